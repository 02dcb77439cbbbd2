"""Benchmark AFLite at scale: 500k rows of 384-d embeddings, m = 64 (run by hand, never in tests).

The embeddings are real all-MiniLM-L6-v2 pair embeddings of the shared SNLI training sample
(computed once with debiased_nli.embeddings.compute_embeddings and cached), resampled with
replacement (rows and their labels together) to --rows rows. Measured, each in a fresh process
(wall time and peak resident memory of that process):

1. one AFLite round (m batched logistic regressions + the scores) on all rows;
2. a full AFLite run (until fewer than k rows pass tau or n rows remain);
3. the same m = 64 fits on a slice (--slice rows, train size slice/5), once batched (ours) and once as
   64 sequential scikit-learn LogisticRegression(lbfgs) fits on the same partitions: the ratio.

Writes benchmarks/results/aflite_bench.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DEBIASED_NLI_SHARED", ROOT.parent / "shared"))


def real_embeddings(n_real: int, encoder: str):
    from debiased_nli.data import load_task
    from debiased_nli.embeddings import compute_embeddings
    ds = load_task("snli", data_files=str(SHARED / "data/snli/train_sample.parquet")).dataset
    if n_real < len(ds):
        ds = ds.select(range(n_real))
    emb = compute_embeddings(ds, encoder, batch_size=64)
    return emb, np.asarray(ds["label"], dtype=np.int64)


def resampled(emb, y, rows, seed):
    idx = np.random.default_rng(seed).integers(0, len(y), size=rows)
    return np.ascontiguousarray(emb[idx]), y[idx]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _child(task, args, queue):
    import torch
    torch.set_num_threads(args["threads"])
    from debiased_nli.aflite import aflite, predictability_scores, random_partitions, standardize
    emb, y = real_embeddings(args["n_real"], args["encoder"])
    X, Y = resampled(emb, y, args["rows"] if task in ("round", "full") else args["slice"], args["seed"])
    X = standardize(X)
    base = _peak_mb()
    t0 = time.perf_counter()
    out = {}
    if task == "round":
        sr = predictability_scores(X, Y, 3, m=args["m"], train_size=len(Y) // 5, rng=np.random.default_rng(0),
                                   max_iter=args["max_iter"])
        out = {"heldout_accuracy": sr.heldout_accuracy, "lbfgs_iter_max": sr.n_iter_max,
               "converged_share": sr.converged, "passing_tau": int((sr.scores >= 0.75).sum())}
    elif task == "full":
        res = aflite(X, Y, 3, m=args["m"], k=args["k"], target_n=args["target_n"], max_iter=args["max_iter"],
                     standardize_embeddings=False, seed=0, progress=False)
        out = {"rounds": len(res.history), "kept": int(len(res.kept_indices)), "stop_reason": res.stop_reason,
               "history": [{k: h[k] for k in ("size_before", "candidates", "removed", "heldout_accuracy",
                                                "lbfgs_iter_max")} for h in res.history]}
    elif task == "slice_batched":
        train = random_partitions(len(Y), args["m"], len(Y) // 5, np.random.default_rng(1))
        sr = predictability_scores(X, Y, 3, m=args["m"], train_size=len(Y) // 5, rng=None, train_mask=train,
                                   max_iter=args["max_iter"])
        out = {"heldout_accuracy": sr.heldout_accuracy, "scores": sr.scores.tolist()}
    elif task == "slice_sklearn":
        import warnings
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression
        train = random_partitions(len(Y), args["m"], len(Y) // 5, np.random.default_rng(1))
        held = ~train
        correct = np.zeros(len(Y))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            for i in range(args["m"]):
                lr = LogisticRegression(C=1.0, max_iter=args["max_iter"], tol=1e-4).fit(X[train[i]], Y[train[i]])
                correct += held[i] & (lr.predict(X) == Y)
        scores = correct / held.sum(0)
        out = {"heldout_accuracy": float(correct.sum() / held.sum()), "scores": scores.tolist()}
    out.update({"seconds": time.perf_counter() - t0, "peak_rss_mb": _peak_mb(), "rss_before_mb": base})
    queue.put(out)


def measure(task, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(task, args, q))
    p.start()
    out = q.get()
    p.join()
    return out


def main(argv=None):
    from debiased_nli.embeddings import OFFLINE_ENCODER
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--n-real", type=int, default=20_000, help="real rows embedded, then resampled")
    ap.add_argument("--encoder", default=OFFLINE_ENCODER)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--max-iter", type=int, default=100, help="L-BFGS iterations per round")
    ap.add_argument("--k", type=int, help="slice size of the full run (default rows/5)")
    ap.add_argument("--target-n", type=int, help="target size of the full run (default rows/2)")
    ap.add_argument("--slice", type=int, default=20_000, help="rows of the batched-vs-sklearn comparison")
    ap.add_argument("--slice-max-iter", type=int, default=100, help="L-BFGS iterations in the comparison (both sides)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["round", "full", "slice"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    a = ap.parse_args(argv)
    args = {"rows": a.rows, "n_real": a.n_real, "encoder": a.encoder, "m": a.m, "max_iter": a.max_iter,
            "k": a.k or a.rows // 5, "target_n": a.target_n or a.rows // 2, "slice": a.slice, "slice_max_iter": a.slice_max_iter, "threads": a.threads,
            "seed": a.seed}
    real_embeddings(a.n_real, a.encoder)  # embed (or read the cache) once, before timing
    results = {"args": args, "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                                         "platform": platform.platform()}}
    import torch
    results["machine"]["torch"] = torch.__version__
    if "slice" not in a.skip:
        sargs = {**args, "max_iter": a.slice_max_iter}
        ours = measure("slice_batched", sargs)
        skl = measure("slice_sklearn", sargs)
        agree = float(np.mean(np.abs(np.asarray(ours.pop("scores")) - np.asarray(skl.pop("scores"))) <= 1.5 / a.m))
        results["slice"] = {"rows": a.slice, "train_size": a.slice // 5, "batched_torch": ours, "sklearn_sequential": skl,
                            "speedup": skl["seconds"] / ours["seconds"],
                            "share_of_scores_within_1.5_over_m": agree}
        print(json.dumps(results["slice"]), flush=True)
    if "round" not in a.skip:
        results["one_round"] = measure("round", args)
        print(json.dumps(results["one_round"]), flush=True)
    if "full" not in a.skip:
        results["full_run"] = measure("full", args)
        print(json.dumps(results["full_run"]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "aflite_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "aflite_bench.md").write_text(render(results, " ".join(sys.argv)))


def render(r, cmd):
    a = r["args"]
    L = ["# AFLite benchmark", "", f"Command: `OMP_NUM_THREADS={a['threads']} python {cmd}`", "",
         f"Machine: {r['machine']['cpu_count']} CPU cores (shared with other jobs), torch {r['machine']['torch']}, "
         f"{a['threads']} thread(s). Embeddings: real all-MiniLM-L6-v2 pair embeddings of {a['n_real']:,} SNLI "
         f"training rows, resampled to {a['rows']:,} rows x 384. m = {a['m']}, L-BFGS max {a['max_iter']} "
         f"iterations per round, tau 0.75. Each measurement runs in a fresh process; memory is the peak "
         f"resident set of that process (the line 'before' is after loading the data).", ""]
    if "slice" in r:
        s = r["slice"]
        L += [f"## Batched vs {a['m']} sequential scikit-learn fits ({s['rows']:,} rows, t = {s['train_size']:,}, "
              f"max {a['slice_max_iter']} L-BFGS iterations on both sides)", "",
              "| | seconds | peak RSS MB | held-out accuracy |", "|---|---|---|---|",
              f"| batched torch (ours) | {s['batched_torch']['seconds']:.1f} | {s['batched_torch']['peak_rss_mb']:.0f} | "
              f"{s['batched_torch']['heldout_accuracy']:.4f} |",
              f"| {a['m']} x sklearn LogisticRegression (lbfgs) | {s['sklearn_sequential']['seconds']:.1f} | "
              f"{s['sklearn_sequential']['peak_rss_mb']:.0f} | {s['sklearn_sequential']['heldout_accuracy']:.4f} |", "",
              f"Speed-up (sklearn time / ours): **{s['speedup']:.2f}x**. Rows whose predictability score differs by "
              f"at most 1.5/m between the two: {100 * s['share_of_scores_within_1.5_over_m']:.1f}%.", ""]
    if "one_round" in r:
        o = r["one_round"]
        L += [f"## One round on {a['rows']:,} rows (t = {a['rows'] // 5:,})", "",
              f"- wall time {o['seconds']:.1f} s; peak RSS {o['peak_rss_mb']:.0f} MB (before: {o['rss_before_mb']:.0f} MB)",
              f"- held-out accuracy {o['heldout_accuracy']:.4f}; L-BFGS iterations {o['lbfgs_iter_max']}; "
              f"converged share {o['converged_share']:.2f}; rows with score >= 0.75: {o['passing_tau']:,}", ""]
    if "full_run" in r:
        f = r["full_run"]
        L += [f"## Full run on {a['rows']:,} rows (k = {a['k']:,}, n = {a['target_n']:,})", "",
              f"- wall time {f['seconds']:.1f} s; peak RSS {f['peak_rss_mb']:.0f} MB; {f['rounds']} round(s); kept "
              f"{f['kept']:,}; stop: {f['stop_reason']}", "", "| rows | score >= tau | removed | held-out acc | L-BFGS iter |",
              "|---|---|---|---|---|"]
        L += [f"| {h['size_before']:,} | {h['candidates']:,} | {h['removed']:,} | {h['heldout_accuracy']:.4f} | "
              f"{h['lbfgs_iter_max']} |" for h in f["history"]]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
