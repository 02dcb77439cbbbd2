"""Publishing at the HTTP boundary: a local Hub-compatible server records what would be sent and
serves it back, so the pull side (`load_dataset("org/name", config, revision=tag)`) runs for real."""
import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from debiased_nli.utils.errors import ConfigError
from debiased_nli.release.publish import legacy_history, merge_history, push_release, with_history
from debiased_nli.release.card import render_history_table
from debiased_nli.release.recipe import build

sys.path.insert(0, str(Path(__file__).parent))
from fake_hub import FakeHub  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_TESTtokenNEVERtoBEprinted"


@pytest.fixture(autouse=True)
def _online_to_the_local_hub(monkeypatch):
    # the suite runs with HF_HUB_OFFLINE=1; these tests talk to a server on 127.0.0.1 only
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    out = tmp_path_factory.mktemp("rel") / "debiased-demo"
    build(ROOT / "builders/demo.yaml", out, progress=False, max_rows=900)
    return out


def test_push_is_one_commit_with_every_file_and_a_tag(release, capsys):
    with FakeHub() as hub:
        out = push_release(release, "org/debiased-demo", revision="v1.0", token=TOKEN, endpoint=hub.url)
        reqs = [(r["method"], r["path"].split("?")[0]) for r in hub.requests]
        assert ("POST", "/api/repos/create") in reqs
        commits = [r for r in hub.requests if r["path"].startswith("/api/datasets/org/debiased-demo/commit/")]
        assert len(commits) == 1
        lines = [json.loads(x) for x in commits[0]["body"].decode().splitlines()]
        sent = {l["value"]["path"]: base64.b64decode(l["value"]["content"]) for l in lines if l["key"] == "file"}
        local = {p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file()}
        assert set(sent) == local
        for rel in local - {"README.md", "manifest.json"}:
            assert sent[rel] == (release / rel).read_bytes()
        assert "| v1.0 |" in sent["README.md"].decode()
        # the machine-readable history and the repo id travel in the pushed manifest
        pushed = json.loads(sent["manifest.json"])
        # the build's `1.0.0 | first release` is the tag's row now: one version scheme
        assert pushed["history"] == [{"version": "v1.0", "notes": "first release"}]
        assert pushed["repo_id"] == "org/debiased-demo"
        local_manifest = json.loads((release / "manifest.json").read_text())
        assert {k: v for k, v in pushed.items() if k not in ("history", "repo_id")} == \
            {k: v for k, v in local_manifest.items() if k not in ("history", "repo_id")}
        tags = [r for r in hub.requests if "/tag/" in r["path"]]
        assert len(tags) == 1 and json.loads(tags[0]["body"])["tag"] == "v1.0" and out["commit"] in tags[0]["path"]
        create = json.loads(next(r for r in hub.requests if r["path"] == "/api/repos/create")["body"])
        assert create["type"] == "dataset" and create["visibility"] == "public"
        # the token travels only in the Authorization header
        for r in hub.requests:
            if r["path"] != "/api/agent-harnesses":  # huggingface_hub's own probe carries no token
                assert r["headers"].get("authorization") == f"Bearer {TOKEN}"
            assert TOKEN.encode() not in r["body"]
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err
    assert not any(TOKEN.encode() in p.read_bytes() for p in release.rglob("*") if p.is_file())


