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
table of its card, parsed once) comes first, then the local rows, then the new version. The load
snippet of the card is rewritten to the repo being pushed to. The token comes from the argument,
``HF_TOKEN`` or the user's ``huggingface-cli login``; it is never printed, logged or written into a file.

A Hub that accepts the connection and never answers must not hang the push: every request has a
timeout (``DEBIASED_NLI_HUB_TIMEOUT`` seconds, default 60; ``huggingface_hub`` retries timed-out
requests with back-off), and the push as a whole has a deadline (``DEBIASED_NLI_HUB_DEADLINE``,
default 3600 s): no request starts after it, and the push itself runs in a worker thread that is
given up at the deadline, whatever the server does (a server that trickles a byte a second never
trips a read timeout). Timeouts, the deadline, unreachable hosts, offline mode and refusals by the
Hub end the push with a one-line :class:`ConfigError`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ..utils.errors import ConfigError
from .card import HISTORY_END, HISTORY_START, render_history_table
from .layout import RELEASE_FILE_PATTERNS

log = logging.getLogger(__name__)
HISTORY_HEADING = "## Version history"
TIMEOUT_ENV, DEADLINE_ENV = "DEBIASED_NLI_HUB_TIMEOUT", "DEBIASED_NLI_HUB_DEADLINE"
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


def merge_history(remote: Sequence[Mapping[str, Any]], local: Sequence[Mapping[str, Any]],
                  version: str | None, note: str | None = None) -> list[dict[str, str]]:
    """The remote rows, then the local rows, then ``version`` (each version once, first one wins)."""
    rows, seen = [], set()
    for row in list(remote) + list(local) + ([{"version": version, "notes": note or "published"}] if version else []):
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
    return Path(path).read_text()


def remote_history(api, repo_id: str) -> list[dict[str, str]]:
    """The history of the release on the Hub: its manifest's, else its card's table (older pushes)."""
    manifest = _download(api, repo_id, "manifest.json")
    if manifest is not None:
        try:
            history = json.loads(manifest).get("history")
        except json.JSONDecodeError:
            history = None
        if isinstance(history, list):
            return [dict(h) for h in history]
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


def env_seconds(env: str, default: float) -> float:
    """A positive number of seconds from ``env`` (``default`` when unset); a one-line error otherwise."""
    value = os.environ.get(env)
    try:
        seconds = float(value) if value else default
    except ValueError:
        raise ConfigError(f"{env}={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ConfigError(f"{env}={value!r} must be a positive number of seconds")
    return seconds


class HubDeadlineExceeded(ConfigError):
    """The push ran past its total deadline (checked before each request)."""


@contextlib.contextmanager
def hub_timeouts(timeout: float, deadline: float) -> Iterator[None]:
    """Every ``huggingface_hub`` request in the block times out after ``timeout`` seconds, and none
    starts after ``deadline`` seconds: a Hub that never answers ends the push in bounded time."""
    try:
        from huggingface_hub.utils import _http
        set_factory = _http.set_client_factory
    except (ImportError, AttributeError):  # an older huggingface_hub (requests): its own default timeouts
        yield
        return
    previous = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)
    end = time.monotonic() + deadline

    def check_deadline(request) -> None:
        if time.monotonic() > end:
            raise HubDeadlineExceeded(f"the push to {request.url.host} ran past its deadline of {deadline:g} s "
                                      f"(set {DEADLINE_ENV} for a longer one)")

    def factory():
        client = previous()
        client.timeout = _http.httpx2.Timeout(timeout)
        client.event_hooks["request"] = [check_deadline, *client.event_hooks["request"]]
        return client

    set_factory(factory)
    try:
        yield
    finally:
        set_factory(previous)


def within_deadline(work, deadline: float, endpoint: str):
    """``work()``, run in a worker thread that is given up after ``deadline`` seconds: its result, or its
    exception, or a :class:`HubDeadlineExceeded`. The worker is a daemon thread: it cannot keep the
    process alive, and it starts no new request once the deadline has passed (:func:`hub_timeouts`)."""
    import threading

    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["result"] = work()
        except BaseException as err:  # handed to the caller's thread
            done["error"] = err

    worker = threading.Thread(target=run, name="debiased-nli-push", daemon=True)
    worker.start()
    worker.join(deadline)
    if worker.is_alive():
        host = re.sub(r"^[a-z]+://", "", endpoint).split("/")[0]
        raise HubDeadlineExceeded(f"the push to {host} ran past its deadline of {deadline:g} s and was given up "
                                  f"(set {DEADLINE_ENV} for a longer one); a request it had started may still "
                                  f"reach the Hub: check the repo before pushing again")
    if "error" in done:
        raise done["error"]
    return done["result"]


