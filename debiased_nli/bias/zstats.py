"""z-statistics of features against labels (Gardner et al. 2021; Wu et al. 2022).

For a feature x present in n rows and a label l, with p_hat(l|x) the share of those rows labelled l
and p0 the expected share (1/K by default, or the label prior):

    z(x, l) = (p_hat(l|x) - p0) / sqrt(p0 (1 - p0) / n)

A feature seen only with label l has p_hat = 1 and z = sqrt(n) (1 - p0) / sqrt(p0 (1 - p0)).
Everything is computed from a count matrix (features x labels) built with one ``np.bincount``
over integer feature ids, so it is linear in the number of stored (row, feature) entries.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from scipy import stats as sstats

from ..utils.errors import ConfigError
from .features import FeatureMatrix


def count_matrix(fm: FeatureMatrix, labels: np.ndarray, num_labels: int, rows: np.ndarray | None = None,
                 block_rows: int = 1 << 17) -> np.ndarray:
    """counts[x, l] = number of rows (optionally only ``rows``: a boolean mask, or row positions) with
    feature x and label l. Counted over blocks of rows, so the temporary keys stay small (131,072 rows
    of about 47 features: three arrays of about 50 MB; blocks of 524,288 rows took 600 MB)."""
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) != fm.n_rows:
        raise ConfigError(f"{len(labels)} labels for a feature matrix of {fm.n_rows} rows")
    mask = None
    if rows is not None:
        rows = np.asarray(rows)
        mask = rows.astype(bool) if rows.dtype == bool else np.zeros(fm.n_rows, bool)
        if rows.dtype != bool:
            mask[rows] = True
    size = fm.n_features * num_labels
    counts = np.zeros(size, np.int64)
    lens = np.diff(fm.indptr)
    for lo in range(0, fm.n_rows, block_rows):
        hi = min(lo + block_rows, fm.n_rows)
        ln = lens[lo:hi]
        lab = labels[lo:hi]
        if mask is not None:
            ln = np.where(mask[lo:hi], ln, 0)
            entry_keep = np.repeat(mask[lo:hi], lens[lo:hi])
            ids = fm.indices[fm.indptr[lo]:fm.indptr[hi]][entry_keep]
        else:
            ids = fm.indices[fm.indptr[lo]:fm.indptr[hi]]
        keys = ids.astype(np.int64) * num_labels + np.repeat(lab, ln)
        counts += np.bincount(keys, minlength=size)
    return counts.reshape(fm.n_features, num_labels)


def resolve_p0(p0: "str | float | Sequence[float] | None", num_labels: int, label_counts: np.ndarray) -> np.ndarray:
    if p0 is None or p0 == "uniform":
        return np.full(num_labels, 1.0 / num_labels)
    if p0 == "prior":
        total = label_counts.sum()
        if total == 0:
            raise ConfigError("p0='prior' needs at least one row")
        return label_counts / total
    arr = np.broadcast_to(np.asarray(p0, dtype=float), (num_labels,)).copy()
    if np.any(arr <= 0) or np.any(arr >= 1):
        raise ConfigError(f"p0 must lie strictly between 0 and 1, got {arr.tolist()}")
    return arr


def z_from_counts(counts: np.ndarray, p0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, p_hat, z) from a features x labels count matrix. Features with n = 0 get p_hat = p0, z = 0."""
    n = counts.sum(axis=1)
    safe_n = np.maximum(n, 1)[:, None]
    p_hat = np.where(n[:, None] > 0, counts / safe_n, p0[None, :])
    z = (p_hat - p0[None, :]) / np.sqrt(p0 * (1 - p0) / safe_n)
    return n, p_hat, z


def bonferroni_threshold(n_tests: int, alpha: float = 0.01) -> float:
    """|z| above which a feature-label pair is significant at level alpha, Bonferroni-corrected
    for ``n_tests`` tests (two-sided), as Gardner et al. (2021) draw it."""
    return float(sstats.norm.isf(alpha / (2 * max(n_tests, 1))))


