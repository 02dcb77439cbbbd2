"""The z-filtering compositions of a release (Wu et al. 2022, section 3): Z(D0), Z-Aug = Z(D_G | D0),
Par-Z = Z(D0) ∪ Z(D_G) and Seq-Z = Z(D_G | Z(D0)), walked from one set of feature matrices, the walks over
D_G at once in forked processes where that pays.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

from ..data.loading import labels_of, materialize
from ..data.tasks import TaskSpec
from ..utils.processes import can_fork, freeze_gc, return_free_memory, unfreeze_gc, usable_cpus
from .features import FeatureMatrix, build_feature_matrices, build_feature_matrix
from .zfilter import (
    MIN_BATCHES,
    ZFilterOutcome,
    ZFilterParams,
    ZFilterResult,
    walk_batch_size,
    z_filter_matrix,
    z_filter_result,
)


def compose(d0, dg, task: TaskSpec, *, params: ZFilterParams | None = None, seed: int = 0,
            configs: Sequence[str] | None = None, progress: bool = True,
            features: "tuple[FeatureMatrix, FeatureMatrix | None] | None" = None,
            seconds: dict | None = None, num_proc: "int | str | None" = None) -> dict[str, ZFilterResult]:
    """The z-filtering compositions available for D0 (and D_G when given), keyed by config name.

    ``params``: Algorithm 1's settings (:class:`~debiased_nli.bias.zfilter.ZFilterParams`; default: its
    defaults); ``seed`` shuffles every walk. ``features``: the feature matrices of D0 and D_G over one
    vocabulary (e.g. from :func:`~debiased_nli.bias.task_features.featurize_build`); otherwise both inputs must
    carry feature columns computed together (same extractors, one hypothesis-only model), and their matrices
    are built here, once. Every composition is z-filtered from these matrices: Z-Aug is seeded with D0's
    rows, Seq-Z with Z(D0)'s (the counts of a seed set do not depend on its order). Z(D0) is walked
    first; the walks over D_G (Z-Aug, Par-Z's Z(D_G), Seq-Z) do not depend on each other and run at once
    in ``num_proc`` processes (``"auto"``: see :func:`worker_processes`; ``None`` or 1: one after the other, in
    this process); the result is the same either way. ``seconds``, when given, receives each
    composition's wall time (the walks' overlap when they run at once).
    """
    wanted = set(configs) if configs else None
    has_new = dg is not None and len(dg) > 0
    if features is None:
        fm0, fmg = build_feature_matrices([d0, dg]) if has_new else (build_feature_matrix(d0), None)
    else:
        fm0, fmg = features
    labels0 = labels_of(d0)
    walks = _Walks(task, params or ZFilterParams(), seed, fm0.vocab_array(), seconds)
    if wanted is None or wanted & {"z_filtered", "par_z", "seq_z"}:
        walks.plan("z_filtered", d0, fm0, labels0, allow_empty=False)
        walks.run(["z_filtered"], 1, progress)
    if has_new:
        labels_g = labels_of(dg)
        if wanted is None or "z_aug" in wanted:
            walks.plan("z_aug", dg, fmg, labels_g, seed_set=(d0, fm0, labels0))
        if wanted is None or "par_z" in wanted:
            walks.plan("par_z_new", dg, fmg, labels_g)
        if wanted is None or "seq_z" in wanted:
            z0 = walks.out["z_filtered"]
            kept0 = z0.outcome.kept
            walks.plan("seq_z", dg, fmg, labels_g, seed_set=(z0.kept, fm0.select(kept0), labels0[kept0]))
        later = [name for name in walks.planned if name not in walks.out]
        walks.run(later, worker_processes(num_proc, len(later), len(labels_g)), progress)
    return walks.out


class _Walks:
    """The walks of :func:`compose`: each planned (its input, seed set and batch size), then walked, here or in
    forked processes, and made into its :class:`ZFilterResult`."""

    def __init__(self, task: TaskSpec, params: ZFilterParams, seed: int, vocab, seconds: dict | None):
        self.task, self.params, self.seed, self.vocab, self.seconds = task, params, seed, vocab, seconds
        # recorded with every composition (the manifest's)
        self.recorded = {"top_k": params.top_k, "batch_size": params.batch_size, "seed": seed, "p0": params.p0,
                         "min_z": params.min_z, "min_batches": MIN_BATCHES}
        # name -> (input dataset, seed dataset or None, allow_empty, batch size used, its note, walk arguments)
        self.planned: dict[str, tuple] = {}
        self.out: dict[str, ZFilterResult] = {}

    def plan(self, name: str, ds, fm, labels, seed_set: tuple | None = None, allow_empty: bool = True) -> None:
        """Plan the walk ``name`` over ``ds`` (matrix ``fm``, ``labels``), seeded with ``seed_set`` = (dataset,
        matrix, labels) when given."""
        seed_ds, seed_fm, seed_labels = seed_set or (None, None, None)
        # an unconditional walk of a small input goes in smaller batches (see zfilter.batch_size_for)
        used, note = walk_batch_size(len(labels), self.params.batch_size,
                                     len(seed_ds) if seed_ds is not None else 0, self.task.name, stacklevel=3)
        walk = ((fm, labels, self.task.num_labels),
                dict(seed_fm=seed_fm, seed_labels=seed_labels, seed=self.seed,
                     params=dataclasses.replace(self.params, batch_size=used)))
        self.planned[name] = (ds, seed_ds, allow_empty, used, note, walk)

    def run(self, names: list[str], processes: int, progress: bool) -> None:
        """Walk ``names``: one after the other here (``processes`` <= 1), else at once in forked processes."""
        if processes <= 1:
            for name in names:
                fm_args, fm_kw = self.planned[name][-1]
                start = time.perf_counter()
                outcome = z_filter_matrix(*fm_args, **fm_kw, progress=progress)
                self.finish(name, outcome, time.perf_counter() - start)
            return
        from tqdm.auto import tqdm

        rows = len(self.planned[names[0]][0])
        with tqdm(total=len(names) * rows, desc=f"z-filtering ({processes} walks at once)", unit="rows",
                  disable=not progress) as bar:
            for name, outcome, walk_seconds in _forked_walks({n: self.planned[n][-1] for n in names}, processes):
                self.finish(name, outcome, walk_seconds)
                bar.update(rows)

    def finish(self, name: str, outcome: ZFilterOutcome, walk_seconds: float) -> None:
        start = time.perf_counter()
        ds, seed_ds, allow_empty, used, note, _ = self.planned[name]
        p = {**self.recorded, "batch_size_used": used, "conditional": seed_ds is not None}
        if note:
            p["batch_size_note"] = note
        outcome = dataclasses.replace(outcome, counts=None)  # features x labels: the build does not read them
        self.out[name] = z_filter_result(ds, outcome, self.vocab, self.task, p, seed_dataset=seed_ds,
                                         allow_empty=allow_empty, lazy=True)
        if self.seconds is not None:
            self.seconds[name] = walk_seconds + time.perf_counter() - start


# what a walk job reads: set before the worker processes fork, so that they inherit it (nothing is pickled
# on the way in; each worker sends back its walk's index-level outcome)
_WALKS: dict = {}


# below this many rows, "auto" does the walks and the z-statistics in the build's process: starting
# processes would cost about what they save (project choice)
PARALLEL_MIN_ROWS = 100_000


def worker_processes(num_proc: "int | str | None", n_jobs: int, rows: int) -> int:
    """How many forked processes do ``n_jobs`` independent jobs over ``rows`` rows: ``"auto"`` is one per
    job where 2 CPUs or more are usable and there are :data:`PARALLEL_MIN_ROWS` rows or more (3 walks on
    2 CPUs take 1.5 walks' time, not 2); 1 (in this process) otherwise, or where processes cannot be forked."""
    if n_jobs <= 1 or not can_fork():
        return 1
    if num_proc == "auto":
        return n_jobs if usable_cpus() >= 2 and rows >= PARALLEL_MIN_ROWS else 1
    return min(int(num_proc or 1), n_jobs)


def _walk(name: str):
    args, kwargs = _WALKS[name]
    start = time.perf_counter()
    outcome = z_filter_matrix(*args, **kwargs, progress=False)
    # Z's final counts (features x labels: 84 MB for 3.5M features) are not sent back: the build does not read them
    return name, dataclasses.replace(outcome, counts=None), time.perf_counter() - start


def _forked_walks(jobs: Mapping[str, tuple], processes: int):
    """``(name, outcome, seconds)`` of every walk, in the order given, ``processes`` at a time: the last
    walk in this process (which would otherwise wait, and gets its outcome without copying it through a
    pipe), the others in forked ones (the walks read only numpy arrays). A process that dies (killed, out
    of memory) stops the build with an error instead of leaving it waiting."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    names = list(jobs)
    _WALKS.update(jobs)
    return_free_memory()  # see processes.py: what the build does meanwhile should not copy shared pages
    freeze_gc()
    try:
        with ProcessPoolExecutor(processes - 1, mp_context=multiprocessing.get_context("fork")) as pool:
            forked = [pool.submit(_walk, name) for name in names[:-1]]
            own = _walk(names[-1])
            for future in forked:
                yield future.result()
            yield own
    except BrokenProcessPool as err:
        raise RuntimeError(f"a z-filtering process ended without its result ({err}); out of memory? "
                           "z_filter.num_proc: 1 walks one input at a time, in the build's process") from err
    finally:
        unfreeze_gc()
        _WALKS.clear()


def z_filtered_original(d0, task: TaskSpec, *, hypothesis_only="tfidf", folds: int = 5, seed: int = 0,
                        progress: bool = True, params: ZFilterParams | None = None, **values) -> ZFilterResult:
    """Z(D0) exactly as ``debiased-nli build`` makes its ``z_filtered`` config from a recipe with these
    ``features`` and ``z_filter`` settings (``params``, or its fields as keywords: ``top_k``, ``batch_size``,
    ``p0``, ``min_z``) and this seed (the hypothesis-only model's folds and the walk both use ``seed``). Z(D0)
    depends on D0 alone, so this is also the Z(D0) of a build with new rows; the generator's G* step uses it."""
    from ..bias.task_features import featurize_build
    from ..utils.params import options_of

    p = options_of(ZFilterParams, params, values, "z_filtered_original()")
    feats = featurize_build(d0, None, task, hypothesis_only=hypothesis_only, folds=folds, seed=seed, progress=progress)
    r = compose(d0, None, task, params=p, seed=seed, configs=["z_filtered"], progress=progress,
                features=(feats.d0, None))["z_filtered"]
    return dataclasses.replace(r, kept=materialize(r.kept), rejected=materialize(r.rejected))
