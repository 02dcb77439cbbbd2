"""z-filtering (Wu et al. 2022, Algorithm 1) and conditional z-filtering.

    Z <- seed set (conditional z-filtering) or the empty set
    shuffle the input D (seeded) and walk it in batches of b rows:
        before each batch, recompute from Z's counts the top-k features per label by z
        (the label's *biased features*)
        keep a row (add it to Z, updating the counts) only if none of its features is biased for
        its label; otherwise reject it to Z- with the biased feature(s) that rejected it

A feature is biased for label l if it is among the k features with the highest z(x, l) in Z
(features absent from Z are never biased; ties are broken by the feature string).

One guard the paper does not spell out: a feature is biased for l only if also z(x, l) > ``min_z``
(default 0). A feature with z <= 0 is not positively correlated with l; on real data the top-k all
have large positive z and the guard never binds, but while Z is tiny (the first rows of a walk, or
batch size 1) "top-k" would otherwise include negatively correlated features, and the null feature
among them would reject every later row of that label.

One deviation for tiny inputs: with an empty start (no seed set), the first batch is checked against an
empty Z and is kept whole, so an input of no more rows than one batch comes out unfiltered (1,000 of
1,000 rows kept at b = 1,000). :func:`z_filter` therefore walks an unconditional input of fewer than
``min_batches`` x b rows (default 20) in batches of ceil(n / ``min_batches``) instead, so at most one
row in ``min_batches`` joins Z unchecked; it warns and records ``batch_size_used`` and the reason in
the result's ``counts`` and ``params`` (and so in the build manifest). The paper walks SNLI/MNLI (550k /
393k rows) where this never binds; ``min_batches=0`` turns it off.

The hot path is vectorised: counts live in a (features x labels) array, z is updated only for the
features a batch touched (z(x, l) depends on x's counts alone), and the top-k per label is taken
from a candidate set (the touched features plus a cached ranking of the untouched ones) that is
provably enough, falling back to a full ranking when it is not. A batch's membership test is one
gather over its (row, feature) entries, no Python loop per row.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import numpy as np

from ..data.loading import labels_of, materialize
from ..data.tasks import TaskSpec, get_task
from ..utils.errors import ConfigError, EmptyResultError
from ..utils.params import options_of
from .features import FeatureMatrix, build_feature_matrices
from .zstats import count_matrix, resolve_p0

REJECTED_BY = "rejected_by"


@dataclasses.dataclass
class ZFilterOutcome:
    """Index-level result of z-filtering an input of n rows (positions in the input)."""

    kept: np.ndarray            # input positions kept, in the order they were added to Z
    rejected: np.ndarray        # input positions rejected, in walk order
    rejected_by_ids: np.ndarray     # the feature ids (int32) that rejected each rejected row, concatenated...
    rejected_by_indptr: np.ndarray  # ...row r's are rejected_by_ids[indptr[r]:indptr[r+1]]
    batch_of: np.ndarray        # batch number (int32) of every input position
    counts: np.ndarray | None   # final counts of Z (features x labels), seed included; None if left out
    n_batches: int
    full_rankings: int          # how often the top-k needed a full ranking (diagnostic)


def _z_rows(counts: np.ndarray, p0: np.ndarray, min_z: float) -> np.ndarray:
    """z for each row of a counts block; -inf (never biased) where n = 0 or z <= min_z."""
    n = counts[:, 0].copy()  # summed column by column: a row-wise sum over K = 2 or 3 is several times slower
    for l in range(1, counts.shape[1]):
        n += counts[:, l]
    safe = np.maximum(n, 1)
    p_hat = counts / safe[:, None]
    z = (p_hat - p0[None, :]) / np.sqrt(p0[None, :] * (1 - p0[None, :]) / safe[:, None])
    z[n == 0] = -np.inf
    z[z <= min_z] = -np.inf
    return z


class _TopK:
    """Top-k feature ids per label under incremental count updates (exact).

    After a full ranking, ``static[l]`` holds the best ``cache`` features of label l and ``floor[l]``
    the z of the next one, so every other feature has z <= floor. Afterwards the invariant "every
    feature outside static[l] and above[l] has z <= floor[l]" is kept by adding each updated
    feature whose z rises above the floor to ``above[l]`` (no scan over the vocabulary per batch). The top-k of the candidates
    static[l] + above[l] (at their current z) is then exact whenever its k-th z is above the
    floor (strictly: a tie at the floor could be won by an outside feature of lower id);
    otherwise a full ranking restores the invariant.
    """

    def __init__(self, z: np.ndarray, k: int, cache: int):
        self.z, self.k, self.cache = z, k, max(cache, 4 * k)
        self.K = z.shape[1]
        self.full_rankings = 0
        self._rank_all()

    def _rank(self, ids: np.ndarray, l: int, m: int) -> np.ndarray:
        """The best m of ``ids`` for label l by (z desc, id asc), finite z only."""
        zz = self.z[ids, l]
        fin = np.isfinite(zz)
        ids, zz = ids[fin], zz[fin]
        if len(ids) > m:
            kth = np.partition(-zz, m - 1)[m - 1]
            sel = -zz <= kth
            ids, zz = ids[sel], zz[sel]
        order = np.lexsort((ids, -zz))
        return ids[order][:m]

    def _rank_all(self) -> None:
        self.full_rankings += 1
        V = self.z.shape[0]
        all_ids = np.arange(V)
        self.static, self.floor = [], np.full(self.K, -np.inf)
        self.listed = np.zeros((self.K, V), bool)  # in static[l] or above[l]
        self.above: list[list[np.ndarray]] = [[] for _ in range(self.K)]
        self.n_above = np.zeros(self.K, np.int64)
        for l in range(self.K):
            ranked = self._rank(all_ids, l, self.cache + 1)
            if len(ranked) > self.cache:
                self.floor[l] = self.z[ranked[-1], l]
                ranked = ranked[:-1]
            self.static.append(ranked)
            self.listed[l, ranked] = True

    def mark(self, ids: np.ndarray, z_ids: np.ndarray | None = None) -> None:
        """Record that the z of ``ids`` changed (``z_ids``: their new rows of z, when the caller has
        them at hand): list those that rose above the floor."""
        z_ids = self.z[ids] if z_ids is None else z_ids
        for l in range(self.K):
            above = ids[z_ids[:, l] > self.floor[l]]  # few: the listed check reads only these
            new = above[~self.listed[l, above]]
            if len(new):
                self.listed[l, new] = True
                self.above[l].append(new)
                self.n_above[l] += len(new)

    def top(self) -> list[np.ndarray]:
        if self.n_above.max() > 4 * self.cache:  # keep the candidate sets small: re-rank
            self._rank_all()
            return self.top_after_full_ranking()
        out = []
        for l in range(self.K):
            # listed features whose z fell back under the floor may stay listed: they are ranked
            # at their current z, and the check below catches any that would matter
            cand = np.concatenate([self.static[l]] + self.above[l]) if self.above[l] else self.static[l]
            best = self._rank(cand, l, self.k)
            if (len(best) < self.k and np.isfinite(self.floor[l])) or (
                    len(best) == self.k and self.z[best[-1], l] <= self.floor[l]):
                self._rank_all()
                return self.top_after_full_ranking()
            out.append(best)
        return out

    def top_after_full_ranking(self) -> list[np.ndarray]:
        # right after a full ranking static[l] is the exact prefix of the order: no check needed
        return [self._rank(self.static[l], l, self.k) for l in range(self.K)]


@dataclasses.dataclass(frozen=True)
class ZFilterParams:
    """Algorithm 1's settings (a recipe's ``z_filter`` section, less ``num_proc``)."""

    top_k: int = 20         # Wu et al. 2022, Table 8: "z-filtering number of biased features 20"
    batch_size: int = 1000  # project's choice: Algorithm 1's "for sample batch D′t ⊂ D0 do" gives no size
    p0: Any = "uniform"     # the null label distribution of z: "uniform" (1/K, Gardner et al. 2021), "prior",
                            # a number or one number per label (zstats.resolve_p0)
    min_z: float = 0.0      # project's guard: biased only if also z > min_z (module docstring)


def z_filter_matrix(fm: FeatureMatrix, labels: np.ndarray, num_labels: int, *, seed: int | None = 0,
                    seed_fm: FeatureMatrix | None = None, seed_labels: np.ndarray | None = None,
                    progress: bool = True, cache: int = 2048, params: ZFilterParams | None = None,
                    **values) -> ZFilterOutcome:
    """Algorithm 1 over a feature matrix. ``seed_fm``/``seed_labels`` start Z from a seed set.

    ``params`` (or its fields as keywords: ``top_k=20, batch_size=1000, p0="uniform", min_z=0.0``): the
    algorithm's settings, :class:`ZFilterParams`. The rows are walked in an order shuffled with ``seed``
    (``seed=None`` keeps the input order). ``cache``: how many features per label the top-k keeps ranked
    between full rankings (:class:`_TopK`; the outcome is the same for any value).
    """
    from tqdm.auto import tqdm

    p = options_of(ZFilterParams, params, values, "z_filter_matrix()")
    labels = np.asarray(labels, dtype=np.int64)
    n, K = fm.n_rows, num_labels
    if len(labels) != n:
        raise ConfigError(f"{len(labels)} labels for {n} rows")
    if p.batch_size < 1 or p.top_k < 1:
        raise ConfigError(f"batch_size and top_k must be >= 1 (got {p.batch_size}, {p.top_k})")
    counts, seed_label_counts = _seed_counts(fm, seed_fm, seed_labels, K)
    if isinstance(p.p0, str) and p.p0 == "prior":
        # the prior of the full input (plus seed); fixed for the whole walk
        p0_arr = resolve_p0("prior", K, np.bincount(labels, minlength=K) + seed_label_counts)
    else:
        p0_arr = resolve_p0(p.p0, K, np.bincount(labels, minlength=K))
    order = np.random.default_rng(seed).permutation(n) if seed is not None else np.arange(n)
    walk = _Walk(fm, labels, order.astype(np.int64), counts, p0_arr, p, cache)
    n_batches = (n + p.batch_size - 1) // p.batch_size
    bar = tqdm(total=n, desc="z-filtering", unit="rows", disable=not progress)
    for b in range(n_batches):
        lo, hi = b * p.batch_size, min((b + 1) * p.batch_size, n)
        walk.batch(b, lo, hi)
        bar.update(hi - lo)
    bar.close()
    return walk.outcome(n_batches)


class _Walk:
    """The state of one walk of Algorithm 1: Z's counts, z, the top-k, and what each batch kept and rejected."""

    def __init__(self, fm: FeatureMatrix, labels: np.ndarray, order: np.ndarray, counts: np.ndarray,
                 p0: np.ndarray, params: ZFilterParams, cache: int):
        V, K = counts.shape
        self.fm, self.order, self.counts, self.p0, self.min_z, self.K = fm, order, counts, p0, params.min_z, K
        self.starts, self.lens = fm.indptr[order], np.diff(fm.indptr)[order]  # rows in walk order
        self.wl = labels[order]
        self.z = np.full((V, K), -np.inf)
        present = counts.sum(axis=1) > 0
        self.z[present] = _z_rows(counts[present], p0, self.min_z)
        self.topk = _TopK(self.z, params.top_k, cache)
        self.biased = np.zeros(V * K, bool)
        self.biased_keys = np.zeros(0, np.int64)  # the entries of ``biased`` set for the current batch
        self.kept_parts, self.rej_parts, self.rej_ids, self.rej_lens = [], [], [], []
        self.last = np.empty(V, np.int64)  # scratch: the features a batch touched, found without a pass over V
        self.flat_counts = counts.reshape(-1)
        self.batch_of = np.empty(len(order), np.int32)

    def batch(self, b: int, lo: int, hi: int) -> None:
        """Walk rows [lo, hi) of the walk order: reject those with a feature biased for their label, add the
        others to Z."""
        K, order = self.K, self.order
        self.batch_of[order[lo:hi]] = b
        top = self.topk.top()
        # per batch, work in the batch's entries and the top-k only: clearing or scanning arrays over the
        # vocabulary (millions of features) for each of thousands of batches was most of a walk's time
        self.biased[self.biased_keys] = False
        self.biased_keys = np.concatenate([top[l] * K + l for l in range(K)])
        self.biased[self.biased_keys] = True
        # gather the batch's (row, feature) entries; no copy of the whole matrix in walk order
        lens = self.lens[lo:hi]
        offsets = np.cumsum(lens) - lens
        total = int(lens.sum())
        feats = self.fm.indices[np.repeat(self.starts[lo:hi] - offsets, lens) + np.arange(total)].astype(np.int64)
        entry_row = np.repeat(np.arange(lo, hi), lens)
        hit = self.biased[feats * K + self.wl[entry_row]]
        row_hit = np.zeros(hi - lo, bool)
        row_hit[entry_row[hit] - lo] = True
        keep_local = np.flatnonzero(~row_hit)
        rej_local = np.flatnonzero(row_hit)
        if len(rej_local):
            # entries are grouped by row, so the hits of the rejected rows come out in their order
            self.rej_ids.append(feats[hit].astype(np.int32))  # vocabulary ids, as the matrix stores them
            self.rej_lens.append(np.bincount(entry_row[hit] - lo, minlength=hi - lo)[rej_local])
        self.rej_parts.append(order[lo + rej_local])
        self.kept_parts.append(order[lo + keep_local])
        if len(keep_local):
            kmask = ~row_hit[entry_row - lo]
            self._add(feats[kmask], self.wl[entry_row[kmask]])

    def _add(self, kf: np.ndarray, kl: np.ndarray) -> None:
        """Add the kept rows' entries (features ``kf`` of labels ``kl``) to Z's counts, and update z and the top-k."""
        np.add.at(self.flat_counts, kf * self.K + kl, 1)
        # each touched feature once (the last of its entries); their order does not matter: z is
        # set per feature and _TopK ranks its candidates by (z, id)
        at = np.arange(len(kf))
        self.last[kf] = at
        touched = kf[self.last[kf] == at]
        z_touched = _z_rows(self.counts[touched], self.p0, self.min_z)
        self.z[touched] = z_touched
        self.topk.mark(touched, z_touched)

    def outcome(self, n_batches: int) -> ZFilterOutcome:
        kept = np.concatenate(self.kept_parts) if self.kept_parts else np.zeros(0, np.int64)
        rejected = np.concatenate(self.rej_parts) if self.rej_parts else np.zeros(0, np.int64)
        ids, indptr = _rejecting_features(self.rej_ids, self.rej_lens)
        return ZFilterOutcome(kept, rejected, ids, indptr, self.batch_of, self.counts, n_batches,
                              self.topk.full_rankings)


