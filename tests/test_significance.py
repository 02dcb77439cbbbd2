"""The statistics behind "does release A help?" (issue 34): the nested paired bootstrap against distributions
enumerated by hand and against an exact permutation test, and the multiple-comparison corrections against
textbook cases."""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from debiased_nli.models.significance import (Difference, benjamini_hochberg, correct, holm, paired_bootstrap,
                                              permutation_test)
from debiased_nli.utils.errors import ConfigError


def _enumerated(a: np.ndarray, b: np.ndarray) -> Counter:
    """The exact nested-bootstrap distribution of d* (points), every row tuple x seed tuple equally likely."""
    (sa, n), sb = a.shape, b.shape[0]
    out = Counter()
    for rows in itertools.product(range(n), repeat=n):
        for seeds_a in itertools.product(range(sa), repeat=sa):
            for seeds_b in itertools.product(range(sb), repeat=sb):
                d = a[list(seeds_a)][:, list(rows)].mean() - b[list(seeds_b)][:, list(rows)].mean()
                out[round(100 * d, 9)] += 1
    total = sum(out.values())
    return Counter({k: v / total for k, v in out.items()})


@pytest.mark.parametrize("a,b", [
    ([[1, 0, 0]], [[0, 0, 0]]),                     # one seed each: rows alone
    ([[1, 0], [1, 1]], [[0, 1]]),                   # two seeds of A that disagree on a row, one of B
    ([[1, 1, 0], [0, 1, 0]], [[1, 0, 0], [0, 0, 1]]),
])
def test_the_bootstrap_distribution_matches_the_one_enumerated_by_hand(a, b):
    a, b = np.array(a), np.array(b)
    exact = _enumerated(a, b)
    r = paired_bootstrap(a, b, replicates=60_000, seed=1)
    assert r.estimate == pytest.approx(100 * (a.mean() - b.mean()))
    # the interval's ends are the exact distribution's 2.5% and 97.5% quantiles (atoms, so exactly equal)
    values = sorted(exact)
    cdf = np.cumsum([exact[v] for v in values])
    lo_exact = values[int(np.searchsorted(cdf, 0.025 - 1e-9))]
    hi_exact = values[int(np.searchsorted(cdf, 0.975 - 1e-9))]
    assert (r.low, r.high) == (pytest.approx(lo_exact), pytest.approx(hi_exact))
    # and the p-value is the exact share of replicates at least as far from the estimate as 0 is
    p_exact = sum(q for v, q in exact.items() if abs(v - r.estimate) >= abs(r.estimate) - 1e-9)
    assert r.p_value == pytest.approx(p_exact, abs=0.01)


def test_the_exact_permutation_test_by_hand():
    # 5 rows where A is right and B wrong, 3 where both are right: 2 of the 2^5 sign patterns reach |5|
    a = np.array([1, 1, 1, 1, 1, 1, 1, 1])
    b = np.array([0, 0, 0, 0, 0, 1, 1, 1])
    assert permutation_test(a, b) == 2 / 32
    assert permutation_test(a, a) == 1.0
    with pytest.raises(ConfigError, match="too many"):
        permutation_test(np.ones(30), np.zeros(30))


@pytest.mark.parametrize("wins,losses,ties", [(14, 4, 30), (9, 3, 60), (10, 10, 5)])
def test_the_bootstrap_p_value_agrees_with_the_exact_permutation_test(wins, losses, ties):
    """Rows A gets right and B wrong (wins), the reverse (losses), and ties: for one model a side both tests
    ask the same question; on these toy sets their p-values agree within 0.05 and make the same call at 0.05
    (with a dozen differing rows the bootstrap is a little liberal: 0.10 against the exact 0.15 for 9 / 3)."""
    a = np.array([1] * wins + [0] * losses + [1] * ties)
    b = np.array([0] * wins + [1] * losses + [1] * ties)
    exact = permutation_test(a, b)
    boot = paired_bootstrap(a, b, replicates=40_000, seed=3).p_value
    assert boot == pytest.approx(exact, abs=0.05)
    assert (boot < 0.05) == (exact < 0.05)


def test_identical_differences_give_a_point_interval():
    a = np.ones((3, 50))
    b = np.zeros((2, 50))
    r = paired_bootstrap(a, b, replicates=500)
    assert (r.estimate, r.low, r.high) == (100.0, 100.0, 100.0) and r.distinguishable


def test_under_no_true_difference_about_5_percent_are_called():
    """Simulated under the null (both sides' seeds drawn from one distribution of models) the 95% interval
    excludes 0 in about 5% of comparisons, not the ~8.5 in 198 (4.3%) plus the set's variance the old rule
    ignored: the row and seed stages are both resampled."""
    rng = np.random.default_rng(0)
    calls, tests = 0, 200
    for t in range(tests):
        difficulty = rng.uniform(0.3, 0.95, size=400)                      # each row's chance to be right
        skill = lambda: np.clip(difficulty + rng.normal(0, 0.02), 0, 1)   # a seed shifts it a little
        a = np.array([rng.random(400) < skill() for _ in range(3)])
        b = np.array([rng.random(400) < skill() for _ in range(3)])
        calls += paired_bootstrap(a, b, replicates=1000, seed=t).distinguishable
    assert calls / tests <= 0.09


def test_holm_and_benjamini_hochberg_by_hand():
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert benjamini_hochberg(p) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_a_corrected_difference_is_called_on_its_adjusted_p():
    d = [Difference(2.0, 0.5, 3.5, 0.02, 100, 3, 3, 1000), Difference(1.0, 0.1, 1.9, 0.04, 100, 3, 3, 1000)]
    holmed = correct(d, "holm")
    assert [x.p_adjusted for x in holmed] == pytest.approx([0.04, 0.04])
    assert all(x.distinguishable for x in holmed)
    assert not correct(d + [Difference(0.0, -1, 1, 0.9, 100, 3, 3, 1000)] * 2, "holm")[1].distinguishable
    assert d[0].describe() == "+2.0 [+0.5, +3.5]"
    assert Difference(0.35, -0.5, 1.2, 0.4, 9, 3, 3, 99).describe() == "+0.3 [-0.5, +1.2], not distinguishable from 0"


def test_tests_the_plan_named_but_not_yet_computed_count_as_p_1_in_the_family():
    d = [Difference(2.0, 0.5, 3.5, 0.005, 100, 3, 3, 1000), Difference(1.0, 0.1, 1.9, 0.02, 100, 3, 3, 1000)]
    # Holm over 4 with two p = 1 placeholders: 0.005 x 4, then max(0.02, 0.02 x 3)
    assert [x.p_adjusted for x in correct(d, "holm", family_size=4)] == pytest.approx([0.02, 0.06])
    assert [x.p_adjusted for x in correct(d, "holm", family_size=2)] == pytest.approx([0.01, 0.02])
    # BH over 4: 0.005 x 4 / 1, 0.02 x 4 / 2
    assert [x.p_adjusted for x in correct(d, "bh", family_size=4)] == pytest.approx([0.02, 0.04])


def test_bad_input_is_refused():
    with pytest.raises(ConfigError, match="same rows"):
        paired_bootstrap(np.ones((2, 10)), np.ones((2, 11)))
    with pytest.raises(ConfigError, match="0/1"):
        paired_bootstrap(np.full((1, 3), 0.5), np.ones((1, 3)))
    with pytest.raises(ConfigError, match="unknown correction"):
        correct([], "bonferoni")
