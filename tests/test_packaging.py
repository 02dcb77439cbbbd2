"""The wheel: model_cards/, evaluation/ and builders/ ship inside it, and a wheel install (not editable,
run from a folder outside the checkout) builds a release and lists the challenge sets."""
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from debiased_nli.utils.errors import ConfigError
from debiased_nli.utils.resources import FOLDERS, data_folder, find_recipe, packaged_recipes

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_subpackage():
    from setuptools import find_packages

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(pyproject["packages"])
    found = set(find_packages(str(ROOT), include=["debiased_nli", "debiased_nli.*"]))
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
    # the data folders are mapped from the repository root into the package
    assert pyproject["package-dir"] == {f"debiased_nli.{inside}": folder for folder, (inside, _) in FOLDERS.items()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    had_build = (ROOT / "build").exists()
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    if not had_build:  # setuptools' staging copy: a stale one would leak removed files into later wheels
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [whl] = out.glob("debiased_nli-*.whl")
    return whl


def test_the_wheel_ships_the_data_folders(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, (inside, _) in FOLDERS.items():
        files = [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        assert files
        for p in files:
            assert f"debiased_nli/{inside}/{p.relative_to(ROOT / folder).as_posix()}" in names, p


def test_a_wheel_install_builds_the_demo_and_lists_the_sets_from_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    # the unpacked wheel first on the path (the checkout's editable install is a fallback finder)
    env = dict(os.environ, PYTHONPATH=str(site), DEBIASED_NLI_CACHE=str(tmp_path / "cache"),
               HF_HOME=str(tmp_path / "hf"))
    for key in ("DEBIASED_NLI_TEMPLATES", "DEBIASED_NLI_EVALUATION", "DEBIASED_NLI_BUILDERS"):
        env.pop(key, None)
    where = subprocess.run([sys.executable, "-c", "import json, debiased_nli.utils.resources as r; print(json.dumps("
                            "[r.__file__] + [str(r.data_folder(f)) for f in r.FOLDERS]))"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    paths = json.loads(where.stdout)
    assert all(p.startswith(str(site)) for p in paths), paths
    cli = [sys.executable, "-m", "debiased_nli.cli"]
    listed = subprocess.run(cli + ["evaluate", "--list"], cwd=work, env=env, capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "suite nli" in listed.stdout and "snli_test_hard" in listed.stdout
    built = subprocess.run(cli + ["--quiet", "build", "demo", "--max-rows", "600", "--out", "out/debiased-demo"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    card = (work / "out/debiased-demo/README.md").read_text()
    assert "## Bias, risks and limitations" in card and "@inproceedings{wu-etal-2022-generating" in card
    assert str(site) in built.stderr  # the packaged recipe was used


def test_the_checkout_fallback_and_recipe_names(tmp_path, monkeypatch):
    # a checkout / editable install has no copies inside the package: the repository root's folders
    assert data_folder("model_cards") == ROOT / "model_cards"
    assert set(packaged_recipes()) >= {"demo", "snli", "mnli", "fever", "qqp"}
    monkeypatch.chdir(tmp_path)
    assert find_recipe("snli") == ROOT / "builders" / "snli.yaml"
    assert find_recipe("builders/demo.yaml") == ROOT / "builders" / "demo.yaml"  # the README's spelling
    (tmp_path / "mine.yaml").write_text("task: demo\n")
    assert find_recipe("mine.yaml") == Path("mine.yaml")  # a file wins
    with pytest.raises(ConfigError, match="Did you mean 'snli'"):
        find_recipe("snil")
    monkeypatch.setenv("DEBIASED_NLI_BUILDERS", str(tmp_path))
    assert set(packaged_recipes()) == {"mine"}


DEMO_PLAN = """\
# a comparison on the demo release: the rows it was built from, its z_filtered config, and random subsets of
# z_filtered's size drawn anew per seed; the epoch is selected on 100 held-out rows that are then not scored
task: demo
model: tiny
seeds: [0, 1]
runs_dir: runs
results_dir: results/compare
train: {learning_rate: 1.0e-3, batch_size: 32, max_length: 32, epochs: 1, threads: 1}
select_on: {set: demo_heldout, rows: 100, seed: 0}
evaluate:
  sets:
    - {name: demo_heldout, task: demo, labels: [entailment, neutral, contradiction],
       label_values: {0: entailment, 1: neutral, 2: contradiction}, local: heldout.parquet}
  max_length: 32
  batch_size: 64
  threads: 1
rows:
  - {name: original, data: {files: [train.parquet]}}
  - name: z_filtered
    data: {release_dir: out/debiased-demo, config: z_filtered}
    compare_with: {row: random_control, why: "same size: debiased data or only less data?"}
  - {name: random_control, data: {random_subset_of: original, size_of: z_filtered, seed: unit}}
primary:
  - {row: z_filtered, against: random_control}
bootstrap: {replicates: 200}
"""


def test_compare_runs_from_the_wheel_on_the_demo_release_and_resumes_after_a_kill(wheel, tmp_path):
    """plan -> run -> report from the unpacked wheel, outside the checkout; the first run is killed once a unit has
    finished, the second (two workers sharing the CPU) finishes without redoing the finished units."""
    import signal
    import time

    import pandas as pd

    from test_training import make_tiny_bert

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), DEBIASED_NLI_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for key in ("DEBIASED_NLI_TEMPLATES", "DEBIASED_NLI_EVALUATION", "DEBIASED_NLI_BUILDERS"):
        env.pop(key, None)
    demo = pd.read_parquet(site / "debiased_nli" / "data" / "demo" / "demo_nli.parquet")
    demo.head(2400).to_parquet(work / "train.parquet")
    demo.iloc[2400:].to_parquet(work / "heldout.parquet")
    make_tiny_bert(work / "tiny", list(demo.premise) + list(demo.hypothesis))
    (work / "plan.yaml").write_text(DEMO_PLAN)
    cli = [sys.executable, "-m", "debiased_nli.cli"]
    t0 = time.monotonic()
    built = subprocess.run(cli + ["--quiet", "build", "demo", "--data-files", "train=train.parquet", "--out",
                                  "out/debiased-demo"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    results = work / "results" / "compare"
    with open(tmp_path / "run1.log", "w") as log:
        first = subprocess.Popen(cli + ["compare", "run", "plan.yaml", "--quiet"], cwd=work, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 240
        while not list(results.glob("*-s*.json")) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)  # mid-way: one unit done, the next one training or scoring
        first.wait()
    killed_at = time.monotonic() - t0
    finished = {p: p.read_bytes() for p in results.glob("*-s*.json")}
    assert 1 <= len(finished) < 6, (tmp_path / "run1.log").read_text()[-3000:]
    status = subprocess.run(cli + ["compare", "status", "plan.yaml"], cwd=work, env=env, capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 0 and f"{len(finished)} done" in status.stdout, status.stderr[-2000:]
    second = subprocess.run(cli + ["compare", "run", "plan.yaml", "--workers", "2", "--quiet"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "report: 6 of 6 units finished" in second.stdout
    for p, data in finished.items():  # not redone
        assert p.read_bytes() == data
    assert len(list(results.glob("*-s*.json"))) == 6 and len(list((results / "predictions").glob("*.npz"))) == 6
    logs = "".join(p.read_text() for p in (work / "runs" / "logs").glob("worker-*.log"))
    for p in finished:
        row, seed = p.stem.rsplit("-s", 1)
        assert f"train {row} seed {seed}" not in logs and f"evaluate {row} seed {seed}" not in logs
    table = json.loads((work / "results" / "compare.json").read_text())
    assert table["schema"] == "debiased-nli/efficacy-table/v2"
    assert table["rows"]["original"]["sets"]["demo_heldout"]["n"] == 500  # 600 held-out rows minus the 100 selected
    comp = next(c for c in table["statistics"]["comparisons"] if c["row"] == "z_filtered" and c["against"] == "random_control")
    assert comp["primary"] and comp["sets"]["demo_heldout"]["p_adjusted"] is not None
    md = (work / "results" / "compare.md").read_text()
    assert "## Differences with 95% intervals" in md and (work / "results" / "compare.png").exists()
    imported = subprocess.run([sys.executable, "-c", "import debiased_nli.evaluation.compare as c; print(c.__file__)"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert imported.stdout.startswith(str(site)), imported.stdout + imported.stderr
    print(f"killed after {killed_at:.0f}s with {len(finished)} unit(s) done; all 6 after {time.monotonic() - t0:.0f}s")
