"""The sampling engines side by side (issue 50): `debiased-nli generate` with each engine on the same generator,
the same prompt (unconditional: the format's start), top-p 1.0, temperature 1.0, at most 128 new tokens, run
interleaved (round r runs every arm once, in an order that rotates between rounds), each arm its own
process (its peak resident memory from wait4).

    python benchmarks/bench_engines.py --generator /work/runs/seqz_cpu/Gstar --samples 512 --rounds 2 \
        --arms fast:bfloat16:256,ctranslate2:float32:128,ctranslate2:int8:128,generate:bfloat16:128 --threads 2

An arm is ENGINE:DTYPE:BATCH. Per arm: samples/s and generated tokens/s (new tokens up to and including the
end marker, counted with the generator's tokenizer over the shards' and rejects' texts) of every round, the
parse rate and label shares over its rounds, peak memory, the ratio to the first arm, and the load average
before and after each run (other jobs on the machine fall on all arms alike only because they alternate).
Writes benchmarks/results/engines/speed.{json,md} (``--name`` changes the name).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "engines"


def run_arm(generator: str, arm: str, samples: int, seed: int, threads: int, out: Path) -> dict:
    engine, dtype, batch = arm.split(":")
    cmd = [sys.executable, "-m", "debiased_nli.cli", "generate", "snli", "--generator", generator, "--out", str(out),
           "--num-samples", str(samples), "--shard-size", str(samples), "--batch-size", batch, "--seed", str(seed),
           "--engine", engine, "--dtype", dtype, "--cpu", "--threads", str(threads), "--max-new-tokens", "128",
           "--top-p", "1.0", "--temperature", "1.0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    log = out.with_suffix(".log")
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)  # the child's own peak resident memory
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{arm} failed:\n{log.read_text()[-3000:]}")
    report = json.loads((out / "generate_report.json").read_text())
    return {"arm": arm, "seconds": report["this_run"]["seconds"], "wall_seconds": round(wall, 1),
            "samples": report["samples"], "parsed": report["parsed"], "labels": report["labels"],
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()]}


def generated_tokens(tok, folder: Path, end: str) -> int:
    import pyarrow.parquet as pq
    n = 0
    for f in folder.glob("*.parquet"):
        t = pq.read_table(f).to_pydict()
        texts = t["text"] if "text" in t else [f"hypothesis: {h}{end}" for h in t["hypothesis"]]
        if "text" not in t:  # a parsed row: premise, label and hypothesis were all generated
            texts = [f" {p}\nlabel: {lab}\nhypothesis: {h}{end}" for p, lab, h in
                     zip(t["premise"], t["label"], t["hypothesis"])]
        for text in texts:
            n += len(tok(text, add_special_tokens=False)["input_ids"])
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generator", required=True)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default="fast:bfloat16:256,ctranslate2:float32:128,ctranslate2:int8:128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="speed")
    args = ap.parse_args(argv)
    from debiased_nli.methods.generation.models import load_tokenizer
    tok = load_tokenizer(args.generator)
    arms = args.arms.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    runs = []
    try:
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for arm in order:
                out = work / f"r{r}-{arm.replace(':', '_')}"
                res = run_arm(args.generator, arm, args.samples, 100 + r, args.threads, out)
                res["round"] = r
                res["tokens"] = generated_tokens(tok, out, tok.eos_token or "")
                runs.append(res)
                print(json.dumps(res), flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for arm in arms:
        mine = [x for x in runs if x["arm"] == arm]
        secs = sum(x["seconds"] for x in mine)
        n = sum(x["samples"] for x in mine)
        labels = {}
        for x in mine:
            for k, v in x["labels"].items():
                labels[k] = labels.get(k, 0) + v
        parsed = sum(x["parsed"] for x in mine)
        summary[arm] = {"samples_per_s": round(n / secs, 3), "tokens_per_s": round(sum(x["tokens"] for x in mine) / secs, 1),
                        "per_round_samples_per_s": [round(x["samples"] / x["seconds"], 3) for x in mine],
                        "parse_rate": round(parsed / n, 4),
                        "label_shares": {k: round(v / max(parsed, 1), 4) for k, v in labels.items()},
                        "samples": n, "peak_rss_mb": max(x["peak_rss_mb"] for x in mine)}
    first = summary[arms[0]]["samples_per_s"]
    for arm in arms:
        summary[arm]["ratio_to_first"] = round(summary[arm]["samples_per_s"] / first, 3)
    command = "python benchmarks/bench_engines.py " + " ".join(sys.argv[1:] if argv is None else argv)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps({"command": command, "runs": runs, "summary": summary}, indent=2))
    md = [f"# Sampling engines side by side ({args.samples} samples per arm and round, {args.rounds} rounds, interleaved)", "",
          f"Command: `{command}`", "",
          "| engine:dtype:batch | samples/s | tokens/s | ratio to first | per round | parse rate | label shares (e/n/c) | peak memory MB | load before → after |",
          "|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        s = summary[arm]
        loads = "; ".join(f"{x['load_before'][0]} → {x['load_after'][0]}" for x in runs if x["arm"] == arm)
        md.append(f"| {arm} | {s['samples_per_s']} | {s['tokens_per_s']} | {s['ratio_to_first']} | "
                  f"{s['per_round_samples_per_s']} | {s['parse_rate']} | "
                  + "/".join(f"{v:.3f}" for v in s["label_shares"].values()) + f" | {s['peak_rss_mb']} | {loads} |")
    (OUT / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
