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

Calibration is measured by the expected calibration error (Naeini, Cooper & Hauskrecht 2015; Guo et
al.'s form: 15 equal-width bins of the top-label confidence, ``ECE = sum_b |B_b|/n |acc(B_b) -
conf(B_b)|``), before and after, with the reliability table each is computed from. The bounds of T
(0.05 to 20) and the 15 bins are the project's choice (Guo et al. use 15 bins; they give no bounds).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..utils.errors import ConfigError

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


def calibration_report(probs: np.ndarray, labels: np.ndarray, temperature: float, *,
                       label_names: Sequence[str] | None = None, bins: int = ECE_BINS) -> dict:
    """NLL, ECE, accuracy and the reliability table of ``probs`` before and after temperature ``T``, and the
    largest calibrated probability each label reaches (what tau can keep of it)."""
    probs, labels = _check(probs, labels)
    after = temperature_scale(probs, temperature)
    names = list(label_names) if label_names is not None else [str(i) for i in range(probs.shape[1])]
    return {"method": "temperature scaling (Guo et al. 2017)", "temperature": round(float(temperature), 6),
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
    for key, colour, name in (("reliability_before", "tab:red", f"before (ECE {report['ece_before']:.3f})"),
                              ("reliability_after", "tab:blue",
                               f"after, T = {report['temperature']:.2f} (ECE {report['ece_after']:.3f})")):
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
