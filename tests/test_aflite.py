"""AFLite (Le Bras et al. 2020, Algorithm 1): predictability scores from ensembles of linear models."""
import dataclasses

import numpy as np
import pytest
import torch

from debiased_nli.data.tasks import get_task
from debiased_nli.methods.aflite.algorithm import AFLiteParams, aflite, predictability_scores, random_partitions, standardize
from debiased_nli.methods.aflite.step import aflite_filter, aflite_step
from debiased_nli.methods.aflite.ensemble import (LinearSolver, fit_linear_ensemble, predict_ensemble,
                                                  shared_preconditioner)
from debiased_nli.data.loading import new_rows
from debiased_nli.utils.errors import ConfigError, InvalidInputError
from test_embeddings import tiny_encoder  # noqa: F401  (the tiny BERT model folder fixture)

K = 3


def planted_bias(n_per_class=200, biased_share=0.3, d=8, seed=0, shift=3.0):
    """Paper section 3: rows whose embedding is pure noise (no signal about the label), except that a
    share of each class carries a planted feature that makes it linearly separable: K extra
    dimensions, zero for every row except dimension d + c = ``shift`` on the biased rows of class c."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(K), n_per_class)
    X = np.concatenate([rng.normal(size=(len(y), d)), np.zeros((len(y), K))], axis=1).astype(np.float32)
    biased = np.zeros(len(y), bool)
    for c in range(K):
        rows = np.nonzero(y == c)[0]
        pick = rng.choice(rows, size=int(biased_share * n_per_class), replace=False)
        biased[pick] = True
        X[pick, d + c] = shift
    return X, y, biased


def test_planted_bias_rows_are_the_ones_removed():
    X, y, biased = planted_bias()
    res = aflite(X, y, K, AFLiteParams(m=32, train_size=150, k=30, tau=0.75, target_n=200, seed=0), progress=False)
    removed = res.removed_indices
    assert len(removed) >= 0.8 * biased.sum()
    # almost everything removed is a planted row, and almost every planted row is gone
    assert biased[removed].mean() > 0.9
    assert biased[res.kept_indices].sum() <= 0.2 * biased.sum()
    # the run ends by the early stop (fewer than k rows above tau), not by reaching n
    assert "fewer than k" in res.stop_reason
    assert len(res.kept_indices) + len(removed) == len(y)
    assert set(res.kept_indices).isdisjoint(set(removed))


def _reference_scores(X, y, train, C=1.0):
    """Slow reference: one classifier at a time over the same partitions (scikit-learn and the
    single-partition torch fit), then the share of correct held-out predictions per row."""
    from sklearn.linear_model import LogisticRegression
    m, n = train.shape
    correct_torch = np.zeros(n)
    correct_skl = np.zeros(n)
    held = np.zeros(n)
    for i in range(m):
        fit = fit_linear_ensemble(X, y, train[i:i + 1], K, LinearSolver(C=C, tol=1e-7, max_iter=1000), dtype=torch.float64)
        assert fit.converged.all()
        pred_torch = predict_ensemble(X, fit.theta)[0]
        lr = LogisticRegression(C=C, tol=1e-10, max_iter=10_000).fit(X[train[i]], y[train[i]])
        pred_skl = lr.predict(X)
        v = ~train[i]
        held += v
        correct_torch += v & (pred_torch == y)
        correct_skl += v & (pred_skl == y)
    return correct_torch / held, correct_skl / held


def test_scores_equal_a_slow_one_partition_at_a_time_reference():
    rng = np.random.default_rng(3)
    n, d = 90, 5
    X = rng.normal(size=(n, d))
    y = (X @ rng.normal(size=(d, K)) + rng.gumbel(size=(n, K))).argmax(1)
    train = random_partitions(n, 12, 50, np.random.default_rng(7))
    sr = predictability_scores(X, y, K, train, LinearSolver(tol=1e-7, max_iter=1000), dtype=torch.float64)
    ref_torch, ref_skl = _reference_scores(X, y, train)
    np.testing.assert_array_equal(sr.scores, ref_torch)
    np.testing.assert_array_equal(sr.scores, ref_skl)
    assert sr.converged == 1.0
    np.testing.assert_array_equal(sr.n_heldout, (~train).sum(0))


def test_batched_weights_match_scikit_learn_logistic_regression():
    from sklearn.linear_model import LogisticRegression
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 6))
    y = (X @ rng.normal(size=(6, K)) + rng.gumbel(size=(200, K))).argmax(1)
    train = random_partitions(200, 4, 120, rng)
    fit = fit_linear_ensemble(X, y, train, K, LinearSolver(C=0.5, tol=1e-7, max_iter=1000), dtype=torch.float64)
    assert fit.converged.all() and (fit.grad_max <= 1e-7).all()
    for i in range(4):
        lr = LogisticRegression(C=0.5, tol=1e-10, max_iter=10_000).fit(X[train[i]], y[train[i]])
        ref = np.vstack([lr.coef_.T, lr.intercept_[None]])
        ours = fit.theta[i].numpy()
        # softmax weights are identified up to a shift per row; compare centred
        np.testing.assert_allclose(ours - ours.mean(1, keepdims=True), ref - ref.mean(1, keepdims=True), atol=1e-5)
    # the logits it leaves are those of the weights, on every row (train and held out)
    Xb = np.hstack([X, np.ones((len(X), 1))])
    np.testing.assert_allclose(fit.logits.numpy(), np.einsum("nd,mdk->nmk", Xb, fit.theta.numpy()), atol=1e-10)


def _objective(theta, X, y, C):
    """(1/t) Σ CE(W x + b, y) + ||W||² / (2 C t), scikit-learn's LogisticRegression objective."""
    Z = X @ theta[:-1] + theta[-1]
    Z = Z - Z.max(1, keepdims=True)
    ce = np.log(np.exp(Z).sum(1)) - Z[np.arange(len(y)), y]
    return ce.mean() + (theta[:-1] ** 2).sum() / (2 * C * len(y))


