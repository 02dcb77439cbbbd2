"""How sure a difference between two training recipes is: a t interval over the seeds with the test rows' variance
added (the seeds are the unit of replication), the nested paired bootstrap it replaces, an exact paired permutation
test for small sets, and corrections for many comparisons whose intervals match their calls.

The question the efficacy table asks is "does a model trained on release A score higher on set T than one
trained on B?", where each side is several training seeds scored on the same rows of T. Two sources of
variance matter:

* which seed a model happened to get (the spread of the seeds' accuracies; on the MNLI hard subsets and HANS
  65-94% of the variance of a difference, Bouthillier et al. 2021 "Accounting for variance in machine learning
  benchmarks");
* which rows the test set happened to hold (a 2,000-row set's accuracy moves by about 1 point from the
  sample alone), or which *clusters* of rows: HANS is 30 subcases of 1,000 template instances, not 30,000
  independent rows (Field & Welsh 2007, "Bootstrapping clustered data": resample, or here sum, at the level
  the data were sampled at).

:func:`seed_row_interval` (the method of ``debiased-nli compare``) treats seeds and test rows (or clusters) as
the two crossed random factors of a two-way layout per side, seeds x rows -- the design of psycholinguistics'
subjects x items, where ignoring either factor is Clark's (1973) "language-as-fixed-effect fallacy". With
X_A[s, g] the accuracy of A's seed s on cluster g scaled so that the seed's accuracy is mean_g X_A[s, g]
(a cluster is one row where the set declares none), and D_g = mean_s X_A[s, g] - mean_s X_B[s, g]::

    d       = mean_g D_g                                              (= mean accuracy of A - of B)
    Var(d)  = s2_A / k_A + s2_B / k_B                                 (seeds: unbiased, ddof 1)
            + max(0, S2_D - MSE_A / k_A - MSE_B / k_B) / G           (rows or clusters, paired)
    df      = Welch-Satterthwaite over the three parts (Satterthwaite 1946), with k_A - 1, k_B - 1 and G - 1 df
    [low, high] = d -/+ t_{df, 1 - alpha/2} sqrt(Var(d));  p = 2 P(T_df > |d| / sqrt(Var(d)))

s2_A is the sample variance of A's seeds' accuracies (which already holds each seed's row-by-seed noise), S2_D
the variance over clusters of the paired difference, and MSE the two-way residual mean square (seed x cluster),
subtracted so that noise counted in the seeds' term is not counted again: the method-of-moments (ANOVA)
estimator of a crossed random-effects model (Searle, Casella & McCulloch 1992, ch. 4), unbiased term by term.
Seeds run on several machines with the same number of each side's seeds on each machine are *stratified*: the
seed variance is pooled within machines (k - M degrees of freedom), so the machine mix is a fixed part of the
design, not resampled noise. The interval is in closed form: it has no Monte Carlo error, and no seed.

:func:`paired_bootstrap` is the nested (two-stage) bootstrap it replaces (Davison & Hinkley 1997, section 3.8,
with the rows as the shared stage). Each replicate draws the test rows with replacement (the same rows for
both sides) and each side's seeds with replacement; the replicate's difference is

    d* = mean_{s in S_A*} acc_s(I*) - mean_{s in S_B*} acc_s(I*)

and the interval is the percentile interval of d*; the p-value tests d = 0 by shifting the replicates to the
null (Efron & Tibshirani 1993, section 16.4): ``p = (1 + #{|d* - d_hat| >= |d_hat|}) / (B + 1)``, with Monte
Carlo standard error sqrt(p (1 - p) / B). Resampling k seeds with replacement shrinks their variance by
(k - 1) / k (Davison & Hinkley's bias of the plug-in variance; 0.67 at 3 seeds) and its percentiles have normal
tails where the seeds' mean has t tails with k - 1 degrees of freedom: at 3-5 seeds it under-covers
(``tests/test_significance.py`` simulates both; docs/efficacy.md has the figures). Replicates are computed with
multinomial weights: a replicate's rows are a count vector w (multinomial(n, 1/n)) and its seeds count vectors
u_A, u_B, so that d* = u_A' C_A w / (n s_A) - u_B' C_B w / (n s_B) with C the seeds x rows matrix of 0/1
correctness.

:func:`permutation_test` is the exact paired test for one model per side (sign flips of the per-row
differences, all 2^n of them for n <= 20); the tests check the bootstrap against it and against a case whose
bootstrap distribution is enumerated by hand.

:func:`holm`, :func:`bonferroni` and :func:`benjamini_hochberg` adjust the p-values of a family of comparisons:
Holm (1979) and Bonferroni control the family-wise error rate, Benjamini & Hochberg (1995) the false discovery
rate. A plan names its primary comparisons in advance; the correction runs over those. :func:`correct` also
gives each test of the family the interval that matches its call (Dror et al. 2018, "The Hitchhiker's Guide to
Testing Statistical Significance in NLP", on reporting a family's tests together): Bonferroni's simultaneous
intervals at 1 - alpha/m; for Holm, each test's interval at the level of the step that tested it (1 - alpha/(m -
r) for the r-th smallest p, and the level of the first step that failed for every later one); for BH, Benjamini
& Yekutieli's (2005) false-coverage-rate intervals at 1 - R alpha / m (R rejections). The interval then excludes
0 exactly when the adjusted p is under alpha.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from ..utils.errors import ConfigError

SEED_ROW_METHOD = "seed-row t interval"
BOOTSTRAP_METHOD = "nested paired bootstrap"

# the bootstrap's replicates and interval level (project's choices: 10,000 replicates put the 2.5% and 97.5%
# percentiles within about 0.1 point of their limit on the table's sets; 95% is the field's convention)
DEFAULT_REPLICATES = 10_000
DEFAULT_LEVEL = 0.95
# row-weight blocks of this many replicates at a time (a block holds replicates x rows int32 counts)
BLOCK_CELLS = 4_000_000


@dataclasses.dataclass
class Difference:
    """A - B in accuracy points (0-100), with its interval and p-value; for a test of a corrected family, the
    adjusted p-value and the interval that matches the call (``adjusted_low``, ``adjusted_high`` at
    ``adjusted_level``). ``se``, ``df``: the t interval's standard error and degrees of freedom (None for the
    bootstrap); ``p_mc_se``: the p-value's Monte Carlo standard error (0: closed form)."""

    estimate: float
    low: float
    high: float
    p_value: float
    rows: int
    seeds_a: int
    seeds_b: int
    replicates: int
    level: float = DEFAULT_LEVEL
    p_adjusted: float | None = None
    correction: str | None = None
    method: str = BOOTSTRAP_METHOD
    se: float | None = None
    df: float | None = None
    p_mc_se: float | None = None
    clusters: int | None = None
    strata: int | None = None
    components: dict | None = None
    adjusted_low: float | None = None
    adjusted_high: float | None = None
    adjusted_level: float | None = None

    @property
    def distinguishable(self) -> bool:
        """Whether the interval excludes 0 (and, after a correction, the adjusted p is under 1 - level; where the
        matching adjusted interval is known it excludes 0 then, and only then)."""
        if self.p_adjusted is not None:
            return self.p_adjusted < 1 - self.level
        return self.low > 0 or self.high < 0

    def interval_at(self, level: float) -> tuple[float, float]:
        """The t interval at another level (the same standard error and degrees of freedom)."""
        if self.se is None or self.df is None:
            raise ConfigError(f"a {self.method} has no interval at another level without resampling again")
        half = _t_quantile(1 - (1 - level) / 2, self.df) * self.se
        return self.estimate - half, self.estimate + half

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "distinguishable": self.distinguishable}

    def describe(self, digits: int = 1) -> str:
        """``+3.1 [+1.2, +5.0]`` or ``+0.4 [-0.9, +1.7], not distinguishable from 0``: the interval that matches
        the call (after a correction, the adjusted one); each figure rounded once, from the unrounded values."""
        low, high = ((self.adjusted_low, self.adjusted_high) if self.adjusted_low is not None
                     else (self.low, self.high))
        text = f"{self.estimate:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"
        return text if self.distinguishable else f"{text}, not distinguishable from 0"


