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
import stat
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


def json_of(path: Path) -> Any:
    """The JSON value of a regular file this tool may have written, or None (absent, a link, not a regular
    file, not JSON, nested too deeply): for the checks that only ask whether a file is this tool's."""
    from .paths import MAX_JSON_BYTES, parse_json

    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_JSON_BYTES:
            return None
        return parse_json(path.read_text(encoding="utf-8"), str(path))
    except (OSError, ValueError):  # ConfigError and UnicodeDecodeError are ValueErrors
        return None


def _marked_json(path: Path, legacy_keys: tuple[str, ...]) -> bool:
    data = json_of(path)
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
    legacy = json_of(folder / "manifest.json")
    return isinstance(legacy, dict) and "recipe" in legacy and isinstance(legacy.get("versions"), dict) \
        and TOOL in legacy["versions"]


def is_audit_folder(folder: Path) -> bool:
    """An audit folder this tool wrote (audit.json marked, or with the keys of an older audit.json)."""
    return _marked_json(folder / "audit.json", ("task", "z_threshold", "features"))


# what an output is made of: everything else in it is the user's, and is never deleted
AUDIT_FILES = ("audit.json", "audit.md", "zstats.png", "set_aside.parquet")
_RELEASE_FILE_RE = re.compile(r"(data/[^/]+/[^/]+-\d{5}-of-\d{5}\.parquet|rejected/[^/]+/train-\d{5}-of-\d{5}\.parquet"
                              r"|rejected/set_aside_on_load\.parquet|images/zstats_[^/]+\.png)")


def release_file_hashes(folder: Path) -> dict[str, "str | None"]:
    """The files (relative paths) a release is made of, read from its manifest, each with the sha256 the
    manifest records (None where it records none): README.md, manifest.json, the data files it lists, the
    decision records of its filter steps (``decisions``: their files and their configs' rejected rows), each
    config's rejected rows and z-statistics plot (and the original's plot), the rows set aside on loading.
    An entry that is not a relative path inside the release (:func:`~.paths.check_relative`) is not one of
    its files. A manifest without a file list (an old one): the file names this tool writes."""
    from .paths import check_relative

    own: dict[str, "str | None"] = {n: None for n in ("README.md", "manifest.json",
                                                      "rejected/set_aside_on_load.parquet",
                                                      "images/zstats_original.png")}

    def add(rel, sha=None) -> None:
        try:
            check_relative(rel, "file")
        except ConfigError:
            return
        own[rel] = sha if isinstance(sha, str) else None

    manifest = json_of(folder / "manifest.json")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):  # no list to go by: the names this tool writes
        for p in folder.rglob("*"):
            rel = p.relative_to(folder).as_posix()
            if _RELEASE_FILE_RE.fullmatch(rel):
                add(rel)
        return own
    for config, splits in files.items():
        if not isinstance(config, str) or "/" in config or config.startswith("."):
            continue
        add(f"images/zstats_{config}.png")
        for entries in (splits.values() if isinstance(splits, dict) else ()):
            for f in entries if isinstance(entries, list) else ():
                if isinstance(f, dict):
                    add(f.get("path"), f.get("sha256"))
        rejected = folder / "rejected" / config
        if rejected.is_dir() and not rejected.is_symlink():
            for p in rejected.iterdir():
                if re.fullmatch(r"train-\d{5}-of-\d{5}\.parquet", p.name):
                    add(f"rejected/{config}/{p.name}")
    decisions = manifest.get("decisions")
    for rec in (decisions.values() if isinstance(decisions, dict) else ()):
        for field in ("files", "rejected_files"):
            listed = rec.get(field) if isinstance(rec, dict) else None
            for rel, sha in (listed.items() if isinstance(listed, dict) else ()):
                if isinstance(rel, str) and rel.startswith(("decisions/", "rejected/")):
                    add(rel, sha)
    return own


def release_files(folder: Path) -> set[str]:
    """The files (relative paths) a release is made of (see :func:`release_file_hashes`)."""
    return set(release_file_hashes(folder))


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


