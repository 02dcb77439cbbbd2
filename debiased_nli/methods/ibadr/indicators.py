"""Bias indicators (Wang et al. 2023, section 2.2 step 1 and section 2.3).

* :func:`assign_indicators`: sort the pool by bias degree beta (ascending; ties by uid) and divide it
  into N_bi groups of equal size (``np.array_split``: sizes differ by at most one, the first groups
  take the extra rows); group n gets indicator b_n, so b_1 holds the least biased rows.
  :func:`reference_assign_indicators` is the slow, obvious version it must agree with.
* :func:`sample_indicators`: the b-bar fed to the generator, "a randomly-selected low-degree bias
  indicator: b-bar = b_r, where 1 <= r <= N_bi/2" (section 2.3), i.e. r uniform in 1..floor(N_bi/2)
  (N_bi = 5 -> {b1, b2}; N_bi = 3 -> {b1}, "the bias indicator can only be set to b1", section 3.2);
  ``"lowest"`` always gives b_1 (Table 5's b_r => b_1 ablation).
* :func:`sample_labels`: y-bar, "a randomly-selected NLI label" (section 2.2 step 3), uniform.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ...utils.errors import ConfigError

STRATEGIES = ("random_low", "lowest", "none")


def indicator_name(n: int) -> str:
    """The indicator's text in the generator's prefix: ``b1`` .. ``b<N_bi>``."""
    return f"b{int(n)}"


def _check(beta: np.ndarray, uids: Sequence[str], n_bi: int) -> None:
    if n_bi < 1:
        raise ConfigError(f"N_bi must be at least 1, got {n_bi}")
    if len(uids) != len(beta):
        raise ConfigError(f"{len(beta)} bias degrees for {len(uids)} uids")
    if len(beta) < n_bi:
        raise ConfigError(f"{len(beta)} rows cannot fill N_bi = {n_bi} groups")
    if not np.all(np.isfinite(beta)):
        bad = int(np.nonzero(~np.isfinite(beta))[0][0])
        raise ConfigError(f"bias degree of row {bad} (uid {uids[bad]!r}) is {beta[bad]}, not a probability")


def assign_indicators(beta: Sequence[float], uids: Sequence[str], n_bi: int = 5) -> np.ndarray:
    """Indicator number (1..n_bi) of every row: equal-size groups by ascending beta, ties by uid."""
    beta = np.asarray(beta, dtype=np.float64)
    _check(beta, uids, n_bi)
    order = np.lexsort((np.asarray(uids, dtype=object).astype(str), beta))
    out = np.empty(len(beta), dtype=np.int64)
    for n, idx in enumerate(np.array_split(order, n_bi), start=1):
        out[idx] = n
    return out


def reference_assign_indicators(beta: Sequence[float], uids: Sequence[str], n_bi: int = 5) -> list[int]:
    """The same, written out: sort (beta, uid) pairs, then hand out group sizes one by one."""
    beta = [float(b) for b in beta]
    _check(np.asarray(beta), uids, n_bi)
    ranked = sorted(range(len(beta)), key=lambda i: (beta[i], str(uids[i])))
    sizes = [len(beta) // n_bi + (1 if g < len(beta) % n_bi else 0) for g in range(n_bi)]
    out = [0] * len(beta)
    pos = 0
    for g, size in enumerate(sizes):
        for i in ranked[pos:pos + size]:
            out[i] = g + 1
        pos += size
    return out


def low_indicators(n_bi: int, strategy: str = "random_low") -> list[int]:
    """The indicators b-bar is drawn from: 1..floor(N_bi/2) (``random_low``) or just 1 (``lowest``)."""
    if strategy not in STRATEGIES[:2]:
        raise ConfigError(f"indicator strategy must be one of {STRATEGIES[:2]} here, not {strategy!r}")
    if strategy == "lowest" or n_bi < 2:
        return [1]
    return list(range(1, n_bi // 2 + 1))


def sample_indicators(n: int, n_bi: int, rng: np.random.Generator, strategy: str = "random_low") -> np.ndarray:
    """``n`` draws of b-bar, uniform over :func:`low_indicators`."""
    choices = np.asarray(low_indicators(n_bi, strategy))
    return choices[rng.integers(0, len(choices), size=n)]


def sample_labels(n: int, num_labels: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` draws of y-bar, uniform over the task's labels."""
    return rng.integers(0, num_labels, size=n)
