"""``debiased-nli aflite``: adversarial filtering with ensembles of linear models (Le Bras et al. 2020)."""
from __future__ import annotations

import argparse
import json
import time

from ._common import (NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, add_task_arguments, check_model_reference, number,
                      task_from_args)

DESCRIPTION = """\
AFLite (Le Bras et al. 2020, Algorithm 1). Each row is embedded once with an encoder (the pair
premise/hypothesis, mean-pooled last layer, cached). Then, each round, m linear classifiers
(multinomial logistic regression, trained all at once) are fitted on m random train parts of size t;
a row's predictability score is the share of the classifiers that held it out and predicted its
label. Up to k rows with score >= tau are removed per round, highest first; it stops when fewer than
k rows pass tau or n rows remain.

Writes to --out: kept.parquet, removed.parquet (with aflite_score, aflite_round and reason:
"aflite" or "warm-up"), aflite.json (parameters, sizes per round, the bias audit of the input, of
the kept rows and of a random subset of the same size), aflite.md and aflite.png.
"""

EXAMPLE = """\
example:
  debiased-nli aflite snli --data-files ../shared/data/snli/train_sample.parquet \\
      --encoder ~/.cache/debiased-nli/models/all-minilm-l6-v2 --out runs/aflite-snli
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("aflite", help="filter a dataset with AFLite (ensembles of linear models on embeddings)",
                              description=DESCRIPTION, epilog=EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--out", required=True, help="output folder")
    g = p.add_argument_group("embeddings")
    g.add_argument("--encoder", help="encoder folder or Hub id (default: roberta-large, the paper's, or the offline "
                                     "all-MiniLM-L6-v2 folder ~/.cache/debiased-nli/models/all-minilm-l6-v2 where it exists)")
    g.add_argument("--batch-size", type=POSITIVE_INT, default=64, help="rows per encoder batch (default 64)")
    g.add_argument("--max-length", type=POSITIVE_INT, default=128, help="max tokens of a pair (default 128)")
    g.add_argument("--pooling", choices=["mean", "cls"], default="mean", help="pooling of the last layer")
    g.add_argument("--warmup-share", type=number(float, low=0, high=1, high_open=True), default=0.0,
                   help="fine-tune the encoder on this share of the rows first (the paper's warm-up; "
                        "those rows are removed with reason 'warm-up'); 0 = no warm-up (default)")
    g.add_argument("--warmup-epochs", type=POSITIVE_FLOAT, default=1.0, help="epochs of warm-up fine-tuning")
    a = p.add_argument_group("algorithm (defaults: m and tau from the paper; n, t, k scaled to the input)")
    a.add_argument("--m", type=POSITIVE_INT, default=64, help="partitions (linear classifiers) per round (default 64)")
    a.add_argument("--train-size", type=POSITIVE_INT, help="t, rows in each train part (default: |D|/5, and < n)")
    a.add_argument("--k", type=POSITIVE_INT, help="slice size, the most rows removed per round (default: |D|/20)")
    a.add_argument("--tau", type=number(float, low=0, high=1, low_open=True), default=0.75, help="predictability threshold (default 0.75)")
    a.add_argument("--target-n", type=POSITIVE_INT, help="stop when this many rows remain (default: |D|/4)")
    a.add_argument("--selection", choices=["greedy", "sample"], default="greedy",
                   help="greedy: remove the top-k scores; sample: the slice-sampling variant (Gumbel top-k "
                        "on log scores)")
    a.add_argument("--C", type=POSITIVE_FLOAT, default=1.0, help="inverse L2 strength of the logistic regressions")
    a.add_argument("--max-iter", type=POSITIVE_INT, default=100, help="L-BFGS iterations per round (default 100)")
    a.add_argument("--max-rounds", type=POSITIVE_INT, help="stop after this many rounds")
    a.add_argument("--memory-budget-mb", type=POSITIVE_INT, help="memory for the partitions trained together "
                                                     "(default 1024 MB; more trains more classifiers at once)")
    a.add_argument("--group-size", type=POSITIVE_INT, help="train this many partitions together (overrides the budget)")
    a.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="seed of partitions, sampling and warm-up (default 0)")
    p.add_argument("--no-audit", action="store_true", help="skip the bias audit before/after/random control")
    p.add_argument("--top-k", type=POSITIVE_INT, default=20, help="top z-statistics per label in the audit (default 20)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    from ..aflite import aflite_step, write_aflite_outputs
    from ..data import load_task, require_two_labels
    from ..provenance import library_versions

    task = task_from_args(args)
    if args.encoder:
        check_model_reference(args.encoder, "--encoder")
    loaded = load_task(task, args.split, data_files=args.data_files, on_invalid=args.on_invalid,
                       revision=args.revision, max_rows=args.max_rows)
    params = {"encoder": args.encoder, "batch_size": args.batch_size, "max_length": args.max_length,
              "pooling": args.pooling, "warmup_share": args.warmup_share, "warmup_epochs": args.warmup_epochs,
              "m": args.m, "train_size": args.train_size, "k": args.k, "tau": args.tau, "target_n": args.target_n,
              "selection": args.selection, "C": args.C, "max_iter": args.max_iter, "max_rounds": args.max_rounds,
              "seed": args.seed, "audit": not args.no_audit, "top_k": args.top_k, "group_size": args.group_size,
              "memory_budget": args.memory_budget_mb * 2**20 if args.memory_budget_mb else None}
    require_two_labels(loaded.dataset, task, f"{task.name} split {args.split!r}")
    start = time.time()
    kept, removed, report = aflite_step(loaded.dataset, task, params)
    report["manifest"] = {"source": loaded.source, "load_counts": loaded.counts, "seconds": round(time.time() - start, 1),
                          "versions": library_versions(),
                          "input_fingerprint": loaded.dataset._fingerprint}
    paths = write_aflite_outputs(kept, removed, report, args.out)
    if loaded.set_aside is not None and len(loaded.set_aside):
        loaded.set_aside.to_parquet(str(paths["json"].parent / "set_aside.parquet"))
    print(json.dumps({"kept": report["n_kept"], "removed": report["removed_by_reason"], "rounds": report["rounds"],
                      "stop_reason": report["stop_reason"], "out": str(paths["json"].parent)}))
    return 0
