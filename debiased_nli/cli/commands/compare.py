"""`debiased-nli compare`: does training on a release help? status / run / report of a plan."""
from __future__ import annotations

import argparse
import sys

from ._common import NON_NEGATIVE_INT, POSITIVE_INT

_EPILOG = """examples:
  debiased-nli compare status plan.yaml                 # every (row, seed): done, stale, trained, todo or pending (why)
  debiased-nli compare run plan.yaml                    # train and score every unit not done yet; resumable
  debiased-nli compare run plan.yaml --workers 4        # four processes sharing the GPU (or the CPU)
  debiased-nli compare run plan.yaml --rows original z_filtered --seeds 0
  debiased-nli compare report plan.yaml                 # <results_dir>.md / .json / .png (+ _intervals.png) beside the results folder
  debiased-nli compare report plan.yaml --push-to ORG/debiased-snli   # + the evaluation report on the Hub

A plan (YAML) names the rows (release configs, the original data, random controls of a row's size, product of
experts), the model, the training recipe, the seeds, the challenge sets, the epoch selection (select_on: a
held-out part of a set, scored without those rows) and the primary comparisons, named before the run. Each
(row, seed) is one unit: one result file and one predictions file (the predicted label and the gold label's
probability of every row scored). The report gives each declared comparison's difference with a 95% seed-row t
interval (the seeds as the unit of replication, the test rows' variance added; closed form, no Monte Carlo
error); the primary comparisons are Holm-corrected, each shown with the adjusted interval that matches its call.
A unit whose row's training rows changed since it ran is stale: `status` says so, `run` trains it again.
The plan's format:
`python -c "import debiased_nli.evaluation.compare.plan as p; print(p.__doc__)"` or docs/efficacy.md."""


def register(sub: argparse._SubParsersAction) -> None:
    from .. import add_global_options

    p = sub.add_parser("compare", help="does training on a release help? train, score and compare rows of a plan",
                       description="Train one model per row of a plan and seed, score each on challenge sets, keep "
                                   "every row's predictions, and report the differences with seed-row t "
                                   "intervals (status, run, report).",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="<action>")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("plan", help="the plan (YAML)")
    common.add_argument("--runs-dir", help="models and built releases (default: the plan's runs_dir)")
    common.add_argument("--results-dir", help="result and predictions files (default: the plan's results_dir)")
    common.add_argument("--rows", nargs="+", metavar="ROW", help="only these rows, in this order")
    common.add_argument("--seeds", nargs="+", type=NON_NEGATIVE_INT, metavar="SEED", help="only these seeds")
    s = actions.add_parser("status", parents=[common], help="done / stale / trained / todo / pending per (row, seed)",
                           description="Every (row, seed) of the plan: done, stale (its row's training rows changed "
                                       "since it ran: `run` trains it again), trained (scoring left), todo, or pending "
                                       "(its data does not exist yet, with the reason).")
    r = actions.add_parser("run", parents=[common], help="train and score every unit that is not done (resumable)",
                           description="Train and score every (row, seed) that has no result file yet, or a stale "
                                       "one (its old files are moved to <results_dir>/stale/). A stopped run "
                                       "resumes: finished units are skipped, a training continues from its last "
                                       "checkpoint, an evaluation from its cached chunks. Before each unit it logs "
                                       "an estimate of the time left for it and for all. Writes the report at the end.")
    r.add_argument("--workers", type=POSITIVE_INT, default=1,
                   help="processes sharing this machine's GPU (or CPU), each taking the next unit no other has "
                        "claimed (default 1)")
    r.add_argument("--device", choices=["any", "cpu", "cuda"],
                   help="where to train and score (default: the plan's device, else any: a GPU when one is visible)")
    r.add_argument("--lock", metavar="FILE", help="take this flock for each stage (build, train, evaluate), giving it up "
                                                  "between turns, on a machine shared with other heavy work")
    r.add_argument("--seed-major", action="store_true",
                   help="every row's first seed first, then the next seed (a run stopped early has whole seeds)")
    r.add_argument("--stop-after", type=POSITIVE_INT, help="stop after this many finished units")
    r.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    r.add_argument("--claims", help=argparse.SUPPRESS)  # a worker of --workers: the shared claims folder
    rep = actions.add_parser("report", parents=[common], help="markdown, JSON and plot of the finished units",
                             description="Write the report of the finished units: OUT.md, OUT.json (which `debiased-nli "
                                         "build --efficacy` reads) and OUT.png.")
    rep.add_argument("--out", metavar="STEM", help="write STEM.md / .json / .png (default: the results folder's path)")
    rep.add_argument("--push-to", metavar="ORG/NAME",
                     help="also push the evaluation report into this Hub dataset repo (the release), under "
                          "evaluation/: the report, its JSON and plot, and a README whose model-index holds each "
                          "row's model's results with the dataset revision it trained on")
    rep.add_argument("--revision", help="--push-to: the Hub revision of the release the rows trained on (default: "
                                        "the tag whose manifest.json is the one the units read, else none)")
    rep.add_argument("--token", help="Hub token for --push-to (default: the logged-in token)")
    for parser in (s, r, rep):
        add_global_options(parser, suppress_defaults=True)
        parser.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run(args: argparse.Namespace) -> int:
    from ...api import compare

    out = compare(args.plan, args.action, runs_dir=args.runs_dir, results_dir=args.results_dir, rows=args.rows,
                  seeds=args.seeds, out=getattr(args, "out", None), workers=getattr(args, "workers", 1),
                  device=getattr(args, "device", None), lock=getattr(args, "lock", None),
                  seed_major=getattr(args, "seed_major", False), stop_after=getattr(args, "stop_after", None),
                  report=not getattr(args, "no_report", False), push_to=getattr(args, "push_to", None),
                  revision=getattr(args, "revision", None), token=getattr(args, "token", None),
                  claims=getattr(args, "claims", None), progress=not args.quiet)
    if out.states is not None:
        states = out.states
        width = max(len(s["row"]) for s in states) if states else 8
        for st in states:
            print(f"{st['row']:{width}s} seed {st['seed']:<3d} {st['state']:8s} {st['reason'] or ''}".rstrip())
        counts = {k: sum(s["state"] == k for s in states) for k in ("done", "stale", "trained", "todo", "pending")}
        print(", ".join(f"{v} {k}" for k, v in counts.items()))
        return 0
    if out.exit_code:
        print(f"error: a worker failed; see {out.logs}", file=sys.stderr)
        return out.exit_code
    if out.table is None:
        return 0
    table = out.table
    done = sum(len(e["seeds_done"]) for e in table["rows"].values())
    pending = [n for n, e in table["rows"].items() if e["pending_reason"]]
    forest = out.stem.with_name(out.stem.name + "_intervals.png")
    print(f"report: {done} of {out.planned} units finished" + (f"; pending rows: {', '.join(pending)}" if pending else "")
          + f"; wrote {out.stem}.md, .json, .png" + (f", {forest.name}" if forest in out.files else ""))
    if out.pushed:
        print(f"pushed the evaluation report to {args.push_to}: {out.pushed['commit_url']}")
        for line in out.pushed["notes"]:
            print(f"  {line}")
    return 0
