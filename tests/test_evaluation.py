"""Scoring, breakdowns, reports and the model-index push (at the HTTP boundary)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from debiased_nli.models.challenge import get_set, load_challenge_set
from debiased_nli.cli import main
from debiased_nli.utils.errors import ConfigError
from debiased_nli.models.evaluation import (SCHEMA, load_results, push_results, score_predictions, set_predictions)

from test_training import make_tiny_bert

NLI = {0: "entailment", 1: "neutral", 2: "contradiction"}


def _hans_root(tmp_path: Path) -> Path:
    """A hand-made HANS file: 8 rows over 2 heuristics and 3 subcases."""
    rows = [  # heuristic, subcase, gold (0 entailment, 1 non-entailment)
        ("lexical_overlap", "ln_passive", 1), ("lexical_overlap", "ln_passive", 1),
        ("lexical_overlap", "le_relative_clause", 0), ("lexical_overlap", "le_relative_clause", 0),
        ("subsequence", "sn_NP/S", 1), ("subsequence", "sn_NP/S", 1),
        ("subsequence", "sn_NP/S", 1), ("subsequence", "se_PP_on_obj", 0)]
    df = pd.DataFrame({"id": [f"ex{i}" for i in range(8)], "premise": [f"the doctor saw the actor {i} ." for i in range(8)],
                       "hypothesis": ["the actor saw the doctor ."] * 8, "label": [r[2] for r in rows],
                       "heuristic": [r[0] for r in rows], "subcase": [r[1] for r in rows], "template": "t"})
    (tmp_path / "hans").mkdir(parents=True)
    df.to_parquet(tmp_path / "hans" / "evaluation_regenerated.parquet")
    return tmp_path


def test_hans_breakdowns_on_a_hand_made_prediction_file_are_exact(tmp_path):
    root = _hans_root(tmp_path)
    spec = get_set("hans")
    ds = load_challenge_set(spec, root)
    # the model's 3-way probabilities (entailment, neutral, contradiction), one row per example
    probs = np.array([[.1, .2, .7],   # -> non-entailment, gold non-entailment: right
                      [.8, .1, .1],   # -> entailment, wrong
                      [.6, .3, .1],   # -> entailment, right
                      [.3, .5, .2],   # -> non-entailment (neutral), wrong
                      [.2, .7, .1],   # -> non-entailment (neutral), right
                      [.4, .3, .3],   # -> entailment: the argmax is taken over 3 labels, not e vs n+c; wrong
                      [.1, .1, .8],   # right
                      [.9, .05, .05]])  # -> entailment, right
    pred, label_map = set_predictions(spec, probs, NLI)
    assert pred.tolist() == [1, 0, 0, 1, 1, 0, 1, 0]
    assert label_map["task_label_to_set_label"] == {"entailment": "entailment", "neutral": "non-entailment",
                                                    "contradiction": "non-entailment"}
    out = score_predictions(spec, ds, pred)
    assert out["accuracy"] == 5 / 8 and out["n"] == 8
    b = out["breakdowns"]
    assert {k: v["accuracy"] for k, v in b["heuristic"].items()} == {"lexical_overlap": 2 / 4, "subsequence": 3 / 4}
    assert {k: (v["correct"], v["n"]) for k, v in b["subcase"].items()} == {
        "le_relative_clause": (1, 2), "ln_passive": (1, 2), "se_PP_on_obj": (1, 1), "sn_NP/S": (2, 3)}
    assert {k: (v["correct"], v["n"]) for k, v in b["heuristic/label"].items()} == {
        "lexical_overlap/entailment": (1, 2), "lexical_overlap/non-entailment": (1, 2),
        "subsequence/entailment": (1, 1), "subsequence/non-entailment": (2, 3)}
    assert b["subcase/label"]["sn_NP/S/non-entailment"]["accuracy"] == 2 / 3


def test_a_model_in_another_label_order_is_mapped_by_name():
    spec = get_set("snli_dev")
    permuted = {0: "contradiction", 1: "entailment", 2: "neutral"}
    probs = np.array([[.7, .2, .1], [.1, .8, .1], [.1, .1, .8]])  # model order
    pred, label_map = set_predictions(spec, probs, permuted)
    assert pred.tolist() == [2, 0, 1]  # contradiction, entailment, neutral in the task's order
    assert label_map["model_output_to_task_label"] == {1: "entailment", 2: "neutral", 0: "contradiction"}
    # generic names are taken to be in the task's order
    assert set_predictions(spec, probs, {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"})[0].tolist() == [0, 1, 2]


def test_a_model_with_other_label_names_is_refused():
    with pytest.raises(ConfigError, match="no output named 'entailment'"):
        set_predictions(get_set("hans"), np.full((2, 3), 1 / 3), {0: "yes", 1: "maybe", 2: "no"}, "m")
    with pytest.raises(ConfigError, match="has 2 labels"):
        set_predictions(get_set("snli_dev"), np.full((2, 2), .5), {0: "entailment", 1: "neutral"}, "m")


def test_fever_symmetric_scores_two_way_with_a_three_way_model():
    spec = get_set("fever_symmetric_v02_dev")
    fever = {0: "SUPPORTS", 1: "REFUTES", 2: "NOT ENOUGH INFO"}
    probs = np.array([[.3, .2, .5], [.1, .3, .6]])  # NEI is the argmax but is not a label of the set
    assert set_predictions(spec, probs, fever)[0].tolist() == [0, 1]


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory, shared_data):
    """Two tiny BERTs (seeds 1 and 2) trained for one epoch on 300 SNLI rows with `debiased-nli train`."""
    base = tmp_path_factory.mktemp("roundtrip")
    texts = []
    for f in ["snli/train_sample.parquet", "snli/dev.parquet", "hans/evaluation_regenerated.parquet"]:
        df = pd.read_parquet(shared_data / f).head(1500)
        texts += list(df.premise) + list(df.hypothesis)
    enc = make_tiny_bert(base / "encoder", texts)
    runs = []
    for seed in (1, 2):
        out = base / f"run-s{seed}"
        rc = main(["train", "snli", "--data-files", f"train={shared_data / 'snli' / 'train_sample.parquet'}",
                   f"validation={shared_data / 'snli' / 'dev.parquet'}", "--max-train-rows", "300",
                   "--max-dev-rows", "64", "--model", str(enc), "--out", str(out), "--epochs", "1",
                   "--max-length", "48", "--lr", "1e-3", "--seed", str(seed), "--cpu"])
        assert rc == 0
        runs.append(out)
    return base, runs


def test_train_then_evaluate_writes_a_well_formed_report(trained_pair, shared_data):
    base, runs = trained_pair
    out = base / "eval"
    rc = main(["evaluate", "--model", *map(str, runs), "--sets", "snli_dev", "hans", "dasgupta_comparisons",
               "--max-examples", "60", "--out", str(out), "--data-root", str(shared_data), "--name", "tiny"])
    assert rc == 0
    results = load_results(out / "results.json")
    assert results["schema"] == SCHEMA and results["seeds"] == [1, 2] and results["num_models"] == 2
    assert results["versions"]["transformers"] and "git" in results
    hans = results["sets"]["hans"]
    assert hans["n"] == 60 and hans["n_total"] == 30000 and hans["subsampled"]
    assert len(hans["runs"]) == 2 and hans["accuracy"] == pytest.approx(np.mean([r["accuracy"] for r in hans["runs"]]))
    assert hans["accuracy_std"] == pytest.approx(np.std([r["accuracy"] for r in hans["runs"]], ddof=1))
    assert set(hans["breakdowns"]) == {"heuristic", "subcase", "heuristic/label", "subcase/label"}
    assert sum(g["n"] for g in hans["breakdowns"]["heuristic"].values()) == 60
    assert results["models"][0]["train"]["train_rows"] == 300
    report = (out / "report.md").read_text()
    assert "| set | n | of | tiny |" in report and "**Subsampled:** at most 60 rows" in report
    assert results["config"]["dtype"] == "float32" and "**Precision:**" not in report
    mean, std = 100 * hans["accuracy"], 100 * hans["accuracy_std"]
    assert f"| hans | 60 | 30000 | {mean:.1f} ± {std:.1f} |" in report
    assert "### hans: by heuristic" in report
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second report compares against the first results file: one more column
    rc = main(["evaluate", "--model", str(runs[0]), "--sets", "hans", "--max-examples", "60", "--out",
               str(base / "eval2"), "--data-root", str(shared_data), "--compare", f"both={out / 'results.json'}"])
    assert rc == 0
    report2 = (base / "eval2" / "report.md").read_text()
    assert "| set | n | of | eval2 | both |" in report2 and f"{mean:.1f} ± {std:.1f}" in report2


def test_bfloat16_evaluation_stays_close_to_float32_and_the_report_says_so(trained_pair, shared_data):
    from debiased_nli.utils.errors import ConfigError
    from debiased_nli.models.classifier import load_classifier, predict_probabilities

    base, runs = trained_pair
    df = pd.read_parquet(shared_data / "snli" / "dev.parquet").head(200)
    clf = load_classifier(str(runs[0]), "cpu")
    f32 = predict_probabilities(clf, list(df.premise), list(df.hypothesis), max_length=48, progress=False)
    bf16 = predict_probabilities(clf, list(df.premise), list(df.hypothesis), max_length=48, progress=False,
                                 dtype="bfloat16")
    assert bf16.dtype == np.float32 and np.allclose(bf16.sum(1), 1, atol=1e-5)
    diff = np.abs(bf16 - f32).max()
    assert 0 < diff < 0.05  # bfloat16 really ran (the probabilities moved) and stayed close
    margin = np.sort(f32, 1)[:, -1] - np.sort(f32, 1)[:, -2]
    assert (bf16.argmax(1) == f32.argmax(1))[margin > 2 * diff].all()  # only near-ties may flip
    with pytest.raises(ConfigError, match="unknown evaluation dtype 'float16'"):
        predict_probabilities(clf, ["a"], ["b"], dtype="float16", progress=False)
    out = base / "eval-bf16"
    assert main(["evaluate", "--model", str(runs[0]), "--sets", "snli_dev", "--max-examples", "40", "--out", str(out),
                 "--data-root", str(shared_data), "--dtype", "bfloat16"]) == 0
    assert load_results(out / "results.json")["config"]["dtype"] == "bfloat16"
    assert "**Precision:** the forward passes ran in bfloat16" in (out / "report.md").read_text()


def test_evaluate_refuses_unknown_suites_and_missing_files(trained_pair, tmp_path, capsys):
    _, runs = trained_pair
    assert main(["evaluate", "--model", str(runs[0]), "--suite", "nlii", "--out", str(tmp_path)]) == 2
    assert "Did you mean 'nli'" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(runs[0]), "--sets", "hans", "--out", str(tmp_path / "o"),
                 "--data-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "hans" / "evaluation_regenerated.parquet") in err and "tommccoy1/hans" in err


# ------------------------------------------------------------------------------ the Hub push

class FakeHub:
    """Answers huggingface_hub's HTTP calls and records them (the Hub is never reached)."""

    def __init__(self, existing_card: str | None):
        self.card = existing_card
        self.requests = []
        self.commits = []

    def __call__(self, request):
        import httpx2 as httpx

        self.requests.append((request.method, request.url.path))
        path = request.url.path
        if "/resolve/" in path and path.endswith("README.md"):
            if self.card is None:
                return httpx.Response(404, headers={"X-Error-Code": "EntryNotFound"}, request=request)
            body = self.card.encode()
            return httpx.Response(200, content=body if request.method == "GET" else b"", request=request,
                                  headers={"ETag": '"abc"', "X-Repo-Commit": "0" * 40,
                                           "Content-Length": str(len(body))})
        if "/preupload/" in path:
            files = json.loads(request.content)["files"]
            return httpx.Response(200, json={"files": [{"path": f["path"], "uploadMode": "regular",
                                                        "shouldIgnore": False} for f in files]}, request=request)
        if "/commit/" in path:
            lines = [json.loads(l) for l in request.content.decode().splitlines() if l.strip()]
            self.commits.append(lines)
            return httpx.Response(200, json={"commitUrl": "https://huggingface.co/org/m/commit/1", "commitOid": "1" * 40},
                                  request=request)
        if path.startswith("/api/validate-yaml"):
            return httpx.Response(200, json={}, request=request)
        return httpx.Response(200, json={}, request=request)

    def pushed_card(self) -> tuple[dict, str]:
        [commit] = self.commits
        [file] = [l for l in commit if l.get("key") == "file"]
        assert file["value"]["path"] == "README.md"
        text = base64.b64decode(file["value"]["content"]).decode()
        _, meta, body = text.split("---", 2)
        return yaml.safe_load(meta), body