def test_tags_are_immutable_and_history_grows(release):
    with FakeHub() as hub:
        push_release(release, "org/d", revision="v1.0", token=TOKEN, endpoint=hub.url)
        with pytest.raises(ConfigError, match="already has the tag 'v1.0'"):
            push_release(release, "org/d", revision="v1.0", token=TOKEN, endpoint=hub.url)
        push_release(release, "org/d", revision="v1.1", token=TOKEN, endpoint=hub.url)
        _, files = hub.snapshot("org/d", "v1.1")
        card = files["README.md"].decode()
        assert card.index("| v1.0 |") < card.index("| v1.1 |")
        _, old = hub.snapshot("org/d", "v1.0")
        assert "| v1.1 |" not in old["README.md"].decode()
    with pytest.raises(ConfigError, match="not a version tag"):
        push_release(release, "org/d", revision="latest version", token=TOKEN, endpoint="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="ORG/NAME"):
        push_release(release, "noslash", token=TOKEN, endpoint="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="not a release folder"):
        push_release(release / "data", "org/d", token=TOKEN, endpoint="http://127.0.0.1:9")


def test_merge_history_keeps_remote_rows_first_and_reads_an_old_card_once():
    # a card pushed before the history lived in manifest.json: its table is parsed, once
    old_card = ("# x\n\n## Version history\n\n| version | notes |\n|---|---|\n| v0.9 | beta \\| rc |\n"
                "\n## Citation\nc\n")
    remote = legacy_history(old_card)
    assert remote == [{"version": "v0.9", "notes": "beta | rc"}]
    merged = merge_history(remote, [{"version": "1.0.0", "notes": "first release"}], "v1.0", "a | b")
    assert [h["version"] for h in merged] == ["v0.9", "v1.0"]  # 1.0.0 is v1.0 written another way: one row
    table = render_history_table(merged)
    # the table is rendered from the list (a pipe in a note is escaped, not a new cell) and reads back
    assert "| v1.0 | a \\| b |" in table
    card = with_history(f"# x\n\n## Version history\n\n{render_history_table([])}\n\n## Citation\nc\n", merged)
    assert legacy_history(card) == merged and card.rstrip().endswith("c")
    with pytest.raises(ConfigError, match="rebuild the release"):
        with_history(old_card, merged)


def test_the_history_after_a_push_has_one_version_scheme(release):
    """The build's own row (the recipe's `1.0.0 | first release`) becomes the tag's row: never both `1.0.0` and
    `v1.0` in the card after a push; a later version adds its row in the same scheme."""
    from debiased_nli.release.publish import legacy_history as rows_of

    assert json.loads((release / "manifest.json").read_text())["history"] == [{"version": "1.0.0",
                                                                                "notes": "first release"}]
    with FakeHub() as hub:
        push_release(release, "org/h", revision="v1.0", token=TOKEN, endpoint=hub.url)
        _, files = hub.snapshot("org/h", "v1.0")
        assert rows_of(files["README.md"].decode()) == [{"version": "v1.0", "notes": "first release"}]
        assert json.loads(files["manifest.json"])["history"] == [{"version": "v1.0", "notes": "first release"}]
        push_release(release, "org/h", revision="v1.1", token=TOKEN, endpoint=hub.url, note="more rows")
        _, files = hub.snapshot("org/h", "v1.1")
        assert rows_of(files["README.md"].decode()) == [{"version": "v1.0", "notes": "first release"},
                                                        {"version": "v1.1", "notes": "more rows"}]
    # a recipe's own history of earlier versions keeps them, in the Hub's scheme where the Hub has them
    merged = merge_history([{"version": "v1.0", "notes": "first release"}],
                           [{"version": "1.0.0", "notes": "first release"}, {"version": "1.1.0", "notes": "fixed"}],
                           "v1.1", None, build_version="1.1.0")
    assert merged == [{"version": "v1.0", "notes": "first release"}, {"version": "v1.1", "notes": "fixed"}]


def test_pull_side_load_dataset_from_the_hub_by_tag(release):
    import datasets

    with FakeHub() as hub:
        push_release(release, "org/debiased-demo", revision="v1.0", token=TOKEN, endpoint=hub.url)
        code = ("import datasets, json; d = datasets.load_dataset('org/debiased-demo', 'z_filtered', "
                "revision='v1.0', split='train'); print(json.dumps(d.to_dict()))")
        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_DATASETS_OFFLINE="0",
                   HF_HOME=str(release.parent / "hf_home"), HF_TOKEN=TOKEN)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        pulled = json.loads(proc.stdout.strip().splitlines()[-1])
    local = datasets.load_dataset(str(release), "z_filtered", split="train").to_dict()
    assert pulled == local


def test_push_cli_reports_without_the_token(release, tmp_path):
    # the user's path: HF_ENDPOINT and HF_TOKEN in the environment, the console script in a new process
    with FakeHub() as hub:
        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0",
                   HF_HOME=str(tmp_path / "hf_home"))
        proc = subprocess.run([sys.executable, "-m", "debiased_nli.cli", "push", str(release), "--repo-id", "org/cli",
                               "--revision", "v2.0"], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        calls = [r for r in hub.requests if r["path"] != "/api/agent-harnesses"]  # huggingface_hub's own probe
        assert calls and all(r["headers"].get("authorization") == f"Bearer {TOKEN}" for r in calls)
        assert hub.repos["org/cli"]["tags"].keys() == {"v2.0"}
    assert "org/cli" in proc.stdout and "v2.0" in proc.stdout
    assert TOKEN not in proc.stdout + proc.stderr


def test_an_unreachable_hub_is_an_error_not_an_empty_history(release):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Exception) as err:
        push_release(release, "org/x", revision="v1.0", token=TOKEN, endpoint=f"http://127.0.0.1:{port}")
    assert TOKEN not in str(err.value)


