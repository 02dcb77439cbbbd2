"""``debiased-nli aflite``: adversarial filtering with ensembles of linear models (Le Bras et al. 2020)."""
from __future__ import annotations

import argparse
import json

from ._common import (
    POSITIVE_FLOAT,
    POSITIVE_INT,
    add_run_arguments,
    add_task_arguments,
    command_outputs,
    number,
    run_method,
    task_from_args,
    write_set_aside,
)
from ...utils.paths import check_model_reference

DESCRIPTION = """\
AFLite (Le Bras et al. 2020, Algorithm 1) with the paper's protocol. A warm-up model (the encoder
fine-tuned as a pair classifier) is trained on a random share of the rows, which are then set aside
(reason "warm-up"); the other rows are embedded once with the fine-tuned encoder's first token
([CLS], cached). Then, each round, m multinomial logistic regressions are fitted on m random train
parts of size t = the warm-up size; a row's predictability score is the share of the classifiers that
held it out and predicted its label. Up to k rows with score >= tau are removed per round, highest
first; it stops when fewer than k rows pass tau or n = |D|/3 rows remain (the paper's SNLI result:
182k of 550k). m, k and tau are the project's choices (the paper gives no values).

Writes to --out: kept.parquet, removed.parquet (with aflite_score, aflite_round and reason:
"aflite" or "warm-up"), aflite.json (parameters with their source, sizes per round, the bias audit of
the input, of the kept rows and of a random subset of the same size), aflite.md and aflite.png.
"""