def test_float32_fits_reach_scikit_learns_solution_at_its_tolerance():
    """At scikit-learn's default tol (1e-4 on max|∇|) both stop converged, at objective values within
    1e-5 of the exact optimum; the weights differ by at most 0.03 (max |∇| <= 1e-4 leaves that much
    freedom along the flattest directions, where the curvature is about λ = 1/(C t)), and the
    held-out predictions agree on more than 99% of the rows. The embeddings have correlated
    dimensions and a weak label signal, like sentence embeddings of NLI pairs."""
    from sklearn.linear_model import LogisticRegression
    rng = np.random.default_rng(0)
    n, d = 1500, 32
    X = standardize((rng.normal(size=(n, d)) @ rng.normal(size=(d, d))).astype(np.float32))
    y = (X @ rng.normal(scale=0.2, size=(d, K)) + rng.gumbel(size=(n, K))).argmax(1)
    train = random_partitions(len(y), 3, 600, np.random.default_rng(0))
    fit = fit_linear_ensemble(X, y, train, K, LinearSolver(tol=1e-4))
    assert fit.converged.all() and fit.n_iter.max() < 60
    X64 = X.astype(np.float64)
    for i in range(3):
        Xi, yi = X64[train[i]], y[train[i]]
        lr = LogisticRegression(C=1.0, tol=1e-4, max_iter=1000).fit(Xi, yi)
        exact = LogisticRegression(C=1.0, tol=1e-10, max_iter=10_000).fit(Xi, yi)
        assert lr.n_iter_[0] < 1000
        ref = np.vstack([lr.coef_.T, lr.intercept_[None]])
        opt = _objective(np.vstack([exact.coef_.T, exact.intercept_[None]]), Xi, yi, 1.0)
        ours = fit.theta[i].numpy().astype(np.float64)
        assert 0 <= _objective(ours, Xi, yi, 1.0) - opt < 1e-5
        assert 0 <= _objective(ref, Xi, yi, 1.0) - opt < 1e-5
        np.testing.assert_allclose(ours - ours.mean(1, keepdims=True), ref - ref.mean(1, keepdims=True), atol=3e-2)
        held = ~train[i]
        agree = (fit.logits[:, i].numpy().argmax(1) == lr.predict(X64))[held].mean()
        assert agree > 0.99