def hub_error(err: Exception, endpoint: str, timeout: float, what: str = "the push") -> ConfigError | None:
    """A one-line error for a failed Hub call (None: not a network/Hub error); ``what`` the Hub refused."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, OfflineModeIsEnabled):
        return ConfigError("cannot push: offline mode is on (HF_HUB_OFFLINE is set); unset it to reach the Hub")
    try:
        from huggingface_hub.utils._http import httpx2 as httpx
    except ImportError:
        httpx = None
    if httpx is not None and isinstance(err, httpx.TimeoutException):
        return ConfigError(f"the Hub at {endpoint} did not answer within {timeout:g} s (after retries); check the "
                           f"network or the endpoint, or set {TIMEOUT_ENV} for a longer timeout")
    if httpx is not None and isinstance(err, (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProxyError)):
        return ConfigError(f"cannot reach the Hub at {endpoint}: {type(err).__name__}: {err}")
    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ConfigError(f"the Hub at {endpoint} refused {what} (HTTP {status}): {first}")
    return None


def push_release(folder: "str | Path", repo_id: str, *, revision: str | None = None, private: bool = False,
                 token: str | None = None, commit_message: str | None = None, endpoint: str | None = None,
                 api: Any = None, note: str | None = None, commit_description: str | None = None) -> dict[str, Any]:
    """Upload a release folder to ``repo_id`` (a dataset repo) in one commit that also deletes the files of
    an earlier release that this one lacks, then tag it ``revision``. ``commit_description``: the commit's
    description on the Hub (``push --diff-against`` puts the release diff there)."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    readme, manifest_path = folder / "README.md", folder / "manifest.json"
    if not readme.exists() or not manifest_path.exists() or not (folder / "data").is_dir():
        raise ConfigError(f"{folder} is not a release folder (it needs README.md, manifest.json and data/); "
                          f"build one with `debiased-nli build`")
    if "/" not in repo_id or repo_id.count("/") != 1:
        raise ConfigError(f"--repo-id must look like ORG/NAME, got {repo_id!r}")
    if revision is not None and not _VERSION_RE.match(revision):
        raise ConfigError(f"--revision {revision!r} is not a version tag (e.g. v1.0 or 1.2.0)")
    manifest = json.loads(manifest_path.read_text())
    card = readme.read_text()
    if HISTORY_START not in card:
        with_history(card, [])  # the error that says to rebuild
    api = api or HfApi(token=token, endpoint=endpoint)
    timeout, deadline = env_seconds(TIMEOUT_ENV, 60), env_seconds(DEADLINE_ENV, 3600)
    try:
        with hub_timeouts(timeout, deadline):
            return within_deadline(lambda: _push(api, folder, card, manifest, repo_id, revision, private,
                                                 commit_message, note, commit_description), deadline, api.endpoint)
    except ConfigError:
        raise
    except Exception as err:
        mapped = hub_error(err, api.endpoint, timeout)
        if mapped is None:
            raise
        raise mapped from err


def _push(api, folder: Path, card: str, manifest: dict, repo_id: str, revision: str | None, private: bool,
          commit_message: str | None, note: str | None, commit_description: str | None = None) -> dict[str, Any]:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    if revision is not None:
        refs = api.list_repo_refs(repo_id, repo_type="dataset")
        if any(t.name == revision for t in refs.tags):
            raise ConfigError(f"{repo_id} already has the tag {revision!r}; versions are immutable, "
                              f"choose a new --revision")
    history = merge_history(remote_history(api, repo_id), manifest.get("history") or [], revision, note)
    card = with_repo_id(with_history(card, history), manifest.get("repo_id"), repo_id)
    manifest.update(history=history, repo_id=repo_id)
    ops: list = [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()),
                 CommitOperationAdd(path_in_repo="manifest.json",
                                    path_or_fileobj=(json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())]
    local = ["README.md", "manifest.json"]
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel not in ("README.md", "manifest.json") and not rel.startswith("."):
            ops.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path)))
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
