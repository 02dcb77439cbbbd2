"""The `pdd` recipe step (a `pdd` config and its card section) and `debiased-nli pdd`, with tiny model folders."""
import json

import pytest

from debiased_nli.data.tasks import get_task
from debiased_nli.cli import main
from debiased_nli.data.loading import load_task
from debiased_nli.utils.errors import ConfigError
from debiased_nli.bias.features import extract_table
from debiased_nli.methods.pdd.step import pdd_step
from debiased_nli.release.recipe import build, load_recipe
from pdd_helpers import tiny_classifier, tiny_mlm, tiny_tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny BertForMaskedLM and a tiny NLI classifier (random weights) with a WordLevel tokenizer over the demo."""
    ds = load_task("demo").dataset
    tok = tiny_tokenizer(list(ds["premise"]) + list(ds["hypothesis"]))
    root = tmp_path_factory.mktemp("pdd-models")
    tiny_mlm(tok).save_pretrained(root / "mlm")
    tok.save_pretrained(root / "mlm")
    tiny_classifier(tok).save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    return str(root / "mlm"), str(root / "teacher")


def test_unigram_pair_features_are_the_words_of_both_sides_once():
    import pyarrow as pa
    t = pa.table({"premise": ["A man, a plan."], "hypothesis": ["The man's plan"]})
    feats = extract_table(t, ["unigram_pair_v1"], ["e", "n", "c"]).column("feat_unigram_pair_v1").to_pylist()[0]
    assert sorted(feats) == ["a@pair", "man's@pair", "man@pair", "plan@pair", "the@pair"]


def recipe(models, **pdd):
    mlm, teacher = models
    return {"name": "pdd-demo", "task": "demo", "seed": 0, "configs": ["pdd"],
            "filters": [{"step": "pdd", "config": "pdd", "mlm": mlm, "teacher": teacher, "tau": 5.0,
                         "families": ["unigram", "overlap"], "candidates": 3, "progress": False, **pdd}]}


def test_the_pdd_config_builds_with_its_card(models, tmp_path):
    import datasets
    res = build(recipe(models), tmp_path / "rel", max_rows=450, progress=False)
    kept = datasets.load_dataset(str(tmp_path / "rel"), "pdd", split="train")
    assert res.configs["pdd"] == len(kept)
    report = next(s["report"] for s in res.manifest["stages"] if s["stage"] == "pdd: pdd")
    rows = report["rows"]
    assert rows["output"] == 450 + report["operations"]["keep"]
    assert set(kept["origin"]) <= {"original", "perturbed"} and "source_uid" in kept.column_names
    new = kept.filter(lambda o: o == "perturbed", input_columns="origin")
    assert len(new) == rows["perturbed_rows_in_output"] and all(s for s in new["source_uid"])
    card = (tmp_path / "rel" / "README.md").read_text()
    assert "PDD (Guo et al. 2023)" in card and "z before and after, per family" in card
    rejected = list((tmp_path / "rel" / "rejected" / "pdd").glob("*.parquet"))
    if report["operations"]["lose"]:
        rej = datasets.load_dataset("parquet", data_files=[str(p) for p in rejected], split="train")
        assert len(rej) == report["operations"]["lose"] and set(rej["reason"]) == {"pdd: replaced"}
        assert all(u for u in rej["replaced_by"])


def test_unknown_parameters_and_a_missing_teacher_are_refused(models):
    ds = load_task("demo").dataset.select(range(50))
    with pytest.raises(ConfigError, match="unknown PDD parameter"):
        pdd_step(ds, get_task("demo"), {"teacher": models[1], "taus": 3})
    with pytest.raises(ConfigError, match="needs `teacher`"):
        pdd_step(ds, get_task("demo"), {"mlm": models[0]})


def test_the_recipes_pdd_profiles_load():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "builders"
    for name in ("snli", "mnli", "fever", "qqp"):
        r = load_recipe(root / f"{name}.yaml", profile="pdd")
        step = next(f for f in r["filters"] if f["step"] == "pdd")
        assert step["mlm"] == "xlm-roberta-large" and step["tau"] == 20
    fever = next(f for f in load_recipe(root / "fever.yaml", profile="pdd")["filters"] if f["step"] == "pdd")
    assert fever["label_groups"] == [["SUPPORTS"], ["REFUTES", "NOT ENOUGH INFO"]]
    qqp = next(f for f in load_recipe(root / "qqp.yaml", profile="pdd")["filters"] if f["step"] == "pdd")
    assert qqp["overlap_feature"] == "lex-overlap<0.8"


def test_cli_writes_data_log_report_and_plot(models, tmp_path, capsys):
    mlm, teacher = models
    out = tmp_path / "out"
    rc = main(["pdd", "demo", "--max-rows", "300", "--mlm", mlm, "--teacher", teacher, "--tau", "5",
               "--families", "hypo_only,unigram", "--candidates", "3", "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for f in ("debiased.parquet", "removed.parquet", "perturbations.parquet", "pdd.json", "pdd.md", "pdd_z.png"):
        assert (out / f).exists(), f
    report = json.loads((out / "pdd.json").read_text())
    assert summary["rows"] == report["rows"] and report["family_order"][0]["family"] == "hypo_only"
    import pyarrow.parquet as pq
    log = pq.read_table(out / "perturbations.parquet")
    assert log.num_rows == report["operations"]["attempted"]
    assert all("<mask>" in m for m in log.column("masked_prompt").to_pylist())
    # rerunning continues from the checkpoint and gives the same rows
    rc = main(["pdd", "demo", "--max-rows", "300", "--mlm", mlm, "--teacher", teacher, "--tau", "5",
               "--families", "hypo_only,unigram", "--candidates", "3", "--out", str(out), "--no-progress"])
    again = json.loads((out / "pdd.json").read_text())
    assert again["rows"] == report["rows"] and again["operations"]["computed"] == 0
