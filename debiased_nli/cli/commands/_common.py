"""Options shared by several sub-commands."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from ...data.tasks import TaskSpec, get_task
from ...utils.errors import ConfigError


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except where an option's help already says its default (no
    "(default: train) (default: train)")."""

    def _get_help_string(self, action):
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def number(kind=int, *, low=None, high=None, low_open: bool = False, high_open: bool = False):
    """An argparse ``type`` for a number in a range: ``--batch-size 0`` is refused before any work,
    with a one-line message (``argument --batch-size: must be >= 1, got 0``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if low is not None and (value < low or low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low}, got {text}")
        if high is not None and (value > high or high_open and value == high):
            raise argparse.ArgumentTypeError(f"must be {'<' if high_open else '<='} {high}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


POSITIVE_INT = number(int, low=1)
NON_NEGATIVE_INT = number(int, low=0)
POSITIVE_FLOAT = number(float, low=0, low_open=True)
NON_NEGATIVE_FLOAT = number(float, low=0)
SEED_LIMIT = 2 ** 32  # numpy's legacy RNG (transformers' set_seed) and torch take seeds below it


def SEED(text: str) -> int:  # noqa: N802 - an argparse type, named like the others
    """The argparse ``type`` of every ``--seed``: an integer from 0 to 2**32 - 1, what numpy's and torch's
    generators accept (a larger one would fail deep inside the run, not here, with one line)."""
    value = NON_NEGATIVE_INT(text)
    if value >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be below 2**32, at most {SEED_LIMIT - 1} (the random generators' "
                                         f"seed range), got {text}")
    return value


def add_task_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", help="a registered task (snli, mnli, fever, qqp, demo), a task YAML file, "
                                "or any name together with --columns and --labels")
    p.add_argument("--data-files", nargs="+", metavar="[SPLIT=]PATH",
                   help="local parquet/jsonl/csv files instead of the Hub: PATH (the train split) or "
                        "SPLIT=PATH ...; globs allowed")
    p.add_argument("--split", default="train", help="which split to use (default: train)")
    p.add_argument("--revision", help="Hub revision (tag, branch or commit) of the task's dataset")
    p.add_argument("--columns", metavar="premise=COL,hypothesis=COL,label=COL",
                   help="map source columns onto premise/hypothesis/label (any sentence-pair set)")
    p.add_argument("--labels", metavar="NAME,NAME,...", help="label names in index order (with --columns)")
    p.add_argument("--on-invalid", choices=["error", "set_aside"], default="error",
                   help="bad rows (empty text, unknown or missing gold label, duplicate id): stop with an "
                        "error naming the row (default), or set them aside with their reason")
    p.add_argument("--max-rows", type=POSITIVE_INT, help="read at most this many rows (for quick looks)")


def task_from_args(args: argparse.Namespace) -> TaskSpec:
    if args.columns or args.labels:
        mapping = {}
        for item in (args.columns or "").split(","):
            if item:
                key, sep, col = item.partition("=")
                if not sep or key not in ("premise", "hypothesis", "label"):
                    raise ConfigError(f"--columns expects premise=COL,hypothesis=COL,label=COL, got {item!r}")
                mapping[key] = col
        try:
            base = get_task(args.task)
        except ConfigError:
            base = None
        if base is None and not args.labels:
            raise ConfigError(f"{args.task!r} is not a registered task: give --labels NAME,NAME,... too")
        labels = args.labels.split(",") if args.labels else list(base.labels)
        columns = {**(dict(base.columns) if base else {c: c for c in ("premise", "hypothesis", "label")}), **mapping}
        return TaskSpec(name=args.task if base is None else base.name, labels=tuple(labels), columns=columns,
                        label_values={} if args.labels else dict(base.label_values),
                        unlabeled_values=base.unlabeled_values if base else (),
                        features=base.features if base else TaskSpec.__dataclass_fields__["features"].default,
                        hub=base.hub if base else None)
    return get_task(args.task)


# ------------------------------------------------------------------ the method commands (aflite, pdd, ibadr)

def add_run_arguments(p, *, seed_default: int | None = 0, seed_help: str = "seed of every random choice (default 0)",
                      seed: bool = True) -> None:
    """``--seed`` and ``--threads``, the flags the method commands share, each with one type: a seed is a
    non-negative integer below 2**32 (:data:`SEED`), threads a positive integer. ``p``: a parser or group.
    ``seed=False``: ``--threads`` only (the step's declaration gives ``--seed``, see :func:`add_param_options`)."""
    if seed:
        p.add_argument("--seed", type=SEED, default=seed_default, help=seed_help)
    p.add_argument("--threads", type=POSITIVE_INT, help="torch CPU threads (default: torch's own choice)")


def _param_type(param):
    """The argparse ``type`` of a declared parameter (:class:`~debiased_nli.utils.params.Param`)."""
    if param.parse is not None:
        return param.parse
    if param.kind == "seed":
        return SEED
    if param.kind in ("int", "float"):
        return number(int if param.kind == "int" else float, low=param.low, high=param.high,
                      low_open=param.low_open, high_open=param.high_open)
    return None


def _param_help(param) -> str:
    """The declaration's help, then its default and where that comes from."""
    from ...utils.params import NOT_GIVEN

    text = param.help
    if param.flag is None and param.default is not None:
        text += f" (default {param.default}"
        text += f"; paper {param.quote})" if param.paper is not NOT_GIVEN and param.quote else ")"
    return text.replace("%", "%%")


def add_param_options(p, params, names=None, *, skip=()) -> None:
    """One option per declared parameter of a step (``params``: its :class:`~debiased_nli.utils.params.Params`;
    ``names``: those, in this order; ``skip``: those the command adds itself), generated from the declaration:
    the option name, the type with its range, the choices, the help with the default and the paper's words.
    Every option's default is None (a switch: unset), so :func:`params_from_args` passes on only what the user
    set and the step's report can tell the user's values from the defaults."""
    for name in (names if names is not None else params.names()):
        param = params[name]
        if param.option is None or name in skip:
            continue
        if param.flag is not None:
            p.add_argument(param.option, dest=name, action="store_const", const=param.flag == "on", default=None,
                           help=_param_help(param))
            continue
        kw = {"dest": name, "default": None, "help": _param_help(param)}
        if param.choices:
            kw["choices"] = list(param.choices)
        if _param_type(param) is not None:
            kw["type"] = _param_type(param)
        if param.metavar:
            kw["metavar"] = param.metavar
        if param.nargs:
            kw["nargs"] = param.nargs
        p.add_argument(param.option, **kw)


def params_from_args(args: argparse.Namespace, params, names=None) -> dict:
    """The values of ``params``' options the user set (None: not set)."""
    out = {}
    for name in (names if names is not None else params.names()):
        value = getattr(args, name, None)
        if value is not None and params[name].option is not None:
            out[name] = value
    return out


def run_method(args: argparse.Namespace, step, write, *, task: TaskSpec | None = None) -> int:
    """The flow of a method command: the task (``task``, or from the shared task arguments), torch's CPU
    threads (``--threads``), the rows (:func:`debiased_nli.data.loading.load_task`), ``step(dataset, task)``,
    then ``write(result, loaded, manifest)``, whose return is the exit code; ``manifest`` says where the rows
    came from, how many were read, the step's seconds and the library versions."""
    import time

    from ...data.loading import load_task
    from ...utils.provenance import library_versions

    task = task or task_from_args(args)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    loaded = load_task(task, args.split, data_files=args.data_files, on_invalid=args.on_invalid,
                       revision=args.revision, max_rows=args.max_rows)
    start = time.time()
    result = step(loaded.dataset, task)
    manifest = {"source": loaded.source, "load_counts": loaded.counts, "seconds": round(time.time() - start, 1),
                "versions": library_versions()}
    return write(result, loaded, manifest)


def write_set_aside(loaded, out: "str | Path", outputs=None) -> None:
    """The rows ``--on-invalid set_aside`` set aside, with their reason, as ``out/set_aside.parquet``
    (``outputs``: the command's :class:`~debiased_nli.utils.outputs.OwnFiles`, which then writes it)."""
    if loaded.set_aside is not None and len(loaded.set_aside):
        path = Path(out) / "set_aside.parquet"
        loaded.set_aside.to_parquet(str(outputs.temp(path) if outputs is not None else path))


def run_folder(out: "str | Path", command: str, markers: "tuple[str, ...]") -> Path:
    """``--out`` of a resumable command (generate, train-generator): new, empty, or a run of that command
    (one of ``markers`` there: its run's config or report as a JSON mapping, or a folder it writes); checked
    before any work, so that a folder of the user's is never written into."""
    from ...utils.outputs import check_output_folder, json_of

    def ours(folder: Path) -> bool:
        return any((folder / n).is_dir() if n.endswith("/") else isinstance(json_of(folder / n), dict) for n in markers)

    return check_output_folder(out, what=f"{command} run", is_ours=ours)


def command_outputs(out: "str | Path", command: str, files: "tuple[str, ...]", *, legacy: "tuple[str, ...]" = ()):
    """The files a command writes into ``--out`` (aflite, pdd, ibadr, confidence-filter), checked before any
    work: the folder is new, empty or this command's (one of ``files`` written by this tool, or, from before
    the markers, one of ``legacy``: a report JSON or the folder of a resumable run), and no file there is
    replaced that this tool did not write. Returns the :class:`~debiased_nli.utils.outputs.OwnFiles` (with
    ``set_aside.parquet``)."""
    from ...utils.outputs import OwnFiles, check_output_folder, holds_own_file, json_of

    names = tuple(files) + ("set_aside.parquet",)

    def old_run(folder: Path) -> bool:
        return any((folder / n).is_dir() if n.endswith("/") else isinstance(json_of(folder / n), dict)
                   for n in legacy)

    folder = check_output_folder(out, what=f"{command} output", is_ours=lambda f: holds_own_file(f, names) or old_run(f))
    return OwnFiles([folder / n for n in names], what=f"--out {out}", legacy=lambda p: old_run(folder))
