"""Errors that tell the user what is wrong and what to do."""
from __future__ import annotations

import difflib
from typing import Sequence


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


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
