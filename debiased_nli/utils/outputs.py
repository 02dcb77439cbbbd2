"""Output folders that are safe to write: checked targets, one writer at a time, atomic replacement.

A command that writes a folder (``build``'s release, ``audit``'s report) goes through these steps:

1. :func:`check_target` refuses a target that must never be replaced: the root, the home folder, the
   current folder or one of its parents, a folder that holds one of the inputs, a file, (even with
   ``--overwrite``) any folder that is not an output this tool wrote (``is_ours``), and an output of
   this tool that holds anything it is not made of (:func:`foreign_files`: a ``NOTES.md`` the user
   put in a release): the refusal names those files, which are never deleted.
2. :func:`target_lock` takes an exclusive lock (``fcntl.flock`` on ``.<name>.lock`` beside the target)
   for the whole run, so a second run writing the same target is refused at once instead of one run
   silently replacing the other. The kernel drops the lock when a process dies (even ``kill -9``), and
   the lock file is removed when the run ends.
3. The output is written into ``.<name>.tmp-<pid>`` beside the target (with a marker file, so only
   folders this tool made are ever cleaned), then :func:`replace_folder` renames it into place; an old
   target is renamed to ``.<name>.old-<pid>`` first and deleted after, unless it holds foreign files by
   then (written while the run worked): it is renamed back and the run refused. The target is
   therefore always either absent, the old output, or the complete new one.
4. :func:`clean_stale` (under the lock) removes the ``.tmp-<pid>`` folders of runs whose process is
   gone, and puts back an old output whose replacement was interrupted between the two renames.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from .errors import ConfigError

log = logging.getLogger(__name__)

TOOL = "debiased-nli"
WRITTEN_BY_KEY = "written_by"  # manifest.json / audit.json: {"written_by": "debiased-nli"}
TMP_MARKER = ".debiased-nli-partial"  # in every temporary folder this tool makes


def _resolve(path: Path, what: str) -> Path:
    """``path.resolve()``, with a loop of symbolic links as a one-line error (Python raises RuntimeError)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as err:
        raise ConfigError(f"{what} {path}: a loop of symbolic links (it leads back to itself)"
                          if isinstance(err, RuntimeError) or getattr(err, "errno", None) == errno.ELOOP
                          else f"{what} {path}: {os_reason(err)}") from None


def _same_or_parent(a: Path, b: Path) -> bool:
    """True when ``a`` is ``b`` or one of its parents."""
    return a == b or a in b.parents


def check_target(out: "str | Path", *, overwrite: bool, is_ours: Callable[[Path], bool], what: str = "release",
                 inputs: Iterable["str | Path"] = (), must_be_new: bool = True) -> Path:
    """The resolved target folder, or a :class:`ConfigError` saying why it may not be written.

    ``must_be_new``: an existing target needs ``overwrite`` (build); otherwise an existing output of
    this tool is replaced without asking (audit). An empty folder is always accepted.
    """
    raw = Path(out).expanduser()
    target = _resolve(raw, "--out")
    a_what = f"{'an' if what[0] in 'aeiou' else 'a'} {what}"
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if target == Path(target.anchor):
        raise ConfigError(f"--out {raw}: refusing to write {a_what} over the root folder")
    if target == home:
        raise ConfigError(f"--out {raw}: refusing to write {a_what} over your home folder {home}")
    if _same_or_parent(target, cwd):
        raise ConfigError(f"--out {raw}: refusing to write {a_what} over the current folder or one of its parents "
                          f"({target}); choose a new folder, e.g. --out out/{what}")
    for path in inputs:
        p = _resolve(Path(path).expanduser(), "input")
        if _same_or_parent(target, p):
            raise ConfigError(f"--out {raw}: {target} holds the input {p}; choose another --out")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--out {raw}: {target} is a file, not a folder; choose another --out")
    if target.is_dir() and any(target.iterdir()):
        if must_be_new and not overwrite:
            raise ConfigError(f"{target} already exists; pass --overwrite to replace it (the old folder is kept "
                              f"until the new one is complete)")
        if not is_ours(target):
            raise ConfigError(f"{target} exists and is not {a_what} written by {TOOL}; refusing to replace it "
                              f"(remove it yourself or choose another --out)")
        refuse_foreign(target)
    return target