def test_a_classifier_fit_does_not_depend_on_the_others_trained_with_it():
    """All m classifiers share the passes over the rows, but each keeps its own L-BFGS history,
    step and stopping test: fitting partition i alone or among m gives the same weights and iterations."""
    rng = np.random.default_rng(1)
    n, d, m = 120, 7, 7
    X = rng.normal(size=(n, d))
    y = (X @ rng.normal(size=(d, K)) + rng.gumbel(size=(n, K))).argmax(1)
    train = random_partitions(n, m, 70, np.random.default_rng(2))
    solver = LinearSolver(tol=1e-7, max_iter=1000)
    together = fit_linear_ensemble(X, y, train, K, solver, dtype=torch.float64)
    assert together.converged.all()
    for i in (0, 3, 6):
        alone = fit_linear_ensemble(X, y, train[i:i + 1], K, solver, dtype=torch.float64)
        np.testing.assert_allclose(together.theta[i].numpy(), alone.theta[0].numpy(), atol=1e-9)
        assert together.n_iter[i] == alone.n_iter[0]


def test_the_shared_preconditioner_is_the_inverse_hessian_at_zero_and_cuts_iterations():
    """At θ = 0 every class has probability 1/K and ∇²f = (I/K - 11ᵀ/K²) ⊗ E[x̃x̃ᵀ] + λ(I ⊗ diag(1,..,1,0)); on
    gradients (which sum to zero over classes) its inverse is the (d+1)² block P. Same optimum with
    or without it, in far fewer iterations on correlated dimensions."""
    rng = np.random.default_rng(5)
    n, d = 400, 6
    X = rng.normal(size=(n, d)) @ np.linalg.cholesky(0.9 * np.ones((d, d)) + 0.1 * np.eye(d)).T  # correlated
    y = (X @ rng.normal(size=(d, K)) + rng.gumbel(size=(n, K))).argmax(1)
    lam = 0.01
    P = shared_preconditioner(torch.as_tensor(X), lam, K, max_rows=n).numpy()
    Xb = np.hstack([X, np.ones((n, 1))])
    A = np.eye(K) / K - 1.0 / K ** 2
    H = np.kron(Xb.T @ Xb / n, A) + np.diag(np.kron(np.r_[np.full(d, lam), 0.0], np.ones(K)))
    g = rng.normal(size=(d + 1, K))
    g -= g.mean(1, keepdims=True)                      # a softmax gradient: zero sum over the classes
    np.testing.assert_allclose(H @ (P @ g).reshape(-1), g.reshape(-1), atol=1e-6)
    train = random_partitions(n, 4, 300, np.random.default_rng(0))
    solver = LinearSolver(C=1 / (lam * 300), tol=1e-8, max_iter=2000)
    pre = fit_linear_ensemble(X, y, train, K, solver, dtype=torch.float64)
    plain = fit_linear_ensemble(X, y, train, K, dataclasses.replace(solver, precondition=False), dtype=torch.float64)
    assert pre.converged.all() and plain.converged.all()
    np.testing.assert_allclose(pre.theta.numpy() - pre.theta.numpy().mean(2, keepdims=True),
                               plain.theta.numpy() - plain.theta.numpy().mean(2, keepdims=True), atol=1e-5)
    assert pre.n_iter.max() * 2 < plain.n_iter.min()


def test_partitions_of_unequal_size_match_their_own_fits():
    """Partitions of different t are fitted together (each row weighted 1/t_i in model i): each
    still minimises its own objective, (1/t_i) Σ CE + ||W||²/(2 C t_i), like scikit-learn."""
    from sklearn.linear_model import LogisticRegression
    rng = np.random.default_rng(4)
    n, d = 150, 5
    X = rng.normal(size=(n, d))
    y = (X @ rng.normal(size=(d, K)) + rng.gumbel(size=(n, K))).argmax(1)
    train = np.zeros((3, n), bool)
    for i, t in enumerate((40, 90, 61)):
        train[i, rng.choice(n, t, replace=False)] = True
    fit = fit_linear_ensemble(X, y, train, K, LinearSolver(C=2.0, tol=1e-7, max_iter=1000), dtype=torch.float64)
    assert fit.converged.all()
    for i in range(3):
        lr = LogisticRegression(C=2.0, tol=1e-10, max_iter=10_000).fit(X[train[i]], y[train[i]])
        ref = np.vstack([lr.coef_.T, lr.intercept_[None]])
        ours = fit.theta[i].numpy()
        np.testing.assert_allclose(ours - ours.mean(1, keepdims=True), ref - ref.mean(1, keepdims=True), atol=1e-5)


