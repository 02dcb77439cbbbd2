"""A small Hub-compatible HTTP server for tests: it records every request and serves what was pushed.

It speaks the parts of the Hub API that ``huggingface_hub`` uses to create a dataset or model repo, commit
files (regular, base64 in the NDJSON commit payload) and deletions (``deletedFile``, ``deletedFolder``),
tag a commit, and that ``datasets``, ``transformers`` and ``huggingface_hub`` use to read a repo back (repo info,
refs, tree listing, paths-info, resolve with ranges; for a model, ``model_info(expand=["evalResults"])``: the
entries of its ``.eval_results/*.yaml`` files, each checked as the Hub checks them). Everything is kept in memory;
each commit is a full snapshot, so revisions and tags resolve to exactly what was pushed. Dataset repos are in
``hub.repos``, model repos in ``hub.models``.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self):
        self.requests: list[dict] = []
        self.repos: dict[str, dict] = {}   # dataset repos
        self.models: dict[str, dict] = {}  # model repos
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def be_the_hub(self, monkeypatch, cache, token: str = "hf_test") -> "FakeHub":
        """Make this server the Hub for huggingface_hub's and datasets' defaults in this process (what HF_ENDPOINT,
        HF_TOKEN and HF_HOME do for a new one): ModelCard.load, model_info, from_pretrained, load_dataset("org/name").
        ``cache``: a new folder for what they download (the user's Hub cache could hold another server's
        ``org/name`` at the same tag, with another commit)."""
        import datasets.config
        import huggingface_hub.constants as c

        monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache / "hub"))
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache / "datasets")
        monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(c, "ENDPOINT", self.url)
        monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", self.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", self.url)
        monkeypatch.setenv("HF_ENDPOINT", self.url)
        monkeypatch.setenv("HF_TOKEN", token)
        return self

    # -- state ------------------------------------------------------------------------------
    def store(self, kind: str) -> dict[str, dict]:
        return self.models if kind == "model" else self.repos

    def snapshot(self, repo: str, rev: str | None, kind: str = "dataset") -> tuple[str, dict[str, bytes]]:
        r = self.store(kind)[repo]
        rev = urllib.parse.unquote(rev or "main")
        if rev in r["tags"]:
            oid = r["tags"][rev]
        elif rev == "main":
            oid = r["head"]
        else:
            oid = rev
        return oid, r["commits"][oid]["files"]

    def _handler(hub):  # noqa: N805 - closure over the FakeHub
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _send(self, code: int, payload=None, headers: dict | None = None, raw: bytes | None = None):
                body = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else b"")
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if raw is None:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _record(self, body: bytes):
                hub.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                     "body": body})

            def do_HEAD(self):
                self._record(b"")
                self._route(b"")

            def do_GET(self):
                self._record(b"")
                self._route(b"")

            def do_POST(self):
                body = self._body()
                self._record(body)
                self._route(body)

            def _not_found(self, code="RepoNotFound"):
                self._send(404, {"error": code}, headers={"X-Error-Code": code})

            def _route(self, body: bytes):
                url = urllib.parse.urlparse(self.path)
                parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
                query = urllib.parse.parse_qs(url.query)
                if parts[:3] == ["api", "repos", "create"]:
                    req = json.loads(body)
                    repo = f"{req.get('organization')}/{req['name']}" if req.get("organization") else req["name"]
                    kind = req.get("type") or "model"
                    store = hub.store(kind)
                    if repo not in store:
                        store[repo] = {"commits": {}, "head": None, "tags": {}, "private": req.get("visibility") == "private" or bool(req.get("private"))}
                    prefix = "datasets/" if kind == "dataset" else ""
                    return self._send(200, {"url": f"{hub.url}/{prefix}{repo}", "name": repo})
                if parts[:2] == ["api", "validate-yaml"]:
                    import yaml
                    content = json.loads(body)["content"]
                    if content.startswith("---"):
                        yaml.safe_load(content.split("---")[1])  # a broken card header fails the push
                    return self._send(200, {"errors": [], "warnings": []})
                if parts[:2] in (["api", "datasets"], ["api", "models"]) and len(parts) >= 4:
                    kind = "dataset" if parts[1] == "datasets" else "model"
                    repo = f"{parts[2]}/{parts[3]}"
                    if repo not in hub.store(kind):
                        return self._not_found()
                    rest = parts[4:]
                    return self._api(repo, rest, body, query, kind)
                resolve = (parts[1:], "dataset") if parts[0] == "datasets" else (parts, "model")
                if len(resolve[0]) >= 5 and resolve[0][2] == "resolve":
                    (org, name, _, rev, *rest), kind = resolve
                    repo = f"{org}/{name}"
                    store = hub.store(kind)
                    if repo not in store or store[repo]["head"] is None:
                        return self._not_found()
                    try:
                        oid, files = hub.snapshot(repo, rev, kind)
                    except KeyError:
                        return self._not_found("RevisionNotFound")
                    path = "/".join(rest)
                    if path not in files:
                        return self._not_found("EntryNotFound")
                    data = files[path]
                    etag = hashlib.sha1(data).hexdigest()
                    headers = {"X-Repo-Commit": oid, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
                    rng = self.headers.get("Range")
                    if rng and rng.startswith("bytes="):
                        start, _, end = rng[6:].partition("-")
                        start = int(start) if start else 0
                        end = min(int(end), len(data) - 1) if end else len(data) - 1
                        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                        return self._send(206, raw=data[start:end + 1], headers=headers)
                    return self._send(200, raw=data, headers=headers)
                return self._send(404, {"error": f"unknown route {url.path}"})

            def _api(self, repo: str, rest: list[str], body: bytes, query, kind: str = "dataset"):
                r = hub.store(kind)[repo]
                if not rest or rest[0] == "revision":
                    if r["head"] is None:
                        return self._not_found("RevisionNotFound")
                    oid, files = hub.snapshot(repo, rest[1] if len(rest) > 1 else None, kind)
                    info = {"id": repo, "_id": repo, "sha": oid, "private": bool(r["private"]),
                            "siblings": [{"rfilename": p} for p in sorted(files)],
                            "tags": [], "lastModified": "2026-01-01T00:00:00.000Z",
                            "disabled": False, "gated": False, "downloads": 0, "likes": 0, "cardData": {}}
                    if kind == "model":
                        info.update(modelId=repo, author=repo.split("/")[0])
                        if "evalResults" in query.get("expand", []) + query.get("expand[]", []):
                            info["evalResults"] = eval_results(files)
                    return self._send(200, info)
                if rest[0] == "refs":
                    return self._send(200, {
                        "branches": ([{"name": "main", "ref": "refs/heads/main", "targetCommit": r["head"]}]
                                     if r["head"] else []),
                        "converts": [],
                        "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": o} for t, o in r["tags"].items()]})
                if rest[0] == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files],
                                            "commitOid": r["head"]})
                if rest[0] == "commit":
                    lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
                    files = dict(r["commits"][r["head"]]["files"]) if r["head"] else {}
                    header = {}
                    for line in lines:
                        if line["key"] == "header":
                            header = line["value"]
                        elif line["key"] == "file":
                            v = line["value"]
                            files[v["path"]] = base64.b64decode(v["content"]) if v.get("encoding") == "base64" \
                                else v["content"].encode()
                        elif line["key"] == "deletedFile":
                            if line["value"]["path"] not in files:  # the Hub refuses to delete a missing file
                                return self._send(404, {"error": f"{line['value']['path']} does not exist"},
                                                  headers={"X-Error-Code": "EntryNotFound"})
                            files.pop(line["value"]["path"])
                        elif line["key"] == "deletedFolder":
                            prefix = line["value"]["path"].rstrip("/") + "/"
                            for path in [p for p in files if p.startswith(prefix)]:
                                files.pop(path)
                    oid = hashlib.sha1(json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items()))
                                       .encode() + str(len(r["commits"])).encode()).hexdigest()
                    r["commits"][oid] = {"files": files, "summary": header.get("summary"), "parent": r["head"]}
                    r["head"] = oid
                    prefix = "datasets/" if kind == "dataset" else ""
                    return self._send(200, {"commitUrl": f"{hub.url}/{prefix}{repo}/commit/{oid}",
                                            "commitOid": oid, "pullRequestUrl": None})
                if rest[0] == "tag":
                    tag = json.loads(body)["tag"]
                    rev = urllib.parse.unquote(rest[1]) if len(rest) > 1 else "main"
                    if tag in r["tags"]:
                        return self._send(409, {"error": "tag exists"})
                    r["tags"][tag] = hub.snapshot(repo, rev, kind)[0]
                    return self._send(200, {})
                if rest[0] in ("tree", "paths-info"):
                    if r["head"] is None:
                        return self._not_found("RevisionNotFound")
                    oid, files = hub.snapshot(repo, rest[1], kind)
                    if rest[0] == "tree":
                        prefix = "/".join(rest[2:]).strip("/")
                        recursive = query.get("recursive", ["false"])[0].lower() == "true"
                        wanted = None
                    else:
                        form = urllib.parse.parse_qs(body.decode()) if body and not body.startswith(b"{") else {}
                        if body.startswith(b"{"):
                            form = {"paths": json.loads(body).get("paths", [])}
                        wanted = set(form.get("paths", []))
                        prefix, recursive = "", True
                    entries, dirs = [], set()
                    for path, data in sorted(files.items()):
                        if prefix and not (path == prefix or path.startswith(prefix + "/")):
                            continue
                        rel = path[len(prefix) + 1:] if prefix else path
                        segs = rel.split("/")
                        for i in range(1, len(segs)):
                            d = "/".join(([prefix] if prefix else []) + segs[:i])
                            if (recursive or i == 1) and d not in dirs:
                                dirs.add(d)
                                entries.append({"type": "directory", "oid": oid, "path": d, "size": 0})
                        if recursive or len(segs) == 1:
                            entries.append({"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data),
                                            "path": path})
                    if wanted is not None:
                        entries = [e for e in entries if e["path"] in wanted]
                    return self._send(200, entries)
                return self._send(404, {"error": f"unknown api route {rest}"})

        return Handler


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def eval_results(files: dict[str, bytes]) -> list[dict]:
    """What the Hub's ``evalResults`` holds for a model's files: every entry of every ``.eval_results/*.yaml``
    (https://huggingface.co/docs/hub/eval-results: ``dataset.id``, a Hub dataset id, and ``dataset.task_id`` are
    required, and so is ``value``; ``source.url`` when there is a ``source``), or ``{filename, error}`` for a file
    that is not a list of such entries."""
    import yaml

    out = []
    for path in sorted(p for p in files if p.startswith(".eval_results/") and p.endswith((".yaml", ".yml"))):
        try:
            entries = yaml.safe_load(files[path].decode())
            assert isinstance(entries, list) and entries, "not a list of results"
            for e in entries:
                ds = e.get("dataset") or {}
                assert isinstance(ds.get("id"), str) and _HUB_ID.match(ds["id"]), f"dataset.id {ds.get('id')!r}"
                assert isinstance(ds.get("task_id"), str) and ds["task_id"], "dataset.task_id is required"
                assert isinstance(e.get("value"), (int, float)), "value is required and numeric"
                assert not e.get("source") or isinstance(e["source"].get("url"), str), "source.url is required"
                assert set(e) <= {"dataset", "value", "verifyToken", "date", "source", "notes"}, f"keys {sorted(e)}"
        except Exception as err:  # noqa: BLE001 - what the Hub reports for an invalid file
            out.append({"filename": path, "error": str(err)})
            continue
        out += [{"filename": path, "data": e} for e in entries]
    return out
