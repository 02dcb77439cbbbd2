"""The objectives against hand-computed values on a toy batch, and the unlikelihood mask."""
import math
import os
from pathlib import Path

import pytest
import torch

from debiased_nli.methods.generation.format import SequenceFormat
from debiased_nli.methods.generation.losses import (debias_loss, generator_loss, label_consistency_loss, mle_loss,
                                                    selective_unlikelihood_loss, target_log_probs, unlikelihood_loss)

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
LABELS = ("entailment", "neutral", "contradiction")


def toy():
    """Two sequences over a 3-token vocabulary; logits = log(probabilities) so p is known exactly.

    Row 0: I = [0, 1, 2, 1]; p(I_1)=0.5, p(I_2)=0.25, p(I_3)=0.8
    Row 1: I = [2, 0, 0, <pad>]; p(I_1)=0.1, p(I_2)=0.6
    """
    probs = torch.tensor([
        [[0.2, 0.5, 0.3], [0.25, 0.5, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]],
        [[0.1, 0.3, 0.6], [0.6, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]],
    ])
    ids = torch.tensor([[0, 1, 2, 1], [2, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    return probs.log(), ids, mask


P = {(0, 1): 0.5, (0, 2): 0.25, (0, 3): 0.8, (1, 1): 0.1, (1, 2): 0.6}


def test_target_log_probs_are_the_probabilities_of_the_next_tokens():
    logits, ids, _ = toy()
    lp = target_log_probs(logits, ids)
    for (b, t), p in P.items():
        assert lp[b, t].item() == pytest.approx(math.log(p), abs=1e-6)
    assert lp[:, 0].abs().sum() == 0


def test_mle_is_the_mean_negative_log_likelihood_of_the_real_tokens():
    logits, ids, mask = toy()
    expected = -sum(math.log(p) for p in P.values()) / 5
    assert mle_loss(logits, ids, mask).item() == pytest.approx(expected, rel=1e-6)


def test_label_consistency_is_unlikelihood_on_the_hypothesis_tokens_only():
    logits, ids, mask = toy()
    hyp = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]])  # hypothesis tokens: row 0 t=2,3; row 1 t=2
    expected = -(math.log(1 - 0.25) + math.log(1 - 0.8) + math.log(1 - 0.6)) / 3
    assert label_consistency_loss(logits, ids, hyp).item() == pytest.approx(expected, rel=1e-6)
    assert unlikelihood_loss(logits, ids, hyp).item() == pytest.approx(expected, rel=1e-6)


def test_generator_loss_is_mle_plus_half_the_label_consistency_term():
    logits, ids, mask = toy()
    hyp = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]])
    mle = -sum(math.log(p) for p in P.values())
    lc = -(math.log(1 - 0.25) + math.log(1 - 0.8) + math.log(1 - 0.6))
    loss, parts = generator_loss(logits, ids, mask, logits, ids, hyp)  # lambda defaults to 0.5
    assert loss.item() == pytest.approx((mle + 0.5 * lc) / 5, rel=1e-6)
    assert parts["label_consistency"] == pytest.approx(lc / 5, rel=1e-5)


def test_selective_unlikelihood_with_no_biased_token_is_mle():
    logits, ids, mask = toy()
    assert selective_unlikelihood_loss(logits, ids, mask, torch.zeros_like(ids)).item() == \
        pytest.approx(mle_loss(logits, ids, mask).item(), rel=1e-6)


def test_debias_loss_mle_on_z_plus_alpha_times_l_ul_on_z_minus():
    logits, ids, mask = toy()
    bias = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])  # m_t = 0 on these tokens
    rejected = torch.tensor([0, 1])  # row 0 is in Z(D0), row 1 in Z-(D0)
    # row 0: plain MLE (its bias mask is ignored: it is not a rejected row)
    mle = -(math.log(0.5) + math.log(0.25) + math.log(0.8))
    # row 1: both tokens biased -> unlikelihood on both
    ul = -(math.log(1 - 0.1) + math.log(1 - 0.6))
    for alpha in (1.0, 2.5):
        loss, parts = debias_loss(logits, ids, mask, bias, rejected, alpha=alpha)
        assert loss.item() == pytest.approx((mle + alpha * ul) / 5, rel=1e-6)
    # a Z- row with one biased token: likelihood on the other
    bias1 = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 0]])
    loss, _ = debias_loss(logits, ids, mask, bias1, torch.tensor([1, 1]), alpha=1.0)
    expected = -(math.log(0.5) + math.log(0.25) + math.log(0.8) + math.log(0.1) + math.log(1 - 0.6)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_unlikelihood_of_a_certain_token_is_large_but_finite():
    logits = torch.tensor([[[0.0, 50.0], [0.0, 0.0]]])
    ids = torch.tensor([[0, 1]])
    val = unlikelihood_loss(logits, ids, torch.tensor([[0, 1]]))
    assert torch.isfinite(val) and val.item() > 10


@pytest.fixture(scope="module", params=["gpt2-tokenizer", "smollm2-135m-instruct"])
def tok(request):
    from debiased_nli.methods.generation.models import load_tokenizer
    return load_tokenizer(str(MODELS / request.param))


def test_unlikelihood_mask_covers_exactly_the_biased_tokens(tok):
    fmt = SequenceFormat.for_tokenizer(tok, LABELS)
    premise, hypothesis = "A man in a red hat sleeps on a bench.", "Nobody is sleeping outdoors"
    enc = fmt.encode(tok, premise, "contradiction", hypothesis,
                     biased_features=["nobody@hypothesis", "red hat@premise", "sleeps@hypothesis"])
    text = fmt.text(premise, "contradiction", hypothesis)
    offs = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    biased_words = {w for (s, e), b in zip(offs, enc["bias"]) if b for w in text[s:e].lower().split()}
    assert biased_words == {"nobody", "red", "hat"}  # "sleeps" is not in the hypothesis
    for (s, e), b in zip(offs, enc["bias"]):
        piece = text[s:e].strip().lower()
        if piece in ("nobody", "red", "hat"):
            assert b == 1
        elif b:
            assert piece and piece in "nobody red hat"  # a sub-word piece of a biased word
    # a whole-hypothesis feature marks every hypothesis token and nothing else
    enc2 = fmt.encode(tok, premise, "contradiction", hypothesis, biased_features=["hypo-len<5"])
    assert enc2["bias"] == enc2["hypothesis"] and sum(enc2["bias"]) > 0
    # no feature: nothing biased
    assert sum(fmt.encode(tok, premise, "contradiction", hypothesis)["bias"]) == 0
