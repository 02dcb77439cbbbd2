"""The self-audit fixed point: a config z-filtered again with its own features until its own audit (as
`debiased-nli audit` computes it, independently) is under the threshold."""
import numpy as np
import pytest

from debiased_nli.bias.audit import audit_dataset
from debiased_nli.bias.self_audit import self_audit_fixed_point
from debiased_nli.data.loading import load_task, new_rows
from debiased_nli.data.tasks import get_task
from debiased_nli.utils.errors import ConfigError


@pytest.fixture(scope="module")
def planted(shared_data):
    """1,200 real SNLI rows plus 300 rows that carry an artifact D0 has not: "zorbly" in a contradiction."""
    d0 = load_task("snli", data_files=str(shared_data / "snli" / "train_sample.parquet"), max_rows=1500).dataset
    base = d0.select(range(1200))
    extra = d0.select(range(1200, 1500))
    names = ["entailment", "neutral", "contradiction"]
    hyp = [h.rstrip(".") + " zorbly." if i % 3 == 0 else h for i, h in enumerate(extra["hypothesis"])]
    lab = ["contradiction" if i % 3 == 0 else names[l] for i, l in enumerate(extra["label"])]
    gen = new_rows("snli", list(extra["premise"]), hyp, lab, origin="generated", method="generator:test")
    import datasets
    return datasets.concatenate_datasets([base.select_columns(gen.column_names), gen])


def test_the_fixed_point_ends_under_the_configs_own_audit_threshold(planted):
    before = audit_dataset(planted, "snli", progress=False)
    assert before["max_abs_z"] > before["z_threshold"]
    assert any("zorbly" in f["feature"] and f["label"] == "contradiction" and f["z"] == before["max_abs_z"]
               for f in before["features"])  # the planted artifact is the largest
    r = self_audit_fixed_point(planted, get_task("snli"), progress=False)
    assert r.converged and r.rounds and r.rounds[0]["before"]["max_abs_z"] == before["max_abs_z"]
    after = audit_dataset(r.kept, "snli", progress=False)  # the command's own audit, recomputed here
    assert after["max_abs_z"] <= after["z_threshold"] and after["max_abs_z"] == r.final_audit["max_abs_z"]
    # every input row is kept or dropped once, the dropped ones with their round and reason
    kept, dropped = set(r.kept["uid"]), set(r.rejected["uid"])
    assert kept.isdisjoint(dropped) and kept | dropped == set(planted["uid"])
    assert set(r.rejected["self_audit_round"]) <= set(range(1, len(r.rounds) + 1)) and "rejected_by" in r.rejected.column_names
    assert sum(x["dropped"] for x in r.rounds) == len(dropped)


def test_a_config_already_under_its_threshold_is_left_as_it_is(planted):
    r = self_audit_fixed_point(planted, get_task("snli"), z_threshold=1e6, progress=False)
    assert r.converged and r.rounds == [] and r.rejected is None and len(r.kept) == len(planted)


def test_rounds_are_bounded(planted):
    r = self_audit_fixed_point(planted, get_task("snli"), z_threshold=0.5, max_rounds=1, progress=False)
    assert len(r.rounds) == 1 and not r.converged
    with pytest.raises(ConfigError, match="max_rounds"):
        self_audit_fixed_point(planted, get_task("snli"), max_rounds=0, progress=False)
