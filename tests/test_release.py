"""Release folders, recipes and compositions (Z-Aug, Par-Z, Seq-Z)."""
import filecmp
import json
from pathlib import Path

import datasets
import pytest
import yaml

from debiased_nli.cli import main
from debiased_nli.utils.errors import ConfigError
from debiased_nli.release.recipe import build, load_recipe
from test_embeddings import tiny_encoder  # noqa: F401  (a tiny BERT folder built from a config)

ROOT = Path(__file__).resolve().parents[1]


def _read_yaml_header(folder: Path) -> dict:
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_demo_build_opens_with_load_dataset_and_shows_the_artifacts_gone(tmp_path):
    out = tmp_path / "demo"
    assert main(["build", str(ROOT / "builders/demo.yaml"), "--out", str(out), "--quiet"]) == 0
    meta = _read_yaml_header(out)
    assert meta["configs"] == [{"config_name": "z_filtered", "data_files": [
        {"split": "train", "path": "data/z_filtered/train-*"}], "default": True},
        # the rows z-filtering dropped, with the reason: a config of their own, not the default
        {"config_name": "rejected_z_filtered", "data_files": [
            {"split": "train", "path": "rejected/z_filtered/train-*"}]}]
    info = meta["dataset_info"]
    assert info["features"][2]["dtype"]["class_label"]["names"] == {"0": "entailment", "1": "neutral",
                                                                    "2": "contradiction"}
    loaded = datasets.load_dataset(str(out), "z_filtered", split="train")
    written = datasets.Dataset.from_parquet(str(next((out / "data/z_filtered").glob("train-*.parquet"))))
    assert loaded.to_dict() == written.to_dict()
    assert info["splits"][0]["num_examples"] == len(loaded)
    assert loaded.column_names == ["premise", "hypothesis", "label", "uid", "origin", "method"]
    rejected = datasets.Dataset.from_parquet(str(next((out / "rejected/z_filtered").glob("*.parquet"))))
    assert len(rejected) + len(loaded) == 3000 and all(rejected["rejected_by"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 0 and manifest["versions"]["datasets"] == datasets.__version__
    assert [s["stage"] for s in manifest["stages"]] == ["load", "features", "z_filtered = Z(D0)"]
    assert manifest["inputs"][0]["inputs"][0]["sha256"]
    card = (out / "README.md").read_text()
    # the card's before/after table: each planted artifact falls from a large z to a small one
    rows = [line.split("|") for line in card.splitlines() if line.startswith("| ") and "`" in line]
    after = {r[2].strip().strip("`"): (float(r[4]), float(r[6])) for r in rows if len(r) > 7 and r[6].strip() != "-"}
    for artifact in ("nobody@hypothesis", "outdoors@hypothesis", "competition@hypothesis"):
        before_z, after_z = after[artifact]
        assert before_z > 10 and after_z < 4, (artifact, before_z, after_z)
    assert (out / "images/zstats_original.png").exists() and (out / "images/zstats_z_filtered.png").exists()
    assert not list(tmp_path.glob(".demo.tmp-*"))


def test_same_seed_same_release_byte_for_byte(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build(ROOT / "builders/demo.yaml", a, progress=False)
    build(ROOT / "builders/demo.yaml", b, progress=False)
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files_a:
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel
    c = tmp_path / "c"
    build(ROOT / "builders/demo.yaml", c, seed=1, progress=False)
    assert not filecmp.cmp(a / files_a[0], c / files_a[0], shallow=False) or \
        (a / "data/z_filtered/train-00000-of-00001.parquet").read_bytes() != \
        (c / "data/z_filtered/train-00000-of-00001.parquet").read_bytes()


def test_compositions_with_new_rows(tmp_path, shared_data):
    out = tmp_path / "snli"
    # D0 = 6,000 rows of the SNLI sample; "new rows" = SNLI dev (any rows of the task's schema)
    res = build(ROOT / "builders/snli.yaml", out, data_files=[f"train={shared_data}/snli/train_sample.parquet"],
                new_rows_files=[str(shared_data / "snli/dev.parquet")], max_rows=6000, progress=False)
    assert set(res.configs) == {"z_filtered", "z_aug", "par_z", "seq_z"}
    meta = _read_yaml_header(out)
    assert sorted(c["config_name"] for c in meta["configs"] if not c["config_name"].startswith("rejected_")) == \
        ["par_z", "seq_z", "z_aug", "z_filtered"]
    assert [c for c in meta["configs"] if c.get("default")][0]["config_name"] == "seq_z"
    load = {c: datasets.load_dataset(str(out), c, split="train") for c in res.configs}
    z0 = set(load["z_filtered"]["uid"])
    new_uids = lambda ds: {u for u, o in zip(ds["uid"], ds["origin"]) if o == "generated"}
    # Seq-Z = Z(D0) + new rows kept given it; Z-Aug = D0 + new rows kept given D0; Par-Z = union
    assert z0 <= set(load["seq_z"]["uid"]) and len(new_uids(load["seq_z"])) > 0
    assert len(load["z_aug"]) == 6000 + len(new_uids(load["z_aug"]))
    assert set(load["par_z"]["uid"]) == z0 | new_uids(load["par_z"])
    assert all(o == "original" for u, o in zip(load["z_filtered"]["uid"], load["z_filtered"]["origin"]))
    assert len(load["seq_z"]) < len(load["z_aug"])


def test_walks_and_statistics_in_processes_write_the_same_release(tmp_path, shared_data):
    # z_filter.num_proc: the three walks over the new rows in forked processes, and the z-statistics and
    # plots in one beside the Parquet writing; every file is the one written in a single process
    recipe = yaml.safe_load((ROOT / "builders/snli.yaml").read_text())
    kw = dict(data_files=[f"train={shared_data}/snli/train_sample.parquet"], max_rows=3000, progress=False,
              new_rows_files=[str(shared_data / "snli/dev.parquet")])
    build({**recipe, "z_filter": {**recipe["z_filter"], "num_proc": 1}}, tmp_path / "one", **kw)
    build({**recipe, "z_filter": {**recipe["z_filter"], "num_proc": 3}}, tmp_path / "three", **kw)
    one, three = tmp_path / "one", tmp_path / "three"
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(three) for p in three.rglob("*") if p.is_file())
    assert len([f for f in files if f.parts[0] == "images"]) == 5  # the original and the four configs
    for rel in files:
        if rel.name != "manifest.json":  # which records the recipe's num_proc
            assert filecmp.cmp(one / rel, three / rel, shallow=False), rel
    with pytest.raises(ConfigError, match="z_filter.num_proc"):
        load_recipe({**recipe, "z_filter": {"num_proc": 0}})


def test_a_statistics_process_that_dies_leaves_no_release(tmp_path, monkeypatch):
    import os

    from debiased_nli.release import layout as release

    monkeypatch.setattr(release, "_summaries", lambda **kw: os._exit(3))  # the forked process inherits it
    recipe = {**yaml.safe_load((ROOT / "builders/demo.yaml").read_text()), "z_filter": {"num_proc": 2}}
    with pytest.raises(RuntimeError, match="z-statistics process ended without its result"):
        build(recipe, tmp_path / "rel", progress=False)
    assert not (tmp_path / "rel").exists() and not list(tmp_path.glob(".rel*tmp*"))


def test_bad_recipes_and_names(tmp_path):
    with pytest.raises(ConfigError, match="unknown recipe key 'z_filtr'.*Did you mean 'z_filter'"):
        load_recipe({"task": "demo", "z_filtr": {}})
    with pytest.raises(ConfigError, match="unknown key z_filter.topk.*Did you mean 'top_k'"):
        load_recipe({"task": "demo", "z_filter": {"topk": 3}})
    with pytest.raises(ConfigError, match="unknown config 'seqz'.*Did you mean 'seq_z'"):
        load_recipe({"task": "demo", "configs": ["seqz"]})
    with pytest.raises(ConfigError, match="unknown task"):
        load_recipe({"task": "demoo"})
    with pytest.raises(ConfigError, match="unknown source step 'fils'"):
        load_recipe({"task": "demo", "new_rows": [{"step": "fils"}]})


def test_an_empty_result_writes_nothing(tmp_path):
    from debiased_nli.utils.errors import EmptyResultError

    data = tmp_path / "unlabelled.jsonl"
    data.write_text('{"premise": "A.", "hypothesis": "B.", "label": -1}\n' * 5)
    out = tmp_path / "empty"
    with pytest.raises(EmptyResultError, match="no usable rows"):
        build({"task": "snli", "data": {"on_invalid": "set_aside"}}, out, data_files=[f"train={data}"],
              progress=False)
    with pytest.raises(ConfigError, match="default config 'nope' is not among"):
        build({"task": "demo", "default_config": "nope"}, out, progress=False, max_rows=300)
    assert list(tmp_path.iterdir()) == [data]


def test_refuses_to_overwrite_and_replaces_atomically(tmp_path):
    out = tmp_path / "r"
    build(ROOT / "builders/demo.yaml", out, progress=False, max_rows=600)
    with pytest.raises(ConfigError, match="already exists"):
        build(ROOT / "builders/demo.yaml", out, progress=False, max_rows=600)
    (out / "marker").write_text("old")
    with pytest.raises(ConfigError, match="not part of the release.*marker"):  # the user's file is never deleted
        build(ROOT / "builders/demo.yaml", out, progress=False, max_rows=600, overwrite=True)
    (out / "marker").unlink()
    build(ROOT / "builders/demo.yaml", out, progress=False, max_rows=600, overwrite=True)
    assert (out / "README.md").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["r"]


def test_interrupted_write_leaves_no_half_release(tmp_path, monkeypatch):
    import debiased_nli.release.layout as release

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(release, "render_card", boom)
    with pytest.raises(KeyboardInterrupt):
        build(ROOT / "builders/demo.yaml", tmp_path / "x", progress=False, max_rows=600)
    assert list(tmp_path.iterdir()) == []


def test_a_filter_step_adds_its_config_and_card_section(tmp_path, tiny_encoder):
    recipe = {"task": "demo", "z_filter": {"top_k": 20, "batch_size": 100},
              "filters": [{"step": "aflite", "encoder": str(tiny_encoder), "m": 8, "max_iter": 20,
                           "audit": False, "random_control": False, "progress": False}]}
    res = build(recipe, tmp_path / "rel", progress=False, max_rows=600)
    assert set(res.configs) == {"z_filtered", "aflite"}
    kept = datasets.load_dataset(str(tmp_path / "rel"), "aflite", split="train")
    removed = datasets.Dataset.from_parquet(str(next((tmp_path / "rel/rejected/aflite").glob("*.parquet"))))
    assert len(kept) + len(removed) == 600 and len(removed) > 0
    assert {"aflite_score", "aflite_round"} <= set(removed.column_names)
    assert min(s for s in removed["aflite_score"] if s is not None) >= 0.75
    card = (tmp_path / "rel/README.md").read_text()
    assert "### `aflite`: how the filter was run" in card


def test_profiles_add_the_papers_generation_steps():
    plain = load_recipe(ROOT / "builders/snli.yaml")
    assert plain["new_rows"] == [] and plain["z_filter"]["top_k"] == 20
    paper = load_recipe(ROOT / "builders/snli.yaml", profile="paper")
    step = paper["new_rows"][0]
    assert step["step"] == "generator" and paper["profile"] == "paper"
    assert step["train"]["model"] == "gpt2-large" and step["train"]["lam"] == 0.5
    assert step["debias"]["alpha"] == 1.0 and step["confidence"]["tau"] == 0.95
    assert step["generate"]["num_samples"] == 5_000_000
    assert load_recipe(ROOT / "builders/mnli.yaml", profile="paper")["new_rows"][0]["generate"]["num_samples"] == 4_000_000
    with pytest.raises(ConfigError, match="no profile 'papr'.*Did you mean 'paper'"):
        load_recipe(ROOT / "builders/snli.yaml", profile="papr")


def test_the_recipes_min_z_reaches_the_walk(tmp_path):
    """``z_filter.min_z`` (a feature is biased only if also z > min_z) is the walk's, not only the manifest's: with
    a guard no z passes, no feature is biased and Z(D0) keeps every row."""
    res = build({"task": "demo", "z_filter": {"min_z": 1.0e9}, "configs": ["original", "z_filtered"]},
                tmp_path / "guarded", progress=False)
    assert res.configs["z_filtered"] == res.configs["original"]
    assert res.manifest["recipe"]["z_filter"]["min_z"] == 1.0e9