def _t_quantile(q: float, df: float) -> float:
    from scipy import stats

    return float(stats.norm.ppf(q)) if not np.isfinite(df) else float(stats.t.ppf(q, df))


def _t_two_sided_p(t: float, df: float) -> float:
    from scipy import stats

    return float(2 * (stats.norm.sf(abs(t)) if not np.isfinite(df) else stats.t.sf(abs(t), df)))


def _correct_matrix(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ConfigError(f"{name}: expected seeds x rows of 0/1 correctness, got shape {np.shape(x)}")
    if not np.isin(a, (0, 1)).all():
        raise ConfigError(f"{name}: correctness must be 0/1 (or booleans)")
    return a.astype(np.float64)


def _cluster_means(x: np.ndarray, inverse: np.ndarray | None, groups: int) -> np.ndarray:
    """seeds x clusters: each cluster's total correct over the set's rows times G / n, so that a seed's accuracy is
    the mean over clusters (the rows themselves where no cluster is declared)."""
    if inverse is None:
        return x
    n = x.shape[1]
    return np.vstack([np.bincount(inverse, weights=row, minlength=groups) for row in x]) * (groups / n)


def _seed_variance(acc: np.ndarray, strata: np.ndarray | None) -> tuple[float, int]:
    """The seeds' variance of their accuracies (ddof 1) and its degrees of freedom; with strata (the machine each
    seed ran on) pooled within them: sum of squares about each stratum's mean / (k - M)."""
    if strata is None:
        return float(acc.var(ddof=1)), len(acc) - 1
    labels, inverse = np.unique(strata, return_inverse=True)
    means = np.bincount(inverse, weights=acc) / np.bincount(inverse)
    df = len(acc) - len(labels)
    return float(((acc - means[inverse]) ** 2).sum() / df), df


def _residual_mean_square(x: np.ndarray) -> float:
    """The two-way (seed x cluster) residual mean square of a seeds x clusters matrix, (k - 1)(G - 1) df."""
    k, g = x.shape
    r = x - x.mean(1, keepdims=True) - x.mean(0, keepdims=True) + x.mean()
    return float((r ** 2).sum() / ((k - 1) * (g - 1)))


def seed_row_interval(correct_a, correct_b, *, level: float = DEFAULT_LEVEL, clusters=None, strata_a=None,
                      strata_b=None) -> Difference:
    """A's accuracy minus B's on the same rows, in points, with the seed-row t interval and p-value (the module's
    docstring has the formula).

    ``correct_a``: seeds_A x rows of 0/1, whether each of A's seeds got each row right; ``correct_b`` likewise
    over the same rows in the same order; at least 2 seeds a side (one seed has no variance to estimate).
    ``clusters``: one label per row (e.g. HANS's subcase): the rows' variance is taken between clusters.
    ``strata_a`` / ``strata_b``: one label per seed (the machine it ran on): the seed variance is pooled within
    them; both sides need the same number of seeds in each stratum and at least one degree of freedom left."""
    a, b = _correct_matrix(correct_a, "A"), _correct_matrix(correct_b, "B")
    if a.shape[1] != b.shape[1]:
        raise ConfigError(f"A is scored on {a.shape[1]} rows and B on {b.shape[1]}: a paired comparison needs "
                          f"the same rows in the same order")
    if not 0 < level < 1:
        raise ConfigError(f"level must be in (0, 1), got {level}")
    (ka, n), kb = a.shape, b.shape[0]
    if ka < 2 or kb < 2:
        raise ConfigError(f"{ka} seed(s) of A and {kb} of B: the seed variance needs at least 2 seeds a side")
    inverse, groups = None, n
    if clusters is not None:
        clusters = np.asarray(clusters)
        if clusters.shape != (n,):
            raise ConfigError(f"clusters: one label per row ({n}), got shape {clusters.shape}")
        _, inverse = np.unique(clusters, return_inverse=True)
        groups = int(inverse.max()) + 1
    if groups < 2:
        raise ConfigError(f"{groups} cluster(s) of rows: the rows' variance needs at least 2")
    strata = None
    if (strata_a is None) != (strata_b is None):
        raise ConfigError("strata: give the machine of every seed on both sides, or on neither")
    if strata_a is not None:
        sa_, sb_ = np.asarray(strata_a).astype(str), np.asarray(strata_b).astype(str)
        if sa_.shape != (ka,) or sb_.shape != (kb,):
            raise ConfigError(f"strata: one label per seed ({ka} and {kb}), got {sa_.shape} and {sb_.shape}")
        la, ca = np.unique(sa_, return_counts=True)
        lb, cb = np.unique(sb_, return_counts=True)
        if list(la) != list(lb) or list(ca) != list(cb):
            raise ConfigError("strata: both sides need the same number of seeds on each machine")
        if ka - len(la) < 1:
            raise ConfigError(f"strata: {ka} seeds on {len(la)} machines leave no degree of freedom for the seeds")
        strata = len(la)
    xa, xb = _cluster_means(a, inverse, groups), _cluster_means(b, inverse, groups)
    estimate = 100.0 * (a.mean() - b.mean())
    var_a, df_a = _seed_variance(xa.mean(1), None if strata is None else sa_)
    var_b, df_b = _seed_variance(xb.mean(1), None if strata is None else sb_)
    d = xa.mean(0) - xb.mean(0)
    s2_d = float(d.var(ddof=1))
    ms_a, ms_b = _residual_mean_square(xa), _residual_mean_square(xb)
    # (value, degrees of freedom) of each part of Var(d), for Welch-Satterthwaite. The rows' part is one term with
    # the G - 1 degrees of freedom of S2_D: Satterthwaite's formula over a difference of mean squares gives ~1 df
    # where the difference is near 0 (Gaylor & Hopper 1969), which no sample of rows justifies
    rows_part = max(0.0, s2_d / groups - ms_a / (ka * groups) - ms_b / (kb * groups))
    terms = [(var_a / ka, df_a), (var_b / kb, df_b), (rows_part, groups - 1)]
    variance = sum(v for v, _ in terms)
    denominator = sum(v * v / f for v, f in terms if f > 0)
    df = variance ** 2 / denominator if denominator > 0 else float("inf")
    se = 100.0 * float(np.sqrt(max(variance, 0.0)))
    if se == 0.0:
        low = high = estimate
        p = 1.0 if estimate == 0 else 0.0
    else:
        half = _t_quantile(1 - (1 - level) / 2, df) * se
        low, high = estimate - half, estimate + half
        p = _t_two_sided_p(estimate / se, df)
    parts = {"seeds_a": 1e4 * var_a / ka, "seeds_b": 1e4 * var_b / kb, "rows": 1e4 * rows_part}
    components = {**parts, "seed_share": ((parts["seeds_a"] + parts["seeds_b"]) / sum(parts.values())
                                          if sum(parts.values()) > 0 else None),
                  "seed_std_a": 100 * float(np.sqrt(var_a)), "seed_std_b": 100 * float(np.sqrt(var_b))}
    return Difference(float(estimate), float(low), float(high), float(p), n, ka, kb, 0, level,
                      method=SEED_ROW_METHOD, se=se, df=float(df), p_mc_se=0.0,
                      clusters=groups if clusters is not None else None, strata=strata, components=components)


def paired_bootstrap(correct_a, correct_b, *, replicates: int = DEFAULT_REPLICATES, level: float = DEFAULT_LEVEL,
                     seed: int = 0) -> Difference:
    """A's accuracy minus B's on the same rows, in points, with a nested bootstrap interval and p-value.

    ``correct_a``: seeds_A x rows (or one row vector for one seed) of 0/1, whether each seed's model got each
    row right; ``correct_b`` likewise, over the same rows in the same order."""
    a, b = _correct_matrix(correct_a, "A"), _correct_matrix(correct_b, "B")
    if a.shape[1] != b.shape[1]:
        raise ConfigError(f"A is scored on {a.shape[1]} rows and B on {b.shape[1]}: a paired comparison needs "
                          f"the same rows in the same order")
    if not 0 < level < 1 or replicates < 1:
        raise ConfigError(f"level must be in (0, 1) and replicates >= 1, got {level}, {replicates}")
    (sa, n), sb = a.shape, b.shape[0]
    estimate = 100.0 * (a.mean() - b.mean())
    rng = np.random.default_rng(seed)
    out = np.empty(replicates)
    block = max(1, min(replicates, BLOCK_CELLS // n))
    for start in range(0, replicates, block):
        r = min(block, replicates - start)
        w = rng.multinomial(n, np.full(n, 1.0 / n), size=r).astype(np.float64)  # r x n row counts
        ua = rng.multinomial(sa, np.full(sa, 1.0 / sa), size=r)                 # r x s_A seed counts
        ub = rng.multinomial(sb, np.full(sb, 1.0 / sb), size=r)
        acc_a = (a @ w.T) / n                                                   # s_A x r: each seed on I*
        acc_b = (b @ w.T) / n
        out[start:start + r] = 100.0 * ((ua * acc_a.T).sum(1) / sa - (ub * acc_b.T).sum(1) / sb)
    tail = (1 - level) / 2
    low, high = np.quantile(out, [tail, 1 - tail])
    # ties count as "at least as far" (1e-9 points absorbs the floating-point noise of equal atoms)
    p = (1 + np.count_nonzero(np.abs(out - estimate) >= abs(estimate) - 1e-9)) / (replicates + 1)
    return Difference(float(estimate), float(low), float(high), float(p), n, sa, sb, replicates, level,
                      p_mc_se=float(np.sqrt(p * (1 - p) / replicates)))


def permutation_test(correct_a, correct_b, *, max_exact_rows: int = 20) -> float:
    """The exact two-sided paired permutation (sign-flip) test of mean(A - B) = 0 for one model per side:
    under the null each row's difference is as likely to have either sign, so the p-value is the share of
    the 2^m sign patterns of the m rows that differ whose |mean| is at least the observed one."""
    a, b = _correct_matrix(correct_a, "A"), _correct_matrix(correct_b, "B")
    if a.shape[0] != 1 or b.shape[0] != 1 or a.shape[1] != b.shape[1]:
        raise ConfigError("the exact permutation test takes one model per side, scored on the same rows")
    d = (a[0] - b[0])[a[0] != b[0]]  # rows where both agree add 0 under every sign pattern
    if len(d) > max_exact_rows:
        raise ConfigError(f"{len(d)} differing rows: 2^{len(d)} sign patterns are too many for the exact test; "
                          f"use paired_bootstrap")
    observed = abs(d.sum())
    hits = sum(abs(np.dot(signs, d)) >= observed - 1e-12 for signs in itertools.product((1, -1), repeat=len(d)))
    return hits / 2 ** len(d)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error rate), in the input order."""
    p = np.asarray(p_values, dtype=np.float64)
    order = np.argsort(p, kind="stable")
    m = len(p)
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


def benjamini_hochberg(p_values: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (false discovery rate), in the input order."""
    p = np.asarray(p_values, dtype=np.float64)
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    running = 1.0
    for rank in range(m - 1, -1, -1):
        i = order[rank]
        running = min(running, p[i] * m / (rank + 1))
        adjusted[i] = running
    return adjusted.tolist()


def bonferroni(p_values: Sequence[float]) -> list[float]:
    """Bonferroni-adjusted p-values, min(1, m p) (family-wise error rate; its intervals are simultaneous)."""
    m = len(p_values)
    return [min(1.0, m * float(p)) for p in p_values]


CORRECTIONS = {"holm": holm, "bonferroni": bonferroni, "bh": benjamini_hochberg}


def matching_levels(p_values: Sequence[float], method: str, alpha: float) -> list[float]:
    """Per test of a family, the level of the interval that excludes 0 exactly when the test's adjusted p is under
    ``alpha`` (the call): Bonferroni 1 - alpha/m for all (simultaneous); Holm 1 - alpha/(m - r) for the r-th
    smallest p (from 0) up to the first step that fails, and that step's level for every later one; BH 1 - R
    alpha / m with R the number of rejections (at least 1), Benjamini & Yekutieli's (2005) FCR-adjusted level."""
    p = np.asarray(p_values, dtype=np.float64)
    m = len(p)
    if method == "bonferroni":
        return [1 - alpha / m] * m
    order = np.argsort(p, kind="stable")
    if method == "holm":
        levels = np.empty(m)
        failed = None
        for rank, i in enumerate(order):
            if failed is None and not p[i] < alpha / (m - rank):
                failed = rank
            levels[i] = 1 - alpha / (m - (rank if failed is None else failed))
        return levels.tolist()
    if method == "bh":
        rejected = max([rank + 1 for rank, i in enumerate(order) if p[i] < (rank + 1) * alpha / m], default=0)
        return [1 - max(rejected, 1) * alpha / m] * m
    raise ConfigError(f"unknown correction {method!r}; known: {sorted(CORRECTIONS)}")


def correct(differences: Sequence[Difference], method: str = "holm", family_size: int | None = None) -> list[Difference]:
    """The differences with ``p_adjusted`` over the family (``holm``, ``bonferroni`` or ``bh``) and, where the
    interval is a t interval, the adjusted interval that matches the call (:func:`matching_levels`).
    ``family_size``: the family the plan named, when some of its tests cannot be computed yet; they count as
    p = 1 (conservative: an adjusted p can only fall when they arrive)."""
    if method not in CORRECTIONS:
        raise ConfigError(f"unknown correction {method!r}; known: {sorted(CORRECTIONS)}")
    ps = [d.p_value for d in differences] + [1.0] * max(0, (family_size or 0) - len(differences))
    adjusted = CORRECTIONS[method](ps)
    levels = matching_levels(ps, method, 1 - differences[0].level) if differences else []
    out = []
    for d, q, level in zip(differences, adjusted, levels):
        d = dataclasses.replace(d, p_adjusted=float(q), correction=method)
        if d.se is not None:
            low, high = d.interval_at(level)
            d = dataclasses.replace(d, adjusted_low=low, adjusted_high=high, adjusted_level=level)
        out.append(d)
    return out
