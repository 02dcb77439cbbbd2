"""Decision records: what each filter step of a build decided and the scores it decided from, so that a
rebuild reproduces the release exactly on any machine.

Why. The z-path of a release (features, the TF-IDF hypothesis-only model, z-statistics, z-filtering) is
bit-identical whatever the CPU and thread count (:mod:`debiased_nli.bias.logreg`). The neural steps are
not and cannot be: AFLite's fine-tuned encoder and linear models, PDD's masked LM and teacher, IBADR's
generator and classifiers compute in float32 with kernels that differ between instruction sets and
thread counts, so a score near a threshold lands on either side (measured:
``benchmarks/results/neural_determinism.md``). Instead of hoping, the build records each decision.

What a build writes for every filter config ``<c>`` (AFLite, PDD, IBADR, a plugin's):

* ``decisions/<c>/decisions.parquet``: one row per row the step decided on, in this order: the rows of
  its train split (``position`` = their index there) and the rows it dropped (``position`` -1). Columns:
  ``uid``, ``decision`` (``kept``, or the reason the step gave), ``position``, ``added`` (a row the step
  made: not in its input), the train split's columns that the step added to its input's (e.g. PDD's
  ``source_uid``, ``teacher_confidence``), and the score columns of its dropped rows (its
  :class:`~.steps.Rejects` ``extra``: ``aflite_score``, ``aflite_round``, ...); null where a row has none.
* ``decisions/<c>/added.parquet``: the rows the step made that are in the train split, with every column
  the build gave them (feature columns included).
* in ``manifest.json`` under ``decisions/<c>``: the step, the sha256 of its parameters (those that change
  a result: not ``progress``, ``device`` or the work folder ``out``) and of its input rows (every column,
  :func:`debiased_nli.data.loading.content_fingerprint`), the counts, the train split's features, and the
  sha256 of the two files and of ``rejected/<c>/``'s.

New rows made during the build (the ``generator`` and ``ibadr_rows`` source steps: G's samples kept by
the confidence filter, IBADR's pseudo samples) are recorded too, in ``decisions/new_rows/<k>-<step>/``:
``rows.parquet`` (the rows, every column), ``dropped.parquet`` (the rows the step dropped, with the reason
and score it gives, e.g. M's ``confidence``) and, in the manifest, the step, the sha256 of its parameters
and of D0's rows, and its report. (``files`` steps read their rows from files: those are their record.)

Replay (``debiased-nli build ... --replay OLD``, OLD a release folder). For each filter config, OLD's
record is used when its step, parameters and input rows are this build's, and its files are the ones its
manifest names: the train split is rebuilt from the input rows kept (by uid, in the recorded order) and
the recorded added rows, the dropped rows are OLD's ``rejected/<c>/`` rows, and the step's report is
OLD's. The release's data then equals OLD's byte for byte. Where a record does not fit, the step runs and
the build says why (another parameter, other input rows, a file changed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Mapping

from ..utils.errors import ConfigError
from ..utils.provenance import file_sha256

log = logging.getLogger(__name__)

DECISIONS_DIR = "decisions"
DECISIONS_FILE = "decisions.parquet"
ADDED_FILE = "added.parquet"
KEPT = "kept"
# parameters that do not change what a step decides: progress bars, the device, the step's work folder
VOLATILE_PARAMS = ("progress", "device", "out")


def params_sha256(params: Mapping[str, Any]) -> str:
    """The sha256 of the parameters that can change a step's result (JSON with sorted keys)."""
    kept = {k: v for k, v in params.items() if k not in VOLATILE_PARAMS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def input_sha256(ds) -> str:
    """A content hash of a step's input rows: every column, in order (not paths or modification times)."""
    from ..data.loading import content_fingerprint
    return content_fingerprint(ds)


@dataclasses.dataclass
class Record:
    """What :func:`record` gives the writer: the two tables and the manifest entry (the files' sha256 are
    added when they are written)."""

    decisions: Any   # datasets.Dataset
    added: Any       # datasets.Dataset (the train split's columns, may have no rows)
    entry: dict


def record(step: str, params: Mapping[str, Any], inputs, kept, dropped, score_columns=(), *,
           reason: str = "reason", input_hash: str | None = None) -> Record:
    """The decision record of one filter step: ``inputs`` the rows it got, ``kept`` its train split,
    ``dropped`` the rows it dropped as the release writes them (the ``reason`` column and its scores)."""
    import datasets
    import pyarrow as pa

    in_uids = set(inputs["uid"])
    kept_uids = list(kept["uid"])
    added_mask = [u not in in_uids for u in kept_uids]
    own = [c for c in kept.column_names if c not in inputs.column_names]  # columns the step gave its rows
    cols: dict[str, Any] = {
        "uid": pa.array(kept_uids + (list(dropped["uid"]) if dropped is not None else []), pa.string()),
    }
    n_kept, n_drop = len(kept), 0 if dropped is None else len(dropped)
    cols["decision"] = pa.array([KEPT] * n_kept + (list(dropped[reason]) if n_drop else []), pa.string())
    cols["position"] = pa.array(list(range(n_kept)) + [-1] * n_drop, pa.int64())
    cols["added"] = pa.array(added_mask + ([u not in in_uids for u in dropped["uid"]] if n_drop else []), pa.bool_())
    from ..data.loading import materialize  # the rows in order: ``.data`` alone ignores a selection's indices
    kept_table = materialize(kept.select_columns(own)).data.table if own else None
    drop_table = materialize(dropped).data.table if n_drop else None
    for name in list(own) + [c for c in score_columns if n_drop and c in dropped.column_names and c not in own]:
        parts = []
        typ = (kept_table.schema.field(name).type if kept_table is not None and name in kept_table.column_names
               else drop_table.schema.field(name).type)
        parts.append(kept_table.column(name).combine_chunks() if kept_table is not None and name in own
                     else pa.nulls(n_kept, typ))
        if n_drop:
            parts.append(drop_table.column(name).combine_chunks().cast(typ) if name in drop_table.column_names
                         else pa.nulls(n_drop, typ))
        cols[name] = pa.concat_arrays([p.cast(typ) for p in parts])
    decisions = datasets.Dataset(pa.table(cols))
    base = [c for c in kept.column_names if c in inputs.column_names]
    added_idx = [i for i, a in enumerate(added_mask) if a]
    added = kept.select(added_idx).select_columns(base).flatten_indices()
    entry = {
        "step": step,
        "params_sha256": params_sha256(params),
        "input_sha256": input_hash or input_sha256(inputs),
        "counts": {"input": len(inputs), "kept": n_kept, "added": len(added_idx), "dropped": n_drop},
        "score_columns": [c for c in decisions.column_names if c not in ("uid", "decision", "position", "added")],
        "kept_columns": list(kept.column_names),
        "kept_features": kept.features.to_dict(),
    }
    return Record(decisions, added, entry)


def write_record(folder: Path, name: str, rec: Record) -> dict:
    """``decisions/<name>/`` under the release folder being written; returns the manifest entry with the
    files' sha256 (relative paths)."""
    out = folder / DECISIONS_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    rec.decisions.to_parquet(str(out / DECISIONS_FILE))
    rec.added.to_parquet(str(out / ADDED_FILE))
    entry = dict(rec.entry)
    entry["files"] = {p.relative_to(folder).as_posix(): file_sha256(p) for p in (out / DECISIONS_FILE, out / ADDED_FILE)}
    rejected = sorted((folder / "rejected" / name).glob("*.parquet"))
    entry["rejected_files"] = {p.relative_to(folder).as_posix(): file_sha256(p) for p in rejected}
    return entry


@dataclasses.dataclass
class RowsRecord:
    """The record of a source step (new rows made in the build): its rows, the rows it dropped, the entry."""

    rows: Any
    dropped: Any
    entry: dict


ROWS_FILE, DROPPED_FILE = "rows.parquet", "dropped.parquet"


def new_rows_key(index: int, step: str) -> str:
    """The record name of the ``index``-th source step of a recipe's ``new_rows``."""
    return f"new_rows/{index}-{step}"


# What a step's report says about this run rather than its rows (wall time, throughput, the number of processes):
# left out of the recorded report, so that the manifest stays byte-identical across runs, machines and
# process counts (`build` under torchrun gives the one-process release).
RUN_ONLY_KEYS = frozenset({"this_run", "seconds", "seconds_by_part"})


def stable_report(report: Any) -> Any:
    """``report`` without the keys that describe the run, not the rows (RUN_ONLY_KEYS, and ``*_per_s``)."""
    if isinstance(report, Mapping):
        return {k: stable_report(v) for k, v in report.items()
                if k not in RUN_ONLY_KEYS and not str(k).endswith("_per_s")}
    if isinstance(report, (list, tuple)):
        return [stable_report(v) for v in report]
    return report


def rows_record(step: str, params: Mapping[str, Any], input_hash: str, rows, dropped, report) -> RowsRecord:
    entry = {"step": step, "params_sha256": params_sha256(params), "input_sha256": input_hash,
             "counts": {"rows": len(rows), "dropped": 0 if dropped is None else len(dropped)},
             "rows_features": rows.features.to_dict(), "rows_columns": list(rows.column_names),
             "report": stable_report(json.loads(json.dumps(report, default=str)))}
    return RowsRecord(rows, dropped, entry)


def write_rows_record(folder: Path, key: str, rec: RowsRecord) -> dict:
    """``decisions/<key>/`` under the release folder being written; the manifest entry with the files' sha256."""
    out = folder / DECISIONS_DIR / key
    out.mkdir(parents=True, exist_ok=True)
    rec.rows.to_parquet(str(out / ROWS_FILE))
    written = [out / ROWS_FILE]
    if rec.dropped is not None and len(rec.dropped):
        rec.dropped.to_parquet(str(out / DROPPED_FILE))
        written.append(out / DROPPED_FILE)
    return {**rec.entry, "files": {p.relative_to(folder).as_posix(): file_sha256(p) for p in written}}


class Replay:
    """The decision records of an earlier release (``--replay OLD``), looked up per filter config."""

    def __init__(self, release: "str | Path"):
        self.root = Path(release).expanduser()
        manifest = self.root / "manifest.json"
        if not manifest.is_file():
            raise ConfigError(f"--replay {release}: no manifest.json there; give the folder of a release written by "
                              f"debiased-nli build")
        self.manifest = json.loads(manifest.read_text())
        self.records = self.manifest.get("decisions") or {}
        if not self.records:
            log.warning("--replay %s: that release has no decision records (built before they were written, or "
                        "without filter steps); every step runs", release)
        self.used: dict[str, str] = {}      # config -> "replayed" or why not

    def lookup(self, name: str, step: str, params: Mapping[str, Any], inputs):
        """(kept, dropped, report) from the record of config ``name``, or None (the reason is logged and
        kept in :attr:`used`)."""
        rec = self._fitting(name, step, params, lambda: input_sha256(inputs), what=f"config {name!r}")
        return None if rec is None else self._outputs(name, rec, inputs)

    def lookup_rows(self, key: str, step: str, params: Mapping[str, Any], input_hash: str):
        """(rows, dropped, report) from the record of the source step ``key`` (:func:`new_rows_key`), or None."""
        import datasets

        rec = self._fitting(key, step, params, lambda: input_hash, what=f"new rows {key.split('/', 1)[1]!r}")
        if rec is None:
            return None
        folder = self.root / DECISIONS_DIR / key
        recorded = datasets.Features.from_dict(rec["rows_features"])
        features = datasets.Features({c: recorded[c] for c in rec["rows_columns"]})
        rows = datasets.Dataset.from_parquet(str(folder / ROWS_FILE)).select_columns(rec["rows_columns"]).cast(features)
        dropped = (datasets.Dataset.from_parquet(str(folder / DROPPED_FILE)) if (folder / DROPPED_FILE).is_file()
                   else None)
        return rows, dropped, rec.get("report") or {}

    def _fitting(self, name: str, step: str, params: Mapping[str, Any], input_hash, what: str):
        """The record ``name`` when it fits this step, its parameters and its input (``input_hash()``), else
        None, with the reason logged and kept in :attr:`used`."""
        rec = self.records.get(name)
        why = None
        if rec is None:
            why = "no record of it"
        elif rec["step"] != step:
            why = f"it was made by step {rec['step']!r}, not {step!r}"
        elif rec["params_sha256"] != params_sha256(params):
            why = "the step's parameters differ"
        else:
            have = input_hash()
            if rec["input_sha256"] != have:
                why = f"the step's input rows differ (sha256 {rec['input_sha256'][:12]} recorded, {have[:12]} now)"
            else:
                why = self._files_changed(rec)
        if why is not None:
            self.used[name] = f"not replayed: {why}"
            log.warning("%s: the decisions recorded in %s are not used (%s); step %r runs", what, self.root, why, step)
            return None
        self.used[name] = "replayed"
        log.info("%s: step %r replayed from the decisions recorded in %s", what, step, self.root)
        return rec

    def _files_changed(self, rec: Mapping[str, Any]) -> str | None:
        for rel, sha in {**rec["files"], **rec.get("rejected_files", {})}.items():
            path = self.root / rel
            if not path.is_file():
                return f"{rel} is missing"
            if file_sha256(path) != sha:
                return f"{rel} is not the file the manifest records (sha256 differs)"
        return None

    def _outputs(self, name: str, rec: Mapping[str, Any], inputs):
        import datasets
        import numpy as np

        dec = datasets.Dataset.from_parquet(str(self.root / DECISIONS_DIR / name / DECISIONS_FILE))
        added = datasets.Dataset.from_parquet(str(self.root / DECISIONS_DIR / name / ADDED_FILE))
        # in the train split's column order (the manifest's JSON sorts its keys)
        recorded = datasets.Features.from_dict(rec["kept_features"])
        features = datasets.Features({c: recorded[c] for c in rec["kept_columns"]})
        kept_rows = dec.filter(lambda b: [p >= 0 for p in b["position"]], batched=True).sort("position")
        if list(kept_rows["position"]) != list(range(rec["counts"]["kept"])):
            raise ConfigError(f"{self.root / DECISIONS_DIR / name / DECISIONS_FILE}: the kept rows' positions are "
                              f"not 0..{rec['counts']['kept'] - 1}")
        index = {u: i for i, u in enumerate(inputs["uid"])}
        add_index = {u: i for i, u in enumerate(added["uid"])}
        base = [c for c in rec["kept_columns"] if c in inputs.column_names]
        parts, order = [], []
        from_input = [index[u] for u, a in zip(kept_rows["uid"], kept_rows["added"]) if not a]
        from_added = [add_index[u] for u, a in zip(kept_rows["uid"], kept_rows["added"]) if a]
        n_in = len(from_input)
        src = iter(range(n_in)), iter(range(n_in, n_in + len(from_added)))
        for a in kept_rows["added"]:
            order.append(next(src[1]) if a else next(src[0]))
        parts.append(inputs.select(from_input).select_columns(base))
        if from_added:
            parts.append(added.select(from_added).select_columns(base).cast(parts[0].features))
        kept = datasets.concatenate_datasets(parts).select(np.asarray(order, dtype=np.int64)) if parts else None
        for col in rec["kept_columns"]:
            if col not in base:
                kept = kept.add_column(col, kept_rows[col], feature=features[col])
        kept = kept.select_columns(rec["kept_columns"]).cast(features).flatten_indices()
        rejected_files = sorted(rec.get("rejected_files", {}))
        dropped = (datasets.Dataset.from_parquet([str(self.root / f) for f in rejected_files])
                   if rejected_files else None)
        return kept, dropped, self.report(name, rec["step"])

    def report(self, name: str, step: str) -> dict:
        """The step's report as the recorded release's manifest holds it."""
        for stage in self.manifest.get("stages", []):
            if stage.get("stage") == f"{name}: {step}":
                return dict(stage.get("report") or {})
        return {}
