"""Feature-specific masking (Guo et al. 2023, section 3.3.1, Table 9, Table 14).

Section 3.3.1: for p_hat < p0, "x should be retained when masking words. To be specific, for unigrams,
we skip the biased words and randomly mask the rest of the words to a fixed percentage. For lexical
overlap, we retain the overlapped words in the premise and the hypothesis and randomly mask the rest.
For hypothesis-only predictions, we retain the hypothesis and randomly mask the premise." For p_hat >
p0, "x should be eliminated in the masking stage. Specifically, for unigrams, we mask the biased word
and the rest randomly to a fixed percentage. For lexical overlap, we mask the overlapped words and the
rest to a fixed percentage. In terms of the hypothesis-only predictions, we randomly mask the
hypothesis." Table 14's overlap examples mask only shared words (p_hat > p0: "Randomly mask words
shared by P and H") or only unique words (p_hat < p0: "Randomly mask unique words in P and H"); the
rules below follow Table 14.

Masking is word-level: the words are those of :func:`debiased_nli.bias.features.tokenize` (runs of
letters, digits and apostrophes, lower-cased for matching), and each chosen word is replaced by ONE
mask (the fill puts one word back). "All the masking rules derive from a random masking strategy: we
mask the words of the samples to a fixed percentage" (Table 9): a rule masks
k = max(1, round(r * |scope|)) words (round half up), drawn at random from its eligible words.

============  ===============================================  =============================================  ====
family        p_hat > p0: S' must lose x ("lose")              p_hat < p0: S' must keep x ("keep")            r
============  ===============================================  =============================================  ====
unigram       every occurrence of x (premise and hypothesis),  x protected; k of the other words               0.25
              plus random other words up to k                  ("mask the rest")
overlap >t    k of the words shared by P and H (either side)   shared words protected; k of the unique words   0.4
overlap <t    k of the unique words (fills may copy words)     unique words protected; k of the shared words   0.4
hypo_only     k of H's words, P kept ("mask words of H")       k of P's words, H kept ("mask words of P")      0.4
============  ===============================================  =============================================  ====

Ratios: "Masking ratio for unigram 0.25 / Masking ratio for H-only prediction 0.4 / Masking ratio for
lexical overlap 0.4" (Appendix B.1, Table 10). The scopes |scope| are the project's choice (the paper
does not say what the percentage is of): all words of the pair for unigrams, the masked side for
hypothesis-only, the eligible (shared or unique) words for overlap. The rule for a *low*-overlap
feature (QQP's ``lex-overlap<0.8``) is the project's: the paper gives no rule for it; it is the high
rule with shared and unique swapped, so that a lose fill can copy premise words into the hypothesis.
A rule with no eligible word (e.g. keep for an overlap row whose words are all shared) masks nothing:
the operation fails with "nothing to mask".
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from ...utils.errors import ConfigError
from ..generation.format import word_spans
from .zvalue import KEEP, LOSE

UNIGRAM, OVERLAP, HYPO_ONLY = "unigram", "overlap", "hypo_only"
FAMILIES = (UNIGRAM, OVERLAP, HYPO_ONLY)
# Guo et al. 2023, Appendix B.1, Table 10: "Masking ratio for unigram 0.25", "Masking ratio for
# H-only prediction 0.4", "Masking ratio for lexical overlap 0.4"
PAPER_RATIOS = {UNIGRAM: 0.25, OVERLAP: 0.4, HYPO_ONLY: 0.4}
MASK = "\x00MASK\x00"  # placeholder in masked text; a filler swaps in its tokenizer's mask token


@dataclasses.dataclass(frozen=True)
class Word:
    side: str   # "premise" or "hypothesis"
    start: int
    end: int
    form: str   # lower-cased, as features.tokenize gives it


@dataclasses.dataclass(frozen=True)
class MaskedPair:
    """A pair with some words masked; ``fill(words)`` puts one word back per mask, in order."""

    premise: str
    hypothesis: str
    masked: tuple[Word, ...]   # sorted: premise words first, then by position

    @property
    def n_masks(self) -> int:
        return len(self.masked)

    def _side(self, side: str, words: Sequence[str]) -> str:
        text = self.premise if side == "premise" else self.hypothesis
        out, pos = [], 0
        for w, fill in zip(self.masked, words):
            if w.side != side:
                continue
            out.append(text[pos:w.start])
            original = text[w.start:w.end]
            out.append(_match_case(fill, original) if fill != MASK else MASK)
            pos = w.end
        out.append(text[pos:])
        return "".join(out)

    def masked_text(self) -> tuple[str, str]:
        """(premise, hypothesis) with every masked word replaced by :data:`MASK`."""
        fills = [MASK] * self.n_masks
        return self._side("premise", fills), self._side("hypothesis", fills)

    def fill(self, words: Sequence[str]) -> tuple[str, str]:
        if len(words) != self.n_masks:
            raise ValueError(f"{len(words)} fills for {self.n_masks} masks")
        return self._side("premise", words), self._side("hypothesis", words)


def _match_case(fill: str, original: str) -> str:
    """A fill for a capitalised word is capitalised (uncased MLMs fill lower case)."""
    if original[:1].isupper() and fill[:1].islower():
        return fill[:1].upper() + fill[1:]
    return fill


def pair_words(premise: str, hypothesis: str) -> list[Word]:
    return [Word(side, s, e, form) for side, text in (("premise", premise), ("hypothesis", hypothesis))
            for form, s, e in word_spans(text)]


def mask_count(ratio: float, scope: int) -> int:
    """k = max(1, round(ratio * scope)), rounding half up; 0 when the scope is empty."""
    if scope <= 0:
        return 0
    return max(1, int(math.floor(ratio * scope + 0.5)))


def overlap_direction(feature: str) -> str:
    """'high' for a feature like ``lex-overlap>0.8``, 'low' for ``lex-overlap<0.8``."""
    if ">" in feature:
        return "high"
    if "<" in feature:
        return "low"
    raise ConfigError(f"overlap feature {feature!r} must say > or < (e.g. lex-overlap>0.8)")


def unigram_word(feature: str) -> str:
    word, at, tag = feature.rpartition("@")
    if not at or not word:
        raise ConfigError(f"a unigram feature looks like '<word>@pair', got {feature!r}")
    return word


def mask_pair(family: str, case: str, feature: str, premise: str, hypothesis: str, ratio: float,
              rng: np.random.Generator) -> MaskedPair:
    """Apply the family's rule for ``case`` (keep / lose) to one pair (see the module docstring)."""
    if case not in (KEEP, LOSE):
        raise ConfigError(f"case must be {KEEP!r} or {LOSE!r}, got {case!r}")
    words = pair_words(premise, hypothesis)
    must: list[int] = []
    if family == UNIGRAM:
        x = unigram_word(feature)
        hits = [i for i, w in enumerate(words) if w.form == x]
        others = [i for i, w in enumerate(words) if w.form != x]
        k = mask_count(ratio, len(words))
        if case == LOSE:
            must, eligible, k = hits, others, max(0, k - len(hits))
        else:
            eligible = others
    elif family == OVERLAP:
        shared_forms = {w.form for w in words if w.side == "premise"} & {w.form for w in words if w.side == "hypothesis"}
        shared = [i for i, w in enumerate(words) if w.form in shared_forms]
        unique = [i for i, w in enumerate(words) if w.form not in shared_forms]
        high = overlap_direction(feature) == "high"
        eligible = (shared if case == LOSE else unique) if high else (unique if case == LOSE else shared)
        k = mask_count(ratio, len(eligible))
    elif family == HYPO_ONLY:
        side = "hypothesis" if case == LOSE else "premise"
        eligible = [i for i, w in enumerate(words) if w.side == side]
        k = mask_count(ratio, len(eligible))
    else:
        raise ConfigError(f"unknown PDD feature family {family!r}; known: {list(FAMILIES)}")
    k = min(k, len(eligible))
    chosen = list(must)
    if k > 0:
        chosen += [eligible[i] for i in rng.choice(len(eligible), size=k, replace=False)]
    return MaskedPair(premise, hypothesis, tuple(words[i] for i in sorted(set(chosen))))