EXAMPLE = """\
example (the paper's warm-up: 3 epochs, lr 1e-5, batch 92 on 10% of the rows):
  debiased-nli aflite snli --data-files ../shared/data/snli/train_sample.parquet \\
      --encoder ~/.cache/debiased-nli/models/all-minilm-l6-v2 --out runs/aflite-snli
sized for a CPU (one epoch, shorter pairs):
  debiased-nli aflite snli --data-files ... --warmup-epochs 1 --warmup-batch-size 16 --warmup-lr 5e-5 \\
      --max-length 64 --out runs/aflite-snli
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("aflite", help="filter a dataset with AFLite (ensembles of linear models on embeddings)",
                              description=DESCRIPTION, epilog=EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--out", required=True, help="output folder")
    g = p.add_argument_group("warm-up and embeddings (defaults: the paper's protocol, Appendix A.4)")
    g.add_argument("--encoder", help="encoder folder or Hub id (default: roberta-large, the paper's, or the offline "
                                     "all-MiniLM-L6-v2 folder ~/.cache/debiased-nli/models/all-minilm-l6-v2 where it exists)")
    g.add_argument("--warmup-share", type=number(float, low=0, high=1, high_open=True), default=None,
                   help="fine-tune the encoder on this share of the rows first; those rows are removed with "
                        "reason 'warm-up' and their number is t (default 0.1, project's choice: the paper says "
                        "'a small fraction'); 0 = no warm-up, embed with the encoder as it is")
    g.add_argument("--warmup-epochs", type=POSITIVE_FLOAT, default=None, help="warm-up epochs (default 3, paper A.4)")
    g.add_argument("--warmup-lr", type=POSITIVE_FLOAT, default=None, help="warm-up learning rate (default 1e-5, paper A.4)")
    g.add_argument("--warmup-eps", type=POSITIVE_FLOAT, default=None, help="warm-up Adam epsilon (default 1e-8, paper A.4)")
    g.add_argument("--warmup-batch-size", type=POSITIVE_INT, default=None, help="warm-up batch size (default 92, paper A.4)")
    g.add_argument("--batch-size", type=POSITIVE_INT, default=None, help="rows per embedding batch (default 64)")
    g.add_argument("--max-length", type=POSITIVE_INT, default=None, help="max tokens of a pair, warm-up and embeddings "
                                                               "(default 128)")
    g.add_argument("--pooling", choices=["cls", "mean"], default=None,
                   help="cls: the first token of the last layer, the input of the classification head (default); "
                        "mean: the masked mean of the last layer")
    a = p.add_argument_group("algorithm (t and n from the paper; m, k, tau: project's choices)")
    a.add_argument("--m", type=POSITIVE_INT, default=None, help="partitions (linear classifiers) per round (default 64)")
    a.add_argument("--train-size", type=POSITIVE_INT, help="t, rows in each train part (default: the warm-up size)")
    a.add_argument("--k", type=POSITIVE_INT, help="slice size, the most rows removed per round (default: 1/20 of the "
                                         "rows filtered)")
    a.add_argument("--tau", type=number(float, low=0, high=1, low_open=True), default=None, help="predictability threshold (default 0.75)")
    a.add_argument("--target-n", type=POSITIVE_INT, help="stop when this many rows remain (default: |D|/3, the paper's "
                                                "182k of 550k)")
    a.add_argument("--selection", choices=["greedy", "sample"], default=None,
                   help="greedy: remove the top-k scores; sample: the slice-sampling variant (Gumbel top-k "
                        "on log scores)")
    a.add_argument("--C", type=POSITIVE_FLOAT, default=None, help="inverse L2 strength of the logistic regressions (default 1.0)")
    a.add_argument("--tol", type=POSITIVE_FLOAT, default=None,
                   help="stop a logistic regression when its largest absolute gradient entry is below this "
                        "(scikit-learn's gtol; default 1e-4)")
    a.add_argument("--max-iter", type=POSITIVE_INT, default=None, help="most L-BFGS iterations per fit (default 1000)")
    a.add_argument("--max-rounds", type=POSITIVE_INT, help="stop after this many rounds")
    a.add_argument("--device", help="torch device of the encoder and the linear models (default: cuda if available)")
    add_run_arguments(a, seed_default=None, seed_help="seed of partitions, sampling and warm-up (default 0)")
    p.add_argument("--no-audit", action="store_true", help="skip the bias audit before/after/random control")
    p.add_argument("--top-k", type=POSITIVE_INT, default=20, help="top z-statistics per label in the audit (default 20)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ...data.loading import require_two_labels
    from ...methods.aflite.report import write_aflite_outputs
    from ...methods.aflite.step import aflite_step

    task = task_from_args(args)
    if args.encoder:
        check_model_reference(args.encoder, "--encoder")
    # only what the user set is passed on, so the report can tell the paper's defaults from the user's values
    params = {"encoder": args.encoder, "batch_size": args.batch_size, "max_length": args.max_length,
              "pooling": args.pooling, "warmup_share": args.warmup_share, "warmup_epochs": args.warmup_epochs,
              "warmup_lr": args.warmup_lr, "warmup_eps": args.warmup_eps, "warmup_batch_size": args.warmup_batch_size,
              "m": args.m, "train_size": args.train_size, "k": args.k, "tau": args.tau, "target_n": args.target_n,
              "selection": args.selection, "C": args.C, "tol": args.tol, "max_iter": args.max_iter,
              "max_rounds": args.max_rounds, "seed": args.seed, "device": args.device, "audit": not args.no_audit,
              "top_k": args.top_k}
    params = {k: v for k, v in params.items() if v is not None}

    from ...methods.aflite.report import OUTPUT_FILES

    outputs = command_outputs(args.out, "aflite", OUTPUT_FILES, legacy=("aflite.json",))  # before any work

    def step(ds, task):
        require_two_labels(ds, task, f"{task.name} split {args.split!r}")
        return aflite_step(ds, task, params)

    def write(result, loaded, manifest) -> int:
        kept, removed, report = result
        report["manifest"] = {**manifest, "input_fingerprint": loaded.dataset._fingerprint}
        with outputs:
            paths = write_aflite_outputs(kept, removed, report, args.out, outputs=outputs)
            write_set_aside(loaded, paths["json"].parent, outputs)
        print(json.dumps({"kept": report["n_kept"], "removed": report["removed_by_reason"], "rounds": report["rounds"],
                          "stop_reason": report["stop_reason"], "out": str(paths["json"].parent)}))
        return 0

    return run_method(args, step, write, task=task)
