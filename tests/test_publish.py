"""Publishing at the HTTP boundary: a local Hub-compatible server records what would be sent and
serves it back, so the pull side (`load_dataset("org/name", config, revision=tag)`) runs for real."""
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from debiased_nli.errors import ConfigError
from debiased_nli.publish import merge_history, push_release
from debiased_nli.recipe import build

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
        for rel in local - {"README.md"}:
            assert sent[rel] == (release / rel).read_bytes()
        assert "| v1.0 |" in sent["README.md"].decode()
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


def test_merge_history_keeps_remote_rows_first():
    local = "# x\n\n## Version history\n\n| version | notes |\n|---|---|\n| 1.0.0 | first release |\n\n## Citation\nc\n"
    remote = "## Version history\n\n| version | notes |\n|---|---|\n| v0.9 | beta |\n"
    merged = merge_history(local, remote, "v1.0")
    assert merged.index("v0.9") < merged.index("1.0.0") < merged.index("| v1.0 |")
    assert merged.rstrip().endswith("c")


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
