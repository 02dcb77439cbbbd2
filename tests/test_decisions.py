"""Decision records (release/decisions.py): a build records what every filter step decided and the scores it
decided from; `build --replay OLD` reuses them, so a step whose numbers differ on another machine still
gives OLD's release byte for byte."""
import hashlib
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml

from debiased_nli.cli import main
from debiased_nli.data.loading import new_rows
from debiased_nli.release import step_registry
from debiased_nli.release.decisions import Replay, params_sha256
from debiased_nli.release.recipe import build
from debiased_nli.release.step_registry import Rejects, Step, declare

ROOT = Path(__file__).resolve().parents[1]
DEMO = yaml.safe_load((ROOT / "builders/demo.yaml").read_text())
CALLS = {"n": 0, "noise": 0.0}


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    monkeypatch.setattr(step_registry, "_STEPS", dict(step_registry._STEPS))
    CALLS.update(n=0, noise=0.0)
    declare(Step("noisy", "filter", noisy_filter, rejects=Rejects(extra=("noisy_score",))))
    declare(Step("noisy_rows", "source", noisy_rows))


def noisy_filter(ds, task, params, ctx):
    """A stand-in for a neural step: a score per row (a hash of its text) plus ``CALLS["noise"]`` (what other
    kernels change), rows scoring above ``threshold`` dropped with their score; two rows made by the step
    (like PDD's perturbations) and a column of its own (like PDD's ``teacher_confidence``) in its output."""
    CALLS["n"] += 1
    h = np.array([int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) / 16**8 for t in ds["hypothesis"]])
    score = h + CALLS["noise"] * np.sin(np.arange(len(ds)))
    keep = score <= params["threshold"]
    kept = ds.select(np.nonzero(keep)[0])
    kept = kept.add_column("teacher_confidence", [None] * len(kept), feature=datasets.Value("float64"))
    made = new_rows(task, ["A man sleeps.", "Two cats play."], ["A person rests.", "Animals play."],
                    ["entailment", "entailment"], origin="perturbed", method="noisy")
    made = made.add_column("teacher_confidence", [0.91, 0.87 + CALLS["noise"]])
    for col in ds.column_names:  # the feature columns of the made rows, as PDD computes them
        if col not in made.column_names:
            made = made.add_column(col, [ds[0][col]] * len(made), feature=ds.features[col])
    kept = datasets.concatenate_datasets([kept, made.select_columns(kept.column_names).cast(kept.features)])
    dropped = ds.select(np.nonzero(~keep)[0])
    dropped = dropped.add_column("noisy_score", score[~keep].tolist())
    dropped = dropped.add_column("reason", ["noisy"] * len(dropped))
    return kept, dropped, {"kept": len(kept), "threshold": params["threshold"]}


def noisy_rows(task, params, ctx):
    """A stand-in for the generator step: made rows, those scoring under ``tau`` dropped with their score
    (like M's confidence); the scores move with ``CALLS["noise"]``."""
    CALLS["n"] += 1
    hyps = [f"A person is doing thing number {i}." for i in range(40)]
    rows = new_rows(task, ["Someone does something."] * 40, hyps, ["entailment", "neutral", "contradiction", "neutral"] * 10,
                    origin="generated", method="noisy_rows")
    conf = (np.arange(40) % 7) / 7 + CALLS["noise"]
    keep = conf > params["tau"]
    dropped = rows.select(np.nonzero(~keep)[0]).add_column("confidence", conf[~keep].tolist())
    dropped = dropped.add_column("rejected_by", [f"confidence<={params['tau']}"] * len(dropped))
    return rows.select(np.nonzero(keep)[0]), dropped, {"kept": int(keep.sum())}


RECIPE = {**DEMO, "filters": [{"step": "noisy", "config": "noisy", "threshold": 0.6}]}


def files_of(release: Path, config: str) -> dict:
    return {p.relative_to(release).as_posix(): p.read_bytes()
            for sub in ("data", "rejected") for p in sorted((release / sub / config).glob("*.parquet"))}