def test_a_partition_without_train_rows_is_named():
    with pytest.raises(ConfigError, match="partition 1 has no train rows"):
        fit_linear_ensemble(np.ones((4, 2)), np.array([0, 1, 2, 0]), np.array([[1, 1, 0, 0], [0, 0, 0, 0]], bool), K)


def test_partitions_have_t_train_rows_each():
    train = random_partitions(50, 7, 20, np.random.default_rng(0))
    assert train.shape == (7, 50)
    assert (train.sum(1) == 20).all()
    assert len({tuple(np.nonzero(r)[0]) for r in train}) == 7


def test_same_seed_same_output_other_seed_other_partitions():
    X, y, _ = planted_bias(n_per_class=60, seed=1)
    a = aflite(X, y, K, AFLiteParams(m=16, train_size=50, k=10, target_n=60, seed=5), progress=False)
    b = aflite(X, y, K, AFLiteParams(m=16, train_size=50, k=10, target_n=60, seed=5), progress=False)
    np.testing.assert_array_equal(a.kept_indices, b.kept_indices)
    np.testing.assert_array_equal(a.removed_indices, b.removed_indices)
    np.testing.assert_array_equal(a.removed_scores, b.removed_scores)
    assert a.history == b.history
    c = aflite(X, y, K, AFLiteParams(m=16, train_size=50, k=10, target_n=60, seed=6), progress=False)
    assert a.history[0]["score_histogram"] != c.history[0]["score_histogram"]


def test_greedy_removes_highest_scores_first_and_respects_tau():
    X, y, _ = planted_bias(n_per_class=80, seed=2)
    res = aflite(X, y, K, AFLiteParams(m=24, train_size=60, k=20, tau=0.75, target_n=80, seed=0), progress=False)
    assert (res.removed_scores >= 0.75).all()
    for r in np.unique(res.removed_round):
        s = res.removed_scores[res.removed_round == r]
        assert len(s) <= 20
    assert len(res.kept_indices) >= 80
    sizes = [h["size_after"] for h in res.history]
    assert sizes == sorted(sizes, reverse=True)
    assert res.history[-1]["size_after"] == len(res.kept_indices)


def test_target_n_is_never_undershot():
    X, y, _ = planted_bias(n_per_class=60, biased_share=0.9, seed=4)
    res = aflite(X, y, K, AFLiteParams(m=16, train_size=40, k=50, tau=0.5, target_n=150, seed=0), progress=False)
    assert len(res.kept_indices) == 150
    assert "target size" in res.stop_reason


def test_slice_sampling_variant_draws_only_rows_above_tau():
    X, y, biased = planted_bias(seed=3)
    res = aflite(X, y, K, AFLiteParams(m=32, train_size=150, k=30, tau=0.75, target_n=200, selection="sample", seed=0),
                 progress=False)
    assert (res.removed_scores >= 0.75).all()
    assert biased[res.removed_indices].mean() > 0.85
    greedy = aflite(X, y, K, AFLiteParams(m=32, train_size=150, k=30, tau=0.75, target_n=200, seed=0), progress=False)
    assert not np.array_equal(np.sort(res.removed_indices), np.sort(greedy.removed_indices))


