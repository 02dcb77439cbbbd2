"""``debiased-nli pipeline``: builders/seqz.yaml (the CPU Seq-Z pipeline) run as resumable stages with tiny models
built from a config: each stage's done-record, the status (pending, partial with k/n shards, done, stale,
skipped), a rerun that redoes nothing, a bounded sampling session continued, and nothing written outside the
run folder."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from debiased_nli.pipeline import STAGES, Pipeline
from debiased_nli.release.recipe import load_recipe
from debiased_nli.utils.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ROWS = 36


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_data):
    """D0 (36 SNLI rows), a tiny GPT-2 that ends its texts early (G's base), a tiny BERT classifier (M's base)."""
    import datasets

    from pdd_helpers import tiny_classifier, tiny_tokenizer
    from test_generation_sample import eos_generator

    root = tmp_path_factory.mktemp("pipeline_models")
    rows = datasets.load_dataset("parquet", data_files=str(shared_data / "snli/train_sample.parquet"), split="train")
    rows = rows.shuffle(seed=0).select(range(ROWS))
    rows.to_parquet(str(root / "d0.parquet"))
    tok = tiny_tokenizer([str(t) for c in ("premise", "hypothesis") for t in rows[c]])
    tiny_classifier(tok).save_pretrained(root / "classifier")
    tok.save_pretrained(root / "classifier")
    return {"d0": str(root / "d0.parquet"), "generator": eos_generator(root / "generator"),
            "classifier": str(root / "classifier")}


def tiny_recipe(tiny, elsewhere: Path) -> dict:
    """builders/seqz.yaml with only the models, the sizes and the recipe's `out` folders (``elsewhere``) changed."""
    rec = copy.deepcopy(load_recipe(ROOT / "builders" / "seqz.yaml"))
    step = rec["new_rows"][0]
    step["train"].update(model=tiny["generator"], out=str(elsewhere / "G"), max_steps=1, batch_size=4, lr=1e-9,
                         mixed_precision=None)
    step["train_m"].update(model=tiny["classifier"], out=str(elsewhere / "M"), epochs=1, batch_size=8, max_length=32,
                           dev_files=None, progress=False)
    # a random model cannot write a whole row: given the premise and the label, about half its samples parse
    step["generate"].update(out=str(elsewhere / "samples"), num_samples=12, shard_size=4, batch_size=4,
                            max_new_tokens=6, condition="premise+label", dtype=None, progress=False)
    step["confidence"].update(taus=[0.0, 0.3], min_kept=2, batch_size=16, progress=False)
    rec["features"].update(folds=2)
    rec["z_filter"].update(batch_size=16)
    rec.pop("profile", None)
    return rec


def test_the_seqz_recipe_runs_as_stages_resumes_and_says_where_it_stands(tiny, tmp_path):
    elsewhere = tmp_path / "recipe_outs"
    rec = tiny_recipe(tiny, elsewhere)
    run = tmp_path / "run"
    said: list[str] = []
    pipe = Pipeline(rec, run, data_files=[f"train={tiny['d0']}"], progress=False, echo=said.append)
    before = {s.stage: s.state for s in pipe.status()}
    assert before == {"train_g": "pending", "train_g_star": "skipped", "train_m": "pending", "sample": "pending",
                      "filter": "pending", "build": "pending", "audit": "pending"}

    # a bounded session: G and M trained, one shard of three sampled, and the run stops there
    states = {s.stage: s for s in pipe.run(units=1)}
    assert states["train_g"].state == "done" and states["train_m"].state == "done"
    assert states["sample"].state == "partial" and states["sample"].detail.startswith("1/3 shards")
    assert states["filter"].state == "pending"
    first = sorted((run / "samples").glob("shard-*.parquet"))
    stamp = {p.name: p.stat().st_mtime_ns for p in first}

    # the next run continues: the missing shards only, then every later stage
    said.clear()
    states = {s.stage: s for s in Pipeline(rec, run, data_files=[f"train={tiny['d0']}"], progress=False,
                                           echo=said.append).run()}
    assert [s for s in STAGES if states[s].state != "done"] == ["train_g_star"]
    assert "train_g: done" in said[0] and {p.name: p.stat().st_mtime_ns for p in first} == stamp
    assert len(list((run / "samples").glob("shard-*.parquet"))) == 3
    cfg = json.loads((run / "samples" / "generate_config.json").read_text())
    assert cfg["generator"] == "G"  # relative: the shards continue in another machine's run folder

    # each stage's record: the command that reruns it, its parameters, its inputs' fingerprints
    rec_filter = json.loads((run / "stages" / "filter.json").read_text())
    assert rec_filter["command"].startswith("debiased-nli pipeline run <recipe> --data-files train=")
    assert rec_filter["command"].endswith("--stages filter")
    assert rec_filter["params"]["tau_rule"] == "min_kept" and set(rec_filter["inputs"]["samples"]) == \
        {p.name for p in (run / "samples").glob("shard-*.parquet")}
    report = json.loads((run / "confident" / "confidence_report.json").read_text())
    assert report["tau"] in (0.0, 0.3) and {c["tau"] for c in report["acceptance_curve"]} == {0.0, 0.3, 0.95}
    manifest = json.loads((run / "release" / "manifest.json").read_text())
    assert report["kept"] > 0
    configs = {p.name for p in (run / "release" / "data").iterdir()}
    assert {"z_filtered", "z_aug", "par_z", "seq_z"} <= configs and manifest["label_distribution"]
    assert (run / "audits" / "original" / "audit.json").is_file() and (run / "audits" / "z_filtered").is_dir()
    assert not elsewhere.exists()  # the recipe's `out` folders are not written: everything is under the run folder

    # a rerun redoes nothing; another tau makes the filter stale (and only it, until it runs again)
    said.clear()
    Pipeline(rec, run, data_files=[f"train={tiny['d0']}"], progress=False, echo=said.append).run()
    assert all(line.split(": ")[1].startswith(("done", "skipped")) for line in said), said
    other = copy.deepcopy(rec)
    other["new_rows"][0]["confidence"]["min_kept"] = 3
    states = {s.stage: s.state for s in Pipeline(other, run, data_files=[f"train={tiny['d0']}"]).status()}
    assert states["filter"] == "stale" and states["sample"] == "done" and states["build"] == "done"
    # a sampling run made with other values is not continued as if it were this one's; more samples of it are
    other = copy.deepcopy(rec)
    other["new_rows"][0]["generate"]["top_p"] = 0.5
    with pytest.raises(ConfigError, match="sample: .*samples was made with other parameters"):
        Pipeline(other, run, data_files=[f"train={tiny['d0']}"], progress=False).run()
    more = copy.deepcopy(rec)
    more["new_rows"][0]["generate"]["num_samples"] = 16
    states = {s.stage: s for s in Pipeline(more, run, data_files=[f"train={tiny['d0']}"], progress=False).run(
        ["sample"])}
    assert states["sample"].state == "done" and states["sample"].detail.startswith("4/4 shards")
    assert not any(p.exists() for p in first)  # grown: shard i of 3 renamed to shard i of 4, the last one sampled
    assert states["filter"].state == "stale"


