"""The benchmarks' shared harness: the real NLI rows to resample, stages and arms run in processes of their own with
their wall, CPU and peak memory, arms in rotating order, this machine's roofline, and the result files (JSON and
markdown with its tables)."""
from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("DEBIASED_NLI_SHARED", ROOT.parent / "shared")) / "data"
RESULTS = ROOT / "benchmarks" / "results"
MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
NLI_FILES = ["snli/train_sample.parquet", "snli/dev.parquet", "snli/test.parquet",
             "mnli/dev_matched.parquet", "mnli/dev_mismatched.parquet"]
for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_k, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def real_nli_rows():
    """Every real 3-way NLI row in ../shared/data (SNLI sample/dev/test, MNLI dev m/mm), canonical."""
    import datasets

    from debiased_nli.data.loading import load_task

    return datasets.concatenate_datasets([load_task("snli", data_files=str(SHARED_DATA / f)).dataset for f in NLI_FILES])


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine(**extra) -> dict:
    from debiased_nli.utils.precision import cpu_description

    cpu = cpu_description()
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "cpu_model": cpu.get("model"), "native_bfloat16": cpu.get("native_bfloat16"), **extra}


def command(script: str, argv: list[str] | None = None) -> str:
    """The command line a result file names: ``python benchmarks/SCRIPT ARGS``."""
    return " ".join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


def run_stage(script: Path, stage: str, *args: str) -> dict:
    """Run one stage in a fresh interpreter so its peak memory is its own; returns its JSON result."""
    proc = subprocess.run([sys.executable, str(script), "--stage", stage, *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"stage {stage} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(stage, result, file=sys.stderr)
    return result


def run_process(cmd: list, log: Path, env: dict | None = None, cwd: Path | None = None, every: float = 0.1) -> dict:
    """``cmd`` as its own process tree, its output into ``log``: wall and CPU seconds, the peak of the sum of its
    processes' RSS and PSS (pages shared by forked workers counted once), and its root's own peak (VmHWM: wait4's
    ru_maxrss would include this process's memory at the fork). Raises with the log's end when it fails."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen([str(c) for c in cmd], env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT)
        root, rss, pss, hwm = psutil.Process(proc.pid), 0, 0, 0
        while proc.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
                infos = [p.memory_full_info() for p in procs]
                rss, pss = max(rss, sum(i.rss for i in infos)), max(pss, sum(getattr(i, "pss", i.rss) for i in infos))
                with open(f"/proc/{proc.pid}/status") as st:
                    hwm = max([hwm] + [int(x.split()[1]) * 1024 for x in st if x.startswith("VmHWM:")])
            except (psutil.Error, OSError, ValueError):
                pass
            time.sleep(every)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:6]))} ... failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    return {"wall_s": round(time.perf_counter() - t0, 1), "peak_rss_mb": round(rss / 2**20),
            "peak_pss_mb": round(pss / 2**20), "peak_root_rss_mb": round(hwm / 2**20, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime, 1)}


def rotations(arms: list, rounds: int) -> list[tuple[int, object]]:
    """(round, arm) in the order the arms run: every arm once a round, the order rotating from round to round
    (A B C, B C A, ...), so that slow drifts of a shared machine fall on every arm alike."""
    return [(r, arm) for r in range(rounds) for arm in arms[r % len(arms):] + arms[:r % len(arms)]]


def roofline(threads: int, fresh: bool = True) -> dict:
    """This CPU's copy bandwidth (GB/s, read + write of a 1 GiB array) and matrix-multiply rates (GFLOP/s of 2048 x
    2048 products in float32 and bfloat16 on ``threads`` threads), best of 5; ``fresh``: in a process of its own
    (this one's thread settings are not the arms')."""
    if fresh:
        code = f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.common import roofline; " \
               f"print(json.dumps(roofline({threads}, False)))"
        p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                           capture_output=True, text=True, check=True)
        return json.loads(p.stdout.strip().splitlines()[-1])
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    a = np.ones(2**27)
    b = np.empty_like(a)
    def timed(fn, *args) -> float:
        t = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t

    out = {"copy_gb_s": round(max(2 * a.nbytes / timed(np.copyto, b, a) / 1e9 for _ in range(5)), 1)}
    for dt in ("float32", "bfloat16"):
        x = torch.randn(2048, 2048).to(getattr(torch, dt))
        out[f"matmul_{dt}_gflop_s"] = round(max(4 * 2 * 2048**3 / timed(lambda: [x @ x for _ in range(4)]) / 1e9
                                                for _ in range(5)), 1)
    return out


def md_table(header: list[str], rows: list[list], align: str = "") -> list[str]:
    """A markdown table; ``align``: one character a column, ``r`` right-aligned (default: left)."""
    align = align or "l" * len(header)
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def write_result(stem: "str | Path", record: dict, md: "list[str] | str", quiet: bool = False) -> None:
    """``STEM.json`` and ``STEM.md`` (printed too)."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    text = md if isinstance(md, str) else "\n".join(md) + "\n"
    Path(f"{stem}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    Path(f"{stem}.md").write_text(text)
    if not quiet:
        print(text)


def write_json(path: "str | Path", obj) -> None:
    """``obj`` as JSON at ``path``, whole or not at all (a temporary file renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)
