"""PDD's z-value (Guo et al. 2023, Eq. 1) and Appendix C: both operations move z*(l, x) toward 0."""
import itertools

import numpy as np
import pytest

from debiased_nli.utils.errors import ConfigError
from debiased_nli.bias.features import FeatureMatrix
from debiased_nli.methods.pdd.zvalue import (KEEP, LOSE, apply_case, case_for, objective_derivative,
                                             printed_derivative, squared_objective, z_star)
from debiased_nli.bias.zstats import compute_zstats, group_labels, z_from_counts


def test_z_star_is_eq_1_and_the_library_z():
    counts = np.array([30, 5, 15])
    p0 = 1 / 3
    n = counts.sum()
    expected = (counts / n - p0) / np.sqrt(p0 * (1 - p0) / n)
    np.testing.assert_allclose(z_star(counts, p0), expected)
    np.testing.assert_allclose(z_star(counts, p0), z_from_counts(counts[None, :], np.full(3, p0))[2][0])


@pytest.mark.parametrize("p0", [1 / 2, 1 / 3])
def test_corrected_appendix_c_derivative_matches_finite_differences(p0):
    """d[n (p_hat - p0)^2]/d n_l = (p_hat - p0)(2 - p0 - p_hat); the printed (2 + p0 + p_hat)(p0 - p_hat) is off."""
    h = 1e-6
    for n_l, n_rest in [(7, 20), (30, 10), (1, 50), (120, 80), (12, 24)]:
        numeric = (squared_objective(n_l + h, n_rest, p0) - squared_objective(n_l - h, n_rest, p0)) / (2 * h)
        p_hat = n_l / (n_l + n_rest)
        assert objective_derivative(p_hat, p0) == pytest.approx(numeric, rel=1e-5, abs=1e-8)
    # the spec's check: p_hat = 0.5 at p0 = 1/3 -> 0.19444; the printed formula gives -0.472
    if p0 == 1 / 3:
        p_hat = 0.5
        assert (squared_objective(20 + h, 20, p0) - squared_objective(20 - h, 20, p0)) / (2 * h) == \
            pytest.approx(0.194444, abs=1e-5)
        assert objective_derivative(p_hat, p0) == pytest.approx(0.194444, abs=1e-5)
        assert printed_derivative(p_hat, p0) == pytest.approx(-0.4722, abs=1e-3)


@pytest.mark.parametrize("K,n_max", [(2, 400), (3, 70)])
def test_both_operations_strictly_lower_the_z_value_of_the_rows_label(K, n_max):
    """Over every count vector with 0 < n < n_max and |z*(l, x)| > 1: adding a row of l (p_hat < p0) or
    removing one (p_hat > p0) strictly lowers |z*(l, x)| (section 3.2, 'see appendix C for proof')."""
    p0 = 1 / K
    checked = 0
    for counts in itertools.product(range(n_max), repeat=K):
        n = sum(counts)
        if n == 0 or n >= n_max:
            continue
        c = np.array(counts)
        z = z_star(c, p0)
        for l in range(K):
            if abs(z[l]) <= 1:
                continue
            case = case_for(c, l, p0)
            after = c.copy()
            apply_case(after, l, case)
            assert abs(z_star(after, p0)[l]) < abs(z[l]), (counts, l, case)
            checked += 1
    assert checked > 1000


def test_case_follows_p_hat_against_p0():
    c = np.array([10, 2, 3])
    assert case_for(c, 0, 1 / 3) == LOSE and case_for(c, 1, 1 / 3) == KEEP
    assert case_for(np.array([2, 2, 2]), 0, 1 / 3) is None


def test_fever_label_groups_make_refutes_and_nei_one_class():
    """Section 4.2: 'we view "refutes" and "not enough information" as one class when computing z-values'."""
    names = ["SUPPORTS", "REFUTES", "NOT ENOUGH INFO"]
    group_of, groups = group_labels(names, [["SUPPORTS"], ["REFUTES", "NOT ENOUGH INFO"]])
    assert group_of.tolist() == [0, 1, 1] and groups == ("SUPPORTS", "REFUTES+NOT ENOUGH INFO")
    # a feature in 10 SUPPORTS, 4 REFUTES and 6 NEI rows: 10 vs 10 over two groups is balanced
    labels = np.array([0] * 10 + [1] * 4 + [2] * 6)
    fm = FeatureMatrix(np.arange(21), np.zeros(20, np.int32), np.array(["x@pair"], dtype=object))
    zs = compute_zstats(fm, labels, names, label_groups=[["SUPPORTS"], ["REFUTES", "NOT ENOUGH INFO"]])
    assert zs.label_names == groups and zs.p0.tolist() == [0.5, 0.5]
    np.testing.assert_allclose(zs.z[0], [0.0, 0.0])
    plain = compute_zstats(fm, labels, names)
    assert plain.z[0, 0] > 0  # without grouping SUPPORTS looks over-represented (10/20 > 1/3)


@pytest.mark.parametrize("groups,match", [([["SUPPORTS"], ["REFUTES"]], "leaves out"),
                                          ([["SUPPORTS", "REFUTES"], ["REFUTES", "NOT ENOUGH INFO"]], "two groups"),
                                          ([["SUPPORTS"], ["nope", "REFUTES", "NOT ENOUGH INFO"]], "not one of")])
def test_bad_label_groups_are_refused(groups, match):
    with pytest.raises(ConfigError, match=match):
        group_labels(["SUPPORTS", "REFUTES", "NOT ENOUGH INFO"], groups)