def _seed_counts(fm: FeatureMatrix, seed_fm: FeatureMatrix | None, seed_labels, K: int):
    """The counts Z starts from (features x labels; the seed set's, or zeros) and the seed set's label counts."""
    V = fm.n_features
    counts = np.zeros((V, K), np.int64)
    seed_label_counts = np.zeros(K, np.int64)
    if seed_fm is not None:
        if seed_fm.n_features != V or seed_fm.vocab is not fm.vocab and not np.array_equal(seed_fm.vocab, fm.vocab):
            raise ConfigError("the seed set's feature matrix must share the input's vocabulary "
                              "(build both with build_feature_matrices)")
        sl = np.asarray(seed_labels, dtype=np.int64)
        counts += count_matrix(seed_fm, sl, K)  # in blocks of rows: small temporaries
        seed_label_counts = np.bincount(sl, minlength=K)
    return counts, seed_label_counts


def _rejecting_features(rej_ids: list, rej_lens: list) -> tuple[np.ndarray, np.ndarray]:
    """The biased features that rejected each rejected row, as CSR parts: (vocabulary ids, indptr)."""
    lens = np.concatenate(rej_lens) if rej_lens else np.zeros(0, np.int64)
    indptr = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=indptr[1:])
    ids = np.concatenate(rej_ids) if rej_ids else np.zeros(0, np.int32)
    return ids, indptr


