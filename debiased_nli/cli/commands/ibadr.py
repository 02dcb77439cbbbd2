"""``debiased-nli ibadr``: iterative bias-aware dataset refinement (Wang et al. 2023)."""
from __future__ import annotations

import argparse
import json
import time

from ._common import (
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    add_run_arguments,
    add_task_arguments,
    command_outputs,
    number,
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
    from ...methods.ibadr import PAPER_DEFAULTS as P

    p = sub.add_parser("ibadr", help="IBADR: iterative bias-aware dataset refinement with a generator",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--out", required=True, help="run folder (one resumable folder per iteration)")
    p.add_argument("--generator", default=P["generator"], help="causal LM to start from (Hub id or folder)")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of the full model")
    p.add_argument("--lora-r", type=POSITIVE_INT, default=8)
    p.add_argument("--lora-alpha", type=POSITIVE_INT, default=16)
    p.add_argument("--lora-dropout", type=number(float, low=0, high=1, high_open=True), default=0.05)
    p.add_argument("--lora-targets", default="all-linear")
    p.add_argument("--confidence-model", required=True, help="the NLI classifier M of the confidence filter")
    p.add_argument("--epsilon", type=number(float, low=0, high=1, high_open=True), default=P["epsilon"], help="keep samples with p_M(label) > epsilon")
    p.add_argument("--shallow-model", default=P["shallow_model"], help="the shallow model theta_s (a classifier to fine-tune)")
    p.add_argument("--shallow-rows", type=POSITIVE_INT, help="rows theta_s is trained on (default 2000; FEVER 500)")
    p.add_argument("--shallow-epochs", type=POSITIVE_FLOAT, default=P["shallow_epochs"])
    p.add_argument("--shallow-lr", type=POSITIVE_FLOAT, default=P["shallow_lr"])
    p.add_argument("--shallow-batch-size", type=POSITIVE_INT, default=16)
    p.add_argument("--shallow-max-length", type=POSITIVE_INT, default=128)
    p.add_argument("--no-update-shallow", action="store_true", help="ablation: keep the first theta_s (w/o USM)")
    p.add_argument("--usm-rows", type=POSITIVE_INT, default=P["usm_rows"], help="pool rows theta_s is re-trained on (USM)")
    p.add_argument("--usm-continue", action="store_true", help="USM fine-tunes the previous theta_s, not the pretrained model")
    p.add_argument("--n-bi", type=POSITIVE_INT, default=P["n_bi"], help="number of bias indicators N_bi")
    p.add_argument("--n-iter", type=POSITIVE_INT, default=P["n_iter"], help="iterations N_iter")
    p.add_argument("--samples-per-iter", type=POSITIVE_INT, default=P["samples_per_iter"])
    p.add_argument("--indicator", choices=["random_low", "lowest", "none"], default=P["indicator"],
                   help="b-bar: random among b1..b_{N_bi/2} (the paper), always b1, or no indicator at all")
    p.add_argument("--no-iterate", action="store_true",
                   help="ablation: one iteration sampling n-iter x samples-per-iter rows")
    p.add_argument("--gen-lr", type=POSITIVE_FLOAT, default=P["gen_lr"])
    p.add_argument("--gen-epochs-first", type=NON_NEGATIVE_INT, default=P["gen_epochs_first"])
    p.add_argument("--gen-epochs-later", type=NON_NEGATIVE_INT, default=P["gen_epochs_later"])
    p.add_argument("--gen-batch-size", type=POSITIVE_INT, default=8)
    p.add_argument("--gen-grad-accum", type=POSITIVE_INT, default=1)
    p.add_argument("--gen-max-length", type=POSITIVE_INT, default=128)
    p.add_argument("--gen-rows", type=POSITIVE_INT, help="train the generator on this many indicator-stratified pool rows "
                                                "per iteration (default: all of S, the paper)")
    p.add_argument("--checkpoint-every", type=POSITIVE_INT, default=500, help="generator checkpoint interval (steps)")
    p.add_argument("--top-p", type=number(float, low=0, high=1, low_open=True), default=P["top_p"])
    p.add_argument("--temperature", type=POSITIVE_FLOAT, default=1.0)
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=96)
    p.add_argument("--sample-batch-size", type=POSITIVE_INT, default=16)
    p.add_argument("--shard-size", type=POSITIVE_INT, default=1000)
    p.add_argument("--confidence-batch-size", type=POSITIVE_INT, default=64)
    add_run_arguments(p, seed_help="seed of the run's random choices (theta_s's rows, the indicators, the generator's "
                                   "training and sampling; iteration k uses seed + k; default 0)")
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="generator dtype for sampling")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is visible")
    p.add_argument("--time-budget", type=POSITIVE_FLOAT, metavar="SECONDS",
                   help="stop between units of work after this long (resume by rerunning); single process only")
    p.add_argument("--gen-chunk-steps", type=POSITIVE_INT, default=20,
                   help="with --time-budget: generator steps between deadline checks (default 20)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ...methods.ibadr.loop import run_ibadr
    from ...methods.ibadr.step import config_from_params, render_ibadr_md

    lora = None
    if args.lora:
        lora = {"r": args.lora_r, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
                "target_modules": args.lora_targets}
    params = {"generator": args.generator, "confidence_model": args.confidence_model, "shallow_model": args.shallow_model,
              "lora": lora, "n_bi": args.n_bi, "n_iter": args.n_iter, "samples_per_iter": args.samples_per_iter,
              "epsilon": args.epsilon, "shallow_rows": args.shallow_rows, "shallow_epochs": args.shallow_epochs,
              "shallow_lr": args.shallow_lr, "shallow_batch_size": args.shallow_batch_size,
              "shallow_max_length": args.shallow_max_length, "update_shallow": not args.no_update_shallow,
              "usm_rows": args.usm_rows, "usm_continue": args.usm_continue, "indicator": args.indicator,
              "iterate": not args.no_iterate, "gen_lr": args.gen_lr, "gen_epochs_first": args.gen_epochs_first,
              "gen_epochs_later": args.gen_epochs_later, "gen_batch_size": args.gen_batch_size,
              "gen_grad_accum": args.gen_grad_accum, "gen_max_length": args.gen_max_length, "gen_rows": args.gen_rows,
              "gen_checkpoint_every": args.checkpoint_every, "top_p": args.top_p, "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "sample_batch_size": args.sample_batch_size,
              "shard_size": args.shard_size, "confidence_batch_size": args.confidence_batch_size, "seed": args.seed,
              "cpu": args.cpu, "mixed_precision": args.mixed_precision, "dtype": args.dtype}

    # before any work: the folder is new, empty or this command's run (its iterations resume)
    outputs = command_outputs(args.out, "ibadr", ("ibadr.json", "pool.parquet", "generated.parquet", "rejected.parquet",
                                                  "ibadr.md"), legacy=("iter-1/", "ibadr.json"))

    def step(d0, task):
        cfg = config_from_params(task, params)
        deadline = time.time() + args.time_budget if args.time_budget else None
        return run_ibadr(d0, task, cfg, args.out, deadline=deadline, gen_chunk_steps=args.gen_chunk_steps)

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