def test_the_run_folder_is_checked_before_any_work(tiny, tmp_path):
    rec = tiny_recipe(tiny, tmp_path / "outs")
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("not a run")
    with pytest.raises(ConfigError, match="--run"):
        Pipeline(rec, user, data_files=[f"train={tiny['d0']}"], progress=False).run(["filter"])
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    with pytest.raises(ConfigError, match="unknown stage 'sampling'"):
        Pipeline(rec, tmp_path / "r", data_files=[f"train={tiny['d0']}"]).run(["sampling"])
    with pytest.raises(ConfigError, match="needs sample, which is pending"):
        Pipeline(rec, tmp_path / "r", data_files=[f"train={tiny['d0']}"], progress=False).run(["filter"])
    no_gen = copy.deepcopy(rec)
    no_gen["new_rows"] = []
    with pytest.raises(ConfigError, match="0 generator steps"):
        Pipeline(no_gen, tmp_path / "r")
    with pytest.raises(ConfigError, match="--samples-from .*no such"):
        Pipeline(rec, tmp_path / "r", samples_from=tmp_path / "absent")


def test_until_leaves_the_later_stages_and_a_deadline_stops_the_stage_in_progress(tiny, tmp_path):
    """`until` ends the run after a stage; with a `deadline` each stage runs in a process of its own, stopped when
    the time is up (nothing recorded for it; the next run starts or continues it)."""
    rec = tiny_recipe(tiny, tmp_path / "outs")
    run = tmp_path / "run"
    said: list[str] = []
    pipe = Pipeline(rec, run, data_files=[f"train={tiny['d0']}"], progress=False, echo=said.append)
    states = {s.stage: s.state for s in pipe.run(deadline=2)}  # less than the stage's process takes to start
    assert states["train_g"] == "pending" and said[-1].startswith("train_g: ") and "deadline" in said[-1]
    assert not (run / "stages").exists()
    shown = Pipeline(rec, run, data_files=[f"train={tiny['d0']}"], progress=True, echo=said.append)
    states = {s.stage: s.state for s in shown.run(until="train_m", deadline=600)}
    assert [s for s in STAGES if states[s] == "done"] == ["train_g", "train_m"] and states["sample"] == "pending"
    log = (run / "logs" / "train_g.log").read_text()  # each process's stderr, after a line naming its command
    assert log.count("\n=== ") == 2 and "--stages train_g" in log and "train generator: 100%" in log
    record = json.loads((run / "stages" / "train_m.json").read_text())
    assert record["command"].endswith("--stages train_m") and record["params"] == pipe.params("train_m")
    with pytest.raises(ConfigError, match="deadline must be a positive"):
        pipe.run(deadline=0)


