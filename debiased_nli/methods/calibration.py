"""Calibrating the confidence model M on held-out real rows before its threshold is applied.

Wu et al. (2022, Sec. 3.2) keep a generated row when ``p_M(label) > tau`` with tau = 0.95 (Table 8:
"data filtering threshold τ 0.95"), read off RoBERTa-large's softmax. A threshold on a probability
means what it says only when the probabilities are calibrated: an over- or under-confident M keeps a
different share of rows at the same tau (the project's MiniLM M keeps no neutral row at 0.95: its
largest neutral probability on 140,000 samples is 0.942). So M is calibrated first, on real rows it
did not train on, and tau is applied to the calibrated probabilities.

The method is temperature scaling (Guo, Pleiss, Sun & Weinberger 2017, "On Calibration of Modern
Neural Networks", ICML, Sec. 4.2): one scalar ``T > 0`` divides the logits, ``q = softmax(z / T)``,
fitted by minimising the negative log-likelihood on a validation set. It keeps M's argmax (its
accuracy) and only moves how sure M is. M's logits are recovered from its probabilities up to a
per-row constant (``log p``), which softmax ignores, so it works on any stored probabilities.

Temperature scaling has one parameter: it cannot fix a model that is over-confident in the middle of its
range and under-confident at the top, which is what the project's MiniLM M is on SNLI dev (rows it gives
0.93-1.0 are right 97.2% of the time at a mean confidence of 0.945, while T = 1.106 > 1 lowers every
probability). The second method is per-label isotonic regression (Zadrozny & Elkan 2002, "Transforming
classifier scores into accurate multiclass probability estimates", KDD: one-vs-rest, then the rows
normalised to sum to 1): for each label c, a non-decreasing map from p_c to P(y = c | p_c) fitted on the
held-out rows (pool adjacent violators). ``auto`` chooses between the two by their negative log-likelihood
on held-out rows they were not fitted on (2-fold cross-fitting over the calibration rows, a proper scoring
rule), then fits the chosen one on all of them; the report gives both methods' cross-fitted NLL and ECE.

Calibration is measured by the expected calibration error (Naeini, Cooper & Hauskrecht 2015; Guo et
al.'s form: 15 equal-width bins of the top-label confidence, ``ECE = sum_b |B_b|/n |acc(B_b) -
conf(B_b)|``), before and after, with the reliability table each is computed from. The bounds of T
(0.05 to 20), the 15 bins, the 2 folds and NLL as the criterion are the project's choice (Guo et al. use
15 bins; no paper gives the others).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..utils.errors import ConfigError

METHODS = ("temperature", "isotonic")
CV_FOLDS = 2  # project's choice: the cross-fitting of ``auto``
ECE_BINS = 15  # Guo et al. (2017), Sec. 2: "we group predictions into M interval bins" (M = 15 in their figures)
T_BOUNDS = (0.05, 20.0)  # the project's choice: a search interval wide enough for any softmax classifier
_TINY = 1e-12


def _check(probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels)
    if probs.ndim != 2 or probs.shape[0] != labels.shape[0]:
        raise ConfigError(f"calibration needs rows x labels probabilities and one label per row; got "
                          f"{probs.shape} probabilities and {labels.shape[0]} labels")
    if probs.shape[0] == 0:
        raise ConfigError("calibration needs at least one held-out row; got none")
    bad = np.nonzero((labels < 0) | (labels >= probs.shape[1]))[0]
    if bad.size:
        raise ConfigError(f"calibration row {int(bad[0])}: label {labels[bad[0]].item()!r} is not one of the "
                          f"{probs.shape[1]} outputs")
    if not np.all(np.isfinite(probs)):
        row = int(np.nonzero(~np.all(np.isfinite(probs), axis=1))[0][0])
        raise ConfigError(f"calibration row {row}: the probabilities are not finite ({probs[row].tolist()})")
    return probs, labels.astype(np.int64)


def temperature_scale(probs: np.ndarray, temperature: float) -> np.ndarray:
    """``softmax(log p / T)`` row by row (float64): the probabilities M would give with logits / T."""
    if not np.isfinite(temperature) or temperature <= 0:
        raise ConfigError(f"the temperature must be a finite number > 0, not {temperature!r}")
    z = np.log(np.clip(np.asarray(probs, dtype=np.float64), _TINY, None)) / temperature
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def negative_log_likelihood(probs: np.ndarray, labels: np.ndarray) -> float:
    probs, labels = _check(probs, labels)
    return float(-np.mean(np.log(np.clip(probs[np.arange(len(labels)), labels], _TINY, None))))


def fit_temperature(probs: np.ndarray, labels: np.ndarray, bounds: Sequence[float] = T_BOUNDS) -> float:
    """The T in ``bounds`` that minimises the NLL of ``softmax(log p / T)`` on the rows (Guo et al. 2017):
    a bounded one-dimensional search over log T (the NLL is smooth and has one minimum there)."""
    from scipy.optimize import minimize_scalar

    probs, labels = _check(probs, labels)
    lo, hi = float(bounds[0]), float(bounds[1])
    if not 0 < lo < hi:
        raise ConfigError(f"temperature bounds must be 0 < low < high, not {bounds!r}")
    logp = np.log(np.clip(probs, _TINY, None))
    rows = np.arange(len(labels))

    def nll(log_t: float) -> float:
        z = logp / np.exp(log_t)
        z -= z.max(axis=1, keepdims=True)
        return float(-np.mean(z[rows, labels] - np.log(np.exp(z).sum(axis=1))))

    res = minimize_scalar(nll, bounds=(np.log(lo), np.log(hi)), method="bounded", options={"xatol": 1e-6})
    return float(np.exp(res.x))


def reliability(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> list[dict]:
    """Per equal-width bin of the top-label confidence: its rows, mean confidence and accuracy."""
    probs, labels = _check(probs, labels)
    conf = probs.max(axis=1)
    hit = probs.argmax(axis=1) == labels
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, bins - 1)  # (lo, hi] bins; 0 goes to the first
    out = []
    for b in range(bins):
        m = which == b
        n = int(m.sum())
        out.append({"low": round(float(edges[b]), 4), "high": round(float(edges[b + 1]), 4), "rows": n,
                    "confidence": float(conf[m].mean()) if n else None, "accuracy": float(hit[m].mean()) if n else None})
    return out


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> float:
    """ECE = sum over bins of |B|/n * |accuracy(B) - confidence(B)| (top-label confidence, equal-width bins)."""
    table = reliability(probs, labels, bins)
    n = sum(b["rows"] for b in table)
    return float(sum(b["rows"] / n * abs(b["accuracy"] - b["confidence"]) for b in table if b["rows"]))


@dataclasses.dataclass
class Calibrator:
    """A fitted calibration: ``temperature`` (one T) or ``isotonic`` (per label, the knots of a non-decreasing map)."""

    method: str
    temperature: float | None = None
    knots: list[tuple[list[float], list[float]]] | None = None

    def apply(self, probs: np.ndarray) -> np.ndarray:
        if self.method == "temperature":
            return temperature_scale(probs, self.temperature)
        if self.method == "isotonic":
            return isotonic_scale(probs, self.knots)
        raise ConfigError(f"unknown calibration method {self.method!r}; the methods are {METHODS}")

    def to_dict(self) -> dict:
        return {"method": self.method, "temperature": self.temperature,
                "knots": None if self.knots is None else [{"x": x, "y": y} for x, y in self.knots]}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibrator":
        knots = d.get("knots")
        return cls(d["method"], d.get("temperature"), None if knots is None else [(k["x"], k["y"]) for k in knots])


def fit_isotonic(probs: np.ndarray, labels: np.ndarray) -> list[tuple[list[float], list[float]]]:
    """Per label c, the knots of the isotonic (non-decreasing) regression of 1[y = c] on p_c (Zadrozny & Elkan 2002)."""
    from sklearn.isotonic import IsotonicRegression

    probs, labels = _check(probs, labels)
    eps = 1.0 / (len(labels) + 2)  # project's choice: no label certain or impossible from a finite sample (Laplace)
    knots = []
    for c in range(probs.shape[1]):
        ir = IsotonicRegression(y_min=eps, y_max=1.0 - eps, increasing=True, out_of_bounds="clip")
        ir.fit(probs[:, c], (labels == c).astype(np.float64))
        knots.append(([float(v) for v in ir.X_thresholds_], [float(v) for v in ir.y_thresholds_]))
    return knots


def isotonic_scale(probs: np.ndarray, knots) -> np.ndarray:
    """Each label's probability through its map (linear between knots, clipped outside), rows normalised to sum
    to 1 (a row that every map sends to 0 becomes uniform)."""
    probs = np.asarray(probs, dtype=np.float64)
    if len(knots) != probs.shape[1]:
        raise ConfigError(f"the isotonic calibration has {len(knots)} labels, the probabilities {probs.shape[1]}")
    out = np.stack([np.interp(probs[:, c], np.asarray(x), np.asarray(y)) for c, (x, y) in enumerate(knots)], axis=1)
    total = out.sum(axis=1, keepdims=True)
    uniform = np.full_like(out, 1.0 / out.shape[1])
    return np.where(total > 0, out / np.where(total > 0, total, 1.0), uniform)


def fit(probs: np.ndarray, labels: np.ndarray, method: str) -> Calibrator:
    if method == "temperature":
        return Calibrator("temperature", temperature=fit_temperature(probs, labels))
    if method == "isotonic":
        return Calibrator("isotonic", knots=fit_isotonic(probs, labels))
    raise ConfigError(f"unknown calibration method {method!r}; the methods are {METHODS} (or auto)")


def choose_calibrator(probs: np.ndarray, labels: np.ndarray, method: str = "auto", *, folds: int = CV_FOLDS,
                      seed: int = 0) -> tuple[Calibrator, dict]:
    """The calibration fitted on all the rows: ``method``, or with ``auto`` the method whose cross-fitted NLL (fitted on
    the other folds, scored on each fold) is lowest. Returns it and the selection (each method's cross-fitted NLL and
    ECE, when ``auto``)."""
    probs, labels = _check(probs, labels)
    if method != "auto":
        return fit(probs, labels, method), {"rule": f"given: {method}"}
    fold = np.random.default_rng(seed).permutation(len(labels)) % folds
    cv = {}
    for m in METHODS:
        out = np.zeros_like(probs)
        for f in range(folds):
            train, test = fold != f, fold == f
            out[test] = fit(probs[train], labels[train], m).apply(probs[test])
        cv[m] = {"nll": round(negative_log_likelihood(out, labels), 6), "ece": round(expected_calibration_error(out, labels), 6)}
    best = min(METHODS, key=lambda m: cv[m]["nll"])
    return fit(probs, labels, best), {"rule": f"auto: the lower {folds}-fold cross-fitted NLL", "cross_fitted": cv,
                                      "chosen": best}


def calibration_report(probs: np.ndarray, labels: np.ndarray, calibrator: "Calibrator | float", *,
                       label_names: Sequence[str] | None = None, bins: int = ECE_BINS, selection: dict | None = None) -> dict:
    """NLL, ECE, accuracy and the reliability table of ``probs`` before and after ``calibrator`` (a temperature is
    taken as temperature scaling), and the largest calibrated probability each label reaches (what tau can keep)."""
    probs, labels = _check(probs, labels)
    if not isinstance(calibrator, Calibrator):
        calibrator = Calibrator("temperature", temperature=float(calibrator))
    after = calibrator.apply(probs)
    names = list(label_names) if label_names is not None else [str(i) for i in range(probs.shape[1])]
    cited = {"temperature": "temperature scaling (Guo et al. 2017)",
             "isotonic": "per-label isotonic regression (Zadrozny & Elkan 2002)"}[calibrator.method]
    return {"method": cited, "calibrator": calibrator.to_dict(), "selection": selection or {"rule": "given"},
            "temperature": None if calibrator.temperature is None else round(float(calibrator.temperature), 6),
            "rows": int(len(labels)), "accuracy": round(float((probs.argmax(1) == labels).mean()), 6),
            "nll_before": round(negative_log_likelihood(probs, labels), 6),
            "nll_after": round(negative_log_likelihood(after, labels), 6),
            "ece_before": round(expected_calibration_error(probs, labels, bins), 6),
            "ece_after": round(expected_calibration_error(after, labels, bins), 6), "bins": bins,
            "max_probability_before": {n: round(float(probs[:, k].max()), 6) for k, n in enumerate(names)},
            "max_probability_after": {n: round(float(after[:, k].max()), 6) for k, n in enumerate(names)},
            "reliability_before": reliability(probs, labels, bins), "reliability_after": reliability(after, labels, bins)}


def plot_reliability(report: dict, path, title: str = "M on held-out real rows") -> None:
    """The reliability diagram of a :func:`calibration_report`: accuracy against confidence per bin, before
    and after temperature scaling, with the diagonal of perfect calibration and the ECE of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfectly calibrated")
    how = f"T = {report['temperature']:.2f}" if report.get("temperature") is not None else "isotonic"
    for key, colour, name in (("reliability_before", "tab:red", f"before (ECE {report['ece_before']:.3f})"),
                              ("reliability_after", "tab:blue", f"after, {how} (ECE {report['ece_after']:.3f})")):
        pts = [(b["confidence"], b["accuracy"], b["rows"]) for b in report[key] if b["rows"]]
        if pts:
            x, y, n = zip(*pts)
            ax.plot(x, y, marker="o", color=colour, label=name)
    ax.set_xlabel("confidence (top label)")
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(f"{title}\n{report['rows']:,} rows, {report['bins']} bins", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