def _marked_json(path: Path, legacy_keys: tuple[str, ...]) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    return data.get(WRITTEN_BY_KEY) == TOOL or bool(legacy_keys) and all(k in data for k in legacy_keys)


def is_release_folder(folder: Path) -> bool:
    """A release this tool wrote: README.md and a manifest.json marked ``written_by: debiased-nli``
    (or, from versions before the marker, a manifest with the recipe and this package's version)."""
    if not (folder / "README.md").is_file() or not (folder / "manifest.json").is_file():
        return False
    if _marked_json(folder / "manifest.json", ()):
        return True
    try:
        legacy = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(legacy, dict) and "recipe" in legacy and TOOL in (legacy.get("versions") or {})


def is_audit_folder(folder: Path) -> bool:
    """An audit folder this tool wrote (audit.json marked, or with the keys of an older audit.json)."""
    return _marked_json(folder / "audit.json", ("task", "z_threshold", "features"))


# what an output is made of: everything else in it is the user's, and is never deleted
AUDIT_FILES = ("audit.json", "audit.md", "zstats.png", "set_aside.parquet")
_RELEASE_FILE_RE = re.compile(r"(data/[^/]+/[^/]+-\d{5}-of-\d{5}\.parquet|rejected/[^/]+/train-\d{5}-of-\d{5}\.parquet"
                              r"|rejected/set_aside_on_load\.parquet|images/zstats_[^/]+\.png)")


def release_files(folder: Path) -> set[str]:
    """The files (relative paths) a release is made of, read from its manifest: README.md, manifest.json,
    the data files it lists, each config's rejected rows and z-statistics plot (and the original's
    plot), the rows set aside on loading. A manifest without a file list (an old one): the file names
    this tool writes."""
    own = {"README.md", "manifest.json", "rejected/set_aside_on_load.parquet", "images/zstats_original.png"}
    try:
        files = json.loads((folder / "manifest.json").read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if not isinstance(files, dict):  # no list to go by: the names this tool writes
        return own | {p.relative_to(folder).as_posix() for p in folder.rglob("*")
                      if _RELEASE_FILE_RE.fullmatch(p.relative_to(folder).as_posix())}
    for config, splits in files.items():
        own.add(f"images/zstats_{config}.png")
        for entries in (splits.values() if isinstance(splits, dict) else ()):
            own.update(str(f.get("path")) for f in entries if isinstance(f, dict))
        rejected = folder / "rejected" / config
        if rejected.is_dir():
            own.update(f"rejected/{config}/{p.name}" for p in rejected.iterdir()
                       if re.fullmatch(r"train-\d{5}-of-\d{5}\.parquet", p.name))
    return own


def audit_files(folder: Path) -> set[str]:
    """The files an audit folder is made of."""
    return set(AUDIT_FILES)


def foreign_files(folder: Path) -> list[str]:
    """What ``folder`` (a release or an audit of this tool) holds that it is not made of: files and
    links, as relative paths, sorted. Every file of a folder that is neither is foreign."""
    own = release_files(folder) if is_release_folder(folder) else audit_files(folder) if is_audit_folder(folder) \
        else set()
    out = []
    for root, dirs, files in os.walk(folder):  # links to folders are listed, not followed
        rel = Path(root).relative_to(folder)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = (rel / name).as_posix()
            if path not in own:
                out.append(path)
    return sorted(out)


def refuse_foreign(folder: Path) -> None:
    """A :class:`ConfigError` naming the foreign files of ``folder`` (see :func:`foreign_files`), if any."""
    foreign = foreign_files(folder)
    if foreign:
        what = "release" if is_release_folder(folder) else "audit" if is_audit_folder(folder) else "output"
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(f"{folder} holds {len(foreign)} file(s) that are not part of the {what} {TOOL} wrote "
                          f"there: {shown}; refusing to replace it (--overwrite replaces only the {what}'s own "
                          f"files, never yours): move them out, or choose another --out")


# ----------------------------------------------------------------------------------------- lock

_HELD: dict[Path, int] = {}  # locks this process holds (a build holds its target's lock while write_release runs)


def lock_target(target: Path) -> Callable[[], None]:
    """Lock ``.<name>.lock`` beside ``target`` exclusively (non-blocking); returns the function that
    releases it. Re-entrant within a process."""
    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.parent / f".{target.name}.lock"
    if path in _HELD:
        _HELD[path] += 1

        def release_inner() -> None:
            _HELD[path] -= 1
        return release_inner
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            try:
                holder = path.read_text().strip() or "?"
            except OSError:
                holder = "?"
            raise ConfigError(f"another {TOOL} process (pid {holder}) is writing {target}; wait for it to finish "
                              f"or choose another --out") from None
        # the file we locked must still be the one at `path` (a finishing run unlinks it)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _HELD[path] = 1

    def release() -> None:
        _HELD[path] -= 1
        if _HELD[path] > 0:
            return
        del _HELD[path]
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
    return release


@contextlib.contextmanager
def target_lock(target: Path) -> Iterator[None]:
    """:func:`lock_target` as a context manager."""
    release = lock_target(target)
    try:
        yield
    finally:
        release()


# ----------------------------------------------------------------------------- temporary folders

def temp_folder(target: Path) -> Path:
    """A new ``.<name>.tmp-<pid>`` beside ``target``, with the marker that lets a later run clean it."""
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / TMP_MARKER).write_text(str(os.getpid()))
    return tmp


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(target: Path, is_ours: Callable[[Path], bool]) -> list[Path]:
    """Remove what interrupted runs left beside ``target`` (call it holding :func:`target_lock`).

    ``.<name>.tmp-<pid>`` folders with the marker whose process is gone are deleted. An
    ``.<name>.old-<pid>`` folder (an old output renamed away just before its replacement was renamed
    in) is put back when the target is missing, else deleted; only when ``is_ours`` says it is an
    output of this tool. Returns what was removed or restored.
    """
    done = []
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.(tmp|old)-(\d+)$")
    if not target.parent.is_dir():
        return done
    for p in sorted(target.parent.iterdir()):
        m = pattern.match(p.name)
        if not m or not p.is_dir() or pid_alive(int(m.group(2))) and int(m.group(2)) != os.getpid():
            continue
        if m.group(1) == "tmp" and (p / TMP_MARKER).is_file():
            shutil.rmtree(p, ignore_errors=True)
            log.warning("removed %s, left by an interrupted run", p)
            done.append(p)
        elif m.group(1) == "old" and is_ours(p):
            if not target.exists():
                p.rename(target)
                log.warning("restored %s from %s (its replacement was interrupted)", target, p)
            elif foreign_files(p):
                log.warning("left %s (an old output, replaced by %s): it holds files %s did not write", p, target,
                            TOOL)
                continue
            else:
                shutil.rmtree(p, ignore_errors=True)
                log.warning("removed %s, left by an interrupted run", p)
            done.append(p)
    return done


