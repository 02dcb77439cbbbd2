"""Publishing a release folder as a Hub dataset repo, with a tag per version.

``push_release`` creates the repo (if needed), uploads the whole folder as **one commit**, and tags
that commit with the version (e.g. ``v1.0``), so ``load_dataset("org/name", "seq_z", revision="v1.0")``
gets exactly that release. The card's "Version history" table is merged with the one already on
the Hub, so the history grows with every version. The token comes from the argument, ``HF_TOKEN``
or the user's ``huggingface-cli login``; it is never printed, logged or written into a file.

A Hub that accepts the connection and never answers must not hang the push: every request has a
timeout (``DEBIASED_NLI_HUB_TIMEOUT`` seconds, default 60; ``huggingface_hub`` retries timed-out
requests with back-off), and the push as a whole has a deadline (``DEBIASED_NLI_HUB_DEADLINE``,
default 3600 s) after which no new request is started. Timeouts, unreachable hosts, offline mode and
refusals by the Hub end the push with a one-line :class:`ConfigError`.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

from .errors import ConfigError

HISTORY_HEADING = "## Version history"
TIMEOUT_ENV, DEADLINE_ENV = "DEBIASED_NLI_HUB_TIMEOUT", "DEBIASED_NLI_HUB_DEADLINE"
_VERSION_RE = re.compile(r"^v?\d+(\.\d+){0,2}([.-][0-9A-Za-z.]+)?$")


def _history_rows(card: str) -> list[tuple[str, str]]:
    """The (version, notes) rows of the card's version-history table."""
    if HISTORY_HEADING not in card:
        return []
    section = card.split(HISTORY_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) >= 2 and line.strip().startswith("|") and cells[0] not in ("version", "") \
                and not set(cells[0]) <= set("-: "):
            # a note is everything after the version cell: a `|` in it (escaped or not) stays in the note
            rows.append((cells[0].replace("\\|", "|"), " | ".join(cells[1:]).replace("\\|", "|")))
    return rows


def _cell(text: str) -> str:
    """A markdown table cell: pipes escaped, one line."""
    return " ".join(str(text).split()).replace("|", "\\|")


def merge_history(local_card: str, remote_card: str | None, version: str | None, note: str | None = None) -> str:
    """The local card with a history table that holds the remote rows, the local rows and ``version``."""
    rows: list[tuple[str, str]] = []
    seen = set()
    for v, n in (_history_rows(remote_card or "") + _history_rows(local_card)
                 + ([(version, note or "published")] if version else [])):
        if v not in seen:
            rows.append((v, n))
            seen.add(v)
    table = "| version | notes |\n|---|---|\n" + "".join(f"| {_cell(v)} | {_cell(n)} |\n" for v, n in rows)
    if HISTORY_HEADING in local_card:
        head, rest = local_card.split(HISTORY_HEADING, 1)
        tail = rest.split("\n## ", 1)
        after = ("\n## " + tail[1]) if len(tail) > 1 else ""
        return f"{head}{HISTORY_HEADING}\n\n{table}{after}"
    return f"{local_card.rstrip()}\n\n{HISTORY_HEADING}\n\n{table}"


def _remote_card(api, repo_id: str) -> str | None:
    """The README.md on the Hub (None if the repo has none yet). A network failure is an error, not
    "no card": merging with a card we could not read would drop the version history."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        path = hf_hub_download(repo_id, "README.md", repo_type="dataset", endpoint=api.endpoint, token=api.token,
                               etag_timeout=_seconds(TIMEOUT_ENV, 60))
    except LocalEntryNotFoundError as err:  # raised when the Hub could not be reached at all
        raise ConfigError(f"could not read the current card of {repo_id} from {api.endpoint}: {err}") from err
    except (EntryNotFoundError, RepositoryNotFoundError):
        return None
    return Path(path).read_text()


def _seconds(env: str, default: float) -> float:
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


def _hub_error(err: Exception, endpoint: str, timeout: float) -> ConfigError | None:
    """A one-line error for a failed Hub call (None: not a network/Hub error)."""
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
        return ConfigError(f"the Hub at {endpoint} refused the push (HTTP {status}): {first}")
    return None


def push_release(folder: "str | Path", repo_id: str, *, revision: str | None = None, private: bool = False,
                 token: str | None = None, commit_message: str | None = None, endpoint: str | None = None,
                 api: Any = None) -> dict[str, Any]:
    """Upload a release folder to ``repo_id`` (a dataset repo) in one commit, then tag it ``revision``."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    readme = folder / "README.md"
    if not readme.exists() or not (folder / "data").is_dir():
        raise ConfigError(f"{folder} is not a release folder (it needs README.md and data/); "
                          f"build one with `debiased-nli build`")
    if "/" not in repo_id or repo_id.count("/") != 1:
        raise ConfigError(f"--repo-id must look like ORG/NAME, got {repo_id!r}")
    if revision is not None and not _VERSION_RE.match(revision):
        raise ConfigError(f"--revision {revision!r} is not a version tag (e.g. v1.0 or 1.2.0)")
    api = api or HfApi(token=token, endpoint=endpoint)
    timeout, deadline = _seconds(TIMEOUT_ENV, 60), _seconds(DEADLINE_ENV, 3600)
    try:
        with hub_timeouts(timeout, deadline):
            return _push(api, folder, readme, repo_id, revision, private, commit_message)
    except ConfigError:
        raise
    except Exception as err:
        mapped = _hub_error(err, api.endpoint, timeout)
        if mapped is None:
            raise
        raise mapped from err


def _push(api, folder: Path, readme: Path, repo_id: str, revision: str | None, private: bool,
          commit_message: str | None) -> dict[str, Any]:
    from huggingface_hub import CommitOperationAdd

    api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    if revision is not None:
        refs = api.list_repo_refs(repo_id, repo_type="dataset")
        if any(t.name == revision for t in refs.tags):
            raise ConfigError(f"{repo_id} already has the tag {revision!r}; versions are immutable, "
                              f"choose a new --revision")
    remote = _remote_card(api, repo_id)
    card = merge_history(readme.read_text(), remote, revision)
    ops = [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode())]
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel != "README.md" and not rel.startswith("."):
            ops.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path)))
    message = commit_message or f"debiased-nli release {revision or ''}".strip()
    info = api.create_commit(repo_id, ops, commit_message=message, repo_type="dataset")
    if revision is not None:
        api.create_tag(repo_id, tag=revision, revision=info.oid, repo_type="dataset",
                       tag_message=f"debiased-nli release {revision}")
    return {"repo_id": repo_id, "commit": info.oid, "commit_url": str(info.commit_url), "tag": revision,
            "files": len(ops)}
