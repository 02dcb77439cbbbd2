"""The generator's sequence format: premise, label, hypothesis, an end marker, parsed back."""
import os
from pathlib import Path

import pytest

from debiased_nli.bias.features import tokenize
from debiased_nli.methods.generation import format as F
from debiased_nli.methods.generation.format import SequenceFormat, feature_char_spans, word_spans

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
LABELS = ("entailment", "neutral", "contradiction")
TOKENIZERS = ["gpt2-tokenizer", "smollm2-135m-instruct"]


@pytest.fixture(scope="module", params=TOKENIZERS)
def tok(request):
    from debiased_nli.methods.generation.models import load_tokenizer
    return load_tokenizer(str(MODELS / request.param))


ROWS = [("A man, sleeping in the park.", "neutral", "The man is tired"),
        ("Two dogs run\nthrough snow.", "entailment", "Dogs are outside."),
        ("Nobody's here, 'tis late", "contradiction", "Everybody's here")]


def test_order_is_premise_label_hypothesis_with_the_tokenizers_end_marker(tok):
    fmt = SequenceFormat.for_tokenizer(tok, LABELS)
    text = fmt.text("P.", "neutral", "H.")
    assert text == f"{tok.bos_token or ''}premise: P.\nlabel: neutral\nhypothesis: H.{tok.eos_token}"
    assert text.index("premise:") < text.index("label:") < text.index("hypothesis:")


@pytest.mark.parametrize("premise,label,hypothesis", ROWS)
def test_round_trip_through_the_tokenizer(tok, premise, label, hypothesis):
    fmt = SequenceFormat.for_tokenizer(tok, LABELS)
    enc = fmt.encode(tok, premise, label, hypothesis)
    decoded = tok.decode(enc["input_ids"], skip_special_tokens=False)
    row, why = fmt.parse(decoded)
    assert why is None
    assert row == {"premise": " ".join(premise.split()), "label": label, "hypothesis": hypothesis}


def test_hypothesis_mask_covers_exactly_the_hypothesis_tokens(tok):
    fmt = SequenceFormat.for_tokenizer(tok, LABELS)
    enc = fmt.encode(tok, "A man sleeps.", "neutral", "The man is tired")
    ids = [i for i, h in zip(enc["input_ids"], enc["hypothesis"]) if h]
    assert tok.decode(ids).strip() == "The man is tired"
    assert enc["hypothesis"][-1] == 0  # the end marker is not a hypothesis token


@pytest.mark.parametrize("sample,reason", [
    ("premise: A dog.\nlabel: neutral\nhypothesis: A cat", F.NO_END),
    ("premise: A dog.\nlabel: happy\nhypothesis: A cat.<END>", F.UNKNOWN_LABEL),
    ("premise: A dog.\nhypothesis: A cat.<END>", F.NO_LABEL_MARKER),
    ("premise: A dog.\nlabel: neutral A cat.<END>", F.NO_HYPOTHESIS_MARKER),
    ("premise:  \nlabel: neutral\nhypothesis: A cat.<END>", F.EMPTY_PREMISE),
    ("premise: A dog.\nlabel: neutral\nhypothesis: <END>", F.EMPTY_HYPOTHESIS),
    ("A dog.\nlabel: neutral\nhypothesis: A cat.<END>", F.NO_PREMISE_MARKER),
])
def test_unparseable_samples_get_a_reason(sample, reason):
    fmt = SequenceFormat(LABELS, start="", end="<END>")
    assert fmt.parse(sample) == (None, reason)


def test_text_after_the_end_marker_is_ignored():
    fmt = SequenceFormat(LABELS, start="<s>", end="</s>")
    row, why = fmt.parse("<s>premise: A.\nlabel: entailment\nhypothesis: B.</s></s>premise: junk")
    assert why is None and row == {"premise": "A.", "label": "entailment", "hypothesis": "B."}


@pytest.mark.parametrize("text", ["Nobody's here, 'tis late", "A man--in a RED hat--waves!", "café ÜBER 3.5 kg'",
                                  "''quoted'' words_with_underscore"])
def test_word_spans_follow_the_feature_tokenisation(text):
    assert [w for w, _, _ in word_spans(text)] == tokenize(text)
    assert all(text[s:e].lower() == w for w, s, e in word_spans(text))


def test_feature_spans():
    p, h = "A man sleeps near a man.", "The man is not sleeping"
    assert feature_char_spans("man@hypothesis", p, h) == [("hypothesis", 4, 7)]
    assert feature_char_spans("man@premise", p, h) == [("premise", 2, 5), ("premise", 20, 23)]
    assert feature_char_spans("is not@hypothesis", p, h) == [("hypothesis", 8, 10), ("hypothesis", 11, 14)]
    assert feature_char_spans("not is@hypothesis", p, h) == []
    # length, overlap (v1 bins and v2 thresholds), hypothesis-only and null features: every hypothesis token
    for whole in ("hypo-len5-9", "lex-overlap<0.2", "hypo-only-pred=contradiction", "<null>", "len-ratio<0.25",
                  "lex-overlap>0.5", "lex-overlap>0.9", "full-lex-overlap"):
        assert feature_char_spans(whole, p, h) == [("hypothesis", 0, len(h))]


@pytest.mark.parametrize("premise,label,hypothesis", ROWS)
def test_prompts_are_token_prefixes_of_the_training_sequence(tok, premise, label, hypothesis):
    fmt = SequenceFormat.for_tokenizer(tok, LABELS)
    full = tok(fmt.text(premise, label, hypothesis), add_special_tokens=False)["input_ids"]
    for prompt in (fmt.prompt(), fmt.prompt(premise), fmt.prompt(premise, label)):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        assert full[:len(ids)] == ids, prompt
        assert fmt.parse(prompt + fmt.text(premise, label, hypothesis)[len(prompt):]) == (
            {"premise": " ".join(premise.split()), "label": label, "hypothesis": hypothesis}, None)
