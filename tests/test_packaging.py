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
