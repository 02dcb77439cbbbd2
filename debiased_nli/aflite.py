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
linear models. ``PARAM_SOURCES`` says where each value comes from; the report and the card repeat it.

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
reason is in benchmarks/results/aflite_bench.md (same tolerance, both converged). A slow reference
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
from typing import Any, Mapping

import numpy as np

from .data import labels_of
from .embeddings import DEFAULT_WARMUP_SHARE, PAPER_WARMUP
from .errors import ConfigError, EmptyResultError, InvalidInputError

log = logging.getLogger(__name__)


def paper_target_size(n_rows: int) -> int:
    """n = round(|D| / 3), the paper's SNLI outcome (182k of 550k), at least 1."""
    return max(1, round(n_rows * TARGET_SHARE))

SELECTIONS = ("greedy", "sample")
TARGET_SHARE = 1 / 3
"""n ≈ |D|/3: §4 "Experimental Setup" compares the filtered set to "a randomly subsampled dataset, with
the same sample size as [the filtered one], amounting to only a third of the full data"; Table 1:
"AFLite-filtered data (, size 182k)" against "the original SNLI data (, size 550k)"."""
PARAM_SOURCES = {
    "train_size": "paper: the warm-up size (§2: \"this fraction corresponds to the training size for AFLite "
                  "and it remains unchanged across iterations\")",
    "target_n": "paper: a third of the input (§4: SNLI-AFLite \"size 182k\" of 550k, \"only a third of the full "
                "data\")",
    "m": "project's choice (§2: \"number of partitions ... determined by the available computation budget\")",
    "k": "project's choice, a twentieth of the rows filtered (§2: \"slice size ... determined by the available "
         "computation budget\")",
    "tau": "project's choice (the paper gives no value for the early-stopping threshold)",
    "C": "project's choice (scikit-learn's default L2 strength; the paper says \"typically a linear classifier\")",
    "tol": "project's choice (scikit-learn's default tolerance for LogisticRegression)",
    "warmup_share": "project's choice (§2: \"a small fraction of the data\"; §5 ImageNet: \"a fixed 20% sample\")",
    "warmup_epochs": "paper A.4 (\"3 epochs for all *NLI tasks\")",
    "warmup_lr": "paper A.4 (\"a learning rate of 1e-05\")",
    "warmup_eps": "paper A.4 (\"an epsilon value of 1e-08\")",
    "warmup_batch_size": "paper A.4 (\"a batch size of 92\")",
    "pooling": "the fine-tuned encoder's first token, the input of its classification head (§4: \"extracted from "
               "the final layer before the output layer\")",
    "encoder": "paper: RoBERTa-large (§4); here the offline all-MiniLM-L6-v2 where it exists",
}
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
    max_iter: int = 1000
    tol: float = 1e-4
    history_size: int = 10
    standardize: bool = True
    seed: int = 0
    max_rounds: int | None = None

    def resolved(self, n_rows: int, num_labels: int) -> "AFLiteParams":
        """Fill in the scaled defaults for an input of ``n_rows`` rows and check everything."""
        p = dataclasses.replace(self)
        if p.target_n is None:
            p.target_n = paper_target_size(n_rows)
        if p.train_size is None:
            # without a warm-up slice to size it: a tenth of the rows, the default warm-up share (project's choice)
            p.train_size = max(2 * num_labels, min(round(n_rows * DEFAULT_WARMUP_SHARE), p.target_n - 1))
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


CHUNK_ROWS = 16384
"""Rows per chunk of a pass over the data: bounds the (rows, m, K) temporaries (16k x 64 x 3 floats)."""
LS_TRIALS = 30
"""At most this many Armijo backtracking trials (steps 1, 1/2, ..., 2^-29) per L-BFGS iteration."""
LS_BLOCK = 4
"""Trial steps after the unit step evaluated together (one pass over the rows for 1/2, 1/4, 1/8, 1/16)."""


@dataclasses.dataclass
class EnsembleFit:
    """m fitted classifiers: θ (m, d+1, K) with the bias in the last row, their logits on every row
    (N, m, K), and per classifier the L-BFGS iterations, whether max|∇| <= tol, and max|∇|."""

    theta: Any
    logits: Any
    n_iter: np.ndarray
    converged: np.ndarray
    grad_max: np.ndarray


