"""Shared helpers of the benchmarks: the pool of real NLI rows to resample, and peak-memory probes."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("DEBIASED_NLI_SHARED", ROOT.parent / "shared")) / "data"
RESULTS = ROOT / "benchmarks" / "results"
NLI_FILES = ["snli/train_sample.parquet", "snli/dev.parquet", "snli/test.parquet",
             "mnli/dev_matched.parquet", "mnli/dev_mismatched.parquet"]


def real_nli_rows():
    """Every real 3-way NLI row in ../shared/data (SNLI sample/dev/test, MNLI dev m/mm), canonical."""
    import datasets

    from debiased_nli.data.loading import load_task

    parts = [load_task("snli", data_files=str(SHARED_DATA / f)).dataset for f in NLI_FILES]
    return datasets.concatenate_datasets(parts)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_stage(script: Path, stage: str, *args: str) -> dict:
    """Run one stage in a fresh interpreter so its peak memory is its own; returns its JSON result."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(script), "--stage", stage, *args], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"stage {stage} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> dict:
    import platform

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
