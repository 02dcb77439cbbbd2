"""Confidence filtering (Wu et al. 2022, section 3.2): keep a generated row only when an NLI model M
is confident of its label.

M is any ``AutoModelForSequenceClassification`` (Hub id or folder; the paper used RoBERTa-large
fine-tuned on the task). Its outputs are mapped onto the task's labels by name
(:func:`debiased_nli.models.labels.map_model_labels`; a model whose labels do not name the task's is
refused). Each (premise, hypothesis) pair is scored in batches of rows in input order
(:func:`debiased_nli.models.classifier.predict_probabilities`); a row is kept when
``p_M(label | premise, hypothesis) > tau`` (tau = 0.95). Both outputs carry the probability in
``confidence``; the rejected rows also carry ``rejected_by = "confidence<=tau"``.

Calibrated (a :class:`~debiased_nli.methods.calibration.Calibrator` fitted on held-out real rows by
:func:`calibrate`: temperature scaling or per-label isotonic regression): tau is applied to M's calibrated
probability, and the rows also carry M's own probability in ``confidence_uncalibrated``. With ``probabilities=True`` every
row carries M's (uncalibrated) probability of each label in ``m_prob_<label>``, so that another tau or
temperature can be applied later without M.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..data.loading import column_numpy, labels_of
from ..data.tasks import TaskSpec, get_task
from ..models.classifier import load_classifier, predict_probabilities
from ..utils.errors import ConfigError, EmptyResultError
from .calibration import Calibrator, calibration_report, choose_calibrator

CONFIDENCE_COLUMN = "confidence"
UNCALIBRATED_COLUMN = "confidence_uncalibrated"
PROB_PREFIX = "m_prob_"
DEFAULT_TAU = 0.95


def confidence_filter(ds, model: "str | Any", task: "str | TaskSpec", tau: float = DEFAULT_TAU, *,
                      batch_size: int = 64, max_length: int = 128, tokenizer: Any = None,
                      device: str | None = None, progress: bool = True, calibrator: "Calibrator | None" = None,
                      probabilities: bool = False, reuse_probabilities: bool = False):
    """(kept, rejected): rows with ``p_M(label) > tau`` and the others, both with ``confidence``
    (calibrated by ``calibrator`` when given, M's own probability then in ``confidence_uncalibrated``; with
    ``probabilities``, M's probability of every label in ``m_prob_<label>``). With ``reuse_probabilities``, rows that
    carry every ``m_prob_<label>`` (an earlier run's) are thresholded on those, without running M over them."""
    task = get_task(task)
    if not 0.0 <= tau < 1.0:
        raise ConfigError(f"tau must be in [0, 1), got {tau}")
    for col in ("premise", "hypothesis", "label"):
        if col not in ds.column_names:
            raise ConfigError(f"confidence filtering needs the column {col!r}; the data has {ds.column_names}")
    stored = [f"{PROB_PREFIX}{name}" for name in task.labels]
    if reuse_probabilities and all(c in ds.column_names for c in stored):
        # M's probabilities of an earlier --probabilities run: another tau or calibration without running M again
        raw = np.stack([np.asarray(ds[c], dtype=np.float64) for c in stored], axis=1) if len(ds) \
            else np.zeros((0, task.num_labels))
        bad = np.nonzero(~np.isfinite(raw).all(1) | (np.abs(raw.sum(1) - 1) > 1e-3))[0] if len(ds) else []
        if len(bad):
            raise ConfigError(f"row {int(bad[0])}: the stored probabilities {raw[bad[0]].tolist()} ({', '.join(stored)}) "
                              f"are not a probability distribution")
    else:
        clf = load_classifier(model, device, tokenizer=tokenizer)
        raw = predict_probabilities(clf, ds["premise"], ds["hypothesis"], batch_size=batch_size, max_length=max_length,
                                    order=range(len(ds)), labels=task.labels, desc="confidence filter",
                                    progress=progress)
    probs = raw if calibrator is None else calibrator.apply(raw)
    labels = labels_of(ds)
    rows = np.arange(len(labels))
    conf = probs[rows, labels] if len(labels) else np.zeros(0)
    added = {CONFIDENCE_COLUMN: conf}
    if calibrator is not None:
        added[UNCALIBRATED_COLUMN] = raw[rows, labels] if len(labels) else np.zeros(0)
    if probabilities:
        added.update({f"{PROB_PREFIX}{name}": raw[:, k] for k, name in enumerate(task.labels)})
    # an earlier run's columns (its confidence, its reason) are replaced, never carried over as if they were this one's
    replaced = dict.fromkeys((*added, UNCALIBRATED_COLUMN, "rejected_by"))  # each name once
    scored = ds.remove_columns([c for c in replaced if c in ds.column_names])
    for name, values in added.items():
        scored = scored.add_column(name, np.asarray(values, dtype=np.float64).tolist())
    keep = conf > tau
    kept = scored.select(np.nonzero(keep)[0])
    # the reason is added before selecting: add_column on an (empty) selection fails in datasets
    reason = scored.add_column("rejected_by", [f"confidence<={tau}"] * len(scored))
    rejected = reason.select(np.nonzero(~keep)[0])
    return kept, rejected


def calibrate(held_out, model: "str | Any", task: "str | TaskSpec", *, method: str = "auto", batch_size: int = 64,
              max_length: int = 128, tokenizer: Any = None, device: str | None = None, progress: bool = True):
    """M's calibration (:func:`debiased_nli.methods.calibration.choose_calibrator`: temperature scaling, per-label
    isotonic regression, or ``auto``: the one with the lower cross-fitted NLL) fitted on ``held_out``: real rows
    with gold labels that M did not train on. Returns (the loaded M, the :class:`Calibrator`, its report: NLL and
    ECE before and after, the reliability tables, the selection), so that the filter scores with the same M."""
    task = get_task(task)
    for col in ("premise", "hypothesis", "label"):
        if col not in held_out.column_names:
            raise ConfigError(f"the calibration rows need the column {col!r}; they have {held_out.column_names}")
    if len(held_out) == 0:
        raise ConfigError("the calibration rows are empty: give held-out real rows with gold labels")
    clf = load_classifier(model, device, tokenizer=tokenizer)
    probs = predict_probabilities(clf, held_out["premise"], held_out["hypothesis"], batch_size=batch_size,
                                  max_length=max_length, order=range(len(held_out)), labels=task.labels,
                                  desc="calibration rows", progress=progress)
    labels = labels_of(held_out)
    calibrator, selection = choose_calibrator(probs, labels, method)
    return clf, calibrator, calibration_report(probs, labels, calibrator, label_names=task.labels, selection=selection)


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
