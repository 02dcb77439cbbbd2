"""The per-build cache (``$DEBIASED_NLI_CACHE`` or ``~/.cache/debiased-nli``): where it is, what this
tool wrote there, and clearing or pruning it.

It keeps the feature columns, the out-of-fold hypothesis-only predictions and the embeddings of earlier
runs, so a rerun over the same input is fast. Every entry this tool writes there is recorded by a
marker beside it (``.<entry name>.debiased-nli``, written once the entry is complete: :func:`record_entry`),
and only recorded entries are ever counted, cleared or pruned. A file that merely has an entry's name
(``cache-*.arrow``, ``hypo-only-*.npz``, an ``embeddings/warmup-*`` folder) is left alone, whoever
wrote it: the user, or a version of this tool from before the markers (``cache info`` reports those,
see :func:`unrecorded_entries`; delete them by hand if they are old entries). Anything else in the
folder, the offline models under ``models/`` included, is never touched.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import time
from pathlib import Path

# (kind, pattern relative to the cache folder): the only entries this tool writes into its cache
OWN_ENTRIES = (
    ("features", "features-*.arrow"),
    ("features", "cache-*.arrow"),          # datasets' map/add_column files beside the feature columns
    ("hypothesis-only", "hypo-only-*.npz"),
    ("embeddings", "embeddings/emb-*.npy"),
    ("warm-up encoders", "embeddings/warmup-*"),
)
MAX_ENV, DEFAULT_MAX_MB = "DEBIASED_NLI_CACHE_MAX_MB", 10240
MARKER_SUFFIX = ".debiased-nli"  # .<entry name>.debiased-nli beside every entry this tool wrote
log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$DEBIASED_NLI_CACHE``, or ``~/.cache/debiased-nli``."""
    return Path(os.environ.get("DEBIASED_NLI_CACHE", Path.home() / ".cache" / "debiased-nli"))


def cache_dir() -> Path:
    return default_cache_dir()


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return path.stat().st_size


def marker_of(entry: "str | Path") -> Path:
    """The marker that records ``entry`` as written by this tool."""
    entry = Path(entry)
    return entry.parent / f".{entry.name}{MARKER_SUFFIX}"


def record_entry(entry: "str | Path") -> None:
    """Record a complete cache entry (a file or a folder) as written by this tool, so that ``cache clear``
    and the prune after a build may delete it. A marker that cannot be written leaves the entry
    unrecorded (never deleted by this tool), with a warning."""
    marker = marker_of(entry)
    tmp = marker.with_name(f"{marker.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"written_by": "debiased-nli", "entry": Path(entry).name}) + "\n")
        os.replace(tmp, marker)
    except OSError as err:
        log.warning("could not record the cache entry %s (%s); it will not be pruned", entry, err)
        tmp.unlink(missing_ok=True)


def record_dataset_files(ds, folder: "str | Path") -> None:
    """Record the Arrow files in ``folder`` behind a dataset (what ``datasets.map`` wrote there)."""
    folder = Path(folder).resolve()
    for f in getattr(ds, "cache_files", None) or []:
        path = Path(f["filename"])
        if path.parent.resolve() == folder and path.is_file():
            record_entry(path)


def is_recorded(entry: "str | Path") -> bool:
    return marker_of(entry).is_file()


def _matching(folder: Path) -> list[tuple[str, Path]]:
    """(kind, path) of everything in the cache folder that has a cache entry's name (not links)."""
    out = []
    for kind, pattern in OWN_ENTRIES:
        parent = folder / os.path.dirname(pattern)
        if not parent.is_dir():
            continue
        for p in parent.iterdir():
            if fnmatch.fnmatch(p.name, os.path.basename(pattern)) and not p.is_symlink():
                out.append((kind, p))
    return out


def _describe(kind: str, p: Path) -> dict | None:
    try:
        return {"kind": kind, "path": p, "bytes": _size(p), "mtime": p.stat().st_mtime}
    except FileNotFoundError:  # removed meanwhile
        return None


def cache_entries(folder: Path | None = None) -> list[dict]:
    """The entries this tool recorded writing: kind, path, bytes, mtime (oldest first)."""
    folder = folder or cache_dir()
    out = [e for kind, p in _matching(folder) if is_recorded(p) for e in [_describe(kind, p)] if e]
    return sorted(out, key=lambda e: e["mtime"])


def unrecorded_entries(folder: Path | None = None) -> list[dict]:
    """Files and folders named like cache entries that this tool did not record writing (a user's, or
    an entry of a version before the markers): never deleted here, only reported."""
    folder = folder or cache_dir()
    out = [e for kind, p in _matching(folder) if not is_recorded(p) for e in [_describe(kind, p)] if e]
    return sorted(out, key=lambda e: e["mtime"])


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    marker_of(path).unlink(missing_ok=True)


def _orphan_markers(folder: Path) -> list[Path]:
    """Markers whose entry is gone (deleted by hand)."""
    out = []
    for _, pattern in OWN_ENTRIES:
        parent = folder / os.path.dirname(pattern)
        if parent.is_dir():
            out += [m for m in parent.glob(f".{os.path.basename(pattern)}{MARKER_SUFFIX}")
                    if not (parent / m.name[1:-len(MARKER_SUFFIX)]).exists()]
    return out


def clear_cache(older_than_days: float | None = None, folder: Path | None = None) -> tuple[int, int]:
    """Delete this tool's cache entries (only those older than ``older_than_days`` when given).
    Returns (entries, bytes) deleted."""
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    n = size = 0
    for e in cache_entries(folder):
        if cutoff is None or e["mtime"] < cutoff:
            _remove(e["path"])
            n, size = n + 1, size + e["bytes"]
    if cutoff is None:
        for m in _orphan_markers(folder or cache_dir()):
            m.unlink(missing_ok=True)
    return n, size


def prune_cache(max_bytes: int | None = None, folder: Path | None = None) -> tuple[int, int]:
    """Delete this tool's oldest cache entries until they take at most ``max_bytes``
    (default ``$DEBIASED_NLI_CACHE_MAX_MB``). Returns (entries, bytes) deleted."""
    if max_bytes is None:
        try:
            max_bytes = int(float(os.environ.get(MAX_ENV, DEFAULT_MAX_MB)) * 2**20)
        except ValueError:
            max_bytes = DEFAULT_MAX_MB * 2**20
    entries = cache_entries(folder)
    total = sum(e["bytes"] for e in entries)
    n = size = 0
    for e in entries:
        if total <= max_bytes:
            break
        _remove(e["path"])
        total -= e["bytes"]
        n, size = n + 1, size + e["bytes"]
    return n, size
