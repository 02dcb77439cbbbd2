"""The bias audit of a dataset: top z-statistics per label, the hypothesis-only accuracy, and the
Gardner et al. (2021) picture (feature frequency n against p_hat(l|x), with the |z| = threshold curve).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import __version__
from ..data.loading import column_numpy, labels_of
from ..data.tasks import TaskSpec, get_task
from .features import NULL_FEATURE, build_feature_matrix
from .task_features import add_features
from .zstats import ZStats, bonferroni_threshold, compute_zstats


def audit_dataset(ds, task: "str | TaskSpec", *, top_k: int = 20, p0="uniform", z_threshold: float | None = None,
                  alpha: float = 0.01, hypothesis_only: str | None = "tfidf", seed: int = 0,
                  features_ready: bool = False, progress: bool = True) -> dict:
    """Audit a canonical dataset: the ``audit.json`` dict (:func:`audit_zstats` also returns the z-statistics).

    ``z_threshold`` defaults to the Bonferroni-corrected two-sided threshold at ``alpha`` over every
    (feature, label) test, as in Gardner et al. (2021).
    """
    return audit_zstats(ds, task, top_k=top_k, p0=p0, z_threshold=z_threshold, alpha=alpha,
                        hypothesis_only=hypothesis_only, seed=seed, features_ready=features_ready,
                        progress=progress)[0]


def audit_zstats(ds, task: "str | TaskSpec", *, top_k: int = 20, p0="uniform", z_threshold: float | None = None,
                 alpha: float = 0.01, hypothesis_only: str | None = "tfidf", seed: int = 0,
                 features_ready: bool = False, progress: bool = True) -> tuple[dict, ZStats]:
    """:func:`audit_dataset`'s report and the :class:`ZStats` it was made from (for the audit's figure)."""
    task = get_task(task)
    hyp = None
    if not features_ready:
        ds, hyp = add_features(ds, task, hypothesis_only=hypothesis_only, seed=seed, progress=progress)
    fm = build_feature_matrix(ds)
    labels = labels_of(ds)
    zs = compute_zstats(fm, labels, task.labels, p0=p0)
    n_tests = int((zs.n > 0).sum()) * task.num_labels
    threshold = float(z_threshold) if z_threshold is not None else bonferroni_threshold(n_tests, alpha)
    if hyp is not None:
        hyp_acc = hyp.accuracy
    elif "hypo_only_pred" in ds.column_names:
        hyp_acc = float((column_numpy(ds, "hypo_only_pred") == labels).mean())
    else:
        hyp_acc = None
    report = {
        "task": task.name,
        "n_rows": int(len(labels)),
        "labels": {name: int(c) for name, c in zip(task.labels, np.bincount(labels, minlength=task.num_labels))},
        "p0": [round(float(x), 6) for x in zs.p0],
        "top_k": top_k,
        "z_threshold": round(threshold, 4),
        "z_threshold_rule": "given" if z_threshold is not None else f"bonferroni(alpha={alpha}, tests={n_tests})",
        "n_features": int((zs.n > 0).sum()),
        "features_above_threshold": zs.count_above(threshold),
        "max_abs_z": round(zs.max_abs_z(exclude=(NULL_FEATURE,)), 4),
        "hypothesis_only_accuracy": None if hyp_acc is None else round(hyp_acc, 6),
        "hypothesis_only": hyp.to_dict() if hyp is not None else None,
        "features": zs.top_records(top_k),
        "version": __version__,
    }
    return report, zs


def _md_table(rows: list[dict], cols: Sequence[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return f"`{v}`" if isinstance(v, str) and ("@" in v or "<" in v or "=" in v or ">" in v) else str(v)


def render_audit_md(report: dict, title: str | None = None) -> str:
    lines = [f"# {title or 'Bias audit: ' + report['task']}", ""]
    lines.append(f"- rows: {report['n_rows']:,}; labels: " +
                 ", ".join(f"{k} {v:,}" for k, v in report["labels"].items()))
    if report.get("hypothesis_only_accuracy") is not None:
        h = report.get("hypothesis_only") or {}
        how = f" ({h.get('method')}, {h.get('folds')} folds)" if h.get("folds") else ""
        lines.append(f"- hypothesis-only accuracy (out-of-fold){how}: {report['hypothesis_only_accuracy']:.3f} "
                     f"(majority class: {max(report['labels'].values()) / max(report['n_rows'], 1):.3f})")
    lines.append(f"- features: {report['n_features']:,}; |z| threshold {report['z_threshold']} "
                 f"({report['z_threshold_rule']}); largest |z| (without `<null>`): {report['max_abs_z']}")
    lines.append("- features above the threshold per label: " +
                 ", ".join(f"{k} {v:,}" for k, v in report["features_above_threshold"].items()))
    lines.append("")
    lines.append(f"## Top {report['top_k']} features per label (z-statistics, as in Wu et al. 2022, Table 10)")
    lines.append("")
    for label in report["labels"]:
        rows = [r for r in report["features"] if r["label"] == label]
        lines += [f"### {label}", "", _md_table(rows, ["feature", "n", "p_hat", "z"]), ""]
    lines.append("z = (p_hat(l|x) - p0) / sqrt(p0 (1 - p0) / n) (Gardner et al. 2021).")
    return "\n".join(lines) + "\n"


def _stacked(n: np.ndarray, counts: np.ndarray, alpha: float):
    """Each distinct point (n, count / n) once, with the opacity of its k copies drawn on top of each
    other (1 - (1 - alpha)^k): the same picture, drawn in time linear in the distinct points (millions
    of features share a few thousand points). Returns x, y and the alpha of each point."""
    import pandas as pd

    if len(n) == 0:
        return n.astype(float), n.astype(float), alpha
    n, counts = n.astype(np.int64), counts.astype(np.int64)
    base = int(n.max()) + 1
    k = pd.Series(n * base + counts).value_counts(sort=False)  # integer keys: one hash pass
    keys = k.index.to_numpy()
    xs, cs = np.divmod(keys, base)
    return xs, cs / xs, 1 - (1 - alpha) ** k.to_numpy()


def plot_zstats(zs: ZStats, threshold: float, path: "str | Path", title: str = "", annotate: int = 6) -> None:
    """Feature frequency n (log x) against p_hat(l|x), one panel per label, with the curves
    p0 ± threshold * sqrt(p0 (1 - p0) / n) where |z| equals the threshold."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = zs.num_labels
    fig, axes = plt.subplots(1, K, figsize=(4.2 * K, 3.8), sharey=True, squeeze=False)
    present = zs.n > 0
    n = zs.n[present]
    # the threshold curves are drawn over this grid (sorted); the scatter's own x values are not
    grid = np.logspace(0, math.log10(max(n.max() if len(n) else 10, 10)), 200)
    top = zs.top_k(annotate)
    for l, ax in enumerate(axes[0]):
        p = zs.p_hat[present, l]
        z = zs.z[present, l]
        sig = np.abs(z) > threshold
        c = zs.counts[present, l]
        xs, ys, a = _stacked(n[~sig], c[~sig], 0.25)
        ax.scatter(xs, ys, alpha=a, s=4, color="0.5", lw=0, label="|z| <= threshold")
        xs, ys, a = _stacked(n[sig], c[sig], 0.7)
        ax.scatter(xs, ys, alpha=a, s=6, color="C3", lw=0, label="|z| > threshold")
        p0 = zs.p0[l]
        band = threshold * np.sqrt(p0 * (1 - p0) / grid)
        ax.plot(grid, np.clip(p0 + band, 0, 1), color="C0", lw=1)
        ax.plot(grid, np.clip(p0 - band, 0, 1), color="C0", lw=1)
        ax.axhline(p0, color="C0", lw=0.6, ls=":")
        for i in top[l][top[l] >= 0]:
            ax.annotate(str(zs.vocab[i]), (zs.n[i], zs.p_hat[i, l]), fontsize=6, alpha=0.9,
                        xytext=(2, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(zs.label_names[l])
        ax.set_xlabel("n (rows with the feature)")
    axes[0][0].set_ylabel("p_hat(label | feature)")
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.suptitle(title or f"z-statistics ({zs.n_rows:,} rows, |z| threshold {threshold:.2f})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_audit(report: dict, out_dir: "str | Path", zs: ZStats | None = None, set_aside=None,
                title: str | None = None, inputs: Sequence["str | Path"] = ()) -> dict[str, Path]:
    """Write audit.json, audit.md, zstats.png (and set_aside.parquet) as one folder, atomically.

    The folder is written under a temporary name and renamed into place (see :mod:`debiased_nli.utils.outputs`),
    so it never mixes the files of two runs; an existing ``out_dir`` is replaced only when it is empty
    or an audit folder this tool wrote."""
    from ..utils.outputs import (
        TOOL,
        WRITTEN_BY_KEY,
        check_target,
        clean_stale,
        is_audit_folder,
        lock_target,
        replace_folder,
        temp_folder,
        write_error,
    )

    out = check_target(out_dir, overwrite=True, must_be_new=False, is_ours=is_audit_folder, what="audit",
                       inputs=inputs)
    unlock = lock_target(out)
    tmp = None
    try:
        clean_stale(out, is_audit_folder)
        check_target(out, overwrite=True, must_be_new=False, is_ours=is_audit_folder, what="audit", inputs=inputs)
        tmp = temp_folder(out)
        names = {"json": "audit.json", "md": "audit.md"}
        (tmp / names["json"]).write_text(json.dumps({**report, WRITTEN_BY_KEY: TOOL}, indent=2) + "\n")
        (tmp / names["md"]).write_text(render_audit_md(report, title))
        if zs is not None:
            names["png"] = "zstats.png"
            plot_zstats(zs, report["z_threshold"], tmp / names["png"])
        if set_aside is not None and len(set_aside):
            names["set_aside"] = "set_aside.parquet"
            set_aside.to_parquet(str(tmp / names["set_aside"]))
        replace_folder(tmp, out)
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise write_error(err, out) from err
        raise
    finally:
        unlock()
    return {kind: out / name for kind, name in names.items()}
