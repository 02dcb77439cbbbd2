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


# every setting this tool reads from the environment: (name, kind), kind "path" (not empty when set) or
# (type, low, high, low_open) for a number; `check_environment` checks them all before a command starts
SETTINGS = (
    ("DEBIASED_NLI_CACHE", "path"),
    ("DEBIASED_NLI_DATA_ROOT", "path"),
    ("DEBIASED_NLI_TEMPLATES", "path"),
    ("DEBIASED_NLI_EVALUATION", "path"),
    ("DEBIASED_NLI_BUILDERS", "path"),
    ("DEBIASED_NLI_CACHE_MAX_MB", (float, 0, 2 ** 40, False)),
    ("DEBIASED_NLI_HUB_TIMEOUT", (float, 0, 7 * 86400, True)),   # at most a week: longer is no deadline at all,
    ("DEBIASED_NLI_HUB_DEADLINE", (float, 0, 7 * 86400, True)),  # and beyond what a thread's wait accepts
    ("WORLD_SIZE", (int, 1, 1 << 20, False)),
    ("RANK", (int, 0, 1 << 20, False)),
)


def setting(name: str, default):
    """``$name`` checked by its rule in :data:`SETTINGS` (a path, or a number in its range), or ``default``
    when it is unset."""
    kind = dict(SETTINGS)[name]
    if kind == "path":
        return env_path(name, default)
    typ, low, high, low_open = kind
    return env_number(name, default, kind=typ, low=low, high=high, low_open=low_open)


def check_environment() -> None:
    """Check every setting of :data:`SETTINGS` that is set: a command refuses a wrong one with one line before
    it does any work (not when it reaches the part that reads it, after writing its output)."""
    for name, _ in SETTINGS:
        if name in os.environ:
            setting(name, None)
