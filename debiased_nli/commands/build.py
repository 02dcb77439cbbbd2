"""``debiased-nli build``: run a builder recipe end to end into a Hub-layout release folder."""
from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "build", help="build a release (z_filtered, z_aug, par_z, seq_z, ...) from a recipe",
        description="Run a builder recipe (builders/<name>.yaml): load the task's data, compute features once, "
                    "z-filter (Wu et al. 2022, Algorithm 1), compose Z-Aug / Par-Z / Seq-Z when new rows are given, "
                    "run the recipe's filter steps, and write OUT as a Hub dataset repo folder "
                    "(data/<config>/<split>-*.parquet, README.md with configs and the dataset card, manifest.json). "
                    "`datasets.load_dataset(OUT, CONFIG)` opens it; `debiased-nli push OUT --repo-id ORG/NAME` publishes it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("recipe", help="a recipe YAML (see builders/)")
    p.add_argument("--out", required=True, help="the release folder to write (written atomically)")
    p.add_argument("--data-files", nargs="+", metavar="[SPLIT=]PATH",
                   help="local files for D0 (and eval splits) instead of the recipe's source")
    p.add_argument("--new-rows", nargs="+", metavar="PATH",
                   help="files of new rows D_G (generated or perturbed; the task's columns) to compose "
                        "z_aug, par_z and seq_z")
    p.add_argument("--profile", help="apply one of the recipe's profiles (e.g. `paper`: the generation steps of "
                                     "Wu et al. 2022; see the recipe's `profiles`)")
    p.add_argument("--max-rows", type=int, help="use at most this many rows of D0 (quick looks)")
    p.add_argument("--seed", type=int, help="override the recipe's seed")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (atomically)")
    p.add_argument("--timings", action="store_true",
                   help="record each stage's seconds in manifest.json (the release is then no longer the same "
                        "byte for byte from run to run)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..recipe import build

    result = build(args.recipe, args.out, data_files=args.data_files, new_rows_files=args.new_rows,
                   overwrite=args.overwrite, seed=args.seed, progress=not args.quiet, max_rows=args.max_rows,
                   profile=args.profile, timings=args.timings)
    print(f"wrote {result.out_dir}", file=sys.stderr)
    for name, n in result.configs.items():
        print(f"  {name}: {n:,} train rows", file=sys.stderr)
    print(f"open it with: datasets.load_dataset({str(result.out_dir)!r}, {next(iter(result.configs))!r})",
          file=sys.stderr)
    return 0