@pytest.fixture
def fake_hub(monkeypatch):
    import httpx2 as httpx
    from huggingface_hub import constants, set_client_factory
    from huggingface_hub.utils import _http

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hubs = []

    def install(card):
        hub = FakeHub(card)
        hubs.append(hub)
        set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(hub)))
        return hub

    yield install
    set_client_factory(_http.default_client_factory)


HUB = {"hans": {"path": "jhu-cogsci/hans", "name": None, "split": "validation"},
       "snli_test": {"path": "stanfordnlp/snli", "name": None, "split": "test"}}


def _results(accs: dict[str, float], n: int = 100, n_total: int = 100, runs: int = 3) -> dict:
    # hub_dataset: what challenge_source() records for a set read from the Hub (None: no Hub dataset)
    return {"schema": SCHEMA, "num_models": runs, "config": {"sample_seed": 7}, "sets": {
        s: {"accuracy": a, "accuracy_std": 0.01, "n": n, "n_total": n_total, "subsampled": n < n_total,
            "sample_seed": 7 if n < n_total else None, "task": "snli", "hub_dataset": HUB.get(s),
            "runs": [{"seed": i + 1} for i in range(runs)]} for s, a in accs.items()}}


def _index(meta) -> dict:
    from huggingface_hub import ModelCardData

    results = ModelCardData(**meta).eval_results  # huggingface_hub's own model-index parser reads it back
    return {(r.dataset_name, r.metric_type): r for r in results}