def replace_folder(tmp: Path, target: Path) -> None:
    """Rename the complete ``tmp`` to ``target``; an existing target is renamed away first, then deleted.

    Once renamed away, the old target is checked again for files it is not made of (written into it
    while this run worked): if there are any, it is renamed back and a :class:`ConfigError` names them."""
    (tmp / TMP_MARKER).unlink(missing_ok=True)
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        target.rename(old)
        try:
            refuse_foreign(old)
        except ConfigError as err:
            old.rename(target)
            raise ConfigError(str(err).replace(str(old), str(target))) from None
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)


def os_reason(err: OSError) -> str:
    """What an operating-system error means, in a few words."""
    return {errno.ENOSPC: "no space left on the device", errno.EROFS: "the file system is read-only",
            errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EDQUOT: "disk quota exceeded"}.get(err.errno, err.strerror or str(err))


def write_error(err: OSError, where: "str | Path") -> ConfigError:
    """A one-line error for a failed write (no space, read-only, no permission)."""
    name = err.filename or where
    return ConfigError(f"cannot write {name}: {os_reason(err)}; nothing was written to {where}")


def print_values(title: str, values: Mapping[str, Any], sources: Mapping[str, str], stream=None) -> None:
    """``name = value    source`` for each value, on stderr (the report goes to stdout)."""
    stream = stream or sys.stderr
    print(f"{title}:", file=stream)
    width = max((len(f"{k} = {v!r}") for k, v in values.items()), default=0)
    for name, value in values.items():
        print(f"  {f'{name} = {value!r}':<{width}}  {sources.get(name, '')}", file=stream)
