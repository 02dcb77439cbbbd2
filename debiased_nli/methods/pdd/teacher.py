"""The teacher's choice (Guo et al. 2023, section 3.3.2 "Confidence Filtering").

"we follow previous works (Yang et al., 2020; Wu et al., 2022) to train a BERT-base model on the
original dataset and use it as a filter. For each masked sample, we generate various candidates and
feed them to the filter. We choose the one with the highest output confidence to maintain label
consistency." The teacher is any ``AutoModelForSequenceClassification`` whose ``id2label`` names the
task's labels (e.g. a folder written by ``debiased-nli train``); there is no threshold (the paper
gives none): the candidate with the highest p_T(l | P', H') wins.

Scoring the candidates is most of a PDD run's time on CPU, so it has three engines, all computing the
same probabilities (up to float rounding in the last bits; measured on the documentation's PDD page):

- ``packed`` (BERT classifiers): each pair tokenised once, without padding; the encoder runs on the
  packed tokens and its last layer only at ``[CLS]`` (encoder.py).
- ``bucketed`` (any classifier): the model's own forward pass on groups of pairs of exactly the same
  token length (no padding, no attention mask). The groups are small (a few pairs), so on CPU it was
  no faster than ``padded`` in the project's measurement (the PDD page); it is there for other models.
- ``padded``: the straightforward one, batches of ``batch_size`` pairs sorted by character length and
  padded to their longest; the reference the others are tested against.

``auto`` (the default) is ``packed`` where the model allows it, else ``padded``.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...models.classifier import default_device, load_classifier, predict_probabilities
from ...models.labels import map_model_labels
from ...utils.errors import ConfigError

ENGINES = ("auto", "packed", "bucketed", "padded")


def _packed_classifier(model: Any) -> bool:
    """A BERT sequence classifier: encoder, pooler (dense + tanh on [CLS]), dropout, linear classifier."""
    import torch

    from .encoder import supports

    bert = getattr(model, "bert", None)
    return (type(model).__name__ == "BertForSequenceClassification" and supports(model)
            and type(getattr(bert, "pooler", None)).__name__ == "BertPooler"
            and isinstance(getattr(model, "classifier", None), torch.nn.Linear))


class Teacher:
    """p_T(label | premise, hypothesis) for lists of pairs (see the module docstring for ``engine``)."""

    def __init__(self, model: "str | Any", labels: Sequence[str], *, tokenizer: Any = None, batch_size: int = 64,
                 max_length: int = 128, device: str | None = None, engine: str = "auto", dtype: str = "float32"):
        from .encoder import DTYPES

        if engine not in ENGINES:
            raise ConfigError(f"unknown teacher engine {engine!r}; known: {list(ENGINES)}")
        if dtype not in DTYPES:
            raise ConfigError(f"unknown teacher dtype {dtype!r}; known: {list(DTYPES)}")
        self.dtype = dtype
        self.device = device or default_device()
        self.clf = load_classifier(model, self.device, tokenizer=tokenizer)
        self.name, self.model, self.tokenizer = self.clf.path, self.clf.model, self.clf.tokenizer
        self.labels = tuple(labels)
        self.order = map_model_labels(self.clf.id2label, self.labels, self.name)
        self.batch_size, self.max_length = batch_size, max_length
        packable = _packed_classifier(self.model)
        if engine == "packed" and not packable:
            raise ConfigError(f"the packed teacher engine needs a BERT sequence classifier (BertForSequenceClassification "
                              f"with a pooler); {type(self.model).__name__} is not one: use engine 'bucketed' or 'auto'")
        self.engine = ("packed" if packable else "padded") if engine == "auto" else engine
        self._packed = None
        if self.engine == "packed":
            from .encoder import PackedBert
            self._packed = PackedBert(self.model, max_tokens=max(1, batch_size) * max(1, max_length))

    def describe(self) -> dict:
        """The teacher's identity in a run's checkpoint (run.json); the engine is not part of it (see
        MaskFiller.describe)."""
        out = {"model": self.name, "max_length": self.max_length}
        if self.dtype != "float32":  # changes the probabilities (encoder.DTYPES); float32 runs keep their old identity
            out["dtype"] = self.dtype
        return out

    def label_probs(self, premises: Sequence[str], hypotheses: Sequence[str]) -> np.ndarray:
        n = len(premises)
        if len(hypotheses) != n:
            raise ValueError(f"{n} premises but {len(hypotheses)} hypotheses")
        if not n:
            return np.zeros((0, len(self.order)), dtype=np.float64)
        if self.engine == "padded":
            return self._padded(premises, hypotheses)
        from .encoder import compute_context

        with compute_context(self.device, self.dtype):
            enc = self.tokenizer(list(premises), list(hypotheses), truncation=True, max_length=self.max_length)
            ids = enc["input_ids"]
            tt = enc.get("token_type_ids")
            if self.engine == "packed":
                return self._packed_probs(ids, tt)
            return self._bucketed(ids, tt)

    # -- engines ---------------------------------------------------------------------------------------
    def _probs(self, logits) -> np.ndarray:
        import torch

        return torch.softmax(logits.float(), -1)[:, self.order].cpu().numpy().astype(np.float64)

    def _packed_probs(self, ids, tt) -> np.ndarray:
        import torch

        hidden = self._packed.hidden_at(ids, tt, [[0]] * len(ids))   # the [CLS] state of every pair
        with torch.inference_mode():
            pooler = self.model.bert.pooler
            pooled = pooler.activation(pooler.dense(hidden))
            logits = self.model.classifier(self.model.dropout(pooled))   # dropout: identity in eval mode
        return self._probs(logits)

    def _bucketed(self, ids, tt) -> np.ndarray:
        import torch

        from .encoder import length_groups

        out = np.zeros((len(ids), len(self.order)), dtype=np.float64)
        with torch.inference_mode():
            for chunk in length_groups([len(s) for s in ids], max(1, self.batch_size) * max(1, self.max_length)):
                for idx in chunk:
                    batch = {"input_ids": torch.tensor([ids[i] for i in idx], device=self.device)}
                    if tt is not None:
                        batch["token_type_ids"] = torch.tensor([tt[i] for i in idx], device=self.device)
                    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
                    out[idx] = self._probs(self.model(**batch).logits)
        return out

    def _padded(self, premises: Sequence[str], hypotheses: Sequence[str]) -> np.ndarray:
        """The straightforward engine (the reference): the project's prediction loop
        (:func:`debiased_nli.models.classifier.predict_probabilities`) on batches of ``batch_size`` pairs in
        order of character length, each padded to its longest."""
        order = sorted(range(len(premises)), key=lambda i: len(premises[i]) + len(hypotheses[i]))
        return predict_probabilities(self.clf, premises, hypotheses, batch_size=self.batch_size,
                                     max_length=self.max_length, order=order, labels=self.labels,
                                     progress=False, dtype=self.dtype).astype(np.float64)
