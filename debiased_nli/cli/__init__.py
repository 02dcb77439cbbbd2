"""The ``debiased-nli`` command line.

Each sub-command lives in ``debiased_nli/cli/commands/<name>.py`` and defines ``register(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed args; returns an exit code or None).
The options of :func:`add_global_options` (``--quiet``, ``--log-level``, ``-v``) are accepted before
or after the sub-command; they set the level of this package's log and of the libraries it drives
(``datasets``, ``transformers``, ``huggingface_hub``), and ``--quiet`` turns every progress bar off.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import pkgutil
import sys
import warnings
from typing import Iterator

from .. import __version__
from ..utils.errors import DebiasedNLIError

LOG_LEVELS = ("debug", "info", "warning", "error")
# environment switches the libraries read when they are imported (the ones already imported are
# switched through their API in `quiet_libraries`)
_QUIET_ENV = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
              "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
_VERBOSITY_ENV = ("DATASETS_VERBOSITY", "TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY")


def _description() -> str:
    """What this installation implements, read from the registries (so --help never names a method
    before it exists)."""
    import textwrap

    from ..release.recipe import known_steps

    steps = known_steps()
    paragraphs = ("Build debiased versions of NLI and other sentence-pair datasets, publish them as Hugging Face "
                  "Hub dataset repos, and score models on challenge sets.",
                  "Every build computes z-statistics (Gardner et al. 2021) and z-filters (Wu et al. 2022), composing "
                  "Z-Aug / Par-Z / Seq-Z when new rows are given. Recipe steps in this installation: "
                  f"new rows: {', '.join(steps['source'])}; extra configs: {', '.join(steps['filter']) or 'none'}.")
    return "\n\n".join(textwrap.fill(p, 100) for p in paragraphs)


def add_global_options(p: argparse.ArgumentParser, *, suppress_defaults: bool = False) -> None:
    """``--quiet``, ``--log-level`` and ``-v``. On a sub-command's parser the defaults are suppressed, so
    that an option given before the sub-command is not reset by the sub-parser."""
    default = (lambda value: argparse.SUPPRESS) if suppress_defaults else (lambda value: value)
    g = p.add_argument_group("logging")
    g.add_argument("-q", "--quiet", action="store_true", default=default(False),
                   help="no progress bars (ours, datasets', transformers', huggingface_hub's) and only errors in "
                        "the log")
    g.add_argument("--log-level", choices=LOG_LEVELS, default=default(None),
                   help="log level of debiased-nli and the libraries it drives (default: warning; info with -v, "
                        "error with --quiet)")
    g.add_argument("-v", "--verbose", action="store_true", default=default(False),
                   help="log more (level info) and show tracebacks")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (``error: debiased-nli build: argument --max-rows: ...``), exit 2.
    Sub-command parsers are made with the same class (argparse uses the parent's type)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="debiased-nli", description=_description(), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `debiased-nli <command> --help` for the options of a command. The logging options may be "
               "given before or after the command.")
    parser.add_argument("--version", action="version", version=f"debiased-nli {__version__}")
    add_global_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    from . import commands
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    for name, sub_parser in sub.choices.items():
        taken = {s for a in sub_parser._actions for s in a.option_strings}
        if not taken & {"-q", "--quiet", "--log-level", "-v", "--verbose"}:
            add_global_options(sub_parser, suppress_defaults=True)
    return parser


def log_level(args: argparse.Namespace) -> int:
    if getattr(args, "log_level", None):
        return getattr(logging, args.log_level.upper())
    if getattr(args, "quiet", False):
        return logging.ERROR
    return logging.INFO if getattr(args, "verbose", False) else logging.WARNING


@contextlib.contextmanager
def quiet_libraries(level: int, progress: bool) -> Iterator[None]:
    """Set the log level of ``datasets``, ``transformers`` and ``huggingface_hub`` (never below warning:
    their info logs are not this tool's) and, with ``progress=False``, turn off every progress bar;
    everything is restored on exit (the CLI also runs inside tests)."""
    lib_level = max(level, logging.WARNING)
    saved_env = {k: os.environ.get(k) for k in list(_QUIET_ENV) + list(_VERBOSITY_ENV)}
    undo = []
    name = logging.getLevelName(lib_level).lower()
    for key in _VERBOSITY_ENV:
        os.environ[key] = name
    for logger_name in ("datasets", "transformers", "huggingface_hub", "evaluate", "accelerate", "peft"):
        logger = logging.getLogger(logger_name)
        undo.append((lambda lg=logger, old=logger.level: lg.setLevel(old)))
        logger.setLevel(lib_level)
    if not progress:
        os.environ.update(_QUIET_ENV)
        if "datasets" in sys.modules:
            import datasets
            was = datasets.is_progress_bar_enabled()
            datasets.disable_progress_bars()
            undo.append(lambda: datasets.enable_progress_bars() if was else None)
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
            was_off = are_progress_bars_disabled()
            disable_progress_bars()
            undo.append(lambda: None if was_off else enable_progress_bars())
        if "transformers" in sys.modules:
            from transformers.utils import logging as tf_logging
            was_on = tf_logging.is_progress_bar_enabled()
            tf_logging.disable_progress_bar()
            undo.append(lambda: tf_logging.enable_progress_bar() if was_on else None)
        # every bar is a tqdm, including ours (which pass `disable=not progress` explicitly, so the
        # TQDM_DISABLE environment default would not reach them): force disable for this command
        import tqdm.std
        original = tqdm.std.tqdm.__init__

        def silent_init(self, *a, **k):
            k["disable"] = True
            original(self, *a, **k)

        tqdm.std.tqdm.__init__ = silent_init
        undo.append(lambda: setattr(tqdm.std.tqdm, "__init__", original))
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _module_of(filename: str) -> str:
    """The dotted name of the loaded module whose file is ``filename`` ("py.warnings" when none is)."""
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == filename:
            return name
    return "py.warnings"


@contextlib.contextmanager
def warnings_as_log_lines() -> Iterator[None]:
    """Show ``warnings.warn`` as log lines (``WARNING debiased_nli.recipe: z-filtering 'snli': batch_size
    ...``) through the logger of the module that raised it, instead of Python's default
    ``recipe.py:489: UserWarning: ...`` followed by the source line. The warnings filters still decide which
    warnings are shown (each once per place by default); the log level decides whether they are printed
    (``--quiet`` hides them). Restored on exit (the CLI also runs inside tests)."""
    original = warnings.showwarning
    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message) if category is UserWarning else f"{category.__name__}: {message}"
        logging.getLogger(_module_of(filename)).warning("%s", text)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


def describe_error(err: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an error that ends a command.

    The project's errors and the operating system's (no space, read-only, permission) are the user's
    to fix: exit 2. Anything else is unexpected: exit 1, with its type, and the traceback behind -v."""
    if isinstance(err, DebiasedNLIError):
        code, text = 2, str(err)
    elif isinstance(err, OSError):
        from ..utils.outputs import os_reason
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
    level = log_level(args)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # the library's log level is this command's only: restored on return, so that main() called from Python (a
    # notebook, a test) leaves a later call's warnings as they were (a --quiet run used to hide them for good)
    own_log = logging.getLogger("debiased_nli")
    was_level = own_log.level
    own_log.setLevel(level)
    try:
        from ..utils.environment import check_environment

        check_environment()  # a wrong DEBIASED_NLI_* setting stops the command before any work
        with quiet_libraries(level, progress=not args.quiet), warnings_as_log_lines():
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
    finally:
        own_log.setLevel(was_level)

