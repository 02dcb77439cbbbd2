"""The m linear classifiers of one AFLite round, fitted at once (see algorithm.py's docstring for the
maths): multinomial logistic regression with an L2 penalty, one batched L-BFGS over shared rows with
per-classifier 0/1 weights and a shared preconditioner."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from ...utils.errors import ConfigError

log = logging.getLogger(__name__)

CHUNK_ROWS = 16384


LS_TRIALS = 30


LS_BLOCK = 4


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


@dataclasses.dataclass(frozen=True)
class LinearSolver:
    """The linear models' objective and solver: ``C`` (inverse L2 strength, scikit-learn's), at most ``max_iter``
    L-BFGS iterations, the stopping test max|∇f_i| <= ``tol``, ``history_size`` curvature pairs kept, and
    ``precondition``: :func:`shared_preconditioner` as the initial inverse Hessian (False: the scalar sᵀy/yᵀy)."""

    C: float = 1.0
    max_iter: int = 1000
    tol: float = 1e-4
    history_size: int = 10
    precondition: bool = True


def fit_linear_ensemble(X, y, train_mask, num_labels: int, solver: LinearSolver | None = None, *, dtype=None,
                        device=None, chunk_rows: int = CHUNK_ROWS, progress: bool = False) -> EnsembleFit:
    """Fit m multinomial logistic regressions, classifier i on the rows where train_mask[i].

    Minimises, for each i separately, f_i(θ_i) = (1/t_i) Σ_{j∈T_i} CE(W_i x_j + b_i, y_j) + ||W_i||² / (2 C t_i),
    scikit-learn's ``LogisticRegression(C=C)`` objective, with L-BFGS (per-classifier history, step and
    Armijo backtracking), full batch; a classifier stops when max|∇f_i| <= ``tol`` (scikit-learn's
    ``tol``, scipy's ``gtol``) or when no trial step decreases f_i. ``solver``: C, tol and the rest
    (:class:`LinearSolver`; default: its defaults).

    Every train part is a subset of the same N rows, so the passes over the rows are shared: the
    logits of a search direction for all m classifiers are one matrix product X·[P_1 ... P_m]
    ((N x d)·(d x m(K-1))), and the gradients another, Rᵀ·X with R the residuals softmax - y of each
    classifier on its own train rows and zero elsewhere. That is N/t times the arithmetic of m
    separate fits, but as matrix products with m(K-1) columns it runs at the machine's GEMM rate
    instead of its memory bandwidth and copies no partition's rows. Only K-1 columns per classifier
    enter the products: weights, directions and residuals sum to zero over the classes (θ starts at
    0 and stays there), so the last class is minus the sum of the others. The state of the line
    search (logits, probabilities) is kept at each classifier's t train rows only.

    The initial inverse Hessian of L-BFGS is :func:`shared_preconditioner` (``solver.precondition=False``:
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

    solver = solver or LinearSolver()
    dtype = dtype or torch.float32
    dev = torch.device(device) if device is not None else torch.device("cpu")
    Xt = torch.as_tensor(np.asarray(X), dtype=dtype, device=dev).contiguous()
    N, d = Xt.shape
    mask = np.asarray(train_mask, dtype=bool)
    if mask.ndim != 2 or mask.shape[1] != N:
        raise ConfigError(f"train_mask must have shape (m, {N}) (one row per partition, one column per data row), "
                          f"got {mask.shape}")
    m = mask.shape[0]
    t = mask.sum(1)
    if m and t.min() == 0:
        raise ConfigError(f"partition {int(np.argmin(t))} has no train rows; every partition needs t >= 1")
    K = int(num_labels)
    lam_np = 1.0 / (solver.C * np.maximum(t, 1))
    lam = torch.as_tensor(lam_np, dtype=dtype, device=dev)
    P0 = shared_preconditioner(Xt, float(lam_np.mean()), K).to(dtype) if solver.precondition and m else None
    passes = _SharedPasses(Xt, K, m, chunk_rows)

    out_theta = torch.zeros(m, d + 1, K, dtype=dtype, device=dev)
    out_gmax = np.zeros(m, dtype=np.float64)
    n_iter = np.zeros(m, dtype=np.int64)
    # the live set holds the only reference to the train-row layout, so retiring classifiers frees it
    live = _LiveClassifiers.at_zero(passes, lam, *train_rows(mask, y, K, dtype=dtype, device=dev), tol=solver.tol)
    halves = 0.5 ** torch.arange(1, LS_TRIALS, dtype=torch.float64)
    bar = tqdm(total=m, desc="linear models converged", unit="model", disable=not progress, leave=False)
    for _ in range(solver.max_iter):
        if not bool(live.active.all()):
            live.retire(live.active, out_theta, out_gmax, bar)
        if len(live.ids) == 0:
            break
        _lbfgs_iteration(live, passes, P0, halves, n_iter, history_size=solver.history_size, tol=solver.tol)
    if len(live.ids):
        live.retire(torch.zeros(len(live.ids), dtype=torch.bool, device=dev), out_theta, out_gmax, bar)
    bar.close()
    passes.buf_b = None
    return EnsembleFit(out_theta, passes.all_logits(out_theta), n_iter, out_gmax <= solver.tol, out_gmax)


def train_rows(mask: np.ndarray, y, num_labels: int, *, dtype, device):
    """The train rows of each classifier (m, t_max), their weights 1/t_i (m, t_max) and one-hot labels
    (K, m, t_max); a smaller partition is padded with rows outside it at weight 0, so that no
    (row, classifier) pair repeats."""
    import torch
    m = mask.shape[0]
    t = mask.sum(1)
    y_np = np.asarray(y).astype(np.int64)
    tmax = int(t.max(initial=1))
    rows_np = np.zeros((m, tmax), dtype=np.int64)
    w_np = np.zeros((m, tmax))
    for i in range(m):
        r = np.flatnonzero(mask[i])
        rows_np[i, :len(r)] = r
        rows_np[i, len(r):] = np.flatnonzero(~mask[i])[:tmax - len(r)]
        w_np[i, :len(r)] = 1.0 / len(r)
    rows = torch.as_tensor(rows_np, device=device)                                         # l, t
    wg = torch.as_tensor(w_np, dtype=dtype, device=device)                                # l, t
    Yg = torch.nn.functional.one_hot(torch.as_tensor(y_np[rows_np], device=device), num_labels).to(dtype)
    return rows, wg, Yg.permute(2, 0, 1).contiguous()                                    # K, l, t


def softmax0(Zg):
    """softmax over the classes, the first dimension (K, l, t)."""
    import torch
    e = torch.exp(Zg - Zg.amax(0, keepdim=True))
    return e.div_(e.sum(0, keepdim=True))


class _SharedPasses:
    """The passes over the N shared rows X (N, d), for l <= m classifiers at once: the logits of their
    first K-1 classes (one product X·P), those logits at each classifier's train rows, the gradient
    (one product Rᵀ·X) and the loss change along a direction. One (N, K-1, m) buffer per direction
    is reused by every iteration."""

    def __init__(self, Xt, num_labels: int, m: int, chunk_rows: int):
        import torch
        self.Xt = Xt
        self.N, self.d = Xt.shape
        self.K = num_labels
        self.Km = num_labels - 1
        self.dtype, self.dev = Xt.dtype, Xt.device
        self.chunks = [(a, min(a + chunk_rows, self.N)) for a in range(0, self.N, chunk_rows)]
        self.buf_f = torch.empty(self.N * self.Km * m, dtype=self.dtype, device=self.dev)
        self.buf_b = torch.empty(self.N * self.Km * m, dtype=self.dtype, device=self.dev)

    def forward(self, P, out):
        """X·P for the first K-1 classes of every classifier in P (l, D, K): (N, K-1, l)."""
        import torch
        N, d, Km, Xt = self.N, self.d, self.Km, self.Xt
        l = P.shape[0]
        Wmat = P[:, :d, :Km].permute(1, 2, 0).reshape(d, Km * l)
        bias = P[:, d, :Km].T.reshape(Km * l)
        F = out[:N * Km * l].view(N, Km * l)
        for a, b in self.chunks:
            torch.addmm(bias, Xt[a:b], Wmat, out=F[a:b])
        return F.view(N, Km, l)

    def at_train_rows(self, F, rows_l):
        """F (N, K-1, l) at each classifier's train rows, all K classes (the last = -Σ): (K, l, t)."""
        import torch
        K, Km, dtype, dev = self.K, self.Km, self.dtype, self.dev
        l = rows_l.shape[0]
        g = F[rows_l, :, torch.arange(l, device=dev)[:, None]]                             # l, t, K-1
        out = torch.empty(K, l, g.shape[1], dtype=dtype, device=dev)
        out[:Km] = g.permute(2, 0, 1)
        torch.sum(out[:Km], 0, out=out[Km]).neg_()
        return out

    def gradient(self, prob, theta, lam, rows_l, wg_l, Yg_l):
        """∇f_i = Σ_{j∈T_i} (softmax(z_ij) - y_j) x̃_jᵀ / t_i + λ_i [W_i; 0] from prob (K, l, t): (l, D, K)."""
        import torch
        N, d, K, Km, Xt, dtype, dev = self.N, self.d, self.K, self.Km, self.Xt, self.dtype, self.dev
        D = d + 1
        l = rows_l.shape[0]
        Rg = (prob - Yg_l).mul_(wg_l[None])                                                 # K, l, t
        B = self.buf_b[:N * Km * l].view(N, Km, l)
        B.zero_()
        B[rows_l, :, torch.arange(l, device=dev)[:, None]] = Rg[:Km].permute(1, 2, 0)
        B2 = B.view(N, Km * l)
        GW = torch.zeros(Km * l, d, dtype=dtype, device=dev)
        for a, b in self.chunks:
            GW.addmm_(B2[a:b].T, Xt[a:b])
        G = torch.empty(l, D, K, dtype=dtype, device=dev)
        G[:, :d, :Km] = GW.view(Km, l, d).permute(1, 2, 0)
        torch.sum(G[:, :d, :Km], 2, out=G[:, :d, Km]).neg_()
        G[:, d] = Rg.sum(2, dtype=torch.float64).T.to(dtype)
        G[:, :d] += lam[:, None, None] * theta[:, :d]
        return G

    def loss_change(self, prob, Zpg, wg_l, Yg_l, steps):
        """Σ_{j∈T_i} [CE(z_ij + α zp_ij) - CE(z_ij)] / t_i for every classifier i and step α: (l, S), float64."""
        import torch
        u = Zpg[:, None] * steps.to(self.dtype)[None, :, None, None]                       # K, S, l, t
        top = u.amax(0).clamp_min_(0)
        # log Σ_k p_k e^{u_k} = top + log1p(Σ_k p_k expm1(u_k - top)): exact for small steps
        change = torch.log1p((prob[:, None] * torch.expm1(u - top)).sum(0)).add_(top)
        change -= (u * Yg_l[:, None]).sum(0)                                                # S, l, t
        return (change * wg_l[None]).sum(2, dtype=torch.float64).T

    def all_logits(self, theta):
        """The logits of every row under every classifier, for the held-out predictions: (N, m, K)."""
        import torch
        m = theta.shape[0]
        logits = torch.empty(self.N, self.K, m, dtype=self.dtype, device=self.dev)
        logits[:, :self.Km] = self.forward(theta, self.buf_f)
        torch.sum(logits[:, :self.Km], 1, out=logits[:, self.Km]).neg_()
        return logits.permute(0, 2, 1)


@dataclasses.dataclass
class _LiveClassifiers:
    """The classifiers still being optimised (``ids``, into the m): θ, λ, gradient, max|∇|, whether
    still active, logits and probabilities at their train rows, their train rows, and the L-BFGS
    curvature pairs ((l, D*K) each, flattened)."""

    ids: Any
    theta: Any
    lam: Any
    grad: Any
    gmax: Any
    active: Any
    Zg: Any
    prob: Any
    rows: Any
    wg: Any
    Yg: Any
    s_hist: list = dataclasses.field(default_factory=list)
    y_hist: list = dataclasses.field(default_factory=list)
    rho_hist: list = dataclasses.field(default_factory=list)

    @classmethod
    def at_zero(cls, passes: _SharedPasses, lam, rows, wg, Yg, *, tol: float) -> "_LiveClassifiers":
        """Every classifier at θ = 0, active while max|∇| > tol."""
        import torch
        m, tmax = rows.shape
        K, dtype, dev = passes.K, passes.dtype, passes.dev
        theta = torch.zeros(m, passes.d + 1, K, dtype=dtype, device=dev)
        Zg = torch.zeros(K, m, tmax, dtype=dtype, device=dev)                              # logits at train rows
        prob = softmax0(Zg)
        grad = passes.gradient(prob, theta, lam, rows, wg, Yg)
        gmax = grad.abs().flatten(1).amax(1)
        return cls(torch.arange(m, device=dev), theta, lam, grad, gmax, gmax > tol, Zg, prob, rows, wg, Yg)

    def retire(self, keep, out_theta, out_gmax: np.ndarray, bar) -> None:
        """Write out the classifiers that stop (where not ``keep``) and drop them from every live tensor."""
        import torch
        done = torch.nonzero(~keep).flatten()
        ids = self.ids[done]
        out_theta[ids] = self.theta[done]
        out_gmax[ids.cpu().numpy()] = self.gmax[done].double().cpu().numpy()
        bar.update(len(done))
        sel = torch.nonzero(keep).flatten()
        self.ids, self.theta, self.lam, self.grad, self.gmax, self.active, self.rows, self.wg = (
            v.index_select(0, sel) for v in (self.ids, self.theta, self.lam, self.grad, self.gmax, self.active,
                                             self.rows, self.wg))
        self.Zg, self.prob, self.Yg = (v.index_select(1, sel) for v in (self.Zg, self.prob, self.Yg))
        self.s_hist = [v.index_select(0, sel) for v in self.s_hist]
        self.y_hist = [v.index_select(0, sel) for v in self.y_hist]
        self.rho_hist = [v.index_select(0, sel) for v in self.rho_hist]


def lbfgs_direction(grad, s_hist, y_hist, rho_hist, P0):
    """The L-BFGS search direction of every classifier from its gradient (l, D, K) and curvature pairs
    (two-loop recursion, every inner product per classifier), P0 (or the scalar sᵀy/yᵀy) as the initial
    inverse Hessian, steepest descent where that is not a descent direction. Returns the direction
    (l, D, K), the same as (l, D*K), and the slope ∇f_i·p_i (l,)."""
    import torch
    l, D, K = grad.shape
    gf = grad.flatten(1)
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
    return direction, pf, slope


def armijo_steps(passes: _SharedPasses, live: _LiveClassifiers, direction, slope, Zpg, halves):
    """Armijo backtracking for every classifier: the first step α of 1, 1/2, 1/4, ... (``LS_TRIALS``,
    ``LS_BLOCK`` at a time) with f_i(θ + αp) - f_i(θ) <= 1e-4 α ∇f_i·p, the data part from (Z, Zp) at
    the train rows, the penalty part ½λ(2α θ·p + α²||p||²) in closed form. Returns the step (l,),
    float64, and whether one was found (l,)."""
    import torch
    d, dev = passes.d, passes.dev
    l = len(live.ids)
    prob, wg, Yg, lam = live.prob, live.wg, live.Yg, live.lam
    tW, pW = live.theta[:, :d].flatten(1), direction[:, :d].flatten(1)
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
        dz = passes.loss_change(sub(prob, 1), sub(Zpg, 1), sub(wg, 0), sub(Yg, 1), trial)
        dz += trial[None, :] * pen1[todo, None] + trial[None, :] ** 2 * pen2[todo, None]
        ok = dz <= 1e-4 * trial[None, :] * slope64[todo, None]
        first = ok.to(torch.uint8).argmax(1)
        take = ok.any(1)
        step[todo[take]] = trial[first[take]]
        found[todo[take]] = True
    return step, found


def _lbfgs_iteration(live: _LiveClassifiers, passes: _SharedPasses, P0, halves, n_iter: np.ndarray, *,
                     history_size: int, tol: float) -> None:
    """One L-BFGS iteration of every live classifier: direction, one forward product, line search, step,
    one backward product (the gradient at the accepted point), curvature pair; counts the iterations
    of the classifiers that moved into ``n_iter``."""
    import torch
    l = len(live.ids)
    direction, pf, slope = lbfgs_direction(live.grad, live.s_hist, live.y_hist, live.rho_hist, P0)
    Zpg = passes.at_train_rows(passes.forward(direction, passes.buf_f), live.rows)         # K, l, t
    step, moved = armijo_steps(passes, live, direction, slope, Zpg, halves)
    stepc = step.to(passes.dtype) * moved
    s_new = stepc[:, None] * pf
    live.theta = live.theta + s_new.view(l, passes.d + 1, passes.K)
    live.Zg.addcmul_(stepc[None, :, None], Zpg)
    del Zpg
    live.prob = softmax0(live.Zg)
    new_grad = passes.gradient(live.prob, live.theta, live.lam, live.rows, live.wg, live.Yg)
    new_grad = torch.where(moved[:, None, None], new_grad, live.grad)
    y_new = (new_grad - live.grad).flatten(1)
    sy = torch.linalg.vecdot(s_new, y_new)
    live.grad = new_grad
    live.gmax = live.grad.abs().flatten(1).amax(1)
    n_iter[live.ids.cpu().numpy()] += moved.cpu().numpy()
    # keep a curvature pair only where it is informative; elsewhere a neutral (zero) pair
    good = moved & (sy > 1e-10 * torch.linalg.vector_norm(s_new, dim=1) * torch.linalg.vector_norm(y_new, dim=1))
    rho = torch.where(good, 1.0 / sy.clamp_min(1e-30), torch.zeros_like(sy))
    live.s_hist.append(s_new * good[:, None])
    live.y_hist.append(y_new * good[:, None])
    live.rho_hist.append(rho)
    if len(live.s_hist) > history_size:
        live.s_hist.pop(0), live.y_hist.pop(0), live.rho_hist.pop(0)
    # a classifier whose line search found no decrease has converged to float precision
    live.active = moved & (live.gmax > tol)


def predict_ensemble(X, theta, dtype=None, device=None) -> np.ndarray:
    """argmax_k (x W_i + b_i)_k for every partition i and row: int64 (m, N)."""
    import torch
    dtype = dtype or theta.dtype
    Xt = torch.as_tensor(np.asarray(X), dtype=dtype, device=theta.device)
    m, D, K = theta.shape
    logits = (Xt @ theta[:, :-1, :].permute(1, 0, 2).reshape(D - 1, m * K)).view(-1, m, K) + theta[:, -1, :][None]
    return logits.argmax(2).T.cpu().numpy()
