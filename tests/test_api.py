"""The Python API (issue 49): one call per command, importable from the top level, returning result objects.

The notebook test runs what docs/python-api.md walks through -- build, audit, push, diff, train, evaluate, compare --
through ``import debiased_nli`` alone, on 400 real SNLI rows and a tiny BERT built from a config, against the test
Hub server; it must stay fast (well under a minute)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from fake_hub import FakeHub  # noqa: E402
from test_training import make_tiny_bert  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_import_debiased_nli_is_light_and_exports_the_api():
    code = ("import sys, time; t = time.perf_counter(); import debiased_nli as dn; took = time.perf_counter() - t\n"
            "heavy = [m for m in ('torch', 'transformers', 'datasets', 'huggingface_hub', 'numpy') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "api = [dn.build, dn.push, dn.diff, dn.audit, dn.train, dn.evaluate, dn.compare]\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
            "assert set(dn.__all__) >= {'build', 'push', 'diff', 'audit', 'train', 'evaluate', 'compare'}\n"
            "print(took)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) < 0.5
    import debiased_nli

    with pytest.raises(AttributeError, match="no attribute 'bulid'"):
        debiased_nli.bulid  # noqa: B018 - a misspelt name is an AttributeError, not a lazy import


def test_each_command_is_a_thin_wrapper_over_its_api_function():
    """The command modules call the API function of their name and hold no logic of their own: no library
    function is imported there that the API function does not already call."""
    import ast

    for command, function in (("build", "build"), ("push", "push"), ("diff", "diff"), ("audit", "audit"),
                              ("train", "train"), ("evaluate", "evaluate"), ("compare", "compare")):
        tree = ast.parse((ROOT / "debiased_nli" / "cli" / "commands" / f"{command}.py").read_text())
        run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
        imported = {(n.module, a.name) for n in ast.walk(run) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert ("api", function) in {(m.rsplit(".", 1)[-1] if m else m, a) for m, a in imported}, command
        heavy = {a for m, a in imported if m and ("release" in m or "models" in m or "bias" in m)
                 and a not in ("is_main_rank", "get_set", "get_suite", "list_sets", "list_suites")}
        assert not heavy, (command, heavy)


@pytest.fixture
def online(monkeypatch, tmp_path_factory):
    """The test Hub server, reachable through huggingface_hub's and datasets' defaults (as HF_ENDPOINT makes it)."""
    with FakeHub() as hub:
        yield hub.be_the_hub(monkeypatch, tmp_path_factory.mktemp("hf-cache"), "hf_notebook")


def test_a_notebook_builds_pushes_trains_evaluates_and_compares_with_the_top_level_api(tmp_path, shared_data,
                                                                                      online, monkeypatch):
    import debiased_nli as dn

    start = time.perf_counter()
    monkeypatch.chdir(tmp_path)
    train_file, dev_file = shared_data / "snli" / "train_sample.parquet", shared_data / "snli" / "dev.parquet"
    rows = pd.read_parquet(train_file).head(400)
    texts = list(rows.premise) + list(rows.hypothesis)
    for f in ("snli/dev.parquet", "snli/test.parquet", "hans/evaluation_regenerated.parquet"):
        df = pd.read_parquet(shared_data / f).head(200)
        texts += list(df.premise) + list(df.hypothesis)
    encoder = make_tiny_bert(tmp_path / "encoder", texts)

    # [1] build a release from 400 real SNLI rows
    release = dn.build("snli", "out/snli-small", data_files=[f"train={train_file}", f"validation={dev_file}"],
                       max_rows=400)
    assert release.configs == {"z_filtered": release.configs["z_filtered"]} and 0 < release.configs["z_filtered"] < 400
    assert release.recipe_path == ROOT / "builders" / "snli.yaml"

    # [2] audit the same rows: the report object, no files
    audit = dn.audit("snli", data_files=str(train_file), max_rows=400, hypothesis_only=None)
    assert audit.report["n_rows"] == 400 and audit.paths == {} and audit.top_features("contradiction")

    # [3] push it to the Hub, tagged, and [4] compare the Hub's copy with the folder
    pushed = dn.push(release.out_dir, "org/snli-small", revision="v1.0")
    assert pushed.tag == "v1.0" and pushed.load_snippet() == \
        "datasets.load_dataset('org/snli-small', CONFIG, revision='v1.0')"
    assert dn.diff("org/snli-small@v1.0", release.out_dir).identical

    # [5] train on the Hub release at its tag, and push the model with its card
    trained = dn.train("snli", model=str(encoder), release="org/snli-small", revision="v1.0", config="z_filtered",
                       dev_files=[str(dev_file)], max_dev_rows=40, epochs=1, batch_size=32, out="runs/zf",
                       push_to="org/tiny-snli-zf", push_revision="v1.0")
    assert trained.result.train_rows == release.configs["z_filtered"]
    assert trained.sources["epochs"] == "given" and trained.config.epochs == 1
    assert trained.pushed["tag"] == "v1.0"
    from huggingface_hub import ModelCard

    card = ModelCard.load("org/tiny-snli-zf")
    assert card.data.datasets == ["org/snli-small"]
    assert "config `z_filtered` of the Hub dataset `org/snli-small` at revision `v1.0`" in card.text

    # [6] score it on two challenge sets and record the scores on the Hub
    scored = dn.evaluate(trained.model_dir, sets=["snli_test", "hans"], max_examples=40, out="eval/zf",
                         data_root=shared_data, push_to="org/tiny-snli-zf")
    assert set(scored.results["sets"]) == {"snli_test", "hans"} and 0 <= scored.accuracy("hans") <= 1
    assert scored.paths["results"] == tmp_path.resolve() / "eval" / "zf" / "results.json"
    assert scored.pushed["not_in_eval_results"] == []
    card = ModelCard.load("org/tiny-snli-zf")
    assert {r.dataset_name.split(" (")[0] for r in card.data.eval_results} == {"snli_test", "hans"}

    # [7] compare the release's config with the rows it came from: a plan, run, then its report
    Path("plan.yaml").write_text(yaml.safe_dump({
        "task": "snli", "model": str(encoder), "seeds": [0], "runs_dir": "runs/compare",
        "results_dir": "results/compare",
        "train": {"learning_rate": 1e-3, "batch_size": 32, "max_length": 48, "epochs": 1, "threads": 1},
        "evaluate": {"sets": ["snli_test"], "max_length": 48, "batch_size": 32, "max_examples": 40, "threads": 1},
        "rows": [{"name": "original", "data": {"files": [str(train_file)]}},
                 {"name": "z_filtered", "data": {"release_dir": str(release.out_dir), "config": "z_filtered"}}]}))
    status = dn.compare("plan.yaml", "status")
    assert [s["state"] for s in status.states] == ["todo", "todo"]
    done = dn.compare("plan.yaml", "run")
    assert done.planned == 2 and set(done.table["rows"]) == {"original", "z_filtered"}
    assert [f.suffix for f in done.files][:2] == [".md", ".json"]
    assert all(s["state"] == "done" for s in dn.compare("plan.yaml", "status").states)
    assert time.perf_counter() - start < 60


def test_an_unknown_option_is_refused_with_the_closest_name_before_any_work(tmp_path, monkeypatch):
    import debiased_nli as dn
    from debiased_nli.utils.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    for call, name, close in (
            (lambda: dn.train("snli", model="m", out="runs/t", epoch=3), "epoch", "epochs"),
            (lambda: dn.train("snli", model="m", out="runs/t", learningrate=1e-5), "learningrate", "learning_rate"),
            (lambda: dn.evaluate("m", sutie="nli"), "sutie", "suite"),
            (lambda: dn.compare("plan.yaml", "status", worker=2), "worker", "workers"),
            (lambda: dn.build("demo", "out", max_row=5), "max_row", "max_rows"),
            (lambda: dn.audit("demo", topk=3), "topk", "top_k")):
        with pytest.raises(ConfigError, match=rf"\(\) got an unknown option '{name}'\. Did you mean '{close}'\?"):
            call()
    with pytest.raises(TypeError, match="unknown option 'xyz'"):  # as Python's own unexpected keyword
        dn.audit("demo", xyz=1)
    with pytest.raises(ConfigError, match="`options` must be a BuildOptions, got TrainOptions"):
        dn.build("demo", "out", options=dn.TrainOptions())
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing loaded


def test_options_come_as_keywords_as_an_object_or_both():
    import debiased_nli as dn
    from debiased_nli.models.training import HYPER_PARAMETERS

    opts = dn.AuditOptions(max_rows=120, hypothesis_only=None, top_k=3)
    by_object = dn.audit("demo", options=opts)
    by_keywords = dn.audit("demo", max_rows=120, hypothesis_only=None, top_k=3)
    assert by_object.report["n_rows"] == by_keywords.report["n_rows"] == 120
    assert by_object.report["features"] == by_keywords.report["features"]
    both = dn.audit("demo", options=opts, max_rows=80)  # a keyword replaces the object's field
    assert both.report["n_rows"] == 80 and both.report["top_k"] == 3 and opts.max_rows == 120
    assert list(dn.TrainOptions(epochs=2).hyper_parameters()) == list(HYPER_PARAMETERS)
    assert dn.TrainOptions(epochs=2).hyper_parameters()["epochs"] == 2
