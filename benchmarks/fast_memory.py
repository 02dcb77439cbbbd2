"""Where the fast engine's memory goes (issue 50: it peaked at 7 GB at batch 256 in bfloat16, 2.7 GB in float32).

Found with it: the peak was one prefill pass. The model returns the last position's logits only, so the output
layer got ``hidden[:, -1:, :]``, a strided view, and PyTorch's CPU ``linear`` multiplies a strided 3-D input as
a batched product against the 49,152 x 576 weight expanded to every row and copied (pytorch/pytorch#151934):
5.6 GB of bfloat16 for a prefill of 100 rows, about 5 s. ``contiguous_head_input`` (``generation/sample.py``)
gives the head a contiguous input: peak 7,034 -> 1,562 MB in bfloat16 (256 samples, batch 256, G*), float32
2,636 MB (its keys and values: 256 slots x 30 layers). Run it again to check a PyTorch upgrade.

Samples ``--samples`` rows from ``--generator`` in this process with ``generate_samples`` (engine fast) while
a thread reads this process's resident memory every 20 ms, and prints it after loading, and its peak while
sampling, with torch's own view (``torch.profiler`` is not used: the reading is the kernel's VmRSS/VmHWM).

    python benchmarks/fast_memory.py --generator /work/runs/seqz_cpu/Gstar --dtype bfloat16 --batch 256
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generator", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    from debiased_nli.data.tasks import get_task
    from debiased_nli.methods.generation import sample as S
    torch.set_num_threads(args.threads)
    trace, stop = [], threading.Event()

    def watch():
        t0 = time.perf_counter()
        while not stop.is_set():
            trace.append((time.perf_counter() - t0, rss_mb()))
            time.sleep(0.02)

    loaded = {}
    orig = S._load_for_sampling

    def load(*a, **k):
        out = orig(*a, **k)
        loaded["after_load_mb"] = rss_mb()
        loaded["t"] = trace[-1][0] if trace else 0
        return out
    S._load_for_sampling = load
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    with tempfile.TemporaryDirectory() as tmp:
        S.generate_samples(args.generator, tmp, get_task("snli"), args.samples,
                           S.SamplingOptions(batch_size=args.batch, dtype=args.dtype), cpu=True, progress=False)
    stop.set()
    th.join()
    after = [m for t, m in trace if t >= loaded["t"]]
    peak_t, peak = max(trace, key=lambda x: x[1])
    res = {"dtype": args.dtype, "batch": args.batch, "after_load_mb": round(loaded["after_load_mb"]),
           "peak_mb": round(peak), "peak_at_s": round(peak_t, 1), "load_done_at_s": round(loaded["t"], 1),
           "peak_while_sampling_mb": round(max(after)), "end_mb": round(trace[-1][1])}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
