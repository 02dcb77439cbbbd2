"""The teacher's choice (Guo et al. 2023, section 3.3.2 "Confidence Filtering").

"we follow previous works (Yang et al., 2020; Wu et al., 2022) to train a BERT-base model on the
original dataset and use it as a filter. For each masked sample, we generate various candidates and
feed them to the filter. We choose the one with the highest output confidence to maintain label
consistency." The teacher is any ``AutoModelForSequenceClassification`` whose ``id2label`` names the
task's labels (e.g. a folder written by ``debiased-nli train``); there is no threshold (the paper
gives none): the candidate with the highest p_T(l | P', H') wins.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..confidence import load_classifier
from ..hypothesis_only import map_model_labels


class Teacher:
    """p_T(label | premise, hypothesis) for lists of pairs, in batches of similar length."""

    def __init__(self, model: "str | Any", labels: Sequence[str], *, tokenizer: Any = None, batch_size: int = 64,
                 max_length: int = 128, device: str | None = None):
        import torch

        self.name = model if isinstance(model, str) else type(model).__name__
        self.model, self.tokenizer = load_classifier(model, tokenizer)
        id2label = {int(i): str(l) for i, l in self.model.config.id2label.items()}
        self.order = map_model_labels(id2label, labels, self.name)
        self.batch_size, self.max_length = batch_size, max_length
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()

    def describe(self) -> dict:
        return {"model": self.name, "max_length": self.max_length}

    def label_probs(self, premises: Sequence[str], hypotheses: Sequence[str]) -> np.ndarray:
        import torch

        n = len(premises)
        out = np.zeros((n, len(self.order)), dtype=np.float64)
        order = sorted(range(n), key=lambda i: len(premises[i]) + len(hypotheses[i]))
        with torch.no_grad():
            for s in range(0, n, self.batch_size):
                idx = order[s:s + self.batch_size]
                enc = self.tokenizer([premises[i] for i in idx], [hypotheses[i] for i in idx], truncation=True,
                                     max_length=self.max_length, padding=True, return_tensors="pt").to(self.device)
                probs = torch.softmax(self.model(**enc).logits.float(), -1)[:, self.order].cpu().numpy()
                out[idx] = probs
        return out