def open_lock_file(path: "str | Path") -> int:
    """Open (or create) a lock file without following a symbolic link at ``path`` (``O_NOFOLLOW``): a link
    there would make the lock write its pid into the link's target. A link, a file that is not a regular one,
    or one with other hard links (writing the pid would change another name's file) is a one-line
    :class:`ConfigError`. Returns the descriptor."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(f"the lock file {path} is a symbolic link; refusing to follow it (remove the link)"
                              ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise ConfigError(f"the lock file {path} is not a regular file of its own "
                          f"({'a hard link to another file' if stat.S_ISREG(st.st_mode) else 'not a regular file'}); "
                          f"refusing to use it (remove it)")
    return fd


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
        fd = open_lock_file(path)
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



# ------------------------------------------------------------------------ files this tool wrote
#
# Every file a command writes outside a release or an audit folder (an evaluation report, a trained model's
# files, a comparison report, a diff, a cache entry) gets a marker beside it, ``.<name>.debiased-nli``, holding
# the sha256 of what was written. A file is this tool's only while its marker is there and its bytes are
# still those: a file the user wrote, or edited since, is never replaced.

MARKER_SUFFIX = ".debiased-nli"


def marker_of(path: "str | Path") -> Path:
    """The marker that records ``path`` as written by this tool."""
    path = Path(path)
    return path.parent / f".{path.name}{MARKER_SUFFIX}"


def payload_sha256(path: "str | Path") -> str:
    """The sha256 of a file, or of a folder's files (their relative paths and bytes, links not followed)."""
    import hashlib

    from .provenance import file_sha256

    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        return file_sha256(path)
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            f = Path(root) / name
            if f.is_symlink() or not f.is_file():
                continue
            h.update(f"{f.relative_to(path).as_posix()}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def record_written(path: "str | Path") -> None:
    """Write the marker of ``path`` (a complete file or folder this tool wrote), with its sha256. Raises
    OSError when the marker cannot be written."""
    marker = marker_of(path)
    tmp = marker.with_name(f"{marker.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({WRITTEN_BY_KEY: TOOL, "entry": Path(path).name,
                                   "sha256": payload_sha256(path)}) + "\n")
        os.replace(tmp, marker)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def marker_record(path: "str | Path") -> dict | None:
    """The marker of ``path`` when there is one of this tool for it (a regular file naming it), else None."""
    data = json_of(marker_of(path))
    if isinstance(data, dict) and data.get(WRITTEN_BY_KEY) == TOOL and data.get("entry") == Path(path).name:
        return data
    return None


def written_by_us(path: "str | Path") -> bool:
    """Whether ``path`` is what this tool wrote there: its marker is there and its bytes are still those."""
    path = Path(path)
    rec = marker_record(path)
    if rec is None or not isinstance(rec.get("sha256"), str) or path.is_symlink() or not path.exists():
        return False
    try:
        return payload_sha256(path) == rec["sha256"]
    except OSError:
        return False


def not_ours(paths: Iterable["str | Path"], legacy: "Callable[[Path], bool] | None" = None) -> list[Path]:
    """Of ``paths``, those that exist (or are links) and that this tool did not write (:func:`written_by_us`).
    ``legacy(path)``: a file written before the markers that is known to be this tool's (it has no marker)."""
    out = []
    for p in map(Path, paths):
        if not os.path.lexists(p) or written_by_us(p):
            continue
        if legacy is not None and not p.is_symlink() and p.is_file() and not marker_of(p).exists() and legacy(p):
            continue
        out.append(p)
    return out


def refuse_not_ours(paths: Iterable["str | Path"], what: str,
                    legacy: "Callable[[Path], bool] | None" = None) -> None:
    """A :class:`ConfigError` naming the files of ``paths`` that exist and were not written by this tool."""
    theirs = not_ours(paths, legacy)
    if theirs:
        shown = ", ".join(map(str, theirs[:5])) + (f" and {len(theirs) - 5} more" if len(theirs) > 5 else "")
        raise ConfigError(f"{what}: refusing to replace {len(theirs)} file(s) that {TOOL} did not write (or that were "
                          f"changed since): {shown}; move them away or choose another output")


