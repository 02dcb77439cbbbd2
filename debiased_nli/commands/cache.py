"""``debiased-nli cache``: what the per-build cache holds, and clearing it.

The cache (``$DEBIASED_NLI_CACHE`` or ``~/.cache/debiased-nli``) keeps the feature columns, the
out-of-fold hypothesis-only predictions and the embeddings of earlier runs, so a rerun over the same
input is fast. Only the files this tool writes there are ever counted or deleted (by name pattern,
below); anything else in the folder, the offline models under ``models/`` included, is left alone.
After every build the cache is pruned to ``$DEBIASED_NLI_CACHE_MAX_MB`` (default 10240 MB), oldest
files first.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import sys
import time
from pathlib import Path

from ._common import POSITIVE_FLOAT

# (kind, pattern relative to the cache folder): the only entries this tool writes into its cache
OWN_ENTRIES = (
    ("features", "features-*.arrow"),
    ("features", "cache-*.arrow"),          # datasets' map/add_column files beside the feature columns
    ("hypothesis-only", "hypo-only-*.npz"),
    ("embeddings", "embeddings/emb-*.npy"),
    ("warm-up encoders", "embeddings/warmup-*"),
)
MAX_ENV, DEFAULT_MAX_MB = "DEBIASED_NLI_CACHE_MAX_MB", 10240


def cache_dir() -> Path:
    from ..featurize import default_cache_dir
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


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def register(sub) -> None:
    p = sub.add_parser("cache", help="show or clear the feature/embedding cache of earlier runs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = p.add_subparsers(dest="cache_action", metavar="<action>", required=True)
    action.add_parser("info", help="the cache folder, its size and what is in it")
    clear = action.add_parser("clear", help="delete the cache entries this tool wrote")
    clear.add_argument("--older-than", type=POSITIVE_FLOAT, metavar="DAYS",
                       help="only entries not written in the last DAYS days")
    p.set_defaults(func=run)


def run(args) -> int:
    folder = cache_dir()
    if args.cache_action == "info":
        entries = cache_entries(folder)
        print(f"cache folder: {folder}{'' if folder.exists() else ' (does not exist yet)'}")
        kinds: dict[str, list] = {}
        for e in entries:
            kinds.setdefault(e["kind"], []).append(e)
        for kind, es in kinds.items():
            print(f"  {kind:18s} {len(es):>6} entries  {_mb(sum(e['bytes'] for e in es)):>12}")
        total = sum(e["bytes"] for e in entries)
        print(f"  {'total':18s} {len(entries):>6} entries  {_mb(total):>12}  (pruned to "
              f"{os.environ.get(MAX_ENV, DEFAULT_MAX_MB)} MB after each build; ${MAX_ENV})")
        if entries:
            age = (time.time() - entries[0]["mtime"]) / 86400
            print(f"  oldest entry: {age:.1f} days")
        return 0
    n, size = clear_cache(args.older_than, folder)
    print(f"removed {n} cache entries ({_mb(size)}) from {folder}", file=sys.stderr)
    return 0