def test_a_build_records_each_filter_steps_decisions_and_scores(tmp_path):
    res = build(RECIPE, tmp_path / "a", max_rows=300, progress=False)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    rec = manifest["decisions"]["noisy"]
    assert rec["step"] == "noisy" and rec["params_sha256"] == params_sha256({"threshold": 0.6, "seed": 0})
    n_kept = res.configs["noisy"]
    dropped = 300 - (n_kept - 2)
    assert rec["counts"] == {"input": 300, "kept": n_kept, "added": 2, "dropped": dropped}
    dec = datasets.Dataset.from_parquet(str(tmp_path / "a" / "decisions" / "noisy" / "decisions.parquet"))
    assert len(dec) == n_kept + dropped and sum(dec["added"]) == 2
    # the scores every drop was decided from are beside the dropped rows, and in the record
    drops = dec.filter(lambda r: r["decision"] == "noisy")
    assert len(drops) == dropped and min(drops["noisy_score"]) > 0.6
    assert [c for c in dec.column_names if c not in ("uid", "decision", "position", "added")] == \
        ["teacher_confidence", "noisy_score"]
    assert set(manifest["decisions"]["noisy"]["files"]) == {"decisions/noisy/decisions.parquet",
                                                            "decisions/noisy/added.parquet"}
    assert manifest["decisions"]["noisy"]["rejected_files"]  # the dropped rows' files, by sha256
    # the Hub sees the release's configs and their dropped rows: the decisions are no config
    assert set(datasets.get_dataset_config_names(str(tmp_path / "a"))) == \
        set(res.configs) | {f"rejected_{c}" for c in res.configs}


def test_a_rebuild_with_replay_gives_the_recorded_release_where_the_numbers_moved(tmp_path):
    build(RECIPE, tmp_path / "a", max_rows=300, progress=False)
    CALLS["noise"] = 0.05  # another machine: the step's scores move a little
    build(RECIPE, tmp_path / "b", max_rows=300, progress=False)
    assert files_of(tmp_path / "b", "noisy") != files_of(tmp_path / "a", "noisy")
    calls = CALLS["n"]
    res = build(RECIPE, tmp_path / "c", max_rows=300, progress=False, replay=tmp_path / "a")
    assert CALLS["n"] == calls  # the step did not run
    assert files_of(tmp_path / "c", "noisy") == files_of(tmp_path / "a", "noisy")
    for config in res.configs:  # every other config too (the z-path is deterministic)
        assert files_of(tmp_path / "c", config) == files_of(tmp_path / "a", config)
    stage = next(s for s in res.manifest["stages"] if s["stage"] == "noisy: noisy")
    assert stage["replay"] == "replayed" and stage["report"]["threshold"] == 0.6
    assert (tmp_path / "c" / "README.md").read_text() == (tmp_path / "a" / "README.md").read_text()
    # and its records are those of the release it replayed
    for name in ("decisions.parquet", "added.parquet"):
        assert (tmp_path / "c" / "decisions" / "noisy" / name).read_bytes() == \
            (tmp_path / "a" / "decisions" / "noisy" / name).read_bytes()


def test_a_record_that_does_not_fit_is_not_used_and_the_build_says_why(tmp_path):
    build(RECIPE, tmp_path / "a", max_rows=300, progress=False)
    calls = CALLS["n"]
    other = {**DEMO, "filters": [{"step": "noisy", "config": "noisy", "threshold": 0.5}]}
    res = build(other, tmp_path / "p", max_rows=300, progress=False, replay=tmp_path / "a")
    assert CALLS["n"] == calls + 1
    assert next(s for s in res.manifest["stages"] if s["stage"] == "noisy: noisy")["replay"] == \
        "not replayed: the step's parameters differ"
    res = build(RECIPE, tmp_path / "r", max_rows=250, progress=False, replay=tmp_path / "a")
    assert "the step's input rows differ" in next(s for s in res.manifest["stages"]
                                                  if s["stage"] == "noisy: noisy")["replay"]
    # a record whose file was changed after the build is not trusted
    dec = tmp_path / "a" / "decisions" / "noisy" / "decisions.parquet"
    dec.write_bytes(dec.read_bytes() + b"\0")
    replay = Replay(tmp_path / "a")
    from debiased_nli.data.loading import load_task
    assert replay.lookup("noisy", "noisy", {"threshold": 0.6, "seed": 0},
                         load_task("demo", max_rows=10).dataset) is None
    assert "differ" in replay.used["noisy"]