def check_output_folder(out: "str | Path", *, what: str, is_ours: Callable[[Path], bool],
                        option: str = "--out", inputs: Iterable["str | Path"] = ()) -> Path:
    """The resolved output folder of a command that writes files into it (evaluate, train, aflite, ...): the
    folder must be new, empty or one of this tool's for that command (``is_ours``). Never the root, the home or
    the current folder or one of its parents, a folder holding an input, or a file. A refusal names what is in
    the folder."""
    raw = Path(out).expanduser()
    if not str(out).strip():
        raise ConfigError(f"{option}: an empty path")
    target = _resolve(raw, option)
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if target == Path(target.anchor) or target == home or _same_or_parent(target, cwd):
        raise ConfigError(f"{option} {raw}: refusing to write {what} into "
                          f"{'the root folder' if target == Path(target.anchor) else 'your home folder' if target == home else 'the current folder or one of its parents'}"
                          f" ({target}); choose a new folder")
    for path in inputs:
        p = _resolve(Path(path).expanduser(), "input")
        if _same_or_parent(target, p):
            raise ConfigError(f"{option} {raw}: {target} holds the input {p}; choose another {option}")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{option} {raw}: {target} is a file, not a folder; choose another {option}")
    if target.is_dir():
        entries = sorted(p.name for p in target.iterdir())
        if entries and not is_ours(target):
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise ConfigError(f"{option} {raw}: {target} is not empty and holds no {what} of {TOOL} ({shown}); "
                              f"refusing to write into it: choose a new or empty folder")
    return target


def holds_own_file(folder: Path, names: "Iterable[str] | None" = None) -> bool:
    """Whether ``folder`` holds one of ``names`` (None: any file with a marker) as a file this tool wrote (see
    :func:`written_by_us`)."""
    if names is None:
        names = [p.name for p in folder.iterdir() if marker_of(p).is_file()] if folder.is_dir() else []
    return any(written_by_us(folder / n) for n in names)


def staged_name(path: Path) -> Path:
    """The temporary name beside ``path`` that a file is written under before it is renamed into place (the
    suffix is kept: matplotlib and pyarrow tell the format by it)."""
    return path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")


class OwnFiles:
    """The files one command writes: checked before the work (none of them may be a file this tool did not
    write: :func:`refuse_not_ours`), each written under a temporary name beside it (:meth:`temp`), then, when
    the block ends without an error, checked again and renamed into place, each with its marker. On an error
    the temporary files are removed, the old files stay, and an OSError (no space, read-only) becomes one
    line. ``legacy``: see :func:`not_ours`."""

    def __init__(self, paths: Iterable["str | Path"], *, what: str, legacy: "Callable[[Path], bool] | None" = None):
        self.paths = [Path(p) for p in paths]
        self.what, self.legacy = what, legacy
        self.staged: dict[Path, Path] = {}
        refuse_not_ours(self.paths, what, legacy)

    def temp(self, path: "str | Path") -> Path:
        """Where to write ``path`` (one of the paths given): a temporary name beside it."""
        path = Path(path)
        if path not in self.paths:
            raise ValueError(f"{path} is not among the files this command declared")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.staged[path] = staged_name(path)
        return self.staged[path]

    def write_text(self, path: "str | Path", text: str) -> Path:
        self.temp(path).write_text(text)
        return Path(path)

    def __enter__(self) -> "OwnFiles":
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if kind is not None:
            self.discard()
            if isinstance(err, OSError) and not isinstance(err, ConfigError):
                raise write_error(err, self.paths[0].parent) from err
            return False
        try:
            refuse_not_ours([p for p in self.staged], self.what, self.legacy)  # written meanwhile?
            for path, tmp in self.staged.items():
                if tmp.exists():
                    os.replace(tmp, path)
                    record_written(path)
        except OSError as oserr:
            self.discard()
            raise write_error(oserr, self.paths[0].parent) from oserr
        except BaseException:
            self.discard()
            raise
        return False

    def discard(self) -> None:
        for tmp in self.staged.values():
            with contextlib.suppress(OSError):
                tmp.unlink()


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
