"""Tiny models and stand-ins for the PDD tests (built from configs; nothing is downloaded)."""
from __future__ import annotations

import numpy as np

LABELS = ("entailment", "neutral", "contradiction")


def tiny_tokenizer(texts):
    """A WordLevel tokenizer over the words of ``texts`` (lower-cased), with BERT's special tokens."""
    import re

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = set()
    for t in texts:
        words.update(re.findall(r"\w+|[^\w\s]+", t.lower()))
    words.update(["yes", "maybe", "no", "?", ".", "red", "blue", "green"])
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def tiny_mlm(tok, seed=0):
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=256)
    return BertForMaskedLM(cfg).eval()


def tiny_classifier(tok, labels=LABELS, seed=0):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=256, num_labels=len(labels),
                     id2label=dict(enumerate(labels)), label2id={l: i for i, l in enumerate(labels)})
    return BertForSequenceClassification(cfg).eval()


class NonceFiller:
    """A filler that always produces candidates: every mask gets a fresh nonce word (seeded by the request)."""

    def __init__(self, candidates=3):
        self.candidates = candidates

    def fill(self, requests):
        out = []
        for r in requests:
            rng = np.random.default_rng(r.seed)
            out.append([[f"w{int(rng.integers(10**9))}" for _ in range(r.n_masks)] for _ in range(self.candidates)])
        return out


class WordFiller:
    """Fills every mask with the same given word (to test the containment check)."""

    def __init__(self, word):
        self.word = word

    def fill(self, requests):
        return [[[self.word] * r.n_masks] for r in requests]


class HashTeacher:
    """p(label) from a hash of the pair: deterministic, different per candidate."""

    def __init__(self, K=3):
        self.K = K

    def label_probs(self, premises, hypotheses):
        import hashlib
        out = np.zeros((len(premises), self.K))
        for i, (p, h) in enumerate(zip(premises, hypotheses)):
            d = hashlib.sha256(f"{p}|{h}".encode()).digest()
            v = np.array([d[j] + 1 for j in range(self.K)], dtype=float)
            out[i] = v / v.sum()
        return out
