"""Compute every feature of a task once: the row-local extractors, then the hypothesis-only model
and its ``hypo-only-pred=<label>`` feature.

Two ways, with the same features, ids and hypothesis-only model:

* :func:`add_features` adds ``feat_<extractor>`` string columns to one dataset (one cached
  ``datasets.map``) and fits the out-of-fold hypothesis-only model on that dataset. The audit, PoE
  training and the generator's G* step use it.
* :func:`featurize_build` is the build's feature stage for D0 and new rows D_G. It reads the text
  a chunk at a time (the datasets stay Arrow, on disk when they came from files), keeps each chunk's
  feature strings only while it encodes them (:class:`~debiased_nli.bias.features.ChunkedFeatures`),
  and returns integer-id matrices for D0 and D_G over one vocabulary. The hypothesis-only model is
  fitted on D0 alone (Wu et al. 2022, appendix B, Table 11: "We train a hypothesis-only model on
  the original dataset and use its prediction as a feature"): out of fold for D0's own rows, and
  once on all of D0 to predict the new rows, so Z(D0) is a function of D0 alone.

Results are cached by fingerprint in ``cache_dir`` (default ``$DEBIASED_NLI_CACHE`` or
``~/.cache/debiased-nli``): the feature map of :func:`add_features` and the hypothesis-only
predictions of both, so a second run over the same input reads them instead of recomputing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import __version__
from ..data.loading import labels_of
from ..data.tasks import TaskSpec, get_task
from ..utils.cache import default_cache_dir, load_npz, record_dataset_files, save_npz
from ..utils.errors import ConfigError
from .features import (
    HYPO_ONLY_COLUMN,
    ChunkedFeatures,
    FeatureMatrix,
    add_feature_columns,
    build_feature_matrices,
    build_feature_matrix,
    extract_table,
    feature_columns,
    get_extractor,
)
from .hypothesis_only import (
    LOGREG_SOLVER,
    HypothesisOnlyResult,
    TfidfHypothesisOnly,
    fit_tfidf,
    out_of_fold_tfidf,
    out_of_fold_transformer,
    start_out_of_fold_tfidf,
    transformer_predictions,
)

HYPO_ONLY_EXTRACTOR = "hypo_only_v1"


def _hash(obj) -> str:
    from datasets.fingerprint import Hasher
    return Hasher.hash(obj)


def add_features(ds, task: "str | TaskSpec", *, extractors: Sequence[str] | None = None,
                 hypothesis_only: str | None = "tfidf", hypo_only_folds: int = 5, seed: int = 0,
                 cache_dir: "str | Path | None" = None, num_proc: int | None = None,
                 progress: bool = True) -> tuple[object, HypothesisOnlyResult | None]:
    """Add the task's feature columns (``feat_<extractor>``) to a canonical dataset.

    ``hypothesis_only``: ``"tfidf"`` (out-of-fold TF-IDF + logistic regression, the default), a
    mapping ``{model: PATH, folds: 5, epochs: 1, ...}`` (a transformer fine-tuned out of fold on the
    hypotheses, see :func:`~debiased_nli.bias.hypothesis_only.out_of_fold_transformer`), a model folder or
    Hub id (an already fine-tuned hypothesis-only classifier), or ``None`` to leave the feature out.
    """
    task = get_task(task)
    names = list(extractors if extractors is not None else task.features)
    for name in names:
        get_extractor(name)
    lexical = [n for n in names if HYPO_ONLY_COLUMN not in get_extractor(n).requires]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    key = _hash([ds._fingerprint, lexical, list(task.labels), __version__])
    ds = ds.remove_columns([c for c in feature_columns(ds) + [HYPO_ONLY_COLUMN] if c in ds.column_names])
    out = add_feature_columns(ds, lexical, task.labels, num_proc=num_proc,
                              cache_file_name=str(cache / f"features-{key}.arrow"),
                              desc=f"features ({len(lexical)} extractors)")
    record_dataset_files(out, cache)
    if HYPO_ONLY_EXTRACTOR not in names or hypothesis_only is None:
        return out, None
    labels = labels_of(out)
    if hypothesis_only == "tfidf":
        params = {"folds": hypo_only_folds, "seed": seed, "solver": LOGREG_SOLVER}
        pkey = _hash([ds._fingerprint, lexical, params, __version__])
        cached = cache / f"hypo-only-{pkey}.npz"
        result = _read_tfidf_result(cached, len(out))
        if result is None:
            fm = build_feature_matrix(out)
            result = out_of_fold_tfidf(fm, labels, task.num_labels, folds=hypo_only_folds, seed=seed,
                                       progress=progress)
            _save_tfidf_result(cached, result)
    elif isinstance(hypothesis_only, dict):
        result, _ = out_of_fold_transformer(out["hypothesis"], labels, task, hypothesis_only, seed=seed,
                                            work_dir=transformer_dir(cache, ds, hypothesis_only, seed), progress=progress)
    else:
        result = transformer_predictions(hypothesis_only, out["hypothesis"], labels, task.labels, progress=progress)
    out = out.add_column(HYPO_ONLY_COLUMN, result.predictions.astype(np.int64).tolist())
    out = add_feature_columns(out, [HYPO_ONLY_EXTRACTOR], task.labels, desc="hypothesis-only feature",
                              cache_file_name=_hypo_only_map_file(cache, out, task))
    record_dataset_files(out, cache)
    return out, result


def _hypo_only_map_file(cache: Path, ds, task: TaskSpec) -> str:
    """Where the map that adds the hypothesis-only feature keeps its Arrow file (named here, so that it
    is checked before it is read: see :func:`~debiased_nli.bias.features.add_feature_columns`)."""
    return str(cache / f"features-{_hash([ds._fingerprint, HYPO_ONLY_EXTRACTOR, list(task.labels), __version__])}.arrow")


def _read_tfidf_result(path: Path, n_rows: int) -> HypothesisOnlyResult | None:
    """The cached out-of-fold TF-IDF result, or None (absent, unreadable or of another length: a miss)."""
    from ..utils.cache import discard_entry

    z = load_npz(path, ("pred", "probs", "acc", "params"))
    if z is None:
        return None
    if len(z["pred"]) != n_rows or len(z["probs"]) != n_rows:
        discard_entry(path, f"{len(z['pred'])} rows, expected {n_rows}")
        return None
    return HypothesisOnlyResult(z["pred"], z["probs"], float(z["acc"]), "tfidf-logreg-oof", json.loads(str(z["params"])))


def _save_tfidf_result(path: Path, result: HypothesisOnlyResult) -> None:
    save_npz(path, pred=result.predictions, probs=result.probabilities, acc=result.accuracy,
             params=json.dumps(result.params))


def add_features_pair(d0, dg, task: TaskSpec, *, hypothesis_only: "str | dict | None" = "tfidf",
                      folds: int = 5, seed: int = 0, cache_dir: "str | Path | None" = None,
                      num_proc: int | None = None, progress: bool = True):
    """D0 and D_G with their ``feat_*`` columns (strings, as :func:`add_features` adds them), the
    hypothesis-only model fitted on D0 alone: out of fold for D0, on all of D0 for D_G. Returns
    ``(d0_f, dg_f or None, D0's hypothesis-only result)``.

    The in-memory counterpart of :func:`featurize_build` (``features.storage: columns`` in a recipe):
    the same features and predictions, with every row's feature strings held as columns.
    """
    d0_f, result = add_features(d0, task, hypothesis_only=hypothesis_only, hypo_only_folds=folds, seed=seed,
                                cache_dir=cache_dir, num_proc=num_proc, progress=progress)
    if dg is None:
        return d0_f, None, result
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    lexical = [n for n in task.features if HYPO_ONLY_COLUMN not in get_extractor(n).requires]
    dg = dg.remove_columns([c for c in feature_columns(dg) + [HYPO_ONLY_COLUMN] if c in dg.column_names])
    key = _hash([dg._fingerprint, lexical, list(task.labels), __version__])
    dg_f = add_feature_columns(dg, lexical, task.labels, num_proc=num_proc,
                               cache_file_name=str(cache / f"features-{key}.arrow"),
                               desc=f"features of the new rows ({len(lexical)} extractors)")
    record_dataset_files(dg_f, cache)
    if result is None:
        return d0_f, dg_f, None
    if hypothesis_only == "tfidf":
        cols = [get_extractor(n).column for n in lexical]
        fm0, fmg = build_feature_matrices([d0_f, dg_f], cols)
        pred = fit_tfidf(fm0, labels_of(d0_f), task.num_labels, seed=seed).predict(fmg)  # exact tie rule
    elif isinstance(hypothesis_only, dict):
        _, probs = out_of_fold_transformer(d0["hypothesis"], labels_of(d0), task, hypothesis_only, seed=seed,
                                           work_dir=transformer_dir(cache, d0, hypothesis_only, seed),
                                           new_hypotheses=dg["hypothesis"], progress=progress)
        pred = probs.argmax(axis=1)
    else:
        pred = transformer_predictions(hypothesis_only, dg["hypothesis"], labels_of(dg), task.labels,
                                       progress=progress).predictions
    dg_f = dg_f.add_column(HYPO_ONLY_COLUMN, np.asarray(pred, np.int64).tolist())
    dg_f = add_feature_columns(dg_f, [HYPO_ONLY_EXTRACTOR], task.labels, desc="hypothesis-only feature",
                               cache_file_name=_hypo_only_map_file(cache, dg_f, task))
    record_dataset_files(dg_f, cache)
    return d0_f, dg_f, result


def transformer_dir(cache: Path, d0, params: dict, seed: int) -> Path:
    """Where the out-of-fold transformer keeps its folds: one folder per (D0, settings, seed)."""
    from .hypothesis_only import TRANSFORMER_RUNTIME_KEYS, transformer_params

    key = {k: v for k, v in transformer_params(params).items() if k not in TRANSFORMER_RUNTIME_KEYS}
    return cache / f"hypo-only-transformer-{_hash([d0._fingerprint, key, seed, __version__])}"


# ---------------------------------------------------------------------------------------------
# the build's feature stage: chunks of text in, integer-id matrices out

@dataclasses.dataclass
class BuildFeatures:
    """The features of D0 and D_G over one vocabulary, and the hypothesis-only model's record."""

    d0: FeatureMatrix
    dg: FeatureMatrix | None
    hypothesis_only: HypothesisOnlyResult | None   # out of fold on D0
    new_rows_hypothesis_only: dict | None           # what the full-D0 model predicted for D_G
    seconds: dict[str, float]

    @property
    def n_features(self) -> int:
        return self.d0.n_features


# what a chunk job reads: set before the worker processes fork, so that they inherit it
_WORK: dict = {}


def _encode_chunk(job):
    """Features of rows [start, stop) of one input, encoded (runs in the main or a forked process)."""
    key, start, stop = job
    table = _WORK["views"][key][start:stop]  # zero-copy slice of a memory-mapped dataset
    feats = extract_table(table, _WORK["extractors"], _WORK["labels"], keep_dictionary=True)
    return ChunkedFeatures.encode(feats, _WORK["columns"], _WORK["present"])


def _map_chunks(jobs, num_proc: "int | str | None"):
    """The encoded chunks of ``jobs``, in order; one chunk's strings live in a process at a time.
    ``num_proc="auto"``: the CPUs this process may use, at most 4."""
    if num_proc == "auto":
        num_proc = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if not num_proc or int(num_proc) <= 1 or len(jobs) <= 1:
        yield from map(_encode_chunk, jobs)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(int(num_proc)) as pool:
        yield from pool.imap(_encode_chunk, jobs)  # in order; a worker's codes are pickled back


@dataclasses.dataclass(frozen=True)
class FeatureWork:
    """How :func:`featurize_build` splits its work; none of it changes the result. ``chunk_rows``: rows per
    chunk; ``num_proc``: processes that extract chunks (forked; each returns its chunk's codes;
    ``"auto"``: the usable CPUs, at most 4); ``n_jobs``: processes that fit the TF-IDF model's folds."""

    chunk_rows: int = 100_000
    num_proc: "int | str | None" = None
    n_jobs: "int | str | None" = None


@dataclasses.dataclass
class _Job:
    """What the parts of one :func:`featurize_build` share."""

    d0: object
    dg: object
    task: TaskSpec
    spec: "str | dict"   # the hypothesis-only model: "tfidf", a transformer's settings, or a classifier
    folds: int
    seed: int
    lexical: list        # the extractors that need no hypothesis-only model
    cache: Path
    n_jobs: "int | str | None"
    progress: bool

    def tfidf_cache(self) -> tuple[Path, Path | None]:
        """Where the TF-IDF model's out-of-fold predictions on D0, and its predictions of D_G, are cached."""
        params = {"folds": self.folds, "seed": self.seed, "solver": LOGREG_SOLVER}
        key = _hash([self.d0._fingerprint, [e.name for e in self.lexical], params, __version__])
        return (self.cache / f"hypo-only-{key}.npz",
                self.cache / f"hypo-only-{key}-new-{_hash(self.dg._fingerprint)}.npz" if self.dg is not None else None)


def featurize_build(d0, dg, task: TaskSpec, *, hypothesis_only: "str | dict | None" = "tfidf",
                    folds: int = 5, seed: int = 0, work: FeatureWork | None = None,
                    cache_dir: "str | Path | None" = None, progress: bool = True) -> BuildFeatures:
    """The task's features of D0 and (optionally) D_G as integer-id matrices over one vocabulary.

    Same features, ids (lexicographic order of the strings), row layout and hypothesis-only model
    on D0 as :func:`add_features` followed by :func:`~debiased_nli.bias.features.build_feature_matrices`,
    but no row's feature strings outlive its chunk, and the hypothesis-only model is fitted on D0
    only (out of fold for D0; on all of D0 for D_G). ``work``: how the work is split over chunks and
    processes (:class:`FeatureWork`); it does not change the result.
    """
    work = work or FeatureWork()
    exts = [get_extractor(n) for n in task.features]
    lexical = [e for e in exts if HYPO_ONLY_COLUMN not in e.requires]
    hypo = [e for e in exts if HYPO_ONLY_COLUMN in e.requires]
    use_hypo = bool(hypo) and hypothesis_only is not None
    # the row layout of add_features: the lexical columns in the task's order, then the hypothesis-only one
    columns = [e.column for e in lexical] + ([hypo[0].column] if use_hypo else [])
    cf = ChunkedFeatures(columns)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    job = _Job(d0, dg, task, hypothesis_only, folds, seed, lexical, cache, work.n_jobs, progress)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    parts, started = _extract_chunks(job, cf, columns, work, use_tfidf=use_hypo and hypothesis_only == "tfidf",
                                     seconds=seconds)
    hypo_names = [f"hypo-only-pred={name}" for name in task.labels]
    cf.finalize(extra=hypo_names if use_hypo else ())
    seconds["lexical features"] = time.perf_counter() - t0 - seconds.get("hypothesis-only model: start", 0.0)

    result, new_info = None, None
    if use_hypo:
        t1 = time.perf_counter()
        pred0, pred_g, result, new_info = _hypothesis_only(job, cf, parts, started)
        hypo_ids = np.array([cf.feature_id(n) for n in hypo_names], np.int32)
        for key, pred in (("d0", pred0), ("dg", pred_g)):
            start = 0
            for i in parts[key]:
                m = cf.chunks[i].n_rows
                cf.set_column(hypo[0].column, i, np.ones(m, np.int32), hypo_ids[pred[start:start + m]])
                start += m
        seconds["hypothesis-only model"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    fm0 = cf.matrix(parts["d0"], release=True)
    fmg = cf.matrix(parts["dg"], release=True) if dg is not None else None
    seconds["feature matrix"] = time.perf_counter() - t2
    return BuildFeatures(fm0, fmg, result, new_info, {k: round(v, 3) for k, v in seconds.items()})


def _extract_chunks(job: _Job, cf: ChunkedFeatures, columns: list[str], work: FeatureWork, *, use_tfidf: bool,
                    seconds: dict) -> tuple[dict[str, list[int]], dict | None]:
    """Extract the lexical features of D0 and D_G a chunk at a time into ``cf`` (row layout ``columns``): the
    chunk numbers of each input, and the TF-IDF model's fits (:func:`_start_tfidf`) when ``use_tfidf``,
    started as soon as D0's chunks are in."""
    from tqdm.auto import tqdm

    d0, dg, lexical = job.d0, job.dg, job.lexical
    needs = ["premise", "hypothesis"] + sorted({c for e in lexical for c in e.requires} - {"premise", "hypothesis"})
    parts: dict[str, list[int]] = {"d0": [], "dg": []}
    sources = {"d0": d0, "dg": dg}
    jobs = [(key, start, min(start + work.chunk_rows, len(ds))) for key, ds in sources.items() if ds is not None
            for start in range(0, len(ds), work.chunk_rows)]
    total = len(d0) + (len(dg) if dg is not None else 0)
    _WORK.update(views={k: ds.select_columns(needs).with_format("arrow") for k, ds in sources.items() if ds is not None},
                 extractors=[e.name for e in lexical], labels=list(job.task.labels), columns=columns,
                 present=[e.column for e in lexical])
    # The TF-IDF hypothesis-only model reads D0 alone: its fits start as soon as D0's chunks are in, on
    # D0's own vocabulary (same strings in the same order as in the final one, so the same fits), and
    # run in their own processes while the new rows' features are extracted.
    n_d0_jobs = sum(1 for key, _, _ in jobs if key == "d0")
    started = None

    def start_tfidf():
        t = time.perf_counter()
        out = _start_tfidf(job, cf, parts["d0"])
        seconds["hypothesis-only model: start"] = time.perf_counter() - t
        return out

    try:
        with tqdm(total=total, desc=f"features ({len(lexical)} extractors)", unit="rows",
                  disable=not job.progress) as bar:
            if use_tfidf and n_d0_jobs == 0:
                started = start_tfidf()
            for (key, start, stop), chunk in zip(jobs, _map_chunks(jobs, work.num_proc)):
                parts[key].append(cf.append(chunk))
                bar.update(stop - start)
                if use_tfidf and key == "d0" and len(parts["d0"]) == n_d0_jobs:
                    started = start_tfidf()
    finally:
        _WORK.clear()
    return parts, started


def _start_tfidf(job: _Job, cf: ChunkedFeatures, d0_chunks) -> dict:
    """Start the TF-IDF model's fits on D0 (before the vocabulary is final; see
    :meth:`ChunkedFeatures.local_matrix`): what is not cached already is fitted."""
    d0, dg = job.d0, job.dg
    oof_path, new_path = job.tfidf_cache()
    # read (and checked) now: an unreadable entry is a miss, recomputed like an absent one
    cached_oof = _read_tfidf_result(oof_path, len(d0))
    cached_new = load_npy_pred(new_path, len(dg)) if new_path is not None else None
    state = {"need_oof": cached_oof is None, "need_full": new_path is not None and cached_new is None,
             "finish": None, "local_vocab": None, "oof": cached_oof, "new": cached_new}
    if state["need_oof"] or state["need_full"]:
        labels0 = labels_of(d0)
        fm0 = cf.local_matrix(d0_chunks, columns=[e.column for e in job.lexical])
        if state["need_oof"]:
            state["finish"] = start_out_of_fold_tfidf(fm0, labels0, job.task.num_labels, folds=job.folds,
                                                      seed=job.seed, progress=job.progress,
                                                      full_model=state["need_full"], n_jobs=job.n_jobs)
        else:
            model = fit_tfidf(fm0, labels0, job.task.num_labels, seed=job.seed)
            state["finish"] = lambda: model
        state["local_vocab"] = fm0.vocab_array()
    return state


def load_npy_pred(path: Path, n_rows: int) -> np.ndarray | None:
    """The cached predictions of the new rows (``pred`` of an ``.npz``), or None: a miss."""
    from ..utils.cache import discard_entry

    z = load_npz(path, ("pred",))
    if z is not None and len(z["pred"]) != n_rows:
        discard_entry(path, f"{len(z['pred'])} rows, expected {n_rows}")
        return None
    return None if z is None else z["pred"]


def _in_final_vocab(model: TfidfHypothesisOnly, local_vocab, vocab: np.ndarray) -> TfidfHypothesisOnly:
    """The model with its input columns as ids of the final vocabulary instead of D0's own."""
    names = np.array(local_vocab.take(model.columns).to_pylist(), dtype=object)
    ids = np.searchsorted(vocab, names)
    if len(names) and (ids.max() >= len(vocab) or not np.array_equal(vocab[ids], names)):
        raise RuntimeError("a hypothesis-only input feature of D0 is missing from the final vocabulary")
    return dataclasses.replace(model, columns=ids.astype(np.int64))


def _hypothesis_only(job: _Job, cf: ChunkedFeatures, parts, started: dict | None = None):
    """(D0's out-of-fold predictions, D_G's predictions by the full-D0 model, D0's result, D_G's record).

    ``started``: the TF-IDF fits :func:`_start_tfidf` started while the features were extracted."""
    d0, dg, task, spec = job.d0, job.dg, job.task, job.spec
    labels0 = labels_of(d0)
    if spec == "tfidf":
        result, pred_g = _finish_tfidf(job, cf, parts, started)
    elif isinstance(spec, dict):
        result, probs_g = out_of_fold_transformer(d0["hypothesis"], labels0, task, spec, seed=job.seed,
                                                  work_dir=transformer_dir(job.cache, d0, spec, job.seed),
                                                  new_hypotheses=dg["hypothesis"] if dg is not None else None,
                                                  progress=job.progress)
        pred_g = probs_g.argmax(axis=1) if probs_g is not None else (np.zeros(0, np.int64) if dg is not None else None)
    else:
        result = transformer_predictions(spec, d0["hypothesis"], labels0, task.labels, progress=job.progress)
        pred_g = None
        if dg is not None:
            pred_g = transformer_predictions(spec, dg["hypothesis"], labels_of(dg), task.labels,
                                             progress=job.progress).predictions
    new_info = None
    if dg is not None:
        labels_g = labels_of(dg)
        new_info = {"rows": int(len(pred_g)), "fitted_on": "D0",
                    "agreement_with_labels": round(float((pred_g == labels_g).mean()), 6) if len(pred_g) else None,
                    "predicted": {name: int(c) for name, c in
                                  zip(task.labels, np.bincount(pred_g, minlength=task.num_labels))}}
    return result.predictions.astype(np.int64), (pred_g.astype(np.int64) if pred_g is not None else None), result, new_info


def _finish_tfidf(job: _Job, cf: ChunkedFeatures, parts, started: dict | None):
    """The TF-IDF model's result on D0 and its predictions of D_G (None without D_G): from the fits
    :func:`_start_tfidf` started, or from the cache; what was fitted is written to the cache."""
    if started is None:
        raise RuntimeError("the TF-IDF hypothesis-only model was not started on D0's chunks")
    oof_path, new_path = job.tfidf_cache()
    model = None
    if started["need_oof"]:
        out = started["finish"]()
        result, model = out if started["need_full"] else (out, None)
        _save_tfidf_result(oof_path, result)
    else:
        result = started["oof"]
        if started["need_full"]:
            model = started["finish"]()
    pred_g = None
    if job.dg is not None:
        if started["need_full"]:
            model = _in_final_vocab(model, started["local_vocab"], cf.vocab)
            lexical_cols = [e.column for e in job.lexical]
            pred_g = np.concatenate([model.predict(cf.matrix([i], columns=lexical_cols))  # exact tie rule
                                     for i in parts["dg"]]) if parts["dg"] else np.zeros(0, np.int64)
            save_npz(new_path, pred=pred_g)
        else:
            pred_g = started["new"]
    return result, pred_g
