"""Loading a task's data (Hub or local files) into the canonical schema, with input validation.

Every stage takes and returns ``datasets.Dataset`` objects with the canonical columns

    premise (string), hypothesis (string), label (ClassLabel of the task), uid, origin, method

``uid`` is ``<task>:<split>:<row>`` for original rows (row = position in the split, across files in
the order given) and a content hash for new rows; ``origin`` is ``original``, ``generated`` or
``perturbed``; ``method`` names what made the row (``source`` for original rows).

Validation is vectorised (pyarrow) and either raises an :class:`InvalidInputError` naming the file,
row, column and value of the first bad row (and how many more there are), or, with
``on_invalid="set_aside"``, returns those rows separately with their reason. Nothing is dropped
silently.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..utils.errors import ConfigError, InvalidInputError
from ..utils.paths import check_input_file, check_name
from .tasks import TaskSpec, get_task

ORIGINS = ("original", "generated", "perturbed")
PROVENANCE_COLUMNS = ("uid", "origin", "method")
ON_INVALID = ("error", "set_aside")
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv"}

REASON_MISSING_TEXT = "empty or null text"
REASON_NOT_TEXT = "text is not a string"
REASON_NO_GOLD = "no gold label"
REASON_BAD_LABEL = "label out of range"
REASON_DUPLICATE_ID = "duplicate id"


def canonical_features(task: TaskSpec):
    import datasets
    return datasets.Features({
        "premise": datasets.Value("string"),
        "hypothesis": datasets.Value("string"),
        "label": datasets.ClassLabel(names=list(task.labels)),
        "uid": datasets.Value("string"),
        "origin": datasets.Value("string"),
        "method": datasets.Value("string"),
    })


def parse_data_files(spec: "str | Sequence[str] | Mapping[str, Any] | None") -> dict[str, list[str]] | None:
    """``PATH`` (the train split), ``["train=a.parquet", "validation=b.jsonl"]`` or a dict -> split: files.

    Globs are expanded; a path that matches nothing is an error.
    """
    if spec is None or spec == [] or spec == {}:
        return None
    items: list[tuple[str, Any]]
    if isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        entries = [spec] if isinstance(spec, str) else list(spec)
        items = []
        for entry in entries:
            split, sep, path = entry.partition("=")
            items.append((split, path) if sep and not os.path.exists(entry) else ("train", entry))
    out: dict[str, list[str]] = {}
    for split, paths in items:
        check_name(split, "split name")  # it names the release's files: <split>-00000-of-00001.parquet
        for path in [paths] if isinstance(paths, (str, Path)) else paths:
            matches = sorted(glob.glob(str(path))) or ([str(path)] if os.path.lexists(path) else [])
            if not matches:
                raise ConfigError(f"data file {path!r} (split {split!r}) does not exist")
            for match in matches:
                check_input_file(match)
            out.setdefault(split, []).extend(matches)
    return out


def file_fingerprint(path: str) -> dict[str, Any]:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        size = os.path.getsize(path)
    except OSError as err:
        raise InvalidInputError(f"{path}: cannot read it ({err.strerror or err})", file=str(path)) from err
    return {"path": str(path), "bytes": size, "sha256": h.hexdigest()}


def content_fingerprint(ds) -> str:
    """A hash of a dataset's rows and features, 16 hex digits.

    ``datasets``' own ``_fingerprint`` of a file it read hashes the file's path and modification time,
    so the same rows read again after a copy, a checkout or a remount of the data get another one, and a
    run recorded with it cannot be resumed. This one depends only on the features and the values of the
    rows, in order: not on how Arrow holds them (chunks, slices, an indices mapping, validity bitmaps
    allocated or not; Arrow's IPC bytes depend on those). About 0.5 s per million SNLI rows."""
    table = materialize(ds).data.table  # the rows in the dataset's order, without an indices mapping
    h = hashlib.sha256(json.dumps(ds.features.to_dict(), sort_keys=True, default=str).encode())
    h.update(f"rows={table.num_rows}".encode())
    for name in table.column_names:
        h.update(f"column={name}".encode())
        for part in _value_bytes(table.column(name).combine_chunks()):
            h.update(part)
    return h.hexdigest()[:16]


def _value_bytes(arr: pa.Array):
    """The values of one column as bytes that depend on nothing but the values (and which are null)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    yield np.packbits(pc.is_valid(arr).to_numpy(zero_copy_only=False)).tobytes()
    if any(f(arr.type) for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                                 pa.types.is_large_binary)):
        text = arr.cast(pa.large_binary()).fill_null(b"")
        _, offsets, data = text.buffers()
        at = np.frombuffer(offsets, dtype=np.int64)[text.offset:text.offset + len(text) + 1]
        yield (at - at[0]).tobytes()
        yield memoryview(data)[int(at[0]):int(at[-1])] if data is not None else b""
    elif pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        yield arr.fill_null(False if pa.types.is_boolean(arr.type) else 0).to_numpy(zero_copy_only=False).tobytes()
    else:  # lists, structs, dates...: rare in a sentence-pair set, hashed through their Python values
        yield json.dumps(arr.to_pylist(), default=str).encode()


def root_cause(err: BaseException) -> str:
    """``Type: message`` of the innermost cause of an error (``datasets`` wraps the reader's own), one line."""
    seen = set()
    while (err.__cause__ or err.__context__) is not None and id(err) not in seen:
        seen.add(id(err))
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    text = " ".join(str(err).split()) or "(no message)"
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(err).__name__}: {text}"


_READER_NAMES = {"parquet": "Parquet", "json": "JSON lines", "csv": "CSV"}


def read_data_file(path: str, sha256: str, *, cache_dir: str | None = None):
    """One local parquet/jsonl/csv/tsv file through ``datasets.load_dataset`` (the Hub's code path).

    The file's content hash is part of the cache key (as the config name), so a file rewritten in place
    with its old modification time (``cp -p``, ``rsync -a``) is read again, not served from the cache.
    A file that cannot be read is an :class:`InvalidInputError` naming it and the reader's reason.
    """
    import datasets

    ext = Path(path).suffix.lower()
    if ext not in _BUILDERS:
        raise ConfigError(f"{path}: unsupported file type {ext!r}; use parquet, jsonl/json or csv/tsv")
    builder = _BUILDERS[ext]
    kind = "TSV" if ext == ".tsv" else _READER_NAMES[builder]
    if os.path.getsize(path) == 0:
        raise InvalidInputError(f"{path}: the file is empty (0 bytes); expected {kind} rows", file=path)
    kwargs = {"delimiter": "\t"} if ext == ".tsv" else {}
    readers_log = logging.getLogger(f"datasets.packaged_modules.{builder}")
    level = readers_log.level
    readers_log.setLevel(logging.CRITICAL)  # a reader's own log of the failure would repeat ours
    try:
        ds = datasets.load_dataset(builder, name=f"sha256-{sha256[:32]}", data_files=path, split="train",
                                   cache_dir=cache_dir, **kwargs)
    except Exception as err:
        cause = root_cause(err).rstrip(".")
        hint = ""
        if "UnicodeDecodeError" in cause or "UTF8" in cause or "utf-8" in cause:
            hint = " The file is not UTF-8 text: re-encode it (e.g. `iconv -f latin1 -t utf-8`)."
        elif builder == "parquet":
            hint = " The file is truncated, corrupt or not Parquet."
        raise InvalidInputError(f"{path}: cannot read it as {kind}: {cause}.{hint}", file=path) from err
    finally:
        readers_log.setLevel(level)
    # datasets' fingerprint of a file hashes its path and modification time: the same bytes copied,
    # checked out or remounted would miss every cache keyed on it (features, hypothesis-only models)
    from datasets.fingerprint import Hasher
    ds._fingerprint = Hasher.hash(["read_data_file", builder, sha256, kwargs])
    return ds


@dataclasses.dataclass
class LoadedSplit:
    """A canonical split, the rows set aside (with ``reason``, ``file``, ``row``) and where it came from."""

    dataset: Any
    set_aside: Any
    source: dict[str, Any]

    @property
    def counts(self) -> dict[str, int]:
        reasons: dict[str, int] = {}
        if self.set_aside is not None and len(self.set_aside):
            for r in self.set_aside["reason"]:
                reasons[r] = reasons.get(r, 0) + 1
        return {"loaded": len(self.dataset) + sum(reasons.values()), "kept": len(self.dataset),
                **{f"set_aside:{k}": v for k, v in sorted(reasons.items())}}


def _default_files(task: TaskSpec) -> dict[str, list[str]] | None:
    if not task.default_data_files:
        return None
    base = resources.files("debiased_nli.data") / "demo"
    return {split: [str(base / f)] for split, f in task.default_data_files.items()}


def load_task(task: "str | TaskSpec", split: str = "train", *, data_files=None, on_invalid: str = "error",
              revision: str | None = None, max_rows: int | None = None, cache_dir: str | None = None,
              hub_path: str | None = None) -> LoadedSplit:
    """Load one split of a task in the canonical schema.

    ``data_files`` (see :func:`parse_data_files`) reads local parquet/jsonl/csv through the same code
    path as the Hub; otherwise the task's Hub dataset (or ``hub_path``) is loaded at ``revision``.
    """
    import datasets

    task = get_task(task)
    if on_invalid not in ON_INVALID:
        raise ConfigError(f"on_invalid must be one of {ON_INVALID}, not {on_invalid!r}")
    if max_rows is not None and (not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1):
        raise ConfigError(f"max_rows must be a positive integer, got {max_rows!r}")
    files = parse_data_files(data_files) or (_default_files(task) if hub_path is None else None)
    parts, sources = [], []
    if files is not None:
        if split not in files:
            raise ConfigError(f"no data files for split {split!r} of task {task.name!r}; "
                              f"given splits: {sorted(files)} (use --data-files {split}=PATH)")
        for path in files[split]:
            ext = "".join(Path(path).suffixes[-1:]).lower()
            if ext not in _BUILDERS:
                raise ConfigError(f"{path}: unsupported file type {ext!r}; use parquet, jsonl/json or csv/tsv")
            fingerprint = file_fingerprint(path)
            raw = read_data_file(path, fingerprint["sha256"], cache_dir=cache_dir)
            parts.append((path, raw, task.columns, None))
            sources.append({"type": "file", **fingerprint})
    else:
        if task.hub is None and hub_path is None:
            raise ConfigError(f"task {task.name!r} has no Hub source; pass --data-files")
        path = hub_path or task.hub.path  # type: ignore[union-attr]
        name = None if hub_path else task.hub.name  # type: ignore[union-attr]
        hub_split = (task.hub.splits.get(split, split) if task.hub and not hub_path else split)
        try:
            raw = datasets.load_dataset(path, name, split=hub_split, revision=revision, cache_dir=cache_dir)
        except Exception as err:  # offline, unknown repo or split, a broken download: one line, not a traceback
            raise ConfigError(f"cannot load {path}{'/' + name if name else ''} [{hub_split}] from the Hub"
                              f"{' at revision ' + revision if revision else ''}: {root_cause(err)}. "
                              f"Offline? Pass local files with --data-files.") from err
        columns = (task.hub.columns if task.hub and task.hub.columns and not hub_path else None) or task.columns
        label_values = task.hub.label_values if task.hub and not hub_path else None
        parts.append((f"{path}{'/' + name if name else ''}[{hub_split}]", raw, columns, label_values))
        sources.append({"type": "hub", "path": path, "name": name, "split": hub_split, "revision": revision,
                        "fingerprint": raw._fingerprint})
    kept, aside, offset = [], [], 0
    for where, raw, columns, label_values in parts:
        if max_rows is not None:
            remaining = max_rows - offset
            if remaining <= 0:
                break
            raw = raw.select(range(min(remaining, len(raw))))
        ds, bad = canonicalize(raw, task, split=split, columns=columns, label_values=label_values,
                               on_invalid=on_invalid, where=where, row_offset=offset)
        offset += len(raw)
        kept.append(ds)
        if bad is not None:
            aside.append(bad)
    dataset = kept[0] if len(kept) == 1 else datasets.concatenate_datasets(kept)
    set_aside = None
    if aside:
        set_aside = aside[0] if len(aside) == 1 else datasets.concatenate_datasets(aside)
    return LoadedSplit(dataset, set_aside, {"task": task.name, "split": split, "inputs": sources})


def _label_codes(values: pa.Array, lookup: Mapping[Any, int]) -> np.ndarray:
    """Source label values -> label index; -1 where the value is not accepted."""
    as_str = pc.cast(values, pa.string()) if not pa.types.is_string(values.type) else values
    if pa.types.is_floating(values.type):  # 1.0 -> "1"
        ints = pc.cast(pc.round(values), pa.int64(), safe=False)
        as_str = pc.if_else(pc.equal(values, pc.cast(ints, values.type)), pc.cast(ints, pa.string()), as_str)
    as_str = pc.utf8_trim_whitespace(as_str)
    keys = [k for k in lookup if isinstance(k, str)]
    pos = pc.index_in(as_str, value_set=pa.array(keys, pa.string())).fill_null(len(keys))
    mapped = np.array([lookup[k] for k in keys] + [-1], dtype=np.int64)
    return mapped[pos.to_numpy(zero_copy_only=False).astype(np.int64)]


def _text_column(table: pa.Table, col: str) -> tuple[pa.Array, np.ndarray]:
    """The column as strings, and where it holds something else (a number, a list, a mapping).

    Such values become null here and the row is marked: they are never turned into text (a JSON
    column would otherwise release every value JSON-quoted)."""
    arr = table.column(col).combine_chunks()
    n = len(arr)
    if isinstance(arr.type, pa.BaseExtensionType):
        # a JSON column (a JSONL file whose values are not all strings): decode, then check each value
        storage = arr.storage.to_pylist()
        values = ([None if v is None else json.loads(v) for v in storage]
                  if arr.type.extension_name == "arrow.json" else arr.to_pylist())
    elif pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr, np.zeros(n, bool)
    elif pa.types.is_null(arr.type):
        return pa.nulls(n, pa.string()), np.zeros(n, bool)
    else:
        values = arr.to_pylist()
    not_text = np.fromiter((v is not None and not isinstance(v, str) for v in values), bool, n)
    return pa.array([v if isinstance(v, str) else None for v in values], pa.string()), not_text


def canonicalize(raw, task: TaskSpec, *, split: str = "train", columns: Mapping[str, str] | None = None,
                 label_values: Mapping[Any, str] | None = None, on_invalid: str = "error",
                 where: str = "<dataset>", row_offset: int = 0, origin: str = "original",
                 method: str = "source"):
    """Validate a raw dataset and map it onto the canonical columns. Returns (kept, set_aside or None)."""
    import datasets

    columns = columns or task.columns
    table = raw.with_format("arrow")[:] if raw._indices is not None else raw.data.table
    _check_columns(table, columns, where)
    n = table.num_rows
    premise, premise_not_text = _text_column(table, columns["premise"])
    hypothesis, hypothesis_not_text = _text_column(table, columns["hypothesis"])
    label_raw = table.column(columns["label"]).combine_chunks()
    if isinstance(raw.features.get(columns["label"]), datasets.ClassLabel):
        names = raw.features[columns["label"]].names
        if label_values is None and list(names) != list(task.labels):
            # a ClassLabel source: map its names onto the task's labels
            label_values = {i: nm for i, nm in enumerate(names) if nm in task.labels}
    lookup = task.label_lookup(label_values)
    codes = _label_codes(label_raw, lookup)
    reason, bad_col = _invalid_rows(table, task, columns, premise, hypothesis, premise_not_text,
                                    hypothesis_not_text, label_raw, codes)
    bad = np.nonzero(reason != "")[0]
    if len(bad) and on_invalid == "error":
        _raise_first_invalid(table, task, lookup, reason, bad_col, bad, where)

    label_arr = pa.array(np.where(codes >= 0, codes, -1), pa.int64())
    uid = pa.array([f"{task.name}:{split}:{i}" for i in range(row_offset, row_offset + n)], pa.string())
    canon = pa.table({
        "premise": premise, "hypothesis": hypothesis, "label": label_arr, "uid": uid,
        "origin": pa.array([origin] * n, pa.string()), "method": pa.array([method] * n, pa.string()),
    })
    set_aside = None
    if len(bad):
        good = np.nonzero(reason == "")[0]
        set_aside = datasets.Dataset(_set_aside_table(table, bad, reason, bad_col, premise, hypothesis, uid, where))
        canon = canon.take(pa.array(good))
    features = canonical_features(task)
    # a deterministic fingerprint (source fingerprint + how it was canonicalised), so that the
    # feature map on top of it is cached across runs
    from datasets.fingerprint import Hasher
    fp = Hasher.hash([getattr(raw, "_fingerprint", None), task.to_dict(), dict(columns), split, on_invalid,
                      row_offset, origin, method, dict(label_values or {})])
    ds = datasets.Dataset(canon.cast(features.arrow_schema), info=datasets.DatasetInfo(features=features),
                          fingerprint=fp)
    return ds, set_aside


def _check_columns(table: pa.Table, columns: Mapping[str, str], where: str) -> None:
    """Refuse a source without one of the mapped columns (with a hint when the delimiter looks wrong)."""
    missing = [f"{canon} (source column {src!r})" for canon, src in columns.items() if src not in table.column_names]
    if missing:
        names = table.column_names
        hint = ("Is the delimiter right? A .csv file must be comma-separated, a .tsv file tab-separated. "
                if len(names) == 1 and any(c in names[0] for c in ",;\t|") else "")
        raise InvalidInputError(
            f"{where}: missing column(s) {', '.join(missing)}; the file has {names}. {hint}"
            f"Map columns with --columns premise=COL,hypothesis=COL,label=COL or a task YAML.",
            file=where, column=missing[0])


def _invalid_rows(table: pa.Table, task: TaskSpec, columns: Mapping[str, str], premise, hypothesis,
                  premise_not_text: np.ndarray, hypothesis_not_text: np.ndarray, label_raw,
                  codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Why each row is invalid ("" where it is valid) and the source column at fault, the first reason
    winning: text that is not a string, missing text, no gold label, a label not accepted, a repeated id."""
    n = table.num_rows
    reason = np.full(n, "", dtype=object)
    bad_col = np.full(n, "", dtype=object)

    def mark(mask: np.ndarray, why: str, col: str) -> None:
        new = mask & (reason == "")
        reason[new], bad_col[new] = why, col

    mark(premise_not_text, REASON_NOT_TEXT, columns["premise"])
    mark(hypothesis_not_text, REASON_NOT_TEXT, columns["hypothesis"])
    for canon in ("premise", "hypothesis"):
        arr = premise if canon == "premise" else hypothesis
        empty = pc.or_kleene(pc.is_null(arr), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(arr)), 0))
        mark(empty.fill_null(True).to_numpy(zero_copy_only=False), REASON_MISSING_TEXT, columns[canon])
    if task.unlabeled_values:
        unl = pc.is_in(pc.cast(label_raw, pa.string()) if not pa.types.is_string(label_raw.type) else label_raw,
                       value_set=pa.array([str(v) for v in task.unlabeled_values], pa.string()))
        mark(unl.fill_null(False).to_numpy(zero_copy_only=False), REASON_NO_GOLD, columns["label"])
    mark(codes < 0, REASON_BAD_LABEL, columns["label"])
    if task.id_column and task.id_column in table.column_names:
        mark(_repeated_ids(table.column(task.id_column)), REASON_DUPLICATE_ID, task.id_column)
    return reason, bad_col


def _repeated_ids(column) -> np.ndarray:
    """Rows whose (non-null) id an earlier row already has; the first occurrence is kept."""
    ids = pc.cast(column.combine_chunks(), pa.string())
    n = len(ids)
    valid_ids = ~pc.is_null(ids).to_numpy(zero_copy_only=False)
    enc = pc.dictionary_encode(ids.fill_null(""))
    counts = np.bincount(enc.indices.to_numpy(), minlength=len(enc.dictionary))
    seen_before = np.zeros(n, bool)
    idx = enc.indices.to_numpy()
    dup_rows = np.nonzero(valid_ids & (counts[idx] > 1))[0]
    if len(dup_rows):
        _, first = np.unique(idx[dup_rows], return_index=True)
        seen_before[dup_rows] = True
        seen_before[dup_rows[first]] = False  # the first occurrence is kept
    return seen_before


def _raise_first_invalid(table: pa.Table, task: TaskSpec, lookup: Mapping[Any, int], reason: np.ndarray,
                         bad_col: np.ndarray, bad: np.ndarray, where: str) -> None:
    """``on_invalid="error"``: the first invalid row, its column, value and reason, with a hint."""
    i = int(bad[0])
    col = str(bad_col[i])
    value = table.column(col)[i].as_py()
    hint = {
        REASON_NO_GOLD: f"{task.name} marks pairs without a gold label with {list(task.unlabeled_values)}",
        REASON_BAD_LABEL: f"accepted labels are {sorted(map(str, lookup))}",
        REASON_MISSING_TEXT: "every premise and hypothesis needs some text",
        REASON_NOT_TEXT: "premise and hypothesis must be strings, not numbers, lists or mappings",
        REASON_DUPLICATE_ID: f"ids in column {col!r} must be unique",
    }[str(reason[i])]
    raise InvalidInputError(
        f"{where}: row {i} (0-based), column {col!r}, value {value!r}: "
        f"{reason[i]} ({hint}). {len(bad) - 1} more row(s) have problems. Fix the input, or pass "
        f"--on-invalid set_aside to set such rows aside (they are written out and counted).",
        file=where, row=i, column=col, value=value, reason=str(reason[i]))


def _set_aside_table(table: pa.Table, bad: np.ndarray, reason: np.ndarray, bad_col: np.ndarray, premise,
                     hypothesis, uid, where: str) -> pa.Table:
    """The rows set aside: file, row, column at fault, its value as text, reason, premise, hypothesis, uid."""
    return pa.table({
        "file": pa.array([where] * len(bad), pa.string()),
        "row": pa.array(bad, pa.int64()),
        "column": pa.array(bad_col[bad].tolist(), pa.string()),
        "value": pa.array([_as_text(table.column(str(bad_col[i]))[int(i)].as_py()) for i in bad], pa.string()),
        "reason": pa.array(reason[bad].tolist(), pa.string()),
        "premise": premise.take(pa.array(bad)),
        "hypothesis": hypothesis.take(pa.array(bad)),
        "uid": uid.take(pa.array(bad)),
    })


def _as_text(value: Any) -> str | None:
    return None if value is None else str(value)


def combine_set_aside(parts: Sequence[tuple[str, Any]]):
    """The rows set aside by every input, in one dataset with an ``input`` column (``train``,
    ``eval:<split>``, ``new_rows:<method>``), and the count per input. (None, {}) when there are none."""
    import datasets

    tables, counts = [], {}
    for where, sa in parts:
        if sa is None or not len(sa):
            continue
        counts[where] = counts.get(where, 0) + len(sa)
        tables.append(sa.flatten_indices().data.table.append_column("input", pa.array([where] * len(sa), pa.string())))
    if not tables:
        return None, {}
    return datasets.Dataset(pa.concat_tables(tables, promote_options="permissive")), counts


def _set_aside_why(row: Mapping[str, Any]) -> str:
    """Why one set-aside row was set aside, in a few words: ``hypothesis is a list``, ``label 7 out of range``."""
    import ast

    col, reason, value = row.get("column") or "?", row.get("reason") or "?", row.get("value")
    if reason == REASON_NOT_TEXT:
        try:  # the value is stored as text (str() of the value read): name what it was
            parsed = ast.literal_eval(value) if value is not None else None
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            parsed = None
        kind = {list: "a list", tuple: "a list", dict: "a mapping", bool: "a boolean", int: "a number",
                float: "a number"}.get(type(parsed), "not text")
        return f"{col} is {kind}"
    if reason == REASON_MISSING_TEXT:
        return f"{col} is empty"
    if reason in (REASON_BAD_LABEL, REASON_NO_GOLD):
        return f"{col} {value!r}: {reason}"
    # a reason about the whole row (e.g. data/duplicates.py's "duplicate of row N") names no column
    return f"{col}: {reason}" if row.get("column") else str(reason)


def set_aside_summary(set_aside, loaded_rows: int, path: str = "rejected/set_aside_on_load.parquet") -> str | None:
    """One line for the terminal about the rows set aside on loading (None when there are none):
    ``1 of 400 rows set aside (row 8: hypothesis is a list) -> rejected/set_aside_on_load.parquet``;
    with more, the first one's reason and the count of each reason."""
    if set_aside is None or not len(set_aside):
        return None
    n = len(set_aside)
    first = set_aside[0]
    files = set(set_aside["file"]) if "file" in set_aside.column_names else set()
    where = f"row {first.get('row')}" + (f" of {Path(str(first.get('file'))).name}" if len(files) > 1 else "")
    text = f"{where}: {_set_aside_why(first)}"
    if n > 1:
        reasons: dict[str, int] = {}
        for r in set_aside["reason"]:
            reasons[str(r)] = reasons.get(str(r), 0) + 1
        text += f", and {n - 1:,} more; " + ", ".join(f"{c:,} {r}" for r, c in sorted(reasons.items()))
    return f"{n:,} of {max(int(loaded_rows), n):,} rows set aside ({text}) -> {path}"


def require_two_labels(ds, task: TaskSpec, where: str) -> None:
    """z-statistics, z-filtering and the hypothesis-only model compare labels: one label is an error."""
    present = np.flatnonzero(np.bincount(labels_of(ds), minlength=task.num_labels))
    if len(ds) and len(present) < 2:
        raise InvalidInputError(
            f"{where}: every one of its {len(ds):,} rows has the label {task.labels[int(present[0])]!r}; "
            f"bias statistics need rows of at least two labels (is the label column the right one?)",
            file=where, column="label", value=task.labels[int(present[0])])


def column_numpy(ds, name: str) -> np.ndarray:
    """A column of a dataset as a numpy array, fast (``np.asarray(ds[name])`` walks the rows one by one:
    about 20 s for a million labels)."""
    col = ds.data.column(name)
    if getattr(ds, "_indices", None) is not None:
        col = col.take(ds._indices.column(0))
    return col.to_numpy()


def materialize(ds, rows: np.ndarray | None = None):
    """The rows of ``ds`` (all, or the given positions, in that order) as a dataset without an indices
    mapping, gathered with one vectorised Arrow ``take``. (``select`` + ``flatten_indices`` gathers a
    row at a time: about 1,000 rows/s on a large in-memory table.) The result is held in memory."""
    import datasets

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    positions = None
    if ds._indices is not None:
        positions = ds._indices.column(0).to_numpy()
    if rows is not None:
        rows = np.asarray(rows, dtype=np.int64)
        positions = rows if positions is None else positions[rows]
    if positions is None:
        return ds
    out = _take_rows(table, positions) if len(positions) else table.slice(0, 0)
    return datasets.Dataset(out, info=ds.info.copy(), split=ds.split)


def _take_rows(table: pa.Table, positions: np.ndarray) -> pa.Table:
    """``table.take(positions)`` without concatenating the table's chunks. Arrow's take on a chunked
    column first copies every chunk into one array, per call: a config of D0 and new rows (two tables
    concatenated) would copy all of both for each of its splits. When the positions visit the chunks in
    order (a config's original rows, then its new rows), each run is taken from its own chunk."""
    if all(col.num_chunks <= 1 for col in table.columns):
        return table.take(pa.array(positions, pa.int64()))
    batches = table.to_batches()  # zero-copy slices, cut wherever any column's chunks are cut
    bounds = np.cumsum([0] + [b.num_rows for b in batches])
    which = np.searchsorted(bounds, positions, side="right") - 1
    if (np.diff(which) < 0).any():  # the chunks interleave: one take over the whole table
        return table.take(pa.array(positions, pa.int64()))
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(which)) + 1, [len(positions)]])
    pieces = [pa.Table.from_batches([batches[which[a]].take(pa.array(positions[a:b] - bounds[which[a]], pa.int64()))])
              for a, b in zip(cuts[:-1], cuts[1:])]
    return pa.concat_tables(pieces).combine_chunks()


