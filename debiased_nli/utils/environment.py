"""Settings read from the environment, checked like command-line options: a number must be finite and in its
range, a path must not be empty. A wrong value is a one-line :class:`~.errors.ConfigError` naming the variable
and the value (the command exits 2), never a silent default: ``DEBIASED_NLI_CACHE_MAX_MB=lots`` is not 10 GB,
``DEBIASED_NLI_CACHE=`` is not the current folder, ``DEBIASED_NLI_HUB_DEADLINE=inf`` is not "no deadline"."""
from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import ConfigError, excerpt


def env_number(name: str, default: float, *, kind: type = float, low: float | None = None,
               high: float | None = None, low_open: bool = False) -> float:
    """``$name`` as a ``kind`` (int or float) in ``[low, high]`` (``(low, high]`` with ``low_open``), or
    ``default`` when it is unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    text = raw.strip()
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"{name}={excerpt(raw, 40)} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={excerpt(raw, 40)} must be a finite number")
    if low is not None and (value < low or low_open and value == low):
        raise ConfigError(f"{name}={excerpt(raw, 40)} must be {'>' if low_open else '>='} {low:g}")
    if high is not None and value > high:
        raise ConfigError(f"{name}={excerpt(raw, 40)} must be at most {high:g}")
    return value


def env_path(name: str, default: "str | os.PathLike | None") -> Path | None:
    """``$name`` as a path, or ``default`` when it is unset; set to an empty string it is an error (an empty
    path would be the current folder)."""
    raw = os.environ.get(name)
    if raw is None:
        return Path(default) if default is not None else None
    if not raw.strip():
        raise ConfigError(f"{name} is set but empty; unset it or give a folder")
    return Path(raw).expanduser()
