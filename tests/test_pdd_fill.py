"""Label-prompted filling with any masked LM (Guo et al. 2023, section 3.3.2), on tiny models from a config."""
import numpy as np
import pytest
import torch

from debiased_nli.utils.errors import ConfigError
from debiased_nli.methods.pdd.fill import (FillRequest, MaskFiller, _scheme, fill_vocabulary, prompt_text,
                                           prompt_words_for, token_words)
from debiased_nli.methods.pdd.masking import MASK, UNIGRAM, mask_pair
from debiased_nli.methods.pdd.zvalue import LOSE
from debiased_nli.methods.pdd.teacher import Teacher
from pdd_helpers import LABELS, tiny_classifier, tiny_mlm, tiny_tokenizer

TEXTS = ["A man is playing a guitar in a park.", "Nobody is playing a guitar.", "A woman is reading outdoors.",
         "The dog runs on the beach for a competition."]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(TEXTS)


def test_prompt_is_p_question_word_dot_h_with_the_papers_words():
    words = prompt_words_for(LABELS)
    assert words == {"entailment": "Yes", "neutral": "Maybe", "contradiction": "No"}
    assert prompt_text("A man sleeps.", words["contradiction"], "A man runs.") == "A man sleeps. ? No . A man runs."
    assert prompt_words_for(["SUPPORTS", "REFUTES", "NOT ENOUGH INFO"])["REFUTES"] == "No"
    with pytest.raises(ConfigError, match="no prompt word"):
        prompt_words_for(["entailment", "other"])
    assert prompt_words_for(["a", "b"], {"a": "Yes", "b": "No"}) == {"a": "Yes", "b": "No"}


def test_fill_vocabulary_is_whole_alphabetic_words(tok):
    allowed = fill_vocabulary(tok)
    vocab = tok.get_vocab()
    assert allowed[vocab["guitar"]] and allowed[vocab["red"]]
    assert not allowed[vocab["[MASK]"]] and not allowed[vocab["."]] and not allowed[vocab["?"]]
    assert _scheme(["▁the", "▁a", "s", "▁dog"]) == "sentencepiece"
    assert _scheme(["Ġthe", "Ġa", "s", "Ġdog"]) == "bytebpe"
    assert _scheme(["the", "##s", "dog"]) == "wordpiece"


def _filler_with_bias(tok, favourite, candidates=4):
    """A stub MLM: the tiny model with its output bias making ``favourite`` win every mask."""
    model = tiny_mlm(tok)
    with torch.no_grad():
        model.cls.predictions.bias.zero_()
        model.cls.predictions.bias[tok.get_vocab()[favourite]] = 100.0
    return MaskFiller(model, tok, candidates=candidates)


def test_argmax_candidate_is_the_models_choice_at_every_mask(tok):
    filler = _filler_with_bias(tok, "red")
    req = FillRequest(f"A man is {MASK} a guitar.", f"{MASK} is playing.", 2, "Yes", seed=0)
    (cands,) = filler.fill([req])
    assert cands[0] == ["red", "red"]
    mp = mask_pair(UNIGRAM, LOSE, "playing@pair", "A man is playing a guitar.", "Nobody is playing.", 0.0,
                   np.random.default_rng(0))
    assert mp.fill(cands[0]) == ("A man is red a guitar.", "Nobody is red.")


def test_banned_words_never_fill_a_mask(tok):
    filler = _filler_with_bias(tok, "nobody", candidates=8)
    for seed in range(10):
        req = FillRequest(f"{MASK} is playing a {MASK}.", f"{MASK} runs.", 3, "No", seed=seed, banned=("nobody",))
        (cands,) = filler.fill([req])
        assert cands and all("nobody" not in c for c in cands)
        assert all(w is not None and w.isalpha() for c in cands for w in c)


def test_candidates_are_distinct_seeded_and_independent_of_the_batch(tok):
    filler = MaskFiller(tiny_mlm(tok), tok, candidates=6)
    reqs = [FillRequest(f"A man is {MASK} a {MASK}.", f"{MASK} is playing.", 3, w, seed=s)
            for s, w in enumerate(["Yes", "Maybe", "No", "Yes"])]
    together = filler.fill(reqs)
    alone = [filler.fill([r])[0] for r in reqs]
    assert together == alone
    for c in together:
        assert len({tuple(x) for x in c}) == len(c) >= 1


def test_head_on_masked_positions_equals_the_full_logits(tok):
    model = tiny_mlm(tok)
    filler = MaskFiller(model, tok)
    enc = tok([prompt_text("A man is [MASK] a guitar .", "Yes", "[MASK] is playing .")], return_tensors="pt")
    pos = enc["input_ids"] == tok.mask_token_id
    with torch.no_grad():
        fast = filler._mask_logits(dict(enc), pos)
        full = model(**enc).logits[pos]
    torch.testing.assert_close(fast, full)


def test_a_truncated_prompt_is_reported_not_filled(tok):
    filler = MaskFiller(tiny_mlm(tok), tok, max_length=8)
    req = FillRequest("a man is playing a guitar in a park " + MASK, MASK, 2, "Yes", seed=0)
    assert filler.fill([req]) == [None]


def test_teacher_scores_pairs_in_the_tasks_label_order(tok):
    model = tiny_classifier(tok, labels=("contradiction", "entailment", "neutral"))
    teacher = Teacher(model, LABELS, tokenizer=tok, batch_size=2)
    P, H = TEXTS[:3], TEXTS[1:4]
    probs = teacher.label_probs(P, H)
    with torch.no_grad():
        ref = torch.softmax(model(**tok(P, H, padding=True, return_tensors="pt")).logits, -1).numpy()
    np.testing.assert_allclose(probs, ref[:, [1, 2, 0]], atol=1e-5)


def test_a_model_without_a_mask_token_is_refused(tok):
    from transformers import AutoTokenizer
    from pathlib import Path
    gpt2 = AutoTokenizer.from_pretrained(str(Path.home() / ".cache/debiased-nli/models/gpt2-tokenizer"))
    with pytest.raises(ConfigError, match="mask token"):
        MaskFiller(tiny_mlm(tok), gpt2)
