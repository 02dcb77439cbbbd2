"""Errors that tell the user what is wrong and what to do."""
from __future__ import annotations

import difflib
import reprlib
from typing import Any, Sequence


class DebiasedNLIError(Exception):
    """Base class: the CLI prints these without a traceback."""


class ConfigError(DebiasedNLIError, ValueError):
    """A task, recipe, config or option that does not exist or does not fit."""


class InvalidInputError(DebiasedNLIError, ValueError):
    """A row of the input that cannot be used; names the file, row, column and value."""

    def __init__(self, message: str, *, file: str | None = None, row: int | None = None,
                 column: str | None = None, value: object = None, reason: str | None = None):
        super().__init__(message)
        self.file, self.row, self.column, self.value, self.reason = file, row, column, value, reason


class EmptyResultError(DebiasedNLIError, RuntimeError):
    """A stage that would leave no rows at all."""


def excerpt(value: Any, limit: int = 100) -> str:
    """A short ``repr`` of a value for an error message: the start of long strings and of big or deep
    lists and mappings, never the whole value (one built from YAML aliases may be gigabytes long)."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 2, limit // 2, limit // 2, limit // 2
    r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = r.maxdict = 4
    try:
        text = r.repr(value)
    except Exception:  # an int too long to print, a repr that fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    if not isinstance(name, str) or len(name) > 200:  # nothing long is "close" to a short name
        return ""
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