@dataclasses.dataclass
class ZStats:
    vocab: np.ndarray
    label_names: tuple[str, ...]
    counts: np.ndarray  # V x K
    n: np.ndarray       # V
    p_hat: np.ndarray   # V x K
    z: np.ndarray       # V x K
    p0: np.ndarray      # K
    n_rows: int

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def top_k(self, k: int = 20, min_n: int = 1) -> np.ndarray:
        """ids[l, :] = the (up to) k features with the highest z for label l, best first (-1 pads)."""
        out = np.full((self.num_labels, k), -1, dtype=np.int64)
        present = self.n >= max(min_n, 1)
        for l in range(self.num_labels):
            out[l] = top_k_ids(self.z[:, l], k, present)
        return out

    def count_above(self, threshold: float) -> dict[str, int]:
        present = self.n > 0
        return {name: int(np.sum(present & (np.abs(self.z[:, l]) > threshold)))
                for l, name in enumerate(self.label_names)}

    def max_abs_z(self, exclude: Sequence[str] = ()) -> float:
        """The largest |z| of the features present, without those named in ``exclude`` (found by binary
        search: the vocabulary is in string order, as :class:`FeatureMatrix` ids are)."""
        keep = self.n > 0
        for name in exclude:
            # the vocabulary is in string order (FeatureMatrix ids): a binary search, not a comparison with
            # each of millions of strings (which, in a forked process, also copies every page they are on)
            j = int(np.searchsorted(self.vocab, name))
            if j < len(self.vocab) and self.vocab[j] == name:
                keep[j] = False
        return float(np.abs(self.z[keep]).max()) if keep.any() else 0.0

    def records(self, ids: np.ndarray | None = None, label: int | None = None) -> list[dict]:
        """``{feature, label, n, p_hat, z}`` for feature ids (all labels, or one)."""
        ids = np.arange(len(self.vocab)) if ids is None else np.asarray(ids)
        labs = range(self.num_labels) if label is None else [label]
        return [{"feature": str(self.vocab[i]), "label": self.label_names[l], "n": int(self.n[i]),
                 "p_hat": round(float(self.p_hat[i, l]), 6), "z": round(float(self.z[i, l]), 4)}
                for l in labs for i in ids if i >= 0]

    def top_records(self, k: int = 20) -> list[dict]:
        top = self.top_k(k)
        return [r for l in range(self.num_labels) for r in self.records(top[l], label=l)]


def top_k_ids(scores: np.ndarray, k: int, valid: np.ndarray | None = None) -> np.ndarray:
    """The k highest-scoring ids (ties broken by lower id), best first; -1 pads when fewer are valid."""
    scores = np.where(valid, scores, -np.inf) if valid is not None else scores
    n_valid = int(np.isfinite(scores).sum())
    k_eff = min(k, n_valid)
    out = np.full(k, -1, dtype=np.int64)
    if k_eff == 0:
        return out
    # argpartition, then a stable order on (-score, id) of the candidates and their ties
    kth = np.partition(scores, len(scores) - k_eff)[len(scores) - k_eff]
    cand = np.nonzero(scores >= kth)[0]
    order = np.lexsort((cand, -scores[cand]))
    out[:k_eff] = cand[order][:k_eff]
    return out


