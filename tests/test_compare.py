"""`debiased-nli compare` (debiased_nli.evaluation.compare): per-row predictions and fingerprints of every unit, the
epoch selected on held-out rows that are then not scored, the report's statistics against seed_row_interval and
Holm directly (clusters, machines, the intervals that match the calls), the seeds-only fallback for units without
predictions, stale and impossible units, the card, the Hub push, and the committed reports' calls.

A tiny BERT from a config trains on 48 SNLI rows and is scored on 24 rows of two sets, so the bookkeeping is
tested end to end without the real model (the wheel / kill / resume test is in test_packaging.py).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import yaml

from debiased_nli.utils.provenance import file_sha256
from debiased_nli.evaluation.significance import correct, seed_row_interval
from debiased_nli.evaluation.compare import load_plan, run
from debiased_nli.evaluation.compare import report as report_module
from debiased_nli.evaluation.compare import units
from debiased_nli.utils.errors import ConfigError
from test_training import make_tiny_bert

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
N_TRAIN = 48
SETS = ["snli_dev", "anli"]


@pytest.fixture(scope="module")
def done(tmp_path_factory, shared_data):
    tmp = tmp_path_factory.mktemp("compare")
    train = pd.read_parquet(shared_data / "snli" / "train_sample.parquet").head(N_TRAIN)
    train.to_parquet(tmp / "train.parquet")
    dev = pd.read_parquet(shared_data / "snli" / "dev.parquet")
    texts = list(train.premise) + list(train.hypothesis) + list(dev.premise.head(500)) + list(dev.hypothesis.head(500))
    texts += list(pd.read_parquet(shared_data / "anli" / "test.parquet").head(300).premise)
    model = make_tiny_bert(tmp / "encoder", texts)
    plan = {
        "task": "snli", "model": "encoder", "seeds": [0, 1], "runs_dir": "runs", "results_dir": "results/compare",
        "train": {"learning_rate": 1e-3, "batch_size": 16, "max_length": 48, "epochs": 1, "threads": 1},
        "select_on": {"set": "snli_dev", "rows": 20, "seed": 0},
        "evaluate": {"sets": SETS, "max_length": 48, "batch_size": 16, "max_examples": 24, "threads": 1},
        "releases": {"small": {"recipe": str(ROOT / "builders" / "snli.yaml"), "data_files": ["train=train.parquet"]}},
        "rows": [
            {"name": "original", "data": {"files": ["train.parquet"]}},
            {"name": "z_filtered", "data": {"release": "small", "config": "z_filtered"},
             "compare_with": {"row": "random_control", "why": "same size"}},
            {"name": "random_control", "data": {"random_subset_of": "original", "size_of": "z_filtered", "seed": "unit"}},
        ],
        "primary": [{"row": "z_filtered", "against": "random_control", "sets": ["anli"]},
                    {"row": "z_filtered", "against": "original"}],
        "statistics": {"level": 0.95},
    }
    (tmp / "plan.yaml").write_text(yaml.safe_dump(plan))
    assert model == tmp / "encoder"
    p = load_plan(tmp / "plan.yaml")
    run(p, progress=False)
    return p


def _scored_rows(plan, set_name):
    """The rows a unit scores on a set, recomputed: the set, without the selection rows, then the seeded sample."""
    from debiased_nli.models.challenge import get_set, load_challenge_set
    from debiased_nli.evaluation.scores import sample_rows

    ds = load_challenge_set(get_set(set_name))
    _, excluded, _ = units.selection_rows(plan)
    if set_name in excluded:
        keep = ~np.isin(np.asarray(ds["row"]), excluded[set_name])
        ds = ds.select(np.flatnonzero(keep))
    return sample_rows(ds, plan.evaluate["max_examples"], 0)


def test_every_unit_stores_compact_predictions_with_the_fingerprints_of_the_rows(done):
    from debiased_nli.data.loading import content_fingerprint

    plan = done
    scored = {s: _scored_rows(plan, s) for s in SETS}
    for row in ("original", "z_filtered", "random_control"):
        for seed in plan.seeds:
            unit = json.loads(plan.unit_file(row, seed).read_text())
            assert unit["schema"] == units.SCHEMA
            path = plan.results_dir / unit["predictions"]["file"]
            assert path == plan.predictions_file(row, seed) and path.suffix == ".npz"
            assert unit["predictions"]["sha256"] == file_sha256(path)
            meta, arrays = units.read_predictions(path)
            assert meta["train_fingerprint"] == unit["data"]["content_fingerprint"] == unit["predictions"]["train_fingerprint"]
            for s in SETS:
                a = arrays[s]
                assert a["predicted"].dtype == np.int8 and a["gold"].dtype == np.int8
                assert a["gold_probability"].dtype == np.float16
                assert len(a["predicted"]) == unit["sets"][s]["n"] == 24
                # the rows scored: their content fingerprint, recorded in the unit and in the file
                assert meta["sets"][s]["rows_fingerprint"] == unit["sets"][s]["rows_fingerprint"] \
                    == content_fingerprint(scored[s])
                assert (a["gold"] == np.asarray(scored[s]["label"])).all()
                assert np.mean(a["predicted"] == a["gold"]) == pytest.approx(unit["sets"][s]["accuracy"])
                assert ((a["gold_probability"] >= 0) & (a["gold_probability"] <= 1)).all()


def test_the_gold_probability_is_the_models_probability_of_the_gold_label(done):
    from debiased_nli.models.challenge import get_set
    from debiased_nli.models.classifier import load_classifier, predict_probabilities

    plan = done
    clf = load_classifier(str(plan.model_dir("original", 0)), "cpu")
    ds = _scored_rows(plan, "anli")
    probs = predict_probabilities(clf, ds["premise"], ds["hypothesis"], batch_size=16, max_length=48, progress=False)
    _, arrays = units.read_predictions(plan.predictions_file("original", 0))
    names = [clf.id2label[i] for i in range(probs.shape[1])]
    spec = get_set("anli")
    gold = [names.index(spec.labels[g]) for g in ds["label"]]
    np.testing.assert_allclose(arrays["anli"]["gold_probability"].astype(float), probs[np.arange(len(ds)), gold],
                               atol=1e-3)  # float16


def test_the_epoch_is_selected_on_held_out_rows_that_are_then_not_scored(done):
    from debiased_nli.models.challenge import get_set, load_challenge_set

    plan = done
    dev, excluded, info = units.selection_rows(plan)
    assert len(dev) == 20 and len(excluded["snli_dev"]) == 20 and info["excluded_from_scoring"]
    full = load_challenge_set(get_set("snli_dev"))
    assert excluded["snli_dev"] == sorted(np.random.default_rng(0).permutation(len(full))[:20].tolist())
    unit = json.loads(plan.unit_file("original", 0).read_text())
    assert unit["sets"]["snli_dev"]["excluded_rows"] == 20 and unit["train"]["dev_rows"] == 20
    assert unit["selection"]["kind"] == "held_out" and unit["selection"]["fingerprint"]
    # the selection rows, as a file the recorded `debiased-nli train` command reads
    sel = pd.read_parquet(plan.model_dir("original", 0) / units.SELECTION_FILE)
    assert list(sel.hypothesis) == list(dev["hypothesis"])
    assert "--dev-files validation=runs/models/original-s0/selection.parquet" in unit["train"]["command"]
    scored = set(_scored_rows(plan, "snli_dev")["hypothesis"])
    assert not scored & set(sel.hypothesis)
    table = report_module.report(plan)
    md = (plan.results_dir.parent / "compare.md").read_text()
    assert "held out with seed 0" in md and "is scored without them" in md
    assert "`snli_dev` (20 rows left out)" in md
    assert table["rows"]["original"]["sets"]["snli_dev"]["excluded_rows"] == 20


def _matrix(plan, row, set_name):
    rows = []
    for seed in plan.seeds:
        _, arrays = units.read_predictions(plan.predictions_file(row, seed))
        rows.append(arrays[set_name]["predicted"] == arrays[set_name]["gold"])
    return np.vstack(rows)


def test_the_reports_statistics_are_seed_row_intervals_and_holm_over_the_primary_comparisons(done):
    plan = done
    table = report_module.report(plan)
    st = table["statistics"]
    comps = {(c["row"], c["against"]): c for c in st["comparisons"]}
    # the primary family: z_filtered - random_control on anli, z_filtered - original on both sets
    family = [("z_filtered", "random_control", "anli"), ("z_filtered", "original", "snli_dev"),
              ("z_filtered", "original", "anli")]
    direct = [seed_row_interval(_matrix(plan, a, s), _matrix(plan, b, s)) for a, b, s in family]
    corrected = correct(direct, "holm")
    assert st["primary_tests"] == 3 and st["correction"] == "holm" and st["monte_carlo_se"] == 0.0
    for (a, b, s), d in zip(family, corrected):
        e = comps[a, b]["sets"][s]
        assert e["family"] == "primary" and e["machines"] == "one machine" and e["cluster_column"] is None
        assert (e["estimate"], e["low"], e["high"], e["p_value"], e["df"]) == (d.estimate, d.low, d.high, d.p_value, d.df)
        assert e["p_adjusted"] == d.p_adjusted and e["text"] == d.describe()
        # the call and the interval shown with it are one: the adjusted interval excludes 0 exactly when called
        assert (e["adjusted_low"], e["adjusted_high"]) == (d.adjusted_low, d.adjusted_high)
        assert (e["adjusted_low"] > 0 or e["adjusted_high"] < 0) == e["distinguishable"] == (e["p_adjusted"] < 0.05)
    # a secondary comparison (and a primary one's other sets) are uncorrected
    e = comps["z_filtered", "random_control"]["sets"]["snli_dev"]
    d = seed_row_interval(_matrix(plan, "z_filtered", "snli_dev"), _matrix(plan, "random_control", "snli_dev"))
    assert e["family"] == "secondary" and e["p_adjusted"] is None and e["text"] == d.describe()
    assert e["adjusted_low"] is None and e["distinguishable"] == (e["low"] > 0 or e["high"] < 0)
    e = comps["random_control", "original"]["sets"]["anli"]
    assert e["family"] == "secondary" and e["estimate"] == seed_row_interval(
        _matrix(plan, "random_control", "anli"), _matrix(plan, "original", "anli")).estimate
    md = (plan.results_dir.parent / "compare.md").read_text()
    assert "Holm (family-wise error rate)" in md and "**Secondary comparisons**" in md and "**uncorrected**" in md
    assert "no Monte Carlo error" in md and "the level of the Holm step that tested it" in md
    assert "* =" not in md.split("## Verdict")[0].split("## Differences")[1]  # no asterisks where intervals exist
    assert corrected[0].describe() in md
    # rounded once: the markdown's figure is the unrounded estimate formatted once
    assert f"{comps['z_filtered', 'original']['sets']['anli']['estimate']:+.1f} [" in md
    # the evaluation's batch size where the plan gives one, never "None"
    assert "at most 16 rows per batch" in md and "None" not in md.split("## Accuracy")[0]
    # closed form: a second report gives the same figures
    again = report_module.summarise(plan)["statistics"]
    assert again["comparisons"] == st["comparisons"]


def test_a_set_can_name_a_cluster_column_and_its_rows_variance_is_taken_between_clusters(done, shared_data):
    """The same units with ANLI declared as clustered by round (3 clusters): the statistics read the clusters from
    the set on disk (the units' content fingerprint checked) and the interval widens; a set whose rows on disk are
    not the ones scored is said to have unknown clusters, its rows treated as independent."""
    from debiased_nli.evaluation.compare import stats

    raw = yaml.safe_load(done.path.read_text())
    anli = yaml.safe_load((ROOT / "evaluation" / "sets" / "anli.yaml").read_text())
    anli["local"] = str(shared_data / anli["local"])  # an inline spec's file is relative to the plan's folder
    raw["evaluate"] = dict(raw["evaluate"], sets=["snli_dev", dict(anli, cluster="round")])
    (done.path.parent / "clustered.yaml").write_text(yaml.safe_dump(raw))
    plan = load_plan(done.path.parent / "clustered.yaml")
    table = report_module.summarise(plan)
    st = table["statistics"]
    assert st["clusters"]["anli"] == {"column": "round", "groups": 3,
                                      "source": "the set's column, read from disk (content fingerprint checked)"}
    e = next(c for c in st["comparisons"] if (c["row"], c["against"]) == ("z_filtered", "original"))["sets"]["anli"]
    rounds = _scored_rows(plan, "anli")["round"]
    d = seed_row_interval(_matrix(plan, "z_filtered", "anli"), _matrix(plan, "original", "anli"), clusters=rounds)
    assert (e["estimate"], e["low"], e["high"], e["clusters"], e["cluster_column"]) == (
        d.estimate, d.low, d.high, 3, "round")
    sides = stats.Sides(plan, {})
    gone = sides.clusters("anli", "0" * 16, None)
    assert gone["codes"] is None and "other rows than the ones scored" in gone["note"]


def test_units_without_predictions_fall_back_to_the_seeds_only_view_labelled(done, tmp_path):
    plan = done
    res = tmp_path / "res"
    shutil.copytree(plan.results_dir, res)
    for seed in plan.seeds:  # as units written before predictions were kept
        path = res / f"original-s{seed}.json"
        unit = json.loads(path.read_text())
        unit["schema"] = "debiased-nli/efficacy-unit/v1"
        for key in ("predictions", "selection"):
            unit.pop(key)
        path.write_text(json.dumps(unit))
    p = load_plan(plan.path, results_dir=str(res))
    table = report_module.report(p, tmp_path / "old")
    st = table["statistics"]
    assert st["coverage"]["original"] == {"with": [], "without": [0, 1]}
    comps = {(c["row"], c["against"]): c for c in st["comparisons"]}
    e = comps["z_filtered", "original"]["sets"]["anli"]
    assert "no stored per-row predictions" in e["unavailable"] and e["seeds_only"]["call"]
    assert st["primary_tests"] == 1 and st["primary_tests_unavailable"] == 2  # the family shrinks, and says so
    assert "text" in comps["z_filtered", "random_control"]["sets"]["anli"]
    md = (tmp_path / "old.md").read_text()
    assert "**Without stored predictions**" in md and "`original` (seeds 0, 1)" in md
    assert "### Seeds-only view: difference from `original`" in md
    assert "**z_filtered** vs original — seeds only, no stored predictions" in md
    assert "2 primary test(s) could not be computed" in md


def test_a_release_card_reads_the_new_report_and_the_old_one(done, tmp_path):
    from debiased_nli.release.efficacy import card_markdown

    plan = done
    table = report_module.report(plan)
    new = plan.results_dir.parent / "compare.json"
    text = card_markdown(new, ["z_filtered"])
    comp = next(c for c in table["statistics"]["comparisons"] if (c["row"], c["against"]) == ("z_filtered", "random_control"))
    assert comp["sets"]["anli"]["text"] in text and "seed-row t interval" in text and "*" not in text.split("\n\n")[-1]
    # the difference from the original data comes with its interval, before the declared comparisons
    ref = next(c for c in table["statistics"]["comparisons"] if (c["row"], c["against"]) == ("z_filtered", "original"))
    line = next(l for l in text.splitlines() if l.startswith("| `z_filtered` − `original` |"))
    assert "against the original data" in line and ref["sets"]["anli"]["text"] in line
    assert text.index(line) < text.index("| `z_filtered` − `random_control` |")
    # a plan that also declares the comparison with the original gets one line for it, not two
    t = json.loads(new.read_text())
    t["comparisons"].append({"row": "z_filtered", "against": "original", "why": "declared", "sets": {}})
    (tmp_path / "declared.json").write_text(json.dumps(t))
    assert card_markdown(tmp_path / "declared.json", ["z_filtered"]).count("| `z_filtered` − `original` |") == 1
    old = ROOT / "benchmarks" / "results" / "efficacy.json"  # a v1 table, committed before this change
    text = card_markdown(old, ["z_filtered"])
    assert "| `z_filtered` − `random_control` |" in text and "-2.5*" in text and "seeds only" in text
    assert "− `original` |" not in text  # a v1 table has no intervals against the reference


def test_a_plan_is_checked_before_any_work(done, tmp_path):
    raw = yaml.safe_load(done.path.read_text())
    bad = dict(raw, primary=[{"row": "z_filtered", "against": "nope"}])
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="primary comparison names 'nope'"):
        load_plan(tmp_path / "p.yaml")
    bad = dict(raw, primary=[{"row": "z_filtered", "against": "original", "sets": ["hans"]}])
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="names set 'hans', which is not scored"):
        load_plan(tmp_path / "p.yaml")
    bad = dict(raw, select_on={"set": "snli_dev"})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="select_on is"):
        load_plan(tmp_path / "p.yaml")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(dict(raw, selct_on={})))
    with pytest.raises(ConfigError, match="unknown key"):
        load_plan(tmp_path / "p.yaml")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(dict(raw, seeds=[True])))  # YAML's `true` is no seed 1
    with pytest.raises(ConfigError, match=r"seeds must be a list of integers from 0 to \d+ .*got \[True\]"):
        load_plan(tmp_path / "p.yaml")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(dict(raw, statistics={"level": 95})))
    with pytest.raises(ConfigError, match="statistics.level is 95, not a number in"):
        load_plan(tmp_path / "p.yaml")


def test_the_cli_status_and_report(done, capsys):
    from debiased_nli.cli import main

    assert main(["compare", "status", str(done.path)]) == 0
    out = capsys.readouterr().out
    assert "z_filtered" in out and "6 done, 0 stale, 0 trained, 0 todo, 0 pending" in out
    assert main(["compare", "report", str(done.path), "--quiet"]) == 0
    assert "report: 6 of 6 units finished" in capsys.readouterr().out
    assert main(["compare", "--help"]) == 0
    assert "primary comparisons" in capsys.readouterr().out
    # --out into a folder that does not exist yet: made, not a failure after the bootstrap
    stem = done.path.parent / "new" / "deeper" / "report"
    assert main(["compare", "report", str(done.path), "--out", str(stem), "--quiet"]) == 0
    capsys.readouterr()
    assert all(stem.with_suffix(x).is_file() for x in (".md", ".json", ".png"))
    # the forest of the declared comparisons' intervals, shown under the statistics heading
    assert stem.with_name("report_intervals.png").is_file()
    md = stem.with_suffix(".md").read_text()
    assert md.index("## Differences with 95% intervals") < md.index("![differences with 95% intervals](report_intervals.png)")


def test_the_evaluation_report_goes_beside_the_release_on_the_hub(done, tmp_path, monkeypatch):
    import huggingface_hub.constants as c
    from fake_hub import FakeHub

    from debiased_nli.evaluation.compare.hub import push_report, read_model_index
    from debiased_nli.release.publish import push_release

    plan = done
    table = report_module.report(plan)
    stem = plan.results_dir.parent / "compare"
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with FakeHub() as hub:
        push_release(plan.release_dir("small"), "org/snli", revision="v1.0", token="hf_x", endpoint=hub.url)
        info = push_report(plan, table, stem, "org/snli", token="hf_x", endpoint=hub.url)
        _, files = hub.snapshot("org/snli", "main")
    assert {"evaluation/README.md", "evaluation/compare.md", "evaluation/compare.json", "evaluation/compare.png",
            "evaluation/compare_intervals.png"} <= set(files)
    assert "data/z_filtered/train-00000-of-00001.parquet" in files  # the release is untouched
    assert info["trained_on"]["z_filtered"]["revision"] == "v1.0" and info["trained_on"]["z_filtered"]["dataset"] == "org/snli"
    assert "files" in info["trained_on"]["original"] and "revision" not in info["trained_on"]["original"]
    rc = info["trained_on"]["random_control"]  # a subset of the local file: no Hub revision, and it says what it is
    assert "revision" not in rc and rc["text"].startswith("a random subset of `original`") and "drawn anew per seed" in rc["text"]
    index = read_model_index(files["evaluation/README.md"].decode())
    from huggingface_hub.repocard_data import model_index_to_eval_results

    by_model = {}
    for entry in index:
        name, results = model_index_to_eval_results([entry])
        by_model[name] = results
    zf = by_model["encoder trained on z_filtered"]
    acc = [r for r in zf if r.metric_type == "accuracy"]
    assert [r.dataset_type for r in acc] == ["stanfordnlp/snli"]  # anli's local file is not marked as the Hub's rows
    assert acc[0].metric_value == round(table["rows"]["z_filtered"]["sets"]["snli_dev"]["mean"], 6)
    assert acc[0].metric_args["trained_on"]["revision"] == "v1.0" and acc[0].metric_args["seeds"] == [0, 1]
    assert acc[0].dataset_args["rows_left_out"] == 20 and "without the 20 rows" in acc[0].dataset_name
    assert "anli" in " ".join(info["notes"])


def test_primary_tests_whose_rows_have_no_finished_unit_count_as_p_1_in_the_family(done, tmp_path):
    res = tmp_path / "res"
    shutil.copytree(done.results_dir, res)
    full = report_module.report(load_plan(done.path, results_dir=str(res)), tmp_path / "full")["statistics"]
    row = next(c["row"] for c in full["comparisons"] if c["primary"])  # its row has no finished unit yet
    for f in res.glob(f"{row}-s*.json"):
        f.unlink()
    st = report_module.report(load_plan(done.path, results_dir=str(res)), tmp_path / "part")["statistics"]
    assert st["primary_tests_pending"] > 0 and st["primary_tests"] + st["primary_tests_pending"] == full["primary_tests"]
    left = {(c["row"], c["against"], s): e for c in st["comparisons"] for s, e in c["sets"].items()
            if e["family"] == "primary"}
    for c in full["comparisons"]:  # the same p-values over the plan's whole family, the missing ones at p = 1
        for s, e in c["sets"].items():
            if (c["row"], c["against"], s) in left:
                assert left[c["row"], c["against"], s]["p_adjusted"] >= e["p_adjusted"] - 1e-12
    assert "wait for rows with no finished unit" in (tmp_path / "part.md").read_text()


def test_a_report_says_which_seeds_ran_on_which_machine(done, tmp_path):
    """A plan whose seeds ran on two machines (seeds 0-2 on a CPU, 3-4 on a lent GPU) says so in its header,
    rather than naming only the GPU."""
    plan = done
    res = tmp_path / "res"
    shutil.copytree(plan.results_dir, res)
    gpu = "NVIDIA H100 80GB HBM3 (CUDA 13.0, torch 2.11.0+cu130)"
    cpu = json.loads((res / "original-s0.json").read_text())["device"]
    for path in res.glob("*-s1.json"):  # as if seed 1 of every row had run on the GPU
        unit = json.loads(path.read_text())
        unit["device"] = gpu
        path.write_text(json.dumps(unit))
    p = load_plan(plan.path, results_dir=str(res))
    table = report_module.report(p, tmp_path / "mixed")
    assert table["device_units"] == {cpu: {r: [0] for r in ("original", "z_filtered", "random_control")},
                                     gpu: {r: [1] for r in ("original", "z_filtered", "random_control")}}
    md = (tmp_path / "mixed.md").read_text()
    assert (f"units on different machines: seed 0 of every row on 1 CPU threads ({cpu}); "
            f"seed 1 of every row on {gpu}") in md
    assert "Times are wall-clock on the machine each unit ran on" in md
    one = report_module.report(plan, tmp_path / "one")  # one machine: the header as before
    assert len(one["device_units"]) == 1 and "units on different machines" not in (tmp_path / "one.md").read_text()


def test_a_report_names_only_the_machines_of_its_own_seeds(done, tmp_path):
    """A results folder shared with another plan (efficacy_seqz beside the headline plan) may hold units of seeds
    this plan does not have, from another machine: the report neither counts nor names them."""
    plan = done
    res = tmp_path / "res"
    shutil.copytree(plan.results_dir, res)
    gpu = "NVIDIA H100 80GB HBM3 (CUDA 13.0, torch 2.11.0+cu130)"
    unit = json.loads((res / "original-s0.json").read_text())
    unit.update(seed=7, device=gpu)  # another plan's seed 7, on a GPU
    (res / "original-s7.json").write_text(json.dumps(unit))
    p = load_plan(plan.path, results_dir=str(res))
    table = report_module.report(p, tmp_path / "shared")
    assert table["devices"] == [json.loads((res / "original-s0.json").read_text())["device"]]
    assert gpu not in (tmp_path / "shared.md").read_text()


def _copy_plan(done, tmp_path):
    """The module's plan folder (encoder, runs, results) copied, so that a test may change its data and rerun."""
    shutil.copytree(done.path.parent, tmp_path / "copy", ignore=shutil.ignore_patterns("claims", "logs"))
    return load_plan(tmp_path / "copy" / done.path.name)


def _record_rebuilt_file(release: Path, part: Path) -> None:
    """The manifest of a release whose data file ``part`` was rewritten records the new file's sha256 and size."""
    import hashlib

    manifest = json.loads((release / "manifest.json").read_text())
    rel = part.relative_to(release).as_posix()
    found = False
    for splits in manifest["files"].values():
        for entries in splits.values():
            for f in entries:
                if f.get("path") == rel:
                    f["sha256"] = hashlib.sha256(part.read_bytes()).hexdigest()
                    if "bytes" in f:
                        f["bytes"] = part.stat().st_size
                    found = True
    assert found, rel
    (release / "manifest.json").write_text(json.dumps(manifest, indent=2))


def test_a_unit_whose_rows_release_changed_is_stale_and_run_trains_it_again(done, tmp_path, capsys):
    """A row's release rebuilt after the run (one row fewer): status says stale for its units (and for the random
    control of its size, whose subsets changed with it), the report leaves them out and says so, and run sets the
    old files aside and trains the unit again, with an estimate of the time left."""
    from debiased_nli.evaluation.compare import unit_states
    from debiased_nli.evaluation.compare.units import load_units

    plan = _copy_plan(done, tmp_path)
    part = next((plan.release_dir("small") / "data" / "z_filtered").glob("*.parquet"))
    old_fp = load_units(plan)["z_filtered"][0]["data"]["content_fingerprint"]
    pd.read_parquet(part).iloc[:-1].to_parquet(part)
    _record_rebuilt_file(plan.release_dir("small"), part)  # as a rebuild's manifest records its new file
    states = {(s["row"], s["seed"]): s for s in unit_states(plan)}
    assert {k: v["state"] for k, v in states.items()} == {
        ("original", 0): "done", ("original", 1): "done", ("z_filtered", 0): "stale", ("z_filtered", 1): "stale",
        ("random_control", 0): "stale", ("random_control", 1): "stale"}
    assert f"it trained on rows {old_fp[:8]}" in states["z_filtered", 0]["reason"]
    table = report_module.report(plan, tmp_path / "stale")
    assert table["rows"]["z_filtered"]["seeds_done"] == [] and table["rows"]["z_filtered"]["seeds_stale"] == [0, 1]
    assert "**Stale units, left out of every figure below**: `z_filtered` seeds 0, 1" in (tmp_path / "stale.md").read_text()
    capsys.readouterr()
    run(plan, rows=["z_filtered"], seeds=[0], progress=False)
    err = capsys.readouterr().out
    assert "stale z_filtered seed 0" in err and "unit 1/1 (z_filtered seed 0): this unit ~" in err
    assert "finished unit 1/1 (z_filtered seed 0)" in err
    assert (plan.results_dir / "stale" / f"z_filtered-s0-{old_fp[:8]}.json").is_file()
    assert (plan.results_dir / "stale" / f"z_filtered-s0-{old_fp[:8]}.npz").is_file()
    new = json.loads(plan.unit_file("z_filtered", 0).read_text())
    assert new["data"]["content_fingerprint"] != old_fp and new["train"]["rows"] == len(pd.read_parquet(part))
    assert "content_fingerprint_now" not in new["data"]
    states = {(s["row"], s["seed"]): s["state"] for s in unit_states(plan)}
    assert states["z_filtered", 0] == "done" and states["z_filtered", 1] == "stale"


def test_the_progress_line_estimates_the_time_left():
    from debiased_nli.evaluation.compare.units import progress_line

    assert progress_line(1, 4, "aflite", 2, [], []) == "unit 1/4 (aflite seed 2): no estimate until the first unit finishes"
    assert progress_line(3, 4, "aflite", 2, [100.0, 140.0], [1.0]) == (
        "unit 3/4 (aflite seed 2): this unit ~2m00s, all 2 left ~4m00s (mean of 2 of this run's units)")
    assert progress_line(1, 25, "x", 0, [], [1500.0] * 3).endswith(
        "this unit ~25m00s, all 25 left ~10h25m (mean of 3 of the finished units on record)")


@pytest.mark.parametrize("field,value,message", [
    ("accuracy", 7.5, "sets.anli.accuracy is 7.5, not an accuracy in [0, 1]"),
    ("accuracy", "0.5", "sets.anli.accuracy is '0.5', not an accuracy in [0, 1]"),
    ("seed", True, "seed is True, not a non-negative integer"),
    ("n", 0, "sets.anli.n is 0, not a positive number of rows"),
])
def test_an_impossible_unit_file_is_one_line_naming_the_file_the_field_and_the_value(done, tmp_path, capsys, field,
                                                                                     value, message):
    from debiased_nli.cli import main

    res = tmp_path / "res"
    shutil.copytree(done.results_dir, res)
    path = res / "original-s0.json"
    unit = json.loads(path.read_text())
    if field == "seed":
        unit["seed"] = value
    else:
        unit["sets"]["anli"][field] = value
    path.write_text(json.dumps(unit))
    for action in ("status", "report"):
        assert main(["compare", action, str(done.path), "--results-dir", str(res), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and str(path) in err and message in err and "\n" not in err


def test_every_published_primary_call_is_the_same_at_20_bootstrap_seeds_and_matches_its_interval():
    """The committed plans' statistics recomputed from their unit files: the committed report JSON's figures and
    calls, whatever the plan's (legacy) bootstrap seed, with no Monte Carlo error; every primary call's adjusted
    interval excludes 0 exactly when the call is made."""
    from debiased_nli.evaluation.compare import stats
    from debiased_nli.evaluation.compare.units import load_units

    for name in ("efficacy_headline", "efficacy_headline_gpu", "efficacy_seqz"):
        plan = load_plan(ROOT / "benchmarks" / f"{name}.yaml")
        committed = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())["statistics"]
        rows = report_module.summarise(plan, statistics=False)["rows"]
        units = load_units(plan)

        def calls(st):
            return {(c["row"], c["against"], s): (e["estimate"], e.get("p_adjusted"), e["distinguishable"])
                    for c in st["comparisons"] for s, e in c["sets"].items() if e["family"] == "primary"}

        published = calls(committed)
        assert committed["monte_carlo_se"] == 0.0 and len(published) == 8
        for seed in range(20):
            plan.raw["bootstrap"] = {"replicates": 10_000, "seed": seed}
            assert calls(stats.compute(plan, units, rows)) == published
        for c in committed["comparisons"]:
            for e in c["sets"].values():
                if e["family"] == "primary":
                    assert (e["adjusted_low"] > 0 or e["adjusted_high"] < 0) == e["distinguishable"]
                    assert e["p_mc_se"] == 0.0
