"""`debiased-nli train`: fine-tune a sentence-pair classifier on a task, files or a release config."""
from __future__ import annotations

import argparse
import json

from ._common import (NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, add_task_arguments,
                      check_model_reference, check_release_reference, number, task_from_args)

_EPILOG = """examples:
  debiased-nli train snli --data-files train=../shared/data/snli/train_sample.parquet \\
      validation=../shared/data/snli/dev.parquet --model sentence-transformers/all-MiniLM-L6-v2 --out runs/base
  debiased-nli train snli --release out/snli-release --config z_filtered \\
      --dev-files ../shared/data/snli/dev.parquet --model roberta-large --out runs/zf
  debiased-nli train snli --data-files ... --poe --poe-beta 1 --poe-gamma 1 --out runs/poe
  accelerate launch --multi_gpu --num_processes 8 -m debiased_nli.cli train snli ...   # 8 GPUs
  (on a machine without GPUs the same launch runs N CPU processes with gloo)

Defaults are the papers' (Wu et al. 2022): lr 1e-5, batch 32, max length 128, 10%% linear warm-up,
early stopping on dev accuracy (patience 3). Rerunning a command resumes from its last checkpoint."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="fine-tune a classifier (optionally with product of experts)",
                       description="Fine-tune any AutoModelForSequenceClassification (Hub id or folder) on a "
                                   "task, local files or a release config; saves the best model with "
                                   "config.id2label = the task's label names.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--release", help="a release folder or Hub dataset repo (load_dataset(RELEASE, CONFIG))")
    p.add_argument("--config", help="the release config to train on, e.g. z_filtered, seq_z")
    p.add_argument("--dev-files", nargs="+", metavar="PATH",
                   help="dev rows for early stopping (default: the 'validation' split of --data-files or the "
                        "release/Hub source, when it has one)")
    p.add_argument("--model", required=True, help="Hub id or folder of the model to fine-tune")
    p.add_argument("--out", required=True, help="output folder (checkpoints, final model, debiased_nli_train.json)")
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=1e-5, help="learning rate (default 1e-5)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=32, help="per-device batch size (default 32)")
    p.add_argument("--max-length", type=POSITIVE_INT, default=128, help="maximum tokens of premise+hypothesis (default 128)")
    p.add_argument("--epochs", type=POSITIVE_FLOAT, default=3.0, help="epochs (default 3; early stopping may end sooner)")
    p.add_argument("--warmup-ratio", type=number(float, low=0, high=1, high_open=True), default=0.1, help="linear warm-up share of steps (default 0.1)")
    p.add_argument("--weight-decay", type=NON_NEGATIVE_FLOAT, default=0.01)
    p.add_argument("--seed", type=NON_NEGATIVE_INT, default=42, help="training seed (init of the head, order, dropout)")
    p.add_argument("--data-seed", type=NON_NEGATIVE_INT, default=0, help="seed of the --max-train-rows/--max-dev-rows sample")
    p.add_argument("--max-train-rows", type=POSITIVE_INT, help="train on a seeded random sample of this many rows")
    p.add_argument("--max-dev-rows", type=POSITIVE_INT, help="early-stop on a seeded random sample of this many dev rows")
    p.add_argument("--eval-steps", type=POSITIVE_INT, help="evaluate and checkpoint every N steps (default: every epoch)")
    p.add_argument("--patience", type=POSITIVE_INT, default=3, help="early-stopping patience in evaluations (default 3)")
    p.add_argument("--poe", action="store_true", help="product of experts with a hypothesis-only bias model")
    p.add_argument("--poe-beta", type=NON_NEGATIVE_FLOAT, default=1.0, help="weight of log b in softmax(log p + beta log b)")
    p.add_argument("--poe-gamma", type=NON_NEGATIVE_FLOAT, default=1.0, help="weight of the bias model's CE term")
    p.add_argument("--bias-model", default="tfidf",
                   help="'tfidf' (out-of-fold hypothesis-only TF-IDF+LR) or a hypothesis-only classifier folder")
    p.add_argument("--no-group-by-length", action="store_true", help="random batches instead of length-grouped")
    p.add_argument("--no-resume", action="store_true", help="start over even if OUT has checkpoints")
    p.add_argument("--cpu", action="store_true", help="train on CPU even if a GPU is visible")
    p.add_argument("--threads", type=POSITIVE_INT, help="torch CPU threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..data import parse_data_files
    from ..errors import ConfigError
    from ..training import TrainConfig, load_training_split, train_classifier

    task = task_from_args(args)
    if args.release and args.data_files:
        raise ConfigError("give either --release (with --config) or --data-files, not both")
    check_model_reference(args.model, "--model")
    if args.poe and args.bias_model != "tfidf":
        check_model_reference(args.bias_model, "--bias-model")
    if args.release:
        check_release_reference(args.release, "--release")
    files = parse_data_files(args.data_files) if args.data_files else None
    train = load_training_split(task, data_files=files, release=args.release, config=args.config,
                                split=args.split, on_invalid=args.on_invalid)
    if args.max_rows:
        train = train.select(range(min(args.max_rows, len(train))))
    dev = None
    if args.dev_files:
        dev = load_training_split(task, data_files={"validation": args.dev_files}, split="validation",
                                  on_invalid=args.on_invalid)
    elif files and "validation" in files:
        dev = load_training_split(task, data_files=files, split="validation", on_invalid=args.on_invalid)
    cfg = TrainConfig(model=args.model, output_dir=args.out, learning_rate=args.lr, batch_size=args.batch_size,
                      max_length=args.max_length, epochs=args.epochs, warmup_ratio=args.warmup_ratio,
                      weight_decay=args.weight_decay, seed=args.seed, data_seed=args.data_seed,
                      max_train_rows=args.max_train_rows, max_dev_rows=args.max_dev_rows,
                      eval_steps=args.eval_steps, early_stopping_patience=args.patience, poe=args.poe,
                      poe_beta=args.poe_beta, poe_gamma=args.poe_gamma, bias_model=args.bias_model,
                      group_by_length=not args.no_group_by_length, resume=not args.no_resume,
                      use_cpu=True if args.cpu else None, num_threads=args.threads)
    result = train_classifier(cfg, task, train, dev)
    print(json.dumps(result.to_dict(), indent=2))
    return 0
