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
import logging
import os
import shutil
import time
from pathlib import Path

from .environment import setting
from .outputs import MARKER_SUFFIX, marker_of, marker_record, pid_alive, record_written, written_by_us

# (kind, pattern relative to the cache folder): the only entries this tool writes into its cache
OWN_ENTRIES = (
    ("features", "features-*.arrow"),
    ("features", "cache-*.arrow"),          # datasets' map/add_column files beside the feature columns
    ("hypothesis-only", "hypo-only-*.npz"),
    ("embeddings", "embeddings/emb-*.npy"),
    ("warm-up encoders", "embeddings/warmup-*"),
    ("ctranslate2 generators", "ctranslate2/ct2-*"),  # generate --engine ctranslate2's converted models
)
MAX_ENV, DEFAULT_MAX_MB = "DEBIASED_NLI_CACHE_MAX_MB", 10240
log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$DEBIASED_NLI_CACHE``, or ``~/.cache/debiased-nli`` (set but empty: an error, not the current folder)."""
    return setting("DEBIASED_NLI_CACHE", Path.home() / ".cache" / "debiased-nli")


def max_cache_bytes() -> int:
    """``$DEBIASED_NLI_CACHE_MAX_MB`` (default 10240) in bytes: a finite number of MB, 0 or more."""
    return int(setting(MAX_ENV, DEFAULT_MAX_MB) * 2**20)


def cache_dir() -> Path:
    return default_cache_dir()


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return path.stat().st_size


def record_entry(entry: "str | Path") -> None:
    """Record a complete cache entry (a file or a folder) as written by this tool, with the sha256 of what it
    holds (:func:`~.outputs.record_written`): ``cache clear`` and the prune after a build may then delete it,
    and a run uses it only while its bytes are still those. A marker that cannot be written leaves the entry
    unrecorded (never deleted by this tool, and never used), with a warning."""
    try:
        record_written(entry)
    except OSError as err:
        log.warning("could not record the cache entry %s (%s); it will not be used or pruned", entry, err)


def record_dataset_files(ds, folder: "str | Path") -> None:
    """Record the Arrow files in ``folder`` behind a dataset (what ``datasets.map`` wrote there)."""
    folder = Path(folder).resolve()
    for f in getattr(ds, "cache_files", None) or []:
        path = Path(f["filename"])
        if path.parent.resolve() == folder and path.is_file():
            record_entry(path)


def is_recorded(entry: "str | Path") -> bool:
    """Whether this tool recorded writing ``entry`` (its marker is there; clearing and pruning go by it)."""
    return marker_record(entry) is not None


def _unrecorded(path: Path) -> None:
    log.warning("cache entry %s has no record of being written by debiased-nli: not used, and left as it is "
                "(`debiased-nli cache info` lists such files; delete it if it is an old entry)", path)


def usable(path: "str | Path") -> bool:
    """Whether a cache entry may be read: recorded, and its bytes the sha256 its marker holds. An entry of this
    tool whose bytes changed is removed with a warning (:func:`discard_entry`) and the caller recomputes it; a
    file without a record (a user's, an older version's) is not used and left as it is."""
    if written_by_us(path):
        return True
    rec = marker_record(path)
    if rec is None:
        _unrecorded(Path(path))
        return False
    discard_entry(path, "it has no sha256 in its record" if not isinstance(rec.get("sha256"), str) else
                  "its bytes are not the ones recorded (sha256 differs)")
    return False


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


def _stale_temporaries(folder: Path) -> list[Path]:
    """Temporary names of entries (``.<entry>.tmp-<pid>``) left by runs that died while writing them."""
    import re

    out = []
    for _, pattern in OWN_ENTRIES:
        parent = folder / os.path.dirname(pattern)
        if parent.is_dir():
            for p in parent.glob(f".{os.path.basename(pattern)}.tmp-*"):
                m = re.search(r"\.tmp-(\d+)$", p.name)
                if m and not pid_alive(int(m.group(1))):
                    out.append(p)
    return out


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
    for tmp in _stale_temporaries(folder or cache_dir()):
        _remove(tmp)
    return n, size


def prune_cache(max_bytes: int | None = None, folder: Path | None = None) -> tuple[int, int]:
    """Delete this tool's oldest cache entries until they take at most ``max_bytes``
    (default ``$DEBIASED_NLI_CACHE_MAX_MB``). Returns (entries, bytes) deleted."""
    if max_bytes is None:
        max_bytes = max_cache_bytes()
    for tmp in _stale_temporaries(folder or cache_dir()):  # what runs killed while writing an entry left
        _remove(tmp)
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


# ------------------------------------------------------------------------ writing and reading entries
#
# An entry is written under a temporary name beside it (``.<name>.tmp-<pid>``) and renamed into place
# once complete, so a reader never sees half of one; a write that fails (no space, read-only) leaves
# nothing behind, and the run goes on without caching. An entry that cannot be read whole anyway (cut
# short by a copy, a crash of the machine, a hand edit) is a miss: it is removed with a warning, and
# the caller recomputes and replaces it.

def temp_name(path: "str | Path") -> Path:
    path = Path(path)
    return path.parent / f".{path.name}.tmp-{os.getpid()}"


def write_entry(path: "str | Path", write) -> bool:
    """Write ``path`` through ``write(binary file)`` atomically, then its marker with its sha256; returns
    whether it was written. A failure of the disk is a warning, not an error: the entry is simply not cached."""
    from .outputs import os_reason

    path = Path(path)
    if os.path.lexists(path) and marker_record(path) is None:  # never over a file this tool did not record
        return False
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        log.warning("could not write the cache entry %s (%s); going on without it", path, os_reason(err))
        return False
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    record_entry(path)
    return True


def save_npz(path: "str | Path", **arrays) -> bool:
    """``np.savez`` of a cache entry, atomically (see :func:`write_entry`)."""
    import numpy as np

    return write_entry(path, lambda f: np.savez(f, **arrays))


def save_npy(path: "str | Path", array) -> bool:
    """``np.save`` of a cache entry, atomically (see :func:`write_entry`)."""
    import numpy as np

    return write_entry(path, lambda f: np.save(f, array, allow_pickle=False))


def _why(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}" if text else type(err).__name__


def discard_entry(path: "str | Path", why: "str | BaseException") -> None:
    """Remove an unreadable cache entry (a file or a folder, and its marker), with a warning."""
    path = Path(path)
    log.warning("cache entry %s cannot be used (%s); recomputing it", path,
                _why(why) if isinstance(why, BaseException) else why)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    marker_of(path).unlink(missing_ok=True)


def load_npz(path: "str | Path", keys) -> dict | None:
    """The arrays ``keys`` of a cached ``.npz``, or None: absent, or unreadable (then removed, with a
    warning: see :func:`discard_entry`)."""
    import numpy as np

    path = Path(path)
    if not os.path.lexists(path) or not usable(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in keys}  # read now: np.load of an .npz reads each array lazily
    except MemoryError:
        raise
    except Exception as err:  # BadZipFile, EOFError, zlib.error, ValueError, a missing key, OSError
        discard_entry(path, err)
        return None


def load_npy(path: "str | Path", rows: int | None = None):
    """A cached ``.npy`` array (with ``rows`` rows, when given), or None: absent, or unreadable or of
    another length (then removed, with a warning)."""
    import numpy as np

    path = Path(path)
    if not os.path.lexists(path) or not usable(path):
        return None
    try:
        array = np.load(path, allow_pickle=False)
    except MemoryError:
        raise
    except Exception as err:
        discard_entry(path, err)
        return None
    if rows is not None and (array.ndim == 0 or array.shape[0] != rows):
        discard_entry(path, f"{array.shape[0] if array.ndim else 0} rows, expected {rows}")
        return None
    return array


def check_arrow_entry(path: "str | Path", rows: int) -> bool:
    """Before ``datasets.map(cache_file_name=path)`` reads a cached Arrow file (or the ``_NNNNN_of_NNNNN``
    shards of a map in processes): every file must be recorded with the sha256 of its bytes, read whole, and
    together hold ``rows`` rows. Otherwise they are removed, with a warning, so that the map recomputes them.
    Returns False when a file without any record (a user's, an older version's) holds the name: it is left as it
    is, and the map must not use that name."""
    import glob as _glob

    import pyarrow as pa

    path = Path(path)
    shards = sorted(Path(p) for p in _glob.glob(_glob.escape(str(path.with_suffix(""))) + "_*_of_*" + path.suffix))
    files = ([path] if path.exists() else []) + shards
    if not files:
        return True
    for f in files:
        if marker_record(f) is None:  # not this tool's (or from before the markers): neither used nor replaced
            _unrecorded(f)
            return False
    problem, total, per_count = None, 0, {}
    for f in files:
        if not written_by_us(f):  # its bytes changed since they were recorded: a miss
            problem = (f, "its bytes are not the ones recorded (sha256 differs)")
            break
        try:
            with pa.memory_map(str(f)) as source:
                n = pa.ipc.open_stream(source).read_all().num_rows
        except MemoryError:
            raise
        except Exception as err:  # ArrowInvalid, OSError: cut short, empty, not Arrow
            problem = (f, _why(err))
            break
        if f == path:
            total = n
        else:
            per_count.setdefault(f.stem.rsplit("_of_", 1)[-1], []).append(n)
    if problem is None and path.exists() and total != rows:
        problem = (path, f"{total} rows, expected {rows}")
    if problem is None:
        for count, sizes in per_count.items():
            if len(sizes) == int(count) and sum(sizes) != rows:
                problem = (shards[0], f"its {count} shards hold {sum(sizes)} rows, expected {rows}")
    if problem is not None:
        log.warning("cache entry %s cannot be used (%s); recomputing it", problem[0], problem[1])
        for f in files:
            f.unlink(missing_ok=True)
            marker_of(f).unlink(missing_ok=True)
    return True
