"""`build` under several processes (issue 31, item 4): `torchrun --nproc_per_node 2` on CPU gives the release the
one-process build gives, byte for byte: the main process alone loads, filters, locks and writes the release;
a generator step shares its sampling over the ranks (one shard file per shard, whichever rank made it)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))


def _env(cache: Path) -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", DEBIASED_NLI_CACHE=str(cache), OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT), MASTER_PORT=str(29500 + os.getpid() % 1000))


def _build(cwd: Path, args: list[str], processes: int) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    head = [sys.executable, "-m", "debiased_nli.cli"] if processes == 1 else \
        [TORCHRUN, "--nproc_per_node", str(processes), "--master_port", str(29500 + os.getpid() % 1000),
         "-m", "debiased_nli.cli"]
    proc = subprocess.run(head + ["build", *args, "--out", "release", "--quiet"], cwd=cwd, env=_env(cwd / "cache"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _same_release(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    assert [name for name in fa if fa[name] != fb[name]] == []


@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed beside this Python")
def test_the_demo_release_is_the_same_under_two_processes(tmp_path):
    one = _build(tmp_path / "one", ["demo"], 1)
    two = _build(tmp_path / "two", ["demo"], 2)
    _same_release(tmp_path / "one" / "release", tmp_path / "two" / "release")
    # the other rank says nothing: one `wrote` line, not two
    wrote = lambda proc: sum(line.startswith("wrote ") for line in proc.stderr.splitlines())
    assert wrote(two) == wrote(one) == 1 and two.stderr.count("recipe: ") == 1


@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed beside this Python")
def test_a_generator_recipe_is_the_same_under_two_processes(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_generation_sample import eos_generator

    lm = eos_generator(tmp_path / "lm")  # a tiny GPT-2 whose samples parse about half of the time
    recipe = {
        "task": "demo", "name": "distributed-generator", "data": {"max_rows": 300},
        "z_filter": {"top_k": 20, "batch_size": 100},
        "new_rows": [{"step": "generator", "generator": lm,
                      # relative to the build's folder, so both builds record the same path
                      "generate": {"out": "samples", "num_samples": 24, "num_shards": 4, "batch_size": 4,
                                   "max_new_tokens": 6, "condition": "premise+label", "cpu": True,
                                   "progress": False}}],
    }
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    _build(tmp_path / "one", ["recipe.yaml"], 1)
    _build(tmp_path / "two", ["recipe.yaml"], 2)
    # 4 shards either way: the first build's one process made all four, the second's two ranks two each
    assert sorted(p.name for p in (tmp_path / "two" / "samples").glob("*.parquet")) == \
        sorted(p.name for p in (tmp_path / "one" / "samples").glob("*.parquet"))
    _same_release(tmp_path / "one" / "release", tmp_path / "two" / "release")
    configs = yaml.safe_load((tmp_path / "two" / "release" / "README.md").read_text().split("---")[1])["configs"]
    assert {c["config_name"] for c in configs} >= {"z_filtered", "z_aug", "par_z", "seq_z"}