def contiguous(ds):
    """``ds`` with each column in one piece of memory, the same rows and fingerprint. A dataset read from
    several files, or written in batches, has its columns in many chunks; every later take of its rows
    (a config's rows, its dropped rows) would copy all of them together first (see :func:`_take_rows`)."""
    import datasets

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    if ds._indices is not None or all(col.num_chunks <= 1 for col in table.columns):
        return ds
    return datasets.Dataset(table.combine_chunks(), info=ds.info.copy(), split=ds.split, fingerprint=ds._fingerprint)


def labels_of(ds) -> np.ndarray:
    return column_numpy(ds, "label").astype(np.int64)


def content_uid(premise: str, hypothesis: str, label: str, prefix: str = "") -> str:
    """A stable uid for a new row: a hash of its content (and a method prefix)."""
    h = hashlib.sha1(f"{premise}\x1f{hypothesis}\x1f{label}".encode()).hexdigest()[:16]
    return f"{prefix}{h}"


# what a uid job reads: set before the worker processes fork, so that they inherit it
_UID_WORK: dict = {}


def _uid_chunk(job) -> pa.Array:
    start, stop = job
    t = _UID_WORK["table"].slice(start, stop - start)
    names = pa.array(_UID_WORK["names"], pa.string())
    label = pa.DictionaryArray.from_arrays(pa.array(t.column(2).to_numpy(zero_copy_only=False).astype(np.int32)),
                                           names).cast(pa.string())
    # the bytes content_uid hashes, joined by Arrow for the whole chunk
    joined = pc.binary_join_element_wise(t.column(0), t.column(1), label, "\x1f").cast(pa.binary())
    sha1, prefix = hashlib.sha1, _UID_WORK["prefix"]
    return pa.array([prefix + sha1(b).hexdigest()[:16] for b in joined.to_pylist()], pa.string())


