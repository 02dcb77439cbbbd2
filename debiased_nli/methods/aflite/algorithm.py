"""AFLite: adversarial filtering of dataset biases with ensembles of linear models
(Le Bras et al. 2020, "Adversarial Filters of Dataset Biases", ICML, §2 and Algorithm 1).

The protocol (§2 "Implementation", §4 "Experimental Setup"): a warm-up model is fine-tuned on a random
share of D, those rows are not reused, and Φ(x) is read from the fine-tuned model ("the final layer
before the output layer": here the first token of its encoder); the warm-up size is AFLite's train size
t ("this fraction corresponds to the training size for AFLite and it remains unchanged across
iterations"). Then, with the target size n, m partitions, slice size k and threshold τ::

    S = D \\ warm-up rows
    while |S| > n:
        E(e) = ∅ for every e in S
        for i in 1..m:
            random partition (T_i, V_i) of S with |T_i| = t
            train a linear classifier L_i on {(Φ(x), y) : (x, y) ∈ T_i}
            add L_i(Φ(x)) to E(e) for every e = (x, y) ∈ V_i
        score(e) = |{p ∈ E(e) : p = y}| / |E(e)|              (the predictability score)
        S' = the (up to) k rows of S with the highest score among those with score >= τ
        S = S \\ S'
        if |S'| < k: stop

Values: t = the warm-up size and n = |D|/3 are the paper's (§4: SNLI-AFLite has "size 182k" against
"550k", "amounting to only a third of the full data"). The text gives no value for m, k or τ ("slice
size and number of partitions are determined by the available computation budget"; τ is "a
pre-specified early stopping threshold"): m = 64, τ = 0.75 and k = |S|/20 are the project's choices, as
are the warm-up share (0.1; the paper: "a small fraction of the data"), C = 1 and tol = 1e-4 of the
linear models. :data:`.params.PARAMS` says where each value comes from; the report and the card repeat it.

The linear classifier is multinomial logistic regression with an L2 penalty, as scikit-learn's
``LogisticRegression(C=C)`` fits it (the intercept is not penalised)::

    min_{W,b}  (1/t) Σ_{j∈T_i} CE(softmax(W·x_j + b), y_j) + ||W||² / (2 C t)

fitted to max|∇| <= tol (scikit-learn's ``tol``). The m fits of a round share their rows: every T_i
is a subset of S, so all m classifiers are evaluated at once with per-classifier 0/1 weights, and
one L-BFGS iteration of all of them is two matrix products over S ((N x d)·(d x mK) for the logits,
(mK x N)·(N x d) for the gradient): compute-bound, where m separate fits on their own t rows each
read their rows at 3 multiply-adds per value (memory-bound). The logits of every row under every
classifier are left at the end, so the held-out predictions cost nothing more. Each classifier keeps
its own L-BFGS history, step, Armijo line search and stopping test, and starts from the inverse
Hessian at θ = 0 shared by all of them (:func:`shared_preconditioner`, E[x̃x̃ᵀ]/K + λ), which removes
the correlations between embedding dimensions: about 10 iterations instead of about 115 for
scikit-learn's on the SNLI embeddings. This solver is hand-written because no library fits m
logistic regressions on masked subsets of shared rows with a shared preconditioner; the measured
reason is on the documentation's AFLite page (same tolerance, both converged). A slow reference
(one partition at a time with scikit-learn) is kept in the tests, which check that the scores agree.

Variants and choices (documented deviations from the paper's text):

* ``selection="sample"`` is the slice-sampling variant: the k rows are drawn without replacement
  among those with score >= τ with probability proportional to the score, via Gumbel top-k on
  log(score).
* The last slice is capped at |S| - n, so the output never has fewer than n rows (the paper's loop
  may overshoot n by up to k - 1).
* Embeddings are standardised (zero mean, unit variance per dimension over S) before the linear
  models, which changes only the conditioning (and the meaning of C).
* A row never held out in a round (possible only for tiny m) has no score that round and is kept.
* Without a warm-up (``warmup_share: 0``), t defaults to a tenth of the rows (project's choice).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from ...utils.errors import ConfigError, EmptyResultError, InvalidInputError
from .params import PARAMS

_D = PARAMS.defaults()  # the declared defaults (m, tau, C, ...): written once, in .params
from .ensemble import CHUNK_ROWS, LinearSolver, fit_linear_ensemble

log = logging.getLogger(__name__)


def paper_target_size(n_rows: int) -> int:
    """n = round(|D| / 3), the paper's SNLI outcome (182k of 550k), at least 1."""
    return max(1, round(n_rows * TARGET_SHARE))

