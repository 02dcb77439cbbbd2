"""Feature mapping + z-statistics on 1M rows resampled from the real NLI rows in ../shared/data.

    python benchmarks/bench_features.py [--rows 1000000] [--num-proc 2]

Each stage runs in its own interpreter (its peak memory is its own):
- lexical: the row-local extractors (unigrams, bigrams, length, ratio, overlap, null) with
  ``datasets.map`` (num_proc workers), then the feature matrix and the z-statistics of every
  feature and label;
- hypothesis-only: the out-of-fold TF-IDF + logistic regression model on the same rows (timed
  separately, as the issue asks);
- baseline: a straightforward per-row Python implementation (regex tokenisation, dict counting,
  z per feature) on a slice, for the speed ratio.
Writes benchmarks/results/features_bench.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (RESULTS, command, machine, md_table, peak_rss_mb, real_nli_rows,  # noqa: E402
                               run_stage, write_result)

LEXICAL = ["unigram_v1", "bigram_v1", "hypo_len_v1", "len_ratio_v1", "overlap_v1", "null_v1"]
LABELS = ["entailment", "neutral", "contradiction"]


def resampled(n: int, seed: int = 0):
    import numpy as np

    pool = real_nli_rows()
    idx = np.random.default_rng(seed).integers(0, len(pool), size=n)
    return pool.select(idx).flatten_indices(), len(pool)


def stage_lexical(rows: int, num_proc: int) -> dict:
    from debiased_nli.bias.features import add_feature_columns, build_feature_matrix
    from debiased_nli.bias.zstats import compute_zstats
    from debiased_nli.data.loading import labels_of

    ds, pool = resampled(rows)
    base = peak_rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        out = add_feature_columns(ds, LEXICAL, LABELS, num_proc=num_proc if num_proc > 1 else None,
                                  cache_file_name=os.path.join(tmp, "features.arrow"))
        t1 = time.perf_counter()
        fm = build_feature_matrix(out)
        t2 = time.perf_counter()
        zs = compute_zstats(fm, labels_of(out), LABELS)
        top = zs.top_k(20)
        t3 = time.perf_counter()
        return {"rows": rows, "pool_unique_rows": pool, "num_proc": num_proc, "features_s": t1 - t0,
                "matrix_s": t2 - t1, "zstats_s": t3 - t2, "total_s": t3 - t0,
                "rows_per_s": rows / (t3 - t0), "n_features": int(fm.n_features), "entries": int(len(fm.indices)),
                "peak_rss_mb": peak_rss_mb(), "rss_before_mb": base,
                "top_contradiction": [str(zs.vocab[i]) for i in top[2][:5]]}


def stage_hypothesis_only(rows: int) -> dict:
    from debiased_nli.bias.features import add_feature_columns, build_feature_matrix
    from debiased_nli.bias.hypothesis_only import out_of_fold_tfidf
    from debiased_nli.data.loading import labels_of

    ds, _ = resampled(rows)
    with tempfile.TemporaryDirectory() as tmp:
        out = add_feature_columns(ds, ["unigram_v1", "bigram_v1"], LABELS, num_proc=2,
                                  cache_file_name=os.path.join(tmp, "f.arrow"))
        fm = build_feature_matrix(out)
        t0 = time.perf_counter()
        res = out_of_fold_tfidf(fm, labels_of(out), 3, progress=False)
        t1 = time.perf_counter()
    return {"rows": rows, "seconds": t1 - t0, "rows_per_s": rows / (t1 - t0), "accuracy": res.accuracy,
            "peak_rss_mb": peak_rss_mb()}


def _tok(text: str) -> list[str]:
    return [t.strip("'") for t in re.findall(r"[\w']+", text.lower()) if t.strip("'")]


def stage_baseline(rows: int) -> dict:
    """Straightforward per-row Python: tokenise, build the feature set, count in dicts, z per feature."""
    ds, _ = resampled(rows, seed=1)
    prem, hyp, lab = ds["premise"], ds["hypothesis"], ds["label"]
    t0 = time.perf_counter()
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for p, h, l in zip(prem, hyp, lab):
        pt, ht = _tok(p), _tok(h)
        feats = {f"{w}@premise" for w in pt} | {f"{w}@hypothesis" for w in ht}
        feats |= {f"{a} {b}@premise" for a, b in zip(pt, pt[1:])} | {f"{a} {b}@hypothesis" for a, b in zip(ht, ht[1:])}
        feats.add(f"hypo-len{min(len(ht) // 5, 4)}")
        feats.add(f"ratio{min(int(4 * len(ht) / max(len(pt), 1)), 4)}")
        share = sum(w in set(pt) for w in ht) / max(len(ht), 1)
        feats.add(f"overlap{min(int(share * 5), 4)}")
        feats.add("<null>")
        for f in feats:
            counts[f][l] += 1
    p0 = 1 / 3
    z = {}
    for f, c in counts.items():
        n = sum(c)
        z[f] = [(c[l] / n - p0) / math.sqrt(p0 * (1 - p0) / n) for l in range(3)]
    top = [sorted(z, key=lambda f: -z[f][l])[:20] for l in range(3)]
    t1 = time.perf_counter()
    return {"rows": rows, "seconds": t1 - t0, "rows_per_s": rows / (t1 - t0), "top_contradiction": top[2][:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--baseline-rows", type=int, default=50_000)
    ap.add_argument("--hypothesis-only-rows", type=int, default=200_000,
                    help="rows for the (separately timed) out-of-fold hypothesis-only model")
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--stage")
    args = ap.parse_args()
    if args.stage:
        print(json.dumps({"lexical": lambda: stage_lexical(args.rows, args.num_proc), "baseline": lambda: stage_baseline(
            args.rows), "hypothesis_only": lambda: stage_hypothesis_only(args.rows)}[args.stage]()))
        return
    os.environ["DEBIASED_NLI_CACHE"] = tempfile.mkdtemp(prefix="bench-features-cache-")
    script = Path(__file__).resolve()
    r = {"machine": machine(), "command": command("bench_features.py")}
    r["baseline"] = run_stage(script, "baseline", "--rows", str(args.baseline_rows))
    r["lexical_1proc"] = run_stage(script, "lexical", "--rows", str(args.rows), "--num-proc", "1")
    r["lexical"] = run_stage(script, "lexical", "--rows", str(args.rows), "--num-proc", str(args.num_proc)) \
        if args.num_proc > 1 else r["lexical_1proc"]
    r["hypothesis_only"] = run_stage(script, "hypothesis_only", "--rows", str(args.hypothesis_only_rows))
    lex, one, hyp, base = r["lexical"], r["lexical_1proc"], r["hypothesis_only"], r["baseline"]
    r["speedup_vs_baseline_per_row"] = lex["rows_per_s"] / base["rows_per_s"]
    write_result(RESULTS / "features_bench", r, [
        "# Feature mapping + z-statistics at 1M rows", "",
        f"Command: `{r['command']}` ({r['machine']['cpus']} CPUs). Rows are resampled (with replacement, seed 0) from "
        f"the {lex['pool_unique_rows']:,} real NLI rows of ../shared/data (SNLI train sample, dev, test; MNLI dev "
        "matched and mismatched). Each stage ran in its own process.", "",
        *md_table(["stage", "rows", "wall (s)", "rows/s", "peak RSS (MB)"], [
            [f"lexical features + matrix + z-statistics, num_proc={lex['num_proc']}", f"{lex['rows']:,}",
             f"{lex['total_s']:.1f}", f"{lex['rows_per_s']:,.0f}", f"{lex['peak_rss_mb']:,.0f}"],
            ["the same, 1 process", f"{one['rows']:,}", f"{one['total_s']:.1f}", f"{one['rows_per_s']:,.0f}",
             f"{one['peak_rss_mb']:,.0f}"],
            ["hypothesis-only model (5-fold out-of-fold TF-IDF + LR)", f"{hyp['rows']:,}", f"{hyp['seconds']:.1f}",
             f"{hyp['rows_per_s']:,.0f}", f"{hyp['peak_rss_mb']:,.0f}"],
            ["baseline: per-row Python, dict counts", f"{base['rows']:,}", f"{base['seconds']:.1f}",
             f"{base['rows_per_s']:,.0f}", ""]], "lrrrr"), "",
        f"Split of the lexical stage: features {lex['features_s']:.1f} s, feature matrix {lex['matrix_s']:.1f} s, "
        f"z-statistics {lex['zstats_s']:.2f} s; {lex['n_features']:,} features, {lex['entries']:,} (row, feature) entries.",
        "", f"**Speed-up over the per-row baseline (rows/s ratio, same run): {r['speedup_vs_baseline_per_row']:.1f}x.** "
        "Target: lexical features and z-statistics of 1M rows in under 60 s and 4 GB on 2 cores.", "",
        f"Peak RSS includes the resampled 1M-row dataset held in memory (the process was at {lex['rss_before_mb']:,.0f} MB "
        "before features)."])


if __name__ == "__main__":
    main()
