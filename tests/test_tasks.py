import pytest

from debiased_nli.utils.errors import ConfigError
from debiased_nli.data.tasks import TaskSpec, get_task, list_tasks


@pytest.mark.parametrize("name,k", [("snli", 3), ("mnli", 3), ("fever", 3), ("qqp", 2), ("demo", 3)])
def test_registered_tasks_have_labels_hub_and_features(name, k):
    task = get_task(name)
    assert task.num_labels == k
    assert set(task.columns) == {"premise", "hypothesis", "label"}
    assert "null_v1" in task.features and "hypo_only_v1" in task.features
    if name != "demo":
        assert task.hub is not None and "/" in task.hub.path


def test_fever_maps_evidence_to_premise_and_claim_to_hypothesis():
    fever = get_task("fever")
    assert fever.columns["premise"] == "evidence" and fever.columns["hypothesis"] == "claim"
    assert fever.labels == ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO")


def test_qqp_has_the_low_overlap_feature():
    assert "low_overlap_v1" in get_task("qqp").features
    assert "low_overlap_v1" not in get_task("snli").features


def test_unknown_task_says_did_you_mean():
    with pytest.raises(ConfigError, match="Did you mean 'snli'"):
        get_task("snil")


def test_task_yaml_by_path_and_unknown_key(tmp_path):
    good = tmp_path / "rte.yaml"
    good.write_text("name: rte\nlabels: [entailment, not_entailment]\n"
                    "columns: {premise: sentence1, hypothesis: sentence2, label: label}\n")
    task = get_task(str(good))
    assert task.name == "rte" and task.num_labels == 2 and task.columns["premise"] == "sentence1"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nlabels: [a, b]\nlabelz: [1]\n")
    with pytest.raises(ConfigError, match="unknown task key"):
        get_task(str(bad))


def test_label_values_must_name_task_labels():
    with pytest.raises(ConfigError, match="not one of the task's labels"):
        TaskSpec.from_dict({"name": "x", "labels": ["a", "b"], "label_values": {0: "c"}})


def test_custom_task_and_label_lookup():
    task = TaskSpec.custom("pairs", ["no", "yes"], premise="s1", hypothesis="s2", label="y",
                           label_values={"false": "no", "true": "yes"})
    lookup = task.label_lookup()
    assert lookup[0] == 0 and lookup["yes"] == 1 and lookup["true"] == 1 and lookup["1"] == 1
    assert "demo" in list_tasks()
