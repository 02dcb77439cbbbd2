"""Options shared by several sub-commands."""
from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..tasks import TaskSpec, get_task


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
    p.add_argument("--max-rows", type=int, help="read at most this many rows (for quick looks)")


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
