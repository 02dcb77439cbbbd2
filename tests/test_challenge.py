"""The challenge-set registry: every registered set loads from ../shared/data with its size and label map."""
from __future__ import annotations

import numpy as np
import pytest

from debiased_nli.models import challenge
from debiased_nli.models.challenge import (get_set, get_suite, list_sets, list_suites, load_challenge_set,
                                           load_metric, resolve_sets)
from debiased_nli.utils.errors import ConfigError
from debiased_nli.data.tasks import get_task


@pytest.mark.parametrize("name", list_sets())
def test_every_registered_set_loads_with_its_size_and_label_map(name, shared_data):
    spec = get_set(name)
    ds = load_challenge_set(spec, data_root=shared_data)
    assert len(ds) == spec.expected_rows
    assert ds.features["label"].names == list(spec.labels)
    labels = np.asarray(ds["label"])
    assert labels.min() >= 0 and labels.max() < len(spec.labels)
    # every model label of the task goes to one of the set's labels or is left out of the argmax
    task = get_task(spec.task)
    assert set(spec.prediction_map) == set(task.labels)
    kept, targets = spec.prediction_indices()
    assert sorted(set(targets)) == list(range(len(spec.labels)))
    for b in spec.breakdowns:
        for c in b.columns:
            assert c == "label" or c in ds.column_names
    assert all(isinstance(p, str) and p for p in ds["premise"][:50])


def test_hans_is_two_way_with_neutral_and_contradiction_as_non_entailment(shared_data):
    spec = get_set("hans")
    assert spec.labels == ("entailment", "non-entailment")
    assert dict(spec.prediction_map) == {"entailment": "entailment", "neutral": "non-entailment",
                                         "contradiction": "non-entailment"}
    ds = load_challenge_set(spec, data_root=shared_data)
    assert np.bincount(ds["label"]).tolist() == [15000, 15000]
    assert len(set(ds["subcase"])) == 30 and set(ds["heuristic"]) == {"lexical_overlap", "subsequence", "constituent"}


def test_fever_symmetric_leaves_not_enough_info_out_of_the_argmax():
    spec = get_set("fever_symmetric_v01")
    kept, targets = spec.prediction_indices()
    assert [get_task("fever").labels[i] for i in kept] == ["SUPPORTS", "REFUTES"] and targets == [0, 1]


def test_anli_rounds_and_their_sizes(shared_data):
    assert [len(load_challenge_set(f"anli_r{r}", shared_data)) for r in (1, 2, 3)] == [1000, 1000, 1200]
    ds = load_challenge_set("anli", shared_data)
    assert sorted(set(ds["round"])) == ["r1", "r2", "r3"]


def test_named_suites_group_the_sets():
    assert {"nli", "fever", "qqp"} <= set(list_suites())
    assert "hans" in get_suite("nli").sets and "paws_qqp" in get_suite("qqp").sets
    assert all(get_set(s).task == "fever" for s in get_suite("fever").sets)
    assert [s.name for s in resolve_sets("qqp", ["hans", "paws_qqp"])] == ["qqp_bimpm_dev", "qqp_bimpm_test",
                                                                          "paws_qqp", "hans"]


def test_unknown_suite_and_set_say_did_you_mean():
    with pytest.raises(ConfigError, match="Did you mean 'nli'"):
        get_suite("nlii")
    with pytest.raises(ConfigError, match="Did you mean 'hans'"):
        get_set("hnas")


def test_a_missing_file_names_the_path_and_how_to_get_it(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_challenge_set("snli_test_hard", data_root=tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "snli" / "test_hard.parquet") in msg
    assert "snli_1.0_test_hard.jsonl" in msg and "--data-root" in msg


def test_the_data_root_and_evaluation_folder_can_be_moved(tmp_path, monkeypatch, shared_data):
    monkeypatch.setenv("DEBIASED_NLI_DATA_ROOT", str(shared_data))
    assert challenge.default_data_root() == shared_data
    assert len(load_challenge_set("paws_qqp")) == 677
    monkeypatch.setenv("DEBIASED_NLI_EVALUATION", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="DEBIASED_NLI_EVALUATION"):
        load_metric()


def test_a_spec_whose_prediction_map_misses_a_model_label_is_refused():
    with pytest.raises(ConfigError, match="no entry for the model label 'contradiction'"):
        challenge.ChallengeSet.from_dict({"name": "x", "task": "snli", "labels": ["entailment", "non-entailment"],
                                          "prediction_map": {"entailment": "entailment",
                                                             "neutral": "non-entailment"}})


def test_the_metric_module_loads_from_its_folder_and_breaks_down_exactly():
    metric = load_metric()
    out = metric.compute(predictions=[0, 1, 1, 0, 2], references=[0, 1, 0, 0, 1],
                         breakdowns={"g": ["a", "a", "b", "b", "b"]})
    assert out["accuracy"] == pytest.approx(3 / 5) and out["n"] == 5 and out["correct"] == 3
    assert out["breakdowns"]["g"] == {"a": {"accuracy": 1.0, "n": 2, "correct": 2},
                                      "b": {"accuracy": pytest.approx(1 / 3), "n": 3, "correct": 1}}
