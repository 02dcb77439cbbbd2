"""The generator's objectives (Wu et al. 2022, sections 3-4), as plain functions of logits.

Notation: a batch of token sequences I (B x T), the model's logits (B x T x V), and for every target
position t >= 1 the log-probability ``log p(I_t | I_<t)`` (:func:`target_log_probs`). Masks are
given per token of I (B x T); position 0 is never a target. Every loss is a sum over the selected
target tokens divided by ``normalizer`` (default: the number of tokens the main term is computed on),
so the relative weights of the terms are exactly those of the paper's sums.

* MLE:                        ``L_MLE = -sum_t log p(I_t | I_<t)``
* label consistency
  (token-level unlikelihood): ``L_LC = -sum_{t in H} log(1 - p(H_t | l', P, H_<t))`` on the hypothesis
                              tokens of the same row with a perturbed label l' != l;
                              generator loss ``L_MLE + lambda * L_LC`` (lambda = 0.5).
* debiasing fine-tune (G*):   ``L = L_MLE(Z(D0)) + alpha * sum_{I in Z-(D0)} L_UL(I)`` (alpha = 1.0) with
                              ``L_UL(I) = -sum_t log(m_t p(I_t|I_<t) + (1 - m_t)(1 - p(I_t|I_<t)))``,
                              m_t = 0 exactly on the tokens carrying a biased feature of the row.
                              With m = 1 everywhere L_UL is L_MLE, so a Z row is a Z- row without
                              biased tokens and weight 1.

``log(1 - p)`` is computed as ``log1p(-p)`` with p clamped to ``1 - 1e-6`` so a confident model gives a
large finite penalty, not ``inf``.
"""
from __future__ import annotations

import torch

P_MAX = 1.0 - 1e-6


def target_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``log p(I_t | I_<t)`` for t = 1..T-1, aligned to I (B x T; column 0 is 0)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    tgt = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(tgt, (1, 0))


def _targets(mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(torch.float32).clone()
    mask[:, 0] = 0.0  # the first token is never predicted
    return mask


def _norm(mask: torch.Tensor, normalizer) -> torch.Tensor:
    if normalizer is None:
        return mask.sum().clamp(min=1.0)
    return torch.as_tensor(normalizer, dtype=torch.float32, device=mask.device)


def mle_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor, normalizer=None) -> torch.Tensor:
    """``-sum_t mask_t log p(I_t|I_<t) / normalizer`` (mask: 1 on real tokens, 0 on padding)."""
    w = _targets(mask)
    return -(w * target_log_probs(logits, input_ids)).sum() / _norm(w, normalizer)


def unlikelihood_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                      normalizer=None) -> torch.Tensor:
    """Token-level unlikelihood ``-sum_t mask_t log(1 - p(I_t|I_<t)) / normalizer``."""
    w = _targets(mask)
    p = target_log_probs(logits, input_ids).exp().clamp(max=P_MAX)
    return -(w * torch.log1p(-p)).sum() / _norm(w, normalizer)


def label_consistency_loss(logits_perturbed: torch.Tensor, input_ids_perturbed: torch.Tensor,
                           hypothesis_mask: torch.Tensor, normalizer=None) -> torch.Tensor:
    """``L_LC = -sum_{t in H} log(1 - p(H_t | l', P, H_<t))``: unlikelihood of the hypothesis tokens
    of the sequence whose label was replaced by a wrong one l'."""
    return unlikelihood_loss(logits_perturbed, input_ids_perturbed, hypothesis_mask, normalizer)


def generator_loss(logits, input_ids, mask, logits_perturbed, input_ids_perturbed, hypothesis_mask_perturbed,
                   lam: float = 0.5) -> tuple[torch.Tensor, dict[str, float]]:
    """Generator G: ``L_MLE + lambda * L_LC``, both normalised by the number of MLE target tokens."""
    n = _targets(mask).sum().clamp(min=1.0)
    mle = mle_loss(logits, input_ids, mask, normalizer=n)
    lc = label_consistency_loss(logits_perturbed, input_ids_perturbed, hypothesis_mask_perturbed, normalizer=n)
    return mle + lam * lc, {"mle": float(mle.detach()), "label_consistency": float(lc.detach())}


def selective_unlikelihood_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                                bias_mask: torch.Tensor, row_weight: torch.Tensor | None = None,
                                normalizer=None) -> torch.Tensor:
    """``-sum_t w_row mask_t log(m_t p + (1 - m_t)(1 - p))`` with ``m_t = 1 - bias_mask_t``: likelihood
    on the tokens without a biased feature, unlikelihood on the biased ones (m_t is 0 or 1)."""
    w = _targets(mask)
    if row_weight is not None:
        w = w * row_weight.to(w.dtype)[:, None]
    logp = target_log_probs(logits, input_ids)
    ul = torch.log1p(-logp.exp().clamp(max=P_MAX))
    term = torch.where(bias_mask.bool(), ul, logp)
    return -(w * term).sum() / _norm(_targets(mask), normalizer)


def debias_loss(logits, input_ids, mask, bias_mask, in_rejected, alpha: float = 1.0
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """G*: ``L_MLE(Z(D0)) + alpha * sum_{I in Z-(D0)} L_UL(I)`` on a batch mixing both sets
    (``in_rejected``: 1 for Z- rows). Normalised by the batch's number of target tokens."""
    in_rejected = in_rejected.to(torch.float32)
    n = _targets(mask).sum().clamp(min=1.0)
    keep = 1.0 - in_rejected
    mle = selective_unlikelihood_loss(logits, input_ids, mask, torch.zeros_like(bias_mask), keep, normalizer=n)
    ul = selective_unlikelihood_loss(logits, input_ids, mask, bias_mask * in_rejected[:, None].to(bias_mask.dtype),
                                     in_rejected, normalizer=n)
    return mle + alpha * ul, {"mle": float(mle.detach()), "unlikelihood": float(ul.detach())}