def test_push_writes_the_model_index_of_a_new_card_with_real_hub_ids_only(fake_hub):
    hub = fake_hub(None)
    _, left_out = push_results("org/minilm-snli", _results({"hans": 0.52, "snli_test_hard": 0.61}), token="hf_test")
    meta, _ = hub.pushed_card()
    assert meta["model-index"][0]["name"] == "minilm-snli"
    got = _index(meta)
    # three seeds: the mean and the standard deviation, each a metric of the same Hub dataset
    assert set(got) == {("hans", "accuracy"), ("hans", "accuracy_std")}
    assert got["hans", "accuracy"].dataset_type == "jhu-cogsci/hans" and got["hans", "accuracy"].metric_value == 0.52
    assert got["hans", "accuracy"].metric_args == {"num_models": 3, "seeds": [1, 2, 3]}
    assert got["hans", "accuracy_std"].metric_value == 0.01
    # SNLI-hard has no Hub dataset: left out, never published under an invented id
    assert left_out == ["snli_test_hard"] and "debiased-nli/" not in json.dumps(meta)
    assert ("POST", "/api/models/org/minilm-snli/commit/main") in hub.requests


def test_a_sample_score_is_published_as_a_sample(fake_hub):
    hub = fake_hub(None)
    push_results("org/m", _results({"snli_test": 0.6}, n=1000, n_total=9824, runs=1))
    meta, _ = hub.pushed_card()
    [(key, result)] = _index(meta).items()
    assert key == ("snli_test (random sample of 1,000 of 9,824 rows, seed 7)", "accuracy")
    assert result.dataset_type == "stanfordnlp/snli" and result.dataset_split == "test"
    assert result.dataset_args == {"rows_scored": 1000, "rows_in_split": 9824, "sample": "seeded random sample",
                                   "sample_seed": 7}
    assert result.metric_name == "Accuracy" and result.metric_args is None


