"""Feature-specific masking (Guo et al. 2023, section 3.3.1, Table 9) on the paper's Table 14 examples."""
import numpy as np
import pytest

from debiased_nli.bias.features import tokenize
from debiased_nli.methods.pdd.masking import (HYPO_ONLY, MASK, OVERLAP, PAPER_RATIOS, UNIGRAM, mask_count, mask_pair,
                                              pair_words)
from debiased_nli.methods.pdd.zvalue import KEEP, LOSE

# Table 14 (MNLI)
NOBODY = ("It's kind of strange here the way things go uh here if you have an accident and no one's injured the "
          "police won't even show up.", "The police don't show up if nobody is hurt.")
CARRY = ("One of our number will carry out your instructions minutely.",
         "A member of our team will execute your orders with great precision.")
MULLER = ("Muller and most of his staff can be expecteded not to cause any more of the usual mid-night disturbances",
          "Muller will most likely cause more trouble.")
WALKMAN = ("My walkman broke so i'm upset now i just have to turn the stereo up real loud.",
           "I'm upset because my walkman broken and now I have to turn the stereo up really loud.")
BETTY = ("She had come to know Betty Currie very well.", "She had come to quite dislike Betty Currie.")
PACE = ("They were pushing the pace all right.", "They were pushing the pace.")


def masked_words(mp):
    return [(w.side, w.form) for w in mp.masked]


def test_paper_ratios_are_table_10():
    assert PAPER_RATIOS == {UNIGRAM: 0.25, OVERLAP: 0.4, HYPO_ONLY: 0.4}
    assert mask_count(0.25, 10) == 3 and mask_count(0.25, 2) == 1 and mask_count(0.4, 5) == 2 and mask_count(0.4, 0) == 0


@pytest.mark.parametrize("seed", range(20))
def test_unigram_keep_preserves_nobody_and_masks_a_quarter_of_the_rest(seed):
    """'Preserve nobody, randomly mask other words' (x = nobody, p_hat(l|x) < 1/3)."""
    mp = mask_pair(UNIGRAM, KEEP, "nobody@pair", *NOBODY, 0.25, np.random.default_rng(seed))
    n_words = len(pair_words(*NOBODY))
    assert "nobody" not in [f for _, f in masked_words(mp)]
    assert mp.n_masks == mask_count(0.25, n_words) == round(0.25 * n_words)
    _, h = mp.masked_text()
    assert "nobody" in h


@pytest.mark.parametrize("seed", range(20))
def test_unigram_lose_always_masks_carry_plus_random_words(seed):
    """'Mask carry, randomly mask other words' (x = carry, p_hat(l|x) > 1/3): carry is only in the premise."""
    mp = mask_pair(UNIGRAM, LOSE, "carry@pair", *CARRY, 0.25, np.random.default_rng(seed))
    assert ("premise", "carry") in masked_words(mp)
    assert mp.n_masks == mask_count(0.25, len(pair_words(*CARRY)))
    p, _ = mp.masked_text()
    assert "carry" not in p and MASK in p


def test_unigram_lose_masks_every_occurrence_even_beyond_the_ratio():
    mp = mask_pair(UNIGRAM, LOSE, "the@pair", "the the the the dog", "the cat", 0.25, np.random.default_rng(0))
    assert sum(f == "the" for _, f in masked_words(mp)) == 5 and mp.n_masks == 5


@pytest.mark.parametrize("seed", range(20))
def test_hypothesis_only_keep_masks_only_the_premise(seed):
    """'Preserve H, randomly mask P' (prediction entailment, p_hat < 1/3)."""
    mp = mask_pair(HYPO_ONLY, KEEP, "hypo-only-pred=entailment", *MULLER, 0.4, np.random.default_rng(seed))
    n_p = len([w for w in pair_words(*MULLER) if w.side == "premise"])
    assert {s for s, _ in masked_words(mp)} == {"premise"} and mp.n_masks == mask_count(0.4, n_p)
    assert mp.masked_text()[1] == MULLER[1]


@pytest.mark.parametrize("seed", range(20))
def test_hypothesis_only_lose_masks_only_the_hypothesis(seed):
    """'Preserve P, randomly mask H' (prediction entailment, p_hat > 1/3)."""
    mp = mask_pair(HYPO_ONLY, LOSE, "hypo-only-pred=entailment", *WALKMAN, 0.4, np.random.default_rng(seed))
    n_h = len(tokenize(WALKMAN[1]))
    assert {s for s, _ in masked_words(mp)} == {"hypothesis"} and mp.n_masks == mask_count(0.4, n_h)
    assert mp.masked_text()[0] == WALKMAN[0]


@pytest.mark.parametrize("seed", range(20))
def test_overlap_keep_masks_only_unique_words(seed):
    """'Randomly mask unique words in P and H' (overlap > 0.8, p_hat < 1/3)."""
    mp = mask_pair(OVERLAP, KEEP, "lex-overlap>0.8", *BETTY, 0.4, np.random.default_rng(seed))
    unique = {"know", "very", "well", "quite", "dislike"}
    assert {f for _, f in masked_words(mp)} <= unique and mp.n_masks == mask_count(0.4, 5)


@pytest.mark.parametrize("seed", range(20))
def test_overlap_lose_masks_only_shared_words(seed):
    """'Randomly mask words shared by P and H' (overlap > 0.8, p_hat > 1/3); the paper's example masks
    pushing in P and were, pace in H: shared words on either side."""
    mp = mask_pair(OVERLAP, LOSE, "lex-overlap>0.8", *PACE, 0.4, np.random.default_rng(seed))
    shared = {"they", "were", "pushing", "the", "pace"}
    assert {f for _, f in masked_words(mp)} <= shared and mp.n_masks == mask_count(0.4, 10)


def test_low_overlap_feature_swaps_shared_and_unique():
    lose = mask_pair(OVERLAP, LOSE, "lex-overlap<0.8", *BETTY, 0.4, np.random.default_rng(0))
    keep = mask_pair(OVERLAP, KEEP, "lex-overlap<0.8", *BETTY, 0.4, np.random.default_rng(0))
    assert {f for _, f in masked_words(lose)} <= {"know", "very", "well", "quite", "dislike"}
    assert {f for _, f in masked_words(keep)} <= {"she", "had", "come", "to", "betty", "currie"}


def test_a_rule_with_nothing_eligible_masks_nothing():
    mp = mask_pair(OVERLAP, KEEP, "lex-overlap>0.8", "a dog runs", "a dog runs", 0.4, np.random.default_rng(0))
    assert mp.n_masks == 0


def test_fill_puts_words_back_in_place_and_keeps_capitals():
    mp = mask_pair(HYPO_ONLY, LOSE, "hypo-only-pred=entailment", *PACE, 1.0, np.random.default_rng(0))
    original = [PACE[1][w.start:w.end] for w in mp.masked]
    assert mp.fill(original) == PACE  # the identity fill round-trips, punctuation and spacing kept
    p, h = mp.fill(["these", "are", "pulling", "a", "rope"])
    assert p == PACE[0] and h == "These are pulling a rope."


@pytest.mark.parametrize("seed", range(5))
def test_masking_is_seeded(seed):
    a = mask_pair(UNIGRAM, KEEP, "nobody@pair", *NOBODY, 0.25, np.random.default_rng(seed))
    b = mask_pair(UNIGRAM, KEEP, "nobody@pair", *NOBODY, 0.25, np.random.default_rng(seed))
    assert a == b
