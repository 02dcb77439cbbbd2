"""Confidence filtering (Wu et al. 2022, section 3.2): keep a generated row only when an NLI model M
is confident of its label.

M is any ``AutoModelForSequenceClassification`` (Hub id or folder; the paper used RoBERTa-large
fine-tuned on the task). Its outputs are mapped onto the task's labels by name
(:func:`debiased_nli.bias.hypothesis_only.map_model_labels`; a model whose labels do not name the task's is
refused). Each (premise, hypothesis) pair is scored in batches; a row is kept when
``p_M(label | premise, hypothesis) > tau`` (tau = 0.95). Both outputs carry the probability in
``confidence``; the rejected rows also carry ``rejected_by = "confidence<=tau"``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..data.loading import column_numpy, labels_of
from ..data.tasks import TaskSpec, get_task
from ..utils.errors import ConfigError, EmptyResultError

CONFIDENCE_COLUMN = "confidence"
DEFAULT_TAU = 0.95


def load_classifier(model: "str | Any", tokenizer: Any = None):
    """(model, tokenizer) from a Hub id / folder, or an already loaded pair."""
    if not isinstance(model, str):
        if tokenizer is None:
            raise ConfigError("pass the tokenizer together with an already loaded model")
        return model, tokenizer
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    try:
        clf = AutoModelForSequenceClassification.from_pretrained(model)
        tok = AutoTokenizer.from_pretrained(model)
    except OSError as err:
        raise ConfigError(f"cannot load a sequence classifier from {model!r} ({err}); give a Hub id (with "
                          f"internet) or a folder written by save_pretrained (e.g. by `debiased-nli train`)") from err
    return clf, tok


def label_probabilities(ds, model, tokenizer, task: TaskSpec, *, batch_size: int = 64, max_length: int = 128,
                        device: str | None = None, progress: bool = True, model_name: str = "model") -> np.ndarray:
    """rows x K probabilities of M, columns in the task's label order."""
    import torch
    from tqdm.auto import tqdm

    from ..models.labels import map_model_labels

    id2label = {int(i): str(l) for i, l in model.config.id2label.items()}
    order = map_model_labels(id2label, task.labels, model_name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    premises, hypotheses = ds["premise"], ds["hypothesis"]
    out = []
    with torch.no_grad():
        for start in tqdm(range(0, len(ds), batch_size), desc="confidence filter", unit="batch", disable=not progress):
            enc = tokenizer(list(premises[start:start + batch_size]), list(hypotheses[start:start + batch_size]),
                            truncation=True, max_length=max_length, padding=True, return_tensors="pt").to(device)
            out.append(torch.softmax(model(**enc).logits.float(), -1)[:, order].cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, task.num_labels))


def confidence_filter(ds, model: "str | Any", task: "str | TaskSpec", tau: float = DEFAULT_TAU, *,
                      batch_size: int = 64, max_length: int = 128, tokenizer: Any = None,
                      device: str | None = None, progress: bool = True):
    """(kept, rejected): rows with ``p_M(label) > tau`` and the others, both with ``confidence``."""
    task = get_task(task)
    if not 0.0 <= tau < 1.0:
        raise ConfigError(f"tau must be in [0, 1), got {tau}")
    for col in ("premise", "hypothesis", "label"):
        if col not in ds.column_names:
            raise ConfigError(f"confidence filtering needs the column {col!r}; the data has {ds.column_names}")
    name = model if isinstance(model, str) else type(model).__name__
    clf, tok = load_classifier(model, tokenizer)
    probs = label_probabilities(ds, clf, tok, task, batch_size=batch_size, max_length=max_length, device=device,
                                progress=progress, model_name=name)
    labels = labels_of(ds)
    conf = probs[np.arange(len(labels)), labels] if len(labels) else np.zeros(0)
    scored = ds.remove_columns([c for c in (CONFIDENCE_COLUMN,) if c in ds.column_names])
    scored = scored.add_column(CONFIDENCE_COLUMN, conf.astype(np.float64).tolist())
    keep = conf > tau
    kept = scored.select(np.nonzero(keep)[0])
    # the reason is added before selecting: add_column on an (empty) selection fails in datasets
    reason = scored.add_column("rejected_by", [f"confidence<={tau}"] * len(scored))
    rejected = reason.select(np.nonzero(~keep)[0])
    return kept, rejected


def confidence_report(kept, rejected, task: TaskSpec, tau: float) -> dict:
    """Counts of a confidence filter's output: rows kept and rejected, per label, and confidence quantiles."""
    n = len(kept) + len(rejected)
    if n == 0:
        raise EmptyResultError("confidence filtering got no rows")
    per_label = {}
    for k, name in enumerate(task.labels):
        nk = int(np.sum(labels_of(kept) == k)) if len(kept) else 0
        nr = int(np.sum(labels_of(rejected) == k)) if len(rejected) else 0
        per_label[name] = {"kept": nk, "rejected": nr, "acceptance": round(nk / (nk + nr), 4) if nk + nr else None}
    conf = np.concatenate([column_numpy(kept, CONFIDENCE_COLUMN), column_numpy(rejected, CONFIDENCE_COLUMN)])
    return {"tau": tau, "rows": n, "kept": len(kept), "rejected": len(rejected),
            "acceptance_rate": round(len(kept) / n, 4), "per_label": per_label,
            "confidence_quantiles": {q: round(float(np.quantile(conf, q)), 4) for q in (0.1, 0.25, 0.5, 0.75, 0.9)}}