def test_replay_from_the_command_line_and_a_folder_that_is_no_release(tmp_path, capsys):
    recipe = tmp_path / "noisy.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    assert main(["build", str(recipe), "--out", str(tmp_path / "a"), "--max-rows", "300", "-q"]) == 0
    CALLS["noise"] = 0.05
    assert main(["build", str(recipe), "--out", str(tmp_path / "b"), "--max-rows", "300", "-q",
                 "--replay", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert f"train rows (replayed from {tmp_path / 'a'})" in err
    assert files_of(tmp_path / "b", "noisy") == files_of(tmp_path / "a", "noisy")
    (tmp_path / "empty").mkdir()
    assert main(["build", str(recipe), "--out", str(tmp_path / "c"), "--max-rows", "300", "-q",
                 "--replay", str(tmp_path / "empty")]) == 2
    assert "no manifest.json there" in capsys.readouterr().err


def test_new_rows_made_in_the_build_are_recorded_and_replayed(tmp_path):
    recipe = {**DEMO, "new_rows": [{"step": "noisy_rows", "tau": 0.5}]}
    build(recipe, tmp_path / "a", max_rows=300, progress=False)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    rec = manifest["decisions"]["new_rows/0-noisy_rows"]
    assert rec["counts"] == {"rows": 16, "dropped": 24} and rec["report"] == {"kept": 16}
    dropped = datasets.Dataset.from_parquet(str(tmp_path / "a" / "decisions/new_rows/0-noisy_rows/dropped.parquet"))
    assert len(dropped) == 24 and max(dropped["confidence"]) <= 0.5 and set(dropped["rejected_by"]) == {"confidence<=0.5"}
    CALLS["noise"] = 0.1  # other kernels: other confidences, other rows kept
    build(recipe, tmp_path / "b", max_rows=300, progress=False)
    calls = CALLS["n"]
    res = build(recipe, tmp_path / "c", max_rows=300, progress=False, replay=tmp_path / "a")
    assert CALLS["n"] == calls
    assert next(s for s in res.manifest["stages"] if s["stage"] == "new rows: noisy_rows")["replay"] == "replayed"
    for config in ("z_aug", "par_z", "seq_z"):
        assert files_of(tmp_path / "b", config) != files_of(tmp_path / "a", config)
        assert files_of(tmp_path / "c", config) == files_of(tmp_path / "a", config)


def test_a_recorded_report_keeps_what_the_rows_are_not_how_long_they_took():
    from debiased_nli.release.decisions import stable_report

    report = {"generate": {"samples": 24, "parsed": 12, "labels": {"neutral": 5},
                           "this_run": {"processes": 2, "seconds": 0.07, "samples_per_s_rank0": 182.5},
                           "tokens_per_s": 9.0, "seconds": 1.2},
              "filter": [{"kept": 3, "seconds": 0.5}]}
    assert stable_report(report) == {"generate": {"samples": 24, "parsed": 12, "labels": {"neutral": 5}},
                                     "filter": [{"kept": 3}]}


@pytest.mark.parametrize("damage", ["a row in neither", "a row in both", "a uid not in the input"])
def test_replay_checks_that_the_record_partitions_the_input(tmp_path, damage):
    """A record whose kept and dropped rows are not the input rows, each exactly once (one row missing: 299 of
    300 accounted for; one kept and dropped; one that is no input row), is not replayed: a one-line error, even
    when its files are the ones its manifest records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from debiased_nli.utils.errors import ConfigError
    from debiased_nli.utils.provenance import file_sha256

    build(RECIPE, tmp_path / "a", max_rows=300, progress=False)
    path = tmp_path / "a" / "decisions" / "noisy" / "decisions.parquet"
    table = pq.read_table(path)
    cols = table.to_pydict()
    i, j = cols["position"].index(-1), cols["position"].index(0)
    if damage == "a row in neither":
        cols = {k: v[:i] + v[i + 1:] for k, v in cols.items()}
    elif damage == "a row in both":
        cols["uid"][i] = cols["uid"][j]
    else:
        cols["uid"][i] = "demo:train:99999"
    pq.write_table(pa.table(cols, schema=table.schema), path)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    manifest["decisions"]["noisy"]["files"]["decisions/noisy/decisions.parquet"] = file_sha256(path)
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="partition|not an input row"):
        build(RECIPE, tmp_path / "b", max_rows=300, progress=False, replay=tmp_path / "a")
    assert not (tmp_path / "b").exists()
