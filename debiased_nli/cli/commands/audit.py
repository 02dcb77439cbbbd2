"""``debiased-nli audit``: z-statistics of a dataset's annotation artifacts."""
from __future__ import annotations

import argparse
import sys

from ._common import (
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
    add_task_arguments,
    check_model_reference,
    number,
    task_from_args,
)


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
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    from ...bias.audit import audit_dataset, write_audit
    from ...data.loading import load_task, parse_data_files, require_two_labels
    from ...utils.outputs import check_target, is_audit_folder

    task = task_from_args(args)
    inputs = [f for files in (parse_data_files(args.data_files) or {}).values() for f in files]
    check_target(args.out, overwrite=True, must_be_new=False, is_ours=is_audit_folder, what="audit", inputs=inputs)
    loaded = load_task(task, args.split, data_files=args.data_files, on_invalid=args.on_invalid,
                       revision=args.revision, max_rows=args.max_rows)
    p0 = args.p0
    hyp = None if args.hypothesis_only.lower() == "none" else args.hypothesis_only
    if hyp not in (None, "tfidf"):
        check_model_reference(hyp, "--hypothesis-only")
    require_two_labels(loaded.dataset, task, f"{task.name} split {args.split!r}")
    report, zs = audit_dataset(loaded.dataset, task, top_k=args.top_k, p0=p0, z_threshold=args.z_threshold,
                               alpha=args.alpha, hypothesis_only=hyp, seed=args.seed, return_zstats=True)
    report["source"] = loaded.source
    report["counts"] = loaded.counts
    paths = write_audit(report, args.out, zs, set_aside=loaded.set_aside, inputs=inputs)
    print(f"audited {report['n_rows']:,} rows of {task.name}; hypothesis-only accuracy "
          f"{report['hypothesis_only_accuracy']}; largest |z| {report['max_abs_z']}", file=sys.stderr)
    for label in task.labels:
        top = [r["feature"] for r in report["features"] if r["label"] == label][:5]
        print(f"  {label}: {', '.join(top)}", file=sys.stderr)
    for kind, path in paths.items():
        print(f"wrote {path}")
    return 0
