"""The ``debiased-nli`` command line.

Each sub-command lives in ``debiased_nli/commands/<name>.py`` and defines ``register(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed args; returns an exit code or None).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys

from . import __version__
from .errors import DebiasedNLIError


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (``error: debiased-nli build: argument --max-rows: ...``), exit 2.
    Sub-command parsers are made with the same class (argparse uses the parent's type)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="debiased-nli",
        description="Build debiased versions of NLU datasets (z-filtering, Z-Aug / Par-Z / Seq-Z, PDD, "
                    "AFLite, IBADR), publish them as Hugging Face Hub dataset repos, and score models "
                    "on challenge sets.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `debiased-nli <command> --help` for the options of a command.")
    parser.add_argument("--version", action="version", version=f"debiased-nli {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (and show tracebacks)")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    from . import commands
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    return parser


def describe_error(err: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an error that ends a command.

    The project's errors and the operating system's (no space, read-only, permission) are the user's
    to fix: exit 2. Anything else is unexpected: exit 1, with its type, and the traceback behind -v."""
    if isinstance(err, DebiasedNLIError):
        code, text = 2, str(err)
    elif isinstance(err, OSError):
        from .outputs import os_reason
        code, text = 2, (f"{err.filename}: " if err.filename else "") + os_reason(err)
    elif isinstance(err, MemoryError):
        code, text = 2, "out of memory; try --max-rows, a smaller --batch-size, or a machine with more memory"
    else:
        code, text = 1, (f"unexpected {type(err).__name__}: {err} (rerun with -v for the traceback, and "
                         f"please report it)")
    return code, " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a bad argument (one line, exit 2)
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 2)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if getattr(args, "verbose", False) or os.environ.get("DEBIASED_NLI_TRACEBACK"):
            raise
        code, message = describe_error(err)
        print(f"error: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
