"""How often does an interval of `debiased-nli compare` cover the true difference? A simulation of unit
predictions with known seed and row variance (issue 46).

Each simulated comparison has two recipes, A and B, scored on the same test rows by k seeds each. Row i has a
difficulty eta_i ~ N(0, row_sd) and A's advantage on it tau_i ~ N(effect, effect_sd) (logits); seed s of a recipe
shifts every row by u_s ~ N(0, seed_sd), and its model gets row i right with probability
expit(eta_i [+ tau_i] + u_s). The true difference is the expected accuracy of A minus B over rows, seeds and
models, E expit(N(effect, sd_A)) - E expit(N(0, sd_B)), computed by Gauss-Hermite quadrature (the sums of
independent normals are normal). The default scenario is set to the committed MNLI-hard units: two seeds of a
recipe agree on 85% of the rows (84-88% measured), a seed's accuracy has a standard deviation of about 1.3 points
(0.9-1.8 measured), and seeds carry about 90% of the variance of a difference (65-94% measured on MNLI-hard and
HANS).

Scenarios:

* ``seeds``: the default, k = 3, 5, 10 seeds a side, 3,000 rows: the seed-row t interval
  (:func:`debiased_nli.evaluation.significance.seed_row_interval`) against the nested bootstrap it replaces
  (:func:`~debiased_nli.evaluation.significance.paired_bootstrap`);
* ``rows``: the same with a seed spread of about 0.3 points (seed_sd 0.05), so that the test rows carry 40% of the
  variance and the seed-by-row noise matters (SNLI test-hard's share in the committed units: 38-40% rows): the
  bootstrap, which counts that noise in both stages, over-covers there;
* ``clusters``: 30 clusters of 100 rows (HANS's subcases), the cluster shifting both the difficulty and A's
  advantage: the interval with the clusters against one that treats the rows as independent;
* ``machines``: seeds split over two machines (3 + 2, 5 + 5), each machine shifting each recipe by its own
  amount; the true difference is the one on that mix: stratified by machine against not.

    python benchmarks/interval_coverage.py           # benchmarks/results/interval_coverage.{md,json} (~8 min on 1 core)

``tests/test_significance.py`` runs the same code with fewer replications and asserts the coverage.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from debiased_nli.evaluation.significance import paired_bootstrap, seed_row_interval  # noqa: E402

# logit-scale parameters of the default scenario (see the module docstring for what they reproduce)
SEEDS_SCENARIO = {"rows": 3000, "row_sd": 5.0, "effect": 0.1, "effect_sd": 1.5, "seed_sd": 0.2}
ROWS_SCENARIO = {"seed_sd": 0.05}  # the test rows' share of the variance about 40%
CLUSTERS = 30
MACHINE_SHIFT = {"a": (0.0, 0.4), "b": (0.0, -0.2)}  # each machine's logit shift of A and of B


def _expit(x):
    return 1.0 / (1.0 + np.exp(-x))


def _mean_expit(mean: float, sd: float) -> float:
    """E expit(X), X ~ N(mean, sd^2), by Gauss-Hermite quadrature (120 nodes: exact to ~1e-12 here)."""
    x, w = np.polynomial.hermite_e.hermegauss(120)
    return float((w * _expit(mean + sd * x)).sum() / w.sum())


def true_difference(rows: int, row_sd: float, effect: float, effect_sd: float, seed_sd: float,
                    cluster_sd: float = 0.0, cluster_effect_sd: float = 0.0, shift_a: float = 0.0,
                    shift_b: float = 0.0) -> float:
    """A's expected accuracy minus B's, in points, over rows, clusters, seeds and Bernoulli draws."""
    sd_a = np.sqrt(row_sd ** 2 + cluster_sd ** 2 + effect_sd ** 2 + cluster_effect_sd ** 2 + seed_sd ** 2)
    sd_b = np.sqrt(row_sd ** 2 + cluster_sd ** 2 + seed_sd ** 2)
    return 100.0 * (_mean_expit(effect + shift_a, sd_a) - _mean_expit(shift_b, sd_b))


def draw(rng, k: int, rows: int, row_sd: float, effect: float, effect_sd: float, seed_sd: float,
         clusters: np.ndarray | None = None, cluster_sd: float = 0.0, cluster_effect_sd: float = 0.0,
         machines: np.ndarray | None = None):
    """One comparison's units: (seeds x rows 0/1 correctness of A, of B)."""
    eta = rng.normal(0.0, row_sd, rows)
    tau = rng.normal(effect, effect_sd, rows)
    if clusters is not None:
        g = clusters.max() + 1
        eta = eta + rng.normal(0.0, cluster_sd, g)[clusters]
        tau = tau + rng.normal(0.0, cluster_effect_sd, g)[clusters]

    def side(linear, shifts):
        u = rng.normal(0.0, seed_sd, (k, 1))
        if machines is not None:
            u = u + np.asarray(shifts)[machines][:, None]
        return rng.random((k, rows)) < _expit(linear[None, :] + u)

    return side(eta + tau, MACHINE_SHIFT["a"]), side(eta, MACHINE_SHIFT["b"])