def test_nothing_to_publish_under_a_hub_id_is_refused(fake_hub):
    fake_hub(None)
    with pytest.raises(ConfigError, match="nothing to put in the model-index"):
        push_results("org/m", _results({"snli_test_hard": 0.6, "dasgupta_compositional": 0.4}))


def test_only_rows_that_are_a_hub_datasets_get_its_id(shared_data):
    from debiased_nli.models.challenge import challenge_source

    # a local file marked as an exact copy of the Hub split, a regenerated stand-in, a set with no Hub id
    assert challenge_source("snli_test", shared_data)["hub_dataset"] == {"path": "stanfordnlp/snli", "name": None,
                                                                       "split": "test"}
    assert challenge_source("hans", shared_data)["kind"] == "local"
    assert challenge_source("hans", shared_data)["hub_dataset"] is None
    assert challenge_source("snli_test_hard", shared_data)["hub_dataset"] is None


def test_push_replaces_the_same_sets_and_keeps_the_rest_of_an_existing_card(fake_hub):
    existing = ("---\nlicense: apache-2.0\nmodel-index:\n- name: m\n  results:\n"
                "  - task: {type: text-classification}\n    dataset: {name: hans, type: jhu-cogsci/hans}\n"
                "    metrics: [{type: accuracy, value: 0.4}]\n"
                "  - task: {type: text-classification}\n    dataset: {name: glue-mrpc, type: glue}\n"
                "    metrics: [{type: f1, value: 0.9}]\n---\n# My model\n\nHand-written text.\n")
    hub = fake_hub(existing)
    push_results("org/m", _results({"hans": 0.55}))
    meta, body = hub.pushed_card()
    assert meta["license"] == "apache-2.0" and "Hand-written text." in body
    values = {k: r.metric_value for k, r in _index(meta).items()}
    assert values == {("hans", "accuracy"): 0.55, ("hans", "accuracy_std"): 0.01, ("glue-mrpc", "f1"): 0.9}


