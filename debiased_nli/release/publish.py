"""Publishing a release folder as a Hub dataset repo, with a tag per version.

``push_release`` creates the repo (if needed) and makes **one commit** that uploads the whole folder
and deletes the files an earlier release wrote that this one does not have (e.g. v1.0's
``train-00000-of-00001.parquet`` when v1.1 has two shards; otherwise the ``data/<config>/train-*``
glob would match both). Only files of the layout this tool writes are deleted (``data/*/*-NNNNN-of-
NNNNN.parquet``, ``rejected/**.parquet``, ``images/*.png``); anything else in the repo is kept. The
commit is tagged with the version (e.g. ``v1.0``), so ``load_dataset("org/name", "seq_z",
revision="v1.0")`` gets exactly that release.

The version history is machine-readable: ``manifest.json`` holds ``history`` (a list of
``{version, notes}``), and the card's table is rendered from it between markers. On push, the
history on the Hub (its ``manifest.json``; for a repo pushed before the history was kept there, the
table of its card, parsed once) comes first, then the local rows, then the new version, in the Hub's one
version scheme: the build's own row (the recipe's ``1.0.0 | first release``) becomes the tag's (``v1.0 | first
release``), never both (:func:`merge_history`). The load
snippet of the card is rewritten to the repo being pushed to. The token comes from the argument,
``HF_TOKEN`` or the user's ``huggingface-cli login``; it is never printed, logged or written into a file.

What is uploaded is exactly the release's own files, the ones its manifest lists (:func:`upload_list`), each
checked against the sha256 the manifest records: a symbolic link in the folder (to a key elsewhere), a hidden
file (``data/.env``) or any other file the manifest does not list stops the push, naming them.

A Hub that accepts the connection and never answers must not hang the push: it runs inside
:func:`debiased_nli.utils.hub.hub_call` (a timeout per request, ``DEBIASED_NLI_HUB_TIMEOUT``, and a deadline
for the whole push, ``DEBIASED_NLI_HUB_DEADLINE``, whatever the server does). Timeouts, the deadline,
unreachable hosts, offline mode and refusals by the Hub end the push with a one-line :class:`ConfigError`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..utils.errors import ConfigError
from ..utils.hub import TIMEOUT_ENV, check_repo_id, env_seconds, hub_call
from .card import HISTORY_END, HISTORY_START, render_history_table
from .layout import RELEASE_FILE_PATTERNS

log = logging.getLogger(__name__)
HISTORY_HEADING = "## Version history"
_VERSION_RE = re.compile(r"^v?\d+(\.\d+){0,2}([.-][0-9A-Za-z.]+)?$")
_RELEASE_FILE_RE = re.compile("|".join(f"(?:{p})" for p in RELEASE_FILE_PATTERNS))


def legacy_history(card: str) -> list[dict[str, str]]:
    """The rows of the "Version history" table of a card written before the history was kept in
    ``manifest.json`` (read once, when such a card is on the Hub)."""
    if HISTORY_HEADING not in card:
        return []
    section = card.split(HISTORY_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) >= 2 and line.strip().startswith("|") and cells[0] not in ("version", "") \
                and not set(cells[0]) <= set("-: "):
            # a note is everything after the version cell: a `|` in it (escaped or not) stays in the note
            rows.append({"version": cells[0].replace("\\|", "|"), "notes": " | ".join(cells[1:]).replace("\\|", "|")})
    return rows


def _version_key(version: Any) -> tuple[int, ...] | None:
    """``v1.0``, ``1.0.0`` and ``1`` are one version, (1,); None for a version that is not numbered."""
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*)", str(version).strip())
    if not m:
        return None
    parts = [int(x) for x in m.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def merge_history(remote: Sequence[Mapping[str, Any]], local: Sequence[Mapping[str, Any]],
                  version: str | None, note: str | None = None, build_version: str | None = None) -> list[dict[str, str]]:
    """The remote rows, then the local rows, then ``version`` (each version once, first one wins), in one version
    scheme: the Hub's. A local row that is a version already on the Hub written another way (``1.0.0`` for the tag
    ``v1.0``) is that version, and the build's own row (``build_version``, the recipe's ``release_version``: ``1.0.0 |
    first release``) is the version being pushed: it becomes the tag's row, its note kept unless ``note`` is given
    (the recipe's default ``first release`` only on a repo without history)."""
    remote = [r for r in remote if isinstance(r, Mapping) and "version" in r]
    local = [r for r in local if isinstance(r, Mapping) and "version" in r]
    on_hub = {str(r["version"]) for r in remote}
    if version is not None and build_version is not None:
        own = [r for r in local if str(r["version"]) == str(build_version) and str(build_version) not in on_hub]
        if own and note is None and (not remote or own[-1].get("notes") != "first release"):
            note = str(own[-1].get("notes") or "") or None
        local = [r for r in local if r not in own]
    hub_keys = {_version_key(v) for v in on_hub | ({version} if version is not None else set())} - {None}
    local = [r for r in local if str(r["version"]) in on_hub or _version_key(r["version"]) not in hub_keys]
    rows, seen = [], set()
    for row in remote + local + ([{"version": version, "notes": note or "published"}] if version else []):
        v = str(row["version"])
        if v not in seen:
            rows.append({"version": v, "notes": str(row.get("notes", ""))})
            seen.add(v)
    return rows


def with_history(card: str, history: Sequence[Mapping[str, Any]]) -> str:
    """``card`` with the table between its history markers rendered from ``history``."""
    if HISTORY_START not in card or HISTORY_END not in card:
        raise ConfigError("the release's README.md has no version-history markers (it was written by an older "
                          "debiased-nli); rebuild the release with `debiased-nli build` before pushing it")
    if card.count(HISTORY_START) != 1 or card.count(HISTORY_END) != 1 or \
            card.index(HISTORY_START) > card.index(HISTORY_END):
        raise ConfigError(f"the release's README.md has its version-history markers {card.count(HISTORY_START)} and "
                          f"{card.count(HISTORY_END)} times (or out of order), not once each: text in the card repeats "
                          f"them; rebuild the release without them before pushing it")
    head, rest = card.split(HISTORY_START, 1)
    tail = rest.split(HISTORY_END, 1)[1]
    return f"{head}{render_history_table(history)}{tail}"


def with_repo_id(card: str, old: str | None, new: str) -> str:
    """The card's load snippets pointed at ``new`` (the repo being pushed to) instead of ``old``."""
    if not old or old == new:
        return card
    return card.replace(f'load_dataset("{old}"', f'load_dataset("{new}"')


def _download(api, repo_id: str, filename: str) -> str | None:
    """A file of the repo's main branch (None if the repo or the file does not exist). A network failure
    is an error, not "no file": merging with a history we could not read would drop it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = hf_hub_download(repo_id, filename, repo_type="dataset", endpoint=api.endpoint, token=api.token,
                               etag_timeout=env_seconds(TIMEOUT_ENV, 60))
    except LocalEntryNotFoundError as err:  # raised when the Hub could not be reached at all
        raise ConfigError(f"could not read {filename} of {repo_id} from {api.endpoint}: {err}") from err
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
        return None
    from ..utils.paths import read_text

    return read_text(path, f"{filename} of {repo_id} on the Hub")


def remote_history(api, repo_id: str) -> list[dict[str, str]]:
    """The history of the release on the Hub: its manifest's, else its card's table (older pushes)."""
    manifest = _download(api, repo_id, "manifest.json")
    if manifest is not None:
        from ..utils.paths import parse_json

        try:
            remote = parse_json(manifest, f"manifest.json of {repo_id} on the Hub")
        except ConfigError:
            remote = None
        history = remote.get("history") if isinstance(remote, dict) else None
        if isinstance(history, list):
            return [dict(h) for h in history if isinstance(h, dict) and "version" in h]
    card = _download(api, repo_id, "README.md")
    return legacy_history(card) if card else []


def remote_files(api, repo_id: str) -> list[str]:
    """The files on the repo's main branch ([] for a repo without commits)."""
    from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

    try:
        return list(api.list_repo_files(repo_id, repo_type="dataset"))
    except (RevisionNotFoundError, EntryNotFoundError):
        return []


def stale_files(remote: Sequence[str], local: Sequence[str]) -> tuple[list[str], list[str]]:
    """(files to delete: written by an earlier release and not part of this one; files kept although
    this release lacks them, because this tool did not write them)."""
    local_set = set(local)
    gone = [p for p in remote if p not in local_set]
    return ([p for p in gone if _RELEASE_FILE_RE.fullmatch(p)],
            [p for p in gone if not _RELEASE_FILE_RE.fullmatch(p) and p.split("/")[0] in ("data", "rejected", "images", "decisions")])


def upload_list(folder: Path) -> list[str]:
    """The files of a release to upload: exactly those its manifest lists (:func:`~debiased_nli.utils.outputs.
    release_file_hashes`), each a regular file inside the folder with the sha256 the manifest records. A symbolic
    link anywhere in the folder, or a file it does not list (``data/.env``, a note), is refused with one line
    naming them: nothing is uploaded that the build did not write."""
    from ..utils.outputs import release_file_hashes
    from ..utils.paths import release_file

    listed = release_file_hashes(folder)
    links, unlisted, present = [], [], []
    for root, dirs, files in os.walk(folder):
        rel_root = Path(root).relative_to(folder)
        for name in sorted(files + dirs):
            p = Path(root) / name
            rel = (rel_root / name).as_posix()
            if p.is_symlink():
                links.append(rel)
            elif name in files:
                (present if rel in listed else unlisted).append(rel)
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
    if links or unlisted:
        parts = ([f"symbolic link(s) {', '.join(sorted(links)[:5])}"] if links else []) + \
                ([f"file(s) its manifest does not list {', '.join(sorted(unlisted)[:5])}"
                  + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")] if unlisted else [])
        raise ConfigError(f"{folder} holds {' and '.join(parts)}; push uploads exactly the release's own files: "
                          f"move them out of the folder (nothing was uploaded)")
    for rel in sorted(present):  # a listed file must be the one the manifest records
        release_file(folder, rel, sha256=listed[rel], what="release file")
    for rel, sha in listed.items():
        if sha is not None and rel not in present:
            raise ConfigError(f"{folder / rel}: missing (listed in {folder / 'manifest.json'}); rebuild the release")
    return sorted(present)


def push_release(folder: "str | Path", repo_id: str, *, revision: str | None = None, private: bool = False,
                 token: str | None = None, commit_message: str | None = None, endpoint: str | None = None,
                 api: Any = None, note: str | None = None, commit_description: str | None = None) -> dict[str, Any]:
    """Upload a release folder to ``repo_id`` (a dataset repo) in one commit that also deletes the files of
    an earlier release that this one lacks, then tag it ``revision``. ``commit_description``: the commit's
    description on the Hub (``push --diff-against`` puts the release diff there)."""
    from huggingface_hub import HfApi

    from ..utils.paths import read_json, read_text
    from .card import check_card_text

    folder = Path(folder)
    readme, manifest_path = folder / "README.md", folder / "manifest.json"
    if not readme.exists() or not manifest_path.exists() or not (folder / "data").is_dir():
        raise ConfigError(f"{folder} is not a release folder (it needs README.md, manifest.json and data/); "
                          f"build one with `debiased-nli build`")
    check_repo_id(repo_id)
    if revision is not None and not _VERSION_RE.match(revision):
        raise ConfigError(f"--revision {revision!r} is not a version tag (e.g. v1.0 or 1.2.0)")
    if note is not None:
        check_card_text(note, "--note")
    manifest = read_json(manifest_path, "the release's manifest", kind=dict)
    if not isinstance(manifest.get("history", []), list):
        raise ConfigError(f"{manifest_path}: `history` is not a list of versions; not a release's manifest")
    card = read_text(readme, "the release's card")
    with_history(card, [])  # the markers once each, or the error that says to rebuild
    release = _Upload(folder, card, manifest, upload_list(folder))
    api = api or HfApi(token=token, endpoint=endpoint)
    return hub_call(lambda: _push(api, release, repo_id, revision, private, commit_message, note, commit_description),
                    what="the push", endpoint=api.endpoint)


@dataclasses.dataclass
class _Upload:
    """A release folder as :func:`push_release` read and checked it: its card and manifest (the history is merged
    into both before the upload) and the files its manifest lists (:func:`upload_list`)."""

    folder: Path
    card: str
    manifest: dict
    files: Sequence[str]


def _push(api, release: _Upload, repo_id: str, revision: str | None, private: bool, commit_message: str | None,
          note: str | None, commit_description: str | None = None) -> dict[str, Any]:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    folder, card, manifest, files = release.folder, release.card, release.manifest, release.files

    api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    if revision is not None:
        refs = api.list_repo_refs(repo_id, repo_type="dataset")
        if any(t.name == revision for t in refs.tags):
            raise ConfigError(f"{repo_id} already has the tag {revision!r}; versions are immutable, "
                              f"choose a new --revision")
    local_history = [h for h in manifest.get("history") or [] if isinstance(h, dict) and "version" in h]
    build_version = (manifest.get("recipe") or {}).get("release_version") if isinstance(manifest.get("recipe"), dict) \
        else None
    history = merge_history(remote_history(api, repo_id), local_history, revision, note, build_version)
    card = with_repo_id(with_history(card, history), manifest.get("repo_id"), repo_id)
    manifest.update(history=history, repo_id=repo_id)
    ops: list = [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()),
                 CommitOperationAdd(path_in_repo="manifest.json",
                                    path_or_fileobj=(json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())]
    local = ["README.md", "manifest.json"]
    for rel in files:  # exactly the manifest's files (upload_list)
        if rel not in ("README.md", "manifest.json"):
            ops.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(folder / rel)))
            local.append(rel)
    delete, kept = stale_files(remote_files(api, repo_id), local)
    ops += [CommitOperationDelete(path_in_repo=p) for p in delete]
    for p in kept:
        log.warning("kept %s in %s: this release does not have it, but debiased-nli did not write it either; "
                    "delete it by hand if it should go", p, repo_id)
    message = commit_message or f"debiased-nli release {revision or ''}".strip()
    info = api.create_commit(repo_id, ops, commit_message=message, repo_type="dataset",
                             commit_description=commit_description)
    if revision is not None:
        api.create_tag(repo_id, tag=revision, revision=info.oid, repo_type="dataset",
                       tag_message=f"debiased-nli release {revision}")
    return {"repo_id": repo_id, "commit": info.oid, "commit_url": str(info.commit_url), "tag": revision,
            "files": len(local), "deleted": delete}