def _covers(d, truth: float) -> bool:
    return d.low <= truth <= d.high


def seeds_scenario(k: int, reps: int, *, old_reps: int = 0, boot_replicates: int = 200, seed: int = 0,
                   scenario: dict | None = None) -> dict:
    """Coverage of the seed-row t interval (``reps`` comparisons) and of the nested bootstrap (``old_reps``, with
    ``boot_replicates`` replicates each) at k seeds a side, and the interval's mean width and seeds' share."""
    sc = dict(SEEDS_SCENARIO, **(scenario or {}))
    truth = true_difference(**sc)
    rng = np.random.default_rng([seed, k])
    hits, widths, shares = 0, [], []
    for _ in range(reps):
        d = seed_row_interval(*draw(rng, k, **sc))
        hits += _covers(d, truth)
        widths.append(d.high - d.low)
        shares.append(d.components["seed_share"])
    old_hits, old_widths = 0, []
    for r in range(old_reps):
        d = paired_bootstrap(*draw(rng, k, **sc), replicates=boot_replicates, seed=r)
        old_hits += _covers(d, truth)
        old_widths.append(d.high - d.low)
    return {"seeds": k, "truth": truth, "reps": reps, "coverage": hits / reps, "width": float(np.mean(widths)),
            "seed_share": float(np.mean(shares)),
            **({"bootstrap_reps": old_reps, "bootstrap_replicates": boot_replicates,
                "bootstrap_coverage": old_hits / old_reps, "bootstrap_width": float(np.mean(old_widths))}
               if old_reps else {})}