@dataclasses.dataclass
class ZFilterResult:
    kept: object           # Dataset: the seed rows (conditional) then the kept input rows
    rejected: object       # Dataset: rejected input rows with `rejected_by` (list of feature strings)
    outcome: ZFilterOutcome
    params: dict

    @property
    def counts(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {
            "input": int(len(self.outcome.kept) + len(self.outcome.rejected)),
            "kept": int(len(self.outcome.kept)), "rejected": int(len(self.outcome.rejected)),
            "output": int(len(self.kept)), "batch_size_used": int(self.params["batch_size_used"])}
        if self.params.get("batch_size_note"):
            out["batch_size_note"] = self.params["batch_size_note"]
        return out


MIN_BATCHES = 20


def batch_size_for(n_rows: int, batch_size: int, *, conditional: bool,
                   min_batches: int = MIN_BATCHES) -> tuple[int, str | None]:
    """The batch size to walk ``n_rows`` with, and why it differs from ``batch_size`` (None if not).

    An unconditional walk keeps its first batch unchecked (Z is empty before it); with fewer than
    ``min_batches`` batches that is more than 1/``min_batches`` of the input (all of it when
    n <= b), so the batch shrinks to ceil(n / ``min_batches``). A conditional walk checks its first
    batch against the seed set, so it keeps ``batch_size``.
    """
    if conditional or min_batches <= 0 or n_rows >= min_batches * batch_size:
        return batch_size, None
    used = max(1, -(-n_rows // min_batches))
    if used >= batch_size:
        return batch_size, None
    why = (f"batch_size {batch_size} shrunk to {used} = ceil({n_rows} rows / {min_batches}): with fewer than "
           f"{min_batches} batches the first batch, checked against an empty kept set, would keep "
           f"{min(batch_size, n_rows)} of {n_rows} rows unfiltered")
    return used, why


def walk_batch_size(n_rows: int, batch_size: int, seed_rows: int, task_name: str, *,
                    min_batches: int = MIN_BATCHES, stacklevel: int = 1) -> tuple[int, str | None]:
    """The batch size a walk over ``n_rows`` rows seeded with ``seed_rows`` rows uses, and why it differs
    from ``batch_size`` (None if not), with a warning when it does: where :func:`z_filter` and
    :func:`debiased_nli.bias.compose.compose` resolve the small-input rule (:func:`batch_size_for`; a walk
    with a non-empty seed set is conditional). ``stacklevel`` as :func:`warnings.warn`'s, from the caller."""
    used, note = batch_size_for(n_rows, batch_size, conditional=seed_rows > 0, min_batches=min_batches)
    if note:
        warnings.warn(f"z-filtering {task_name!r}: {note}", stacklevel=stacklevel + 1)
    return used, note


def z_filter(ds, task: "str | TaskSpec", *, seed: int = 0, seed_dataset=None, allow_empty: bool = False,
             progress: bool = True, include_seed: bool = True, min_batches: int = MIN_BATCHES,
             params: ZFilterParams | None = None, **values) -> ZFilterResult:
    """z-filter a dataset with feature columns (Z(D)), or conditionally on ``seed_dataset`` (Z(D | S)).

    ``params`` (or its fields as keywords: ``top_k=20, batch_size=1000, p0="uniform", min_z=0.0``): the
    algorithm's settings, :class:`ZFilterParams`. The output ``kept`` holds the seed rows (when
    ``include_seed``) followed by the kept rows in the order they joined Z; ``rejected`` holds the rejected
    rows with their ``rejected_by`` features. An unconditional input of fewer than ``min_batches`` x
    ``batch_size`` rows is walked in smaller batches (:func:`walk_batch_size`, with a warning;
    ``params["batch_size_used"]`` of the result says which).
    """
    p = options_of(ZFilterParams, params, values, "z_filter()")
    task = get_task(task)
    batch_size, note = walk_batch_size(len(ds), p.batch_size, len(seed_dataset) if seed_dataset is not None else 0,
                                       task.name, min_batches=min_batches, stacklevel=2)
    if seed_dataset is not None:
        for name, d in (("input", ds), ("seed set", seed_dataset)):
            lab = d.features.get("label")
            if getattr(lab, "names", None) != list(task.labels):
                raise ConfigError(
                    f"the {name} has labels {getattr(lab, 'names', lab)}, but task {task.name!r} has "
                    f"{list(task.labels)}: the seed set must be of the same task")
        fm, seed_fm = build_feature_matrices([ds, seed_dataset])
        seed_labels = labels_of(seed_dataset)
    else:
        fm, = build_feature_matrices([ds])
        seed_fm = seed_labels = None
    labels = labels_of(ds)
    out = z_filter_matrix(fm, labels, task.num_labels, seed=seed, seed_fm=seed_fm, seed_labels=seed_labels,
                          progress=progress, params=dataclasses.replace(p, batch_size=batch_size))
    recorded = {"top_k": p.top_k, "batch_size": p.batch_size, "batch_size_used": batch_size, "seed": seed,
                "p0": p.p0, "min_z": p.min_z, "conditional": seed_dataset is not None, "min_batches": min_batches}
    if note:
        recorded["batch_size_note"] = note
    return z_filter_result(ds, out, fm.vocab, task, recorded, seed_dataset=seed_dataset if include_seed else None,
                           allow_empty=allow_empty)


def z_filter_result(ds, out: ZFilterOutcome, vocab, task: TaskSpec, params: dict, *, seed_dataset=None,
                    allow_empty: bool = False, lazy: bool = False) -> ZFilterResult:
    """The datasets of an index-level outcome: ``kept`` (``seed_dataset``'s rows, if given, then the kept
    rows of ``ds``) and ``rejected`` with ``rejected_by``. ``vocab``: the matrix's vocabulary (strings,
    as a numpy or Arrow array). ``lazy`` leaves both as selections of ``ds`` (nothing copied);
    otherwise they are gathered into tables of their own."""
    import datasets
    import pyarrow as pa

    if len(out.kept) == 0 and not allow_empty:
        raise EmptyResultError(
            f"z-filtering rejected every one of the {len(ds):,} rows of {task.name!r} (top_k={params['top_k']}, "
            f"batch_size={params.get('batch_size_used', params['batch_size'])}); try a smaller top_k or a larger batch, or check the input")
    kept = ds.select(out.kept)
    if seed_dataset is not None:
        cols = [c for c in kept.column_names if c in seed_dataset.column_names]
        kept = datasets.concatenate_datasets([seed_dataset.select_columns(cols), kept.select_columns(cols)])
    # rejected_by as a column over every input row (empty where kept), then the rejected rows as a
    # selection: no row is copied until the release writes them
    n = len(ds)
    seg = np.diff(out.rejected_by_indptr)
    by_pos = np.argsort(out.rejected, kind="stable")
    lens = seg[by_pos]
    gather = np.repeat(out.rejected_by_indptr[:-1][by_pos] - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
    lengths = np.zeros(n, np.int64)
    lengths[out.rejected] = seg
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    names_all = vocab if isinstance(vocab, pa.Array) else pa.array(vocab.tolist(), pa.string())
    by = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), names_all.take(pa.array(out.rejected_by_ids[gather])))
    from datasets.fingerprint import Hasher

    base = ds if ds._indices is None else materialize(ds)
    fp = Hasher.hash([ds._fingerprint, REJECTED_BY, params, out.rejected, out.rejected_by_ids])
    rejected = base.add_column(REJECTED_BY, by, feature=datasets.Sequence(datasets.Value("string")),
                               new_fingerprint=fp).select(out.rejected)
    if not lazy:
        kept, rejected = materialize(kept), materialize(rejected)
    return ZFilterResult(kept, rejected, out, params)


def reference_z_filter(rows: Sequence[tuple[Sequence[str], int]], num_labels: int, top_k: int, batch_size: int,
                       seed_rows: Sequence[tuple[Sequence[str], int]] = (), min_z: float = 0.0
                       ) -> tuple[list[int], list[int]]:
    """A plain dictionary-and-loop Algorithm 1 (input order as given); returns (kept, rejected) positions.

    Used by the tests and the benchmark as the straightforward baseline.
    """
    import math

    p0 = 1.0 / num_labels
    counts: dict[str, list[int]] = {}
    for feats, lab in seed_rows:
        for f in set(feats):
            counts.setdefault(f, [0] * num_labels)[lab] += 1
    kept, rejected = [], []
    for start in range(0, len(rows), batch_size):
        biased: list[set[str]] = []
        for l in range(num_labels):
            scored = []
            for f, c in counts.items():
                n = sum(c)
                if n:
                    z = (c[l] / n - p0) / math.sqrt(p0 * (1 - p0) / n)
                    if z > min_z:
                        scored.append((-z, f))
            scored.sort()
            biased.append({f for _, f in scored[:top_k]})
        for i in range(start, min(start + batch_size, len(rows))):
            feats, lab = rows[i]
            if any(f in biased[lab] for f in feats):
                rejected.append(i)
            else:
                kept.append(i)
                for f in set(feats):
                    counts.setdefault(f, [0] * num_labels)[lab] += 1
    return kept, rejected
