"""`debiased-nli train`: fine-tune a sentence-pair classifier on a task, files or a release config."""
from __future__ import annotations

import argparse
import json
import sys

from ...models.training import POE_PRESETS, TRAIN_PRESETS, TrainConfig, resolve_config
from ._common import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
    add_task_arguments,
    number,
    task_from_args,
)

_EPILOG = """examples:
  debiased-nli train snli --data-files train=../shared/data/snli/train_sample.parquet \\
      validation=../shared/data/snli/dev.parquet --model sentence-transformers/all-MiniLM-L6-v2 --out runs/base
  debiased-nli train snli --release out/snli-release --config z_filtered \\
      --dev-files ../shared/data/snli/dev.parquet --model roberta-large --out runs/zf
  debiased-nli train snli --data-files ... --preset paper --model bert-base-uncased --out runs/paper
  debiased-nli train snli --data-files ... --poe --poe-preset snli --out runs/poe
  debiased-nli train snli --release org/debiased-snli --revision v1.0 --config z_filtered \\
      --dev-files ../shared/data/snli/dev.parquet --model bert-base-uncased --out runs/zf \\
      --push-to org/bert-snli-zf --push-revision v1.0       # + the model and its card on the Hub
  accelerate launch --multi_gpu --num_processes 8 -m debiased_nli.cli train snli ...   # 8 GPUs
  (on a machine without GPUs the same launch runs N CPU processes with gloo)

Hyper-parameters (the values used and their sources are printed before training):
  defaults         the project's choice for small data: lr 1e-5, batch 32, max length 128 and early
                   stopping patience 3 as in Wu et al. (2022, Table 9), but 3 epochs, a linear schedule
                   warming up over 10% of the steps, AdamW eps 1e-8 and weight decay 0.01
  --preset paper   Wu et al. (2022), Table 9 "Hyperparameters for training the NLI models": lr 1e-5,
                   batch 32, 5 epochs, Adam eps 1e-6, betas (0.9, 0.999), "constant with warmup" over
                   2,000 steps, max length 128, early stop patience 3 epochs (the paper's model is
                   BERT-base: --model bert-base-uncased). Options given explicitly override the preset.
Product of experts (--poe): L = CE(softmax(log p + beta log b), y) + gamma CE(b, y). --poe-preset
  takes beta and gamma from Wu et al. (2022), Table 10 (tuned per evaluation set), and trains the bias
  model jointly (--bias-model joint, as Karimi Mahabadi et al. 2020, whose code the paper adapts):
    snli (SNLI -> SNLI-hard) beta 2.0 gamma 0.4      seq-z-snli (Seq-Z SNLI -> SNLI-hard) 2.0 0.4
    mnli-m-hard (MNLI -> MNLI-m hard) 0.8 1.0        mnli-mm-hard (MNLI -> MNLI-mm hard) 2.0 0.4
    mnli-hans (MNLI -> HANS) 2.0 0.8                 z-aug-mnli-m-hard (Z-Aug MNLI -> MNLI-m hard) 2.0 0.4
    z-aug-mnli-mm-hard (Z-Aug MNLI -> MNLI-mm hard) 2.0 0.8    z-aug-mnli-hans (Z-Aug MNLI -> HANS) 2.0 1.0
  gamma only acts on a jointly trained bias model: with a fixed one (tfidf, a folder) gamma CE(b, y)
  is a constant.
Rerunning a command resumes from its last checkpoint."""


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
    p.add_argument("--out", required=True, help="output folder (checkpoints, final model, debiased_nli_train.json, the model card "
                                                   "README.md)")
    p.add_argument("--preset", choices=sorted(TRAIN_PRESETS),
                   help="'paper': Wu et al. (2022), Table 9 (see below); explicit options override it")
    p.add_argument("--lr", type=POSITIVE_FLOAT, help="learning rate (default 1e-5, Table 9)")
    p.add_argument("--batch-size", type=POSITIVE_INT, help="per-device batch size (default 32, Table 9)")
    p.add_argument("--max-length", type=POSITIVE_INT, help="maximum tokens of premise+hypothesis (default 128, Table 9)")
    p.add_argument("--epochs", type=POSITIVE_FLOAT, help="epochs (default 3; paper 5; early stopping may end sooner)")
    p.add_argument("--warmup-ratio", type=number(float, low=0, high=1, high_open=True), help="warm-up share of the steps (default 0.1)")
    p.add_argument("--warmup-steps", type=NON_NEGATIVE_INT, help="warm-up steps instead of --warmup-ratio (paper: 2000)")
    p.add_argument("--scheduler", choices=["linear", "constant", "constant_with_warmup", "cosine"],
                   help="learning-rate schedule (default linear; paper: constant_with_warmup)")
    p.add_argument("--adam-epsilon", type=POSITIVE_FLOAT, help="Adam epsilon (default 1e-8; paper 1e-6)")
    p.add_argument("--weight-decay", type=NON_NEGATIVE_FLOAT, help="AdamW weight decay (default 0.01; paper 0: Adam)")
    p.add_argument("--seed", type=SEED, default=42, help="training seed (init of the head, order, dropout)")
    p.add_argument("--data-seed", type=SEED, default=0, help="seed of the --max-train-rows/--max-dev-rows sample")
    p.add_argument("--max-train-rows", type=POSITIVE_INT, help="train on a seeded random sample of this many rows")
    p.add_argument("--max-dev-rows", type=POSITIVE_INT, help="early-stop on a seeded random sample of this many dev rows")
    p.add_argument("--eval-steps", type=POSITIVE_INT, help="evaluate and checkpoint every N steps (default: every epoch)")
    p.add_argument("--patience", type=POSITIVE_INT, help="early-stopping patience in evaluations (default 3, Table 9)")
    p.add_argument("--poe", action="store_true", help="product of experts with a hypothesis-only bias model")
    p.add_argument("--poe-preset", metavar="NAME",
                   help=f"beta and gamma of Wu et al. (2022), Table 10 (implies --poe and, unless given, "
                        f"--bias-model joint): {', '.join(POE_PRESETS)}")
    p.add_argument("--poe-beta", type=NON_NEGATIVE_FLOAT, help="weight of log b in softmax(log p + beta log b) (default 1.0)")
    p.add_argument("--poe-gamma", type=NON_NEGATIVE_FLOAT, help="weight of the bias model's CE term (default 1.0; acts only "
                                                   "with --bias-model joint)")
    p.add_argument("--bias-model",
                   help="'joint' (a hypothesis-only head trained with the model, the paper's; default with "
                        "--poe-preset), 'tfidf' (fixed out-of-fold TF-IDF+LR; default otherwise) or a fixed "
                        "hypothesis-only classifier folder")
    p.add_argument("--no-group-by-length", action="store_true", help="random batches instead of length-grouped")
    p.add_argument("--no-resume", action="store_true", help="start over even if OUT has checkpoints")
    p.add_argument("--cpu", action="store_true", help="train on CPU even if a GPU is visible")
    p.add_argument("--threads", type=POSITIVE_INT, help="torch CPU threads")
    hub = p.add_argument_group("the Hub")
    hub.add_argument("--push-to", metavar="ORG/NAME",
                     help="upload the final model and its card (README.md: base model, training data with its "
                          "fingerprint, every hyper-parameter with its source, dev accuracy) to this Hub model repo, "
                          "created if needed, in one commit")
    hub.add_argument("--push-revision", metavar="TAG",
                     help="tag the pushed commit with this version, e.g. v1.0 (tags are immutable; --revision is the "
                          "revision of the training data)")
    hub.add_argument("--private", action="store_true", help="--push-to: create the repo as private")
    hub.add_argument("--token", help="--push-to: Hub token (default: HF_TOKEN or the logged-in token)")
    p.set_defaults(func=run)


