"""Duplicate rows of an input: the same premise, hypothesis and label as an earlier row.

A build counts them in D0 (the manifest's ``duplicates`` and one line on the terminal), and the
recipe's ``data.duplicates`` decides what happens to them: ``keep`` (the default: the release is what
it was before they were counted) or ``set_aside`` (every later copy goes to the rows set aside on
loading, ``rejected/set_aside_on_load.parquet``, with the reason ``duplicate of row N``, N being the
row of the first copy in the split, as in its uid; the first copy stays).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

POLICIES = ("keep", "set_aside")
REASON = "duplicate of row {row}"
_UID_ROW = re.compile(r":(\d+)$")


def _column(ds, name: str) -> pa.Array:
    col = ds.data.column(name)
    if getattr(ds, "_indices", None) is not None:
        col = col.take(ds._indices.column(0))
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _codes(arr: pa.Array) -> np.ndarray:
    """An integer per row, equal where the values are equal (nulls: one code of their own)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return pc.dictionary_encode(arr, null_encoding="encode").indices.to_numpy(zero_copy_only=False).astype(np.int64)


def find_duplicates(ds, columns=("premise", "hypothesis", "label")) -> np.ndarray:
    """For every row, the position of the first row with the same values in ``columns``; -1 for a first
    (or only) occurrence. Exact: each column is compared on its own, not as joined text."""
    n = len(ds)
    if n == 0:
        return np.zeros(0, np.int64)
    keys = np.stack([_codes(_column(ds, c)) for c in columns], axis=1)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    first_of = first[inverse.reshape(-1)]
    return np.where(first_of == np.arange(n), -1, first_of).astype(np.int64)


@dataclasses.dataclass
class Duplicates:
    """What :func:`handle_duplicates` found and did."""

    rows: int          # rows that repeat an earlier one
    groups: int        # distinct rows that occur more than once
    policy: str
    set_aside: object  # the later copies, as set-aside rows (set_aside), else None

    def record(self) -> dict:
        """What the manifest keeps (``duplicates.train``)."""
        return {"rows": self.rows, "groups": self.groups, "policy": self.policy}


def duplicates_line(record: dict, where: str) -> str:
    """The terminal's line for a manifest's ``duplicates`` record."""
    what = ("set aside (rejected/set_aside_on_load.parquet, reason 'duplicate of row N')"
            if record["policy"] == "set_aside" else "kept")
    n, groups = record["rows"], record["groups"]
    return (f"duplicates: {n:,} row{'s' if n != 1 else ''} of {where} repeat{'s' if n == 1 else ''} an earlier row "
            f"(same premise, hypothesis and label; {groups:,} distinct row{'s' if groups != 1 else ''}): {what} "
            f"(recipe data.duplicates: {record['policy']})")


def handle_duplicates(ds, policy: str = "keep") -> tuple[object, Duplicates]:
    """Count the duplicate rows of a canonical dataset; with ``policy="set_aside"``, remove every later
    copy and return it as set-aside rows (the columns of :func:`~debiased_nli.data.loading.canonicalize`'s)."""
    import datasets

    if policy not in POLICIES:
        raise ValueError(f"duplicates policy must be one of {POLICIES}, not {policy!r}")
    first_of = find_duplicates(ds)
    later = np.flatnonzero(first_of >= 0)
    groups = len(np.unique(first_of[later]))
    if policy == "keep" or not len(later):
        return ds, Duplicates(len(later), groups, policy, None)
    uid = _column(ds, "uid")
    uids = uid.to_pylist()

    def row_of(i: int) -> int:
        m = _UID_ROW.search(uids[i] or "")
        return int(m.group(1)) if m else int(i)

    take = pa.array(later, pa.int64())
    aside = pa.table({
        "file": pa.nulls(len(later), pa.string()),
        "row": pa.array([row_of(int(i)) for i in later], pa.int64()),
        "column": pa.array([""] * len(later), pa.string()),
        "value": pa.nulls(len(later), pa.string()),
        "reason": pa.array([REASON.format(row=row_of(int(first_of[i]))) for i in later], pa.string()),
        "premise": _column(ds, "premise").take(take),
        "hypothesis": _column(ds, "hypothesis").take(take),
        "uid": uid.take(take),
    })
    keep = np.flatnonzero(first_of < 0)
    return ds.select(keep), Duplicates(len(later), groups, policy, datasets.Dataset(aside))
