"""AFLite: adversarial filtering of dataset biases with ensembles of linear models
(Le Bras et al. 2020, "Adversarial Filters of Dataset Biases", ICML, Algorithm 1).

Given pre-computed embeddings Φ(x) of a dataset D = (X, Y), a target size n, a number of partitions
m, a train size t < n, a slice size k and an early-stop threshold τ::

    S = D
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

The linear classifier is multinomial logistic regression with an L2 penalty, as scikit-learn's
``LogisticRegression(C=C)`` fits it (the intercept is not penalised)::

    min_{W,b}  (1/t) Σ_{j∈T_i} CE(softmax(W·x_j + b), y_j) + ||W||² / (2 C t)

The m classifiers of a round are trained in groups of g partitions (g from a memory budget, 1 GiB
by default): the t train rows of each partition of a group are gathered into one (g, t, d) tensor,
and every full-batch pass is one batched matrix product (``torch.bmm``), so each classifier does
exactly the arithmetic of its own fit on t rows (not a masked pass over all N rows). The optimiser
is L-BFGS run independently per partition (its own history, curvature pairs and Armijo
backtracking line search), so each classifier follows the same path it would follow when fitted
alone; the trial points of the line search reuse the logits (they are linear in the weights), so
one iteration costs one forward and one backward pass. The held-out predictions are one matrix
product over all rows for all partitions (most rows are held out by most partitions).

Variants and choices (documented deviations from the paper's text):

* ``selection="sample"`` is the slice-sampling variant: the k rows are drawn without replacement
  among those with score >= τ with probability proportional to the score, via Gumbel top-k on
  log(score).
* The last slice is capped at |S| - n, so the output never has fewer than n rows (the paper's loop
  may overshoot n by up to k - 1).
* Embeddings are standardised (zero mean, unit variance per dimension over S) before the linear
  models, which changes only the conditioning (and the meaning of C).
* A row never held out in a round (possible only for tiny m) has no score that round and is kept.

Defaults: m = 64 and τ = 0.75 are the paper's. The paper sets n, t and k per dataset (tens of
thousands of rows for SNLI-sized data); here they scale with |D| = N when not given:
n = N / 4 (never remove more than three quarters), t = N / 5 (< n, as the algorithm needs), and
k = N / 20 (twenty slices at most), with k >= 1 and t >= 2K.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import numpy as np

from .data import labels_of
from .errors import ConfigError, EmptyResultError, InvalidInputError

log = logging.getLogger(__name__)

SELECTIONS = ("greedy", "sample")
WARMUP_REASON = "warm-up"
AFLITE_REASON = "aflite"


# ----------------------------------------------------------------------------------------------
# parameters


@dataclasses.dataclass
class AFLiteParams:
    """The knobs of Algorithm 1 (``None`` = the scaled default, see the module docstring)."""

    m: int = 64
    train_size: int | None = None
    k: int | None = None
    tau: float = 0.75
    target_n: int | None = None
    selection: str = "greedy"
    C: float = 1.0
    max_iter: int = 100
    tol: float = 1e-4
    history_size: int = 10
    standardize: bool = True
    seed: int = 0
    max_rounds: int | None = None

    def resolved(self, n_rows: int, num_labels: int) -> "AFLiteParams":
        """Fill in the scaled defaults for an input of ``n_rows`` rows and check everything."""
        p = dataclasses.replace(self)
        if p.target_n is None:
            p.target_n = max(1, n_rows // 4)
        if p.train_size is None:
            p.train_size = max(2 * num_labels, min(n_rows // 5, p.target_n - 1))
        if p.k is None:
            p.k = max(1, n_rows // 20)
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
# the batched linear ensemble


def random_partitions(n: int, m: int, t: int, rng: np.random.Generator) -> np.ndarray:
    """train[i, j] is True when row j is in T_i: m independent uniformly random t-subsets of n rows."""
    if not 1 <= t < n:
        raise ConfigError(f"cannot draw a train part of t = {t} rows from {n} rows (need 1 <= t < {n})")
    keys = rng.random((m, n), dtype=np.float32)
    part = np.argpartition(keys, t - 1, axis=1)[:, :t]
    train = np.zeros((m, n), dtype=bool)
    np.put_along_axis(train, part, True, axis=1)
    return train


DEFAULT_MEMORY_BUDGET = 1 << 30
"""Bytes allowed for the gathered train rows of one group of partitions (1 GiB)."""
CPU_CACHE_BYTES = 16 << 20
"""On CPU a group is also kept small enough to stay in the last-level cache (16 MiB) across its
L-BFGS iterations: with K ~ 3 classes each pass over the rows is memory-bound (3 multiply-adds per
value read); in isolation a pass over 1-2 partitions of 2,000 x 384 ran about twice as fast per
partition as one over 8 or more, though on the shared benchmark machine group sizes 1 to 32 measured
within noise of each other (see benchmarks/results/aflite_bench.md)."""


def group_size_for(m: int, t: int, d: int, num_labels: int, *, itemsize: int = 4,
                   memory_budget: int = DEFAULT_MEMORY_BUDGET, device_type: str = "cpu") -> int:
    """How many partitions to train together: g = floor(budget / bytes per partition), 1 <= g <= m.

    One partition holds its t gathered rows (t x d) and a few t x K arrays (labels, weights, logits,
    the direction's logits, the trial logits, the residuals). On CPU g is further capped so a group
    fits in ``CPU_CACHE_BYTES`` (never below 1)."""
    per = t * (d + 6 * num_labels + 1) * itemsize
    g = memory_budget // per
    if device_type == "cpu":
        g = min(g, CPU_CACHE_BYTES // per)
    return int(max(1, min(m, g)))


def fit_linear_ensemble(X, y, train_mask, num_labels: int, *, C: float = 1.0, max_iter: int = 100,
                        tol: float = 1e-4, history_size: int = 10, dtype=None, device=None,
                        memory_budget: int = DEFAULT_MEMORY_BUDGET, group_size: int | None = None,
                        progress: bool = False):
    """Fit m multinomial logistic regressions, partition i on the rows where train_mask[i].

    Minimises, for each i separately, (1/t_i) Σ_{j∈T_i} CE(W_i x_j + b_i, y_j) + ||W_i||² / (2 C t_i)
    with L-BFGS (per-partition two-loop recursion and Armijo backtracking), full batch; stops a
    partition when its largest absolute gradient entry is below ``tol``. Returns (theta (m, d+1, K)
    with the bias in the last row, n_iter per partition, converged per partition).

    The partitions are trained in groups of g (``group_size``, or :func:`group_size_for` from
    ``memory_budget``): the train rows of each partition of a group are gathered into one
    (g, t, d) tensor and every pass is a batched matrix product (``torch.bmm``), so each classifier
    does exactly the arithmetic of its own fit on t rows. Every partition keeps its own L-BFGS
    history, step and line search; a partition leaves the group (and costs nothing more) once it
    has converged, so the result does not depend on g (up to floating-point summation order).

    The line search uses that logits are linear in θ: with Z = θ·X and Zp = p·X for the search
    direction p, the trial point θ + αp has logits Z + α·Zp, so the trial losses need no further
    pass over the rows. One iteration is thus one forward pass (Zp) and one backward pass (the
    gradient at the accepted point), whatever the number of backtracking steps.
    """
    import torch
    from tqdm.auto import tqdm

    dtype = dtype or torch.float32
    dev = torch.device(device) if device is not None else torch.device("cpu")
    Xt = torch.as_tensor(np.asarray(X), dtype=dtype, device=dev)
    N, d = Xt.shape
    yt = torch.as_tensor(np.asarray(y), device=dev).long()
    mask = np.asarray(train_mask, dtype=bool)
    if mask.ndim != 2 or mask.shape[1] != N:
        raise ConfigError(f"train_mask must have shape (m, {N}) (one row per partition, one column per data row), "
                          f"got {mask.shape}")
    m = mask.shape[0]
    t = mask.sum(1)
    if m and t.min() == 0:
        raise ConfigError(f"partition {int(np.argmin(t))} has no train rows; every partition needs t >= 1")
    K = int(num_labels)
    g = int(group_size) if group_size else group_size_for(m, int(t.max(initial=1)), d, K,
                                                          itemsize=Xt.element_size(),
                                                          memory_budget=memory_budget, device_type=dev.type)
    theta = torch.zeros(m, d + 1, K, dtype=dtype, device=dev)
    n_iter = np.zeros(m, dtype=np.int64)
    converged = np.zeros(m, dtype=bool)
    for s in tqdm(range(0, m, g), desc="linear models", unit="group", disable=not progress, leave=False):
        rows = [np.flatnonzero(mask[i]) for i in range(s, min(s + g, m))]
        width = max(len(r) for r in rows)
        # partitions of unequal size are padded with row 0 at weight 0
        idx = np.zeros((len(rows), width), dtype=np.int64)
        w = np.zeros((len(rows), width), dtype=np.float64)
        for j, r in enumerate(rows):
            idx[j, :len(r)] = r
            w[j, :len(r)] = 1.0 / len(r)
        idx_t = torch.as_tensor(idx, device=dev)
        Xg = Xt[idx_t]                                                                   # g, t, d
        Y1 = torch.nn.functional.one_hot(yt[idx_t], K).to(dtype).transpose(1, 2).contiguous()  # g, K, t
        wt = torch.as_tensor(w, dtype=dtype, device=dev)[:, None, :]                    # g, 1, t
        lam = torch.as_tensor(1.0 / (C * t[s:s + len(rows)]), dtype=dtype, device=dev)  # g
        th, it, cv = _lbfgs_group(Xg, Y1, wt, lam, max_iter=max_iter, tol=tol, history_size=history_size)
        theta[s:s + len(rows)] = th.transpose(1, 2)
        n_iter[s:s + len(rows)] = it
        converged[s:s + len(rows)] = cv
        del Xg, Y1, wt
    return theta, n_iter, converged


def _group_loss(Z, theta, Y1, w, lam, regmask):
    """Per-partition objective from the logits Z (g, K, t) = θ·X: returns (loss (g,), logsumexp (g, t))."""
    import torch
    lse = torch.logsumexp(Z, dim=1)
    ce = lse - (Z * Y1).sum(1)
    loss = (w[:, 0] * ce).sum(1) + 0.5 * lam * (regmask * theta.pow(2)).sum((1, 2))
    return loss, lse


def _group_grad(Z, lse, theta, Xg, Y1, w, lam, regmask):
    """∇ = (softmax(Z) - Y)·w · [X, 1] + λ θ (no penalty on the bias column): (g, K, d+1)."""
    import torch
    R = (torch.exp(Z - lse[:, None, :]) - Y1) * w                                        # g, K, t
    G = torch.cat([torch.bmm(R, Xg), R.sum(2, keepdim=True)], dim=2)
    return G + lam[:, None, None] * regmask * theta


def _group_logits(P, Xg):
    """P (g, K, d+1) with the bias in the last column -> P·[x, 1] for every row: (g, K, t)."""
    import torch
    d = Xg.shape[2]
    return torch.baddbmm(P[:, :, d:], P[:, :, :d].contiguous(), Xg.transpose(1, 2))


LS_TRIALS = 30
"""At most this many Armijo backtracking trials (steps 1, 1/2, ..., 2^-29) per L-BFGS iteration."""
LS_BLOCK = 3
"""Trial steps evaluated together (one set of tensor operations for 3 steps, then the next 3 if none passed)."""


def _lbfgs_group(Xg, Y1, w, lam, *, max_iter: int, tol: float, history_size: int):
    """L-BFGS for the g partitions of one group (θ stored transposed, (g, K, d+1)); each partition
    has its own history, direction, step and stopping test. Returns (θ, n_iter, converged).

    Per iteration and partition: the two-loop recursion gives the direction p = -H∇ (the first
    step is steepest descent scaled to unit L1 length; a non-descent direction is replaced by -∇);
    Armijo backtracking takes the first step α in 1, 1/2, 1/4, ... with
    f(θ + αp) <= f(θ) + 1e-4 α ∇·p, where f(θ + αp) comes from the logits Z + α·(p·X) and the penalty
    ½λ(||θ||² + 2α θ·p + α²||p||²) (no new pass over the rows); the curvature pair (s, y) is kept
    when s·y > 1e-10. A partition stops when max|∇| <= tol or when no trial step passes."""
    import torch

    g, t, d = Xg.shape
    K = Y1.shape[1]
    dtype, dev = Xg.dtype, Xg.device
    regmask = torch.ones(1, 1, d + 1, dtype=dtype, device=dev)
    regmask[..., d] = 0
    out_theta = torch.zeros(g, K, d + 1, dtype=dtype, device=dev)
    out_iter = torch.zeros(g, dtype=torch.long, device=dev)
    out_gmax = torch.zeros(g, dtype=dtype, device=dev)

    live = torch.arange(g, device=dev)              # the group positions still being optimised
    theta = torch.zeros(g, K, d + 1, dtype=dtype, device=dev)
    Z = torch.zeros(g, K, t, dtype=dtype, device=dev)
    loss, lse = _group_loss(Z, theta, Y1, w, lam, regmask)
    grad = _group_grad(Z, lse, theta, Xg, Y1, w, lam, regmask)
    n_iter = torch.zeros(g, dtype=torch.long, device=dev)
    s_hist, y_hist, rho_hist = [], [], []           # (g, K(d+1)) each: flattened curvature pairs
    active = grad.abs().flatten(1).amax(1) > tol

    def retire(keep):
        """Write out the partitions that stop and drop them from every per-partition tensor."""
        nonlocal live, theta, Z, lse, loss, grad, n_iter, Xg, Y1, w, lam, s_hist, y_hist, rho_hist
        done = ~keep
        out_theta[live[done]] = theta[done]
        out_iter[live[done]] = n_iter[done]
        out_gmax[live[done]] = grad[done].abs().flatten(1).amax(1)
        sel = torch.nonzero(keep).flatten()
        live, theta, Z, lse, loss, grad, n_iter = (a.index_select(0, sel)
                                                   for a in (live, theta, Z, lse, loss, grad, n_iter))
        Xg, Y1, w, lam = (a.index_select(0, sel) for a in (Xg, Y1, w, lam))
        s_hist = [a.index_select(0, sel) for a in s_hist]
        y_hist = [a.index_select(0, sel) for a in y_hist]
        rho_hist = [a.index_select(0, sel) for a in rho_hist]

    halves = 0.5 ** torch.arange(LS_TRIALS, dtype=torch.float64)
    for _ in range(max_iter):
        if not bool(active.all()):
            retire(active)
        if len(live) == 0:
            break
        n = len(live)
        gf = grad.flatten(1)
        # two-loop recursion, every inner product per partition: (g,)
        q = gf.clone()
        alphas = []
        for s, yv, rho in zip(reversed(s_hist), reversed(y_hist), reversed(rho_hist)):
            a = rho * torch.linalg.vecdot(s, q)
            q.addcmul_(a[:, None], yv, value=-1)
            alphas.append(a)
        if s_hist:
            s, yv = s_hist[-1], y_hist[-1]
            q *= (torch.linalg.vecdot(s, yv) / torch.linalg.vecdot(yv, yv).clamp_min(1e-30))[:, None]
        else:
            # first step: a unit-length steepest-descent step per partition
            q /= gf.abs().sum(1).clamp_min(1e-30)[:, None]
        for s, yv, rho, a in zip(s_hist, y_hist, rho_hist, reversed(alphas)):
            q.addcmul_((a - rho * torch.linalg.vecdot(yv, q))[:, None], s)
        pf = q.neg_()
        slope = torch.linalg.vecdot(gf, pf)
        bad = slope >= 0  # not a descent direction (lost curvature): restart with steepest descent
        if bool(bad.any()):
            pf[bad] = -gf[bad]
            slope = torch.where(bad, -torch.linalg.vecdot(gf, gf), slope)
        direction = pf.view_as(grad)
        # Armijo backtracking on the logits Z + α·Zp (one pass over the rows for Zp)
        Zp = _group_logits(direction, Xg)
        tf, pr = (theta * regmask).flatten(1), (direction * regmask).flatten(1)
        pen = (torch.linalg.vecdot(tf, tf), 2 * torch.linalg.vecdot(tf, pr), torch.linalg.vecdot(pr, pr))
        step = torch.zeros(n, dtype=dtype, device=dev)
        found = torch.zeros(n, dtype=torch.bool, device=dev)
        new_loss, new_lse = loss, lse
        rows = torch.arange(n, device=dev)
        for b0 in range(0, LS_TRIALS, LS_BLOCK):
            steps = halves[b0:b0 + LS_BLOCK].to(dtype=dtype, device=dev)                        # S
            cZ = Z[:, None] + steps[None, :, None, None] * Zp[:, None]                           # g, S, K, t
            c_lse = torch.logsumexp(cZ, dim=2)                                                   # g, S, t
            c_loss = ((c_lse - (cZ * Y1[:, None]).sum(2)) * w).sum(2) + 0.5 * lam[:, None] * (
                pen[0][:, None] + steps * pen[1][:, None] + steps * steps * pen[2][:, None])      # g, S
            ok = c_loss <= loss[:, None] + 1e-4 * steps * slope[:, None]
            first = ok.to(torch.uint8).argmax(1)
            take = ok.any(1) & ~found
            step = torch.where(take, steps[first], step)
            new_loss = torch.where(take, c_loss[rows, first], new_loss)
            new_lse = torch.where(take[:, None], c_lse[rows, first], new_lse)
            found |= take
            if bool(found.all()):
                break
        moved = found
        s_new = step[:, None] * pf
        new_theta = theta + s_new.view_as(theta)
        new_Z = torch.addcmul(Z, step[:, None, None], Zp)
        new_grad = _group_grad(new_Z, new_lse, new_theta, Xg, Y1, w, lam, regmask)
        if not bool(moved.all()):
            new_grad = torch.where(moved[:, None, None], new_grad, grad)
        y_new = (new_grad - grad).flatten(1)
        sy = torch.linalg.vecdot(s_new, y_new)
        theta, loss, grad, Z, lse = new_theta, new_loss, new_grad, new_Z, new_lse
        n_iter += moved.long()
        # keep a curvature pair only where it is informative; elsewhere store a neutral pair
        good = moved & (sy > 1e-10)
        rho = torch.where(good, 1.0 / sy.clamp_min(1e-30), torch.zeros_like(sy))
        if not bool(good.all()):
            s_new, y_new = s_new * good[:, None], y_new * good[:, None]
        s_hist.append(s_new)
        y_hist.append(y_new)
        rho_hist.append(rho)
        if len(s_hist) > history_size:
            s_hist.pop(0), y_hist.pop(0), rho_hist.pop(0)
        # a partition whose line search failed has converged to float precision
        active = moved & (grad.abs().flatten(1).amax(1) > tol)
    if len(live):
        retire(torch.zeros(len(live), dtype=torch.bool, device=dev))
    return out_theta, out_iter.cpu().numpy(), (out_gmax <= tol).cpu().numpy()


def predict_ensemble(X, theta, dtype=None, device=None) -> np.ndarray:
    """argmax_k (x W_i + b_i)_k for every partition i and row: int64 (m, N)."""
    import torch
    dtype = dtype or theta.dtype
    Xt = torch.as_tensor(np.asarray(X), dtype=dtype, device=theta.device)
    m, D, K = theta.shape
    logits = (Xt @ theta[:, :-1, :].permute(1, 0, 2).reshape(D - 1, m * K)).view(-1, m, K) + theta[:, -1, :][None]
    return logits.argmax(2).T.cpu().numpy()


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


def heldout_correct(X, y, theta, train_mask, *, chunk_rows: int = 32768):
    """Per row: how many partitions held it out (|{i : e ∈ V_i}|) and how many of those predict its
    label (|{i : e ∈ V_i, argmax_k (x W_i + b_i)_k = y_e}|). One matrix product over all rows for all
    partitions at once, in chunks of ``chunk_rows`` rows (the held-out rows are most of them, so
    this is cheaper than gathering them per partition). Returns (n_heldout, n_correct), int64 (N,)."""
    import torch
    Xt = torch.as_tensor(np.asarray(X), dtype=theta.dtype, device=theta.device)
    yt = torch.as_tensor(np.asarray(y), device=theta.device).long()
    held = torch.as_tensor(~np.asarray(train_mask, dtype=bool), device=theta.device)   # m, N
    m, D, K = theta.shape
    W = theta[:, :-1, :].permute(1, 0, 2).reshape(D - 1, m * K)
    b = theta[:, -1, :]
    n_corr = torch.zeros(len(yt), dtype=torch.long, device=theta.device)
    for a in range(0, len(yt), chunk_rows):
        pred = (Xt[a:a + chunk_rows] @ W).view(-1, m, K).add_(b[None]).argmax(2)        # rows, m
        n_corr[a:a + chunk_rows] = ((pred == yt[a:a + chunk_rows, None]) & held[:, a:a + chunk_rows].T).sum(1)
    return held.sum(0).cpu().numpy().astype(np.int64), n_corr.cpu().numpy()


def predictability_scores(X, y, num_labels: int, *, m: int = 64, train_size: int, rng: np.random.Generator,
                          C: float = 1.0, max_iter: int = 100, tol: float = 1e-4, history_size: int = 10,
                          dtype=None, device=None, train_mask: np.ndarray | None = None,
                          memory_budget: int = DEFAULT_MEMORY_BUDGET, group_size: int | None = None,
                          progress: bool = False) -> ScoreRound:
    """score(e) = |{i : e ∈ V_i and L_i(Φ(e)) = y_e}| / |{i : e ∈ V_i}| over m random partitions."""
    n = len(y)
    train = train_mask if train_mask is not None else random_partitions(n, m, train_size, rng)
    theta, n_iter, conv = fit_linear_ensemble(X, y, train, num_labels, C=C, max_iter=max_iter, tol=tol,
                                              history_size=history_size, dtype=dtype, device=device,
                                              memory_budget=memory_budget, group_size=group_size,
                                              progress=progress)
    n_held, n_corr = heldout_correct(X, y, theta, train)
    with np.errstate(invalid="ignore", divide="ignore"):
        scores = np.where(n_held > 0, n_corr / np.maximum(n_held, 1), np.nan)
    acc = float(n_corr.sum() / max(n_held.sum(), 1))
    return ScoreRound(scores, n_held, n_corr, acc, int(n_iter.max(initial=0)), float(conv.mean()))


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


def aflite(embeddings: np.ndarray, labels: np.ndarray, num_labels: int | None = None, *, m: int = 64,
           train_size: int | None = None, k: int | None = None, tau: float = 0.75, target_n: int | None = None,
           selection: str = "greedy", C: float = 1.0, max_iter: int = 100, tol: float = 1e-4,
           history_size: int = 10, standardize_embeddings: bool = True, seed: int = 0,
           max_rounds: int | None = None, dtype=None, device: str | None = None,
           memory_budget: int | None = None, group_size: int | None = None,
           progress: bool = True) -> AFLiteResult:
    """Run AFLite (Le Bras et al. 2020, Algorithm 1) on precomputed embeddings Φ(x) and labels y.

    ``memory_budget`` (bytes, default 1 GiB) bounds the gathered train rows of the partitions trained
    together; ``group_size`` sets their number directly (see :func:`fit_linear_ensemble`)."""
    memory_budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)
    if memory_budget < 1:
        raise ConfigError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
    if group_size is not None and group_size < 1:
        raise ConfigError(f"group_size must be >= 1 (partitions trained together), got {group_size}")
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
    p = AFLiteParams(m=m, train_size=train_size, k=k, tau=tau, target_n=target_n, selection=selection, C=C,
                     max_iter=max_iter, tol=tol, history_size=history_size, standardize=standardize_embeddings,
                     seed=seed, max_rounds=max_rounds).resolved(N, K)
    rng = np.random.default_rng(seed)
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
        sr = predictability_scores(Xs, y[alive], K, m=p.m, train_size=p.train_size, rng=rng, C=p.C,
                                   max_iter=p.max_iter, tol=p.tol, history_size=p.history_size, dtype=dtype,
                                   device=device, memory_budget=memory_budget, group_size=group_size,
                                   progress=progress)
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


# ----------------------------------------------------------------------------------------------
# datasets


def aflite_filter(ds, embeddings: np.ndarray, *, num_labels: int | None = None, **params) -> tuple[Any, Any, AFLiteResult]:
    """AFLite on a canonical dataset with one embedding per row (same order). Returns
    (kept_ds, removed_ds, result); removed rows carry ``aflite_score``, ``aflite_round`` and
    ``reason`` = "aflite", so nothing is lost."""
    emb = np.asarray(embeddings)
    if emb.ndim != 2 or len(emb) != len(ds):
        raise InvalidInputError(f"the dataset has {len(ds)} rows but the embeddings have "
                                f"{emb.shape[0] if emb.ndim else 0} rows (shape {emb.shape}); compute the "
                                f"embeddings of this dataset (debiased_nli.embeddings.compute_embeddings)")
    if "label" not in ds.column_names:
        raise InvalidInputError(f"the dataset has no 'label' column (columns: {ds.column_names})", column="label")
    if num_labels is None and hasattr(ds.features.get("label"), "num_classes"):
        num_labels = ds.features["label"].num_classes
    res = aflite(emb, labels_of(ds), num_labels, **params)
    kept = ds.select(res.kept_indices)
    order = np.argsort(res.removed_indices, kind="stable")  # removed rows in input order
    removed = ds.select(res.removed_indices[order])
    removed = removed.add_column("aflite_score", res.removed_scores[order].astype(np.float64).tolist())
    removed = removed.add_column("aflite_round", res.removed_round[order].astype(np.int64).tolist())
    removed = removed.add_column("reason", [AFLITE_REASON] * len(removed))
    return kept, removed, res


STEP_DEFAULTS: dict[str, Any] = {
    "encoder": None, "batch_size": 64, "max_length": 128, "pooling": "mean", "warmup_share": 0.0,
    "warmup_epochs": 1.0, "warmup_lr": 2e-5, "m": 64, "train_size": None, "k": None, "tau": 0.75,
    "target_n": None, "selection": "greedy", "C": 1.0, "max_iter": 100, "tol": 1e-4, "seed": 0,
    "max_rounds": None, "audit": True, "top_k": 20, "random_control": True, "progress": True,
    "memory_budget": None, "group_size": None,
}


def _audit_summary(ds, task, top_k: int, seed: int, progress: bool) -> dict:
    from .audit import audit_dataset
    rep = audit_dataset(ds, task, top_k=top_k, seed=seed, progress=progress)
    keep = ("n_rows", "labels", "hypothesis_only_accuracy", "max_abs_z", "z_threshold", "features_above_threshold",
            "features")
    return {k: rep[k] for k in keep if k in rep}


def aflite_step(ds, task, params: Mapping[str, Any] | None = None):
    """The AFLite recipe step: (optional warm-up fine-tuning) -> embeddings -> Algorithm 1 -> audit.

    Returns (kept_ds, removed_ds, report). ``removed_ds`` holds the warm-up rows (``reason`` =
    "warm-up", no score) and the filtered rows (``reason`` = "aflite", with ``aflite_score`` and
    ``aflite_round``). The report has the parameters, the sizes per round, and (``audit``) the bias
    audit of the input, of the kept rows and of a random subset of the same size (the paper's control).
    """
    import datasets
    from .embeddings import compute_embeddings, default_encoder, warm_up_encoder
    from .tasks import get_task

    task = get_task(task)
    unknown = sorted(set(params or {}) - set(STEP_DEFAULTS))
    if unknown:
        from .tasks import did_you_mean
        raise ConfigError(f"unknown AFLite parameter(s) {unknown}{did_you_mean(unknown[0], list(STEP_DEFAULTS))}; "
                          f"known: {sorted(STEP_DEFAULTS)}")
    p = {**STEP_DEFAULTS, **(params or {})}
    encoder = p["encoder"] or default_encoder()
    report: dict[str, Any] = {"method": "aflite", "encoder": encoder, "n_input": len(ds)}
    work, warm_rows = ds, None
    if p["warmup_share"]:
        wu = warm_up_encoder(ds, encoder, num_labels=task.num_labels, share=p["warmup_share"], seed=p["seed"],
                             epochs=p["warmup_epochs"], lr=p["warmup_lr"], batch_size=16,
                             max_length=p["max_length"], progress=p["progress"])
        warm_rows = ds.select(wu.indices)
        work = ds.select(wu.rest(len(ds)))
        encoder = wu.model_dir
        report["warm_up"] = {"rows": int(len(wu.indices)), "model_dir": wu.model_dir, "train_loss": wu.train_loss,
                             **wu.params}
    emb = compute_embeddings(work, encoder, batch_size=p["batch_size"], max_length=p["max_length"],
                             pooling=p["pooling"], progress=p["progress"])
    report["embedding_dim"] = int(emb.shape[1])
    algo = {k: p[k] for k in ("m", "train_size", "k", "tau", "target_n", "selection", "C", "max_iter", "tol",
                              "seed", "max_rounds", "memory_budget", "group_size")}
    kept, removed, res = aflite_filter(work, emb, num_labels=task.num_labels, progress=p["progress"], **algo)
    if warm_rows is not None and len(warm_rows):
        n = len(warm_rows)
        warm = warm_rows.add_column("aflite_score", [float("nan")] * n)
        warm = warm.add_column("aflite_round", [-1] * n)
        warm = warm.add_column("reason", [WARMUP_REASON] * n)
        removed = datasets.concatenate_datasets([warm.cast(removed.features), removed])
    report.update(res.to_dict())
    report["n_input"] = len(ds)
    report["removed_by_reason"] = {WARMUP_REASON: 0 if warm_rows is None else len(warm_rows),
                                   AFLITE_REASON: int(len(res.removed_indices))}
    if p["audit"] and len(kept):
        report["audit"] = {"before": _audit_summary(ds, task, p["top_k"], p["seed"], p["progress"]),
                           "after": _audit_summary(kept, task, p["top_k"], p["seed"], p["progress"])}
        if p["random_control"]:
            rng = np.random.default_rng(p["seed"] + 1)
            ctrl = ds.select(np.sort(rng.choice(len(ds), size=len(kept), replace=False)))
            report["audit"]["random_same_size"] = _audit_summary(ctrl, task, p["top_k"], p["seed"], p["progress"])
    return kept, removed, report


# ----------------------------------------------------------------------------------------------
# report


def render_aflite_md(report: Mapping[str, Any], title: str | None = None) -> str:
    """The card section: parameters, sizes per round, and the audit before / after / random control."""
    p = report["params"]
    lines = [f"# {title or 'AFLite (Le Bras et al. 2020)'}", ""]
    lines.append(f"- input rows: {report['n_input']:,}; kept: {report['n_kept']:,}; removed: "
                 + ", ".join(f"{k} {v:,}" for k, v in report.get("removed_by_reason", {}).items()))
    lines.append(f"- encoder: `{report.get('encoder')}`" + (f", embedding dimension {report['embedding_dim']}"
                                                            if report.get("embedding_dim") else ""))
    lines.append(f"- m = {p['m']} partitions, train size t = {p['train_size']:,}, slice k = {p['k']:,}, "
                 f"tau = {p['tau']}, target n = {p['target_n']:,}, selection {p['selection']}, "
                 f"logistic regression C = {p['C']} (L-BFGS, max {p['max_iter']} iterations), seed {p['seed']}")
    lines.append(f"- stopped: {report['stop_reason']} after {report['rounds']} round(s)")
    lines += ["", "## Rounds", "",
              "| round | rows | score >= tau | removed | held-out accuracy | median score | lowest removed score |",
              "|---|---|---|---|---|---|---|"]
    for h in report["history"]:
        med = h["score_quantiles"].get("0.5")
        low = h["removed_min_score"]
        med_s = "" if med is None else f"{med:.3f}"
        low_s = "" if low is None else f"{low:.3f}"
        lines.append(f"| {h['round']} | {h['size_before']:,} | {h['candidates']:,} | {h['removed']:,} | "
                     f"{h['heldout_accuracy']:.3f} | {med_s} | {low_s} |")
    audit = report.get("audit")
    if audit:
        cols = [("before", "input"), ("after", "AFLite kept"), ("random_same_size", "random subset, same size")]
        cols = [(k, name) for k, name in cols if k in audit]
        lines += ["", "## Bias audit", "", "| | " + " | ".join(name for _, name in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        lines.append("| rows | " + " | ".join(f"{audit[k]['n_rows']:,}" for k, _ in cols) + " |")
        lines.append("| hypothesis-only accuracy | " + " | ".join(
            "" if audit[k].get("hypothesis_only_accuracy") is None else f"{audit[k]['hypothesis_only_accuracy']:.3f}"
            for k, _ in cols) + " |")
        lines.append("| largest \\|z\\| | " + " | ".join(f"{audit[k]['max_abs_z']:.1f}" for k, _ in cols) + " |")
        lines.append("| features above the z threshold | " + " | ".join(
            f"{sum(audit[k]['features_above_threshold'].values()):,}" for k, _ in cols) + " |")
        for key, name in cols:
            top = sorted(audit[key]["features"], key=lambda r: -r["z"])[:10]
            lines += ["", f"### Largest z-statistics: {name}", "", "| feature | label | n | p_hat | z |",
                      "|---|---|---|---|---|"]
            lines += [f"| `{r['feature']}` | {r['label']} | {r['n']:,} | {r['p_hat']:.3f} | {r['z']:.1f} |" for r in top]
    lines += ["", "score(e) = share of the m linear classifiers, among those that held e out, that predict "
                  "e's label; rows with score >= tau are removed, up to k per round, highest first."]
    return "\n".join(lines) + "\n"


def plot_aflite(report: Mapping[str, Any], path) -> None:
    """Left: rows left after each round; right: the predictability score distribution of each round."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = report["history"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    sizes = [hist[0]["size_before"]] + [h["size_after"] for h in hist] if hist else [report["n_input"]]
    a.plot(range(len(sizes)), sizes, marker="o")
    a.axhline(report["params"]["target_n"], color="C3", ls=":", label="target n")
    a.set_xlabel("round")
    a.set_ylabel("rows kept")
    a.set_title("kept size per round")
    a.legend(fontsize=7)
    edges = np.linspace(0, 1, 21)
    centers = (edges[:-1] + edges[1:]) / 2
    cmap = plt.get_cmap("viridis")
    for i, h in enumerate(hist):
        counts = np.asarray(h["score_histogram"], float)
        b.plot(centers, counts / max(counts.sum(), 1), color=cmap(i / max(len(hist) - 1, 1)), lw=1,
               label=f"round {h['round']}" if i in (0, len(hist) - 1) else None)
    b.axvline(report["params"]["tau"], color="C3", ls=":", label="tau")
    b.set_xlabel("predictability score")
    b.set_ylabel("share of rows")
    b.set_title("score distribution per round")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_aflite_outputs(kept, removed, report: Mapping[str, Any], out_dir) -> dict:
    """kept.parquet, removed.parquet, aflite.json, aflite.md and aflite.png in ``out_dir``."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"kept": out / "kept.parquet", "removed": out / "removed.parquet", "json": out / "aflite.json",
             "md": out / "aflite.md", "png": out / "aflite.png"}
    kept.to_parquet(str(paths["kept"]))
    removed.to_parquet(str(paths["removed"]))
    paths["json"].write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    paths["md"].write_text(render_aflite_md(report))
    plot_aflite(report, paths["png"])
    return paths


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")