def _load_revisions(endpoint: str, repo: str, config: str, revisions, hf_home: Path, token: str | None = None) -> dict:
    """``load_dataset(repo, config, revision=r)`` for each revision, in a fresh process that talks to
    ``endpoint`` through HF_ENDPOINT, as a user's would."""
    code = ("import datasets, json, sys; print(json.dumps({r: datasets.load_dataset(sys.argv[1], sys.argv[2], "
            "revision=None if r == 'main' else r, split='train').to_dict() for r in sys.argv[3:]}))")
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0", HF_DATASETS_OFFLINE="0", HF_HOME=str(hf_home))
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    proc = subprocess.run([sys.executable, "-c", code, repo, config, *revisions], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_republishing_deletes_the_old_shards_and_each_revision_loads_its_own_rows(tmp_path, monkeypatch):
    import datasets

    import debiased_nli.release.layout as release_module

    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    build(ROOT / "builders/demo.yaml", v1, progress=False, max_rows=600)
    monkeypatch.setattr(release_module, "ROWS_PER_SHARD", 150)  # v1.1 is written in several shards
    build(ROOT / "builders/demo.yaml", v2, progress=False, max_rows=1200)
    shards = lambda folder: sorted(p.relative_to(folder).as_posix() for p in (folder / "data").rglob("*.parquet"))
    assert shards(v1) == ["data/z_filtered/train-00000-of-00001.parquet"]
    assert len(shards(v2)) >= 2 and "data/z_filtered/train-00000-of-00001.parquet" not in shards(v2)
    with FakeHub() as hub:
        push_release(v1, "org/d", revision="v1.0", token=TOKEN, endpoint=hub.url)
        from huggingface_hub import HfApi
        # a file a person added to the repo: not written by debiased-nli, so never deleted
        HfApi(endpoint=hub.url, token=TOKEN).upload_file(path_or_fileobj=b"notes", path_in_repo="data/NOTES.txt",
                                                         repo_id="org/d", repo_type="dataset")
        out = push_release(v2, "org/d", revision="v1.1", token=TOKEN, endpoint=hub.url)
        commits = [r for r in hub.requests if r["path"].startswith("/api/datasets/org/d/commit/")]
        last = [json.loads(x) for x in commits[-1]["body"].decode().splitlines()]
        deleted = {l["value"]["path"] for l in last if l["key"] == "deletedFile"}
        # the deletions travel in the same commit as the new files
        assert "data/z_filtered/train-00000-of-00001.parquet" in deleted and set(out["deleted"]) == deleted
        assert "rejected/z_filtered/train-00000-of-00001.parquet" in deleted
        _, files_v10 = hub.snapshot("org/d", "v1.0")
        _, files_v11 = hub.snapshot("org/d", "v1.1")
        assert sorted(p for p in files_v10 if p.endswith(".parquet") and p.startswith("data/")) == shards(v1)
        assert sorted(p for p in files_v11 if p.endswith(".parquet") and p.startswith("data/")) == shards(v2)
        assert files_v11["data/NOTES.txt"] == b"notes"
        assert {p for p in files_v11 if p.startswith("rejected/")} == \
            {p.relative_to(v2).as_posix() for p in (v2 / "rejected").rglob("*") if p.is_file()}
        pulled = _load_revisions(hub.url, "org/d", "z_filtered", ["v1.0", "v1.1"], tmp_path / "hf_home", TOKEN)
    for rev, folder in (("v1.0", v1), ("v1.1", v2)):
        assert pulled[rev] == datasets.load_dataset(str(folder), "z_filtered", split="train").to_dict(), rev
    assert len(pulled["v1.0"]["uid"]) != len(pulled["v1.1"]["uid"])


def test_push_points_the_card_at_the_repo_and_keeps_local_paths_out(release):
    with FakeHub() as hub:
        push_release(release, "someone/my-copy", revision="v1.0", token=TOKEN, endpoint=hub.url)
        _, files = hub.snapshot("someone/my-copy", "v1.0")
    card, manifest = files["README.md"].decode(), files["manifest.json"].decode()
    assert 'load_dataset("someone/my-copy", "z_filtered")' in card
    assert "debiased-nli/debiased-demo" not in card  # the recipe's repo id
    for text in (card, manifest, (release / "README.md").read_text(), (release / "manifest.json").read_text()):
        assert str(ROOT) not in text and str(release.parent) not in text and "/tmp/" not in text


# ------------------------------------------------------------------ a third-party Hub-compatible server

def _olah_cli() -> str | None:
    exe = os.environ.get("OLAH_CLI") or shutil.which("olah-cli") or str(Path(sys.executable).parent / "olah-cli")
    return exe if exe and Path(exe).exists() else None


@pytest.mark.skipif(_olah_cli() is None, reason="olah is not installed (pip install olah, or the dev extra); "
                                                "the pull side is still tested against tests/fake_hub.py")
def test_olah_offline_mirror_serves_a_release_to_load_dataset(release, tmp_path):
    """olah (a self-hosted Hub mirror) in offline mode serves a git repository of the release from its
    mirrors path (mirrors/datasets/ORG/NAME); `load_dataset` reads it through HF_ENDPOINT, by tag."""
    import socket
    import time
    import urllib.request

    import datasets

    repo = tmp_path / "mirrors" / "datasets" / "org" / "debiased-demo"
    shutil.copytree(release, repo)
    git_env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org", GIT_COMMITTER_NAME="t",
                   GIT_COMMITTER_EMAIL="t@example.org")
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "v1.0"],
                ["git", "tag", "v1.0"]):
        subprocess.run(cmd, cwd=repo, env=git_env, check=True, capture_output=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "olah.toml"
    config.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{tmp_path / "cache"}"\n'
                      f'mirror-scheme = "http"\nmirror-netloc = "127.0.0.1:{port}"\n'
                      f'mirror-lfs-netloc = "127.0.0.1:{port}"\nmirrors-path = ["{tmp_path / "mirrors"}"]\n'
                      f'[accessibility]\noffline = true\n')
    log_file = open(tmp_path / "olah.log", "w")
    server = subprocess.Popen([_olah_cli(), "-c", str(config)], cwd=tmp_path, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/datasets/org/debiased-demo/revision/v1.0", timeout=5).read()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    pytest.fail("olah did not start: " + (tmp_path / "olah.log").read_text()[-2000:])
                time.sleep(0.5)
        pulled = _load_revisions(url, "org/debiased-demo", "z_filtered", ["v1.0"], tmp_path / "hf_home")
    finally:
        server.terminate()
        server.wait(timeout=30)
        log_file.close()
    assert pulled["v1.0"] == datasets.load_dataset(str(release), "z_filtered", split="train").to_dict()
    assert "/resolve/" in (tmp_path / "olah.log").read_text()  # the rows came through olah