def content_uids(table: pa.Table, label_names: Sequence[str], prefix: str = "", *, chunk_rows: int = 100_000,
                 num_proc: "int | str | None" = None) -> pa.Array:
    """:func:`content_uid` of every row of a (premise, hypothesis, label code) table, as one string array.
    ``num_proc`` hashes chunks in that many forked processes (``"auto"``: the usable CPUs, at most 4, for
    200,000 rows or more); the uids are the same."""
    import multiprocessing

    from ..utils.processes import can_fork, usable_cpus

    jobs = [(a, min(a + chunk_rows, table.num_rows)) for a in range(0, table.num_rows, chunk_rows)]
    if num_proc == "auto":
        num_proc = min(4, usable_cpus()) if table.num_rows >= 200_000 else 1
    _UID_WORK.update(table=table.select([0, 1, 2]), names=list(label_names), prefix=prefix)
    try:
        if not num_proc or int(num_proc) <= 1 or len(jobs) <= 1 or not can_fork():
            parts = list(map(_uid_chunk, jobs))
        else:
            with multiprocessing.get_context("fork").Pool(int(num_proc)) as pool:
                parts = pool.map(_uid_chunk, jobs)
    finally:
        _UID_WORK.clear()
    return pa.concat_arrays(parts) if parts else pa.array([], pa.string())


