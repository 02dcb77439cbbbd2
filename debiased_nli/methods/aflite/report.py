"""AFLite's report: the markdown section of the card, the plot of its rounds and the output files of the
``aflite`` command."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def render_aflite_md(report: Mapping[str, Any], title: str | None = None) -> str:
    """The card section: parameters, sizes per round, and the audit before / after / random control."""
    p = report["params"]
    lines = [f"# {title or 'AFLite (Le Bras et al. 2020)'}", ""]
    lines.append(f"- input rows: {report['n_input']:,}; kept: {report['n_kept']:,}; removed: "
                 + ", ".join(f"{k} {v:,}" for k, v in report.get("removed_by_reason", {}).items()))
    w = report.get("warm_up")
    if w:
        lines.append(f"- warm-up: `{w['base_model']}` fine-tuned as a pair classifier on {w['rows']:,} random rows "
                     f"(share {w['share']}), {w['epochs']:g} epoch(s), batch {w['batch_size']}, lr {w['lr']:g}, "
                     f"Adam eps {w['eps']:g}, max length {w['max_length']}; final train loss {w['train_loss']:.3f}. "
                     f"These rows are set aside (reason `warm-up`) and t = {p['train_size']:,} is their number.")
    else:
        lines.append("- no warm-up: the encoder was used as it is")
    lines.append(f"- embeddings: {'first token ([CLS])' if report.get('pooling', 'cls') == 'cls' else 'masked mean'} "
                 f"of the last layer of `{report.get('embedded_with', report.get('encoder'))}`"
                 + (f", dimension {report['embedding_dim']}" if report.get("embedding_dim") else "")
                 + (f", max length {report['max_length']}" if report.get("max_length") else ""))
    lines.append(f"- m = {p['m']} partitions, train size t = {p['train_size']:,}, slice k = {p['k']:,}, "
                 f"tau = {p['tau']}, target n = {p['target_n']:,}, selection {p['selection']}, "
                 f"logistic regression C = {p['C']} (L-BFGS to max|grad| <= {p.get('tol', 1e-4):g}), seed {p['seed']}")
    lines.append(f"- stopped: {report['stop_reason']} after {report['rounds']} round(s)")
    lines += ["", "## Rounds", "",
              "| round | rows | score >= tau | removed | held-out accuracy | median score | lowest removed score "
              "| L-BFGS iterations, median (max) |",
              "|---|---|---|---|---|---|---|---|"]
    for h in report["history"]:
        med = h["score_quantiles"].get("0.5")
        low = h["removed_min_score"]
        med_s = "" if med is None else f"{med:.3f}"
        low_s = "" if low is None else f"{low:.3f}"
        its = f"{h['lbfgs_iter_median']:.0f} ({h['lbfgs_iter_max']})" if "lbfgs_iter_median" in h else ""
        lines.append(f"| {h['round']} | {h['size_before']:,} | {h['candidates']:,} | {h['removed']:,} | "
                     f"{h['heldout_accuracy']:.3f} | {med_s} | {low_s} | {its} |")
    proto = report.get("protocol")
    if proto:
        lines += ["", "## Where each value comes from", "", "| value | used | source |", "|---|---|---|"]
        cell = (lambda x: str(x).replace("|", "\\|"))
        lines += [f"| `{k}` | {cell(v['value'])} | {cell(v['source'])} |" for k, v in proto.items()]
    audit = report.get("audit")
    if audit:
        cols = [("before", "input"), ("after", "AFLite kept"), ("random_same_size", "random subset, same size")]
        cols = [(k, name) for k, name in cols if k in audit]
        lines += ["", "## Bias audit", "", "| | " + " | ".join(name for _, name in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        lines.append("| rows | " + " | ".join(f"{audit[k]['n_rows']:,}" for k, _ in cols) + " |")
        lines.append("| hypothesis-only accuracy | " + " | ".join(
            "" if audit[k].get("hypothesis_only_accuracy") is None else f"{audit[k]['hypothesis_only_accuracy']:.3f}"
            for k, _ in cols) + " |")
        lines.append("| largest \\|z\\| | " + " | ".join(f"{audit[k]['max_abs_z']:.1f}" for k, _ in cols) + " |")
        lines.append("| features above the z threshold | " + " | ".join(
            f"{sum(audit[k]['features_above_threshold'].values()):,}" for k, _ in cols) + " |")
        for key, name in cols:
            top = sorted(audit[key]["features"], key=lambda r: -r["z"])[:10]
            lines += ["", f"### Largest z-statistics: {name}", "", "| feature | label | n | p_hat | z |",
                      "|---|---|---|---|---|"]
            lines += [f"| `{r['feature']}` | {r['label']} | {r['n']:,} | {r['p_hat']:.3f} | {r['z']:.1f} |" for r in top]
    lines += ["", "score(e) = share of the m linear classifiers, among those that held e out, that predict "
                  "e's label; rows with score >= tau are removed, up to k per round, highest first."]
    return "\n".join(lines) + "\n"


def plot_aflite(report: Mapping[str, Any], path) -> None:
    """Left: rows left after each round; right: the predictability score distribution of each round."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = report["history"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    sizes = [hist[0]["size_before"]] + [h["size_after"] for h in hist] if hist else [report["n_input"]]
    a.plot(range(len(sizes)), sizes, marker="o")
    a.axhline(report["params"]["target_n"], color="C3", ls=":", label="target n")
    a.set_xlabel("round")
    a.set_ylabel("rows kept")
    a.set_title("kept size per round")
    a.legend(fontsize=7)
    edges = np.linspace(0, 1, 21)
    centers = (edges[:-1] + edges[1:]) / 2
    cmap = plt.get_cmap("viridis")
    for i, h in enumerate(hist):
        counts = np.asarray(h["score_histogram"], float)
        b.plot(centers, counts / max(counts.sum(), 1), color=cmap(i / max(len(hist) - 1, 1)), lw=1,
               label=f"round {h['round']}" if i in (0, len(hist) - 1) else None)
    b.axvline(report["params"]["tau"], color="C3", ls=":", label="tau")
    b.set_xlabel("predictability score")
    b.set_ylabel("share of rows")
    b.set_title("score distribution per round")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


OUTPUT_FILES = ("kept.parquet", "removed.parquet", "aflite.json", "aflite.md", "aflite.png")


def write_aflite_outputs(kept, removed, report: Mapping[str, Any], out_dir, outputs=None) -> dict:
    """kept.parquet, removed.parquet, aflite.json, aflite.md and aflite.png in ``out_dir``, each under a
    temporary name first and never over a file this tool did not write (``outputs``: the command's
    :class:`~debiased_nli.utils.outputs.OwnFiles`; the caller then closes it)."""
    import json
    from pathlib import Path

    from ...utils.outputs import OwnFiles

    out = Path(outputs.paths[0].parent if outputs is not None else out_dir)
    paths = dict(zip(("kept", "removed", "json", "md", "png"), (out / n for n in OUTPUT_FILES)))
    import contextlib

    own = outputs or OwnFiles(paths.values(), what=f"--out {out_dir}")
    with own if outputs is None else contextlib.nullcontext():  # the caller's OwnFiles: it renames them
        kept.to_parquet(str(own.temp(paths["kept"])))
        removed.to_parquet(str(own.temp(paths["removed"])))
        own.write_text(paths["json"], json.dumps(report, indent=2, default=_json_default) + "\n")
        own.write_text(paths["md"], render_aflite_md(report))
        plot_aflite(report, own.temp(paths["png"]))
    return paths


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")
