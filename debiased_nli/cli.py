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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except DebiasedNLIError as err:
        if args.verbose or os.environ.get("DEBIASED_NLI_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
