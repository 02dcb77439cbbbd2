"""Benchmark one AFLite round at scale against m sequential scikit-learn fits, at equal convergence.

Data: the real embeddings of the AFLite run on the shared 20k SNLI sample (benchmarks/results/aflite_snli.md:
the first token of all-MiniLM-L6-v2 fine-tuned on the 10% warm-up slice, 1 epoch, max length 64; the
18,000 rows left after the warm-up), resampled with replacement (rows and labels together) to --rows
rows and standardised, float32. m random train parts of t rows each (the same parts on both sides).

Both sides fit the same objective, scikit-learn's LogisticRegression(C=1) (multinomial, L2, intercept
not penalised), to the same tolerance: stop when max|∇f_i| <= --tol (scikit-learn's ``tol`` is scipy
L-BFGS-B's ``gtol``, a bound on the largest gradient entry; ours tests the same quantity), with an
iteration cap high enough that every fit of both sides converges (checked and reported). Each side
then scores every row on the partitions that held it out (the predictability scores of one round).

- ``ours``: ``debiased_nli.methods.aflite.fit_linear_ensemble`` + ``heldout_correct`` (all m classifiers in
  one pass per iteration: two matrix products over the shared rows, preconditioned L-BFGS), torch.
- ``sklearn-A-B``: classifiers A..B-1 fitted one at a time with scikit-learn (lbfgs, float32 input as
  given), each predicting all rows. The m fits are split into units so that no unit runs long.

Every unit runs in a fresh process (wall time, CPU time, peak RSS of that process) and writes its result
to --work (one JSON per unit, skipped when present: the benchmark resumes). ``--units`` picks units to
run now; ``report`` merges what is there into benchmarks/results/aflite_bench.{json,md}. The speed-up is
the ratio of the summed times of the sklearn units to the time of ``ours``, measured back to back in one
session (see the md). The GPU path (``--device cuda``) is the same code: there ``ours`` runs on the GPU and
the sklearn units on the machine's CPU cores, and the md says whether units ran one after the other or at
the same time (from their start and finish times). ``--stem`` names the result files, so a GPU run does not
overwrite the CPU one.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, SHARED_DATA, machine, md_table, peak_rss_mb, write_result  # noqa: E402

#: the CPU-sized warm-up of the real run (benchmarks/results/aflite_snli.md)
REAL_RUN = {"share": 0.1, "seed": 0, "epochs": 1.0, "lr": 5e-5, "eps": 1e-8, "batch_size": 16, "max_length": 64}


def real_embeddings(encoder: str, path: str | None = None):
    """The fine-tuned first-token embeddings of the real run's rows (cached by the run; computed if not),
    or the arrays X and y of an .npz file."""
    if path:
        data = np.load(path)
        return data["X"], data["y"].astype(np.int64)
    from debiased_nli.data.loading import load_task
    from debiased_nli.methods.embeddings import WarmUpParams, compute_embeddings, warm_up_encoder
    ds = load_task("snli", data_files=str(SHARED_DATA / "snli/train_sample.parquet")).dataset
    wu = warm_up_encoder(ds, encoder, num_labels=3, params=WarmUpParams(**REAL_RUN))
    rest = ds.select(wu.rest(len(ds)))
    emb = compute_embeddings(rest, wu.model_dir, max_length=REAL_RUN["max_length"], pooling="cls")
    return emb, np.asarray(rest["label"], dtype=np.int64)


def problem(args):
    from debiased_nli.methods.aflite.algorithm import random_partitions, standardize
    emb, y = real_embeddings(args["encoder"], args["embeddings"])
    idx = np.random.default_rng(args["seed"]).integers(0, len(y), size=args["rows"])
    X = standardize(np.ascontiguousarray(emb[idx], dtype=np.float32))
    Y = y[idx]
    train = random_partitions(args["rows"], args["m"], args["train_size"], np.random.default_rng(args["seed"] + 1))
    return X, Y, train


def _child(unit, args, queue):
    import torch
    torch.set_num_threads(args["threads"])
    X, Y, train = problem(args)
    held = ~train
    work = Path(args["work"])
    base = peak_rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    if unit == "ours":
        from debiased_nli.methods.aflite.ensemble import LinearSolver, fit_linear_ensemble
        from debiased_nli.methods.aflite.algorithm import heldout_correct
        fit = fit_linear_ensemble(X, Y, train, 3, LinearSolver(tol=args["tol"], max_iter=args["max_iter"]),
                                  device=args["device"], progress=True)
        fit_s, fit_c = time.perf_counter() - t0, time.process_time() - c0
        n_held, n_corr = heldout_correct(Y, fit.logits, train)
        np.save(work / "ours_theta.npy", fit.theta.cpu().numpy())
        np.save(work / "ours_correct.npy", n_corr)
        out = {"n_iter": fit.n_iter.tolist(), "converged": fit.converged.tolist(), "grad_max": fit.grad_max.tolist(),
               "fit_seconds": fit_s, "fit_cpu_seconds": fit_c,
               "heldout_accuracy": float(n_corr.sum() / n_held.sum())}
    else:
        import warnings

        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression
        a, b = (int(v) for v in unit.split("-")[1:])
        correct = np.zeros(len(Y), dtype=np.int64)
        coefs, n_iter, gmax = [], [], []
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConvergenceWarning)  # a fit that does not converge fails the unit
            for i in range(a, b):
                lr = LogisticRegression(C=1.0, tol=args["tol"], max_iter=args["max_iter"]).fit(X[train[i]], Y[train[i]])
                n_iter.append(int(lr.n_iter_[0]))
                coefs.append(np.vstack([lr.coef_.T, lr.intercept_[None]]))
                correct += held[i] & (lr.predict(X) == Y)
                gmax.append(_sk_grad_max(lr, X[train[i]], Y[train[i]]))
        np.save(work / f"{unit}_theta.npy", np.stack(coefs))
        np.save(work / f"{unit}_correct.npy", correct)
        out = {"models": [a, b], "n_iter": n_iter, "grad_max": gmax, "dtype": str(coefs[0].dtype),
               "heldout_correct": int(correct.sum()), "heldout_total": int(held[a:b].sum())}
    out.update({"unit": unit, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                "peak_rss_mb": peak_rss_mb(), "rss_before_mb": base, "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    queue.put(out)


def _sk_grad_max(lr, X, y) -> float:
    """max|∇f| of scikit-learn's objective at its solution, in float64 (the quantity its tol bounds)."""
    X = X.astype(np.float64)
    W = np.vstack([lr.coef_.T, lr.intercept_[None]]).astype(np.float64)
    Z = X @ W[:-1] + W[-1]
    P = np.exp(Z - Z.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    P[np.arange(len(y)), y] -= 1
    P /= len(y)
    G = np.vstack([X.T @ P + W[:-1] / (lr.C * len(y)), P.sum(0)[None]])
    return float(np.abs(G).max())


def measure(unit, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(unit, args, q))
    p.start()
    out = q.get()
    p.join()
    return out


def sklearn_units(m: int, per_unit: int) -> list[str]:
    return [f"sklearn-{a}-{min(a + per_unit, m)}" for a in range(0, m, per_unit)]


def report(args, work: Path, out_dir: Path, cmd: str, stem: str = "aflite_bench") -> None:
    import torch
    units = ["ours"] + sklearn_units(args["m"], args["per_unit"])
    res = {u: json.loads((work / f"{u}.json").read_text()) for u in units if (work / f"{u}.json").exists()}
    missing = [u for u in units if u not in res]
    if missing:
        raise SystemExit(f"units not measured yet: {missing}; run them first (--units ...)")
    ours = res["ours"]
    sk = [res[u] for u in units[1:]]
    sk_iter = [i for r in sk for i in r["n_iter"]]
    sk_wall, sk_cpu = sum(r["seconds"] for r in sk), sum(r["cpu_seconds"] for r in sk)
    # agreement of the two sides: weights (centred over classes, softmax weights are defined up to a shift),
    # predictability scores
    theta_o = np.load(work / "ours_theta.npy").astype(np.float64)
    theta_s = np.concatenate([np.load(work / f"{u}_theta.npy") for u in units[1:]]).astype(np.float64)
    centre = (lambda t: t - t.mean(2, keepdims=True))
    wdiff = np.abs(centre(theta_o) - centre(theta_s)).max((1, 2))
    _, Y, train = problem(args)
    n_held = (~train).sum(0)
    corr_o = np.load(work / "ours_correct.npy")
    corr_s = sum(np.load(work / f"{u}_correct.npy") for u in units[1:])
    ok = n_held > 0
    sdiff = np.abs(corr_o[ok] - corr_s[ok]) / n_held[ok]
    result = {
        "args": args, "command": cmd,
        "machine": machine(torch=torch.__version__, sklearn=__import__("sklearn").__version__,
                           gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None),
        "units": res,
        "summary": {
            "ours": {"seconds": ours["seconds"], "cpu_seconds": ours["cpu_seconds"],
                     "fit_seconds": ours["fit_seconds"], "iter_median": float(np.median(ours["n_iter"])),
                     "iter_max": int(max(ours["n_iter"])), "converged": int(sum(ours["converged"])),
                     "grad_max": float(max(ours["grad_max"])), "heldout_accuracy": ours["heldout_accuracy"],
                     "peak_rss_mb": ours["peak_rss_mb"]},
            "sklearn": {"seconds": sk_wall, "cpu_seconds": sk_cpu, "iter_median": float(np.median(sk_iter)),
                        "iter_max": int(max(sk_iter)), "converged": len(sk_iter),
                        "grad_max": float(max(g for r in sk for g in r["grad_max"])), "dtype": sk[0]["dtype"],
                        "heldout_accuracy": float(corr_s.sum() / n_held.sum()),
                        "peak_rss_mb": max(r["peak_rss_mb"] for r in sk)},
            "speedup_wall": sk_wall / ours["seconds"], "speedup_cpu": sk_cpu / ours["cpu_seconds"],
            "weights_max_abs_diff": {"max": float(wdiff.max()), "median": float(np.median(wdiff))},
            "weights_scale": float(np.abs(centre(theta_s)).max()),
            "score_abs_diff": {"max": float(sdiff.max()), "mean": float(sdiff.mean()),
                               "share_within_1.5_over_m": float((sdiff <= 1.5 / args["m"]).mean())},
        },
    }
    write_result(out_dir / stem, result, render(result), quiet=True)


def overlapping(units: dict) -> int:
    """The most units that were running at one moment (1: one after the other), from each unit's finish time
    and wall seconds."""
    import datetime as dt
    spans = []
    for v in units.values():
        end = dt.datetime.strptime(v["finished"], "%Y-%m-%d %H:%M:%S").timestamp()
        spans.append((end - v["seconds"], end))
    return max(sum(a < e and s < b for s, e in spans) for a, b in spans)


def render(r) -> str:
    a, s, u = r["args"], r["summary"], r["units"]
    o, k = s["ours"], s["sklearn"]
    L = ["# AFLite: one round of m linear models, batched vs sequential scikit-learn", "",
         f"Command: `{r['command']}`", "",
         f"Machine: {r['machine']['cpus']} CPU cores"
         + (f" and one {r['machine']['gpu']}" if r["machine"].get("gpu") else " shared with other jobs")
         + f", torch {r['machine']['torch']}, "
         f"scikit-learn {r['machine']['sklearn']}, {a['threads']} thread(s) on each side (OMP_NUM_THREADS=1), "
         f"device {a['device'] or 'cpu'}. Data: the real fine-tuned first-token embeddings of the AFLite SNLI run "
         f"(18,000 rows x 384, `aflite_snli.md`), resampled to {a['rows']:,} rows and standardised, float32. "
         f"m = {a['m']} random train parts of t = {a['train_size']:,} rows (t/N = {a['train_size'] / a['rows']:.2f}), "
         f"the same parts on both sides; C = 1; tol = {a['tol']:g} on max|∇| for both; iteration cap {a['max_iter']:,} "
         f"(not reached). Each unit ran in a fresh process; the sklearn fits ran in {len(u) - 1} units of "
         f"{a['per_unit']} (the times are summed).", "",
         *md_table(["", "wall s", "CPU s", "L-BFGS iterations, median (max)", "converged", "largest max\\|∇\\|",
                    "held-out accuracy", "peak RSS MB"],
                   [[what, f"{x['seconds']:.1f}", f"{x['cpu_seconds']:.1f}", f"{x['iter_median']:.0f} ({x['iter_max']})",
                     f"{x['converged']}/{a['m']}", f"{x['grad_max']:.1e}", f"{x['heldout_accuracy']:.4f}",
                     f"{x['peak_rss_mb']:.0f}"] for what, x in (
                       (f"ours: `fit_linear_ensemble` (one pass of 2 GEMMs per iteration for all {a['m']}, preconditioned "
                        "L-BFGS)", o),
                       (f"{a['m']} x scikit-learn `LogisticRegression(lbfgs)`, one after the other ({k['dtype']})", k))]),
         "",
         f"**Speed-up (scikit-learn / ours): {s['speedup_wall']:.1f}x wall, {s['speedup_cpu']:.1f}x CPU time.** "
         f"Ours: {o['fit_seconds']:.1f} s of the {o['seconds']:.1f} s are the fit, the rest the held-out scores.",
         "",
         f"Agreement: largest |centred weight difference| per model, max {s['weights_max_abs_diff']['max']:.3f}, median "
         f"{s['weights_max_abs_diff']['median']:.3f} (largest centred weight {s['weights_scale']:.2f}); predictability "
         f"scores differ by at most {s['score_abs_diff']['max']:.3f} (mean {s['score_abs_diff']['mean']:.4f}; "
         f"{100 * s['score_abs_diff']['share_within_1.5_over_m']:.1f}% of rows within 1.5/m). Both sides stop at "
         f"max|∇| <= {a['tol']:g}, which leaves this much freedom along the flattest directions (curvature ~ "
         f"1/(C t)); at a tight tolerance the two agree to 1e-5 (tests/test_aflite.py).", "",
         ("Units (finish times show they ran back to back):" if (n := overlapping(u)) == 1 else
          f"Units (up to {n} ran at the same time, each in its own process on its own cores; the sklearn "
          f"total is the sum of their wall times, as if run one after the other):"), "",
         *md_table(["unit", "wall s", "CPU s", "finished"],
                   [[name, f"{v['seconds']:.1f}", f"{v['cpu_seconds']:.1f}", v["finished"]] for name, v in u.items()])]
    return "\n".join(L) + "\n"


def main(argv=None):
    from debiased_nli.methods.embeddings import OFFLINE_ENCODER
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--train-size", type=int, default=50_000, help="t (default 50,000: a 10%% warm-up of 500k)")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--max-iter", type=int, default=10_000)
    ap.add_argument("--per-unit", type=int, default=16, help="sklearn fits per unit")
    ap.add_argument("--encoder", default=OFFLINE_ENCODER)
    ap.add_argument("--embeddings", help="an .npz with X (rows x dim) and y instead of the real run's embeddings")
    ap.add_argument("--device", help="torch device of ours (default cpu)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--units", nargs="*", default=None,
                    help="units to run now: ours, sklearn-A-B, all (default: every missing unit), report")
    ap.add_argument("--work", help="folder of the per-unit results (default: <cache>/bench-aflite-<rows>-<t>-<m>)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--stem", default="aflite_bench", help="name of the result files in --out (default aflite_bench)")
    a = ap.parse_args(argv)
    from debiased_nli.utils.cache import default_cache_dir
    work = Path(a.work or default_cache_dir() / f"bench-aflite-{a.rows}-{a.train_size}-{a.m}")
    args = {"rows": a.rows, "train_size": a.train_size, "m": a.m, "tol": a.tol, "max_iter": a.max_iter,
            "per_unit": a.per_unit, "encoder": a.encoder, "embeddings": a.embeddings, "device": a.device,
            "threads": a.threads, "seed": a.seed, "work": str(work)}
    work.mkdir(parents=True, exist_ok=True)
    units = ["ours"] + sklearn_units(a.m, a.per_unit)
    todo = units if a.units in (None, [], ["all"]) else [u for u in a.units if u != "report"]
    real_embeddings(a.encoder, a.embeddings)  # embed (or read the cache) once, before timing
    for unit in todo:
        if unit not in units:
            raise SystemExit(f"unknown unit {unit!r}; units: {units}")
        path = work / f"{unit}.json"
        if path.exists():
            continue
        res = measure(unit, args)
        path.write_text(json.dumps(res) + "\n")
        print(json.dumps({k: v for k, v in res.items() if k not in ("n_iter", "converged", "grad_max")}), flush=True)
    if all((work / f"{u}.json").exists() for u in units):
        cmd = (f"OMP_NUM_THREADS=1 python benchmarks/bench_aflite.py --rows {a.rows} --train-size {a.train_size} "
               f"--m {a.m} --tol {a.tol:g} --max-iter {a.max_iter} --per-unit {a.per_unit}"
               + (f" --device {a.device}" if a.device else "") + (f" --embeddings {a.embeddings}" if a.embeddings else ""))
        report(args, work, Path(a.out), cmd + (f" --stem {a.stem}" if a.stem != "aflite_bench" else ""), a.stem)


if __name__ == "__main__":
    main()