def shared_preconditioner(Xt, lam: float, num_labels: int, *, max_rows: int = 16384):
    """P = (E[x̃x̃ᵀ]/K + diag(λ, ..., λ, 0))⁻¹, a (d+1) x (d+1) matrix, x̃ = [x, 1].

    It is the inverse Hessian of every classifier at θ = 0, where each class has probability 1/K:
    there ∇²f_i = (I/K - 11ᵀ/K²) ⊗ (1/t_i) Σ_{j∈T_i} x̃_j x̃_jᵀ + λ_i (I_K ⊗ diag(1, ..., 1, 0)). The
    gradients of a softmax model sum to zero over the classes, and on that subspace the class factor
    acts as I/K, so the Hessian is K identical (d+1) x (d+1) blocks. Every T_i is a uniformly random
    subset of the same rows, so E[x̃x̃ᵀ] over (up to ``max_rows``, evenly spaced) rows stands in for each
    partition's own second moment. Used as the initial inverse Hessian of L-BFGS, it takes the
    correlations of the embedding dimensions out of the problem."""
    import torch
    N, d = Xt.shape
    step = max(1, -(-N // max_rows))
    Xs = Xt[::step]
    n = len(Xs)
    H = torch.empty(d + 1, d + 1, dtype=torch.float64, device=Xt.device)
    H[:d, :d] = (Xs.T @ Xs).double() / n
    H[:d, d] = H[d, :d] = Xs.double().mean(0)
    H[d, d] = 1.0
    H /= num_labels
    H.diagonal()[:d] += lam
    H.diagonal().add_(1e-10 * float(H.diagonal().mean()))  # guards a rank-deficient embedding matrix
    return torch.cholesky_inverse(torch.linalg.cholesky(H))


def fit_linear_ensemble(X, y, train_mask, num_labels: int, *, C: float = 1.0, max_iter: int = 1000,
                        tol: float = 1e-4, history_size: int = 10, precondition: bool = True, dtype=None,
                        device=None, chunk_rows: int = CHUNK_ROWS, progress: bool = False) -> EnsembleFit:
    """Fit m multinomial logistic regressions, classifier i on the rows where train_mask[i].

    Minimises, for each i separately, f_i(θ_i) = (1/t_i) Σ_{j∈T_i} CE(W_i x_j + b_i, y_j) + ||W_i||² / (2 C t_i),
    scikit-learn's ``LogisticRegression(C=C)`` objective, with L-BFGS (per-classifier history, step and
    Armijo backtracking), full batch; a classifier stops when max|∇f_i| <= ``tol`` (scikit-learn's
    ``tol``, scipy's ``gtol``) or when no trial step decreases f_i.

    Every train part is a subset of the same N rows, so the passes over the rows are shared: the
    logits of a search direction for all m classifiers are one matrix product X·[P_1 ... P_m]
    ((N x d)·(d x m(K-1))), and the gradients another, Rᵀ·X with R the residuals softmax - y of each
    classifier on its own train rows and zero elsewhere. That is N/t times the arithmetic of m
    separate fits, but as matrix products with m(K-1) columns it runs at the machine's GEMM rate
    instead of its memory bandwidth and copies no partition's rows. Only K-1 columns per classifier
    enter the products: weights, directions and residuals sum to zero over the classes (θ starts at
    0 and stays there), so the last class is minus the sum of the others. The state of the line
    search (logits, probabilities) is kept at each classifier's t train rows only.

    The initial inverse Hessian of L-BFGS is :func:`shared_preconditioner` (``precondition=False``:
    the usual scalar sᵀy/yᵀy), which cuts the iterations several-fold on embeddings with correlated
    dimensions. The trial points of the line search reuse the logits (linear in θ: Z + α·Zp), and
    the change of the loss per row, log Σ_k softmax(z)_k e^{α zp_k} - α zp_y, is computed with
    log1p/expm1 so that the Armijo test stays exact near the optimum in float32. One iteration is
    one forward product (Zp) and one backward product (the gradient at the accepted point),
    whatever the backtracking. The logits of every row under every classifier are computed once at
    the end (``EnsembleFit.logits``), for the held-out predictions.
    """
    import torch
    from tqdm.auto import tqdm

    dtype = dtype or torch.float32
    dev = torch.device(device) if device is not None else torch.device("cpu")
    Xt = torch.as_tensor(np.asarray(X), dtype=dtype, device=dev).contiguous()
    N, d = Xt.shape
    D = d + 1
    mask = np.asarray(train_mask, dtype=bool)
    if mask.ndim != 2 or mask.shape[1] != N:
        raise ConfigError(f"train_mask must have shape (m, {N}) (one row per partition, one column per data row), "
                          f"got {mask.shape}")
    m = mask.shape[0]
    t = mask.sum(1)
    if m and t.min() == 0:
        raise ConfigError(f"partition {int(np.argmin(t))} has no train rows; every partition needs t >= 1")
    K = int(num_labels)
    Km = K - 1
    y_np = np.asarray(y).astype(np.int64)
    chunks = [(a, min(a + chunk_rows, N)) for a in range(0, N, chunk_rows)]
    # the train rows of each classifier (m, t_max); a smaller partition is padded with rows outside
    # it at weight 0, so that no (row, classifier) pair repeats
    tmax = int(t.max(initial=1))
    rows_np = np.zeros((m, tmax), dtype=np.int64)
    w_np = np.zeros((m, tmax))
    for i in range(m):
        r = np.flatnonzero(mask[i])
        rows_np[i, :len(r)] = r
        rows_np[i, len(r):] = np.flatnonzero(~mask[i])[:tmax - len(r)]
        w_np[i, :len(r)] = 1.0 / len(r)
    rows = torch.as_tensor(rows_np, device=dev)                                            # l, t
    wg = torch.as_tensor(w_np, dtype=dtype, device=dev)                                   # l, t
    Yg = torch.nn.functional.one_hot(torch.as_tensor(y_np[rows_np], device=dev), K).to(dtype)
    Yg = Yg.permute(2, 0, 1).contiguous()                                                  # K, l, t
    lam_np = 1.0 / (C * np.maximum(t, 1))
    lam = torch.as_tensor(lam_np, dtype=dtype, device=dev)
    P0 = shared_preconditioner(Xt, float(lam_np.mean()), K).to(dtype) if precondition and m else None
    # one (N, K-1, m) buffer for the products in each direction, reused by every iteration
    buf_f = torch.empty(N * Km * m, dtype=dtype, device=dev)
    buf_b = torch.empty(N * Km * m, dtype=dtype, device=dev)

    def forward(P, out):
        """X·P for the first K-1 classes of every classifier in P (l, D, K): (N, K-1, l)."""
        l = P.shape[0]
        Wmat = P[:, :d, :Km].permute(1, 2, 0).reshape(d, Km * l)
        bias = P[:, d, :Km].T.reshape(Km * l)
        F = out[:N * Km * l].view(N, Km * l)
        for a, b in chunks:
            torch.addmm(bias, Xt[a:b], Wmat, out=F[a:b])
        return F.view(N, Km, l)

    def at_train_rows(F, rows_l):
        """F (N, K-1, l) at each classifier's train rows, all K classes (the last = -Σ): (K, l, t)."""
        l = rows_l.shape[0]
        g = F[rows_l, :, torch.arange(l, device=dev)[:, None]]                             # l, t, K-1
        out = torch.empty(K, l, g.shape[1], dtype=dtype, device=dev)
        out[:Km] = g.permute(2, 0, 1)
        torch.sum(out[:Km], 0, out=out[Km]).neg_()
        return out

    def softmax0(Zg):
        e = torch.exp(Zg - Zg.amax(0, keepdim=True))
        return e.div_(e.sum(0, keepdim=True))

    def gradient(prob, theta, lam, rows_l, wg_l, Yg_l):
        """∇f_i = Σ_{j∈T_i} (softmax(z_ij) - y_j) x̃_jᵀ / t_i + λ_i [W_i; 0] from prob (K, l, t): (l, D, K)."""
        l = rows_l.shape[0]
        Rg = (prob - Yg_l).mul_(wg_l[None])                                                 # K, l, t
        B = buf_b[:N * Km * l].view(N, Km, l)
        B.zero_()
        B[rows_l, :, torch.arange(l, device=dev)[:, None]] = Rg[:Km].permute(1, 2, 0)
        B2 = B.view(N, Km * l)
        GW = torch.zeros(Km * l, d, dtype=dtype, device=dev)
        for a, b in chunks:
            GW.addmm_(B2[a:b].T, Xt[a:b])
        G = torch.empty(l, D, K, dtype=dtype, device=dev)
        G[:, :d, :Km] = GW.view(Km, l, d).permute(1, 2, 0)
        torch.sum(G[:, :d, :Km], 2, out=G[:, :d, Km]).neg_()
        G[:, d] = Rg.sum(2, dtype=torch.float64).T.to(dtype)
        G[:, :d] += lam[:, None, None] * theta[:, :d]
        return G

    def loss_change(prob, Zpg, wg_l, Yg_l, steps):
        """Σ_{j∈T_i} [CE(z_ij + α zp_ij) - CE(z_ij)] / t_i for every classifier i and step α: (l, S), float64."""
        u = Zpg[:, None] * steps.to(dtype)[None, :, None, None]                            # K, S, l, t
        top = u.amax(0).clamp_min_(0)
        # log Σ_k p_k e^{u_k} = top + log1p(Σ_k p_k expm1(u_k - top)): exact for small steps
        change = torch.log1p((prob[:, None] * torch.expm1(u - top)).sum(0)).add_(top)
        change -= (u * Yg_l[:, None]).sum(0)                                                # S, l, t
        return (change * wg_l[None]).sum(2, dtype=torch.float64).T

    out_theta = torch.zeros(m, D, K, dtype=dtype, device=dev)
    out_iter = np.zeros(m, dtype=np.int64)
    out_gmax = np.zeros(m, dtype=np.float64)
    live = torch.arange(m, device=dev)           # the classifiers still being optimised
    theta = torch.zeros(m, D, K, dtype=dtype, device=dev)
    Zg = torch.zeros(K, m, tmax, dtype=dtype, device=dev)                                  # logits at train rows
    prob = softmax0(Zg)
    n_iter = np.zeros(m, dtype=np.int64)
    grad = gradient(prob, theta, lam, rows, wg, Yg)
    gmax = grad.abs().flatten(1).amax(1)
    active = gmax > tol
    s_hist, y_hist, rho_hist = [], [], []        # (l, D*K) each: flattened curvature pairs
    halves = 0.5 ** torch.arange(1, LS_TRIALS, dtype=torch.float64)
    bar = tqdm(total=m, desc="linear models converged", unit="model", disable=not progress, leave=False)

    def retire(keep):
        """Write out the classifiers that stop and drop them from every live tensor."""
        nonlocal live, theta, lam, grad, gmax, active, Zg, prob, rows, wg, Yg, s_hist, y_hist, rho_hist
        done = torch.nonzero(~keep).flatten()
        ids = live[done]
        out_theta[ids] = theta[done]
        out_gmax[ids.cpu().numpy()] = gmax[done].double().cpu().numpy()
        bar.update(len(done))
        sel = torch.nonzero(keep).flatten()
        live, theta, lam, grad, gmax, active, rows, wg = (
            v.index_select(0, sel) for v in (live, theta, lam, grad, gmax, active, rows, wg))
        Zg, prob, Yg = (v.index_select(1, sel) for v in (Zg, prob, Yg))
        s_hist = [v.index_select(0, sel) for v in s_hist]
        y_hist = [v.index_select(0, sel) for v in y_hist]
        rho_hist = [v.index_select(0, sel) for v in rho_hist]

    for _ in range(max_iter):
        if not bool(active.all()):
            retire(active)
        if len(live) == 0:
            break
        l = len(live)
        gf = grad.flatten(1)
        # two-loop recursion, every inner product per classifier: (l,)
        q = gf.clone()
        alphas = []
        for s, yv, rho in zip(reversed(s_hist), reversed(y_hist), reversed(rho_hist)):
            a = rho * torch.linalg.vecdot(s, q)
            q.addcmul_(a[:, None], yv, value=-1)
            alphas.append(a)
        if P0 is not None:
            q = torch.matmul(P0, q.view(l, D, K)).flatten(1)
        elif s_hist:
            s, yv = s_hist[-1], y_hist[-1]
            q *= (torch.linalg.vecdot(s, yv) / torch.linalg.vecdot(yv, yv).clamp_min(1e-30))[:, None]
        else:
            q /= gf.abs().sum(1).clamp_min(1e-30)[:, None]  # a unit-length steepest-descent first step
        for s, yv, rho, a in zip(s_hist, y_hist, rho_hist, reversed(alphas)):
            q.addcmul_((a - rho * torch.linalg.vecdot(yv, q))[:, None], s)
        direction = q.neg_().view(l, D, K)
        direction -= direction.mean(2, keepdim=True)   # exactly zero over the classes, like θ and ∇
        pf = direction.flatten(1)
        slope = torch.linalg.vecdot(gf, pf)
        bad = slope >= 0  # not a descent direction (lost curvature): steepest descent instead
        if bool(bad.any()):
            pf[bad] = -gf[bad]
            slope = torch.where(bad, -torch.linalg.vecdot(gf, gf), slope)
        Zpg = at_train_rows(forward(direction, buf_f), rows)                               # K, l, t
        # Armijo backtracking: f_i(θ + αp) - f_i(θ) <= 1e-4 α ∇f_i·p, the data part from (Z, Zp) at the
        # train rows, the penalty part ½λ(2α θ·p + α²||p||²) in closed form
        tW, pW = theta[:, :d].flatten(1), direction[:, :d].flatten(1)
        pen1 = (lam * torch.linalg.vecdot(tW, pW)).double()
        pen2 = (0.5 * lam * torch.linalg.vecdot(pW, pW)).double()
        slope64 = slope.double()
        step = torch.zeros(l, dtype=torch.float64, device=dev)
        found = torch.zeros(l, dtype=torch.bool, device=dev)
        for trial in [torch.ones(1, dtype=torch.float64)] + [halves[i:i + LS_BLOCK]
                                                              for i in range(0, len(halves), LS_BLOCK)]:
            trial = trial.to(dev)
            todo = torch.nonzero(~found).flatten()
            if len(todo) == 0:
                break
            sub = (lambda v, dim: v) if len(todo) == l else (lambda v, dim: v.index_select(dim, todo))
            dz = loss_change(sub(prob, 1), sub(Zpg, 1), sub(wg, 0), sub(Yg, 1), trial)
            dz += trial[None, :] * pen1[todo, None] + trial[None, :] ** 2 * pen2[todo, None]
            ok = dz <= 1e-4 * trial[None, :] * slope64[todo, None]
            first = ok.to(torch.uint8).argmax(1)
            take = ok.any(1)
            step[todo[take]] = trial[first[take]]
            found[todo[take]] = True
        moved = found
        stepc = step.to(dtype) * moved
        s_new = stepc[:, None] * pf
        theta = theta + s_new.view(l, D, K)
        Zg.addcmul_(stepc[None, :, None], Zpg)
        del Zpg
        prob = softmax0(Zg)
        new_grad = gradient(prob, theta, lam, rows, wg, Yg)
        new_grad = torch.where(moved[:, None, None], new_grad, grad)
        y_new = (new_grad - grad).flatten(1)
        sy = torch.linalg.vecdot(s_new, y_new)
        grad = new_grad
        gmax = grad.abs().flatten(1).amax(1)
        n_iter[live.cpu().numpy()] += moved.cpu().numpy()
        # keep a curvature pair only where it is informative; elsewhere a neutral (zero) pair
        good = moved & (sy > 1e-10 * torch.linalg.vector_norm(s_new, dim=1) * torch.linalg.vector_norm(y_new, dim=1))
        rho = torch.where(good, 1.0 / sy.clamp_min(1e-30), torch.zeros_like(sy))
        s_hist.append(s_new * good[:, None])
        y_hist.append(y_new * good[:, None])
        rho_hist.append(rho)
        if len(s_hist) > history_size:
            s_hist.pop(0), y_hist.pop(0), rho_hist.pop(0)
        # a classifier whose line search found no decrease has converged to float precision
        active = moved & (gmax > tol)
    if len(live):
        retire(torch.zeros(len(live), dtype=torch.bool, device=dev))
    bar.close()
    del buf_b
    # the logits of every row under every classifier, for the held-out predictions: (N, K, m)
    logits = torch.empty(N, K, m, dtype=dtype, device=dev)
    logits[:, :Km] = forward(out_theta, buf_f)
    torch.sum(logits[:, :Km], 1, out=logits[:, Km]).neg_()
    return EnsembleFit(out_theta, logits.permute(0, 2, 1), n_iter, out_gmax <= tol, out_gmax)


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


def predictability_scores(X, y, num_labels: int, *, m: int = 64, train_size: int, rng: np.random.Generator,
                          C: float = 1.0, max_iter: int = 1000, tol: float = 1e-4, history_size: int = 10,
                          precondition: bool = True, dtype=None, device=None, train_mask: np.ndarray | None = None,
                          progress: bool = False) -> ScoreRound:
    """score(e) = |{i : e ∈ V_i and L_i(Φ(e)) = y_e}| / |{i : e ∈ V_i}| over m random partitions."""
    n = len(y)
    train = train_mask if train_mask is not None else random_partitions(n, m, train_size, rng)
    fit = fit_linear_ensemble(X, y, train, num_labels, C=C, max_iter=max_iter, tol=tol, history_size=history_size,
                              precondition=precondition, dtype=dtype, device=device, progress=progress)
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


def aflite(embeddings: np.ndarray, labels: np.ndarray, num_labels: int | None = None, *, m: int = 64,
           train_size: int | None = None, k: int | None = None, tau: float = 0.75, target_n: int | None = None,
           selection: str = "greedy", C: float = 1.0, max_iter: int = 1000, tol: float = 1e-4,
           history_size: int = 10, standardize_embeddings: bool = True, seed: int = 0,
           max_rounds: int | None = None, precondition: bool = True, dtype=None, device: str | None = None,
           progress: bool = True) -> AFLiteResult:
    """Run AFLite (Le Bras et al. 2020, Algorithm 1) on precomputed embeddings Φ(x) and labels y.

    ``device`` runs the linear models with torch on that device (default: the CPU)."""
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
                                   max_iter=p.max_iter, tol=p.tol, history_size=p.history_size,
                                   precondition=precondition, dtype=dtype, device=device, progress=progress)
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


# ----------------------------------------------------------------------------------------------
# datasets


def aflite_filter(ds, embeddings: np.ndarray, *, num_labels: int | None = None, **params) -> tuple[Any, Any, AFLiteResult]:
    """AFLite on a canonical dataset with one embedding per row (same order). Returns
    (kept_ds, removed_ds, result); removed rows carry ``aflite_score``, ``aflite_round`` and
    ``reason`` = "aflite", so nothing is lost."""
    import datasets
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
    # explicit types: with no row removed the columns would otherwise be typed "null"
    removed = removed.add_column("aflite_score", res.removed_scores[order].astype(np.float64).tolist(),
                                 feature=datasets.Value("float64"))
    removed = removed.add_column("aflite_round", res.removed_round[order].astype(np.int64).tolist(),
                                 feature=datasets.Value("int64"))
    removed = removed.add_column("reason", [AFLITE_REASON] * len(removed), feature=datasets.Value("string"))
    return kept, removed, res


STEP_DEFAULTS: dict[str, Any] = {
    "encoder": None, "batch_size": 64, "max_length": 128, "pooling": "cls",
    "warmup_share": DEFAULT_WARMUP_SHARE, "warmup_epochs": PAPER_WARMUP["epochs"], "warmup_lr": PAPER_WARMUP["lr"],
    "warmup_eps": PAPER_WARMUP["eps"], "warmup_batch_size": PAPER_WARMUP["batch_size"],
    "m": 64, "train_size": None, "k": None, "tau": 0.75, "target_n": None, "selection": "greedy", "C": 1.0,
    "max_iter": 1000, "tol": 1e-4, "seed": 0, "max_rounds": None, "audit": True, "top_k": 20, "random_control": True,
    "progress": True, "device": None,
}
"""The step's defaults: the paper's protocol (warm-up of Appendix A.4, t = the warm-up size, n = |D|/3,
first-token embeddings of the fine-tuned encoder); m, k and tau are the project's choices (see
``PARAM_SOURCES``)."""


def _audit_summary(ds, task, top_k: int, seed: int, progress: bool) -> dict:
    from .audit import audit_dataset
    rep = audit_dataset(ds, task, top_k=top_k, seed=seed, progress=progress)
    keep = ("n_rows", "labels", "hypothesis_only_accuracy", "max_abs_z", "z_threshold", "features_above_threshold",
            "features")
    return {k: rep[k] for k in keep if k in rep}


def aflite_step(ds, task, params: Mapping[str, Any] | None = None):
    """The AFLite recipe step, the paper's protocol: warm-up fine-tuning on a share of the rows ->
    first-token embeddings of the other rows with the fine-tuned encoder -> Algorithm 1 with t = the
    warm-up size and n = |D|/3 -> audit.

    Returns (kept_ds, removed_ds, report). ``removed_ds`` holds the warm-up rows (``reason`` =
    "warm-up", no score: the paper does "not reuse this data") and the filtered rows (``reason`` =
    "aflite", with ``aflite_score`` and ``aflite_round``). The report has the parameters with their
    source (``protocol``), the sizes per round, and (``audit``) the bias audit of the input, of the
    kept rows and of a random subset of the same size (the paper's control). ``warmup_share: 0``
    skips the warm-up (then the encoder is used as it is and t defaults to a tenth of the rows).
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
    given = {k for k, v in (params or {}).items() if v is not None}
    p = {**STEP_DEFAULTS, **{k: v for k, v in (params or {}).items() if v is not None}}
    encoder = p["encoder"] or default_encoder()
    n_input = len(ds)
    report: dict[str, Any] = {"method": "aflite", "encoder": encoder, "n_input": n_input, "pooling": p["pooling"],
                              "max_length": p["max_length"]}
    target_n = p["target_n"] if p["target_n"] is not None else paper_target_size(n_input)
    work, warm_rows, train_size = ds, None, p["train_size"]
    if p["warmup_share"]:
        wu = warm_up_encoder(ds, encoder, num_labels=task.num_labels, share=p["warmup_share"], seed=p["seed"],
                             epochs=p["warmup_epochs"], lr=p["warmup_lr"], eps=p["warmup_eps"],
                             batch_size=p["warmup_batch_size"], max_length=p["max_length"], progress=p["progress"],
                             device=p["device"])
        warm_rows = ds.select(wu.indices)
        work = ds.select(wu.rest(len(ds)))
        encoder = wu.model_dir
        if train_size is None:
            train_size = len(wu.indices)  # t = the warm-up size (§2)
        report["warm_up"] = {"rows": int(len(wu.indices)), "model_dir": wu.model_dir, "train_loss": wu.train_loss,
                             **wu.params}
    emb = compute_embeddings(work, encoder, batch_size=p["batch_size"], max_length=p["max_length"],
                             pooling=p["pooling"], progress=p["progress"], device=p["device"])
    report["embedding_dim"] = int(emb.shape[1])
    report["embedded_with"] = encoder
    if target_n >= len(work):
        raise ConfigError(f"the target size n = {target_n:,} is not below the {len(work):,} rows left after the "
                          f"warm-up; lower target_n or warmup_share")
    algo = {k: p[k] for k in ("m", "k", "tau", "selection", "C", "max_iter", "tol", "seed", "max_rounds", "device")}
    kept, removed, res = aflite_filter(work, emb, num_labels=task.num_labels, progress=p["progress"],
                                       train_size=train_size, target_n=target_n, **algo)
    if warm_rows is not None and len(warm_rows):
        n = len(warm_rows)
        # no score: these rows were never filtered (null, not NaN)
        warm = warm_rows.add_column("aflite_score", [None] * n, feature=datasets.Value("float64"))
        warm = warm.add_column("aflite_round", [-1] * n, feature=datasets.Value("int64"))
        warm = warm.add_column("reason", [WARMUP_REASON] * n, feature=datasets.Value("string"))
        removed = datasets.concatenate_datasets([warm.cast(removed.features), removed])
    report.update(res.to_dict())
    report["n_input"] = n_input
    report["n_removed"] = len(removed)
    report["removed_by_reason"] = {WARMUP_REASON: 0 if warm_rows is None else len(warm_rows),
                                   AFLITE_REASON: int(len(res.removed_indices))}
    report["protocol"] = _protocol(report, p, given)
    if p["audit"] and len(kept):
        report["audit"] = {"before": _audit_summary(ds, task, p["top_k"], p["seed"], p["progress"]),
                           "after": _audit_summary(kept, task, p["top_k"], p["seed"], p["progress"])}
        if p["random_control"]:
            rng = np.random.default_rng(p["seed"] + 1)
            ctrl = ds.select(np.sort(rng.choice(len(ds), size=len(kept), replace=False)))
            report["audit"]["random_same_size"] = _audit_summary(ctrl, task, p["top_k"], p["seed"], p["progress"])
    return kept, removed, report


def _protocol(report: Mapping[str, Any], p: Mapping[str, Any], given: set) -> dict:
    """Every value the run used, with where it comes from (the paper, the project, or the user)."""
    used = dict(report["params"])
    used.update({"encoder": report["encoder"], "pooling": p["pooling"]})
    if "warm_up" in report:
        w = report["warm_up"]
        used.update({"warmup_share": w["share"], "warmup_epochs": w["epochs"], "warmup_lr": w["lr"],
                     "warmup_eps": w["eps"], "warmup_batch_size": w["batch_size"]})
    else:
        used["warmup_share"] = 0
    out = {}
    for key in ("encoder", "warmup_share", "warmup_epochs", "warmup_lr", "warmup_eps", "warmup_batch_size", "pooling",
                "train_size", "target_n", "m", "k", "tau", "C", "tol"):
        if key not in used:
            continue
        if key in given:
            src = "set for this run"
        elif key == "train_size" and "warm_up" not in report:
            src = "project's choice (no warm-up: a tenth of the rows)"
        else:
            src = PARAM_SOURCES.get(key, "project's choice")
        out[key] = {"value": used[key], "source": src}
    return out


# ----------------------------------------------------------------------------------------------
# report


def render_aflite_md(report: Mapping[str, Any], title: str | None = None) -> str:
    """The card section: parameters, sizes per round, and the audit before / after / random control."""
    p = report["params"]
    lines = [f"# {title or 'AFLite (Le Bras et al. 2020)'}", ""]
    lines.append(f"- input rows: {report['n_input']:,}; kept: {report['n_kept']:,}; removed: "
                 + ", ".join(f"{k} {v:,}" for k, v in report.get("removed_by_reason", {}).items()))
    w = report.get("warm_up")
    if w:
        lines.append(f"- warm-up: `{w['base_model']}` fine-tuned as a pair classifier on {w['rows']:,} random rows "
                     f"(share {w['share']}), {w['epochs']:g} epoch(s), batch {w['batch_size']}, lr {w['lr']:g}, "
                     f"Adam eps {w['eps']:g}, max length {w['max_length']}; final train loss {w['train_loss']:.3f}. "
                     f"These rows are set aside (reason `warm-up`) and t = {p['train_size']:,} is their number.")
    else:
        lines.append("- no warm-up: the encoder was used as it is")
    lines.append(f"- embeddings: {'first token ([CLS])' if report.get('pooling', 'cls') == 'cls' else 'masked mean'} "
                 f"of the last layer of `{report.get('embedded_with', report.get('encoder'))}`"
                 + (f", dimension {report['embedding_dim']}" if report.get("embedding_dim") else "")
                 + (f", max length {report['max_length']}" if report.get("max_length") else ""))
    lines.append(f"- m = {p['m']} partitions, train size t = {p['train_size']:,}, slice k = {p['k']:,}, "
                 f"tau = {p['tau']}, target n = {p['target_n']:,}, selection {p['selection']}, "
                 f"logistic regression C = {p['C']} (L-BFGS to max|grad| <= {p.get('tol', 1e-4):g}), seed {p['seed']}")
    lines.append(f"- stopped: {report['stop_reason']} after {report['rounds']} round(s)")
    lines += ["", "## Rounds", "",
              "| round | rows | score >= tau | removed | held-out accuracy | median score | lowest removed score "
              "| L-BFGS iterations, median (max) |",
              "|---|---|---|---|---|---|---|---|"]
    for h in report["history"]:
        med = h["score_quantiles"].get("0.5")
        low = h["removed_min_score"]
        med_s = "" if med is None else f"{med:.3f}"
        low_s = "" if low is None else f"{low:.3f}"
        its = f"{h['lbfgs_iter_median']:.0f} ({h['lbfgs_iter_max']})" if "lbfgs_iter_median" in h else ""
        lines.append(f"| {h['round']} | {h['size_before']:,} | {h['candidates']:,} | {h['removed']:,} | "
                     f"{h['heldout_accuracy']:.3f} | {med_s} | {low_s} | {its} |")
    proto = report.get("protocol")
    if proto:
        lines += ["", "## Where each value comes from", "", "| value | used | source |", "|---|---|---|"]
        cell = (lambda x: str(x).replace("|", "\\|"))
        lines += [f"| `{k}` | {cell(v['value'])} | {cell(v['source'])} |" for k, v in proto.items()]
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
