"""The hypothesis-only model behind the ``hypo-only-pred=<label>`` feature.

It must never predict a row it was trained on, so the default is **out-of-fold** prediction: the
rows are split into k stratified folds (seeded) and each fold is predicted by a TF-IDF + logistic
regression model fitted on the other k-1 folds. Its input is the hypothesis unigram and bigram
features already in the feature matrix (``*@hypothesis``; features seen in fewer than ``min_df``
rows are ignored), with sublinear TF-IDF weighting, so nothing is tokenised twice. For FEVER this
is the claim-only model (the claim is the hypothesis).

The other option is a fine-tuned ``transformers`` sequence classifier (a folder or Hub id) applied
to the hypothesis alone; its ``id2label`` is mapped onto the task's labels. That model should have
been trained on other data: it is not out-of-fold.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import pyarrow.compute as pc

from .errors import ConfigError
from .features import FeatureMatrix


@dataclasses.dataclass
class HypothesisOnlyResult:
    predictions: np.ndarray       # int label per row
    probabilities: np.ndarray     # rows x K
    accuracy: float               # out-of-fold accuracy against the gold labels
    method: str
    params: dict

    def to_dict(self) -> dict:
        return {"method": self.method, "accuracy": round(self.accuracy, 6), **self.params}


def hypothesis_matrix(fm: FeatureMatrix, min_df: int = 2):
    """The rows x (hypothesis n-gram) sub-matrix used as the model's input."""
    mask = fm.feature_mask(lambda v: pc.ends_with(v, "@hypothesis"))
    X = fm.csr()[:, np.nonzero(mask)[0]]
    df = np.asarray((X > 0).sum(axis=0)).ravel()
    return X[:, np.nonzero(df >= min_df)[0]]


def out_of_fold_tfidf(fm: FeatureMatrix, labels: np.ndarray, num_labels: int, *, folds: int = 5,
                      seed: int = 0, C: float = 1.0, min_df: int = 2, max_iter: int = 300,
                      progress: bool = True) -> HypothesisOnlyResult:
    """Out-of-fold predictions of TF-IDF + logistic regression on the hypothesis n-grams."""
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold
    from tqdm.auto import tqdm

    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    if n < folds * 2:
        raise ConfigError(f"the hypothesis-only model needs at least {folds * 2} rows for {folds}-fold "
                          f"prediction, got {n}")
    X = TfidfTransformer(sublinear_tf=True).fit_transform(hypothesis_matrix(fm, min_df))
    probs = np.zeros((n, num_labels))
    counts = np.bincount(labels, minlength=num_labels)
    present = counts[counts > 0]
    k = int(min(folds, present.min())) if present.min() >= 2 else 2
    splitter = StratifiedKFold(n_splits=max(k, 2), shuffle=True, random_state=seed)
    for train, held in tqdm(list(splitter.split(np.zeros(n), labels)), desc="hypothesis-only (out-of-fold)",
                            disable=not progress):
        clf = LogisticRegression(C=C, max_iter=max_iter, random_state=seed)
        clf.fit(X[train], labels[train])
        probs[np.ix_(held, clf.classes_)] = clf.predict_proba(X[held])
    pred = probs.argmax(axis=1)
    return HypothesisOnlyResult(pred, probs, float((pred == labels).mean()), "tfidf-logreg-oof",
                                {"folds": int(max(k, 2)), "seed": seed, "C": C, "min_df": min_df,
                                 "n_inputs": int(X.shape[1])})


def transformer_predictions(model: str, hypotheses: Sequence[str], labels: np.ndarray,
                            label_names: Sequence[str], *, batch_size: int = 64, max_length: int = 64,
                            device: str | None = None, progress: bool = True) -> HypothesisOnlyResult:
    """Predictions of a fine-tuned sequence classifier (folder or Hub id) on the hypothesis alone."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    clf = AutoModelForSequenceClassification.from_pretrained(model)
    id2label = {int(i): str(l) for i, l in clf.config.id2label.items()}
    order = map_model_labels(id2label, label_names, model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    clf.to(device).eval()
    out = []
    with torch.no_grad():
        for start in tqdm(range(0, len(hypotheses), batch_size), desc="hypothesis-only (model)", disable=not progress):
            enc = tok(list(hypotheses[start:start + batch_size]), truncation=True, max_length=max_length,
                      padding=True, return_tensors="pt").to(device)
            out.append(torch.softmax(clf(**enc).logits.float(), -1)[:, order].cpu().numpy())
    probs = np.concatenate(out) if out else np.zeros((0, len(label_names)))
    pred = probs.argmax(axis=1)
    labels = np.asarray(labels)
    return HypothesisOnlyResult(pred, probs, float((pred == labels).mean()) if len(labels) else 0.0,
                                "transformers", {"model": model})


def map_model_labels(id2label: dict[int, str], label_names: Sequence[str], model: str = "model") -> list[int]:
    """For each task label, the model's output index with that name (case-insensitive).

    Generic names (LABEL_0, ...) are taken to be in the task's order; other mismatches are refused.
    """
    names = {i: l.lower() for i, l in id2label.items()}
    if len(names) != len(label_names):
        raise ConfigError(f"{model} has {len(names)} labels {list(id2label.values())}, the task has "
                          f"{len(label_names)} {list(label_names)}")
    if all(l.startswith("label_") for l in names.values()):
        return list(range(len(label_names)))
    order = []
    for name in label_names:
        hits = [i for i, l in names.items() if l == name.lower()]
        if not hits:
            raise ConfigError(f"{model}: no output named {name!r}; its labels are {id2label}. "
                              f"Use a model whose id2label names the task's labels {list(label_names)}.")
        order.append(hits[0])
    return order