def test_a_missing_model_folder_is_named(tmp_path, capsys):
    assert main(["evaluate", "--model", str(tmp_path / "runs" / "nothing"), "--sets", "paws_qqp",
                 "--out", str(tmp_path / "o")]) == 2
    assert f"--model {tmp_path / 'runs' / 'nothing'}: no such folder" in capsys.readouterr().err


def test_bfloat16_on_a_cpu_without_native_bfloat16_warns_once(monkeypatch, caplog):
    import logging

    from debiased_nli.utils import precision

    monkeypatch.setattr(precision, "_warned", set())
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"sse4_2", "avx", "avx2", "fma"}))
    assert precision.native_bfloat16_cpu() is False
    with caplog.at_level(logging.WARNING, logger="debiased_nli.utils.precision"):
        precision.compute_context("cpu", "bfloat16")
        precision.compute_context("cpu", "bfloat16")
        precision.compute_context("cpu", "float32")
    warnings = [r for r in caplog.records if "without native bfloat16" in r.getMessage()]
    assert len(warnings) == 1 and "avx512_bf16/amx_bf16" in warnings[0].getMessage()

    caplog.clear()
    monkeypatch.setattr(precision, "_warned", set())
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx", "avx2", "avx512f", "avx512_bf16"}))
    assert precision.native_bfloat16_cpu() is True
    with caplog.at_level(logging.WARNING, logger="debiased_nli.utils.precision"):
        precision.compute_context("cpu", "bfloat16")
        precision.compute_context("cuda:0", "bfloat16")
    assert not [r for r in caplog.records if "without native bfloat16" in r.getMessage()]
    # flags that are not an x86 CPU's (or none readable): unknown, no warning
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"fp", "asimd"}))
    assert precision.native_bfloat16_cpu() is None
    monkeypatch.setattr(precision, "cpu_flags", lambda: None)
    assert precision.native_bfloat16_cpu() is None
