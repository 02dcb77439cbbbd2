"""Label-prompted filling with any masked LM (Guo et al. 2023, section 3.3.2 "Prompt-Based Filling").

"We map 'entailment' to 'Yes', 'neutral' to 'Maybe', and 'contradiction' to 'No'. We feed the
connected input 'P_mask ?[w]. H_mask' into the MLM". The input here is ``f"{P_mask} ? {w} . {H_mask}"``
(the spacing is the project's choice), every mask one ``tokenizer.mask_token``, encoded in one piece
and filled in one forward pass (all masks at once; the paper does not say whether it fills
iteratively). Candidates ("For each masked sample, we generate various candidates", the number is not
given; default 8, the project's choice): candidate 1 is the argmax at every mask; each further one
samples every mask from its top-10 tokens (probabilities renormalised over those 10), with a seeded
generator per request, so a request's candidates do not depend on the batch it is in. Duplicate
candidates are dropped. Only *fill tokens* may be chosen: tokens that start a word and spell an
alphabetic word (WordPiece: not ``##``; SentencePiece: ``▁`` prefix; byte-level BPE: ``Ġ`` prefix),
never special tokens, so that one mask becomes one whole word. A request may ban words (the unigram
lose case bans x itself).

:class:`MaskFiller` works with any ``AutoModelForMaskedLM`` (the paper's is ``xlm-roberta-large``).
For speed it projects only the masked positions onto the vocabulary when the model exposes its head
(``cls`` for BERT, ``lm_head`` for RoBERTa/XLM-R); otherwise it reads the full logits. Engines (the
same candidates; the forward pass differs only in float rounding in the last bits, see teacher.py):
``packed`` (BERT masked LMs: prompts tokenised once without padding, the encoder run on the packed
tokens and its last layer only at the masks, encoder.py), ``bucketed`` (any model: its own forward
pass on groups of prompts of exactly the same token length) and ``padded`` (the straightforward
reference: batches sorted by character length, padded to their longest); ``auto`` picks ``packed``
where it can, else ``padded``. The packed engine does not run a prompt that lost masks to truncation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from ...utils.errors import ConfigError
from .masking import MASK

# Guo et al. 2023, section 3.3.2: "We map 'entailment' to 'Yes', 'neutral' to 'Maybe', and
# 'contradiction' to 'No'". FEVER and QQP words are the project's choice (the paper gives none).
DEFAULT_PROMPT_WORDS = {
    "entailment": "Yes", "neutral": "Maybe", "contradiction": "No",
    "SUPPORTS": "Yes", "REFUTES": "No", "NOT ENOUGH INFO": "Maybe",
    "duplicate": "Yes", "not_duplicate": "No",
}
TOP_K_SAMPLING = 10  # the project's choice: candidates 2.. sample each mask from its top-10 fill tokens
ENGINES = ("auto", "packed", "bucketed", "padded")
HEAD_ROWS = 1024     # masked positions projected onto the vocabulary at a time (bounds the logits held)


def prompt_words_for(labels: Sequence[str], given: Mapping[str, str] | None = None) -> dict[str, str]:
    """The prompt word of every label: ``given`` first, then the defaults; an unknown label is an error."""
    out = {}
    for name in labels:
        word = (given or {}).get(name, DEFAULT_PROMPT_WORDS.get(name))
        if not word:
            raise ConfigError(f"no prompt word for label {name!r}; pass prompt_words (e.g. "
                              f"--prompt-words {name}=Yes,...)")
        out[name] = str(word)
    return out


def prompt_text(premise_masked: str, word: str, hypothesis_masked: str) -> str:
    return f"{premise_masked} ? {word} . {hypothesis_masked}"


@dataclasses.dataclass(frozen=True)
class FillRequest:
    premise_masked: str      # with masking.MASK placeholders
    hypothesis_masked: str
    n_masks: int
    prompt_word: str
    seed: int
    banned: tuple[str, ...] = ()


def _scheme(tokens: Sequence[str]) -> str:
    if sum(t.startswith("▁") for t in tokens) > len(tokens) // 10:
        return "sentencepiece"
    if sum(t.startswith("Ġ") for t in tokens) > len(tokens) // 10:
        return "bytebpe"
    return "wordpiece"


def token_words(tokenizer) -> list[str | None]:
    """For every token id, the whole word it spells when it can fill a mask, else None."""
    n = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    tokens = [t if isinstance(t, str) else "" for t in tokens]
    scheme = _scheme(tokens)
    special = set(tokenizer.all_special_ids)
    out: list[str | None] = []
    for i, t in enumerate(tokens):
        word = None
        if i not in special:
            if scheme == "sentencepiece":
                word = t[1:] if t.startswith("▁") else None
            elif scheme == "bytebpe":
                word = t[1:] if t.startswith("Ġ") else None
            else:
                word = None if t.startswith("##") else t
        out.append(word if word and word.isalpha() else None)
    return out


def fill_vocabulary(tokenizer) -> np.ndarray:
    """Boolean mask over token ids: the tokens a fill may use (see the module docstring)."""
    return np.array([w is not None for w in token_words(tokenizer)], dtype=bool)


class MaskFiller:
    """Fill :class:`FillRequest` s with a masked LM: per request, up to ``candidates`` word lists."""

    def __init__(self, model: Any, tokenizer: Any, *, candidates: int = 8, batch_size: int = 32,
                 max_length: int = 256, device: str | None = None, engine: str = "auto", dtype: str = "float32"):
        import torch

        from .encoder import DTYPES, supports

        if engine not in ENGINES:
            raise ConfigError(f"unknown fill engine {engine!r}; known: {list(ENGINES)}")
        if dtype not in DTYPES:
            raise ConfigError(f"unknown fill dtype {dtype!r}; known: {list(DTYPES)}")
        self.dtype = dtype
        if tokenizer.mask_token is None:
            raise ConfigError("the fill model's tokenizer has no mask token; PDD needs a masked LM")
        if candidates < 1:
            raise ConfigError(f"candidates must be >= 1, got {candidates}")
        self.model, self.tokenizer = model, tokenizer
        self.candidates, self.batch_size, self.max_length = candidates, batch_size, max_length
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        self.words = token_words(tokenizer)
        allowed = np.array([w is not None for w in self.words], dtype=bool)
        vocab_size = int(getattr(model.config, "vocab_size", len(allowed)))
        if vocab_size > len(allowed):
            allowed = np.concatenate([allowed, np.zeros(vocab_size - len(allowed), bool)])
            self.words = self.words + [None] * (vocab_size - len(self.words))
        if not allowed.any():
            raise ConfigError("the fill model's vocabulary has no whole-word alphabetic token")
        self.allowed = torch.tensor(allowed[:vocab_size])
        self._word_ids: dict[str, list[int]] = {}
        for i, w in enumerate(self.words):
            if w is not None:
                self._word_ids.setdefault(w.lower(), []).append(i)
        packable = (type(model).__name__ == "BertForMaskedLM" and supports(model)
                    and type(getattr(model, "cls", None)).__name__ == "BertOnlyMLMHead")
        if engine == "packed" and not packable:
            raise ConfigError(f"the packed fill engine needs a BERT masked LM (BertForMaskedLM); "
                              f"{type(model).__name__} is not one: use engine 'bucketed' or 'auto'")
        self.engine = ("packed" if packable else "padded") if engine == "auto" else engine
        self._packed = None
        if self.engine == "packed":
            from .encoder import PackedBert
            self._packed = PackedBert(model, max_tokens=max(1, batch_size) * max(1, max_length))

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "MaskFiller":
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        try:
            model = AutoModelForMaskedLM.from_pretrained(path)
            tok = AutoTokenizer.from_pretrained(path)
        except OSError as err:
            raise ConfigError(f"cannot load a masked LM from {path!r} ({err}); give a Hub id (the paper's is "
                              f"xlm-roberta-large) or a folder with an AutoModelForMaskedLM") from err
        return cls(model, tok, **kwargs)

    def describe(self) -> dict:
        """The filler's identity in a run's checkpoint (run.json). The engine is not part of it: engines
        differ only in float rounding, so a run started with one may be continued with another."""
        out = {"model": type(self.model).__name__, "name_or_path": getattr(self.model, "name_or_path", None),
               "candidates": self.candidates, "top_k_sampling": TOP_K_SAMPLING}
        if self.dtype != "float32":  # changes the fills (encoder.DTYPES); float32 runs keep their old identity
            out["dtype"] = self.dtype
        return out

    def _mask_logits(self, enc, positions):
        head = getattr(self.model, "cls", None) or getattr(self.model, "lm_head", None)
        base = getattr(self.model, "base_model", None)
        if head is not None and base is not None and base is not self.model:
            hidden = base(**enc).last_hidden_state
            return head(hidden[positions])
        return self.model(**enc).logits[positions]

    def _prompts(self, requests: Sequence[FillRequest]) -> list[str]:
        mask = self.tokenizer.mask_token
        return [prompt_text(r.premise_masked.replace(MASK, mask), r.prompt_word, r.hypothesis_masked.replace(MASK, mask))
                for r in requests]

    def _allowed_logits(self, logits):
        logits = logits.float().cpu()
        return logits[:, : len(self.allowed)].masked_fill(~self.allowed[: logits.shape[1]], float("-inf"))

    def fill(self, requests: Sequence[FillRequest]) -> list[list[list[str]] | None]:
        """Per request: the distinct candidates (each a word per mask), or None if the prompt lost masks
        to truncation."""
        from .encoder import compute_context

        with compute_context(self.device, self.dtype):
            return self._fill(requests)

    def _fill(self, requests: Sequence[FillRequest]) -> list[list[list[str]] | None]:
        import torch

        if self.engine == "padded":
            return self._fill_padded(requests)
        out: list[list[list[str]] | None] = [None] * len(requests)
        if not requests:
            return out
        enc = self.tokenizer(self._prompts(requests), truncation=True, max_length=self.max_length)
        ids, tt = enc["input_ids"], enc.get("token_type_ids")
        mask_id = self.tokenizer.mask_token_id
        positions = [[p for p, t in enumerate(seq) if t == mask_id] for seq in ids]
        live = [i for i, r in enumerate(requests) if len(positions[i]) == r.n_masks and r.n_masks > 0]
        if not live:
            return out  # every prompt truncated
        if self.engine == "packed":
            hidden = self._packed.hidden_at([ids[i] for i in live], [tt[i] for i in live] if tt is not None else None,
                                            [positions[i] for i in live])
        else:
            hidden = self._bucketed_hidden(ids, tt, positions, live)
        head = self.model.cls if self.engine == "packed" else None
        start, j = 0, 0
        while j < len(live):  # the vocabulary projection, HEAD_ROWS masked positions at a time
            k, rows = j, 0
            while k < len(live) and (k == j or rows + requests[live[k]].n_masks <= HEAD_ROWS):
                rows += requests[live[k]].n_masks
                k += 1
            with torch.inference_mode():  # top-k and softmax for all masks of the slice at once (row-wise ops)
                h = hidden[start:start + rows]
                logits = self._allowed_logits(head(h) if head is not None else self._project(h))
                r0 = 0
                for i in live[j:k]:
                    banned = self._banned_ids(requests[i]) if requests[i].banned else []
                    if banned:
                        logits[r0:r0 + requests[i].n_masks, banned] = float("-inf")
                    r0 += requests[i].n_masks
                top = torch.topk(logits, k=min(TOP_K_SAMPLING, logits.shape[1]), dim=-1)
                probs = torch.softmax(top.values, dim=-1).numpy().astype(np.float64)
                ids, finite = top.indices.numpy(), np.isfinite(top.values.numpy())
            r0 = 0
            for i in live[j:k]:
                m = requests[i].n_masks
                out[i] = self._sample(probs[r0:r0 + m], ids[r0:r0 + m], finite[r0:r0 + m], requests[i])
                r0 += m
            start += rows
            j = k
        return out

    def _project(self, hidden):
        """Vocabulary logits of last-layer states, by the model's head (bucketed engine)."""
        head = getattr(self.model, "cls", None) or getattr(self.model, "lm_head", None)
        if head is None:
            raise ConfigError(f"{type(self.model).__name__} exposes no masked-LM head (cls / lm_head)")
        return head(hidden)

    def _bucketed_hidden(self, ids, tt, positions, live):
        """Last-layer states at the masks of the ``live`` prompts (in that order), from the model's own
        forward pass on groups of prompts of exactly the same length (no padding)."""
        import torch

        from .encoder import length_groups

        base = getattr(self.model, "base_model", None)
        if base is None or base is self.model:
            raise ConfigError(f"{type(self.model).__name__} exposes no base model; use engine 'padded'")
        rows: list = [None] * len(live)
        with torch.inference_mode():
            for chunk in length_groups([len(ids[i]) for i in live], max(1, self.batch_size) * max(1, self.max_length)):
                for group in chunk:
                    batch = {"input_ids": torch.tensor([ids[live[g]] for g in group], device=self.device)}
                    if tt is not None:
                        batch["token_type_ids"] = torch.tensor([tt[live[g]] for g in group], device=self.device)
                    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
                    hidden = base(**batch).last_hidden_state
                    for r, g in enumerate(group):
                        rows[g] = hidden[r, positions[live[g]]]
        return torch.cat(rows, dim=0)

    def _fill_padded(self, requests: Sequence[FillRequest]) -> list[list[list[str]] | None]:
        """The straightforward engine (the reference): padded batches sorted by character length."""
        import torch

        out: list[list[list[str]] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].premise_masked)
                       + len(requests[i].hypothesis_masked))
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            texts = self._prompts([requests[i] for i in idx])
            enc = self.tokenizer(texts, truncation=True, max_length=self.max_length, padding=True,
                                 return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in enc.items()}
            positions = enc["input_ids"] == self.tokenizer.mask_token_id
            with torch.no_grad():
                logits = self._mask_logits(enc, positions).float().cpu()
            logits = logits[:, : len(self.allowed)].masked_fill(~self.allowed[: logits.shape[1]], float("-inf"))
            per_row = positions.sum(dim=1).tolist()
            start = 0
            for i, m in zip(idx, per_row):
                rows = logits[start:start + m]
                start += m
                if m != requests[i].n_masks:
                    continue  # truncated
                out[i] = self._candidates(rows, requests[i])
        return out

    def _banned_ids(self, req: FillRequest) -> list[int]:
        return [i for w in req.banned for i in self._word_ids.get(w.lower(), [])]

    def _candidates(self, logits, req: FillRequest) -> list[list[str]]:
        """One request's candidates from its masks' logits (the padded engine)."""
        import torch

        if req.banned:
            logits = logits.clone()
            for w in req.banned:
                ids = self._word_ids.get(w.lower(), [])
                if ids:
                    logits[:, ids] = float("-inf")
        top = torch.topk(logits, k=min(TOP_K_SAMPLING, logits.shape[1]), dim=-1)
        probs = torch.softmax(top.values, dim=-1).numpy().astype(np.float64)
        return self._sample(probs, top.indices.numpy(), np.isfinite(top.values.numpy()), req)

    def _sample(self, probs, ids, finite, req: FillRequest) -> list[list[str]]:
        """Candidate 1 = the argmax at every mask; the others sample each mask from its top tokens with
        the request's seeded generator; duplicates dropped."""
        rng = np.random.default_rng(req.seed)
        cands, seen = [], set()
        first = tuple(int(ids[j, 0]) for j in range(len(ids)))
        for c in range(self.candidates):
            if c == 0:
                pick = first
            else:
                pick = []
                for j in range(len(ids)):
                    p = np.where(finite[j], probs[j], 0.0)
                    p = p / p.sum()
                    pick.append(int(ids[j, rng.choice(len(p), p=p)]))
                pick = tuple(pick)
            if pick in seen:
                continue
            seen.add(pick)
            cands.append([self.words[t] for t in pick])
        return cands
