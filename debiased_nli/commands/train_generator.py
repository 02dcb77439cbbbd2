"""``debiased-nli train-generator``: train the generator G or its debiased fine-tune G*."""
from __future__ import annotations

import argparse
import json

from ._common import (NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, add_task_arguments,
                      check_model_reference, number, task_from_args)

DESCRIPTION = """\
Train a causal LM on `premise, label, hypothesis` sequences (Wu et al. 2022).

  --mode generator  G:  L = MLE + lambda * label-consistency unlikelihood of the hypothesis under a
                        wrong label (lambda = 0.5)
  --mode debias     G*: L = MLE on Z(D0) + alpha * L_UL on Z-(D0) (alpha = 1.0), unlikelihood only on
                        the tokens that carry each rejected row's biased features. The input is
                        z-filtered here (top-k, batch size, seed options) to get Z(D0) and Z-(D0).

Any AutoModelForCausalLM (Hub id or folder); --lora trains a peft LoRA adapter (LLaMA family), else
the full model is trained (GPT-2 family). Runs on CPU or under `accelerate launch` on many GPUs;
checkpoints every --checkpoint-every steps and resumes from the last one when rerun with the same --out.
"""


def register(sub) -> None:
    p = sub.add_parser("train-generator", help="train the generator G (or G* with --mode debias)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--model", default="gpt2-large", help="causal LM: Hub id or folder (default: gpt2-large, the paper's)")
    p.add_argument("--out", required=True, help="output folder (model or adapter, tokenizer, checkpoints, report)")
    p.add_argument("--mode", choices=["generator", "debias"], default="generator")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of the full model")
    p.add_argument("--lora-r", type=POSITIVE_INT, default=8)
    p.add_argument("--lora-alpha", type=POSITIVE_INT, default=16)
    p.add_argument("--lora-dropout", type=number(float, low=0, high=1, high_open=True), default=0.05)
    p.add_argument("--lora-targets", default="all-linear", help="'all-linear' or module names, comma-separated")
    p.add_argument("--merge", action="store_true", help="also save the LoRA adapter merged into the base (out/merged)")
    p.add_argument("--max-steps", type=POSITIVE_INT, help="optimizer steps (default: --epochs over the data)")
    p.add_argument("--epochs", type=POSITIVE_INT, default=1)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8, help="rows per process and step")
    p.add_argument("--grad-accum", type=POSITIVE_INT, default=1)
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=5e-5)
    p.add_argument("--warmup-steps", type=NON_NEGATIVE_INT, default=0)
    p.add_argument("--lam", type=NON_NEGATIVE_FLOAT, default=0.5, help="lambda, weight of the label-consistency term")
    p.add_argument("--alpha", type=NON_NEGATIVE_FLOAT, default=1.0, help="alpha, weight of L_UL on Z-(D0) (--mode debias)")
    p.add_argument("--max-length", type=POSITIVE_INT, default=128, help="tokens per sequence (longer ones are cut)")
    p.add_argument("--top-k", type=POSITIVE_INT, default=20, help="biased features per label for the z-filter (--mode debias)")
    p.add_argument("--z-batch-size", type=POSITIVE_INT, default=1000, help="z-filter batch size (--mode debias)")
    p.add_argument("--checkpoint-every", type=POSITIVE_INT, default=500)
    p.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is visible")
    p.add_argument("--threads", type=POSITIVE_INT, help="torch CPU threads")
    p.add_argument("--log-every", type=POSITIVE_INT, default=10)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..data import load_task
    from ..generation.steps import train_generator_step

    task = task_from_args(args)
    check_model_reference(args.model, "--model")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    ds = load_task(task, args.split, data_files=args.data_files, on_invalid=args.on_invalid,
                   revision=args.revision, max_rows=args.max_rows).dataset
    params = {k: getattr(args, k) for k in ("model", "out", "mode", "lora_r", "lora_alpha", "lora_dropout",
                                            "lora_targets", "merge", "max_steps", "epochs", "batch_size",
                                            "grad_accum", "lr", "warmup_steps", "lam", "alpha", "max_length",
                                            "top_k", "z_batch_size", "checkpoint_every", "seed",
                                            "mixed_precision", "cpu", "log_every")}
    params["lora"] = args.lora
    _, _, report = train_generator_step(ds, task, params)
    print(json.dumps({k: v for k, v in report.items() if k != "history"}, indent=2, default=str))
    return 0