def test_standardize_gives_zero_mean_unit_variance():
    X = np.random.default_rng(0).normal(3, 5, size=(100, 4)).astype(np.float32)
    X[:, 2] = 1.0
    Z = standardize(X)
    np.testing.assert_allclose(Z.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(Z[:, [0, 1, 3]].std(0), 1, atol=1e-4)


def test_defaults_scale_with_the_input_and_bad_sizes_are_named():
    # n = |D|/3 (the paper's 182k of 550k); without a warm-up, t = |D|/10; k = |D|/20 (project's choice)
    p = AFLiteParams().resolved(20_000, 3)
    assert (p.m, p.tau, p.target_n, p.train_size, p.k) == (64, 0.75, 6667, 2000, 1000)
    with pytest.raises(ConfigError, match=r"t = 500.*n = 400"):
        AFLiteParams(train_size=500, target_n=400).resolved(1000, 3)
    with pytest.raises(ConfigError, match="tau"):
        AFLiteParams(tau=1.5).resolved(1000, 3)


def _dataset(n_per_class=60, seed=0):
    X, y, biased = planted_bias(n_per_class=n_per_class, seed=seed)
    names = ["entailment", "neutral", "contradiction"]
    ds = new_rows("snli", [f"premise {i}" for i in range(len(y))], [f"hypothesis {i}" for i in range(len(y))],
                  [names[c] for c in y], origin="generated", method="test")
    return ds, X, y, biased


def test_dataset_helper_keeps_every_row_accounted_for():
    ds, X, y, biased = _dataset()
    kept, removed, res = aflite_filter(ds, X, m=16, train_size=50, k=10, target_n=60, seed=0, progress=False)
    assert len(kept) + len(removed) == len(ds)
    assert sorted(list(kept["uid"]) + list(removed["uid"])) == sorted(ds["uid"])
    assert {"aflite_score", "aflite_round", "reason"} <= set(removed.column_names)
    assert all(s >= 0.75 for s in removed["aflite_score"])
    assert set(removed["reason"]) <= {"aflite"}
    assert kept.features["label"].names == ds.features["label"].names


def test_embedding_row_count_mismatch_names_both_counts():
    ds, X, _, _ = _dataset()
    with pytest.raises(InvalidInputError, match=rf"{len(ds)} rows.*{len(ds) - 1} rows"):
        aflite_filter(ds, X[:-1], progress=False)
    with pytest.raises(InvalidInputError, match="179 rows but there are 180 labels"):
        aflite(X[:-1], np.asarray(ds["label"]), K, progress=False)


def test_nan_embedding_and_out_of_range_label_name_the_row():
    X, y, _ = planted_bias(n_per_class=20)
    X[7, 2] = np.nan
    with pytest.raises(InvalidInputError, match="row 7"):
        aflite(X, y, K, progress=False)
    X[7, 2] = 0.0
    y = y.copy()
    y[11] = 5
    with pytest.raises(InvalidInputError, match="row 11: label 5"):
        aflite(X, y, K, progress=False)


def test_step_rejects_unknown_parameters_with_a_suggestion():
    ds, _, _, _ = _dataset(n_per_class=5)
    with pytest.raises(ConfigError, match="Did you mean.*'tau'"):
        aflite_step(ds, get_task("snli"), {"tua": 0.7})


def test_command_writes_kept_removed_report_and_plot(tmp_path, tiny_encoder):
    import json

    import pandas as pd

    from debiased_nli.cli import main
    rng = np.random.default_rng(0)
    words = "a man woman dog plays runs sleeps outside inside the park street ball".split()
    pd.DataFrame({"premise": [" ".join(rng.choice(words, 8)) for _ in range(60)],
                  "hypothesis": [" ".join(rng.choice(words, 4)) for _ in range(60)],
                  "label": np.arange(60) % 3}).to_parquet(tmp_path / "train.parquet")
    out = tmp_path / "out"
    assert main(["aflite", "snli", "--data-files", str(tmp_path / "train.parquet"), "--encoder", tiny_encoder,
                 "--out", str(out), "--m", "8", "--train-size", "10", "--k", "5", "--target-n", "20"]) == 0
    report = json.loads((out / "aflite.json").read_text())
    kept, removed = pd.read_parquet(out / "kept.parquet"), pd.read_parquet(out / "removed.parquet")
    assert len(kept) == report["n_kept"] and len(removed) == report["n_removed"]
    assert len(kept) + len(removed) == 60
    assert report["params"]["m"] == 8 and report["params"]["tau"] == 0.75
    # the paper's warm-up by default: 10% of the rows fine-tune the encoder and are set aside
    assert report["removed_by_reason"]["warm-up"] == 6 == (removed["reason"] == "warm-up").sum()
    assert [h["size_before"] for h in report["history"]][0] == 54
    assert report["protocol"]["tau"]["source"].startswith("project's choice")
    assert {"before", "after", "random_same_size"} <= set(report["audit"])
    md = (out / "aflite.md").read_text()
    assert "## Bias audit" in md and "## Where each value comes from" in md and "warm-up:" in md
    assert (out / "aflite.png").stat().st_size > 0
    # a train size that is not below the target size is refused with both numbers
    assert main(["aflite", "snli", "--data-files", str(tmp_path / "train.parquet"), "--encoder", tiny_encoder,
                 "--out", str(out), "--train-size", "30", "--target-n", "20"]) == 2
