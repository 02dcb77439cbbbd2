"""debiased_nli.bias.logreg: the machine-independent TF-IDF and logistic regression of the hypothesis-only feature."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from debiased_nli.bias import logreg

ROOT = Path(__file__).resolve().parents[1]


def test_exp_and_log_are_within_a_few_ulps_of_numpys():
    x = np.random.default_rng(0).uniform(-700, 700, 200_000)
    np.testing.assert_allclose(logreg.exp(x), np.exp(x), rtol=4e-16, atol=0)
    pos = np.abs(x) + 1e-300
    np.testing.assert_allclose(logreg.log(pos), np.log(pos), rtol=4e-16, atol=1e-300)
    assert logreg.exp(np.array([0.0]))[0] == 1.0 and logreg.log(np.array([1.0]))[0] == 0.0
    assert logreg.log(np.array([2.0 ** 40]))[0] == pytest.approx(40 * np.log(2), rel=1e-16)


def test_exp_and_log_give_the_same_bits_with_and_without_numpys_avx512_kernels():
    # np.exp and np.log do not (numpy dispatches them to AVX-512 code where the CPU has it): ours must
    code = ("import hashlib, numpy as np; from debiased_nli.bias import logreg; "
            "x = np.random.default_rng(0).uniform(-30, 5, 100_000); "
            "print(hashlib.sha256(logreg.exp(x).tobytes() + logreg.log(x + 31).tobytes()).hexdigest())")
    from test_determinism import _numpy_avx512_features

    outs = []
    for disable in ("", " ".join(_numpy_avx512_features())):
        env = dict(os.environ, PYTHONPATH=str(ROOT), NPY_DISABLE_CPU_FEATURES=disable)
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout.strip())
    assert outs[0] == outs[1]


def test_tfidf_matches_scikit_learns_sublinear_tfidf():
    from sklearn.feature_extraction.text import TfidfTransformer

    rng = np.random.default_rng(1)
    X = sp.random(300, 40, density=0.1, random_state=2, format="csr")
    X.data = rng.integers(1, 4, len(X.data)).astype(np.float64)
    ours = logreg.TfidfTransformer().fit(X)
    ref = TfidfTransformer(sublinear_tf=True).fit(X)
    np.testing.assert_allclose(ours.idf_, ref.idf_, rtol=1e-15)
    np.testing.assert_allclose(ours.transform(X).toarray(), ref.transform(X).toarray(), rtol=1e-14, atol=1e-15)


def _problem(n=600, v=80, k=3, seed=0):
    rng = np.random.default_rng(seed)
    X = sp.random(n, v, density=0.08, random_state=seed, format="csr")
    true = rng.normal(size=(v, k)) * 2
    y = np.argmax(X @ true + rng.gumbel(size=(n, k)), axis=1)
    return logreg.TfidfTransformer().fit_transform(X), y


def test_fit_reaches_scikit_learns_optimum_far_below_its_tolerance():
    from sklearn.linear_model import LogisticRegression

    X, y = _problem()
    ours = logreg.LogisticRegression(C=1.0).fit(X, y)
    ref = LogisticRegression(C=1.0, solver="newton-cg", tol=1e-12, max_iter=1000).fit(X, y)
    assert ours.info_["converged"] and ours.info_["max_abs_gradient"] <= 1e-10
    assert ours.n_iter_[0] <= 15
    # the same optimum: scikit-learn's multinomial parameters are identified the same way (W's rows sum to 0)
    np.testing.assert_allclose(ours.coef_, ref.coef_, atol=1e-6)
    np.testing.assert_allclose(ours.predict_proba(X), ref.predict_proba(X), atol=1e-7)
    np.testing.assert_array_equal(ours.predict(X), ref.predict(X))


def test_fit_gives_the_same_bits_however_the_matrix_was_built():
    X, y = _problem(seed=3)
    a = logreg.LogisticRegression().fit(X, y)
    # the same matrix with its entries stored in another order, as int-valued float32
    coo = X.tocoo()
    perm = np.random.default_rng(0).permutation(coo.nnz)
    shuffled = sp.csr_matrix((coo.data[perm], (coo.row[perm], coo.col[perm])), shape=X.shape)
    shuffled.has_sorted_indices = False
    b = logreg.LogisticRegression().fit(shuffled, y)
    assert a.coef_.tobytes() == b.coef_.tobytes() and a.intercept_.tobytes() == b.intercept_.tobytes()


def test_classes_absent_from_the_fold_are_left_out_as_scikit_learn_does():
    X, y = _problem(k=3, seed=4)
    y = np.where(y == 1, 2, y)  # no class 1
    m = logreg.LogisticRegression().fit(X, y)
    assert m.classes_.tolist() == [0, 2] and set(m.predict(X)) <= {0, 2}
    assert m.info_["converged"]
    with pytest.raises(ValueError, match="at least 2 classes"):
        logreg.LogisticRegression().fit(X, np.zeros(X.shape[0], int))


def test_ties_within_the_margin_go_to_the_lowest_label():
    Z = np.array([[1.0, 2.0, 2.0 + 5e-8],      # 2 and 3 within 1e-7: a tie, label 1 wins
                  [0.5, 0.5, -1.0],            # an exact tie: label 0
                  [0.0, 1.0, 1.0 + 2e-7],      # outside the margin: label 2
                  [3.0, -np.inf, 2.0]]).T      # an absent label never wins
    pred, tie = logreg.decide(Z)
    assert pred.tolist() == [1, 0, 2, 0]
    assert tie.tolist() == [True, True, False, False]
