"""benchmarks/seqz_cpu.py (issue 31, item 5) without any model: the commands it runs, the acceptance curve and
the tau it falls back to, the committed sample shards that let another machine continue the run, the status,
and a report built from a run folder that has only some stages' outputs."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks import seqz_cpu as sc


def layout(tmp_path: Path) -> sc.Layout:
    data = tmp_path / "data" / "snli"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"premise": ["p"] * 10, "hypothesis": ["h"] * 10, "label": [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]}),
                   data / "train_sample.parquet")
    return sc.Layout(run=tmp_path / "run", models=tmp_path / "models", data=tmp_path / "data",
                     release=tmp_path / "release", results=tmp_path / "results")


def write_shard(folder: Path, i: int, n: int, rows: int, rejects: int, config: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "generate_config.json").write_text(json.dumps(config))
    pq.write_table(pa.table({"sample_index": list(range(rejects)), "shard": [i] * rejects, "seed": [7] * rejects,
                             "text": ["premise: x"] * rejects, "reason": ["no end marker"] * rejects}),
                   folder / f"rejects-{i:05d}-of-{n:05d}.parquet")
    pq.write_table(pa.table({
        "premise": [f"A man {j} sits." for j in range(rows)], "hypothesis": [f"A person {j} rests here." for j in range(rows)],
        "label": [j % 3 for j in range(rows)], "uid": [f"g{i}-{j}" for j in range(rows)], "origin": ["generated"] * rows,
        "method": ["generator:G"] * rows, "generator": ["G"] * rows, "checkpoint": ["G@step-834"] * rows,
        "shard": [i] * rows, "seed": [7] * rows, "sample_index": list(range(rejects, rejects + rows))}),
        folder / f"shard-{i:05d}-of-{n:05d}.parquet")


CONFIG = {"generator": "G", "task": "snli", "num_samples": 2000, "num_shards": 2, "seed": 0, "batch_size": 256,
          "top_p": 1.0, "temperature": 1.0, "max_new_tokens": 128, "condition": "none", "premises": None,
          "engine": "fast", "dtype": "bfloat16"}


def test_the_generate_command_and_the_bounded_call_use_the_same_values():
    from debiased_nli.cli import build_parser
    args = vars(build_parser().parse_args(sc.cmd_generate(30_000)[1:]))
    for key, value in sc.GENERATE.items():
        assert args[key] == value, key
    # relative names (the command runs in RUN): generate_config.json then says "G" on every machine
    assert (args["generator"], args["out"], args["num_samples"], args["cpu"]) == ("G", "samples", 30_000, True)
    assert "stop_after_shards=3" in sc.units_call(30_000, 3) and "'G', 'samples', 'snli', 30000" in sc.units_call(30_000, 3)


def test_train_g_runs_exactly_the_issue_s_command(tmp_path):
    cmd = " ".join(sc.cmd_train_g(layout(tmp_path)))
    assert cmd.endswith("--lora --lora-r 8 --lora-alpha 16 --epochs 1 --batch-size 24 --max-length 128 --lr 3e-4 "
                        "--group-by-length --mixed-precision bf16 --checkpoint-every 40 --cpu --threads 2 --log-every 10")
    assert sc.expected_shards(30_000) == 30 and sc.expected_shards(30_001) == 31 and sc.expected_shards(5) == 1


def test_acceptance_curve_counts_rows_strictly_above_tau():
    curve = sc.acceptance_curve([0.5, 0.7, 0.96, 0.99, 0.999], taus=(0.5, 0.95, 0.99))
    assert curve == [{"tau": 0.5, "kept": 4, "rate": 0.8}, {"tau": 0.95, "kept": 3, "rate": 0.6},
                     {"tau": 0.99, "kept": 1, "rate": 0.2}]


def test_the_paper_s_tau_unless_it_keeps_too_few_rows():
    def curve(kept):
        return [{"tau": t, "kept": k, "rate": None} for t, k in zip(sc.TAUS, kept)]
    assert sc.choose_tau(curve([9000, 8000, 7000, 6000, 5000, 100])) == (0.95, None)
    tau, note = sc.choose_tau(curve([9000, 8000, 6000, 4000, 3000, 100]))
    assert tau == 0.8 and "largest" in note
    tau, note = sc.choose_tau(curve([900, 800, 700, 600, 500, 100]))
    assert tau == 0.5 and "no tau" in note


def test_a_tau_that_keeps_no_row_of_one_label_is_passed_over():
    """The 60k CPU run: M is never 0.95-sure of a neutral sample (7,500 kept, none neutral)."""
    labels = ["entailment", "neutral", "contradiction"]
    conf = [0.96, 0.96, 0.91, 0.93, 0.93, 0.81, 0.85, 0.6]
    lab = [0, 2, 0, 1, 2, 1, 1, 1]
    curve = sc.acceptance_curve(conf, taus=(0.5, 0.8, 0.9, 0.95), labels=lab, label_names=labels)
    assert curve[3] == {"tau": 0.95, "kept": 2, "rate": 0.25,
                        "kept_by_label": {"entailment": 1, "neutral": 0, "contradiction": 1}}
    assert curve[1]["kept_by_label"] == {"entailment": 2, "neutral": 3, "contradiction": 2}
    tau, note = sc.choose_tau(curve, min_kept=3)    # every label needs >= 1 row
    assert tau == 0.9 and "neutral 0" in note and ">= 1 of every label" in note
    tau, note = sc.choose_tau(curve, min_kept=6)    # >= 2 of every label: only 0.8 and 0.5; the largest
    assert tau == 0.8 and "(7 rows" in note
    assert sc.choose_tau(curve, min_kept=2, paper=0.9) == (0.9, None)


def test_a_lower_tau_splits_the_scores_the_filter_already_wrote(tmp_path):
    L = layout(tmp_path)
    write_shard(L.samples, 0, 1, rows=6, rejects=0)
    t = pq.read_table(str(L.samples / "shard-00000-of-00001.parquet"))
    conf = [0.99, 0.2, 0.97, 0.85, 0.6, 0.91]
    t = t.append_column("confidence", pa.array(conf))
    L.confident.mkdir(parents=True)
    keep = [c > 0.95 for c in conf]
    pq.write_table(t.filter(pa.array(keep)), L.confident / "kept.parquet")
    rej = t.filter(pa.array([not k for k in keep]))
    pq.write_table(rej.append_column("rejected_by", pa.array(["confidence<=0.95"] * rej.num_rows)),
                   L.confident / "rejected.parquet")
    scored = sc.scored_rows(L.confident)
    assert scored["sample_index"] == list(range(6))  # back in sample order
    out = sc.write_tau_dir(L, 0.8, ["shard-00000-of-00001.parquet"])
    assert out == L.run / "confident_tau0.8"
    kept = pq.read_table(str(out / "kept.parquet")).to_pydict()
    assert kept["confidence"] == [0.99, 0.97, 0.85, 0.91]
    rejected = pq.read_table(str(out / "rejected.parquet")).to_pydict()
    assert rejected["confidence"] == [0.2, 0.6] and set(rejected["rejected_by"]) == {"confidence<=0.8"}
    report = json.loads((out / "confidence_report.json").read_text())
    assert (report["tau"], report["kept"], report["rows"]) == (0.8, 4, 6)


def test_finished_shards_are_committed_and_seed_a_fresh_run_folder(tmp_path):
    L = layout(tmp_path)
    write_shard(L.samples, 0, 2, rows=4, rejects=1, config=CONFIG)
    (L.samples / ".shard-00001-of-00002.parquet.tmp").write_text("half written")
    assert sc.copy_back(L) == 1 and sc.copy_back(L) == 0
    assert sorted(p.name for p in L.committed.iterdir()) == [
        "generate_config.json", "rejects-00000-of-00002.parquet", "shard-00000-of-00002.parquet"]
    other = sc.Layout(run=tmp_path / "elsewhere", models=L.models, data=L.data, release=L.release, results=L.results)
    assert sc.seed_from_committed(other) == 1
    for name in ("generate_config.json", "rejects-00000-of-00002.parquet", "shard-00000-of-00002.parquet"):
        assert (other.samples / name).read_bytes() == (L.committed / name).read_bytes()
    assert sc.run_num_samples(other, 1000) == 2000 and sc.run_num_samples(other, 30_000) == 30_000  # grown to it
    # a run folder of another run is not mixed with the committed shards, nor they with it
    third = sc.Layout(run=tmp_path / "third", models=L.models, data=L.data, release=L.release, results=L.results)
    write_shard(third.samples, 0, 3, rows=2, rejects=0, config={**CONFIG, "num_samples": 3000, "num_shards": 3})
    assert sc.seed_from_committed(third) == 0 and sc.copy_back(third) == 0
    assert not (third.samples / "shard-00000-of-00002.parquet").exists()


def test_a_grown_run_renames_the_committed_shards_and_grows_another_machine_s_copy(tmp_path):
    """generate --extend grows RUN/samples from 2,000 to 3,000 samples: copy_back renames the committed shards (their
    bytes kept) and adds the new one; a machine still holding the 2,000-sample run is grown from the commit."""
    L = layout(tmp_path)
    write_shard(L.samples, 0, 2, rows=4, rejects=1, config=CONFIG)
    assert sc.copy_back(L) == 1
    first = (L.committed / "shard-00000-of-00002.parquet").read_bytes()
    grown = {**CONFIG, "num_samples": 3000, "num_shards": 3, "extended_from": [{"num_samples": 2000, "num_shards": 2}]}
    for kind in ("shard", "rejects"):   # what generate --extend leaves in RUN/samples
        (L.samples / f"{kind}-00000-of-00002.parquet").rename(L.samples / f"{kind}-00000-of-00003.parquet")
    write_shard(L.samples, 2, 3, rows=3, rejects=0, config=grown)
    assert sc.grew_from(grown, CONFIG) and not sc.grew_from(CONFIG, grown)
    assert not sc.grew_from({**grown, "seed": 1}, CONFIG)
    assert sc.copy_back(L) == 1
    names = ["generate_config.json", "rejects-00000-of-00003.parquet", "rejects-00002-of-00003.parquet",
             "shard-00000-of-00003.parquet", "shard-00002-of-00003.parquet"]
    assert sorted(p.name for p in L.committed.iterdir()) == names
    assert (L.committed / "shard-00000-of-00003.parquet").read_bytes() == first
    assert json.loads((L.committed / "generate_config.json").read_text()) == grown
    other = sc.Layout(run=tmp_path / "elsewhere", models=L.models, data=L.data, release=L.release, results=L.results)
    write_shard(other.samples, 0, 2, rows=4, rejects=1, config=CONFIG)
    assert sc.seed_from_committed(other) == 1
    assert sorted(p.name for p in other.samples.iterdir()) == names
    assert json.loads((other.samples / "generate_config.json").read_text()) == grown
    with pytest.raises(sc.StageError, match="more than 2000"):
        sc.check_resumable(other, 2000)


def test_status_and_report_of_a_half_done_run(tmp_path):
    L = layout(tmp_path)
    L.G.mkdir(parents=True)
    (L.G / "train_report.json").write_text(json.dumps({
        "mode": "generator", "model": "/m/smollm2-135m-instruct", "rows": 10, "steps": 834, "steps_this_run": 34,
        "seconds": 170.0, "seconds_per_step": 5.0, "batch_size": 24, "max_length": 128, "lr": 3e-4, "epochs": 1,
        "lambda": 0.5, "lora": {"r": 8, "alpha": 16}, "mixed_precision": "bf16",
        "history": [{"step": 10, "loss": 3.1, "mle": 3.0, "lr": 3e-4}, {"step": 834, "loss": 1.4, "mle": 1.3, "lr": 3e-4}]}))
    (L.run / "G_tokens.json").write_text(json.dumps({"rows": 10, "sequence_tokens": 417000,
                                                     "wrong_label_tokens": 417000, "mean_sequence_tokens": 41.7}))
    L.M.mkdir()
    (L.M / "config.json").write_text("{}")
    (L.M / "debiased_nli_train.json").write_text(json.dumps({"config": {"learning_rate": 5e-5, "epochs": 2.0}, "result": {
        "train_rows": 10, "dev_rows": 9842, "dev_accuracy": 0.78, "train_seconds": 100.0}}))
    write_shard(L.samples, 0, 2, rows=4, rejects=1, config=CONFIG)
    t = pq.read_table(str(L.samples / "shard-00000-of-00002.parquet")).append_column("confidence", pa.array([0.99, 0.3, 0.97, 0.5]))
    L.confident.mkdir()
    pq.write_table(t.filter(pa.array([True, False, True, False])), L.confident / "kept.parquet")
    rej = t.filter(pa.array([False, True, False, True]))
    pq.write_table(rej.append_column("rejected_by", pa.array(["confidence<=0.95"] * 2)), L.confident / "rejected.parquet")
    curve = sc.acceptance_curve([0.99, 0.3, 0.97, 0.5])
    tau, note = sc.choose_tau(curve)
    (L.run / "filter.json").write_text(json.dumps({
        "inputs": ["shard-00000-of-00002.parquet"], "rule": sc.TAU_RULE, "rows": 4, "tau_paper": 0.95, "min_kept": sc.MIN_KEPT,
        "acceptance_curve": curve, "tau_used": tau, "confident_dir": str(L.confident), "note": note}))

    st = sc.status_of(L, 2000)
    assert {k: v["state"] for k, v in st.items()} == {"train_g": "done", "train_m": "done", "generate": "partial",
                                                       "filter": "done", "build": "todo", "audit": "todo"}
    assert (st["generate"]["shards"], st["generate"]["of"], st["generate"]["samples"]) == (1, 2, 5)

    s = sc.collect(L, 2000)
    json.dumps(s)  # the JSON report can be written
    assert s["still_to_run"] == ["generate", "build", "audit"]
    assert s["generator"]["tokens_per_s"] == round(1000.0 / 5.0, 1)   # (417000 + 417000) / 834 tokens a step
    assert s["generation"]["parse_rate"] == 0.8 and s["generation"]["labels"] == {
        "entailment": 2, "neutral": 1, "contradiction": 1}
    assert s["ratios"]["samples_per_original_row"] == 0.5 and s["ratios"]["paper"]["samples_per_original_row"] == 9.1
    assert len(s["filter"]["examples_kept"]) == 2 and len(s["filter"]["examples_rejected"]) == 2
    assert s["filter"]["examples_rejected"][0]["confidence"] in (0.3, 0.5)
    md = sc.markdown(s)
    assert "**0.5 samples per original row**" in md and "Not built yet (`build`)" in md
    assert "Not audited yet" in md and "G*" in md and "RoBERTa-large" in md
    assert "| 0.95 (paper) |" in md and "**used**" in md and "| rejected |" in md

    # more shards than the filter saw: it is no longer done
    write_shard(L.samples, 1, 2, rows=3, rejects=0)
    assert sc.status_of(L, 2000)["filter"]["state"] == "partial"
    assert sc.status_of(L, 2000)["generate"]["state"] == "done"


def test_report_of_an_empty_run_folder(tmp_path, monkeypatch):
    L = layout(tmp_path)
    for key, value in (("SEQZ_RUN_DIR", L.run), ("SEQZ_RESULTS_DIR", L.results), ("SEQZ_RELEASE_DIR", L.release),
                       ("DEBIASED_NLI_SHARED", tmp_path), ("DEBIASED_NLI_MODELS", L.models)):
        monkeypatch.setenv(key, str(value))
    assert sc.main(["report"]) == 0 and sc.main(["status"]) == 0
    s = json.loads((L.results / "seqz_cpu.json").read_text())
    assert s["still_to_run"] == list(sc.STAGES) and s["generation"] is None
    assert "no samples yet" in (L.results / "seqz_cpu.md").read_text()


def test_a_stage_without_its_inputs_stops_with_a_reason(tmp_path, monkeypatch, capsys):
    L = layout(tmp_path)
    monkeypatch.setenv("SEQZ_RUN_DIR", str(L.run))
    monkeypatch.setenv("SEQZ_RESULTS_DIR", str(L.results))
    assert sc.main(["filter"]) == 1
    assert "run generate first" in capsys.readouterr().err
    with sc.driver_lock(L), pytest.raises(sc.StageError, match="holds"), sc.driver_lock(L):
        pass


def test_the_finished_g_is_committed_once_and_restored_on_a_machine_without_it(tmp_path):
    L = layout(tmp_path)
    L.G.mkdir(parents=True)
    (L.G / "adapter_model.safetensors").write_bytes(b"weights")
    (L.G / "adapter_config.json").write_text("{}")
    (L.G / "checkpoints").mkdir()  # never committed
    sc.commit_g(L)
    assert not L.committed_G.exists()  # not finished: nothing to commit
    (L.G / "train_report.json").write_text(json.dumps({"steps": 834}))
    sc.commit_g(L)
    assert sorted(p.name for p in L.committed_G.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                               "train_report.json"]
    import shutil
    shutil.rmtree(L.G)  # another machine
    sc.restore_g(L)
    assert (L.G / "adapter_model.safetensors").read_bytes() == b"weights"
    assert json.loads((L.G / "train_report.json").read_text()) == {"steps": 834}
