"""How sure a difference between two training recipes is: a paired bootstrap over test rows nested with the
seeds, an exact paired permutation test for small sets, and corrections for many comparisons.

The question the efficacy table asks is "does a model trained on release A score higher on set T than one
trained on B?", where each side is several training seeds scored on the same rows of T. Two sources of
variance matter, and a seeds-only standard error (the table's old ``|d| > max(2 SE, 1 point)`` rule) sees
only the first:

* which seed a model happened to get (the spread of the seeds' accuracies);
* which rows the test set happened to hold (a 2,000-row set's accuracy moves by about 1 point from the
  sample alone).

:func:`paired_bootstrap` resamples both at once. Each replicate draws the test rows with replacement (the
same rows for both sides: the comparison is paired, so the rows' own difficulty cancels) and, independently,
each side's seeds with replacement; the replicate's difference is

    d* = mean_{s in S_A*} acc_s(I*) - mean_{s in S_B*} acc_s(I*)

where acc_s(I*) is seed s's accuracy on the resampled rows I*. This is the nested (two-stage) bootstrap of
Davison & Hinkley (1997, section 3.8) with the rows as the shared stage. The interval is the percentile
interval of d*; the p-value tests d = 0 by shifting the replicates to the null (Efron & Tibshirani 1993,
section 16.4): ``p = (1 + #{|d* - d_hat| >= |d_hat|}) / (B + 1)``.

Replicates are computed with multinomial weights instead of index arrays: a replicate's rows are a count
vector w (multinomial(n, 1/n)) and its seeds count vectors u_A, u_B, so that d* = u_A' C_A w / (n s_A)
- u_B' C_B w / (n s_B) with C the seeds x rows matrix of 0/1 correctness; one matrix product scores a block
of replicates for every seed at once.

:func:`permutation_test` is the exact paired test for one model per side (sign flips of the per-row
differences, all 2^n of them for n <= 20); the tests check the bootstrap against it and against a case whose
bootstrap distribution is enumerated by hand.

:func:`holm` and :func:`benjamini_hochberg` adjust the p-values of a family of comparisons: Holm (1979)
controls the family-wise error rate, Benjamini & Hochberg (1995) the false discovery rate. A plan names its
primary comparisons in advance; the correction runs over those.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from ..utils.errors import ConfigError

# the bootstrap's replicates and interval level (project's choices: 10,000 replicates put the 2.5% and 97.5%
# percentiles within about 0.1 point of their limit on the table's sets; 95% is the field's convention)
DEFAULT_REPLICATES = 10_000
DEFAULT_LEVEL = 0.95
# row-weight blocks of this many replicates at a time (a block holds replicates x rows int32 counts)
BLOCK_CELLS = 4_000_000


@dataclasses.dataclass
class Difference:
    """A - B in accuracy points (0-100), with its bootstrap interval and p-value."""

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

    @property
    def distinguishable(self) -> bool:
        """Whether the interval excludes 0 (and, after a correction, the adjusted p is under 1 - level)."""
        if self.p_adjusted is not None:
            return self.p_adjusted < 1 - self.level
        return self.low > 0 or self.high < 0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "distinguishable": self.distinguishable}

    def describe(self, digits: int = 1) -> str:
        """``+3.1 [+1.2, +5.0]`` or ``+0.4 [-0.9, +1.7], not distinguishable from 0``; each figure rounded
        once, from the unrounded values."""
        text = f"{self.estimate:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"
        return text if self.distinguishable else f"{text}, not distinguishable from 0"


def _correct_matrix(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ConfigError(f"{name}: expected seeds x rows of 0/1 correctness, got shape {np.shape(x)}")
    if not np.isin(a, (0, 1)).all():
        raise ConfigError(f"{name}: correctness must be 0/1 (or booleans)")
    return a.astype(np.float64)


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
    return Difference(float(estimate), float(low), float(high), float(p), n, sa, sb, replicates, level)


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


CORRECTIONS = {"holm": holm, "bh": benjamini_hochberg}


def correct(differences: Sequence[Difference], method: str = "holm", family_size: int | None = None) -> list[Difference]:
    """The differences with ``p_adjusted`` over the family (``holm`` or ``bh``). ``family_size``: the family the
    plan named, when some of its tests cannot be computed yet; they count as p = 1 (conservative: an adjusted
    p can only fall when they arrive)."""
    if method not in CORRECTIONS:
        raise ConfigError(f"unknown correction {method!r}; known: {sorted(CORRECTIONS)}")
    ps = [d.p_value for d in differences]
    adjusted = CORRECTIONS[method](ps + [1.0] * max(0, (family_size or 0) - len(ps)))
    return [dataclasses.replace(d, p_adjusted=float(q), correction=method) for d, q in zip(differences, adjusted)]
