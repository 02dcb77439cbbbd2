"""``debiased-nli pipeline run|status``: a recipe profile's generation pipeline as resumable stages."""
from __future__ import annotations

import argparse
import json

from ._common import POSITIVE_FLOAT, POSITIVE_INT

DESCRIPTION = """\
Run a recipe (or its --profile) with a `generator` step (Wu et al. 2022: train G, fine-tune G*, sample, confidence-filter)
as resumable stages in one run folder, then build the release from the kept rows and audit it:

  train_g       G on D0 (the step's `train`)              train_g_star  G* (`debias`; skipped without one)
  train_m       M on D0 (`train_m`; else confidence.model) sample       sharded sampling (`generate`)
  filter        the confidence filter (`confidence`)       build        the recipe's release, kept rows as new rows
  audit         `debiased-nli audit` of D0 and of every config of the release

Every output goes under --run (the `out` folders the recipe names are not used); each finished stage leaves
RUN/stages/<stage>.json with the command that reruns it, its parameters and the sha256 of its inputs and
outputs. `run` skips what is done and continues what is partial (G's and M's checkpoints, the missing sample
shards); a filter, build or audit whose parameters or inputs changed is stale and runs again, a model or sample
folder made with other values is refused (move it away; more samples of the same run grow it). `status` says,
per stage: done, stale, partial (e.g. 44/182 shards, with an ETA), pending or skipped, and for a stage that
--deadline stopped, its last run's rate (its stderr is in RUN/logs/<stage>.log). One process runs the
stages (to share the sampling over GPUs: `cd RUN && accelerate launch -m debiased_nli.cli generate TASK --generator G
--out samples ...` with the recipe's sampling values, then `run` again).

examples:
  debiased-nli pipeline run seqz --data-files train=../shared/data/snli/train_sample.parquet --run runs/seqz-cpu
                                                # the CPU Seq-Z pipeline (builders/seqz.yaml), G's training to audits
  debiased-nli pipeline status seqz --data-files train=../shared/data/snli/train_sample.parquet --run runs/seqz-cpu
  debiased-nli pipeline run seqz --data-files train=... --run runs/seqz-cpu --units 4
                                                # sample 4 more shards and stop
  debiased-nli pipeline run seqz --profile gpu --data-files train=... --run runs/seqz-gpu   # the GPU kit's values
  debiased-nli pipeline run seqz --profile gpu --data-files train=... --run runs/seqz-gpu --until filter --deadline 500
                                                # at most 500 s, no build or audit (the GPU kit's call)
"""


def _common(p) -> None:
    p.add_argument("recipe", help="a recipe YAML file, or the name of a packaged recipe (builders/<name>.yaml)")
    p.add_argument("--profile", help="the recipe's profile (e.g. `gpu` of seqz, `paper` of snli)")
    p.add_argument("--run", required=True, help="the run folder: every stage's output and done-record goes there")
    p.add_argument("--data-files", nargs="+", metavar="[SPLIT=]PATH", help="D0's files instead of the recipe's source")
    p.add_argument("--samples-from", metavar="DIR",
                   help="finished shards of the same sampling run (e.g. committed ones): copied into RUN/samples "
                        "where it lacks them, so the run continues from there")
    p.add_argument("--probabilities-from", metavar="FILE",
                   help="M's stored probabilities (uid, m_prob_<label>; `confidence-filter --probabilities`): the "
                        "filter thresholds them and needs no M")


def register(sub) -> None:
    from ...pipeline import STAGES

    p = sub.add_parser("pipeline", help="run a recipe's generation pipeline as resumable stages, with a status",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", required=True, metavar="{run,status}")
    r = actions.add_parser("run", help="run the stages that are not done (or --stages)",
                           description="Run the stages that are not done, in order; a stage that ends unfinished "
                                       "(--units) ends the run there.")
    _common(r)
    r.add_argument("--stages", nargs="+", choices=STAGES, metavar="STAGE",
                   help=f"run only these stages, whatever their state ({', '.join(STAGES)})")
    r.add_argument("--units", type=POSITIVE_INT, help="sample at most this many more shards, then stop")
    r.add_argument("--until", choices=STAGES, metavar="STAGE",
                   help="the last stage to run; the later ones are left to another run (e.g. `--until filter` on a "
                        "GPU machine, then build and audit here)")
    r.add_argument("--deadline", type=POSITIVE_FLOAT, metavar="SECONDS",
                   help="stop the stage in progress after this many seconds (each stage then runs in a process of "
                        "its own): what it finished stays (checkpoints, whole shards) and the next run continues it")
    r.set_defaults(func=run)
    s = actions.add_parser("status", help="each stage: done, stale, partial, pending or skipped")
    _common(s)
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.set_defaults(func=status)


def _pipeline(args):
    from ...pipeline import Pipeline

    return Pipeline(args.recipe, args.run, profile=args.profile, data_files=args.data_files,
                    samples_from=args.samples_from, probabilities_from=args.probabilities_from,
                    progress=not getattr(args, "quiet", False))


def _print(states) -> None:
    for st in states:
        print(f"  {st.stage:13s} {st.state:8s} {st.detail}")


def run(args) -> int:
    pipe = _pipeline(args)
    states = pipe.run(args.stages, units=args.units, until=args.until, deadline=args.deadline)
    print(f"{pipe.run_dir}:")
    _print(states)
    return 0


def status(args) -> int:
    pipe = _pipeline(args)
    states = pipe.status()
    if args.json:
        print(json.dumps([s.to_dict() for s in states], indent=2))
        return 0
    print(f"{pipe.run_dir} ({pipe.command()}):")
    _print(states)
    return 0
