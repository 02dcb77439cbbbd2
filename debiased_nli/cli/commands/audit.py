"""``debiased-nli audit``: z-statistics of a dataset's annotation artifacts."""
from __future__ import annotations

import sys

from ._common import (DefaultsHelpFormatter, POSITIVE_FLOAT, POSITIVE_INT, SEED, add_task_arguments, number,
                      task_from_args)


def p0_argument(text: str):
    """'uniform', 'prior' or a number strictly between 0 and 1."""
    if text in ("uniform", "prior"):
        return text
    return number(float, low=0, high=1, low_open=True, high_open=True)(text)


def register(sub) -> None:
    p = sub.add_parser(
        "audit", help="find annotation artifacts: z-statistics per feature and label, hypothesis-only accuracy",
        description="Audit a dataset for spurious feature-label correlations (Gardner et al. 2021). Writes "
                    "OUT/audit.json (n_rows, labels, the top-k features per label with n, p_hat, z, and the "
                    "out-of-fold hypothesis-only accuracy), OUT/audit.md (a table per label) and OUT/zstats.png.",
        formatter_class=DefaultsHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--top-k", type=POSITIVE_INT, default=20, help="features reported per label")
    p.add_argument("--z-threshold", type=POSITIVE_FLOAT, default=None,
                   help="|z| threshold for counts and the plot (default: Bonferroni-corrected at --alpha)")
    p.add_argument("--alpha", type=number(float, low=0, high=1, low_open=True, high_open=True), default=0.01, help="significance level for the default threshold")
    p.add_argument("--p0", type=p0_argument, default="uniform", help="'uniform' (1/K), 'prior' (label shares) or a number")
    p.add_argument("--hypothesis-only", default="tfidf",
                   help="'tfidf' (out-of-fold TF-IDF + logistic regression), a fine-tuned classifier folder or "
                        "Hub id, or 'none'")
    p.add_argument("--seed", type=SEED, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    from ...api import audit

    task = task_from_args(args)
    result = audit(task, out=args.out, data_files=args.data_files, split=args.split, revision=args.revision,
                   max_rows=args.max_rows, on_invalid=args.on_invalid, top_k=args.top_k, z_threshold=args.z_threshold,
                   alpha=args.alpha, p0=args.p0, hypothesis_only=args.hypothesis_only, seed=args.seed,
                   progress=not args.quiet)
    report = result.report
    print(f"audited {report['n_rows']:,} rows of {task.name}; hypothesis-only accuracy "
          f"{report['hypothesis_only_accuracy']}; largest |z| {report['max_abs_z']}", file=sys.stderr)
    for label in task.labels:
        print(f"  {label}: {', '.join(result.top_features(label))}", file=sys.stderr)
    for kind, path in result.paths.items():
        print(f"wrote {path}")
    return 0
