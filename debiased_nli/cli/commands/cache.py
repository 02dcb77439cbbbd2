"""``debiased-nli cache``: what the per-build cache holds, and clearing it.

The cache (``$DEBIASED_NLI_CACHE`` or ``~/.cache/debiased-nli``) keeps the feature columns, the
out-of-fold hypothesis-only predictions and the embeddings of earlier runs, so a rerun over the same
input is fast. Only the entries this tool recorded writing (a ``.<name>.debiased-nli`` marker beside
each) are ever counted or deleted; a file that merely has an entry's name (``hypo-only-*.npz``,
``cache-*.arrow``, ...: yours, or an entry of a version before the markers) is left alone and
reported by ``cache info``, and anything else in the folder, the offline models under ``models/``
included, is never touched. After every build the cache is pruned to ``$DEBIASED_NLI_CACHE_MAX_MB``
(default 10240 MB), oldest entries first.
"""
from __future__ import annotations

import argparse
import sys
import time

from ...utils.cache import MAX_ENV, cache_dir, cache_entries, clear_cache, max_cache_bytes, unrecorded_entries
from ._common import POSITIVE_FLOAT


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
              f"{max_cache_bytes() / 2**20:g} MB after each build; ${MAX_ENV})")
        if entries:
            age = (time.time() - entries[0]["mtime"]) / 86400
            print(f"  oldest entry: {age:.1f} days")
        other = unrecorded_entries(folder)
        if other:
            print(f"  also {len(other)} files ({_mb(sum(e['bytes'] for e in other))}) named like cache entries but "
                  f"not recorded as written by debiased-nli (yours, or entries of an older version): never "
                  f"cleared or pruned; delete them yourself if they are old entries, e.g. "
                  f"{other[0]['path'].relative_to(folder)}")
        return 0
    n, size = clear_cache(args.older_than, folder)
    print(f"removed {n} cache entries ({_mb(size)}) from {folder}", file=sys.stderr)
    return 0
