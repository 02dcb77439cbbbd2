"""Publishing a release folder as a Hub dataset repo, with a tag per version.

``push_release`` creates the repo (if needed), uploads the whole folder as **one commit**, and tags
that commit with the version (e.g. ``v1.0``), so ``load_dataset("org/name", "seq_z", revision="v1.0")``
gets exactly that release. The card's "Version history" table is merged with the one already on
the Hub, so the history grows with every version. The token comes from the argument, ``HF_TOKEN``
or the user's ``huggingface-cli login``; it is never printed, logged or written into a file.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .errors import ConfigError

HISTORY_HEADING = "## Version history"
_VERSION_RE = re.compile(r"^v?\d+(\.\d+){0,2}([.-][0-9A-Za-z.]+)?$")


def _history_rows(card: str) -> list[tuple[str, str]]:
    """The (version, notes) rows of the card's version-history table."""
    if HISTORY_HEADING not in card:
        return []
    section = card.split(HISTORY_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and line.strip().startswith("|") and cells[0] not in ("version", "") \
                and not set(cells[0]) <= set("-: "):
            rows.append((cells[0], cells[1]))
    return rows


def merge_history(local_card: str, remote_card: str | None, version: str | None, note: str | None = None) -> str:
    """The local card with a history table that holds the remote rows, the local rows and ``version``."""
    rows: list[tuple[str, str]] = []
    seen = set()
    for v, n in (_history_rows(remote_card or "") + _history_rows(local_card)
                 + ([(version, note or "published")] if version else [])):
        if v not in seen:
            rows.append((v, n))
            seen.add(v)
    table = "| version | notes |\n|---|---|\n" + "".join(f"| {v} | {n} |\n" for v, n in rows)
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
        path = hf_hub_download(repo_id, "README.md", repo_type="dataset", endpoint=api.endpoint, token=api.token)
    except LocalEntryNotFoundError as err:  # raised when the Hub could not be reached at all
        raise ConfigError(f"could not read the current card of {repo_id} from {api.endpoint}: {err}") from err
    except (EntryNotFoundError, RepositoryNotFoundError):
        return None
    return Path(path).read_text()


def push_release(folder: "str | Path", repo_id: str, *, revision: str | None = None, private: bool = False,
                 token: str | None = None, commit_message: str | None = None, endpoint: str | None = None,
                 api: Any = None) -> dict[str, Any]:
    """Upload a release folder to ``repo_id`` (a dataset repo) in one commit, then tag it ``revision``."""
    from huggingface_hub import CommitOperationAdd, HfApi

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
