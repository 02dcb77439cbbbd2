"""Scoring, breakdowns, reports and the model-index entries of a results file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from debiased_nli.models.challenge import get_set, load_challenge_set
from debiased_nli.cli import main
from debiased_nli.utils.errors import ConfigError
from debiased_nli.evaluation.scores import SCHEMA, load_results, score_predictions, set_predictions

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

HUB = {"hans": {"relation": "stand-in", "path": "jhu-cogsci/hans", "name": None, "split": "validation",
                "file": "hans/evaluation_regenerated.parquet", "file_sha256": "ab" * 32},
       "snli_test": {"relation": "exact", "path": "stanfordnlp/snli", "name": None, "split": "test"}}


def _results(accs: dict[str, float], n: int = 100, n_total: int = 100, runs: int = 3) -> dict:
    # hub_reference: what hub_reference() records for a set (relation None: no Hub dataset)
    return {"schema": SCHEMA, "num_models": runs, "config": {"sample_seed": 7}, "sets": {
        s: {"accuracy": a, "accuracy_std": 0.01, "n": n, "n_total": n_total, "subsampled": n < n_total,
            "sample_seed": 7 if n < n_total else None, "task": "snli",
            "hub_reference": HUB.get(s, {"relation": None, "file": f"{s}.parquet", "file_sha256": "cd" * 32}),
            "runs": [{"seed": i + 1} for i in range(runs)]} for s, a in accs.items()}}


def _index(results) -> dict:
    from huggingface_hub import ModelCardData
    from huggingface_hub.repocard_data import eval_results_to_model_index

    from debiased_nli.models.hub import model_index_results, result_rows

    entries = model_index_results(result_rows(results), "https://huggingface.co/org/m/blob/main/evaluation/results.json")
    meta = {"model-index": eval_results_to_model_index("m", entries)}
    results = ModelCardData(**meta).eval_results  # huggingface_hub's own model-index parser reads it back
    return {(r.dataset_name, r.metric_type): r for r in results}


def test_several_seeds_give_the_mean_and_the_std_under_the_sets_hub_relation():
    got = _index(_results({"hans": 0.52, "snli_test_hard": 0.61}))
    hans = ("hans (local stand-in for jhu-cogsci/hans[validation], sha256 abababababab)", "accuracy")
    assert set(got) == {hans, (hans[0], "accuracy_std"), ("snli_test_hard (local file, sha256 cdcdcdcdcdcd)", "accuracy"),
                        ("snli_test_hard (local file, sha256 cdcdcdcdcdcd)", "accuracy_std")}
    # a stand-in: the Hub dataset it stands in for, never its split (the rows are not the split's)
    assert got[hans].dataset_type == "jhu-cogsci/hans" and got[hans].dataset_split is None
    assert got[hans].metric_value == 0.52 and got[hans].metric_args == {"num_models": 3, "seeds": [1, 2, 3]}
    assert got[hans[0], "accuracy_std"].metric_value == 0.01
    assert got[hans].dataset_args["file_sha256"] == "ab" * 32
    assert got[hans].source_name == ("debiased-nli evaluate: hans: local file hans/evaluation_regenerated.parquet "
                                     "(sha256 abababababab)")


def test_a_sample_score_is_published_as_a_sample():
    [(key, result)] = _index(_results({"snli_test": 0.6}, n=1000, n_total=9824, runs=1)).items()
    assert key == ("snli_test (random sample of 1,000 of 9,824 rows, seed 7)", "accuracy")
    assert result.dataset_type == "stanfordnlp/snli" and result.dataset_split == "test"
    assert result.dataset_args == {"rows_scored": 1000, "rows_in_split": 9824, "sample": "seeded random sample",
                                   "sample_seed": 7}
    assert result.metric_name == "Accuracy" and result.metric_args is None


def test_a_results_file_from_before_hub_reference_is_read_by_its_hub_dataset():
    from debiased_nli.models.hub import result_rows

    old = _results({"snli_test": 0.6}, runs=1)
    entry = old["sets"]["snli_test"]
    del entry["hub_reference"]
    entry["hub_dataset"] = {"path": "stanfordnlp/snli", "name": None, "split": "test"}
    [row] = result_rows(old)
    assert row["reference"] == {"relation": "exact", "path": "stanfordnlp/snli", "name": None, "split": "test"}


def test_each_set_names_how_its_rows_relate_to_a_hub_dataset(shared_data):
    from debiased_nli.models.challenge import challenge_source, hub_reference
    from debiased_nli.utils.provenance import file_sha256

    # a local file marked as an exact copy of the Hub split, a regenerated stand-in, a subset, a set with no Hub id
    assert challenge_source("snli_test", shared_data)["hub_dataset"] == {"path": "stanfordnlp/snli", "name": None,
                                                                       "split": "test"}
    assert hub_reference("snli_test", shared_data) == {
        "relation": "exact", "path": "stanfordnlp/snli", "name": None, "split": "test", "file": "snli/test.parquet",
        "file_sha256": file_sha256(shared_data / "snli" / "test.parquet")}
    assert challenge_source("hans", shared_data)["hub_dataset"] is None
    assert hub_reference("hans", shared_data)["relation"] == "stand-in"
    assert hub_reference("snli_test_hard", shared_data)["relation"] == "subset"
    assert hub_reference("snli_test_hard", shared_data)["path"] == "stanfordnlp/snli"
    dasgupta = hub_reference("dasgupta_compositional", shared_data)
    assert dasgupta["relation"] is None and dasgupta["file"] == "dasgupta2018_compositional/master_true.parquet"


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
