"""The model side of the Hub at the HTTP boundary: `train` writes a model card and pushes the model, `evaluate`
pushes every scored set into the card's model-index and `.eval_results/`, and huggingface_hub and transformers read
it all back from the test Hub server (tests/fake_hub.py), as a user would from huggingface.co."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from debiased_nli.cli import main
from debiased_nli.utils.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from fake_hub import FakeHub  # noqa: E402
from test_training import make_tiny_bert  # noqa: E402

TOKEN = "hf_TESTmodelTOKENneverPRINTED"


@pytest.fixture
def hub(monkeypatch, tmp_path_factory):
    with FakeHub() as server:  # huggingface_hub's readers (ModelCard.load, model_info, from_pretrained) go there
        yield server.be_the_hub(monkeypatch, tmp_path_factory.mktemp("hf-cache"), TOKEN)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_data):
    """A tiny BERT trained by `debiased-nli train` on 200 SNLI rows (early stopping on 60 dev rows)."""
    base = tmp_path_factory.mktemp("model")
    train = pd.read_parquet(shared_data / "snli" / "train_sample.parquet").head(400)
    texts = [t for f in ("snli/dev.parquet", "snli/test.parquet", "snli/test_hard.parquet",
                         "hans/evaluation_regenerated.parquet") for df in [pd.read_parquet(shared_data / f).head(300)]
             for t in list(df.premise) + list(df.hypothesis)] + list(train.premise) + list(train.hypothesis)
    encoder = make_tiny_bert(base / "encoder", texts)
    out = base / "run"
    rc = main(["train", "snli", "--data-files", f"train={shared_data / 'snli' / 'train_sample.parquet'}",
               f"validation={shared_data / 'snli' / 'dev.parquet'}", "--max-train-rows", "200", "--max-dev-rows", "60",
               "--model", str(encoder), "--out", str(out), "--epochs", "1", "--batch-size", "32", "--seed", "3",
               "--quiet"])
    assert rc == 0
    return out


def test_train_writes_a_model_card_with_its_data_values_and_dev_accuracy(trained):
    from huggingface_hub import ModelCard

    card = ModelCard.load(trained / "README.md")
    record = json.loads((trained / "debiased_nli_train.json").read_text())
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    assert card.data.base_model is None  # a local folder is no Hub model: named in the text instead
    assert "the local model folder `encoder`" in card.text
    # the training data: the file with its sha256 and the rows' content fingerprint
    train_src = record["data"]["train"]
    assert train_src["type"] == "files" and train_src["files"][0]["file"] == "train_sample.parquet"
    assert f"`train_sample.parquet` (sha256 `{train_src['files'][0]['sha256'][:12]}`)" in card.text
    assert f"`{record['train_fingerprint']}`" in card.text and f"`{record['dev_fingerprint']}`" in card.text
    # every hyper-parameter, with its source
    assert "| `epochs` | `1.0` | given |" in card.text
    assert '| `learning_rate` | `1e-05` | Wu et al. 2022, Table 9: "learning rate 1e-5" |' in card.text
    assert "| `seed` | `3` | given |" in card.text
    assert f"**{record['result']['dev_accuracy']:.4f}**" in card.text
    assert record["sources"]["epochs"] == "given"


def test_a_release_trained_on_is_named_with_its_version_and_the_datasets_link(tmp_path):
    from debiased_nli.models.card import card_metadata, data_text, hub_datasets

    hub_release = {"type": "hub_release", "repo_id": "org/debiased-snli", "config": "z_filtered", "split": "train",
                   "revision": "v1.1"}
    assert data_text(hub_release) == ("config `z_filtered` of the Hub dataset `org/debiased-snli` at revision `v1.1`, "
                                      "split `train`")
    local = {"type": "release", "release": "rel", "config": "seq_z", "split": "train", "repo_id": "org/d",
             "version": "v1.0", "manifest_sha256": "ab" * 32}
    assert data_text(local) == "config `seq_z` of the local release `rel`, built for `org/d`, release version " \
                               "`v1.0`, split `train` (manifest.json sha256 `abababababab`)"
    assert hub_datasets({"data": {"train": local}}) == []  # a local folder's rows may not be the repo's
    record = {"config": {"model": "bert-base-uncased"}, "task": "snli", "data": {"train": hub_release}}
    meta = card_metadata(record)
    assert hub_datasets(record) == ["org/debiased-snli"]
    assert meta.base_model == "bert-base-uncased" and meta.datasets == ["org/debiased-snli"]


def test_train_push_evaluate_push_and_read_everything_back(trained, hub, shared_data, tmp_path, capsys):
    """train -> push -> evaluate -> push, then read back with huggingface_hub (ModelCard.load, model_info's
    eval_results) and transformers (from_pretrained from the Hub)."""
    from huggingface_hub import HfApi, ModelCard
    from transformers import AutoModelForSequenceClassification

    from debiased_nli.models.hub import push_model

    out = push_model(trained, "org/tiny-snli", revision="v1.0")
    assert set(out["files"]) >= {"README.md", "config.json", "model.safetensors", "debiased_nli_train.json",
                                 "tokenizer.json"}
    _, files = hub.snapshot("org/tiny-snli", "v1.0", kind="model")
    assert set(files) == set(out["files"])  # one commit: the weights, the card, the record; no pickle, no resume file
    assert "training_args.bin" not in files and "debiased_nli_run.json" not in files
    assert str(trained) not in files["debiased_nli_train.json"].decode()  # local paths reduced to file names
    commits = [r for r in hub.requests if r["path"].startswith("/api/models/org/tiny-snli/commit/")]
    assert len(commits) == 1
    card = ModelCard.load("org/tiny-snli")
    assert 'model="org/tiny-snli"' in card.text and "<org>/" not in card.text
    model = AutoModelForSequenceClassification.from_pretrained("org/tiny-snli", revision="v1.0")
    assert model.config.id2label == {0: "entailment", 1: "neutral", 2: "contradiction"}
    with pytest.raises(ConfigError, match="already has the tag 'v1.0'"):
        push_model(trained, "org/tiny-snli", revision="v1.0")

    # evaluate the pushed model on four kinds of sets, and push the results
    rc = main(["evaluate", "--model", str(trained), "--sets", "snli_test", "hans", "snli_test_hard",
               "dasgupta_compositional", "--max-examples", "40", "--data-root", str(shared_data),
               "--out", str(tmp_path / "eval"), "--push-to", "org/tiny-snli", "--quiet"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "not in .eval_results/ (no Hub dataset to name): dasgupta_compositional" in printed.out
    results = json.loads((tmp_path / "eval" / "results.json").read_text())

    card = ModelCard.load("org/tiny-snli")
    assert 'model="org/tiny-snli"' in card.text  # the card train wrote, kept
    got = {r.dataset_name.split(" (")[0]: r for r in card.data.eval_results}
    assert set(got) == {"snli_test", "hans", "snli_test_hard", "dasgupta_compositional"}  # every scored set
    for s, r in got.items():
        assert r.metric_type == "accuracy" and r.metric_value == round(results["sets"][s]["accuracy"], 6)
        assert r.source_url.endswith("/org/tiny-snli/blob/main/evaluation/results.json")
    # rows that are a Hub split's: its id and split; a sample says so
    assert (got["snli_test"].dataset_type, got["snli_test"].dataset_split) == ("stanfordnlp/snli", "test")
    assert got["snli_test"].dataset_args["rows_scored"] == 40
    # a stand-in and a subset: the Hub dataset they relate to, no split, the file and its sha256
    hans_sha = results["sets"]["hans"]["hub_reference"]["file_sha256"]
    assert got["hans"].dataset_type == "jhu-cogsci/hans" and got["hans"].dataset_split is None
    assert got["hans"].dataset_args["file_sha256"] == hans_sha and "local stand-in" in got["hans"].dataset_name
    assert got["snli_test_hard"].dataset_type == "stanfordnlp/snli" and got["snli_test_hard"].dataset_split is None
    assert "subset of stanfordnlp/snli[test]" in got["snli_test_hard"].dataset_name
    # no Hub dataset at all: its own name, and the file as the source
    assert got["dasgupta_compositional"].dataset_type == "dasgupta_compositional"
    assert "master_true.parquet (sha256" in got["dasgupta_compositional"].source_name
    assert "| `hans` |" in card.text and "standing in for `jhu-cogsci/hans[validation]`" in card.text

    # the newer format: what the Hub's API serves from .eval_results/ (each file checked as the Hub checks it)
    info = HfApi().model_info("org/tiny-snli", expand=["evalResults"])
    entries = {e.task_id: e for e in info.eval_results}
    assert set(entries) == {"test", "hans", "snli_test_hard"}
    assert entries["test"].dataset_id == "stanfordnlp/snli"
    assert entries["test"].value == round(results["sets"]["snli_test"]["accuracy"], 6)
    assert "seeded random sample of 40" in entries["test"].notes
    assert entries["hans"].dataset_id == "jhu-cogsci/hans" and hans_sha in entries["hans"].notes
    assert entries["hans"].source_url.endswith("evaluation/results.json") and entries["hans"].date == results["created"]
    _, files = hub.snapshot("org/tiny-snli", None, kind="model")
    assert {".eval_results/snli_test.yaml", ".eval_results/hans.yaml", ".eval_results/snli_test_hard.yaml",
            "evaluation/results.json", "evaluation/report.md", "model.safetensors"} <= set(files)
    assert yaml.safe_load(files[".eval_results/hans.yaml"])[0]["dataset"] == {"id": "jhu-cogsci/hans",
                                                                              "task_id": "hans"}
    assert str(shared_data) not in files["evaluation/results.json"].decode()
    for r in hub.requests:  # the token only in the Authorization header
        assert TOKEN.encode() not in r["body"]
    assert TOKEN not in printed.out + printed.err

    # a push of new weights removes the evaluation of the earlier ones, in its commit
    push_model(trained, "org/tiny-snli", revision="v1.1")
    _, files = hub.snapshot("org/tiny-snli", "v1.1", kind="model")
    assert not [f for f in files if f.startswith((".eval_results/", "evaluation/"))]


def test_evaluate_creates_the_repo_and_keeps_another_cards_text(hub):
    """evaluate --push-to on a repo that does not exist creates it; on a card written by hand, the text and other
    results stay and only the same sets' results are replaced."""
    from huggingface_hub import HfApi, ModelCard

    from debiased_nli.evaluation.scores import SCHEMA
    from debiased_nli.models.hub import push_results

    def results(acc):
        return {"schema": SCHEMA, "created": "2026-01-01T00:00:00+00:00", "config": {"sample_seed": 0},
                "sets": {"snli_test": {"accuracy": acc, "accuracy_std": 0.02, "n": 9824, "n_total": 9824,
                                       "task": "snli", "hub_reference": {"relation": "exact",
                                                                         "path": "stanfordnlp/snli", "name": None,
                                                                         "split": "test"},
                                       "runs": [{"seed": 1}, {"seed": 2}, {"seed": 3}]}}}

    pushed = push_results("org/new", results(0.8))
    assert ("POST", "/api/repos/create") in {(r["method"], r["path"]) for r in hub.requests}
    assert pushed["not_in_eval_results"] == []
    card = ModelCard.load("org/new")
    values = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert values == {("snli_test", "accuracy"): 0.8, ("snli_test", "accuracy_std"): 0.02}

    api = HfApi()
    text = ("---\nlicense: apache-2.0\nmodel-index:\n- name: m\n  results:\n"
            "  - task: {type: text-classification}\n    dataset: {name: glue-mrpc, type: nyu-mll/glue}\n"
            "    metrics: [{type: f1, value: 0.9}]\n---\n# My model\n\nHand-written text.\n")
    api.upload_file(path_or_fileobj=text.encode(), path_in_repo="README.md", repo_id="org/new")
    push_results("org/new", results(0.85))
    card = ModelCard.load("org/new")
    assert card.data.license == "apache-2.0" and "Hand-written text." in card.text
    assert "## Evaluation results" in card.text and "| `snli_test` |" in card.text
    values = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert values == {("glue-mrpc", "f1"): 0.9, ("snli_test", "accuracy"): 0.85, ("snli_test", "accuracy_std"): 0.02}
    [entry] = HfApi().model_info("org/new", expand=["evalResults"]).eval_results
    assert entry.value == 0.85 and "mean over 3 seeds (1, 2, 3)" in entry.notes


def test_push_model_refuses_a_folder_without_a_model_or_with_changed_files(trained, tmp_path, hub):
    import shutil

    from debiased_nli.models.hub import push_model

    with pytest.raises(ConfigError, match="is not a training folder"):
        push_model(tmp_path, "org/x")
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("entailment", "ENTAILMENT"))
    with pytest.raises(ConfigError, match="changed since debiased-nli wrote them: config.json"):
        push_model(copy, "org/x")
    assert not hub.models  # refused before any request


def test_train_refuses_a_bad_push_target_before_any_work(tmp_path, capsys):
    """`train --push-to` is checked with the other options: a wrong repo id or tag stops the command in one line
    before any data is read or any model loaded (the --model folder does not even exist)."""
    base = ["train", "snli", "--data-files", str(tmp_path / "none.parquet"), "--model", str(tmp_path / "m"),
            "--out", str(tmp_path / "out")]
    assert main(base + ["--push-to", "no-slash"]) == 2
    assert "error: --push-to must look like ORG/NAME" in capsys.readouterr().err
    assert main(base + ["--push-to", "org/m", "--push-revision", "latest version"]) == 2
    assert "error: --push-revision 'latest version' is not a version tag" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