SELECTIONS = ("greedy", "sample")
TARGET_SHARE = 1 / 3
"""n ≈ |D|/3: §4 "Experimental Setup" compares the filtered set to "a randomly subsampled dataset, with
the same sample size as [the filtered one], amounting to only a third of the full data"; Table 1:
"AFLite-filtered data (, size 182k)" against "the original SNLI data (, size 550k)"."""
WARMUP_REASON = "warm-up"
AFLITE_REASON = "aflite"


# ----------------------------------------------------------------------------------------------
# parameters


@dataclasses.dataclass
class AFLiteParams:
    """The knobs of Algorithm 1 (``None`` = the scaled default, see the module docstring)."""

    m: int = _D["m"]
    train_size: int | None = None
    k: int | None = None
    tau: float = _D["tau"]
    target_n: int | None = None
    selection: str = _D["selection"]
    C: float = _D["C"]
    max_iter: int = _D["max_iter"]
    tol: float = _D["tol"]
    history_size: int = 10
    standardize: bool = True
    seed: int = _D["seed"]
    max_rounds: int | None = None

    def resolved(self, n_rows: int, num_labels: int) -> "AFLiteParams":
        """Fill in the scaled defaults for an input of ``n_rows`` rows and check everything."""
        p = dataclasses.replace(self)
        if p.target_n is None:
            p.target_n = paper_target_size(n_rows)
        if p.train_size is None:
            # without a warm-up slice to size it: a tenth of the rows, the default warm-up share (project's choice)
            p.train_size = max(2 * num_labels, min(round(n_rows * PARAMS['warmup_share'].default), p.target_n - 1))
        if p.k is None:
            p.k = max(1, n_rows // 20)  # project's choice: twenty slices at most
        if p.m < 1:
            raise ConfigError(f"m (the number of partitions) must be >= 1, got {p.m}")
        if not 0 < p.tau <= 1:
            raise ConfigError(f"tau must lie in (0, 1], got {p.tau}")
        if p.k < 1:
            raise ConfigError(f"k (the slice size) must be >= 1, got {p.k}")
        if not 1 <= p.target_n:
            raise ConfigError(f"target_n must be >= 1, got {p.target_n}")
        if not 1 <= p.train_size < p.target_n:
            raise ConfigError(f"the train size t must satisfy 1 <= t < n (the target size): t = {p.train_size}, "
                              f"n = {p.target_n}. Lower --train-size or raise --target-n")
        if p.selection not in SELECTIONS:
            raise ConfigError(f"selection must be one of {SELECTIONS}, not {p.selection!r}")
        if p.C <= 0:
            raise ConfigError(f"C (inverse regularisation strength) must be > 0, got {p.C}")
        return p

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------
# predictability scores (the ensemble itself: ensemble.py)


def random_partitions(n: int, m: int, t: int, rng: np.random.Generator) -> np.ndarray:
    """train[i, j] is True when row j is in T_i: m independent uniformly random t-subsets of n rows."""
    if not 1 <= t < n:
        raise ConfigError(f"cannot draw a train part of t = {t} rows from {n} rows (need 1 <= t < {n})")
    keys = rng.random((m, n), dtype=np.float32)
    part = np.argpartition(keys, t - 1, axis=1)[:, :t]
    train = np.zeros((m, n), dtype=bool)
    np.put_along_axis(train, part, True, axis=1)
    return train


"""Rows per chunk of a pass over the data: bounds the (rows, m, K) temporaries (16k x 64 x 3 floats)."""
"""At most this many Armijo backtracking trials (steps 1, 1/2, ..., 2^-29) per L-BFGS iteration."""
"""Trial steps after the unit step evaluated together (one pass over the rows for 1/2, 1/4, 1/8, 1/16)."""


def standardize(X: np.ndarray) -> np.ndarray:
    """(X - mean) / std per dimension (std 0 -> 1)."""
    mu = X.mean(0, dtype=np.float64)
    sd = X.std(0, dtype=np.float64)
    sd[sd == 0] = 1.0
    return ((X - mu) / sd).astype(X.dtype, copy=False)


@dataclasses.dataclass
class ScoreRound:
    """One filtering phase: score per row (NaN where never held out), held-out counts, and the fit."""

    scores: np.ndarray
    n_heldout: np.ndarray
    n_correct: np.ndarray
    heldout_accuracy: float
    n_iter_max: int
    converged: float
    n_iter_median: float = 0.0


def heldout_correct(y, logits, train_mask, *, chunk_rows: int = CHUNK_ROWS):
    """Per row: how many partitions held it out (|{i : e ∈ V_i}|) and how many of those predict its
    label (|{i : e ∈ V_i, argmax_k (x W_i + b_i)_k = y_e}|), from the logits of every classifier on
    every row ((N, m, K), as :func:`fit_linear_ensemble` leaves them). Returns (n_heldout, n_correct),
    int64 (N,)."""
    import torch
    dev = logits.device
    yt = torch.as_tensor(np.asarray(y), device=dev).long()
    held = torch.as_tensor(~np.asarray(train_mask, dtype=bool), device=dev)   # m, N
    n_corr = torch.zeros(len(yt), dtype=torch.long, device=dev)
    by_class = logits.permute(0, 2, 1)                                                 # N, K, m
    for a in range(0, len(yt), chunk_rows):
        # argmax over the K classes (the first of equal maxima, like torch.argmax) as K-1 comparisons
        # of (rows, m) slabs: torch's argmax over a dimension of size 3 is slow on CPU
        z = by_class[a:a + chunk_rows]
        best, pred = z[:, 0], torch.zeros(z.shape[0], z.shape[2], dtype=torch.long, device=dev)
        for k in range(1, z.shape[1]):
            better = z[:, k] > best
            best = torch.where(better, z[:, k], best)
            pred.masked_fill_(better, k)
        n_corr[a:a + chunk_rows] = ((pred == yt[a:a + chunk_rows, None]) & held[:, a:a + chunk_rows].T).sum(1)
    return held.sum(0).cpu().numpy().astype(np.int64), n_corr.cpu().numpy()


def predictability_scores(X, y, num_labels: int, train: np.ndarray, solver: LinearSolver | None = None, *,
                          dtype=None, device=None, progress: bool = False) -> ScoreRound:
    """score(e) = |{i : e ∈ V_i and L_i(Φ(e)) = y_e}| / |{i : e ∈ V_i}| over the m partitions ``train``
    (train[i, j]: row j is in T_i, e.g. :func:`random_partitions`), V_i the rows outside T_i."""
    fit = fit_linear_ensemble(X, y, train, num_labels, solver, dtype=dtype, device=device, progress=progress)
    n_held, n_corr = heldout_correct(y, fit.logits, train)
    with np.errstate(invalid="ignore", divide="ignore"):
        scores = np.where(n_held > 0, n_corr / np.maximum(n_held, 1), np.nan)
    acc = float(n_corr.sum() / max(n_held.sum(), 1))
    return ScoreRound(scores, n_held, n_corr, acc, int(fit.n_iter.max(initial=0)), float(fit.converged.mean()),
                      float(np.median(fit.n_iter)) if len(fit.n_iter) else 0.0)


# ----------------------------------------------------------------------------------------------
# Algorithm 1


@dataclasses.dataclass
class AFLiteResult:
    """Row indices (into the input) kept and removed, the score and round of every removed row,
    and one record per round (sizes, candidates, score distribution)."""

    kept_indices: np.ndarray
    removed_indices: np.ndarray
    removed_scores: np.ndarray
    removed_round: np.ndarray
    history: list[dict]
    params: dict
    stop_reason: str

    def to_dict(self) -> dict:
        return {"n_input": int(len(self.kept_indices) + len(self.removed_indices)),
                "n_kept": int(len(self.kept_indices)), "n_removed": int(len(self.removed_indices)),
                "rounds": len(self.history), "stop_reason": self.stop_reason, "params": self.params,
                "history": self.history}


def _select_slice(scores: np.ndarray, tau: float, k: int, selection: str, rng: np.random.Generator) -> np.ndarray:
    """Positions of the rows to remove: up to k rows with score >= tau, highest first (greedy), or
    drawn with probability ∝ score (Gumbel top-k on log score)."""
    cand = np.nonzero(np.nan_to_num(scores, nan=-1.0) >= tau)[0]
    if len(cand) <= k:
        return cand[np.lexsort((cand, -scores[cand]))]
    if selection == "greedy":
        key = scores[cand]
    else:
        key = np.log(scores[cand]) + rng.gumbel(size=len(cand))
    order = np.lexsort((cand, -key))  # ties: lower index first (deterministic)
    return cand[order[:k]]


def aflite(embeddings: np.ndarray, labels: np.ndarray, num_labels: int | None = None,
           params: AFLiteParams | None = None, *, precondition: bool = True, dtype=None, device: str | None = None,
           progress: bool = True) -> AFLiteResult:
    """Run AFLite (Le Bras et al. 2020, Algorithm 1) on precomputed embeddings Φ(x) and labels y.

    ``params``: the algorithm's knobs (:class:`AFLiteParams`; default: the declared defaults, m, k, t and n scaled
    to the input). ``device`` runs the linear models with torch on that device (default: the CPU)."""
    from tqdm.auto import tqdm

    X = np.asarray(embeddings)
    y = np.asarray(labels)
    if X.ndim != 2:
        raise InvalidInputError(f"embeddings must be a 2-d array (rows x dimensions), got shape {X.shape}")
    if len(X) != len(y):
        raise InvalidInputError(f"embeddings have {len(X)} rows but there are {len(y)} labels; compute the "
                                f"embeddings of exactly the rows being filtered (same dataset, same order)")
    if not np.issubdtype(y.dtype, np.integer):
        raise InvalidInputError(f"labels must be integers, got dtype {y.dtype}", column="label")
    bad = np.nonzero(~np.isfinite(X).all(1))[0]
    if len(bad):
        raise InvalidInputError(f"embedding row {int(bad[0])} has a NaN or infinite value ({len(bad)} such rows); "
                                f"recompute the embeddings", row=int(bad[0]), column="embeddings")
    K = int(num_labels if num_labels is not None else (y.max() + 1 if len(y) else 0))
    if len(y) and (y.min() < 0 or y.max() >= K):
        i = int(np.nonzero((y < 0) | (y >= K))[0][0])
        raise InvalidInputError(f"row {i}: label {int(y[i])} is outside 0..{K - 1}", row=i, column="label",
                                value=int(y[i]))
    N = len(y)
    if N < 3:
        raise EmptyResultError(f"AFLite needs at least 3 rows, got {N}")
    p = (params or AFLiteParams()).resolved(N, K)
    solver = LinearSolver(C=p.C, max_iter=p.max_iter, tol=p.tol, history_size=p.history_size, precondition=precondition)
    rng = np.random.default_rng(p.seed)
    alive = np.arange(N)
    removed, removed_scores, removed_round, history = [], [], [], []
    stop = f"reached the target size n = {p.target_n}"
    bar = tqdm(desc="AFLite rounds", unit="round", disable=not progress)
    r = 0
    while len(alive) > p.target_n:
        if p.max_rounds is not None and r >= p.max_rounds:
            stop = f"max_rounds = {p.max_rounds}"
            break
        Xs = X[alive]
        if p.standardize:
            Xs = standardize(Xs.astype(np.float32, copy=False))
        train = random_partitions(len(alive), p.m, p.train_size, rng)
        sr = predictability_scores(Xs, y[alive], K, train, solver, dtype=dtype, device=device, progress=progress)
        cap = min(p.k, len(alive) - p.target_n)
        pos = _select_slice(sr.scores, p.tau, cap, p.selection, rng)
        n_cand = int(np.sum(np.nan_to_num(sr.scores, nan=-1.0) >= p.tau))
        s = sr.scores[~np.isnan(sr.scores)]
        history.append({
            "round": r, "size_before": int(len(alive)), "candidates": n_cand, "removed": int(len(pos)),
            "size_after": int(len(alive) - len(pos)), "heldout_accuracy": round(sr.heldout_accuracy, 6),
            "score_mean": round(float(s.mean()), 6) if len(s) else None,
            "score_quantiles": {q: round(float(np.quantile(s, float(q))), 6) for q in ("0.1", "0.25", "0.5", "0.75", "0.9")}
            if len(s) else {},
            "score_histogram": np.histogram(s, bins=20, range=(0.0, 1.0))[0].astype(int).tolist(),
            "removed_min_score": round(float(sr.scores[pos].min()), 6) if len(pos) else None,
            "min_heldout": int(sr.n_heldout.min()), "lbfgs_iter_max": sr.n_iter_max,
            "lbfgs_iter_median": sr.n_iter_median,
            "converged_share": round(sr.converged, 4),
        })
        removed.append(alive[pos])
        removed_scores.append(sr.scores[pos])
        removed_round.append(np.full(len(pos), r, dtype=np.int64))
        keep = np.ones(len(alive), bool)
        keep[pos] = False
        alive = alive[keep]
        bar.update(1)
        bar.set_postfix(size=len(alive), removed=len(pos), candidates=n_cand)
        r += 1
        if len(pos) < cap or (len(pos) < p.k and len(alive) > p.target_n):
            stop = f"fewer than k = {p.k} rows had score >= tau = {p.tau} (round {r - 1}: {n_cand})"
            break
    bar.close()
    cat = (lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dt))
    return AFLiteResult(kept_indices=alive, removed_indices=cat(removed, np.int64),
                        removed_scores=cat(removed_scores, np.float64), removed_round=cat(removed_round, np.int64),
                        history=history, params=p.to_dict(), stop_reason=stop)