def group_labels(label_names: Sequence[str], label_groups: "Sequence[Sequence[str]] | None"
                 ) -> tuple[np.ndarray, tuple[str, ...]]:
    """(group of each label, group names) for ``label_groups``, e.g. FEVER's ``[["SUPPORTS"],
    ["REFUTES", "NOT ENOUGH INFO"]]`` (Guo et al. 2023, section 4.2: "we view 'refutes' and 'not enough
    information' as one class when computing z-values"). A group is named by its labels joined with
    ``+``; ``None`` keeps every label its own group. Every label must be in exactly one group."""
    names = [str(n) for n in label_names]
    if not label_groups:
        return np.arange(len(names), dtype=np.int64), tuple(names)
    group_of = np.full(len(names), -1, dtype=np.int64)
    for g, group in enumerate(label_groups):
        if isinstance(group, str) or not len(group):
            raise ConfigError(f"label_groups must be a list of non-empty label lists, got {list(label_groups)}")
        for name in group:
            if str(name) not in names:
                raise ConfigError(f"label_groups: {name!r} is not one of the labels {names}")
            if group_of[names.index(str(name))] >= 0:
                raise ConfigError(f"label_groups: {name!r} is in two groups")
            group_of[names.index(str(name))] = g
    missing = [n for n, g in zip(names, group_of) if g < 0]
    if missing:
        raise ConfigError(f"label_groups leaves out the label(s) {missing}; every label needs a group")
    if len(label_groups) < 2:
        raise ConfigError("label_groups needs at least two groups")
    return group_of, tuple("+".join(str(n) for n in group) for group in label_groups)


def compute_zstats(fm: FeatureMatrix, labels: np.ndarray, label_names: Sequence[str],
                   p0: "str | float | Sequence[float] | None" = "uniform", rows: np.ndarray | None = None,
                   label_groups: "Sequence[Sequence[str]] | None" = None) -> ZStats:
    """z-statistics of every feature and label (optionally over a boolean row mask).

    With ``label_groups`` (see :func:`group_labels`) the statistics are over the groups: K is the
    number of groups and ``label_names`` of the result are the group names."""
    labels = np.asarray(labels, dtype=np.int64)
    if label_groups:
        group_of, label_names = group_labels(label_names, label_groups)
        labels = group_of[labels]
    K = len(label_names)
    counts = count_matrix(fm, labels, K, rows)
    sel = labels if rows is None else labels[np.asarray(rows, bool)]
    label_counts = np.bincount(sel, minlength=K)
    p0_arr = resolve_p0(p0, K, label_counts)
    n, p_hat, z = z_from_counts(counts, p0_arr)
    return ZStats(fm.vocab, tuple(label_names), counts, n, p_hat, z, p0_arr, int(len(sel)))


def compute_zstats_parts(parts: Sequence[tuple[FeatureMatrix, np.ndarray, "np.ndarray | None"]],
                         label_names: Sequence[str], p0: "str | float | Sequence[float] | None" = "uniform") -> ZStats:
    """z-statistics of the union of several row sets, each ``(matrix, labels, rows or None)``; the
    matrices share one vocabulary (e.g. D0's and D_G's from one build). Same numbers as
    :func:`compute_zstats` over the concatenated rows, without building that matrix."""
    if not parts:
        raise ConfigError("compute_zstats_parts needs at least one part")
    K = len(label_names)
    vocab = parts[0][0].vocab
    counts = np.zeros((len(vocab), K), np.int64)
    label_counts = np.zeros(K, np.int64)
    for fm, labels, rows in parts:
        if fm.vocab is not vocab and (len(fm.vocab) != len(vocab) or not np.array_equal(fm.vocab, vocab)):
            raise ConfigError("the parts' feature matrices must share one vocabulary")
        labels = np.asarray(labels, dtype=np.int64)
        counts += count_matrix(fm, labels, K, rows)
        if rows is None:
            sel = labels
        else:
            rows = np.asarray(rows)
            sel = labels[rows]
        label_counts += np.bincount(sel, minlength=K)
    p0_arr = resolve_p0(p0, K, label_counts)
    n, p_hat, z = z_from_counts(counts, p0_arr)
    return ZStats(vocab, tuple(label_names), counts, n, p_hat, z, p0_arr, int(label_counts.sum()))


def z_only_label(n: int, p0: float) -> float:
    """z of a feature seen in n rows, all with the same label: sqrt(n) (1 - p0) / sqrt(p0 (1 - p0))."""
    return math.sqrt(n) * (1 - p0) / math.sqrt(p0 * (1 - p0))
