"""`debiased-nli diff OLD NEW` on real builds of the 20k SNLI sample: with and without new rows, and
after a recipe change; plus uids that changed, bad input, a Hub revision and `push --diff-against`."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from debiased_nli.cli import main
from debiased_nli.release.diff import diff_releases
from debiased_nli.release.recipe import build
from debiased_nli.utils.provenance import file_sha256

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def releases(tmp_path_factory, shared_data):
    """The 20k SNLI release (v1), the same with 2,000 SNLI dev rows as new rows, and v1.1: a recipe with
    top_k 10 instead of 20."""
    tmp = tmp_path_factory.mktemp("diff")
    train = [f"train={shared_data / 'snli/train_sample.parquet'}"]
    new_rows = tmp / "new_rows.parquet"
    pq.write_table(pq.read_table(shared_data / "snli/dev.parquet").slice(0, 2000), new_rows)
    recipe = yaml.safe_load((ROOT / "builders/snli.yaml").read_text())
    recipe["z_filter"]["top_k"] = 10
    recipe["release_version"] = "1.1.0"
    recipe["history"].append({"version": "1.1.0", "notes": "top_k 10"})
    (tmp / "snli_top10.yaml").write_text(yaml.safe_dump(recipe))
    out = {"v1": tmp / "v1", "new_rows": tmp / "with-new-rows", "top10": tmp / "top10"}
    build(ROOT / "builders/snli.yaml", out["v1"], data_files=train, progress=False)
    build(ROOT / "builders/snli.yaml", out["new_rows"], data_files=train, new_rows_files=[str(new_rows)], progress=False)
    build(tmp / "snli_top10.yaml", out["top10"], data_files=train, progress=False)
    return out


def _rows(release: Path) -> dict:
    m = json.loads((release / "manifest.json").read_text())
    return {c: sum(f["rows"] for f in s["train"]) for c, s in m["files"].items()}


def test_a_copy_is_identical_exit_0(releases, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(releases["v1"], copy)
    assert main(["diff", str(releases["v1"]), str(copy)]) == 0
    out, err = capsys.readouterr()
    assert "The data is **identical**" in out and "same recipe, inputs, seed and library versions" in out
    assert err.startswith("identical:")
    assert str(tmp_path) not in out  # folders are named by name and version, never by local path


def test_new_rows_add_three_configs_and_leave_z_filtered_alone(releases, capsys):
    assert main(["diff", str(releases["v1"]), str(releases["new_rows"]), "--top-k", "3"]) == 1
    out, err = capsys.readouterr()
    rows = _rows(releases["new_rows"])
    assert f"| `z_filtered` | train | {rows['z_filtered']:,} | {rows['z_filtered']:,} | +0 | -0 | 0 | 0 | 0 |" in out
    for config in ("z_aug", "par_z", "seq_z"):
        assert f"| `{config}` | train | — | {rows[config]:,} | new config |" in out
    assert "| recipe new_rows | [] |" in out and "new_rows.parquet" in out  # which input changed
    assert "`z_aug` | train | entailment |" in out  # the new configs' biased features
    assert "`z_filtered` | train | entailment |" not in out  # same rows: same z, left out
    assert err.startswith("different: ") and "z_aug: new config" in err


def test_a_recipe_change_is_named_and_its_rows_add_up(releases, tmp_path, capsys):
    old, new = releases["v1"], releases["top10"]
    d = diff_releases(old, new, top_k=5)
    assert not d.identical
    assert ("recipe z_filter.top_k", 20, 10) in d.build and ("recipe release_version", "1.0.0", "1.1.0") in d.build
    (z,) = [s for s in d.splits if s.config == "z_filtered"]
    assert z.old_rows == _rows(old)["z_filtered"] and z.new_rows == _rows(new)["z_filtered"]
    assert z.kept + z.added == z.new_rows and z.kept + z.removed == z.old_rows and z.added and z.removed
    assert z.moved == z.edited == z.relabelled == 0
    labels = [json.loads((r / "manifest.json").read_text())["label_distribution"]["z_filtered"]["train"]
              for r in (old, new)]
    assert z.labels_old == labels[0] and z.labels_new == labels[1]
    # z of the top features in each: every label has its top 5 of both releases, marked
    for label in ("entailment", "neutral", "contradiction"):
        feats = [f for f in z.features if f["label"] == label]
        assert sum(f["top"][0] for f in feats) == 5 and sum(f["top"][1] for f in feats) == 5
    md = d.markdown()
    assert "| recipe z_filter.top_k | 20 | 10 |" in md and "max \\|z\\| before" in md
    assert "top10 (1.1.0)" in md and "v1 (1.0.0)" in md
    assert d.summary().startswith("vs v1 (1.0.0): z_filtered ") and "recipe z_filter.top_k" in d.summary()
    # the CLI: exit 1, --out writes the same markdown, --json the numbers
    assert main(["diff", str(old), str(new), "--out", str(tmp_path / "note.md")]) == 1
    printed = capsys.readouterr().out
    assert (tmp_path / "note.md").read_text() == printed == md
    assert main(["diff", str(old), str(new), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["identical"] is False and {"what": "recipe z_filter.top_k", "before": 20, "after": 10} in data["build"]


def test_rows_whose_uid_changed_are_matched_by_content(releases, tmp_path):
    new = tmp_path / "edited"
    shutil.copytree(releases["v1"], new)
    (path,) = (new / "data/z_filtered").glob("*.parquet")
    t = pq.read_table(path)
    uid = t.column("uid").to_pylist()
    label = t.column("label").to_pylist()
    hyp = t.column("hypothesis").to_pylist()
    uid[:10] = [f"renumbered:{i}" for i in range(10)]       # 10 moved (rows 0-9)
    label[0] = (label[0] + 1) % 3                           # one of them relabelled too
    label[20] = (label[20] + 1) % 3                         # 1 relabelled in place
    hyp[30] = hyp[30] + " Edited."                          # 1 edited (same uid)
    t = t.set_column(t.schema.get_field_index("uid"), "uid", pa.array(uid))
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(label, t.schema.field("label").type))
    t = t.set_column(t.schema.get_field_index("hypothesis"), "hypothesis", pa.array(hyp))
    t = t.slice(0, t.num_rows - 5)                          # 5 removed
    pq.write_table(t, path)
    # the manifest records the edited file's sha256 (diff reads only the bytes a manifest records)
    manifest = json.loads((new / "manifest.json").read_text())
    (entry,) = manifest["files"]["z_filtered"]["train"]
    entry["sha256"] = file_sha256(path)
    (new / "manifest.json").write_text(json.dumps(manifest))
    (z,) = diff_releases(releases["v1"], new, top_k=0).splits
    assert (z.moved, z.relabelled, z.edited, z.removed, z.added) == (10, 2, 1, 5, 0)
    assert z.kept == z.new_rows == z.old_rows - 5


@pytest.mark.parametrize("make, names", [
    (lambda tmp, rel: tmp / "nowhere", "nowhere"),
    (lambda tmp, rel: (tmp / "empty").mkdir() or tmp / "empty", "manifest.json"),
    (lambda tmp, rel: _copy_with(tmp, rel, "manifest.json", b"{not json"), "manifest.json"),
    (lambda tmp, rel: _copy_with(tmp, rel, "data/z_filtered/train-00000-of-00001.parquet", b"PAR1 garbage"),
     "train-00000-of-00001.parquet"),
    (lambda tmp, rel: _copy_without(tmp, rel, "data/z_filtered/train-00000-of-00001.parquet"),
     "train-00000-of-00001.parquet"),
])
def test_bad_input_is_one_line_naming_the_file_exit_2(releases, tmp_path, capsys, make, names):
    bad = make(tmp_path, releases["v1"])
    assert main(["diff", str(releases["v1"]), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0], err


def _copy_with(tmp, rel, name, content: bytes):
    out = tmp / "copy"
    shutil.copytree(rel, out)
    (out / name).write_bytes(content)
    return out


def _copy_without(tmp, rel, name):
    out = tmp / "copy"
    shutil.copytree(rel, out)
    (out / name).unlink()
    return out


def test_a_hub_revision_and_push_diff_against(releases, tmp_path, monkeypatch):
    """`diff ORG/NAME@TAG FOLDER` downloads the tagged release; `push --diff-against` writes the summary into
    the version history and the table into the commit description."""
    import base64

    import huggingface_hub.constants as c
    from fake_hub import FakeHub

    from debiased_nli.release.publish import push_release

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    with FakeHub() as hub:
        push_release(releases["v1"], "org/snli", revision="v1.0", token="hf_x", endpoint=hub.url)
        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN="hf_x", HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf"),
                   PYTHONPATH=str(ROOT))
        cli = [sys.executable, "-m", "debiased_nli.cli"]
        same = subprocess.run(cli + ["diff", "org/snli@v1.0", str(releases["v1"])], env=env, capture_output=True,
                              text=True, timeout=300)
        assert same.returncode == 0, same.stderr[-2000:]
        assert "Changes from `org/snli@v1.0` to `v1 (1.0.0)`" in same.stdout
        missing = subprocess.run(cli + ["diff", "org/snli@v9.9", str(releases["v1"])], env=env, capture_output=True,
                                 text=True, timeout=300)
        assert missing.returncode == 2 and "org/snli@v9.9" in missing.stderr and len(missing.stderr.splitlines()) == 1
        n_requests = len(hub.requests)
        pushed = subprocess.run(cli + ["push", str(releases["top10"]), "--repo-id", "org/snli", "--revision", "v1.1",
                                       "--diff-against", "org/snli@v1.0"], env=env, capture_output=True, text=True,
                                timeout=300)
        assert pushed.returncode == 0, pushed.stderr[-2000:]
        assert "| recipe z_filter.top_k | 20 | 10 |" in pushed.stdout
        commit = next(r for r in hub.requests[n_requests:] if "/commit/" in r["path"])
        lines = [json.loads(x) for x in commit["body"].decode().splitlines()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        assert "| recipe z_filter.top_k | 20 | 10 |" in header["description"]
        sent = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"}
        history = json.loads(sent["manifest.json"])["history"]
        assert history[-1]["version"] == "v1.1"
        assert history[-1]["notes"].startswith("vs org/snli@v1.0: z_filtered ") and "recipe z_filter.top_k" in \
            history[-1]["notes"]