def test_status_gives_the_rate_of_a_stage_stopped_between_checkpoints(tiny, tmp_path):
    """A stage stopped at a deadline before its first checkpoint leaves only its progress bars (RUN/logs/<stage>.log,
    as the GPU run of 2026-11-28 did): `status` reads the last run's longest bar, with tqdm's own rate."""
    from debiased_nli.pipeline.run import bar_rates

    run = tmp_path / "run"
    pipe = Pipeline(tiny_recipe(tiny, tmp_path / "outs"), run, data_files=[f"train={tiny['d0']}"], progress=False)
    (run / "logs").mkdir(parents=True)
    earlier = "\n=== 10:00: train_g\r" + "train generator:   1%|   | 40/4170 [00:20<35:00,  2.00it/s]\r"
    last = ("\n=== 11:00: train_g\nloading:  100%|#| 9/9 [00:30<00:00, 0.30it/s]\r"
            "train generator:  45%|####5     | 1891/4170 [08:24<10:07,  3.75it/s, loss=3.1]\rtrain generator:  45%|####5     | 1892/4170")
    (run / "logs" / "train_g.log").write_text(earlier + last)
    st = pipe.state("train_g")
    assert st.state == "pending" and "train generator 1,891/4,170 in 504 s (3.75/s: the whole ~1,112 s, ~608 s left" in st.detail
    assert pipe.state("train_m").detail == ""  # no log: nothing said
    rates = bar_rates(earlier + last)  # of each description its last bar of 10 s or more; s/it read as its inverse
    assert rates["train generator"]["done"] == 1891 and rates["loading"]["per_s"] == 0.3 and len(rates) == 2
    assert bar_rates("filter:  10%|#  | 10/100 [00:30<04:30,  3.00s/it]")["filter"]["per_s"] == 0.333
    assert bar_rates("train generator:   0%|   | 0/4170 [00:20<?, ?it/s]") == {}  # no step done: no rate


def test_the_cli_continues_a_run_started_elsewhere(tiny, tmp_path, capsys):
    """Finished shards of the same sampling run are copied in (--samples-from), the others sampled, and `status`
    counts them."""
    import yaml

    from debiased_nli.cli import main

    rec = tiny_recipe(tiny, tmp_path / "outs")
    rec["new_rows"][0]["generate"]["num_samples"] = 8
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    d0 = f"train={tiny['d0']}"
    run, other = tmp_path / "run", tmp_path / "other"
    assert main(["-q", "pipeline", "run", str(path), "--data-files", d0, "--run", str(run), "--units", "1"]) == 0
    capsys.readouterr()
    assert main(["-q", "pipeline", "run", str(path), "--data-files", d0, "--run", str(other), "--samples-from",
                 str(run / "samples"), "--units", "1"]) == 0
    assert "1 finished shard(s) copied" in capsys.readouterr().out
    first = "shard-00000-of-00002.parquet"
    assert (other / "samples" / first).read_bytes() == (run / "samples" / first).read_bytes()
    assert main(["pipeline", "status", str(path), "--data-files", d0, "--run", str(other), "--json"]) == 0
    states = {s["stage"]: s for s in json.loads(capsys.readouterr().out)}
    assert states["sample"]["state"] == "done" and states["sample"]["detail"].startswith("2/2 shards")
    assert states["audit"]["state"] == "done"  # the sampling finished within the session, so the run went on


def test_the_gpu_profile_samples_from_g_star_with_m_calibrated_first(tiny, tmp_path):
    """`--profile gpu`: G, then G* on Z(D0) / Z-(D0), M, samples of G*, M calibrated on held-out rows (a file)."""
    rec = copy.deepcopy(load_recipe(ROOT / "builders" / "seqz.yaml", "gpu"))
    step = rec["new_rows"][0]
    step["train"].update(model=tiny["generator"], max_steps=1, batch_size=4, lr=1e-9, mixed_precision=None)
    step["debias"].update(max_steps=1, batch_size=4, lr=1e-9, z_batch_size=100, cpu=True, progress=False,
                          mixed_precision=None)
    step["train"].update(cpu=True, progress=False)
    step["train_m"].update(model=tiny["classifier"], epochs=1, batch_size=8, max_length=32, dev_files=None, cpu=True,
                           progress=False)
    step["generate"].update(num_samples=8, shard_size=4, batch_size=4, max_new_tokens=6, condition="premise+label",
                            dtype=None, cpu=True, progress=False)
    step["confidence"].update(calibration=tiny["d0"], tau=0.0, batch_size=16, progress=False)
    rec["features"].update(folds=2)
    rec["z_filter"].update(batch_size=16)
    rec.pop("profile", None)
    run = tmp_path / "run"
    pipe = Pipeline(rec, run, data_files=[f"train={tiny['d0']}"], progress=False, echo=lambda line: None)
    states = {s.stage: s for s in pipe.run(["train_g", "train_g_star", "train_m", "sample", "filter"])}
    assert [s for s in STAGES[:5] if states[s].state != "done"] == []
    assert json.loads((run / "samples" / "generate_config.json").read_text())["generator"] == "G_star"
    assert json.loads((run / "G_star" / "train_report.json").read_text())["mode"] == "debias"
    cal = json.loads((run / "confident" / "calibration.json").read_text())
    assert cal["rows"] == ROWS and (run / "confident" / "kept.parquet").is_file()
    assert states["build"].state == "pending"
