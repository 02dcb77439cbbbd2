"""Do two `debiased-nli generate` runs sample the same distribution? Parse rate, label shares, hypothesis and
premise lengths of each run, and tests of each against a reference run:

* label shares: chi-square test of homogeneity on the 2 x labels table of parsed rows' label counts;
* parse rate: chi-square test on the 2 x 2 table parsed / unparseable (Fisher's exact test when a cell is small);
* hypothesis and premise length (words of ``debiased_nli.bias.features.tokenize``): two-sample
  Kolmogorov-Smirnov test (the lengths are whole numbers, so its p-value is conservative), and the means.

    python benchmarks/engine_parity.py --reference fast_bf16=/runs/samples_gstar \
        ct2_int8=/tmp/gstar_ct2_int8 ct2_float32=/tmp/gstar_ct2_float32 --out benchmarks/results/engines/parity_gstar

Each run is a `generate` output folder (shards and rejects); only complete shards are read, and
``--max-samples`` takes the first shards of a run up to that many samples (a run that is still going is
read as it stands). Writes ``<out>.json`` and ``<out>.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LABELS = ("entailment", "neutral", "contradiction")


def run_summary(folder: str, max_samples: int | None = None) -> dict:
    """Counts and length arrays of a generate run folder (its complete shards, in order)."""
    import numpy as np
    import pyarrow.parquet as pq

    from debiased_nli.bias.features import tokenize

    folder = Path(folder)
    shards = sorted(folder.glob("shard-*-of-*.parquet"))
    if not shards:
        raise SystemExit(f"{folder}: no complete shard")
    cfg = json.loads((folder / "generate_config.json").read_text())
    from debiased_nli.data.tasks import get_task
    labels = list(get_task(cfg["task"]).labels)
    counts = np.zeros(len(labels), dtype=np.int64)
    parsed = rejected = 0
    hyp_len, prem_len, reasons = [], [], {}
    for shard in shards:
        rej_path = shard.with_name(shard.name.replace("shard-", "rejects-"))
        rows = pq.read_table(shard).to_pydict()
        rej = pq.read_table(rej_path).to_pydict() if rej_path.exists() else {"reason": []}
        n = len(rows["hypothesis"]) + len(rej["reason"])
        if max_samples is not None and parsed + rejected + n > max_samples:
            break
        parsed += len(rows["hypothesis"])
        rejected += len(rej["reason"])
        for r in rej["reason"]:
            reasons[r] = reasons.get(r, 0) + 1
        counts += np.bincount(np.asarray(rows["label"], dtype=np.int64), minlength=len(labels))
        hyp_len += [len(tokenize(h)) for h in rows["hypothesis"]]
        prem_len += [len(tokenize(p)) for p in rows["premise"]]
    total = parsed + rejected
    return {"folder": str(folder), "engine": cfg.get("engine", "generate"), "dtype": cfg.get("dtype"),
            "batch_size": cfg.get("batch_size"), "seed": cfg.get("seed"), "samples": total, "parsed": parsed,
            "parse_rate": parsed / total, "label_counts": dict(zip(labels, counts.tolist())),
            "label_shares": dict(zip(labels, (counts / max(parsed, 1)).round(4).tolist())),
            "unparseable_reasons": reasons, "hypothesis_words_mean": float(np.mean(hyp_len)),
            "premise_words_mean": float(np.mean(prem_len)), "_hyp": hyp_len, "_prem": prem_len}


def compare(ref: dict, run: dict) -> dict:
    """Tests of ``run`` against ``ref`` (p-values; small ones say the distributions differ)."""
    import numpy as np
    from scipy import stats

    labels = list(ref["label_counts"])
    table = np.array([[ref["label_counts"][k] for k in labels], [run["label_counts"][k] for k in labels]])
    chi2, p_labels, dof, _ = stats.chi2_contingency(table)
    parse = np.array([[ref["parsed"], ref["samples"] - ref["parsed"]], [run["parsed"], run["samples"] - run["parsed"]]])
    if parse.min() < 5:
        p_parse = float(stats.fisher_exact(parse)[1])
    else:
        p_parse = float(stats.chi2_contingency(parse)[1])
    ks_h = stats.ks_2samp(ref["_hyp"], run["_hyp"])
    ks_p = stats.ks_2samp(ref["_prem"], run["_prem"])
    # the difference of each label share with its 95% interval (normal approximation)
    share_diff = {}
    for k in labels:
        a, n1 = ref["label_counts"][k], ref["parsed"]
        b, n2 = run["label_counts"][k], run["parsed"]
        p1, p2 = a / n1, b / n2
        se = (p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2) ** 0.5
        share_diff[k] = [round(p2 - p1, 4), round(p2 - p1 - 1.96 * se, 4), round(p2 - p1 + 1.96 * se, 4)]
    return {"labels_chi2": round(float(chi2), 3), "labels_dof": int(dof), "labels_p": float(p_labels),
            "label_share_diff_ci95": share_diff, "parse_p": p_parse,
            "hypothesis_length_ks": round(float(ks_h.statistic), 4), "hypothesis_length_p": float(ks_h.pvalue),
            "premise_length_ks": round(float(ks_p.statistic), 4), "premise_length_p": float(ks_p.pvalue)}


def verdict(c: dict, alpha: float = 0.01) -> str:
    bad = [name for name, key in (("label shares", "labels_p"), ("parse rate", "parse_p"),
                                  ("hypothesis length", "hypothesis_length_p"), ("premise length", "premise_length_p"))
           if c[key] < alpha]
    return "same (no test below %g)" % alpha if not bad else "differs: " + ", ".join(bad)


def table_md(ref_name: str, summaries: dict, comparisons: dict) -> list[str]:
    lines = ["| run | engine | dtype | batch | samples | parse rate | " + " | ".join(LABELS)
             + " | hyp. words | prem. words | labels p | parse p | hyp. length KS (p) | prem. length KS (p) | verdict |",
             "|" + "---|" * (13 + len(LABELS))]
    for name, s in summaries.items():
        c = comparisons.get(name)
        cells = [f"{name}" + (" (reference)" if name == ref_name else ""), s["engine"], str(s["dtype"]),
                 str(s["batch_size"]), f"{s['samples']:,}", f"{s['parse_rate']:.4f}",
                 *[f"{s['label_shares'][k]:.4f}" for k in LABELS],
                 f"{s['hypothesis_words_mean']:.2f}", f"{s['premise_words_mean']:.2f}"]
        if c:
            cells += [f"{c['labels_p']:.3g}", f"{c['parse_p']:.3g}",
                      f"{c['hypothesis_length_ks']} ({c['hypothesis_length_p']:.3g})",
                      f"{c['premise_length_ks']} ({c['premise_length_p']:.3g})", verdict(c)]
        else:
            cells += ["", "", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, metavar="NAME=FOLDER", help="the run the others are tested against")
    ap.add_argument("runs", nargs="+", metavar="NAME=FOLDER")
    ap.add_argument("--max-samples", type=int, help="read at most this many samples of each run (whole shards)")
    ap.add_argument("--out", required=True, help="output path without suffix (.json and .md are written)")
    args = ap.parse_args(argv)
    named = [a.split("=", 1) for a in [args.reference, *args.runs]]
    summaries = {name: run_summary(folder, args.max_samples) for name, folder in named}
    ref_name = named[0][0]
    comparisons = {name: compare(summaries[ref_name], s) for name, s in summaries.items() if name != ref_name}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/engine_parity.py " + " ".join(sys.argv[1:] if argv is None else argv)
    clean = {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in summaries.items()}
    out.with_suffix(".json").write_text(json.dumps({"command": command, "reference": ref_name, "runs": clean,
                                                    "tests": comparisons}, indent=2))
    md = [f"# Output distribution of generate runs against `{ref_name}`", "", f"Command: `{command}`", "",
          *table_md(ref_name, summaries, comparisons), "",
          "Label shares are of the parsed rows; labels p: chi-square test of homogeneity of the label counts; "
          "parse p: chi-square (Fisher) test of parsed/unparseable; KS: two-sample Kolmogorov-Smirnov statistic "
          "on the word counts (whole numbers: conservative p). Verdict at alpha 0.01 per test.", "",
          "Differences of label shares (run - reference) with 95% intervals:", ""]
    for name, c in comparisons.items():
        md.append(f"- {name}: " + ", ".join(f"{k} {d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]"
                                             for k, d in c["label_share_diff_ci95"].items()))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
