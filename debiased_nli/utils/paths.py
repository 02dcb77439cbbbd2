"""One guard for every path this tool makes from a name, and for every file it reads.

Names become paths: a config (``data/<config>/``), a split (``<split>-00000-of-00001.parquet``), a plan's row
(``<row>-s<seed>.json``), the entries of a release's manifest and decision records. Each goes through
:func:`check_name` (one component: letters, digits, ``.``, ``_``, ``-``, starting with a letter or a digit, at
most 128 characters; so never empty, absolute, hidden, ``..`` or with a ``/``) or :func:`check_relative` (a
relative path of such components), and :func:`path_inside` resolves it under its root and refuses one that
leads outside (through ``..`` or a symbolic link), before anything is written or read.

A file read from a release (:func:`release_file`) is a regular file inside it (no symbolic link on the way)
whose sha256 is the one the manifest records (:class:`ChecksumMismatch` otherwise). An input named on the
command line (:func:`check_input_file`) is a regular file through any links: a FIFO, which blocks, or a
device such as ``/dev/zero``, which never ends, is refused before it is opened. JSON and text files are read
with bounds (:func:`read_json`, :func:`read_text`): their size, UTF-8, and for JSON how deeply it nests.
Every refusal is a one-line :class:`~.errors.ConfigError`.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError, excerpt

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = "letters, digits, '.', '_' and '-', starting with a letter or a digit, at most 128 characters"
MAX_JSON_BYTES = 256 << 20   # a manifest of a release with millions of rows is a few MB
MAX_JSON_DEPTH = 64          # the deepest file this tool writes nests 8 levels
MAX_TEXT_BYTES = 64 << 20


class ChecksumMismatch(ConfigError):
    """A release file whose bytes are not the ones its manifest records."""


def check_name(value: Any, what: str) -> str:
    """``value`` when it is a name that can be one path component (see :data:`NAME_RE`), else a
    :class:`ConfigError` quoting it."""
    if isinstance(value, str) and NAME_RE.fullmatch(value) and value not in (".", ".."):
        return value
    raise ConfigError(f"{what} {excerpt(value)} is not a name that can be a file or folder name: use {NAME_RULE}")


def check_relative(value: Any, what: str) -> str:
    """``value`` when it is a relative POSIX path whose every component passes :func:`check_name`."""
    if isinstance(value, str) and value and not value.startswith("/") and "\\" not in value \
            and all(NAME_RE.fullmatch(part) for part in value.split("/")):
        return value
    raise ConfigError(f"{what} {excerpt(value)} is not a relative path inside its folder (each part: {NAME_RULE})")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def path_inside(root: "str | os.PathLike", rel: Any, what: str, *, within: "str | os.PathLike | None" = None) -> Path:
    """``root / rel`` for a relative path ``rel`` (:func:`check_relative`) that, resolved (links followed),
    stays inside ``root`` (or ``within``, a folder around it)."""
    rel = check_relative(rel, what)
    root_r = Path(within if within is not None else root).resolve()
    path = Path(root) / rel
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        raise ConfigError(f"{what} {rel!r}: a loop of symbolic links under {root}") from None
    if not _inside(resolved, root_r):
        raise ConfigError(f"{what} {rel!r} leads outside {root} (to {resolved}); refusing to use it")
    return path


def release_file(root: "str | os.PathLike", rel: Any, *, sha256: str | None = None, what: str = "file",
                 links_within: "str | os.PathLike | None" = None) -> Path:
    """A file of a release (or any folder this tool wrote) named by its manifest: ``rel`` inside ``root``
    (:func:`path_inside`), no symbolic link on the way from ``root``, a regular file, and when ``sha256`` is
    given, those bytes (:class:`ChecksumMismatch` otherwise). ``links_within``: a Hub snapshot in the
    ``huggingface_hub`` cache, whose files are links into the repo's ``blobs/``: links are allowed there, as long
    as they resolve inside that folder."""
    path = path_inside(root, rel, what, within=links_within)
    here = Path(root)
    for part in Path(rel).parts:
        here = here / part
        try:
            st = os.stat(here) if links_within is not None else os.lstat(here)
        except FileNotFoundError:
            raise ConfigError(f"{what} {path}: missing (listed in {Path(root) / 'manifest.json'})") from None
        except OSError as err:
            raise ConfigError(f"{what} {path}: cannot read it ({err.strerror or err})") from None
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(f"{what} {rel!r} of {root} is (or is inside) a symbolic link ({here}); a release holds "
                              f"its files, not links to other files")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path}: not a regular file")
    if sha256 is not None:
        from .provenance import file_sha256

        if not isinstance(sha256, str) or file_sha256(path) != sha256:
            raise ChecksumMismatch(f"{what} {path} is not the file the manifest records (its sha256 differs)")
    return path


_NOT_REGULAR = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_input_file(path: "str | os.PathLike", what: str = "data file") -> None:
    """An input must be a regular file (through any symbolic links), checked before it is opened: a
    loop of links, a broken link, a folder, a pipe or a device (``/dev/zero``: reading it never ends;
    a FIFO: opening it blocks) is a one-line :class:`ConfigError`. ``os.stat`` never blocks."""
    p = str(path)
    if not p:
        raise ConfigError(f"{what}: an empty path")
    try:
        st = os.stat(p)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(f"{what} {p}: a loop of symbolic links (it leads back to itself); point it at "
                              f"a file") from None
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            if os.path.islink(p):
                raise ConfigError(f"{what} {p}: a symbolic link to {os.readlink(p)!r}, which does not exist") from None
            raise ConfigError(f"{what} {p} does not exist") from None
        raise ConfigError(f"{what} {p}: cannot read it ({err.strerror or err})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {p}: is a folder; give the files in it (e.g. {os.path.join(p, '*.parquet')})")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _NOT_REGULAR if test(st.st_mode)), "not a file")
        raise ConfigError(f"{what} {p}: not a regular file ({kind}); reading it could block or never end: "
                          f"copy the data into a file")


def read_text(path: "str | os.PathLike", what: str = "file", *, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes`` (:func:`check_input_file` first)."""
    check_input_file(path, what)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise ConfigError(f"{what} {path}: cannot read it ({err.strerror or err})") from None
    if len(data) > max_bytes:
        raise ConfigError(f"{what} {path} is too large (more than {max_bytes >> 20} MB)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {err.start}: {data[err.start:err.start + 1]!r})"
                          ) from None


