import math

import numpy as np
import pytest

from debiased_nli.utils.errors import ConfigError
from debiased_nli.bias.features import FeatureMatrix
from debiased_nli.bias.zstats import bonferroni_threshold, compute_zstats, top_k_ids, z_only_label


def matrix(rows, vocab):
    indptr = np.cumsum([0] + [len(r) for r in rows])
    return FeatureMatrix(indptr, np.array([i for r in rows for i in r], np.int32), np.array(vocab, dtype=object))


def test_a_feature_seen_only_with_one_label():
    # feature 0 in 9 contradiction rows only; feature 1 everywhere
    rows = [[0, 1]] * 9 + [[1]] * 6
    labels = np.array([2] * 9 + [0] * 3 + [1] * 3)
    zs = compute_zstats(matrix(rows, ["nobody@hypothesis", "<null>"]), labels, ["e", "n", "c"])
    p0 = 1 / 3
    expected = math.sqrt(9) * (1 - p0) / math.sqrt(p0 * (1 - p0))
    assert zs.z[0, 2] == pytest.approx(expected) == pytest.approx(z_only_label(9, p0))
    assert zs.z[0, 0] == pytest.approx((0 - p0) / math.sqrt(p0 * (1 - p0) / 9))
    assert zs.n[1] == 15 and zs.p_hat[1].tolist() == pytest.approx([3 / 15, 3 / 15, 9 / 15])


def test_z_matches_the_formula_for_every_cell_and_prior_p0():
    rng = np.random.default_rng(0)
    rows = [sorted(set(rng.integers(0, 6, size=3).tolist())) for _ in range(200)]
    labels = rng.integers(0, 3, size=200)
    fm = matrix(rows, [f"f{i}" for i in range(6)])
    for p0_opt in ("uniform", "prior"):
        zs = compute_zstats(fm, labels, ["a", "b", "c"], p0=p0_opt)
        prior = np.bincount(labels, minlength=3) / 200 if p0_opt == "prior" else np.full(3, 1 / 3)
        for x in range(6):
            have = [i for i, r in enumerate(rows) if x in r]
            n = len(have)
            for l in range(3):
                p_hat = np.mean(labels[have] == l)
                assert zs.z[x, l] == pytest.approx((p_hat - prior[l]) / math.sqrt(prior[l] * (1 - prior[l]) / n))


def test_top_k_breaks_ties_by_id_and_skips_absent_features():
    assert top_k_ids(np.array([1.0, 3.0, 3.0, 2.0]), 3).tolist() == [1, 2, 3]
    assert top_k_ids(np.array([1.0, 3.0]), 4, np.array([True, False])).tolist() == [0, -1, -1, -1]
    rows = [[0]] * 4 + [[1]] * 2
    zs = compute_zstats(matrix(rows, ["a", "b", "unused"]), np.array([0, 0, 0, 0, 1, 1]), ["x", "y"])
    assert zs.top_k(3)[0].tolist() == [0, 1, -1]


def test_bonferroni_threshold_grows_with_the_number_of_tests():
    assert bonferroni_threshold(1, 0.05) == pytest.approx(1.959964, abs=1e-5)
    assert bonferroni_threshold(10_000) > bonferroni_threshold(100)


def test_bad_p0_and_label_count():
    fm = matrix([[0]], ["a"])
    with pytest.raises(ConfigError):
        compute_zstats(fm, np.array([0]), ["x", "y"], p0=1.5)
    with pytest.raises(ConfigError):
        compute_zstats(fm, np.array([0, 1]), ["x", "y"])


def test_counts_over_parts_and_row_blocks_are_the_counts_of_the_union():
    from debiased_nli.bias.zstats import compute_zstats_parts, count_matrix

    rng = np.random.default_rng(1)
    rows = [sorted(set(rng.integers(0, 9, size=4).tolist())) for _ in range(300)]
    labels = rng.integers(0, 3, size=300)
    fm = matrix(rows, [f"f{i}" for i in range(9)])
    # blocks of 7 rows, a boolean mask and a list of positions all count the same rows
    mask = rng.random(300) < 0.4
    np.testing.assert_array_equal(count_matrix(fm, labels, 3, mask, block_rows=7), count_matrix(fm, labels, 3, mask))
    np.testing.assert_array_equal(count_matrix(fm, labels, 3, np.nonzero(mask)[0]), count_matrix(fm, labels, 3, mask))
    # D0's rows 0..199 plus the new rows 200..299 kept by a mask: the z-statistics of their union
    d0 = fm.select(np.arange(200))
    dg = fm.select(np.arange(200, 300))
    keep_g = mask[200:]
    parts = compute_zstats_parts([(d0, labels[:200], None), (dg, labels[200:], np.nonzero(keep_g)[0])], ["a", "b", "c"])
    union = np.concatenate([np.arange(200), 200 + np.nonzero(keep_g)[0]])
    whole = compute_zstats(fm.select(union), labels[union], ["a", "b", "c"])
    np.testing.assert_array_equal(parts.counts, whole.counts)
    np.testing.assert_allclose(parts.z, whole.z)
    assert parts.n_rows == whole.n_rows == len(union)
    other = matrix(rows, [f"g{i}" for i in range(9)])
    with pytest.raises(ConfigError, match="share one vocabulary"):
        compute_zstats_parts([(d0, labels[:200], None), (other, labels, None)], ["a", "b", "c"])


def test_largest_z_leaves_out_the_named_features():
    from debiased_nli.bias.features import FeatureMatrix

    vocab = np.array(sorted(["<null>", "a@hypothesis", "b@hypothesis", "nobody@hypothesis"]), dtype=object)
    # <null> in every row; "nobody" only in contradiction rows; a and b spread over entailment and neutral
    rows = [["<null>", "nobody@hypothesis"]] * 30 + [["<null>", "a@hypothesis"]] * 30 + [["<null>", "b@hypothesis"]] * 30
    labels = np.array([2] * 30 + [0] * 20 + [1] * 10 + [0] * 10 + [1] * 20)
    index = {v: i for i, v in enumerate(vocab)}
    indptr = np.cumsum([0] + [len(r) for r in rows])
    indices = np.array([index[f] for r in rows for f in r], np.int32)
    zs = compute_zstats(FeatureMatrix(indptr, indices, vocab), labels, ["e", "n", "c"])
    nobody = index["nobody@hypothesis"]
    assert zs.max_abs_z() == pytest.approx(np.abs(zs.z).max())
    without = zs.max_abs_z(exclude=("nobody@hypothesis", "not-a-feature"))
    assert without == pytest.approx(np.abs(np.delete(zs.z, nobody, axis=0)).max()) and without < zs.max_abs_z()
