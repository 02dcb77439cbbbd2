"""``debiased-nli train-generator``: train the generator G or its debiased fine-tune G*."""
from __future__ import annotations

import argparse
import json

from ._common import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
    add_task_arguments,
    number,
    run_folder,
    task_from_args,
)
from ...utils.paths import check_model_reference

DESCRIPTION = """\
Train a causal LM on `premise, label, hypothesis` sequences (Wu et al. 2022).

  --mode generator  G:  L = MLE + lambda * label-consistency unlikelihood of the hypothesis under a
                        wrong label (lambda = 0.5)
  --mode debias     G*: L = MLE on Z(D0) + alpha * L_UL on Z-(D0) (alpha = 1.0), unlikelihood only on
                        the tokens that carry each rejected row's biased features. The input is
                        z-filtered here (top-k, batch size, seed options) to get Z(D0) and Z-(D0).

Any AutoModelForCausalLM (Hub id or folder); --lora trains a peft LoRA adapter (LLaMA family), else
the full model is trained (GPT-2 family). Runs on CPU or under `accelerate launch` on many GPUs;
checkpoints (accelerator.save_state: optimizer, scheduler, GradScaler, every process's RNG) every
--checkpoint-every steps and resumes from the last one when rerun with the same --out.

Defaults are Table 7 of Wu et al. (2022), "Hyperparameters for training the generator G*": learning
rate 1e-5, batch size 24, 5 epochs, Adam eps 1e-6, betas (0.9, 0.999), constant schedule, max sequence
length 128, GPT-2 large, lambda 0.5, alpha 1.0. The values used, and where each comes from (the
paper's table or the project's choice), are printed before training. Mixed precision is left to
accelerate (`accelerate launch --mixed_precision bf16`, `accelerate config`) unless
--mixed-precision is given.
"""


def register(sub) -> None:
    p = sub.add_parser("train-generator", help="train the generator G (or G* with --mode debias)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--model", help="causal LM: Hub id or folder (default: gpt2-large, Table 7)")
    p.add_argument("--out", required=True, help="output folder (model or adapter, tokenizer, checkpoints, report)")
    p.add_argument("--mode", choices=["generator", "debias"], default="generator")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of the full model")
    p.add_argument("--lora-r", type=POSITIVE_INT, default=8)
    p.add_argument("--lora-alpha", type=POSITIVE_INT, default=16)
    p.add_argument("--lora-dropout", type=number(float, low=0, high=1, high_open=True), default=0.05)
    p.add_argument("--lora-targets", default="all-linear", help="'all-linear' or module names, comma-separated")
    p.add_argument("--merge", action="store_true", help="also save the LoRA adapter merged into the base (out/merged)")
    p.add_argument("--max-steps", type=POSITIVE_INT, help="optimizer steps (default: --epochs over the data)")
    p.add_argument("--epochs", type=POSITIVE_INT, help="epochs (default 5, Table 7)")
    p.add_argument("--batch-size", type=POSITIVE_INT, help="rows per process and micro-batch (default 24, Table 7)")
    p.add_argument("--grad-accum", type=POSITIVE_INT, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--lr", type=POSITIVE_FLOAT, help="learning rate (default 1e-5, Table 7)")
    p.add_argument("--eps", type=POSITIVE_FLOAT, help="Adam epsilon (default 1e-6, Table 7)")
    p.add_argument("--betas", type=_betas, help="Adam betas as B1,B2 (default 0.9,0.999, Table 7)")
    p.add_argument("--weight-decay", type=NON_NEGATIVE_FLOAT, help="AdamW weight decay (default 0: Adam, Table 7)")
    p.add_argument("--scheduler", choices=["constant", "constant_with_warmup", "linear", "cosine"],
                   help="learning-rate schedule (default constant, Table 7)")
    p.add_argument("--warmup-steps", type=NON_NEGATIVE_INT, help="warm-up steps (default 0; needs a *_with_warmup, linear "
                                                    "or cosine schedule)")
    p.add_argument("--lam", type=NON_NEGATIVE_FLOAT, help="lambda, weight of the label-consistency term (default 0.5, Table 7)")
    p.add_argument("--alpha", type=NON_NEGATIVE_FLOAT, help="alpha, weight of L_UL on Z-(D0), --mode debias (default 1.0, Table 7)")
    p.add_argument("--max-length", type=POSITIVE_INT, help="tokens per sequence, longer ones are cut (default 128, Table 7)")
    p.add_argument("--top-k", type=POSITIVE_INT, help="biased features per label for the z-filter, --mode debias (default 20)")
    p.add_argument("--z-batch-size", type=POSITIVE_INT, help="z-filter batch size, --mode debias (default 1000)")
    p.add_argument("--checkpoint-every", type=POSITIVE_INT, help="optimizer steps between checkpoints (default 500)")
    p.add_argument("--group-by-length", action="store_true", default=None,
                   help="batch rows of similar length together (less padding computed: about 0.57x the time "
                        "per step on SNLI, batch 24); the rows per epoch are the same, their batches differ")
    p.add_argument("--seed", type=SEED, help="default 0")
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"],
                   help="override accelerate's setting (default: what `accelerate launch`/`accelerate config` say)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is visible")
    p.add_argument("--threads", type=POSITIVE_INT, help="torch CPU threads")
    p.add_argument("--log-every", type=POSITIVE_INT, default=10)
    p.set_defaults(func=run)


def _betas(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--betas takes two numbers as B1,B2 (e.g. 0.9,0.999), not {text!r}")
    return b1, b2


def run(args) -> int:
    from accelerate import PartialState

    from ...data.loading import load_task
    from ...methods.generation.step import train_generator_step

    task = task_from_args(args)
    # a LoRA adapter folder (adapter_config.json) continues that adapter: G* is fine-tuned from a LoRA G
    check_model_reference(args.model, "--model", files=("config.json", "adapter_config.json"))
    run_folder(args.out, "train-generator", ("train_report.json", "checkpoints/"))  # never a folder of the user's
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    ds = load_task(task, args.split, data_files=args.data_files, on_invalid=args.on_invalid,
                   revision=args.revision, max_rows=args.max_rows).dataset
    params = {k: getattr(args, k) for k in ("model", "out", "mode", "lora_r", "lora_alpha", "lora_dropout",
                                            "lora_targets", "merge", "max_steps", "epochs", "batch_size",
                                            "grad_accum", "lr", "eps", "betas", "weight_decay", "scheduler",
                                            "warmup_steps", "lam", "alpha", "max_length", "top_k", "z_batch_size",
                                            "checkpoint_every", "seed", "mixed_precision", "cpu", "log_every",
                                            "group_by_length")}
    params["lora"] = args.lora
    _, _, report = train_generator_step(ds, task, params, show_values=True)
    if PartialState(cpu=args.cpu).is_main_process:  # one report, not one per process
        print(json.dumps({k: v for k, v in report.items() if k not in ("history", "value_sources")}, indent=2,
                         default=str))
    return 0
