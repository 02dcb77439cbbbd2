"""The generator's sequence format (Wu et al. 2022, section 3): premise, label, hypothesis, in that order.

One row of a task becomes one text::

    {start}premise: {P}\\nlabel: {l}\\nhypothesis: {H}{end}

``start`` is the tokenizer's BOS token (empty when it has none), ``end`` (the end marker) is its
EOS token (GPT-2 ``<|endoftext|>``, SmolLM2 ``<|im_end|>``; the literal ``\\n<|end|>`` when a tokenizer
has no EOS). ``l`` is the task's label name. Newlines inside P and H are replaced by spaces so the
markers are unambiguous. A sample is parsed back by cutting at the first end marker and splitting at
the first ``\\nlabel: `` and ``\\nhypothesis: ``; a sample without end marker (it hit the length limit),
with a missing marker, an unknown label or an empty premise/hypothesis is *unparseable*, and the
reason is returned, never guessed.

Encoding works with any fast tokenizer (GPT-2 byte-level BPE, LLaMA/SmolLM2 BPE, SentencePiece): the
text is tokenised once with ``return_offsets_mapping`` and a token belongs to a field when its
character span overlaps the field's span (a token `` A`` that carries the space before the hypothesis
is a hypothesis token).

The debiasing fine-tune (G*) needs, for every row of Z-(D0), the tokens that *carry* the row's biased
features (:func:`biased_token_mask`): a unigram/bigram feature ``w@hypothesis`` / ``a b@premise`` is
located in its side with the word rules of :func:`debiased_nli.bias.features.tokenize` (lower-cased runs
of letters, digits and apostrophes, apostrophes at the ends dropped), every occurrence is marked, and
the tokens overlapping those words' characters are the biased tokens. Any other feature (hypothesis
length, length ratio, lexical overlap, hypothesis-only prediction, ``<null>``) is a property of the
whole hypothesis, so every hypothesis token carries it.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import numpy as np

from ...utils.errors import ConfigError

PREMISE_MARKER = "premise: "
LABEL_MARKER = "\nlabel: "
HYPOTHESIS_MARKER = "\nhypothesis: "
FALLBACK_END = "\n<|end|>"

# the reasons a sample is unparseable
NO_END = "no end marker (length limit reached)"
NO_PREMISE_MARKER = "no premise marker"
NO_LABEL_MARKER = "no label marker"
NO_HYPOTHESIS_MARKER = "no hypothesis marker"
UNKNOWN_LABEL = "unknown label"
EMPTY_PREMISE = "empty premise"
EMPTY_HYPOTHESIS = "empty hypothesis"

# a word of debiased_nli.bias.features.tokenize: a run of letters, digits and apostrophes
_WORD = re.compile(r"(?:[^\W_]|')+")


def _clean(text: str) -> str:
    return " ".join(str(text).replace("\r", " ").replace("\n", " ").split(" ")).strip()



def label_name(labels: Sequence[str], label: Any) -> str:
    """A label given by index or by name, as its name (an unknown name is an error)."""
    if isinstance(label, (int, np.integer)):
        return labels[int(label)]
    if label not in labels:
        raise ConfigError(f"label {label!r} is not one of {list(labels)}")
    return str(label)

@dataclasses.dataclass(frozen=True)
class SequenceFormat:
    """``premise, label, hypothesis`` sequences for one tokenizer and one label set."""

    labels: tuple[str, ...]
    start: str = ""
    end: str = FALLBACK_END

    @classmethod
    def for_tokenizer(cls, tokenizer, labels: Sequence[str]) -> "SequenceFormat":
        return cls(tuple(labels), start=tokenizer.bos_token or "", end=tokenizer.eos_token or FALLBACK_END)

    # ---- text ----------------------------------------------------------------------------
    def prompt(self, premise: str | None = None, label: str | None = None) -> str:
        """The generation prompt: the start and the premise marker (optionally a given premise and label),
        without the marker's trailing space, so that its tokens are a prefix of the training sequence's."""
        text = self.start + PREMISE_MARKER
        if premise is not None:
            text += _clean(premise) + LABEL_MARKER
            if label is not None:
                text += self._label(label) + HYPOTHESIS_MARKER
        elif label is not None:
            raise ConfigError("a prompt with a label needs a premise too (the order is premise, label, hypothesis)")
        # no trailing space: in training the space before a field is part of its first token (" A"),
        # so a prompt ending in " " would put the model off its training distribution
        return text[:-1] if text.endswith(" ") else text

    def _label(self, label: Any) -> str:
        return label_name(self.labels, label)

    def spans(self, premise: str, label: Any, hypothesis: str) -> tuple[str, dict[str, tuple[int, int]]]:
        """The sequence text and the character span of each field (premise, label, hypothesis, end)."""
        p, h, lab = _clean(premise), _clean(hypothesis), self._label(label)
        parts = [(None, self.start + PREMISE_MARKER), ("premise", p), (None, LABEL_MARKER), ("label", lab),
                 (None, HYPOTHESIS_MARKER), ("hypothesis", h), ("end", self.end)]
        text, spans = "", {}
        for name, piece in parts:
            if name:
                spans[name] = (len(text), len(text) + len(piece))
            text += piece
        return text, spans

    def text(self, premise: str, label: Any, hypothesis: str) -> str:
        return self.spans(premise, label, hypothesis)[0]

    def parse(self, sample: str) -> tuple[dict[str, str] | None, str | None]:
        """A generated text -> ({premise, label, hypothesis}, None) or (None, reason)."""
        text = sample
        if self.start and text.startswith(self.start):
            text = text[len(self.start):]
        cut = text.find(self.end)
        if cut < 0:
            return None, NO_END
        text = text[:cut]
        # markers are matched without their trailing space (a sample may end right after "hypothesis:")
        if not text.startswith(PREMISE_MARKER.rstrip(" ")):
            return None, NO_PREMISE_MARKER
        text = text[len(PREMISE_MARKER.rstrip(" ")):]
        premise, sep, rest = text.partition(LABEL_MARKER.rstrip(" "))
        if not sep:
            return None, NO_LABEL_MARKER
        label, sep, hypothesis = rest.partition(HYPOTHESIS_MARKER.rstrip(" "))
        if not sep:
            return None, NO_HYPOTHESIS_MARKER
        label = label.strip()
        if label not in self.labels:
            return None, UNKNOWN_LABEL
        premise, hypothesis = premise.strip(), hypothesis.strip()
        if not premise:
            return None, EMPTY_PREMISE
        if not hypothesis:
            return None, EMPTY_HYPOTHESIS
        return {"premise": premise, "label": label, "hypothesis": hypothesis}, None

    # ---- tokens --------------------------------------------------------------------------
    def encode(self, tokenizer, premise: str, label: Any, hypothesis: str,
               biased_features: Sequence[str] = ()) -> dict[str, list[int]]:
        """Token ids of one row and, per token, whether it is a hypothesis token and whether it
        carries one of ``biased_features`` (``bias``: 1 there, the ``1 - m_t`` of L_UL)."""
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{type(tokenizer).__name__} is not a fast tokenizer; character offsets "
                              f"(return_offsets_mapping) need one: load it with use_fast=True")
        text, spans = self.spans(premise, label, hypothesis)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        char_bias = np.zeros(len(text) + 1, dtype=bool)
        p0, h0 = spans["premise"][0], spans["hypothesis"][0]
        p_text, h_text = text[slice(*spans["premise"])], text[slice(*spans["hypothesis"])]
        for feat in biased_features:
            for side, s, e in feature_char_spans(feat, p_text, h_text):
                base = p0 if side == "premise" else h0
                char_bias[base + s: base + e] = True
        return {
            "input_ids": list(enc["input_ids"]),
            "hypothesis": _overlaps(offsets, *spans["hypothesis"]).astype(int).tolist(),
            "bias": _covers(offsets, char_bias).astype(int).tolist(),
        }


def _overlaps(offsets: np.ndarray, start: int, end: int) -> np.ndarray:
    return (offsets[:, 0] < end) & (offsets[:, 1] > start) & (offsets[:, 1] > offsets[:, 0])


def _covers(offsets: np.ndarray, char_mask: np.ndarray) -> np.ndarray:
    """Tokens whose character span contains at least one marked character."""
    csum = np.concatenate([[0], np.cumsum(char_mask)])
    return (csum[offsets[:, 1]] - csum[offsets[:, 0]]) > 0


def word_spans(text: str) -> list[tuple[str, int, int]]:
    """The words of ``debiased_nli.bias.features.tokenize`` with their character spans in ``text``."""
    out = []
    for m in _WORD.finditer(text):
        s, e = m.start(), m.end()
        while s < e and text[s] == "'":
            s += 1
        while e > s and text[e - 1] == "'":
            e -= 1
        if e > s:
            out.append((text[s:e].lower(), s, e))
    return out


def feature_char_spans(feature: str, premise: str, hypothesis: str) -> list[tuple[str, int, int]]:
    """(side, start, end) of the characters that carry ``feature`` in a row.

    ``w@side`` / ``a b@side``: every occurrence of the n-gram's words in that side (adjacent words,
    as the bigram extractor counts them). Every other feature: the whole hypothesis.
    """
    ngram, at, side = feature.rpartition("@")
    if at and side in ("premise", "hypothesis") and ngram:
        words = ngram.split(" ")
        toks = word_spans(premise if side == "premise" else hypothesis)
        out = []
        for i in range(len(toks) - len(words) + 1):
            if all(toks[i + j][0] == w for j, w in enumerate(words)):
                out.extend((side, toks[i + j][1], toks[i + j][2]) for j in range(len(words)))
        return out
    return [("hypothesis", 0, len(hypothesis))] if hypothesis else []
