"""Release folders laid out exactly like a Hub dataset repo, and the compositions of Wu et al. (2022).

    <release>/README.md                          YAML (configs, dataset_info) + the dataset card
    <release>/data/<config>/<split>-00000-of-0000N.parquet
    <release>/rejected/<config>/train-*.parquet  the rows a stage dropped, with the reason
    <release>/images/zstats_<config>.png         the z-statistics picture of each config
    <release>/decisions/<config>/*.parquet       a filter step's decisions and scores, for exact rebuilds
                                                 (release.decisions: `build --replay`)
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
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..bias.compose import worker_processes
from ..bias.features import build_feature_matrix
from ..bias.zstats import ZStats, compute_zstats, compute_zstats_parts
from ..data.loading import labels_of, materialize
from ..data.tasks import TaskSpec
from ..utils.errors import ConfigError
from ..utils.outputs import (
    TOOL,
    WRITTEN_BY_KEY,
    check_target,
    clean_stale,
    is_release_folder,
    lock_target,
    replace_folder,
    temp_folder,
    write_error,
)
from ..utils.provenance import file_sha256
from ..utils.processes import freeze_gc, return_free_memory, unfreeze_gc
from ..utils.paths import public_paths
from .card import dataset_card_yaml, label_distribution, render_card
from .configs import ROWS_PER_SHARD, ConfigData, canonical_only, data_extra_columns
from .decisions import write_record, write_rows_record


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
        # the card's num_bytes: the Arrow size of the file's rows as read back, so that it depends on the file
        # alone (not on how the rows were held in memory: a replayed config gives the same card)
        files.append({"path": str(path), "rows": len(part), "bytes": path.stat().st_size,
                      "arrow_bytes": int(pq.read_table(str(path), memory_map=True).nbytes)})
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
    (matrix, labels, rows) parts (see :func:`~debiased_nli.bias.zstats.compute_zstats_parts`) instead of
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


# the output files a build writes (push deletes those of an older release that this one lacks)
RELEASE_FILE_PATTERNS = (r"data/[^/]+/[^/]+-\d{5}-of-\d{5}\.parquet", r"rejected/.+\.parquet", r"images/[^/]+\.png",
                         r"decisions/.+\.parquet")


@dataclasses.dataclass
class ReleaseContents:
    """What :func:`write_release` writes: the configs (``default`` the one ``load_dataset`` opens without a
    name), the manifest and the card's metadata, and what the folder keeps beside them.

    ``original``: D0, for its z-statistics in the card, with ``original_features``: its features as (matrix,
    labels, rows) parts (otherwise read from its ``feat_*`` columns). ``set_aside``: the rows set aside on
    loading, written to ``rejected/``. ``row_records``: the source steps' records of the new rows they made
    (:mod:`.decisions`), written to ``decisions/<key>/``."""

    configs: Sequence[ConfigData]
    default: str
    manifest: Mapping[str, Any]
    meta: Mapping[str, Any]
    original: Any = None
    original_features: list | None = None
    set_aside: Any = None
    row_records: Mapping[str, Any] | None = None


def write_release(out_dir: "str | Path", task: TaskSpec, contents: ReleaseContents, *, overwrite: bool = False,
                  top_k_card: int = 10, timings: bool = False, num_proc: "int | str | None" = "auto") -> Path:
    """Write a Hub-layout release folder atomically (temporary name, then rename).

    The z-statistics and plots of every config are computed in a forked process while this one writes the
    Parquet files (``num_proc``: ``"auto"``, see :func:`worker_processes`; 1: one after the other, here); the
    files are the same either way. ``timings`` adds a ``write release`` stage with its seconds (Parquet;
    z-statistics and plots, which overlap when they run at once) to the manifest."""
    configs, default, manifest, meta = contents.configs, contents.default, contents.manifest, contents.meta
    out = Path(out_dir).resolve()
    _check_configs(configs, default)
    tmp, unlock = _open_target(out, overwrite)
    stats = None
    try:
        (tmp / "images").mkdir()
        clock = {"parquet": 0.0, "z-statistics and plots": 0.0}
        writing = time.perf_counter()
        jobs = _stats_jobs(configs, contents.original, contents.original_features)
        n_rows = sum(len(ds) for _, ds, _ in jobs)
        stats = _StatsJob(jobs, task, tmp / "images", top_k_card, forked=worker_processes(num_proc, 2, n_rows) > 1)
        written: dict[str, dict[str, list]] = {}
        labels: dict[str, dict[str, dict[str, int]]] = {}
        new_rows: dict[str, Any] = {"rows": 0, "methods": set(), "perturbed": False}
        for c in configs:
            start = time.perf_counter()
            written[c.name], labels[c.name] = _write_config(tmp, c, task, new_rows)
            clock["parquet"] += time.perf_counter() - start
        summaries, clock["z-statistics and plots"] = stats.result()
        wall = time.perf_counter() - writing  # the parts overlap when the statistics run in their own process
        if contents.set_aside is not None and len(contents.set_aside):
            _write_set_aside(tmp, contents.set_aside)
        decisions = {c.name: write_record(tmp, c.name, c.decisions) for c in configs if c.decisions is not None}
        decisions.update({key: write_rows_record(tmp, key, rec) for key, rec in (contents.row_records or {}).items()})
        if decisions:  # after rejected/: each record names the sha256 of its config's dropped rows too
            manifest = {**manifest, "decisions": decisions}
        manifest = _release_manifest(manifest, meta, labels, written,
                                     stage={"stage": "write release",
                                            "detail": "Parquet of every config; z-statistics and plots",
                                            "seconds": round(wall, 3),
                                            "seconds_by_part": {k: round(v, 3) for k, v in clock.items()}}
                                     if timings else None)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
        new_origins = ["generated"] if new_rows["rows"] else []
        yaml_header = dataset_card_yaml(task, configs, written, default, meta, new_origins=new_origins)
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


def _check_configs(configs: Sequence[ConfigData], default: str) -> None:
    from ..utils.paths import check_name

    names = [c.name for c in configs]
    for c in configs:  # they become folder and file names: data/<config>/<split>-00000-of-00001.parquet
        check_name(c.name, "config name")
        for split in c.splits:
            check_name(split, f"config {c.name!r}: split name")
    if not configs:
        raise ConfigError("a release needs at least one config")
    if default not in names:
        raise ConfigError(f"default config {default!r} is not among the configs {names}")
    if len(set(names)) != len(names):
        raise ConfigError(f"config names must be unique: {names}")
    from .card import rejected_config

    clash = sorted(set(names) & {rejected_config(n) for n in names})
    if clash:  # the card declares rejected_<config> for the rows a config's stage dropped
        raise ConfigError(f"config name(s) {clash} are the names of other configs' rejected rows; rename them")


def _open_target(out: Path, overwrite: bool):
    """Lock the target and make the temporary folder beside it: (temporary folder, unlock). The lock is
    held until ``unlock()``: one writer per target (see outputs.py)."""
    check_target(out, overwrite=overwrite, is_ours=is_release_folder, what="release")
    unlock = lock_target(out)
    try:
        # under the lock: first what interrupted runs left, then the target again (another run may
        # have written it meanwhile, or an interrupted replacement been put back)
        clean_stale(out, is_release_folder)
        check_target(out, overwrite=overwrite, is_ours=is_release_folder, what="release")
        return temp_folder(out), unlock
    except BaseException as err:
        unlock()
        if isinstance(err, OSError):
            raise write_error(err, out) from err
        raise


def _stats_jobs(configs: Sequence[ConfigData], original, original_features) -> list[tuple]:
    """The z-statistics (card tables) and plots to make: the original's and every config's with features, as
    ``(name, train rows, feature parts or None)``."""
    jobs = [("original", original, original_features)] if original is not None else []
    for c in configs:
        train = c.splits.get("train")
        if c.features is not None:
            jobs.append((c.name, train, c.features))
        elif train is not None and any(col.startswith("feat_") for col in train.column_names):
            jobs.append((c.name, train, None))
    return jobs


def _write_config(tmp: Path, c: ConfigData, task: TaskSpec, new_rows: dict) -> tuple[dict, dict]:
    """The Parquet shards of every split of config ``c`` (and its rejected rows) under ``tmp``; counts the new
    rows into ``new_rows``. Returns the files of each split (relative paths, sha256) and its label counts."""
    written, labels = {}, {}
    extra = data_extra_columns(c)
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
            f["sha256"] = file_sha256(tmp / f["path"])
        written[split] = files
        labels[split] = label_distribution(ds, task.labels)
    if c.rejected is not None and len(c.rejected):  # already in its columns (release.step_registry.Rejects)
        _write_parquet(c.rejected, tmp / "rejected" / c.name, "train")
    return written, labels


def _write_set_aside(tmp: Path, set_aside) -> None:
    """The rows set aside on load, in ``rejected/set_aside_on_load.parquet`` (file names, not paths)."""
    (tmp / "rejected").mkdir(exist_ok=True)
    if "file" in set_aside.column_names:  # file names, not the builder's paths
        set_aside = set_aside.map(lambda b: {"file": [public_paths(f) for f in b["file"]]}, batched=True)
    set_aside.to_parquet(str(tmp / "rejected" / "set_aside_on_load.parquet"))


def _release_manifest(manifest: Mapping[str, Any], meta: Mapping[str, Any], labels: dict, written: dict,
                      stage: dict | None) -> dict:
    """``manifest.json``: the build's manifest (paths reduced to file names) with the written-by mark, repo id,
    history, label distribution, the ``write release`` stage (``stage``, with timings) and the files."""
    manifest = public_paths(dict(manifest))
    manifest[WRITTEN_BY_KEY] = TOOL  # the mark that lets --overwrite replace it
    manifest["repo_id"] = meta.get("repo_id")
    manifest["history"] = [dict(h) for h in meta.get("history") or []]
    manifest["label_distribution"] = labels
    if stage is not None:
        manifest["stages"] = list(manifest.get("stages", [])) + [stage]
    manifest["files"] = {c: {s: [{k: v for k, v in f.items() if k != "arrow_bytes"} for f in fs]
                             for s, fs in sp.items()} for c, sp in written.items()}
    return manifest


def _summaries(jobs: Sequence[tuple], task: TaskSpec, images: Path, top_k: int) -> tuple[dict, float]:
    """The card summary and the plot of each ``(name, dataset, feature parts or None)``; the first job
    named ``original`` is the "before" of the others. Returns the summaries and the seconds taken."""
    from ..bias.audit import plot_zstats
    from ..bias.zstats import bonferroni_threshold

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
