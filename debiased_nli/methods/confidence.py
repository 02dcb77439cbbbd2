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

Choosing tau (``tau_rule``): ``fixed`` applies tau as given (the paper's 0.95). ``min_kept`` scores the rows once
and measures how many M keeps at each tau of ``taus`` (:func:`acceptance_curve`); it keeps the given tau when that
keeps at least ``min_kept`` rows with every label among them (``min_kept / #labels`` of each), else the largest tau
of ``taus`` that does, else the smallest (:func:`choose_tau`). The report says which tau was used and why. Why every
label: z-filtering measures each feature's label distribution against the uniform one, so rows of two labels only
(M too unsure of the third to pass tau) cannot be z-filtered into a balanced config (on the CPU Seq-Z run of 60k
samples, tau 0.95 kept 7,500 rows and no neutral one, and only 305 of them joined seq_z).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..data.loading import column_numpy, labels_of
from ..data.tasks import TaskSpec
from ..models.classifier import load_classifier, predict_probabilities
from ..utils.errors import ConfigError, EmptyResultError
from ..utils.params import Param, Params, options_of
from .calibration import METHODS as CALIBRATION_METHODS
from .calibration import Calibrator, calibration_report, choose_calibrator

CONFIDENCE_COLUMN = "confidence"
UNCALIBRATED_COLUMN = "confidence_uncalibrated"
PROB_PREFIX = "m_prob_"
DEFAULT_TAU = 0.95
TAU_RULES = ("fixed", "min_kept")
DEFAULT_TAUS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
DEFAULT_MIN_KEPT = 5000

PARAMS = Params("confidence filter", [
    Param("model", "any", "roberta-large", "M: an NLI classifier (Hub id or folder), or a loaded one",
          paper="roberta-large", quote='Table 8: "data filtering model Roberta-large"'),
    Param("tau", "float", DEFAULT_TAU, "keep rows with p_M(label) > tau (with tau_rule min_kept: the tau tried first)",
          low=0, high=1, high_open=True, nullable=False, paper=DEFAULT_TAU,
          quote='Table 8: "data filtering threshold τ 0.95"'),
    Param("tau_rule", "str", "fixed", "fixed: tau as given; min_kept: tau if it keeps >= min_kept rows of every "
          "label, else the largest of `taus` that does, else the smallest of `taus`", choices=TAU_RULES,
          nullable=False, source="project's choice (the paper applies 0.95; small models keep too few rows at it)"),
    Param("taus", "any", list(DEFAULT_TAUS), "the taus tried by tau_rule min_kept (numbers in [0, 1))",
          source="project's choice"),
    Param("min_kept", "int", DEFAULT_MIN_KEPT, "rows tau_rule min_kept needs (and min_kept / #labels of each label)",
          low=1, nullable=False, source="project's choice (the CPU Seq-Z run: >= 5,000 generated rows)"),
    Param("batch_size", "int", 64, "rows per forward pass of M", low=1, nullable=False),
    Param("max_length", "int", 128, "tokens of a pair M reads", low=1, nullable=False),
    Param("calibration", "any", None, "held-out real rows with gold labels (a Dataset, or a file of the task's "
          "columns) to calibrate M on first", cli=None),
    Param("calibration_method", "str", "auto", "how M is calibrated", choices=("auto", *CALIBRATION_METHODS),
          nullable=False),
    Param("calibrator", "any", None, "a calibration.json of an earlier run (its fitted `calibrator`): applied as "
          "fitted there, without M and without held-out rows (a rebuild from M's stored probabilities)", cli=None),
    Param("probabilities", "bool", False, "add M's probability of every label (m_prob_<label>) to the rows"),
    Param("reuse_probabilities", "bool", False, "threshold rows that carry m_prob_<label> on those, without M"),
    Param("progress", "bool", True, "show progress bars"),
])
"""The confidence filter's parameters (a recipe's ``confidence:`` mapping, ``debiased-nli confidence-filter``)."""


@dataclass(frozen=True)
class MScoring:
    """How M reads rows: pairs per forward pass, tokens of a pair, its tokenizer (None: the model's own), the
    device (None: CUDA when present) and whether a progress bar shows. The filter, its scoring and the calibration
    take one (or the same fields as keywords)."""

    batch_size: int = 64
    max_length: int = 128
    tokenizer: Any = None
    device: str | None = None
    progress: bool = True


def _check_task(task) -> None:
    """The task is resolved where its name comes in (the command line, a recipe); here it is a TaskSpec."""
    if not isinstance(task, TaskSpec):
        raise TypeError(f"give the task as a TaskSpec (debiased_nli.data.tasks resolves a name), not {task!r}")


def confidence_filter(ds, model: "str | Any", task: TaskSpec, tau: float = DEFAULT_TAU, *,
                      scoring: MScoring | None = None, calibrator: "Calibrator | None" = None,
                      probabilities: bool = False, reuse_probabilities: bool = False, **scoring_options):
    """(kept, rejected): rows with ``p_M(label) > tau`` and the others, both with ``confidence``
    (calibrated by ``calibrator`` when given, M's own probability then in ``confidence_uncalibrated``; with
    ``probabilities``, M's probability of every label in ``m_prob_<label>``). With ``reuse_probabilities``, rows that
    carry every ``m_prob_<label>`` (an earlier run's) are thresholded on those, without running M over them.
    How M reads the rows: ``scoring`` or its fields as keywords (:class:`MScoring`: batch_size, max_length,
    tokenizer, device, progress)."""
    if not 0.0 <= tau < 1.0:
        raise ConfigError(f"tau must be in [0, 1), got {tau}")
    scoring = options_of(MScoring, scoring, scoring_options, "confidence_filter()")
    scored = score_confidence(ds, model, task, scoring=scoring, calibrator=calibrator,
                              probabilities=probabilities, reuse_probabilities=reuse_probabilities)
    return split_at_tau(scored, tau)


def _stored_probabilities(ds, task: TaskSpec, stored: list[str]) -> np.ndarray:
    """M's probabilities of an earlier ``--probabilities`` run (the ``m_prob_<label>`` columns), checked to be
    distributions (else an error naming the first row that is not)."""
    raw = np.stack([np.asarray(ds[c], dtype=np.float64) for c in stored], axis=1) if len(ds) \
        else np.zeros((0, task.num_labels))
    bad = np.nonzero(~np.isfinite(raw).all(1) | (np.abs(raw.sum(1) - 1) > 1e-3))[0] if len(ds) else []
    if len(bad):
        raise ConfigError(f"row {int(bad[0])}: the stored probabilities {raw[bad[0]].tolist()} ({', '.join(stored)}) "
                          f"are not a probability distribution")
    return raw


def score_confidence(ds, model: "str | Any", task: TaskSpec, *, scoring: MScoring | None = None,
                     calibrator: "Calibrator | None" = None, probabilities: bool = False,
                     reuse_probabilities: bool = False, **scoring_options):
    """``ds`` in its order with M's ``confidence`` in each row's label (and the columns :func:`confidence_filter`
    describes), before any threshold: :func:`split_at_tau` cuts it at a tau."""
    scoring = options_of(MScoring, scoring, scoring_options, "score_confidence()")
    _check_task(task)
    for col in ("premise", "hypothesis", "label"):
        if col not in ds.column_names:
            raise ConfigError(f"confidence filtering needs the column {col!r}; the data has {ds.column_names}")
    stored = [f"{PROB_PREFIX}{name}" for name in task.labels]
    if reuse_probabilities and all(c in ds.column_names for c in stored):
        # M's probabilities of an earlier --probabilities run: another tau or calibration without running M again
        raw = _stored_probabilities(ds, task, stored)
    else:
        clf = load_classifier(model, scoring.device, tokenizer=scoring.tokenizer)
        raw = predict_probabilities(clf, ds["premise"], ds["hypothesis"], batch_size=scoring.batch_size,
                                    max_length=scoring.max_length, order=range(len(ds)), labels=task.labels,
                                    progress=scoring.progress and "confidence filter")
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
    return scored


def split_at_tau(scored, tau: float):
    """(kept, rejected) of rows scored by :func:`score_confidence`: ``confidence > tau`` kept, the others rejected
    with ``rejected_by = "confidence<=tau"``; both in the input's order."""
    if not 0.0 <= tau < 1.0:
        raise ConfigError(f"tau must be in [0, 1), got {tau}")
    if CONFIDENCE_COLUMN not in scored.column_names:
        raise ConfigError(f"split_at_tau needs the rows' {CONFIDENCE_COLUMN!r} (score_confidence); they have "
                          f"{scored.column_names}")
    if "rejected_by" in scored.column_names:
        scored = scored.remove_columns(["rejected_by"])
    keep = np.asarray(scored[CONFIDENCE_COLUMN], dtype=np.float64) > tau if len(scored) else np.zeros(0, bool)
    kept = scored.select(np.nonzero(keep)[0])
    # the reason is added before selecting: add_column on an (empty) selection fails in datasets
    reason = scored.add_column("rejected_by", [f"confidence<={tau}"] * len(scored))
    rejected = reason.select(np.nonzero(~keep)[0])
    return kept, rejected


def acceptance_curve(conf, taus=DEFAULT_TAUS, labels=None, label_names=None) -> list[dict]:
    """Rows M keeps at each tau (``confidence > tau``, as the filter keeps them) and their share; with ``labels``
    (one label id per row) also the rows kept per label (``kept_by_label``, by ``label_names``)."""
    conf = np.asarray(conf, dtype=np.float64)
    n = len(conf)
    out = [{"tau": t, "kept": int((conf > t).sum()), "rate": round(float((conf > t).mean()), 4) if n else None}
           for t in taus]
    if labels is not None:
        labels = np.asarray(labels)
        ids = sorted(set(labels.tolist()))
        names = label_names or [str(i) for i in range(max(ids, default=-1) + 1)]
        for c in out:
            c["kept_by_label"] = {names[i]: int(((conf > c["tau"]) & (labels == i)).sum()) for i in ids}
    return out


def _cell(counts: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in counts.items())


def choose_tau(curve: list[dict], tau: float = DEFAULT_TAU, min_kept: int = DEFAULT_MIN_KEPT) -> tuple[float, str | None]:
    """``tau_rule: min_kept`` on an :func:`acceptance_curve`: ``tau`` if it keeps >= min_kept rows with every label
    among them (>= min_kept / #labels each, when the curve has per-label counts); else the largest tau of the curve
    that does; else the smallest tau of the curve (the most rows there are). Returns (the tau, why it is not
    ``tau``, or None when it is)."""
    if not curve:
        raise ConfigError("choose_tau needs an acceptance curve of at least one tau")

    def enough(c):
        per = c.get("kept_by_label")
        return c["kept"] >= min_kept and (not per or min(per.values()) >= min_kept / len(per))

    at = {c["tau"]: c for c in curve}
    if tau in at and enough(at[tau]):
        return tau, None
    p = at.get(tau, {"kept": 0})
    why = (f"M keeps {p['kept']:,} rows at tau {tau}" + (f" ({_cell(p['kept_by_label'])})" if p.get("kept_by_label")
                                                          else ""))
    rule = f">= {min_kept:,} rows" + (f" and >= {min_kept / len(p['kept_by_label']):,.0f} of every label"
                                      if p.get("kept_by_label") else "")
    ok = [t for t, c in at.items() if enough(c)]
    if ok:
        t = max(ok)
        return t, (f"{why}; downstream uses tau {t}, the largest of {list(at)} keeping {rule} "
                   f"({at[t]['kept']:,} rows" + (f", {_cell(at[t]['kept_by_label'])}" if at[t].get("kept_by_label")
                                                  else "") + ")")
    t = min(at)
    return t, f"{why}; no tau of {list(at)} keeps {rule}: downstream uses the smallest, {t} ({at[t]['kept']:,} rows)"


def check_taus(taus) -> list[float]:
    """``taus`` of tau_rule min_kept as a list of numbers in [0, 1) (else an error naming the value)."""
    if isinstance(taus, (int, float)) and not isinstance(taus, bool):
        taus = [taus]
    if not isinstance(taus, (list, tuple)) or not taus or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and 0.0 <= t < 1.0 for t in taus):
        raise ConfigError(f"`taus` must be a non-empty list of numbers in [0, 1), got {taus!r}")
    return [float(t) for t in taus]


def calibrate(held_out, model: "str | Any", task: TaskSpec, *, method: str = "auto",
              scoring: MScoring | None = None, **scoring_options):
    """M's calibration (:func:`debiased_nli.methods.calibration.choose_calibrator`: temperature scaling, per-label
    isotonic regression, or ``auto``: the one with the lower cross-fitted NLL) fitted on ``held_out``: real rows
    with gold labels that M did not train on. Returns (the loaded M, the :class:`Calibrator`, its report: NLL and
    ECE before and after, the reliability tables, the selection), so that the filter scores with the same M. M
    reads the rows as ``scoring`` (or its fields as keywords) says."""
    scoring = options_of(MScoring, scoring, scoring_options, "calibrate()")
    _check_task(task)
    for col in ("premise", "hypothesis", "label"):
        if col not in held_out.column_names:
            raise ConfigError(f"the calibration rows need the column {col!r}; they have {held_out.column_names}")
    if len(held_out) == 0:
        raise ConfigError("the calibration rows are empty: give held-out real rows with gold labels")
    clf = load_classifier(model, scoring.device, tokenizer=scoring.tokenizer)
    probs = predict_probabilities(clf, held_out["premise"], held_out["hypothesis"], batch_size=scoring.batch_size,
                                  max_length=scoring.max_length, order=range(len(held_out)), labels=task.labels,
                                  progress=scoring.progress and "calibration rows")
    labels = labels_of(held_out)
    calibrator, selection = choose_calibrator(probs, labels, method)
    return clf, calibrator, calibration_report(probs, labels, calibrator, label_names=task.labels, selection=selection)


def load_calibrator(path) -> "tuple[Calibrator, dict]":
    """The fitted :class:`Calibrator` of an earlier run's ``calibration.json`` (``calibrator``: its method, T or
    isotonic knots) and that file's report with its name and sha256 added, so that the rebuild's report says which
    calibration it applied. An unreadable or foreign file is refused with its name."""
    import json

    from ..utils.paths import check_input_file
    from ..utils.provenance import file_sha256

    check_input_file(str(path), "calibrator")
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        calibrator = Calibrator.from_dict(report["calibrator"])
        calibrator.apply(np.full((1, len(calibrator.knots or [0, 0, 0])), 1.0 / len(calibrator.knots or [0, 0, 0])))
    except (ValueError, KeyError, TypeError, IndexError, ConfigError) as err:
        raise ConfigError(f"calibrator {path}: not the calibration.json of a confidence-filter run "
                          f"({type(err).__name__}: {err})") from None
    return calibrator, {**report, "from": {"file": Path(path).name, "sha256": file_sha256(str(path))}}


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


def join_probabilities(ds, path: str, task: TaskSpec, what: str = "--probabilities-from"):
    """``ds`` with M's stored probabilities (``m_prob_<label>`` by ``uid`` from ``path``) in place of any it had; every
    row must have its uid there (else one line naming the first that does not)."""
    import pyarrow.parquet as pq

    from ..utils.paths import check_input_file

    check_input_file(path, what)
    cols = ["uid", *(f"{PROB_PREFIX}{n}" for n in task.labels)]
    try:
        table = pq.read_table(path)
    except Exception as err:  # not Parquet, damaged
        raise ConfigError(f"{what} {path}: not a readable Parquet file ({type(err).__name__})") from None
    missing = [c for c in cols if c not in table.column_names]
    if missing:
        raise ConfigError(f"{what} {path}: needs the columns {cols}; it lacks {missing}")
    if "uid" not in ds.column_names:
        raise ConfigError(f"{what} joins by uid: the rows have no uid column")
    index = {u: i for i, u in enumerate(table.column("uid").to_pylist())}
    where = np.empty(len(ds), dtype=np.int64)
    for r, u in enumerate(ds["uid"]):
        if u not in index:
            raise ConfigError(f"row {r}: uid {u!r} has no stored probabilities in {path}")
        where[r] = index[u]
    out = ds.remove_columns([c for c in cols[1:] if c in ds.column_names])
    for c in cols[1:]:
        out = out.add_column(c, table.column(c).to_numpy()[where].astype(np.float64).tolist())
    return out
