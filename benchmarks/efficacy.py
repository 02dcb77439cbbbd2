"""The efficacy table (issue 14): does training on a debiased release make a model more robust?

A thin plan over ``debiased-nli compare`` (:mod:`debiased_nli.evaluation.compare`): the rows of
``benchmarks/efficacy.yaml`` (every release config and method of this project, and random controls of their
size) train the same model and are scored on every challenge set in full; each (row, seed) is one unit whose
result file (and, for units run since issue 34, predictions file) lands in ``benchmarks/results/efficacy/``.
Relative paths in the plan are relative to the repository root. This script adds the project's defaults (the
plan, the results of ``EFFICACY_RUNS``, the report's title). (``speed``, which chose the plan's batch:
``git show b65411f:benchmarks/efficacy.py``.)

    python benchmarks/efficacy.py status
    nohup python benchmarks/efficacy.py run --lock /tmp/debiased-heavy.lock > efficacy.log 2>&1 &
    python benchmarks/efficacy.py run --rows original --seeds 0          # one unit
    python benchmarks/efficacy.py run --workers 4                        # four processes sharing the machine
    python benchmarks/efficacy.py report

``debiased-nli compare status|run|report PLAN`` does the same for any plan (paths relative to the plan's folder).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/efficacy.py` from a checkout
    sys.path.insert(0, str(ROOT))

from debiased_nli.evaluation.compare import plan as _plan_module  # noqa: E402
from debiased_nli.evaluation.compare import report as _report_module  # noqa: E402
from debiased_nli.evaluation.compare import units as _units  # noqa: E402
from debiased_nli.evaluation.compare.locking import LockTurns, claim, heavy_lock, log  # noqa: E402,F401
from debiased_nli.evaluation.compare.plan import Plan, write_json_atomic  # noqa: E402,F401
from debiased_nli.evaluation.compare.report import (SHARE_SETS, build_of as _build_of, same_rows as _same_rows,  # noqa: E402,F401
                                                 verdict_paragraph)
from debiased_nli.evaluation.compare.rows import (NotBuilt, Pending, RowData, build_command, per_unit_subset,  # noqa: E402,F401
                                               poe_settings, resolve_row)
from debiased_nli.evaluation.compare.stats import seeds_only as compare  # noqa: E402,F401
from debiased_nli.evaluation.compare.units import (SCHEMA, TRAIN_RECORD, device_name, eval_config, evaluate_unit,  # noqa: E402,F401
                                                load_units, train_cli, train_config, train_unit, unit_order,
                                                unit_states)

DEFAULT_PLAN = Path(__file__).resolve().with_suffix(".yaml")
TITLE = "The efficacy table: every method, one model, every challenge set"
TIMES_NOTE = "Times are wall-clock on a 2-core machine shared with other work (CPU seconds beside them)"


def _path(value: "str | os.PathLike", base: Path = ROOT) -> Path:
    p = Path(os.path.expanduser(str(value)))
    return p if p.is_absolute() else (base / p).resolve()


def show(p: "str | os.PathLike") -> str:
    """A path as the commands in this project write it: relative to the repository, or ``../shared/...``."""
    p = Path(p)
    for base, prefix in ((ROOT, ""), ((ROOT.parent / "shared").resolve(), "../shared/")):
        try:
            return prefix + str(p.relative_to(base))
        except ValueError:
            continue
    return str(p)


def load_plan(path: "str | os.PathLike" = DEFAULT_PLAN, *, runs_dir: str | None = None,
              results_dir: str | None = None) -> Plan:
    """A plan of this project: paths relative to the repository root; the runs folder from ``--runs-dir``,
    ``$EFFICACY_RUNS`` or the plan."""
    return _plan_module.load_plan(path, base=ROOT, runs_dir=runs_dir or os.environ.get("EFFICACY_RUNS"),
                                  results_dir=results_dir)


def release_dir(plan: Plan, name: str) -> Path:
    return plan.release_dir(name)


def run(plan: Plan, *args, **kwargs) -> list[dict]:
    return _units.run(plan, *args, **kwargs)


def _commands(plan: Plan) -> list[str]:
    plan_arg = "" if plan.path.resolve() == DEFAULT_PLAN.resolve() else f" --plan {show(plan.path)}"
    return [f"python benchmarks/efficacy.py status{plan_arg}",
            f"nohup python benchmarks/efficacy.py run{plan_arg} --lock /tmp/debiased-heavy.lock > efficacy.log 2>&1 &",
            f"python benchmarks/efficacy.py report{plan_arg}"]


def write_markdown(table: dict, plan: Plan, path: Path, figure: str | None) -> None:
    _report_module.write_markdown(table, plan, path, figure, title=TITLE, commands=_commands(plan),
                                  share_sets=SHARE_SETS, times_note=TIMES_NOTE)


def summarise(plan: Plan, **options) -> dict:
    return _report_module.summarise(plan, share_sets=SHARE_SETS, replicates_of=load_plan, **options)


def report(plan: Plan, out_stem: Path | None = None) -> dict:
    """``efficacy.md`` / ``.json`` / ``.png`` beside the results folder (``compare report`` with this project's
    title and commands)."""
    return _report_module.report(plan, out_stem, replicates_of=load_plan, title=TITLE, commands=_commands(plan),
                                 share_sets=SHARE_SETS, times_note=TIMES_NOTE)


# ------------------------------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["status", "run", "report"])
    ap.add_argument("--plan", default=str(DEFAULT_PLAN), help="the rows YAML (default benchmarks/efficacy.yaml)")
    ap.add_argument("--rows", nargs="+", help="only these rows, in this order")
    ap.add_argument("--seeds", nargs="+", type=int, help="only these seeds")
    ap.add_argument("--lock", help="take this flock for each stage (build, train, evaluate): /tmp/debiased-heavy.lock")
    ap.add_argument("--runs-dir", help="models and built releases (default: the plan's runs_dir or $EFFICACY_RUNS)")
    ap.add_argument("--results-dir", help="result files (default: the plan's results_dir)")
    ap.add_argument("--stop-after", type=int, help="stop after this many finished units")
    ap.add_argument("--no-report", action="store_true", help="`run`: do not rewrite the report at the end")
    ap.add_argument("--workers", type=int, default=1, help="`run`: processes sharing this machine (GPU or CPU), each "
                                                          "taking the next unit no other has claimed")
    ap.add_argument("--claims", help="`run`: a folder shared by several run processes; each takes the next unit no "
                                     "other has claimed (parallel workers on one GPU or several)")
    ap.add_argument("--seed-major", action="store_true",
                    help="`run`: every row's seed 0 first, then seed 1, ... (a run stopped early has whole seeds)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    a = ap.parse_args(argv)
    plan = load_plan(a.plan, runs_dir=a.runs_dir, results_dir=a.results_dir)
    if a.command == "status":
        for s in unit_states(plan, a.rows, a.seeds):
            print(f"{s['row']:16s} seed {s['seed']}  {s['state']:8s} {s['reason'] or ''}")
        return 0
    if a.command == "run":
        if a.workers > 1 and not a.claims:
            cmd = [sys.executable, str(Path(__file__).resolve()), "run", "--plan", str(Path(a.plan).resolve()),
                   "--no-report", "--quiet"]
            for opt in ("runs_dir", "results_dir", "lock"):
                if getattr(a, opt):
                    cmd += [f"--{opt.replace('_', '-')}", str(getattr(a, opt))]
            cmd += (["--rows", *a.rows] if a.rows else []) + (["--seeds", *map(str, a.seeds)] if a.seeds else [])
            cmd += ["--seed-major"] if a.seed_major else []
            claims = plan.runs_dir / "claims" / time.strftime("%Y%m%d-%H%M%S")
            if _units.run_workers(cmd, a.workers, claims, plan.runs_dir / "logs", env=dict(os.environ)):
                return 1
        else:
            run(plan, a.rows, a.seeds, a.lock, progress=not a.quiet, stop_after=a.stop_after, claims=a.claims,
                seed_major=a.seed_major)
        if a.no_report or a.claims:
            return 0
    table = report(plan)
    done = sum(len(e["seeds_done"]) for e in table["rows"].values())
    print(f"report: {done} finished units; pending rows: "
          + ", ".join(n for n, e in table["rows"].items() if e["pending_reason"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