def clusters_scenario(k: int, reps: int, *, seed: int = 0, cluster_sd: float = 2.0,
                      cluster_effect_sd: float = 0.6) -> dict:
    """30 clusters of 100 rows: coverage with the clusters declared and with the rows taken as independent."""
    sc = dict(SEEDS_SCENARIO, row_sd=4.0, effect_sd=1.0)
    clusters = np.repeat(np.arange(CLUSTERS), sc["rows"] // CLUSTERS)
    truth = true_difference(**sc, cluster_sd=cluster_sd, cluster_effect_sd=cluster_effect_sd)
    rng = np.random.default_rng([seed, k, 1])
    with_c = without = 0
    for _ in range(reps):
        a, b = draw(rng, k, **sc, clusters=clusters, cluster_sd=cluster_sd, cluster_effect_sd=cluster_effect_sd)
        with_c += _covers(seed_row_interval(a, b, clusters=clusters), truth)
        without += _covers(seed_row_interval(a, b), truth)
    return {"seeds": k, "clusters": CLUSTERS, "truth": truth, "reps": reps, "coverage": with_c / reps,
            "coverage_rows_independent": without / reps}


def machines_scenario(split: tuple[int, ...], reps: int, *, seed: int = 0) -> dict:
    """Seeds on two machines (``split``: seeds on each), each machine shifting A and B by its own amount: coverage
    of the difference on this mix, stratified by machine and not, and the mean widths."""
    sc = dict(SEEDS_SCENARIO)
    machines = np.repeat(np.arange(len(split)), split)
    k = int(sum(split))
    weights = np.asarray(split) / k
    truth = float(sum(w * true_difference(**sc, shift_a=MACHINE_SHIFT["a"][m], shift_b=MACHINE_SHIFT["b"][m])
                      for m, w in enumerate(weights)))
    rng = np.random.default_rng([seed, k, 2])
    strat = plain = 0
    ws, wp = [], []
    for _ in range(reps):
        a, b = draw(rng, k, **sc, machines=machines)
        d = seed_row_interval(a, b, strata_a=machines, strata_b=machines)
        e = seed_row_interval(a, b)
        strat += _covers(d, truth)
        plain += _covers(e, truth)
        ws.append(d.high - d.low)
        wp.append(e.high - e.low)
    return {"split": list(split), "truth": truth, "reps": reps, "coverage": strat / reps, "width": float(np.mean(ws)),
            "coverage_unstratified": plain / reps, "width_unstratified": float(np.mean(wp))}


def run(reps: int = 4000, old_reps: int = 1000, boot_replicates: int = 400, seed: int = 0) -> dict:
    t0 = time.perf_counter()
    out = {"scenario": SEEDS_SCENARIO, "seeds": [seeds_scenario(k, reps, old_reps=old_reps,
                                                                boot_replicates=boot_replicates, seed=seed)
                                                 for k in (3, 5, 10)],
           "rows": [seeds_scenario(k, reps // 2, old_reps=old_reps // 2, boot_replicates=boot_replicates, seed=seed,
                                   scenario=ROWS_SCENARIO) for k in (3, 5, 10)],
           "clusters": [clusters_scenario(k, reps // 2, seed=seed) for k in (3, 5, 10)],
           "machines": [machines_scenario(split, reps // 2, seed=seed) for split in ((3, 2), (5, 5))]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def markdown(res: dict) -> str:
    from benchmarks.common import md_table

    se = lambda p, n: 100 * np.sqrt(p * (1 - p) / n)  # noqa: E731 - the simulation's own standard error
    cov = lambda r, k="coverage", n="reps": f"{100 * r[k]:.1f}% ± {se(r[k], r[n]):.1f}"  # noqa: E731
    s0 = res["seeds"][0]
    return "\n".join([
        "# Coverage of the comparison intervals (simulated)", "",
        "`python benchmarks/interval_coverage.py` (the scenarios: its docstring). Coverage: the share of simulated "
        "comparisons whose 95% interval holds the true difference (± its simulation standard error).", "",
        *md_table(["seeds a side", "seed-row t interval", "mean width (points)", "nested bootstrap (old)",
                   "seeds' share of the variance"],
                  [[r["seeds"], cov(r), f"{r['width']:.2f}", cov(r, "bootstrap_coverage", "bootstrap_reps"),
                    f"{100 * r['seed_share']:.0f}%"] for r in res["seeds"]], "rrrrr"), "",
        f"({s0['reps']:,} comparisons per line for the t interval, {s0['bootstrap_reps']:,} for the bootstrap with "
        f"{s0['bootstrap_replicates']} replicates each.)", "",
        "Rows carrying more of the variance (`rows`: a seed spread of about 0.3 points):", "",
        *md_table(["seeds a side", "seed-row t interval", "mean width", "nested bootstrap (old)", "mean width",
                   "seeds' share"],
                  [[r["seeds"], cov(r), f"{r['width']:.2f}", cov(r, "bootstrap_coverage", "bootstrap_reps"),
                    f"{r['bootstrap_width']:.2f}", f"{100 * r['seed_share']:.0f}%"] for r in res["rows"]], "rrrrrr"), "",
        *md_table(["seeds a side", f"{CLUSTERS} clusters declared", "rows taken as independent"],
                  [[r["seeds"], f"{100 * r['coverage']:.1f}%", f"{100 * r['coverage_rows_independent']:.1f}%"]
                   for r in res["clusters"]], "rrr"), "",
        *md_table(["seeds per machine", "stratified by machine", "width", "not stratified", "width"],
                  [[" + ".join(map(str, r["split"])), f"{100 * r['coverage']:.1f}%", f"{r['width']:.2f}",
                    f"{100 * r['coverage_unstratified']:.1f}%", f"{r['width_unstratified']:.2f}"]
                   for r in res["machines"]], "lrrrr"), "",
        f"{res['seconds']:.0f} s on one core.", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=4000)
    ap.add_argument("--old-reps", type=int, default=1000)
    ap.add_argument("--boot-replicates", type=int, default=400)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "interval_coverage"))
    args = ap.parse_args(argv)
    res = run(args.reps, args.old_reps, args.boot_replicates)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
