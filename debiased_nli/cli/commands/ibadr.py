"""``debiased-nli ibadr``: iterative bias-aware dataset refinement (Wang et al. 2023)."""
from __future__ import annotations

import argparse
import json
import time

from ...methods.ibadr.params import PARAMS
from ._common import (
    POSITIVE_FLOAT,
    POSITIVE_INT,
    add_param_options,
    add_run_arguments,
    add_task_arguments,
    command_outputs,
    number,
    params_from_args,
    run_method,
)

DESCRIPTION = """\
IBADR (Wang et al. 2023). The pool S starts as the task's rows D0. Each iteration:
  1. a shallow model theta_s (trained on --shallow-rows random rows) scores every row's bias degree
     beta = p(gold label | row); rows are sorted by beta into --n-bi equal groups b1 (least biased) .. bN;
  2. the generator learns p(premise, hypothesis | b, label) on S (--gen-epochs-first, then --gen-epochs-later,
     continuing the same weights; --lora trains a LoRA adapter);
  3. it samples --samples-per-iter rows with b drawn from the lower half of the indicators and a uniform label;
  4. rows the confidence model gives p(label) > --epsilon join S; theta_s is re-trained on a fresh sample of S (USM).

Every iteration is a folder OUT/iter-K (scores, shallow model, generator, samples, kept and rejected rows,
report, a completion marker): rerunning the same command resumes. Under `accelerate launch` the generator's
training and sampling are shared between the processes. Writes OUT/pool.parquet (S), OUT/generated.parquet
(the pseudo samples), OUT/rejected.parquet, OUT/ibadr.json and OUT/ibadr.md.

Defaults are the paper's (section 3.1): 2K shallow rows (0.5K for FEVER), 3 epochs at 5e-5; generator lr 5e-5,
3 then 1 epochs; 200K samples per iteration; 5 iterations; N_bi 5. epsilon is not given: 0.95 is Wu et al.'s.

Ablations (Table 5): --no-update-shallow (w/o USM), --indicator lowest (b_r => b1), --indicator none
(w/o bias indicator), --no-iterate (w/o iterative generation).
"""


def register(sub) -> None:
    p = sub.add_parser("ibadr", help="IBADR: iterative bias-aware dataset refinement with a generator",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--out", required=True, help="run folder (one resumable folder per iteration)")
    # the options come from the declaration (methods/ibadr/params.py), but for the LoRA switch and its settings
    add_param_options(p, PARAMS, skip=("generator", "confidence_model"))
    p.add_argument("--generator", default=PARAMS["generator"].paper, help=PARAMS["generator"].help +
                   f" (default {PARAMS['generator'].paper}, the paper's)")
    p.add_argument("--confidence-model", required=True, help=PARAMS["confidence_model"].help)
    lora = p.add_argument_group("LoRA (peft) for the generator")
    lora.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of the full model")
    lora.add_argument("--lora-r", type=POSITIVE_INT, default=8)
    lora.add_argument("--lora-alpha", type=POSITIVE_INT, default=16)
    lora.add_argument("--lora-dropout", type=number(float, low=0, high=1, high_open=True), default=0.05)
    lora.add_argument("--lora-targets", default="all-linear")
    add_run_arguments(p, seed=False)
    p.add_argument("--time-budget", type=POSITIVE_FLOAT, metavar="SECONDS",
                   help="stop between units of work after this long (resume by rerunning); single process only")
    p.set_defaults(func=run)


def run(args) -> int:
    from ...methods.ibadr.loop import run_ibadr
    from ...methods.ibadr.step import config_from_params, render_ibadr_md

    lora = None
    if args.lora:
        lora = {"r": args.lora_r, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
                "target_modules": args.lora_targets}
    params = {**params_from_args(args, PARAMS), "generator": args.generator, "confidence_model": args.confidence_model,
              "lora": lora}

    # before any work: the folder is new, empty or this command's run (its iterations resume)
    outputs = command_outputs(args.out, "ibadr", ("ibadr.json", "pool.parquet", "generated.parquet", "rejected.parquet",
                                                  "ibadr.md"), legacy=("iter-1/", "ibadr.json"))

    def step(d0, task):
        cfg = config_from_params(task, params)
        deadline = time.time() + args.time_budget if args.time_budget else None
        return run_ibadr(d0, task, cfg, args.out, deadline=deadline, gen_chunk_steps=args.gen_chunk_steps or 20)

    def write(res, loaded, manifest) -> int:  # IBADR's report has no manifest: it records its own run
        from accelerate import PartialState
        if not PartialState().is_main_process:
            return 0
        out = outputs.paths[0].parent
        with outputs:  # each file under a temporary name, renamed into place once all are written
            outputs.write_text(out / "ibadr.json", json.dumps(res.report, indent=2, default=str))
            if res.complete:
                res.pool.to_parquet(str(outputs.temp(out / "pool.parquet")))
                if res.generated is not None:
                    res.generated.to_parquet(str(outputs.temp(out / "generated.parquet")))
                if res.rejected is not None:
                    res.rejected.to_parquet(str(outputs.temp(out / "rejected.parquet")))
                outputs.write_text(out / "ibadr.md", render_ibadr_md(res.report))
        if not res.complete:
            print(f"IBADR paused after {res.report['iterations_complete']} complete iteration(s); rerun the same "
                  f"command to continue")
            return 3
        print(json.dumps({k: v for k, v in res.report.items() if k != "iterations"}, indent=2, default=str))
        return 0

    return run_method(args, step, write)