def _given(args: argparse.Namespace) -> dict:
    """The hyper-parameters given on the command line, by their TrainConfig names (None: not given)."""
    return {"learning_rate": args.lr, "batch_size": args.batch_size, "max_length": args.max_length,
            "epochs": args.epochs, "warmup_ratio": args.warmup_ratio, "warmup_steps": args.warmup_steps,
            "lr_scheduler": args.scheduler, "adam_epsilon": args.adam_epsilon, "weight_decay": args.weight_decay,
            "eval_steps": args.eval_steps, "early_stopping_patience": args.patience}


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, str]]:
    """The TrainConfig of a command line (preset, then explicit options) and the source of each value."""
    return resolve_config(args.model, args.out, preset=args.preset, given=_given(args), poe=args.poe,
                          poe_preset_name=args.poe_preset, poe_beta=args.poe_beta, poe_gamma=args.poe_gamma,
                          bias_model=args.bias_model, seed=args.seed, data_seed=args.data_seed,
                          max_train_rows=args.max_train_rows, max_dev_rows=args.max_dev_rows,
                          group_by_length=not args.no_group_by_length, resume=not args.no_resume,
                          use_cpu=True if args.cpu else None, num_threads=args.threads)


def run(args: argparse.Namespace) -> int:
    from ...api import train

    given = _given(args)
    out = train(task_from_args(args), model=args.model, out=args.out, release=args.release, config=args.config,
                data_files=args.data_files, dev_files=args.dev_files, split=args.split, revision=args.revision,
                max_rows=args.max_rows, on_invalid=args.on_invalid, preset=args.preset, seed=args.seed,
                data_seed=args.data_seed, max_train_rows=args.max_train_rows, max_dev_rows=args.max_dev_rows,
                poe=args.poe, poe_preset=args.poe_preset, poe_beta=args.poe_beta, poe_gamma=args.poe_gamma,
                bias_model=args.bias_model, group_by_length=not args.no_group_by_length, resume=not args.no_resume,
                cpu=args.cpu, threads=args.threads, push_to=args.push_to, push_revision=args.push_revision,
                private=args.private, token=args.token, progress=not args.quiet, show_values=True, **given)
    print(json.dumps(out.result.to_dict(), indent=2))
    if out.pushed:
        print(f"pushed the model to {out.pushed['repo_id']} (commit {out.pushed['commit'][:10]}"
              f"{', tag ' + out.pushed['tag'] if out.pushed['tag'] else ''}): {out.pushed['commit_url']}",
              file=sys.stderr)
    return 0
