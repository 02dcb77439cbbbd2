"""Benchmark AFLite at scale: 500k rows of 384-d embeddings, m = 64 (run by hand, never in tests).

The embeddings are real all-MiniLM-L6-v2 pair embeddings of the shared SNLI training sample
(computed once with debiased_nli.embeddings.compute_embeddings and cached), resampled with
replacement (rows and their labels together) to --rows rows. Measured, each in a fresh process
(wall time and peak resident memory of that process):

1. one AFLite round (m batched logistic regressions + the scores) on all rows;
2. a full AFLite run (until fewer than k rows pass tau or n rows remain);
3. the same m = 64 fits on a slice (--slice rows, train size slice/5), once batched (ours: groups of
   partitions with gathered rows, see debiased_nli.aflite.fit_linear_ensemble) and once as 64
   sequential scikit-learn LogisticRegression(lbfgs) fits on the same partitions, back to back,
   --repeat times: the ratio of wall times and of process CPU times (the CPU time is less sensitive
   to other jobs on a shared machine).

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
    t0, c0 = time.perf_counter(), time.process_time()
    budget = {"memory_budget": args["memory_budget"], "group_size": args["group_size"]}
    out = {}
    if task == "round":
        sr = predictability_scores(X, Y, 3, m=args["m"], train_size=len(Y) // 5, rng=np.random.default_rng(0),
                                   max_iter=args["max_iter"], **budget)
        out = {"heldout_accuracy": sr.heldout_accuracy, "lbfgs_iter_max": sr.n_iter_max,
               "converged_share": sr.converged, "passing_tau": int((sr.scores >= 0.75).sum())}
    elif task == "full":
        res = aflite(X, Y, 3, m=args["m"], k=args["k"], target_n=args["target_n"], max_iter=args["max_iter"],
                     standardize_embeddings=False, seed=0, progress=False, **budget)
        out = {"rounds": len(res.history), "kept": int(len(res.kept_indices)), "stop_reason": res.stop_reason,
               "history": [{k: h[k] for k in ("size_before", "candidates", "removed", "heldout_accuracy",
                                                "lbfgs_iter_max")} for h in res.history]}
    elif task == "slice_batched":
        train = random_partitions(len(Y), args["m"], len(Y) // 5, np.random.default_rng(1))
        sr = predictability_scores(X, Y, 3, m=args["m"], train_size=len(Y) // 5, rng=None, train_mask=train,
                                   max_iter=args["max_iter"], **budget)
        out = {"heldout_accuracy": sr.heldout_accuracy, "scores": sr.scores.tolist(), "lbfgs_iter_max": sr.n_iter_max}
    elif task == "slice_sklearn":
        import warnings
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression
        train = random_partitions(len(Y), args["m"], len(Y) // 5, np.random.default_rng(1))
        held = ~train
        correct = np.zeros(len(Y))
        n_iter = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            for i in range(args["m"]):
                lr = LogisticRegression(C=1.0, max_iter=args["max_iter"], tol=1e-4).fit(X[train[i]], Y[train[i]])
                n_iter.append(int(lr.n_iter_.max()))
                correct += held[i] & (lr.predict(X) == Y)
        scores = correct / held.sum(0)
        out = {"heldout_accuracy": float(correct.sum() / held.sum()), "scores": scores.tolist(),
               "lbfgs_iter_max": max(n_iter), "lbfgs_iter_mean": float(np.mean(n_iter))}
    out.update({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "peak_rss_mb": _peak_mb(), "rss_before_mb": base})
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
    ap.add_argument("--memory-budget", type=float, default=1024,
                    help="MiB for the gathered train rows of one group of partitions (default 1024)")
    ap.add_argument("--group-size", type=int, help="partitions trained together (default: from the budget)")
    ap.add_argument("--repeat", type=int, default=2, help="back-to-back repetitions of the slice comparison")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["round", "full", "slice"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    a = ap.parse_args(argv)
    args = {"rows": a.rows, "n_real": a.n_real, "encoder": a.encoder, "m": a.m, "max_iter": a.max_iter,
            "k": a.k or a.rows // 5, "target_n": a.target_n or a.rows // 2, "slice": a.slice, "slice_max_iter": a.slice_max_iter, "threads": a.threads,
            "seed": a.seed, "memory_budget": int(a.memory_budget * 2**20), "group_size": a.group_size}
    real_embeddings(a.n_real, a.encoder)  # embed (or read the cache) once, before timing
    results = {"args": args, "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                                         "platform": platform.platform()}}
    import torch
    results["machine"]["torch"] = torch.__version__
    if "slice" not in a.skip:
        sargs = {**args, "max_iter": a.slice_max_iter}
        runs = []
        for rep in range(a.repeat):  # back to back: ours, then sklearn, on the same partitions
            ours = measure("slice_batched", sargs)
            skl = measure("slice_sklearn", sargs)
            agree = float(np.mean(np.abs(np.asarray(ours.pop("scores")) - np.asarray(skl.pop("scores"))) <= 1.5 / a.m))
            runs.append({"batched_torch": ours, "sklearn_sequential": skl, "speedup": skl["seconds"] / ours["seconds"],
                         "speedup_cpu": skl["cpu_seconds"] / ours["cpu_seconds"],
                         "share_of_scores_within_1.5_over_m": agree})
            print(json.dumps(runs[-1]), flush=True)
        from debiased_nli.aflite import group_size_for
        g = a.group_size or group_size_for(a.m, a.slice // 5, 384, 3, memory_budget=args["memory_budget"])
        results["slice"] = {"rows": a.slice, "train_size": a.slice // 5, "group_size": g, "runs": runs}
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
         f"{a['threads']} thread(s), memory budget {a['memory_budget'] / 2**20:.0f} MiB per group of partitions. Embeddings: real all-MiniLM-L6-v2 pair embeddings of {a['n_real']:,} SNLI "
         f"training rows, resampled to {a['rows']:,} rows x 384. m = {a['m']}, L-BFGS max {a['max_iter']} "
         f"iterations per round, tau 0.75. Each measurement runs in a fresh process; memory is the peak "
         f"resident set of that process (the line 'before' is after loading the data).", ""]
    if "slice" in r:
        s = r["slice"]
        L += [f"## Batched vs {a['m']} sequential scikit-learn fits ({s['rows']:,} rows, t = {s['train_size']:,}, "
              f"max {a['slice_max_iter']} L-BFGS iterations on both sides)", "",
              f"Ours trains {s['group_size']} partitions at a time (gathered rows, batched matrix products). Each "
              f"repetition runs ours, then scikit-learn, back to back, each in a fresh process.", "",
              "| repetition | | wall s | CPU s | peak RSS MB | held-out accuracy | max L-BFGS iterations |",
              "|---|---|---|---|---|---|---|"]
        for i, run in enumerate(s["runs"]):
            for key, name in (("batched_torch", "batched torch (ours)"),
                              ("sklearn_sequential", f"{a['m']} x sklearn LogisticRegression (lbfgs)")):
                x = run[key]
                L.append(f"| {i + 1} | {name} | {x['seconds']:.1f} | {x['cpu_seconds']:.1f} | {x['peak_rss_mb']:.0f} | "
                         f"{x['heldout_accuracy']:.4f} | {x['lbfgs_iter_max']} |")
        L.append("")
        for i, run in enumerate(s["runs"]):
            L.append(f"- repetition {i + 1}: speed-up (sklearn time / ours) **{run['speedup']:.2f}x** wall, "
                     f"**{run['speedup_cpu']:.2f}x** CPU; rows whose predictability score differs by at most 1.5/m "
                     f"between the two: {100 * run['share_of_scores_within_1.5_over_m']:.1f}%")
        L.append("")
    if "one_round" in r:
        o = r["one_round"]
        L += [f"## One round on {a['rows']:,} rows (t = {a['rows'] // 5:,})", "",
              f"- wall time {o['seconds']:.1f} s (CPU {o['cpu_seconds']:.1f} s); peak RSS {o['peak_rss_mb']:.0f} MB (before: {o['rss_before_mb']:.0f} MB)",
              f"- held-out accuracy {o['heldout_accuracy']:.4f}; L-BFGS iterations {o['lbfgs_iter_max']}; "
              f"converged share {o['converged_share']:.2f}; rows with score >= 0.75: {o['passing_tau']:,}", ""]
    if "full_run" in r:
        f = r["full_run"]
        L += [f"## Full run on {a['rows']:,} rows (k = {a['k']:,}, n = {a['target_n']:,})", "",
              f"- wall time {f['seconds']:.1f} s (CPU {f['cpu_seconds']:.1f} s); peak RSS {f['peak_rss_mb']:.0f} MB; {f['rounds']} round(s); kept "
              f"{f['kept']:,}; stop: {f['stop_reason']}", "", "| rows | score >= tau | removed | held-out acc | L-BFGS iter |",
              "|---|---|---|---|---|"]
        L += [f"| {h['size_before']:,} | {h['candidates']:,} | {h['removed']:,} | {h['heldout_accuracy']:.4f} | "
              f"{h['lbfgs_iter_max']} |" for h in f["history"]]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