def new_rows(task: "str | TaskSpec", premises: Sequence[str], hypotheses: Sequence[str],
             labels: Sequence[Any], *, origin: str, method: str, extra: Mapping[str, Sequence[Any]] | None = None):
    """A canonical dataset of new (generated or perturbed) rows with content-hash uids."""
    import datasets

    task = get_task(task)
    if origin not in ORIGINS:
        raise ConfigError(f"origin must be one of {ORIGINS}, not {origin!r}")
    lookup = task.label_lookup()
    codes = []
    for i, lab in enumerate(labels):
        if lab not in lookup:
            raise InvalidInputError(f"new row {i}: label {lab!r} is not one of {list(task.labels)}",
                                    row=i, column="label", value=lab)
        codes.append(lookup[lab])
    uids = [content_uid(p, h, task.labels[c], prefix=f"{method}:") for p, h, c in zip(premises, hypotheses, codes)]
    data = {"premise": list(premises), "hypothesis": list(hypotheses), "label": codes, "uid": uids,
            "origin": [origin] * len(codes), "method": [method] * len(codes)}
    feats = canonical_features(task)
    if extra:
        for k, v in extra.items():
            data[k] = list(v)
        return datasets.Dataset.from_dict(data).cast_column("label", feats["label"])
    return datasets.Dataset.from_dict(data, features=feats)
