"""The z-value of one feature and its O(1) updates (Guo et al. 2023, Eq. 1 and Appendix C).

For a feature x with count vector n_1..n_K over the label groups (n = sum n_l, p_hat = n_l / n,
p0 = 1/K):

    z*(l, x) = (p_hat - p0) / sqrt(p0 (1 - p0) / n)                       (Eq. 1)

The two perturbations of Algorithm 1 change one count by one:

    keep  (p_hat(l|x) < p0): add S' that still contains x        n_l += 1, n += 1
    lose  (p_hat(l|x) > p0): replace S by S' without x            n_l -= 1, n -= 1

Appendix C argues with d z*^2 / d n_l (n = n_l + the other counts), z*^2 proportional to
n (p_hat - p0)^2. Its printed result "(2 + p0 + p_hat)(p0 - p_hat)" is wrong; the derivative is

    d [n (p_hat - p0)^2] / d n_l = (p_hat - p0)(2 - p0 - p_hat)

(a = n_l - p0 n = n (p_hat - p0); d(a^2 / n)/d n_l = 2 (1 - p0) a / n - a^2 / n^2), positive when
p_hat > p0 and negative when p_hat < p0, so removing (lose) or adding (keep) a row of label l moves
z*(l, x) toward 0; the text's second "p_hat < p0" should read "p_hat > p0". tests/test_pdd_zvalue.py
checks the formula against finite differences and that both operations strictly lower |z*(l, x)|
over a grid of count vectors.
"""
from __future__ import annotations

import numpy as np

KEEP = "keep"
LOSE = "lose"


def z_star(counts: np.ndarray, p0: float) -> np.ndarray:
    """z*(l, x) for every label group l from x's count vector (zeros when n = 0)."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    if n <= 0:
        return np.zeros_like(counts)
    return (counts / n - p0) / np.sqrt(p0 * (1 - p0) / n)


def squared_objective(n_l: float, n_rest: float, p0: float) -> float:
    """n (p_hat - p0)^2 with n = n_l + n_rest: z*(l, x)^2 up to the factor p0 (1 - p0)."""
    n = n_l + n_rest
    return n * (n_l / n - p0) ** 2


def objective_derivative(p_hat: float, p0: float) -> float:
    """d [n (p_hat - p0)^2] / d n_l = (p_hat - p0)(2 - p0 - p_hat) (Appendix C, corrected)."""
    return (p_hat - p0) * (2 - p0 - p_hat)


def printed_derivative(p_hat: float, p0: float) -> float:
    """Appendix C as printed, (2 + p0 + p_hat)(p0 - p_hat): kept only to show it disagrees."""
    return (2 + p0 + p_hat) * (p0 - p_hat)


def case_for(counts: np.ndarray, group: int, p0: float) -> str | None:
    """The operation a row of label group ``group`` gets: keep (p_hat < p0), lose (p_hat > p0), or None."""
    n = counts.sum()
    if n <= 0:
        return None
    p_hat = counts[group] / n
    if p_hat < p0:
        return KEEP
    if p_hat > p0:
        return LOSE
    return None


def apply_case(counts: np.ndarray, group: int, case: str) -> None:
    """The O(1) count update of one successful operation (in place)."""
    counts[group] += 1 if case == KEEP else -1
