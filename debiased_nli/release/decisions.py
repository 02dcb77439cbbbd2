"""Decision records: what each filter step of a build decided and the scores it decided from, so that a
rebuild reproduces the release exactly on any machine.

Why. The z-path of a release (features, the TF-IDF hypothesis-only model, z-statistics, z-filtering) is
bit-identical whatever the CPU and thread count (:mod:`debiased_nli.bias.logreg`). The neural steps are
not and cannot be: AFLite's fine-tuned encoder and linear models, PDD's masked LM and teacher, IBADR's
generator and classifiers compute in float32 with kernels that differ between instruction sets and
thread counts, so a score near a threshold lands on either side (measured on the 20k SNLI sample: the
documentation's Data model page). Instead of hoping, the build records each decision.

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
import os
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


def _read_parquet(path: Path):
    """A decision record's table as a ``datasets.Dataset`` (its features from the file's metadata), read with
    pyarrow: a table of no rows (AFLite adds none) is a table, and nothing is written to the datasets cache."""
    import datasets
    import pyarrow.parquet as pq

    try:
        return datasets.Dataset(pq.read_table(str(path)))
    except Exception as err:  # ArrowInvalid, OSError: a damaged file the manifest's sha256 did not catch
        raise ConfigError(f"--replay: {path}: cannot read it as Parquet ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:160]})") from None


class Replay:
    """The decision records of an earlier release (``--replay OLD``), looked up per filter config.

    Nothing outside OLD is read: every file comes from the record's own list, is a regular file inside OLD
    (:func:`~debiased_nli.utils.paths.release_file`) and has the sha256 the manifest records. A record is used
    only when its decisions make a partition of this build's input rows (each uid kept or dropped exactly
    once, none that is not an input row) and the dropped rows are its ``rejected/<config>/`` rows; a record of
    the wrong shape is a one-line error."""

    def __init__(self, release: "str | Path"):
        from ..utils.paths import check_relative, read_json

        self.root = Path(release).expanduser()
        manifest = self.root / "manifest.json"
        if not manifest.is_file():
            raise ConfigError(f"--replay {release}: no manifest.json there; give the folder of a release written by "
                              f"debiased-nli build")
        self.manifest = read_json(manifest, "--replay: manifest", kind=dict)
        self.records = self.manifest.get("decisions") or {}
        if not isinstance(self.records, dict) or not all(isinstance(r, dict) for r in self.records.values()):
            raise ConfigError(f"--replay: {manifest}: `decisions` is not a mapping of records; not a release's manifest")
        for key in self.records:
            check_relative(key, f"--replay: {manifest}: decision record")
        if not isinstance(self.manifest.get("stages", []), list):
            raise ConfigError(f"--replay: {manifest}: `stages` is not a list; not a release's manifest")
        if not self.records:
            log.warning("--replay %s: that release has no decision records (built before they were written, or "
                        "without filter steps); every step runs", release)
        self.used: dict[str, str] = {}      # config -> "replayed" or why not

    def lookup(self, name: str, step: str, params: Mapping[str, Any], inputs):
        """(kept, dropped, report) from the record of config ``name``, or None (the reason is logged and
        kept in :attr:`used`)."""
        rec = self._fitting(name, step, params, lambda: input_sha256(inputs), what=f"config {name!r}",
                            needs=(DECISIONS_FILE, ADDED_FILE))
        return None if rec is None else self._outputs(name, rec, inputs)

    def lookup_rows(self, key: str, step: str, params: Mapping[str, Any], input_hash: str):
        """(rows, dropped, report) from the record of the source step ``key`` (:func:`new_rows_key`), or None."""
        import datasets

        rec = self._fitting(key, step, params, lambda: input_hash, what=f"new rows {key.split('/', 1)[-1]!r}",
                            needs=(ROWS_FILE,))
        if rec is None:
            return None
        folder = f"{DECISIONS_DIR}/{key}"
        recorded = datasets.Features.from_dict(rec["rows_features"])
        features = datasets.Features({c: recorded[c] for c in rec["rows_columns"]})
        rows = self._table(rec, f"{folder}/{ROWS_FILE}").select_columns(rec["rows_columns"]).cast(features)
        dropped = (self._table(rec, f"{folder}/{DROPPED_FILE}") if f"{folder}/{DROPPED_FILE}" in rec["files"]
                   else None)
        if len(rows) != rec["counts"]["rows"] or (len(dropped) if dropped is not None else 0) != rec["counts"]["dropped"]:
            raise ConfigError(f"--replay: {self.root / folder}: its files hold {len(rows)} rows and "
                              f"{len(dropped) if dropped is not None else 0} dropped rows, the manifest counts "
                              f"{rec['counts']}; the record is not whole")
        report = rec.get("report")
        return rows, dropped, dict(report) if isinstance(report, dict) else {}

    def _table(self, rec: Mapping[str, Any], rel: str):
        """A file of the record: listed in it, inside the release, with the sha256 it records."""
        from ..utils.paths import release_file

        return _read_parquet(release_file(self.root, rel, sha256=rec["files"][rel], what="--replay: file"))

    def _check_shape(self, name: str, rec: Mapping[str, Any], needs: tuple) -> None:
        """A record has the fields a build writes, of their types, and lists its own files: else one line."""
        where = f"--replay: {self.root / 'manifest.json'}: decisions.{name}"
        strings = ("step", "params_sha256", "input_sha256")
        if not all(isinstance(rec.get(k), str) for k in strings) or not isinstance(rec.get("files"), dict) \
                or not isinstance(rec.get("counts"), dict) \
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in rec["counts"].values()) \
                or not isinstance(rec.get("rejected_files", {}), dict):
            raise ConfigError(f"{where} is not a decision record (it needs {', '.join(strings)}, files, counts); "
                              f"not a release written by debiased-nli build")
        features = ("kept_features", "kept_columns") if DECISIONS_FILE in needs else ("rows_features", "rows_columns")
        if not isinstance(rec.get(features[0]), dict) or not isinstance(rec.get(features[1]), list) \
                or not all(isinstance(c, str) for c in rec[features[1]]):
            raise ConfigError(f"{where} lacks {features[0]} / {features[1]}; not a decision record of this kind")
        counts = ("input", "kept", "added", "dropped") if DECISIONS_FILE in needs else ("rows", "dropped")
        if any(k not in rec["counts"] for k in counts):
            raise ConfigError(f"{where}: counts {rec['counts']} lack {', '.join(k for k in counts if k not in rec['counts'])}")
        for f in needs:
            if f"{DECISIONS_DIR}/{name}/{f}" not in rec["files"]:
                raise ConfigError(f"{where} does not list its file {DECISIONS_DIR}/{name}/{f}")
        allowed = f"{DECISIONS_DIR}/{name}/"
        for rel in rec["files"]:
            if not isinstance(rel, str) or not rel.startswith(allowed):
                raise ConfigError(f"{where} lists the file {rel!r}, which is not in its own folder {allowed}")
        for rel in rec.get("rejected_files", {}):
            if not isinstance(rel, str) or not rel.startswith(f"rejected/{name}/"):
                raise ConfigError(f"{where} lists the rejected file {rel!r}, which is not in rejected/{name}/")

    def _fitting(self, name: str, step: str, params: Mapping[str, Any], input_hash, what: str, needs: tuple):
        """The record ``name`` when it fits this step, its parameters and its input (``input_hash()``), else
        None, with the reason logged and kept in :attr:`used`."""
        rec = self.records.get(name)
        why = None
        if rec is None:
            why = "no record of it"
        else:
            self._check_shape(name, rec, needs)
        if why is not None:
            pass
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
        """Why the record's files are not the ones its manifest records (None: they are). A file that is not a
        regular file inside the release (a link, a path out of it) is an error, not a reason."""
        from ..utils.paths import ChecksumMismatch, release_file

        for rel, sha in {**rec["files"], **rec.get("rejected_files", {})}.items():
            path = self.root / rel
            if not os.path.lexists(path):
                return f"{rel} is missing"
            try:
                release_file(self.root, rel, sha256=sha, what="--replay: file")
            except ChecksumMismatch:
                return f"{rel} is not the file the manifest records (sha256 differs)"
        return None

    def _outputs(self, name: str, rec: Mapping[str, Any], inputs):
        import datasets
        import numpy as np

        where = self.root / DECISIONS_DIR / name
        dec = self._table(rec, f"{DECISIONS_DIR}/{name}/{DECISIONS_FILE}")
        added = self._table(rec, f"{DECISIONS_DIR}/{name}/{ADDED_FILE}")
        for col, table in (("uid", dec), ("position", dec), ("added", dec), ("decision", dec), ("uid", added)):
            if col not in table.column_names:
                raise ConfigError(f"--replay: {where}: a decision table without the column {col!r}")
        # in the train split's column order (the manifest's JSON sorts its keys)
        recorded = datasets.Features.from_dict(rec["kept_features"])
        features = datasets.Features({c: recorded[c] for c in rec["kept_columns"]})
        kept_rows = dec.filter(lambda b: [p >= 0 for p in b["position"]], batched=True).sort("position")
        if list(kept_rows["position"]) != list(range(rec["counts"]["kept"])):
            raise ConfigError(f"{where / DECISIONS_FILE}: the kept rows' positions are "
                              f"not 0..{rec['counts']['kept'] - 1}")
        self._check_partition(where, dec, added, inputs)
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
                if col not in kept_rows.column_names:
                    raise ConfigError(f"--replay: {where / DECISIONS_FILE}: lacks the column {col!r} its record names")
                kept = kept.add_column(col, kept_rows[col], feature=features[col])
        kept = kept.select_columns(rec["kept_columns"]).cast(features).flatten_indices()
        rejected_files = sorted(rec.get("rejected_files", {}))
        dropped = (datasets.concatenate_datasets([self._rejected(rec, f) for f in rejected_files])
                   if rejected_files else None)
        dropped_uids = [u for u, p in zip(dec["uid"], dec["position"]) if p < 0]
        have = list(dropped["uid"]) if dropped is not None and "uid" in dropped.column_names else []
        if sorted(have) != sorted(dropped_uids):
            raise ConfigError(f"--replay: {self.root / 'rejected' / name}: its rows are not the {len(dropped_uids):,} "
                              f"rows {where / DECISIONS_FILE} records as dropped ({len(have):,} rows there)")
        return kept, dropped, self.report(name, rec["step"])

    def _rejected(self, rec: Mapping[str, Any], rel: str):
        from ..utils.paths import release_file

        return _read_parquet(release_file(self.root, rel, sha256=rec["rejected_files"][rel], what="--replay: file"))

    @staticmethod
    def _check_partition(where: Path, dec, added, inputs) -> None:
        """The record's rows from the input (kept ones not added, and every dropped one) are the input rows,
        each exactly once; its added rows are in ``added.parquet``: else the record is not this step's on these
        rows, and using it would lose or repeat rows."""
        import collections

        from ..utils.errors import excerpt

        input_uids = list(inputs["uid"])
        in_set = set(input_uids)
        from_input = [u for u, a, p in zip(dec["uid"], dec["added"], dec["position"]) if not (a and p >= 0)]
        strangers = [u for u in from_input if u not in in_set]
        if strangers:
            raise ConfigError(f"--replay: {where / DECISIONS_FILE}: {len(strangers):,} row(s) whose uid is not an input "
                              f"row of this build (e.g. {excerpt(strangers[0], 60)}); not this step's record")
        counts = collections.Counter(from_input)
        twice = [u for u, c in counts.items() if c > 1]
        missing = [u for u in input_uids if u not in counts]
        if twice or missing:
            raise ConfigError(f"--replay: {where / DECISIONS_FILE}: kept and dropped rows are not a partition of the "
                              f"{len(input_uids):,} input rows ({len(twice):,} recorded more than once, e.g. "
                              f"{excerpt(twice[0] if twice else None, 60)}; {len(missing):,} in neither, e.g. "
                              f"{excerpt(missing[0] if missing else None, 60)})")
        made = {u for u, a, p in zip(dec["uid"], dec["added"], dec["position"]) if a and p >= 0}
        lacking = made - set(added["uid"])
        if lacking:
            raise ConfigError(f"--replay: {where / ADDED_FILE}: lacks {len(lacking):,} row(s) the record keeps as "
                              f"added (e.g. {excerpt(sorted(lacking)[0], 60)})")

    def report(self, name: str, step: str) -> dict:
        """The step's report as the recorded release's manifest holds it."""
        for stage in self.manifest.get("stages", []):
            if isinstance(stage, dict) and stage.get("stage") == f"{name}: {step}":
                report = stage.get("report")
                return dict(report) if isinstance(report, dict) else {}
        return {}
