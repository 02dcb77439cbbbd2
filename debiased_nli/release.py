"""Release folders laid out exactly like a Hub dataset repo, and the compositions of Wu et al. (2022).

    <release>/README.md                          YAML (configs, dataset_info) + the dataset card
    <release>/data/<config>/<split>-00000-of-0000N.parquet
    <release>/rejected/<config>/train-*.parquet  the rows a stage dropped, with the reason
    <release>/images/zstats_<config>.png         the z-statistics picture of each config
    <release>/manifest.json                      recipe, seeds, versions, input and output sha256, counts,
                                                 label distribution, version history (machine-readable)

``load_dataset(<release>, "seq_z")`` works offline and, after a push, ``load_dataset("org/name",
"seq_z")`` works from the Hub. The folder is written under a temporary name beside the target and
renamed when complete, so an interrupted build never leaves a half release. Nothing in it depends
on the clock, so the same inputs and seed give the same folder byte for byte.

The card is rendered from ``model_cards/dataset_card.md.j2`` (its citations and this project's
measured figures from ``citations.yaml`` and ``measurements.yaml`` beside it); its YAML goes through
``huggingface_hub.DatasetCardData``. Paths in the manifest are reduced to file names (:func:`public_paths`).

Compositions for a base set D0 and new rows D_G:
    z_filtered = Z(D0)        z_aug = Z(D_G | D0) (= D0 + the kept new rows)
    par_z = Z(D0) ∪ Z(D_G)    seq_z = Z(D_G | Z(D0)) (= Z(D0) + the new rows kept given it)
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from . import __version__
from .data import PROVENANCE_COLUMNS, labels_of, materialize
from .errors import ConfigError
from .outputs import (TOOL, WRITTEN_BY_KEY, check_target, clean_stale, is_release_folder, lock_target,
                      replace_folder, temp_folder, write_error)
from .processes import can_fork, freeze_gc, return_free_memory, unfreeze_gc, usable_cpus
from .features import FeatureMatrix, build_feature_matrices, build_feature_matrix
from .tasks import TaskSpec, get_task
from .zfilter import MIN_BATCHES, REJECTED_BY, ZFilterResult, batch_size_for, z_filter_matrix, z_filter_result
from .zstats import ZStats, compute_zstats, compute_zstats_parts

CONFIG_DESCRIPTIONS = {
    "original": "the input D0, unchanged (for comparison)",
    "z_filtered": "Z(D0): the original rows z-filtered (Wu et al. 2022, Algorithm 1)",
    "z_aug": "Z-Aug = Z(D_G | D0): the original rows plus the new rows kept by z-filtering conditioned on them",
    "par_z": "Par-Z = Z(D0) ∪ Z(D_G): the z-filtered original rows plus the separately z-filtered new rows",
    "seq_z": "Seq-Z = Z(D_G | Z(D0)): the z-filtered original rows plus the new rows kept by z-filtering "
             "conditioned on them",
    "aflite": "AFLite (Le Bras et al. 2020): the original rows that an ensemble of linear models on embeddings "
              "does not predict too easily",
    "ibadr": "IBADR (Wang et al. 2023): the original rows plus the pseudo samples of an iterative bias-aware generator",
    "pdd": "PDD (Guo et al. 2023): the original rows with masked-LM perturbations added or swapped in until every "
           "biased feature's z is under the threshold",
}
# provenance of new rows that a config's data keeps when its train split has them (PDD's perturbed rows)
DATA_EXTRA_COLUMNS = ("source_uid", "teacher_confidence")
CANONICAL = ("premise", "hypothesis", "label") + PROVENANCE_COLUMNS
ROWS_PER_SHARD = 500_000


@dataclasses.dataclass
class ConfigData:
    """One config of a release: its splits, the rows its stage dropped, and a description."""

    name: str
    splits: dict[str, Any]
    rejected: Any = None
    description: str = ""
    stages: list[dict] = dataclasses.field(default_factory=list)
    card_section: str | None = None  # markdown a filter step adds to the card (e.g. AFLite's audit)
    # the train split's features as parts (matrix, labels, rows or None) of matrices sharing one
    # vocabulary, for its z-statistics; without them they are read from the split's feat_* columns
    features: list | None = None


def compose(d0, dg, task: "str | TaskSpec", *, top_k: int = 20, batch_size: int = 1000, seed: int = 0,
            p0="uniform", configs: Sequence[str] | None = None, progress: bool = True,
            features: "tuple[FeatureMatrix, FeatureMatrix | None] | None" = None,
            seconds: dict | None = None, num_proc: "int | str | None" = None) -> dict[str, ZFilterResult]:
    """The z-filtering compositions available for D0 (and D_G when given), keyed by config name.

    ``features``: the feature matrices of D0 and D_G over one vocabulary (e.g. from
    :func:`~debiased_nli.featurize.featurize_build`); otherwise both inputs must carry feature columns
    computed together (same extractors, one hypothesis-only model), and their matrices are built
    here, once. Every composition is z-filtered from these matrices: Z-Aug is seeded with D0's
    rows, Seq-Z with Z(D0)'s (the counts of a seed set do not depend on its order). Z(D0) is walked
    first; the walks over D_G (Z-Aug, Par-Z's Z(D_G), Seq-Z) do not depend on each other and run at once
    in ``num_proc`` processes (``"auto"``: see :func:`_processes`; ``None`` or 1: one after the other, in
    this process); the result is the same either way. ``seconds``, when given, receives each
    composition's wall time (the walks' overlap when they run at once).
    """
    from tqdm.auto import tqdm

    task = get_task(task)
    wanted = set(configs) if configs else None
    has_new = dg is not None and len(dg) > 0
    if features is None:
        fm0, fmg = build_feature_matrices([d0, dg]) if has_new else (build_feature_matrix(d0), None)
    else:
        fm0, fmg = features
    labels0 = labels_of(d0)
    labels_g = labels_of(dg) if has_new else None
    vocab = fm0.vocab_array()  # once, for every composition's rejected_by
    params = {"top_k": top_k, "batch_size": batch_size, "seed": seed, "p0": p0, "min_z": 0.0,
              "min_batches": MIN_BATCHES}
    out: dict[str, ZFilterResult] = {}
    # name -> (input dataset, seed dataset or None, allow_empty, batch size used, its note, walk arguments)
    walks: dict[str, tuple] = {}

    def plan(name, ds, fm, labels, seed_ds=None, seed_fm=None, seed_labels=None, allow_empty=True):
        # an unconditional walk of a small input goes in smaller batches (see zfilter.batch_size_for)
        used, note = batch_size_for(len(labels), batch_size, conditional=seed_ds is not None and len(seed_ds) > 0)
        if note:
            warnings.warn(f"z-filtering {task.name!r}: {note}", stacklevel=3)
        walk = ((fm, labels, task.num_labels), dict(seed_fm=seed_fm, seed_labels=seed_labels, batch_size=used,
                                                    top_k=top_k, seed=seed, p0=p0, keep_counts=False))
        walks[name] = (ds, seed_ds, allow_empty, used, note, walk)

    def finish(name, outcome, walk_seconds):
        start = time.perf_counter()
        ds, seed_ds, allow_empty, used, note, _ = walks[name]
        p = {**params, "batch_size_used": used, "conditional": seed_ds is not None}
        if note:
            p["batch_size_note"] = note
        out[name] = z_filter_result(ds, outcome, vocab, task, p, seed_dataset=seed_ds, allow_empty=allow_empty,
                                    lazy=True)
        if seconds is not None:
            seconds[name] = walk_seconds + time.perf_counter() - start

    need_z0 = wanted is None or wanted & {"z_filtered", "par_z", "seq_z"}
    if need_z0:
        plan("z_filtered", d0, fm0, labels0, allow_empty=False)
        fm_args, fm_kw = walks["z_filtered"][-1]
        start = time.perf_counter()
        finish("z_filtered", z_filter_matrix(*fm_args, **fm_kw, progress=progress), time.perf_counter() - start)
    if has_new:
        later = []
        if wanted is None or "z_aug" in wanted:
            plan("z_aug", dg, fmg, labels_g, d0, fm0, labels0)
            later.append("z_aug")
        if wanted is None or "par_z" in wanted:
            plan("par_z_new", dg, fmg, labels_g)
            later.append("par_z_new")
        if wanted is None or "seq_z" in wanted:
            kept0 = out["z_filtered"].outcome.kept
            plan("seq_z", dg, fmg, labels_g, out["z_filtered"].kept, fm0.select(kept0), labels0[kept0])
            later.append("seq_z")
        processes = _processes(num_proc, len(later), len(labels_g))
        if processes <= 1:
            for name in later:
                fm_args, fm_kw = walks[name][-1]
                start = time.perf_counter()
                finish(name, z_filter_matrix(*fm_args, **fm_kw, progress=progress), time.perf_counter() - start)
        else:
            with tqdm(total=len(later) * len(labels_g), desc=f"z-filtering ({processes} walks at once)",
                      unit="rows", disable=not progress) as bar:
                for name, outcome, walk_seconds in _forked_walks({n: walks[n][-1] for n in later}, processes):
                    finish(name, outcome, walk_seconds)
                    bar.update(len(labels_g))
    return out


# what a walk job reads: set before the worker processes fork, so that they inherit it (nothing is pickled
# on the way in; each worker sends back its walk's index-level outcome)
_WALKS: dict = {}


# below this many rows, "auto" does the walks and the z-statistics in the build's process: starting
# processes would cost about what they save (project choice)
PARALLEL_MIN_ROWS = 100_000


def _processes(num_proc: "int | str | None", n_jobs: int, rows: int) -> int:
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
    return name, outcome, time.perf_counter() - start


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


def z_filtered_original(d0, task: "str | TaskSpec", *, hypothesis_only="tfidf", folds: int = 5, seed: int = 0,
                        top_k: int = 20, batch_size: int = 1000, p0="uniform", progress: bool = True) -> ZFilterResult:
    """Z(D0) exactly as ``debiased-nli build`` makes its ``z_filtered`` config from a recipe with these
    ``features`` and ``z_filter`` settings and this seed (the hypothesis-only model's folds and the
    walk both use ``seed``). Z(D0) depends on D0 alone, so this is also the Z(D0) of a build with new
    rows; the generator's G* step uses it."""
    from .featurize import featurize_build

    feats = featurize_build(d0, None, task, hypothesis_only=hypothesis_only, folds=folds, seed=seed, progress=progress)
    r = compose(d0, None, task, top_k=top_k, batch_size=batch_size, seed=seed, p0=p0, configs=["z_filtered"],
                progress=progress, features=(feats.d0, None))["z_filtered"]
    return dataclasses.replace(r, kept=materialize(r.kept), rejected=materialize(r.rejected))


