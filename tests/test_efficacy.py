"""The efficacy harness (benchmarks/efficacy.py): units, resumability, pending rows, the report.

A tiny BERT from a config is trained on a few dozen SNLI rows and scored on a few rows of two sets, so
the harness's bookkeeping is tested end to end without the real model.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from benchmarks import efficacy
from debiased_nli.cli import build_parser
from debiased_nli.evaluation.compare import units
from debiased_nli.utils.errors import ConfigError
from test_training import make_tiny_bert

N_TRAIN = 48


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_data):
    tmp = tmp_path_factory.mktemp("efficacy")
    train = pd.read_parquet(shared_data / "snli" / "train_sample.parquet").head(N_TRAIN)
    train.to_parquet(tmp / "train.parquet")
    dev = pd.read_parquet(shared_data / "snli" / "dev.parquet").head(40)
    dev.to_parquet(tmp / "dev.parquet")
    texts = list(train.premise) + list(train.hypothesis) + list(dev.premise) + list(dev.hypothesis)
    texts += list(pd.read_parquet(shared_data / "anli" / "test.parquet").head(300).premise)
    model = make_tiny_bert(tmp / "encoder", texts)
    recipe = efficacy.ROOT / "builders" / "snli.yaml"  # z-filtering shrinks its batch to fit 48 rows
    plan = {
        "task": "snli", "model": str(model), "seeds": [0, 1], "runs_dir": str(tmp / "runs"),
        "results_dir": str(tmp / "results" / "efficacy"), "reference": "original",
        "train": {"learning_rate": 1e-3, "batch_size": 16, "max_length": 48, "epochs": 1, "warmup_ratio": 0.1,
                  "dev_files": [str(tmp / "dev.parquet")], "max_dev_rows": 20, "threads": 1},
        "evaluate": {"sets": ["snli_test_hard", "anli"], "max_length": 48, "batch_size": 16, "max_tokens": 256,
                     "max_examples": 24, "threads": 1},
        "releases": {"small": {"recipe": str(recipe), "data_files": [f"train={tmp / 'train.parquet'}"]},
                     "generated": {"recipe": str(recipe), "data_files": [f"train={tmp / 'train.parquet'}"],
                                   "new_rows": [str(tmp / "no-such-generator-run" / "kept.parquet")]}},
        "rows": [
            {"name": "original", "data": {"files": [str(tmp / "train.parquet")]}},
            {"name": "z_filtered", "data": {"release": "small", "config": "z_filtered"},
             "compare_with": {"row": "random_control", "why": "same size"}},
            {"name": "random_control", "data": {"random_subset_of": "original", "size_of": "z_filtered", "seed": 0}},
            {"name": "random_control_resampled",
             "data": {"random_subset_of": "original", "size_of": "z_filtered", "seed": "unit"}},
            {"name": "held", "data": {"files": [str(tmp / "train.parquet")]}, "poe": {"beta": 1.0, "gamma": 1.0},
             "hold": "waiting for a fix"},
            {"name": "aflite", "data": {"release_dir": str(tmp / "releases" / "aflite-snli"), "config": "aflite"}},
            {"name": "seq_z", "data": {"release": "generated", "config": "seq_z"}},
        ],
    }
    path = tmp / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    p = efficacy.load_plan(path)
    states = efficacy.run(p, progress=False)
    return p, states


def test_every_unit_is_trained_scored_and_written_once(setup):
    plan, states = setup
    by = {(s["row"], s["seed"]): s for s in states}
    for row in ("original", "z_filtered", "random_control"):
        for seed in (0, 1):
            assert by[(row, seed)]["state"] == "done"
            unit = json.loads(plan.unit_file(row, seed).read_text())
            assert unit["row"] == row and unit["seed"] == seed
            assert set(unit["sets"]) == {"snli_test_hard", "anli"}
            assert all(0.0 <= v["accuracy"] <= 1.0 and v["n"] == 24 for v in unit["sets"].values())
            assert unit["train"]["rows"] == unit["data"]["rows"] > 0
            assert unit["train"]["seconds"] > 0 and unit["evaluation"]["examples_per_second"] > 0
            assert unit["train"]["git"] and unit["evaluation"]["git"]  # the commit each stage ran at
            assert unit["data"]["command"]
    assert not list(plan.results_dir.glob(".*tmp*"))  # written atomically: no partial files left


def test_pending_rows_are_reported_with_their_reason_not_dropped(setup):
    plan, states = setup
    reasons = {s["row"]: s["reason"] for s in states if s["state"] == "pending"}
    assert set(reasons) == {"held", "aflite", "seq_z"}
    assert "waiting for a fix" in reasons["held"]
    assert "aflite-snli does not exist yet" in reasons["aflite"]
    assert "no-such-generator-run" in reasons["seq_z"] and "not on disk" in reasons["seq_z"]
    table = efficacy.report(plan)
    assert set(table["rows"]) == {r["name"] for r in plan.rows}
    md = plan.results_dir.with_suffix(".md").read_text()
    for row in ("held", "aflite", "seq_z"):
        assert f"| `{row}` | pending |" in md
    assert "waiting for a fix" in md and plan.results_dir.with_suffix(".png").exists()


def test_a_second_run_skips_finished_units(setup, monkeypatch):
    plan, _ = setup
    before = {p: p.stat().st_mtime_ns for p in plan.results_dir.glob("*.json")}

    def fail(*a, **k):
        raise AssertionError("a finished unit was run again")

    monkeypatch.setattr("debiased_nli.models.training.train_classifier", fail)
    monkeypatch.setattr("debiased_nli.evaluation.scores.evaluate_models", fail)
    efficacy.run(plan, progress=False)
    assert {p: p.stat().st_mtime_ns for p in plan.results_dir.glob("*.json")} == before


def test_an_interrupted_unit_continues_from_its_trained_model(setup, monkeypatch):
    plan, _ = setup
    unit = plan.unit_file("original", 1)
    old = json.loads(unit.read_text())
    unit.unlink()  # as if the run stopped after training, before the evaluation was written
    monkeypatch.setattr("debiased_nli.models.training.train_classifier",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("retrained")))
    efficacy.run(plan, rows=["original"], progress=False)
    new = json.loads(unit.read_text())
    assert new["train"] == old["train"]
    assert new["sets"]["anli"]["accuracy"] == old["sets"]["anli"]["accuracy"]  # the same model, the same rows


def test_the_random_control_has_z_filtereds_size_and_the_recorded_command_trains_on_it(setup):
    plan, _ = setup
    zf = json.loads(plan.unit_file("z_filtered", 0).read_text())
    rc = json.loads(plan.unit_file("random_control", 0).read_text())
    assert rc["train"]["rows"] == zf["train"]["rows"] < N_TRAIN
    args = build_parser().parse_args(__import__("shlex").split(rc["train"]["command"])[1:])
    assert args.max_train_rows == zf["train"]["rows"] and args.data_seed == 0
    assert args.lr == plan.train["learning_rate"] and args.epochs == plan.train["epochs"] and args.seed == 0
    args = build_parser().parse_args(__import__("shlex").split(zf["train"]["command"])[1:])
    assert args.config == "z_filtered" and args.release.endswith("releases/small")


def test_the_table_is_mean_and_std_over_seeds(setup):
    plan, _ = setup
    table = efficacy.summarise(plan)
    runs = [json.loads(plan.unit_file("original", s).read_text())["sets"]["anli"]["accuracy"] for s in (0, 1)]
    cell = table["rows"]["original"]["sets"]["anli"]
    assert cell["mean"] == pytest.approx(sum(runs) / 2)
    assert cell["std"] == pytest.approx(abs(runs[0] - runs[1]) / 2 ** 0.5)
    assert set(table["verdict"]) == {"z_filtered", "random_control", "random_control_resampled"}


def test_each_unit_records_the_rows_it_trained_on_and_the_report_says_whether_the_seeds_agree(setup):
    from debiased_nli.data.loading import content_fingerprint
    from debiased_nli.data.tasks import get_task
    from debiased_nli.models.training import load_training_split

    plan, _ = setup
    unit = {(r, s): json.loads(plan.unit_file(r, s).read_text())["data"] for r in ("original", "z_filtered") for s in (0, 1)}
    rows = load_training_split(get_task("snli"), data_files={"train": plan.rows[0]["data"]["files"]})
    assert unit[("original", 0)]["content_fingerprint"] == content_fingerprint(rows)  # what `train` reads
    assert unit[("z_filtered", 0)]["content_fingerprint"] == unit[("z_filtered", 1)]["content_fingerprint"]
    assert unit[("z_filtered", 0)]["content_fingerprint"] != unit[("original", 0)]["content_fingerprint"]
    table = efficacy.summarise(plan)
    fp = unit[("z_filtered", 0)]["content_fingerprint"]
    assert efficacy._same_rows(table["rows"]["z_filtered"]["data_fingerprints"]) == f"yes (`{fp[:8]}`)"
    assert efficacy._same_rows({0: "a" * 16, 1: "b" * 16}) == "**no**: s0 `aaaaaaaa`, s1 `bbbbbbbb`"
    assert efficacy._same_rows({0: None, 1: "a" * 16}) == "one seed (`aaaaaaaa`); not recorded for seed 0"
    assert efficacy._same_rows({0: None}) == "not recorded"
    assert efficacy._same_rows({0: None, 1: None}, sizes={0: 7454, 1: 7609}) == "**no**: s0 7,454 rows, s1 7,609 rows"
    from debiased_nli.release.efficacy import train_rows_text

    assert train_rows_text({"train_rows": 7454, "train_rows_by_seed": {0: 7454, 1: 7609}}) == "7,454 (s0) / 7,609 (s1)"


def test_a_control_drawn_per_seed_trains_each_seed_on_its_own_subset_of_the_same_size(setup):
    plan, _ = setup
    units = [json.loads(plan.unit_file("random_control_resampled", s).read_text()) for s in (0, 1)]
    fixed = json.loads(plan.unit_file("random_control", 0).read_text())
    assert units[0]["data"]["content_fingerprint"] != units[1]["data"]["content_fingerprint"]
    assert units[0]["data"]["content_fingerprint"] == fixed["data"]["content_fingerprint"]  # seed 0 draws subset 0
    for seed, u in enumerate(units):
        assert u["data"]["seed"] == seed and u["data"]["subset_seed_is_unit_seed"]
        assert u["train"]["rows"] == fixed["train"]["rows"]
        args = build_parser().parse_args(__import__("shlex").split(u["train"]["command"])[1:])
        assert args.data_seed == seed and args.seed == seed and args.max_train_rows == fixed["train"]["rows"]
    table = efficacy.summarise(plan)
    e = table["rows"]["random_control_resampled"]
    assert efficacy._same_rows(e["data_fingerprints"], e["subset_per_seed"]) == "no, drawn anew per seed (2 distinct in 2 seeds)"
    # the report's "how it was built" names the unit's seed as the shuffle seed, not seed 0's draw alone
    assert e["data_command"].startswith("original.shuffle(seed=s).select(range(len(z_filtered) = ")
    assert e["data_command"].endswith("; s = the unit's seed (0, 1)")
    assert table["rows"]["random_control"]["data_command"].startswith("original.shuffle(seed=0).select(")
    with pytest.raises(ValueError, match="unit_seed"):
        efficacy.resolve_row(plan, plan.row("random_control_resampled"))


def test_each_set_records_its_confusion_matrix_and_the_report_shows_predicted_label_shares(setup, monkeypatch):
    plan, _ = setup
    for seed in (0, 1):
        for _name, v in json.loads(plan.unit_file("original", seed).read_text())["sets"].items():
            m = v["confusion"]
            assert list(m) == ["entailment", "neutral", "contradiction"]
            assert sum(sum(r.values()) for r in m.values()) == v["n"]
            assert sum(m[lab][lab] for lab in m) / v["n"] == pytest.approx(v["accuracy"])
    monkeypatch.setattr(efficacy, "SHARE_SETS", ["snli_test_hard"])
    table = efficacy.report(plan)
    shares = table["rows"]["original"]["predicted_shares"]["snli_test_hard"]
    assert shares["n_seeds"] == 2 and sum(shares["predicted"].values()) == pytest.approx(1.0)
    assert sum(shares["gold"].values()) == pytest.approx(1.0)
    md = plan.results_dir.with_suffix(".md").read_text()
    assert "### Predicted labels" in md and "| *gold* |" in md


def test_a_row_is_also_compared_with_the_row_it_names(setup, tmp_path):
    plan, _ = setup
    table = efficacy.summarise(plan)
    (comp,) = table["comparisons"]
    assert (comp["row"], comp["against"], comp["why"]) == ("z_filtered", "random_control", "same size")
    zf, rc = table["rows"]["z_filtered"]["sets"], table["rows"]["random_control"]["sets"]
    for s in ("snli_test_hard", "anli"):
        diff, se, call = efficacy.compare(zf[s], rc[s])
        # unrounded in the JSON: each figure is rounded once, where it is written
        assert comp["sets"][s] == {"difference": diff, "se": se, "call": call}
    md = tmp_path / "efficacy.md"
    efficacy.write_markdown(table, plan, md, None)
    text = md.read_text()
    assert "| `z_filtered` − `random_control` | same size |" in text
    assert "**z_filtered** vs random_control (same size)" in text
    bad = yaml.safe_load(plan.path.read_text())
    bad["rows"][1]["compare_with"] = "no_such_row"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="compare_with 'no_such_row'"):
        efficacy.load_plan(tmp_path / "bad.yaml")


def test_compare_calls_a_difference_only_beyond_two_standard_errors():
    ref = {"mean": 0.50, "std": 0.01, "n_seeds": 3}
    assert efficacy.compare({"mean": 0.60, "std": 0.01, "n_seeds": 3}, ref)[2] == "helps"
    assert efficacy.compare({"mean": 0.40, "std": 0.01, "n_seeds": 3}, ref)[2] == "hurts"
    assert efficacy.compare({"mean": 0.505, "std": 0.01, "n_seeds": 3}, ref)[2] == "no clear change"
    assert efficacy.compare({"mean": 0.60, "std": None, "n_seeds": 1}, ref)[2] == "one seed"


def test_a_release_card_shows_its_rows_of_the_table(setup, tmp_path):
    from debiased_nli.release.recipe import build

    plan, _ = setup
    efficacy.report(plan)
    table_json = plan.results_dir.with_suffix(".json")
    build(efficacy.ROOT / "builders" / "snli.yaml", tmp_path / "release", data_files=[f"train={plan.path.parent / 'train.parquet'}"],
          progress=False, efficacy=table_json)
    card = (tmp_path / "release" / "README.md").read_text()
    section = card.split("## Does training on it help? (measured)", 1)[1].split("\n## ", 1)[0]
    table = json.loads(table_json.read_text())
    zf, ref = table["rows"]["z_filtered"]["sets"]["anli"], table["rows"]["original"]["sets"]["anli"]
    assert "| `original` |" in section and "| `z_filtered` |" in section
    assert f"{100 * zf['mean']:.1f} ± {100 * zf['std']:.1f} ({100 * (zf['mean'] - ref['mean']):+.1f})" in section
    assert "| `aflite` |" not in section  # the release has no aflite config
    # the same-size control, which separates debiased data from less data, comes with the row
    comp = next(c for c in table["comparisons"] if c["row"] == "z_filtered" and c["against"] == "random_control")
    d = comp["sets"]["anli"]
    assert "| `z_filtered` − `random_control` | same size" in section
    assert f"{d['difference']:+.1f}" + ("*" if d["call"] in ("helps", "hurts") else "") in section

    # seeds that trained on different sizes (a release rebuilt on another machine): the card shows each,
    # as efficacy.md does, not the first seed's size alone
    from debiased_nli.release.efficacy import card_markdown

    table["rows"]["z_filtered"]["train_rows_by_seed"] = {"0": 7454, "1": 7609, "10": 7609}
    table_json.write_text(json.dumps(table))
    assert "| `z_filtered` | 7,454 (s0) / 7,609 (s1) / 7,609 (s10) |" in card_markdown(table_json, ["z_filtered"])
    # this release's config has another size than some seeds trained on: the card says so
    note = "`z_filtered` trained on 7,454 / 7,609 rows of `z_filtered`, this release's `z_filtered` has 7,609"
    assert note in card_markdown(table_json, ["z_filtered"], sizes={"z_filtered": 7609})
    table["rows"]["z_filtered"]["train_rows_by_seed"] = {"0": 7609, "1": 7609}
    table_json.write_text(json.dumps(table))
    assert "another size" not in card_markdown(table_json, ["z_filtered"], sizes={"z_filtered": 7609})

    # a plan that scores two releases with the same config names (issue 45's seqz-v2 and seqz-v2-filtered): each
    # release's card shows its own rows; a release built under another name shows every row of its configs
    import copy

    other = copy.deepcopy(table["rows"]["z_filtered"])
    other["data"] = {"release_dir": "/runs/releases/snli-filtered", "config": "z_filtered"}
    table["rows"]["z_filtered"]["data"] = {"release_dir": "/runs/releases/snli", "config": "z_filtered"}
    table["rows"]["z_filtered_more"] = other
    table_json.write_text(json.dumps(table))
    assert "| `z_filtered` |" in (mine := card_markdown(table_json, ["z_filtered"], release="snli"))
    assert "`z_filtered_more`" not in mine
    theirs = card_markdown(table_json, ["z_filtered"], release="snli-filtered")
    assert "| `z_filtered_more` |" in theirs and "| `z_filtered` |" not in theirs and "| `original` |" in theirs
    for name in ("elsewhere", None):
        both = card_markdown(table_json, ["z_filtered"], release=name)
        assert "| `z_filtered` |" in both and "| `z_filtered_more` |" in both
    other["data"] = {"release": "snli-filtered", "config": "z_filtered"}  # a release the plan builds, by name
    table_json.write_text(json.dumps(table))
    assert "| `z_filtered` |" not in card_markdown(table_json, ["z_filtered"], release="snli-filtered")


def test_a_unit_scores_what_debiased_nli_evaluate_scores_and_a_cached_one_loads_no_model(setup, tmp_path, monkeypatch):
    """evaluate_unit goes through evaluate_models (issue 33): the same accuracies, breakdowns and confusion
    matrices as an evaluation without chunks or cache; re-scored from its cached chunks, the model is not loaded."""
    from debiased_nli.evaluation import scores as evaluation
    from debiased_nli.models.challenge import resolve_sets

    plan, _ = setup
    unit = json.loads(plan.unit_file("original", 0).read_text())
    model = str(plan.model_dir("original", 0))
    results = evaluation.evaluate_models([model], resolve_sets(sets=plan.evaluate["sets"]),
                                         efficacy.eval_config(plan, progress=False))
    for name, entry in results["sets"].items():
        run = entry["runs"][0]
        assert (unit["sets"][name]["accuracy"], unit["sets"][name]["confusion"]) == (run["accuracy"], run["confusion"])
        assert unit["sets"][name]["breakdowns"] == (run.get("breakdowns") or {})
        assert (unit["sets"][name]["n"], unit["sets"][name]["n_total"]) == (entry["n"], entry["n_total"])
    assert unit["evaluation"]["config"] == results["config"]
    monkeypatch.setattr(evaluation, "load_classifier", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    again = efficacy.evaluate_unit(efficacy.load_plan(plan.path, results_dir=str(tmp_path)), plan.row("original"), 0,
                                   json.loads((plan.model_dir("original", 0) / efficacy.TRAIN_RECORD).read_text()),
                                   None, progress=False)
    assert again["sets"] == unit["sets"] and again["evaluation"]["git"] == unit["evaluation"]["git"]


# ------------------------------------------------------------------ evaluation batching (evaluation.py)

def test_length_batches_cover_every_row_once_within_the_row_and_token_budgets():
    import numpy as np

    from debiased_nli.models.classifier import length_batches

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 120, size=1000)
    batches = length_batches(lengths, batch_size=64, max_tokens=1024)
    order = np.concatenate(batches)
    assert sorted(order.tolist()) == list(range(1000))
    assert all(np.diff(lengths[order]) >= 0)  # sorted by length: each batch pads to similar rows
    for b in batches:
        assert len(b) <= 64 and (len(b) == 1 or len(b) * lengths[b].max() <= 1024)
    assert len(length_batches(lengths, 64)) == 16  # no token budget: rows only


def test_predictions_do_not_depend_on_the_batching(setup, shared_data):
    import numpy as np

    from debiased_nli.models.classifier import load_classifier, predict_probabilities

    plan, _ = setup
    clf = load_classifier(str(plan.model_dir("original", 0)), "cpu")
    df = pd.read_parquet(shared_data / "anli" / "test.parquet").head(40)
    prem, hyp = list(df.premise), list(df.hypothesis)
    one = predict_probabilities(clf, prem, hyp, batch_size=1, max_length=48, progress=False)
    many = predict_probabilities(clf, prem, hyp, batch_size=32, max_length=48, max_tokens=600, progress=False)
    np.testing.assert_allclose(many, one, atol=1e-5)  # dynamic padding is masked out
    assert np.allclose(one.sum(axis=1), 1.0)


def test_a_release_of_another_branch_is_read_when_it_appears(setup):
    plan, _ = setup
    folder = efficacy.release_dir(plan, "small")  # stands in for e.g. /work/releases/aflite-snli
    row = {"name": "other", "data": {"release_dir": str(folder), "config": "z_filtered"}}
    data = efficacy.resolve_row(plan, row)
    zf = json.loads(plan.unit_file("z_filtered", 0).read_text())
    assert data.info["rows"] == zf["train"]["rows"] and len(data.info["release_manifest_sha256"]) == 64
    with pytest.raises(efficacy.Pending, match=r"has no config 'aflite' \(it has \['z_filtered'\]\)"):
        efficacy.resolve_row(plan, {"name": "x", "data": {"release_dir": str(folder), "config": "aflite"}})


def test_a_stage_gives_up_the_lock_between_turns_and_resumes(setup, tmp_path, monkeypatch):
    import fcntl

    plan, _ = setup
    raw = dict(plan.raw, lock_budget_minutes=0, runs_dir=str(tmp_path / "runs"), results_dir=str(tmp_path / "res"),
               seeds=[0])
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(raw))
    p = efficacy.load_plan(tmp_path / "plan.yaml")
    monkeypatch.setattr(efficacy.LockTurns, "pause_s", 0.0)
    lock = tmp_path / "heavy.lock"
    taken = []
    real_flock = fcntl.flock
    def flock(fh, op):  # count the heavy lock's calls (datasets' file locks use flock too)
        if getattr(fh, "name", None) == str(lock):
            taken.append(op)
        return real_flock(fh, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    efficacy.run(p, rows=["original"], lock=str(lock), progress=False)
    train = json.loads((p.model_dir("original", 0) / efficacy.TRAIN_RECORD).read_text())
    # a budget of 0: every turn ends after one optimizer step; 48 rows in batches of 16 = 3 steps, 3 turns
    assert [s["stopped_for_the_lock"] for s in train["sessions"]] == [True, True, False]
    assert train["sessions"][1]["resumed_from"].endswith("checkpoint-1")
    assert train["result"]["train_rows"] == N_TRAIN and not list(p.model_dir("original", 0).glob("checkpoint-*"))
    # train: 3 turns; evaluate: one turn per chunk (2 sets of 24 rows); each turn takes and gives up the lock
    assert taken.count(fcntl.LOCK_EX) == taken.count(fcntl.LOCK_UN) == 5
    unit = json.loads(p.unit_file("original", 0).read_text())
    assert set(unit["sets"]) == {"snli_test_hard", "anli"}


def test_poe_rows_take_wu_et_als_table_10_preset(setup):
    plan, _ = setup
    row = {"name": "original_poe", "data": {"files": ["x"]}, "poe": {"preset": "snli", "bias_model": "joint"}}
    poe = efficacy.poe_settings(row)
    assert (poe["beta"], poe["gamma"], poe["bias_model"]) == (2.0, 0.4, "joint") and "Table 10" in poe["source"]
    cfg = efficacy.train_config(plan, row, 0, progress=False)
    assert cfg.poe and (cfg.poe_beta, cfg.poe_gamma, cfg.bias_model) == (2.0, 0.4, "joint")
    data = efficacy.RowData(None, {"kind": "files", "files": ["train.parquet"]})
    args = build_parser().parse_args(__import__("shlex").split(efficacy.train_cli(cfg, data, ["dev.parquet"], "snli"))[1:])
    assert args.poe and (args.poe_beta, args.poe_gamma, args.bias_model) == (2.0, 0.4, "joint")


# ------------------------------------------------------------------ the GPU plan (efficacy_gpu.yaml, gpu_kit.py)

def test_a_plan_extends_another_restating_only_what_differs(setup, tmp_path):
    plan, _ = setup
    child = tmp_path / "gpu.yaml"
    child.write_text(yaml.safe_dump({"extends": str(plan.path), "device": "cuda", "results_dir": str(tmp_path / "res"),
                                     "train": {"epochs": 2}}))
    p = efficacy.load_plan(child)
    assert [r["name"] for r in p.rows] == [r["name"] for r in plan.rows]
    assert p.train["epochs"] == 2 and p.train["learning_rate"] == plan.train["learning_rate"]  # merged key by key
    assert p.evaluate == plan.evaluate and p.results_dir == tmp_path / "res" and p.raw["device"] == "cuda"
    loop = tmp_path / "loop.yaml"
    loop.write_text(yaml.safe_dump({"extends": "loop.yaml"}))
    with pytest.raises(ConfigError, match="loops"):
        efficacy.load_plan(loop)
    import torch

    if not torch.cuda.is_available():  # a GPU table is never computed on a CPU
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            efficacy.run(p, progress=False)
    # the real GPU plan is the CPU plan with its own results and runs folders
    gpu, cpu = efficacy.load_plan(efficacy.ROOT / "benchmarks" / "efficacy_gpu.yaml"), efficacy.load_plan()
    assert gpu.rows == cpu.rows and gpu.train == cpu.train and gpu.model == cpu.model
    assert gpu.evaluate == {**cpu.evaluate, "batch_size": 256}  # batching changes no probability beyond 3e-8
    assert gpu.results_dir != cpu.results_dir and gpu.runs_dir != cpu.runs_dir


def test_runs_sharing_a_claims_folder_split_the_units_and_seed_major_takes_every_rows_seed_0_first(setup, tmp_path,
                                                                                                 monkeypatch):
    plan, _ = setup
    child = tmp_path / "p.yaml"
    child.write_text(yaml.safe_dump({"extends": str(plan.path), "results_dir": str(tmp_path / "res")}))
    p = efficacy.load_plan(child)
    ran = []
    monkeypatch.setattr(units, "train_unit", lambda plan, row, seed, *a, **k: ran.append((row["name"], seed)) or {})
    monkeypatch.setattr(units, "evaluate_unit", lambda *a, **k: None)
    claims = tmp_path / "claims"
    assert efficacy.claim(claims, "original", 0) and not efficacy.claim(claims, "original", 0)  # another process has it
    efficacy.run(p, rows=["original", "z_filtered"], claims=claims, seed_major=True, progress=False)
    assert ran == [("z_filtered", 0), ("original", 1), ("z_filtered", 1)]
    assert sorted(f.name for f in claims.iterdir()) == ["original-s0", "original-s1", "z_filtered-s0", "z_filtered-s1"]
    ran.clear()
    efficacy.run(p, rows=["original", "z_filtered"], claims=claims, progress=False)  # everything is claimed
    assert ran == []
    # a row that breaks does not stop a shared worker: the others run, and the worker names it at the end
    def train(plan, row, seed, *a, **k):
        if row["name"] == "original":
            raise ValueError("broken rows")
        ran.append((row["name"], seed))

    monkeypatch.setattr(units, "train_unit", train)
    with pytest.raises(ConfigError, match="original: ValueError: broken rows"):
        efficacy.run(p, rows=["original", "z_filtered"], claims=tmp_path / "claims2", progress=False)
    assert ran == [("z_filtered", 0), ("z_filtered", 1)]
    assert efficacy.unit_order(p, ["original", "z_filtered"]) == [("original", 0), ("original", 1),
                                                                  ("z_filtered", 0), ("z_filtered", 1)]


def test_a_copy_without_git_records_the_commit_it_was_given(monkeypatch):
    from debiased_nli.utils.provenance import git_hash

    monkeypatch.setenv("DEBIASED_NLI_GIT_COMMIT", "0123abcd")
    assert git_hash() == "0123abcd"


def test_the_gpu_kit_carries_the_weights_as_float16_and_writes_them_back_as_float32(setup, tmp_path):
    import torch
    from safetensors.torch import load_file

    from benchmarks import gpu_kit

    plan, _ = setup
    info = gpu_kit._float16_model(Path(plan.model), tmp_path / "kit" / "model")
    (w,) = info["weights"].values()
    assert w["bytes_float16"] < 0.6 * w["bytes_float32"] and 0 < w["max_rel_change_above_1e-4"] <= 2 ** -11
    src, half = load_file(str(Path(plan.model) / "model.safetensors")), load_file(str(tmp_path / "kit" / "model" / "model.safetensors"))
    assert {k: t.dtype for k, t in half.items() if t.is_floating_point()} == {k: torch.float16 for k, t in src.items()
                                                                                if t.is_floating_point()}
    assert max((half[k].float() - src[k]).abs().max().item() for k in src) == w["max_abs_change"]


def test_collect_adds_the_units_a_gpu_run_packed_and_keeps_those_already_there(setup, tmp_path):
    import tarfile

    from benchmarks import gpu_kit

    plan, _ = setup
    res = tmp_path / "res"
    child = tmp_path / "p.yaml"
    child.write_text(yaml.safe_dump({"extends": str(plan.path), "results_dir": str(res)}))
    res.mkdir()
    (res / "original-s0.json").write_text('{"kept": true}')
    archive = tmp_path / "efficacy_gpu.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("original-s0.json", "original-s1.json"):
            tar.add(plan.unit_file("original", int(name[-6])), arcname=f"results/{name}")
        tar.add(plan.unit_file("original", 1), arcname="logs/worker0.log")
    assert gpu_kit.collect(archive, child, tmp_path / "logs") == ["original-s1.json"]
    assert json.loads((res / "original-s0.json").read_text()) == {"kept": True}
    assert (res / "original-s1.json").read_bytes() == plan.unit_file("original", 1).read_bytes()
    assert (tmp_path / "logs" / "logs" / "worker0.log").exists()


def test_a_table_that_replicates_another_reports_each_rows_difference_from_it(setup, tmp_path):
    import shutil

    plan, _ = setup
    res = tmp_path / "res"
    shutil.copytree(plan.results_dir, res)
    child = tmp_path / "p.yaml"
    child.write_text(yaml.safe_dump({"extends": str(plan.path), "replicates": str(plan.path), "results_dir": str(res)}))
    p = efficacy.load_plan(child)
    table = efficacy.summarise(p)
    rep = table["replication"]
    assert rep["against"] == efficacy.show(plan.path) and rep["called"] == 0  # the same units: no difference
    assert all(c["difference"] == 0 for r in rep["rows"].values() for c in r.values())
    assert set(rep["rows"]) >= {"original", "z_filtered"}
    efficacy.write_markdown(table, p, tmp_path / "t.md", None)
    text = (tmp_path / "t.md").read_text()
    assert f"0 of the {rep['differences']} differences with at least two seeds on both sides are called" in text
    assert "| `original` | +0.0 | +0.0 |" in text


def test_the_gpu_kit_empties_only_a_folder_it_made(tmp_path):
    from benchmarks import gpu_kit

    user = tmp_path / "thesis"  # a user's folder given as --kit by mistake
    user.mkdir()
    (user / "chapter1.tex").write_text("keep me")
    with pytest.raises(SystemExit, match="not made by gpu_kit.py make"):
        gpu_kit.clear_kit(user)
    assert (user / "chapter1.tex").read_text() == "keep me" and not (user / gpu_kit.MARKER).exists()
    (tmp_path / "notes.txt").write_text("a file")
    with pytest.raises(SystemExit, match="not a folder this tool made"):
        gpu_kit.clear_kit(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "a file"
    link = tmp_path / "link"
    link.symlink_to(user, target_is_directory=True)
    with pytest.raises(SystemExit, match="not a folder this tool made"):
        gpu_kit.clear_kit(link)
    assert (user / "chapter1.tex").exists()

    kit = tmp_path / "kit"  # a new folder, then a kit made earlier: emptied and marked again
    gpu_kit.clear_kit(kit)
    (kit / "model").mkdir()
    (kit / "model" / "old.safetensors").write_text("old")
    gpu_kit.clear_kit(kit)
    assert sorted(p.name for p in kit.iterdir()) == [gpu_kit.MARKER]
    empty = tmp_path / "empty"  # an empty folder holds nothing to lose
    empty.mkdir()
    gpu_kit.clear_kit(empty)
    assert (empty / gpu_kit.MARKER).exists()


def test_seeds_without_content_fingerprints_that_read_different_builds_are_marked():
    # issue 32: aflite seed 0 and z_aug seed 0 had no content fingerprint, and their release had been rebuilt
    # (another manifest sha256, another commit) before seeds 1-2 trained: "not recorded" hid it
    aflite = [{"kind": "release_dir", "release_manifest_sha256": "2aa7", "fingerprint": "x"},
              {"kind": "release_dir", "release_manifest_sha256": "c0a2", "fingerprint": "y"},
              {"kind": "release_dir", "release_manifest_sha256": "c0a2", "fingerprint": "z", "content_fingerprint": "e" * 16}]
    builds = {s: efficacy._build_of(d) for s, d in enumerate(aflite)}
    fps = {s: d.get("content_fingerprint") for s, d in enumerate(aflite)}
    assert efficacy._same_rows(fps, builds=builds) == (
        "**maybe not**: the seeds read different builds (s0 b1, s1 b2, s2 b2); contents not recorded for seed 0, 1")
    z_aug = {0: {"kind": "release", "built_at_commit": "76a7"}, 1: {"kind": "release", "built_at_commit": "d6a6",
                                                                     "content_fingerprint": "b" * 16}}
    assert efficacy._same_rows({s: d.get("content_fingerprint") for s, d in z_aug.items()},
                               builds={s: efficacy._build_of(d) for s, d in z_aug.items()}).startswith("**maybe not**")
    # the same build, or contents known to be the same across builds: not marked; datasets' own fingerprint
    # (path and mtime) is no sign of other rows
    same = {s: efficacy._build_of({"built_at_commit": "76a7", "fingerprint": str(s)}) for s in (0, 1)}
    assert efficacy._same_rows({0: None, 1: "b" * 16}, builds=same) == "one seed (`bbbbbbbb`); not recorded for seed 0"
    rebuilt_same = {0: "commit:a", 1: "commit:b"}
    assert efficacy._same_rows({0: "b" * 16, 1: "b" * 16}, builds=rebuilt_same) == "yes (`bbbbbbbb`)"
    assert efficacy._build_of({"kind": "files", "fingerprint": "e902"}) is None


def test_the_gpu_kit_names_the_largest_folders_when_over_the_limit():
    from benchmarks import gpu_kit

    files = {"benchmarks/results/seqz_cpu/G/adapter.safetensors": 9_800_000, "benchmarks/results/seqz_cpu/G/tok.json": 3_500_000,
             "benchmarks/results/efficacy.png": 290_000, "debiased_nli/cli/main.py": 20_000, "README.md": 9_000}
    top = gpu_kit.largest_folders(files, depth=3, n=3)
    assert top == [("benchmarks/results/seqz_cpu", 13_300_000), ("benchmarks/results/efficacy.png", 290_000),
                   ("debiased_nli/cli/main.py", 20_000)]
