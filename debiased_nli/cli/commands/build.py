"""``debiased-nli build``: run a builder recipe end to end into a Hub-layout release folder."""
from __future__ import annotations

import sys

from ._common import DefaultsHelpFormatter, POSITIVE_INT, SEED


def register(sub) -> None:
    from ...utils.resources import packaged_recipes

    p = sub.add_parser(
        "build", help="build a release (z_filtered, z_aug, par_z, seq_z, ...) from a recipe",
        description="Run a builder recipe (a YAML file, or a packaged recipe by name) end to end: load the task's "
                    "data, compute features once, "
                    "z-filter (Wu et al. 2022, Algorithm 1), compose Z-Aug / Par-Z / Seq-Z when new rows are given, "
                    "run the recipe's filter steps, and write OUT as a Hub dataset repo folder "
                    "(data/<config>/<split>-*.parquet, README.md with configs and the dataset card, manifest.json). "
                    "`datasets.load_dataset(OUT, CONFIG)` opens it; `debiased-nli push OUT --repo-id ORG/NAME` publishes it.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("recipe", help="a recipe YAML file, or the name of a recipe that comes with the package: "
                                  f"{', '.join(packaged_recipes()) or 'none found'} (builders/<name>.yaml)")
    p.add_argument("--out", required=True, help="the release folder to write (written atomically)")
    p.add_argument("--data-files", nargs="+", metavar="[SPLIT=]PATH",
                   help="local files for D0 (and eval splits) instead of the recipe's source")
    p.add_argument("--new-rows", nargs="+", metavar="PATH",
                   help="files of new rows D_G (generated or perturbed; the task's columns) to compose "
                        "z_aug, par_z and seq_z")
    p.add_argument("--profile", help="apply one of the recipe's profiles (e.g. `paper`: the generation steps of "
                                     "Wu et al. 2022; see the recipe's `profiles`)")
    p.add_argument("--max-rows", type=POSITIVE_INT, help="use at most this many rows of D0 (quick looks)")
    p.add_argument("--seed", type=SEED, help="override the recipe's seed")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (atomically)")
    p.add_argument("--efficacy", metavar="FILE",
                   help="an efficacy table, the JSON `debiased-nli compare report` writes (e.g. "
                        "the project's headline table: 5 seeds, seed-row t intervals): the card shows the measured accuracy of a model trained on each config that "
                        "has a row in it, its difference from the original data and its declared comparisons "
                        "(where the table scores several releases, the rows of the one named like OUT)")
    p.add_argument("--replay", metavar="OLD_RELEASE",
                   help="an earlier release folder: reuse the decisions its filter steps recorded (AFLite, PDD, "
                        "IBADR: decisions/<config>/) where the step, its parameters and its input rows are the same, "
                        "so the neural steps give that release's rows exactly on any CPU; a step whose record does "
                        "not fit runs, and the build says why")
    p.add_argument("--quality", nargs="+", metavar="REPORT",
                   help="reports of `debiased-nli quality` (quality.json or its folder) on this release's generated "
                        "rows (the new rows, or one config's generated rows: matched by their rows' fingerprint): "
                        "the card shows their tables and examples, manifest.json records them")
    p.add_argument("--timings", action="store_true",
                   help="record each stage's seconds in manifest.json (the release is then no longer the same "
                        "byte for byte from run to run)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ...api import build
    from ...release.recipe import is_main_rank

    main = is_main_rank()  # under `accelerate launch` / torchrun the other ranks share the work and say nothing
    result = build(args.recipe, args.out, data_files=args.data_files, new_rows=args.new_rows, overwrite=args.overwrite,
                   seed=args.seed, progress=not args.quiet, max_rows=args.max_rows, profile=args.profile,
                   efficacy=args.efficacy, timings=args.timings, replay=args.replay, quality=args.quality)
    if not main:
        return 0
    if result.recipe_path is not None and str(result.recipe_path) != args.recipe:
        print(f"recipe: {result.recipe_path}", file=sys.stderr)
    pruned, size = result.pruned or (0, 0)
    if pruned:  # the feature cache of earlier builds is kept bounded
        print(f"pruned {pruned} old cache entries ({size / 2**20:,.1f} MB); see `debiased-nli cache info`",
              file=sys.stderr)
    print(f"wrote {result.out_dir}", file=sys.stderr)
    if result.set_aside_note:
        print(result.set_aside_note, file=sys.stderr)
    replays = {s["stage"].split(":")[0]: s["replay"] for s in result.manifest.get("stages", []) if "replay" in s}
    for name, n in result.configs.items():
        print(f"  {name}: {n:,} train rows" + (f" ({replays[name]} from {args.replay})" if name in replays else ""),
              file=sys.stderr)
    for split, record in (result.manifest.get("duplicates") or {}).items():
        if record["rows"]:
            from ...data.duplicates import duplicates_line
            print(f"  {duplicates_line(record, f'the {split} split')}", file=sys.stderr)
    print(f"open it with: datasets.load_dataset({str(result.out_dir)!r}, {next(iter(result.configs))!r})",
          file=sys.stderr)
    return 0