def json_depth(value: Any) -> int:
    """How deeply lists and mappings nest in ``value`` (walked without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:
                stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def parse_json(text: str, where: str) -> Any:
    """``json.loads`` of ``text`` with one-line errors: not JSON (line and column), nested more than
    :data:`MAX_JSON_DEPTH` levels (a "JSON bomb" that would exhaust the recursion of every reader)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    except RecursionError:
        raise ConfigError(f"{where}: its JSON nests too deeply to read (at most {MAX_JSON_DEPTH} levels)") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ConfigError(f"{where}: its JSON nests more than {MAX_JSON_DEPTH} levels deep; not a file this tool wrote")
    return value


def read_json(path: "str | os.PathLike", what: str = "file", *, max_bytes: int = MAX_JSON_BYTES,
              kind: type | None = None) -> Any:
    """The JSON value of a regular UTF-8 file (:func:`read_text`, :func:`parse_json`); ``kind`` (``dict`` or
    ``list``): the value must be one."""
    value = parse_json(read_text(path, what, max_bytes=max_bytes), f"{what} {path}")
    if kind is not None and not isinstance(value, kind):
        raise ConfigError(f"{what} {path}: a JSON {type(value).__name__} where a JSON "
                          f"{'object' if kind is dict else kind.__name__} belongs; not a file this tool wrote")
    return value


def public_paths(value: Any) -> Any:
    """``value`` with every local path that would expose the builder's file system (absolute, or
    reaching outside the working folder with ``..``) replaced by its file name (a ``SPLIT=PATH``
    entry keeps its split); the sha256 recorded beside an input identifies it."""
    if isinstance(value, Mapping):
        return {k: public_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public_paths(v) for v in value]
    if not isinstance(value, str) or "\n" in value:
        return value
    split, sep, rest = value.partition("=")
    head, path = (split + "=", rest) if sep and split.isidentifier() else ("", value)
    if os.path.isabs(path) or path.startswith(".."):
        return head + (Path(path).name or path)
    return value


def _looks_like_a_path(ref: str) -> bool:
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or os.sep != "/" and os.sep in ref


def check_model_reference(ref: str, option: str, *, files=("config.json",)) -> str:
    """A model folder or Hub id given on the command line, checked before any work.

    A folder must hold one of ``files`` as valid JSON; a path that does not exist is an error; a Hub id
    is accepted online, and offline (``HF_HUB_OFFLINE``) only when it is in the local Hub cache."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{option} {ref}: is a file; give a model folder (with {files[0]}) or a Hub id")
        found = [path / f for f in files if (path / f).is_file()]
        if not found:
            raise ConfigError(f"{option} {ref}: the folder has no {' or '.join(files)}; it is not a model folder "
                              f"(give one written by `debiased-nli train` or save_pretrained)")
        try:
            json.loads(found[0].read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ConfigError(f"{option} {ref}: {found[0].name} is not valid JSON ({err}); the model folder "
                              f"is corrupt") from err
        return ref
    if _looks_like_a_path(ref):
        raise ConfigError(f"{option} {ref}: no such folder")
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(ref, files[0]), str):
        raise ConfigError(f"{option} {ref}: no such folder, and not a Hub model in the local cache "
                          f"(offline mode: HF_HUB_OFFLINE is set)")
    return ref


def check_release_reference(ref: str, option: str = "--release") -> str:
    """A release folder (README.md and data/, as `debiased-nli build` writes) or a Hub dataset id."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "README.md").is_file() or not (path / "data").is_dir():
            raise ConfigError(f"{option} {ref}: not a release folder (it needs README.md and data/); "
                              f"build one with `debiased-nli build`")
        return ref
    if _looks_like_a_path(ref):
        raise ConfigError(f"{option} {ref}: no such folder")
    return ref