def canonical_only(ds, extra: Sequence[str] = ()):
    keep = [c for c in list(CANONICAL) + list(extra) if c in ds.column_names]
    return ds.select_columns(keep)


def _data_extra(c: "ConfigData") -> list[str]:
    train = c.splits.get("train")
    return [col for col in DATA_EXTRA_COLUMNS if train is not None and col in train.column_names]


def _config_split(ds, extra: Sequence[str], like=None):
    """The columns a config publishes; a split without the extra columns gets them empty (one schema per config)."""
    out = canonical_only(ds, extra)
    missing = [col for col in extra if col not in out.column_names]
    if missing:
        out = materialize(out)  # a column is added to rows held, not to a selection of them
    for col in missing:
        out = out.add_column(col, [None] * len(out)).cast_column(col, like.features[col])
    return out


def _write_parquet(ds, folder: Path, split: str, on_part=None) -> list[dict]:
    """Write ``ds`` as shards of :data:`ROWS_PER_SHARD` rows. ``ds`` may be a selection of a larger table
    (a config's rows, its dropped rows): each shard's rows are gathered just before it is written, so a
    split of millions of rows is never held whole. ``on_part`` sees each shard's rows once written."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(ds)
    shards = max(1, (n + ROWS_PER_SHARD - 1) // ROWS_PER_SHARD)
    files = []
    for i in range(shards):
        part = materialize(ds.select(range(i * ROWS_PER_SHARD, min((i + 1) * ROWS_PER_SHARD, n))) if shards > 1
                           else ds)
        path = folder / f"{split}-{i:05d}-of-{shards:05d}.parquet"
        part.to_parquet(str(path))
        files.append({"path": str(path), "rows": len(part), "bytes": path.stat().st_size,
                      "arrow_bytes": int(part.data.nbytes)})
        if on_part is not None:
            on_part(part)
        del part
    return files


def _new_rows_of(table: pa.Table) -> tuple[int, bool, set[str]]:
    """(rows whose origin is not ``original``, whether any is ``perturbed``, their methods) of a table."""
    import pyarrow.compute as pc

    origin = table.column("origin")
    new = pc.fill_null(pc.not_equal(origin, "original"), True)
    n_new = int(pc.sum(new).as_py() or 0)
    if not n_new:
        return 0, False, set()
    perturbed = bool(pc.any(pc.fill_null(pc.equal(origin, "perturbed"), False)).as_py())
    methods = {str(m) for m in pc.unique(table.column("method").filter(new)).to_pylist()}
    return n_new, perturbed, methods


def zstats_summary(ds, task: TaskSpec, reference: ZStats | None = None, top_k: int = 10,
                   parts: list | None = None) -> tuple[dict, ZStats]:
    """Top features per label of ``ds`` (and the reference's top features with their z in ``ds``),
    for cards. Returns the summary and the z-statistics of ``ds``. ``parts``: ``ds``'s features as
    (matrix, labels, rows) parts (see :func:`~debiased_nli.zstats.compute_zstats_parts`) instead of
    its ``feat_*`` columns."""
    zs = compute_zstats_parts(parts, task.labels) if parts is not None else \
        compute_zstats(build_feature_matrix(ds), labels_of(ds), task.labels)
    summary = {"n_rows": zs.n_rows, "max_abs_z": round(zs.max_abs_z(exclude=("<null>",)), 3),
               "top": zs.top_records(top_k)}
    if reference is not None:
        rows = []
        for l, name in enumerate(task.labels):
            for i in reference.top_k(top_k)[l]:
                if i < 0:
                    continue
                feature = str(reference.vocab[i])
                j = int(np.searchsorted(zs.vocab, feature))  # both vocabularies are in string order
                present = j < len(zs.vocab) and zs.vocab[j] == feature and zs.n[j] > 0
                rows.append({"label": name, "feature": feature, "z_before": round(float(reference.z[i, l]), 2),
                             "n_before": int(reference.n[i]),
                             "z_after": round(float(zs.z[j, l]), 2) if present else None,
                             "n_after": int(zs.n[j]) if present else 0})
        summary["before_after"] = rows
    return summary, zs


# who made the labels of each task's source data (Hub card vocabulary); generated rows add machine-generated
ANNOTATIONS_CREATORS = {"snli": ["crowdsourced"], "mnli": ["crowdsourced"], "fever": ["crowdsourced"],
                        "qqp": ["other"], "demo": ["machine-generated"]}


def _dataset_card_yaml(task: TaskSpec, configs: Sequence[ConfigData], written: Mapping[str, Mapping[str, list]],
                       default: str, meta: Mapping[str, Any], new_origins: Sequence[str] = ()) -> str:
    """The README YAML: ``configs`` (data_files, default), ``dataset_info`` (features, sizes) and the
    Hub's card metadata (licence, task, language, sources, annotation creators, size)."""
    import datasets
    from datasets.info import DatasetInfosDict
    from huggingface_hub import DatasetCardData

    annotations = list(ANNOTATIONS_CREATORS.get(task.name, ["other"]))
    if new_origins and "machine-generated" not in annotations:
        annotations.append("machine-generated")
    config_entries = []
    for c in configs:  # the Hub lists the default config first
        entry = {"config_name": c.name,
                 "data_files": [{"split": s, "path": f"data/{c.name}/{s}-*"} for s in written[c.name]]}
        if c.name == default:
            entry["default"] = True
        config_entries.append(entry)
    config_entries.sort(key=lambda e: not e.get("default", False))
    card = DatasetCardData(
        license=meta.get("license"), pretty_name=meta.get("pretty_name"), task_categories=["text-classification"],
        task_ids=["natural-language-inference"] if task.num_labels == 3 else ["semantic-similarity-classification"],
        language=["en"], multilinguality=["monolingual"], annotations_creators=annotations,
        source_datasets=[f"extended|{task.hub.path}"] if task.hub else ["original"],
        tags=["debiasing", "z-filtering", "spurious-correlations", "debiased-nli"],
        size_categories=[_size_category(max(sum(f["rows"] for f in written[c.name]["train"]) for c in configs))],
        configs=config_entries)
    infos = {}
    for c in configs:
        feats = canonical_only(c.splits.get("train", next(iter(c.splits.values()))), _data_extra(c)).features
        splits = datasets.SplitDict()
        for split, files in written[c.name].items():
            splits.add(datasets.SplitInfo(name=split, num_bytes=sum(f["arrow_bytes"] for f in files),
                                          num_examples=sum(f["rows"] for f in files)))
        infos[c.name] = datasets.DatasetInfo(
            features=feats, splits=splits, config_name=c.name,
            download_size=sum(f["bytes"] for fs in written[c.name].values() for f in fs),
            dataset_size=sum(f["arrow_bytes"] for fs in written[c.name].values() for f in fs))
    # dataset_info in the Hub's YAML form, as Dataset.push_to_hub writes it
    DatasetInfosDict(infos).to_dataset_card_data(card)
    return card.to_yaml().rstrip("\n") + "\n"


def _size_category(n: int) -> str:
    for bound, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
                        (1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M")):
        if n < bound:
            return name
    return "10M<n<100M"


HISTORY_START = "<!-- debiased-nli:history:start -->"
HISTORY_END = "<!-- debiased-nli:history:end -->"
# the output files a build writes (push deletes those of an older release that this one lacks)
RELEASE_FILE_PATTERNS = (r"data/[^/]+/[^/]+-\d{5}-of-\d{5}\.parquet", r"rejected/.+\.parquet", r"images/[^/]+\.png")


def render_history_table(history: Sequence[Mapping[str, Any]]) -> str:
    """The card's version-history table, between markers, from the machine-readable history
    (``manifest.json`` ``history``: a list of ``{version, notes}``)."""
    def cell(text: Any) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    rows = "".join(f"| {cell(h['version'])} | {cell(h.get('notes', ''))} |\n" for h in history)
    return f"{HISTORY_START}\n| version | notes |\n|---|---|\n{rows}{HISTORY_END}"


def public_paths(value: Any) -> Any:
    """``value`` with every local path that would expose the builder's file system (absolute, or
    reaching outside the working folder with ``..``) replaced by its file name (a ``SPLIT=PATH``
    entry keeps its split); the sha256 recorded beside an input identifies it."""
    if isinstance(value, Mapping):
        return {k: public_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public_paths(v) for v in value]
    if not isinstance(value, str) or "\n" in value:
        return value
    split, sep, rest = value.partition("=")
    head, path = (split + "=", rest) if sep and split.isidentifier() else ("", value)
    if os.path.isabs(path) or path.startswith(".."):
        return head + (Path(path).name or path)
    return value


def label_distribution(ds, labels: Sequence[str]) -> dict[str, int]:
    counts = np.bincount(labels_of(ds), minlength=len(labels)) if len(ds) else np.zeros(len(labels), int)
    return {name: int(n) for name, n in zip(labels, counts)}


def project_url() -> str | None:
    """The project's home page from the installed package's metadata (none is invented)."""
    import importlib.metadata as md

    try:
        meta = md.metadata("debiased-nli")
    except md.PackageNotFoundError:
        return None
    for entry in meta.get_all("Project-URL") or []:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("homepage", "home", "source", "repository"):
            return url.strip()
    return meta.get("Home-page") or None


def citations_for(steps: Sequence[str]) -> list[dict]:
    """The BibTeX entries (``model_cards/citations.yaml``) of the methods a release used: z-statistics
    and z-filtering always, plus the papers of its recipe steps (``aflite``, ``generator``, ...)."""
    import yaml

    entries = yaml.safe_load((templates_dir() / "citations.yaml").read_text())
    used = {"z-statistics", "z-filtering"} | {str(s).lower() for s in steps}
    return [dict(e, key=k) for k, e in entries.items() if used & set(e.get("used_by", []))]


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_release(out_dir: "str | Path", task: "str | TaskSpec", configs: Sequence[ConfigData], *, default: str,
                  manifest: Mapping[str, Any], meta: Mapping[str, Any], original=None, overwrite: bool = False,
                  top_k_card: int = 10, set_aside=None, original_features: list | None = None,
                  timings: bool = False, num_proc: "int | str | None" = "auto") -> Path:
    """Write a Hub-layout release folder atomically (temporary name, then rename).

    ``original_features``: the original's features as (matrix, labels, rows) parts, for its
    z-statistics (otherwise read from its ``feat_*`` columns). The z-statistics and plots of every
    config are computed in a forked process while this one writes the Parquet files (``num_proc``:
    ``"auto"``, see :func:`_processes`; 1: one after the other, here); the files are the same either way.
    ``timings`` adds a ``write release`` stage with its seconds (Parquet; z-statistics and plots, which
    overlap when they run at once) to the manifest."""
    task = get_task(task)
    out = Path(out_dir).resolve()
    names = [c.name for c in configs]
    if not configs:
        raise ConfigError("a release needs at least one config")
    if default not in names:
        raise ConfigError(f"default config {default!r} is not among the configs {names}")
    if len(set(names)) != len(names):
        raise ConfigError(f"config names must be unique: {names}")
    check_target(out, overwrite=overwrite, is_ours=is_release_folder, what="release")
    unlock = lock_target(out)  # one writer per target; held until the end (see outputs.py)
    try:
        # under the lock: first what interrupted runs left, then the target again (another run may
        # have written it meanwhile, or an interrupted replacement been put back)
        clean_stale(out, is_release_folder)
        check_target(out, overwrite=overwrite, is_ours=is_release_folder, what="release")
        tmp = temp_folder(out)
    except BaseException as err:
        unlock()
        if isinstance(err, OSError):
            raise write_error(err, out) from err
        raise
    stats = None
    try:
        written: dict[str, dict[str, list]] = {}
        (tmp / "images").mkdir()
        clock = {"parquet": 0.0, "z-statistics and plots": 0.0}
        writing = time.perf_counter()
        # the z-statistics (card tables) and plots of the original and of every config with features
        stats_jobs = [("original", original, original_features)] if original is not None else []
        for c in configs:
            train = c.splits.get("train")
            if c.features is not None:
                stats_jobs.append((c.name, train, c.features))
            elif train is not None and any(col.startswith("feat_") for col in train.column_names):
                stats_jobs.append((c.name, train, None))
        n_rows = sum(len(ds) for _, ds, _ in stats_jobs)
        stats = _StatsJob(stats_jobs, task, tmp / "images", top_k_card,
                          forked=_processes(num_proc, 2, n_rows) > 1)
        labels: dict[str, dict[str, dict[str, int]]] = {}
        new_rows: dict[str, Any] = {"rows": 0, "methods": set(), "perturbed": False}
        for c in configs:
            start = time.perf_counter()
            written[c.name] = {}
            labels[c.name] = {}
            extra = _data_extra(c)
            for split, ds in c.splits.items():
                ds = _config_split(ds, extra, c.splits.get("train"))
                seen = {"new": 0}  # the split's new rows, counted shard by shard

                def count_new(part, seen=seen):
                    if "origin" in part.column_names:
                        n_new, perturbed, methods = _new_rows_of(part.data.table)
                        seen["new"] += n_new
                        new_rows["perturbed"] |= perturbed
                        new_rows["methods"] |= methods

                files = _write_parquet(ds, tmp / "data" / c.name, split, on_part=count_new)
                new_rows["rows"] = max(new_rows["rows"], seen["new"])
                for f in files:
                    f["path"] = Path(f["path"]).relative_to(tmp).as_posix()
                    f["sha256"] = _sha256(tmp / f["path"])
                written[c.name][split] = files
                labels[c.name][split] = label_distribution(ds, task.labels)
            if c.rejected is not None and len(c.rejected):
                extra = [col for col in (REJECTED_BY, "reason", "aflite_score", "aflite_round", "stage", "replaced_by",
                                        *DATA_EXTRA_COLUMNS)
                         if col in c.rejected.column_names]
                _write_parquet(canonical_only(c.rejected, extra), tmp / "rejected" / c.name, "train")
            clock["parquet"] += time.perf_counter() - start
        summaries, clock["z-statistics and plots"] = stats.result()
        wall = time.perf_counter() - writing  # the parts overlap when the statistics run in their own process
        if set_aside is not None and len(set_aside):
            (tmp / "rejected").mkdir(exist_ok=True)
            if "file" in set_aside.column_names:  # file names, not the builder's paths
                set_aside = set_aside.map(lambda b: {"file": [public_paths(f) for f in b["file"]]}, batched=True)
            set_aside.to_parquet(str(tmp / "rejected" / "set_aside_on_load.parquet"))
        manifest = public_paths(dict(manifest))
        manifest[WRITTEN_BY_KEY] = TOOL  # the mark that lets --overwrite replace it
        manifest["repo_id"] = meta.get("repo_id")
        manifest["history"] = [dict(h) for h in meta.get("history") or []]
        manifest["label_distribution"] = labels
        if timings:
            manifest["stages"] = list(manifest.get("stages", [])) + [
                {"stage": "write release", "detail": "Parquet of every config; z-statistics and plots",
                 "seconds": round(wall, 3), "seconds_by_part": {k: round(v, 3) for k, v in clock.items()}}]
        manifest["files"] = {c: {s: [{k: v for k, v in f.items() if k != "arrow_bytes"} for f in fs]
                                 for s, fs in sp.items()} for c, sp in written.items()}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
        new_origins = ["generated"] if new_rows["rows"] else []
        yaml_header = _dataset_card_yaml(task, configs, written, default, meta, new_origins=new_origins)
        body = render_card(task, configs, written, summaries, manifest, meta, default,
                           generated=dict(new_rows, methods=sorted(new_rows["methods"])) if new_rows["rows"] else None)
        (tmp / "README.md").write_text(f"---\n{yaml_header}---\n\n{body}")
        replace_folder(tmp, out)
    except BaseException as err:
        if stats is not None:
            stats.stop()  # before its folder goes
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):  # no space, read-only: one line, and no half release left
            raise write_error(err, out) from err
        raise
    finally:
        unlock()
    return out


def _summaries(jobs: Sequence[tuple], task: TaskSpec, images: Path, top_k: int) -> tuple[dict, float]:
    """The card summary and the plot of each ``(name, dataset, feature parts or None)``; the first job
    named ``original`` is the "before" of the others. Returns the summaries and the seconds taken."""
    from .audit import plot_zstats
    from .zstats import bonferroni_threshold

    start = time.perf_counter()
    summaries, reference = {}, None
    for name, ds, parts in jobs:
        summary, zs = zstats_summary(ds, task, reference=reference, top_k=top_k, parts=parts)
        thr = bonferroni_threshold(int((zs.n > 0).sum()) * task.num_labels)
        plot_zstats(zs, thr, images / f"zstats_{name}.png", title=f"{name} ({len(ds):,} rows)")
        summaries[name] = summary
        if name == "original":  # computed once: the "before" of every config
            reference = zs
        del zs
    return summaries, time.perf_counter() - start


def _stats_process(conn, args: dict) -> None:
    """The forked z-statistics process: sends back ``("ok", (summaries, seconds))`` or ``("error", exc)``."""
    try:
        conn.send(("ok", _summaries(**args)))
    except BaseException as err:  # sent back to the build, which raises it
        import traceback

        try:
            conn.send(("error", err))
        except Exception:  # an exception that does not pickle: its text
            conn.send(("error", RuntimeError(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")))
    finally:
        conn.close()


class _StatsJob:
    """:func:`_summaries` in a forked process (started now; :meth:`result` waits for it), or in this
    process when :meth:`result` is called."""

    def __init__(self, jobs, task, images, top_k, forked: bool):
        self.args = dict(jobs=jobs, task=task, images=images, top_k=top_k)
        self.proc = self.conn = None
        if forked:
            import multiprocessing

            ctx = multiprocessing.get_context("fork")  # the process inherits the rows and features: nothing pickled
            self.conn, child = ctx.Pipe(duplex=False)
            self.proc = ctx.Process(target=_stats_process, args=(child, self.args), daemon=True)
            return_free_memory()  # see processes.py: the Parquet writing should not copy shared pages
            freeze_gc()
            self.proc.start()
            child.close()

    def result(self) -> tuple[dict, float]:
        if self.proc is None:
            return _summaries(**self.args)
        try:
            try:
                kind, payload = self.conn.recv()
            except EOFError:
                self.proc.join()
                raise RuntimeError(f"the z-statistics process ended without its result (exit code "
                                   f"{self.proc.exitcode}); out of memory? z_filter.num_proc: 1 computes them "
                                   "in the build's process") from None
            if kind == "error":
                raise payload
            return payload
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.terminate()
            self.proc.join()
            self.conn.close()
            self.proc = None
            unfreeze_gc()


def templates_dir() -> Path:
    """``model_cards/`` (``$DEBIASED_NLI_TEMPLATES``, the copy inside an installed wheel, or the checkout's)."""
    from .resources import data_folder

    return data_folder("model_cards")


def render_card(task: TaskSpec, configs: Sequence[ConfigData], written, summaries, manifest, meta, default,
                generated: Mapping[str, Any] | None = None) -> str:
    """The card body (``model_cards/dataset_card.md.j2``). The build manifest is linked, not inlined."""
    import jinja2
    import yaml

    from .features import list_extractors

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    sizes = []
    split_names = sorted({s for sp in written.values() for s in sp}, key=lambda s: (s != "train", s))
    for c in configs:
        rejected = len(c.rejected) if c.rejected is not None else 0
        train = sum(f["rows"] for f in written[c.name].get("train", []))
        sizes.append({"config": c.name, "description": c.description or CONFIG_DESCRIPTIONS.get(c.name, ""),
                      "default": c.name == default,
                      "rows": {s: sum(f["rows"] for f in written[c.name].get(s, [])) if s in written[c.name] else None
                               for s in split_names},
                      "rejected": rejected, "considered": train + rejected if rejected else 0})
    # a step's markdown keeps its own structure, three levels below the card's config headings
    sections = [(c.name, "\n".join("###" + line if line.startswith("#") else line
                                    for line in c.card_section.splitlines()))
                for c in configs if c.card_section]
    recipe = manifest.get("recipe") or {}
    steps = [c.name for c in configs] + [st.get("step", "") for key in ("new_rows", "filters")
                                         for st in (recipe.get(key) or []) if isinstance(st, Mapping)]
    used = set(manifest.get("features", {}).get("extractors", {}))
    unused = [e for e in list_extractors() if e not in used]
    label_rows = []
    for config, splits in (manifest.get("label_distribution") or {}).items():
        for split, counts in splits.items():
            total = max(sum(counts.values()), 1)
            label_rows.append({"config": config, "split": split,
                               "cells": [f"{counts[l]:,} ({100 * counts[l] / total:.1f}%)" for l in task.labels]})
    return env.get_template("dataset_card.md.j2").render(
        task=task, sections=sections, meta=meta, sizes=sizes, split_names=split_names, summaries=summaries,
        manifest=manifest, default=default, version=__version__, project_url=project_url(),
        repo_id=meta.get("repo_id") or f"<org>/{meta.get('pretty_name', 'release')}",
        label_rows=label_rows, generated=generated,
        debiased_families=", ".join(f"`{e}`" for e in sorted(used - {"null_v1"})) or "none",
        unused_families="; nor the registered extractors this task did not use: "
                        + ", ".join(f"`{e}`" for e in unused) if unused else "",
        measurements=yaml.safe_load((templates_dir() / "measurements.yaml").read_text()) or {},
        citations=citations_for(steps), history_table=render_history_table(meta.get("history") or []))
