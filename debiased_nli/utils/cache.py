"""The per-build cache (``$DEBIASED_NLI_CACHE`` or ``~/.cache/debiased-nli``): where it is, what this
tool wrote there, and clearing or pruning it.

It keeps the feature columns, the out-of-fold hypothesis-only predictions and the embeddings of earlier
runs, so a rerun over the same input is fast. Only the files this tool writes there are ever counted or
deleted (by name pattern, below); anything else in the folder, the offline models under ``models/``
included, is left alone.
"""
from __future__ import annotations

import fnmatch
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


def default_cache_dir() -> Path:
    """``$DEBIASED_NLI_CACHE``, or ``~/.cache/debiased-nli``."""
    return Path(os.environ.get("DEBIASED_NLI_CACHE", Path.home() / ".cache" / "debiased-nli"))


def cache_dir() -> Path:
    return default_cache_dir()


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return path.stat().st_size


def cache_entries(folder: Path | None = None) -> list[dict]:
    """The entries of the cache this tool wrote: kind, path, bytes, mtime (oldest first)."""
    folder = folder or cache_dir()
    out = []
    for kind, pattern in OWN_ENTRIES:
        parent = folder / os.path.dirname(pattern)
        if not parent.is_dir():
            continue
        for p in parent.iterdir():
            if fnmatch.fnmatch(p.name, os.path.basename(pattern)) and not p.is_symlink():
                try:
                    out.append({"kind": kind, "path": p, "bytes": _size(p), "mtime": p.stat().st_mtime})
                except FileNotFoundError:  # removed meanwhile
                    continue
    return sorted(out, key=lambda e: e["mtime"])


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clear_cache(older_than_days: float | None = None, folder: Path | None = None) -> tuple[int, int]:
    """Delete this tool's cache entries (only those older than ``older_than_days`` when given).
    Returns (entries, bytes) deleted."""
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    n = size = 0
    for e in cache_entries(folder):
        if cutoff is None or e["mtime"] < cutoff:
            _remove(e["path"])
            n, size = n + 1, size + e["bytes"]
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
