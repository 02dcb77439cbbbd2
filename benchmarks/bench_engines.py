"""The generator's sampling engines side by side (issue 50): the project's engines (`debiased-nli generate
--engine fast | generate | ctranslate2`) and the peers a CPU user would reach for (llama.cpp through
llama-cpp-python, ONNX Runtime GenAI; ``benchmarks/engine_peers.py``), on the same generator, the same prompt
(unconditional: the format's start), top-p 1.0, temperature 1.0, at most 128 new tokens.

    python benchmarks/bench_engines.py --generator /work/runs/seqz_cpu/Gstar --samples 1000 --rounds 2 \
        --arms fast:bfloat16:256,generate:bfloat16:64,ctranslate2:float32:256,llamacpp:bf16:128 \
        --peer llamacpp=/work/peers/llama/bin/python --model llamacpp:bf16=/work/peers/gstar-bf16.gguf \
        --conditions idle,loaded --reference ctranslate2:float32:256

An arm is ENGINE:DTYPE:BATCH (ENGINE:DTYPE:BATCH@N: N samples per round instead of ``--samples``). Each condition runs ``--rounds`` rounds; a round runs every arm once, each in
its own process, in an order that rotates between rounds (A B C, B C A, ...), so slow drifts of the machine
fall on every arm alike. ``loaded``: a second job (one thread multiplying float32 matrices) runs on the
machine during every arm. Per arm and condition: samples/s and generated tokens/s (new tokens up to and
including the end marker, counted with the generator's tokenizer), the parse rate, label shares and
hypothesis length with tests against the ``--reference`` arm (``benchmarks/engine_parity.py``'s: chi-square
on the labels, KS on the lengths), peak resident memory (the child's VmHWM), and the share of this CPU's roofline
measured in the same run (matrix-multiply FLOP/s in the arm's arithmetic, copy bandwidth): achieved FLOP/s is
tokens/s x 2 x parameters (the weights' multiply-adds; attention adds little at these lengths).
Writes benchmarks/results/engines/<name>.{json,md}.
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
LIBRARY = ("fast", "generate", "ctranslate2")
PEERS = ("llamacpp", "ortgenai")
LOAD = ("import numpy as np, time\na = np.random.rand(768, 768).astype(np.float32)\n"
        "while True:\n    a = (a @ a) / 768.0\n")


def roofline(threads: int) -> dict:
    """This CPU's copy bandwidth (GB/s, read + write of a 1 GB array) and matrix-multiply rates (GFLOP/s of
    2048 x 2048 products in float32 and bfloat16, ``threads`` threads), best of 5."""
    import numpy as np
    import torch
    torch.set_num_threads(threads)
    a = np.ones(2**27)  # 1 GiB of float64
    b = np.empty_like(a)
    copy = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        copy.append(2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    out = {"copy_gb_s": round(max(copy), 1)}
    for dt in ("float32", "bfloat16"):
        x = torch.randn(2048, 2048).to(getattr(torch, dt))
        best = 0.0
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(4):
                x @ x
            best = max(best, 4 * 2 * 2048**3 / (time.perf_counter() - t) / 1e9)
        out[f"matmul_{dt}_gflop_s"] = round(best, 1)
    return out


def roofline_of(threads: int) -> dict:
    """:func:`roofline` in a fresh process with ``threads`` threads (this process's thread settings are not
    the arms')."""
    code = f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.bench_engines import roofline; print(json.dumps(roofline({threads})))"
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_arm(args, arm: str, seed: int, out: Path, prompt_ids: list[int], eos: int, threads: int) -> dict:
    engine, dtype, batch = arm.split("@")[0].split(":")
    n = int(arm.split("@")[1]) if "@" in arm else args.samples  # ARM@N: N samples per round for this arm
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    if engine in LIBRARY:
        cmd = [sys.executable, "-m", "debiased_nli.cli", "generate", "snli", "--generator", args.generator,
               "--out", str(out), "--num-samples", str(n), "--shard-size", str(n),
               "--batch-size", batch, "--seed", str(seed), "--engine", engine, "--dtype", dtype, "--cpu",
               "--threads", str(threads), "--max-new-tokens", "128", "--top-p", "1.0", "--temperature", "1.0"]
    else:
        model = args.model.get(f"{engine}:{dtype}")
        if not model or engine not in args.peer:
            raise SystemExit(f"arm {arm}: give --peer {engine}=PYTHON and --model {engine}:{dtype}=PATH")
        cmd = [args.peer[engine], str(ROOT / "benchmarks" / "engine_peers.py"), engine, "--model", model,
               "--prompt-ids", ",".join(map(str, prompt_ids)), "--eos", str(eos), "--samples", str(n),
               "--batch", batch, "--seed", str(seed), "--threads", str(threads), "--out", str(out) + ".json"]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    log = out.with_suffix(".log")
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        peak_kb = 0
        while True:  # the child's own peak: VmHWM of its address space (wait4's ru_maxrss would include
            # this process's resident memory at the fork, which Linux carries across exec)
            try:
                with open(f"/proc/{p.pid}/status") as st:
                    peak_kb = max([peak_kb] + [int(x.split()[1]) for x in st if x.startswith("VmHWM:")])
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.2)
        p.returncode = status
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{arm} failed:\n{log.read_text()[-3000:]}")
    if engine in LIBRARY:
        seconds = json.loads((out / "generate_report.json").read_text())["this_run"]["seconds"]
    else:
        seconds = json.loads(Path(str(out) + ".json").read_text())["seconds"]
    return {"arm": arm, "seconds": seconds, "wall_seconds": round(wall, 1),
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_mb": round(peak_kb / 1024, 1),
            "load_before": round(load0[0], 2), "load_after": round(os.getloadavg()[0], 2)}


def arm_rows(arm: str, out: Path, tok, fmt, labels: list[str]) -> dict:
    """Parsed rows of one arm's run: label counts, lengths, parse counts and generated tokens."""
    import numpy as np

    from benchmarks.engine_parity import run_summary
    from debiased_nli.bias.features import tokenize
    engine = arm.split(":")[0]
    if engine in LIBRARY:
        s = run_summary(str(out))
        import pyarrow.parquet as pq
        tokens = 0
        end = tok.eos_token or ""
        for f in out.glob("*.parquet"):
            t = pq.read_table(f).to_pydict()
            texts = (t["text"] if "text" in t else
                     [f" {p}\nlabel: {lab}\nhypothesis: {h}{end}" for p, lab, h in
                      zip(t["premise"], [labels[x] for x in t["label"]], t["hypothesis"])])
            if texts:
                tokens += sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"])
        return {"samples": s["samples"], "parsed": s["parsed"], "counts": [s["label_counts"][k] for k in labels],
                "hyp": s["_hyp"], "prem": s["_prem"], "tokens": tokens}
    samples = json.loads(Path(str(out) + ".json").read_text())["samples"]
    prompt = fmt.prompt()
    counts, hyp, prem, parsed = np.zeros(len(labels), dtype=np.int64), [], [], 0
    for ids in samples:
        row, _ = fmt.parse(prompt + tok.decode(ids, skip_special_tokens=False))
        if row is None:
            continue
        parsed += 1
        lab = row["label"]
        counts[lab if isinstance(lab, int) else labels.index(lab)] += 1
        hyp.append(len(tokenize(row["hypothesis"])))
        prem.append(len(tokenize(row["premise"])))
    return {"samples": len(samples), "parsed": parsed, "counts": counts.tolist(), "hyp": hyp, "prem": prem,
            "tokens": sum(len(x) for x in samples)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generator", required=True)
    ap.add_argument("--samples", type=int, default=1000, help="samples per arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", required=True)
    ap.add_argument("--loaded-arms", default=None, help="the arms of the loaded condition (default: all)")
    ap.add_argument("--reference", default=None, help="the arm the others' outputs are tested against (default: first)")
    ap.add_argument("--conditions", default="idle,loaded")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loaded-threads", type=int, default=None,
                    help="threads of the arms beside the second job (default: --threads minus the job's core, at least 1)")
    ap.add_argument("--peer", action="append", default=[], help="ENGINE=PYTHON: the interpreter that runs a peer")
    ap.add_argument("--model", action="append", default=[], help="ENGINE:DTYPE=PATH: a peer's converted model")
    ap.add_argument("--prepared", default="", help="how the peers' models were made (written to the report)")
    ap.add_argument("--name", default="speed")
    ap.add_argument("--units", default=None, help="a folder for one result file per arm run: a rerun skips the runs "
                    "already there (resume after an interruption)")
    args = ap.parse_args(argv)
    if args.loaded_threads is None:
        args.loaded_threads = max(1, args.threads - 1)
    args.peer = dict(x.split("=", 1) for x in args.peer)
    args.model = dict(x.split("=", 1) for x in args.model)
    import numpy as np

    from benchmarks.engine_parity import compare, verdict
    from debiased_nli.data.tasks import get_task
    from debiased_nli.methods.generation.format import SequenceFormat
    from debiased_nli.methods.generation.models import load_generator, load_tokenizer
    tok = load_tokenizer(args.generator)
    labels = list(get_task("snli").labels)
    fmt = SequenceFormat.for_tokenizer(tok, labels)
    prompt_ids = tok(fmt.prompt(), add_special_tokens=False)["input_ids"]
    model, _ = load_generator(args.generator)
    if hasattr(model, "merge_and_unload"):  # the engines sample from the merged weights
        model = model.merge_and_unload()
    # the multiply-adds per token: every weight once (the tied output layer is the embedding's weight, counted
    # once by parameters() and used once per token, as the head; the input lookup multiplies nothing)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    runs_of = args.arms.split(",")  # as given (ARM@N); results are keyed by the arm without its @N
    arms = [a.split("@")[0] for a in runs_of]
    ref = (args.reference or arms[0]).split("@")[0]
    roof = roofline_of(args.threads)
    roof_loaded = roofline_of(args.loaded_threads) if "loaded" in args.conditions.split(",") else roof
    print(json.dumps({"roofline": roof, "params": n_params}), flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    runs, rows = [], {}
    try:
        for cond in args.conditions.split(","):
            cond_arms = runs_of if cond == "idle" or not args.loaded_arms else args.loaded_arms.split(",")
            for r in range(args.rounds):
                order = cond_arms[r % len(cond_arms):] + cond_arms[:r % len(cond_arms)]
                for arm in order:
                    name = f"{cond}-r{r}-{arm.replace(':', '_').replace('@', '_')}"
                    unit = Path(args.units) / f"{name}.json" if args.units else None
                    if unit and unit.exists():  # a unit of an earlier, interrupted run of this benchmark
                        res, got = (lambda d: (d["run"], d["rows"]))(json.loads(unit.read_text()))
                    else:
                        out = work / name
                        load = (subprocess.Popen([sys.executable, "-c", LOAD], env={**os.environ, "OMP_NUM_THREADS": "1"})
                                if cond == "loaded" else None)
                        try:
                            res = run_arm(args, arm, 100 + r, out, prompt_ids, tok.eos_token_id,
                                          args.threads if cond == "idle" else args.loaded_threads)
                        finally:
                            if load:
                                load.kill()
                                load.wait()
                        got = arm_rows(arm, out, tok, fmt, labels)
                        res.update(arm=arm.split("@")[0], condition=cond, round=r, samples=got["samples"],
                                   parsed=got["parsed"], tokens=got["tokens"], labels=dict(zip(labels, got["counts"])))
                        shutil.rmtree(out, ignore_errors=True)
                        if unit:
                            unit.parent.mkdir(parents=True, exist_ok=True)
                            unit.write_text(json.dumps({"run": res, "rows": got}))
                    acc = rows.setdefault((cond, arm.split("@")[0]), {"counts": np.zeros(len(labels), dtype=np.int64), "hyp": [],
                                                        "prem": [], "samples": 0, "parsed": 0, "no_lengths": 0})
                    acc["counts"] += got["counts"]
                    if got.get("hyp") is None:  # a unit that kept its counts but not its lengths
                        acc["no_lengths"] += got["samples"]
                    else:
                        acc["hyp"] += got["hyp"]
                        acc["prem"] += got["prem"]
                    acc["samples"] += got["samples"]
                    acc["parsed"] += got["parsed"]
                    runs.append(res)
                    print(json.dumps(res), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    again = roofline_of(args.threads)
    roof = {k: max(v, again[k]) for k, v in roof.items()}  # the best of the start's and the end's readings:
    # another job running during one reading lowers it, nothing raises it
    if "loaded" in args.conditions.split(","):
        again = roofline_of(args.loaded_threads)
        roof_loaded = {k: max(v, again[k]) for k, v in roof_loaded.items()}
    summary = {}
    # the output distribution: every arm's rows of both conditions against the reference arm's
    dist = {}
    for arm in arms:
        acc = {"label_counts": dict(zip(labels, sum(rows[k]["counts"] for k in rows if k[1] == arm).tolist())),
               "_hyp": [x for k in rows if k[1] == arm for x in rows[k]["hyp"]],
               "_prem": [x for k in rows if k[1] == arm for x in rows[k]["prem"]],
               "samples": sum(rows[k]["samples"] for k in rows if k[1] == arm),
               "samples_without_lengths": sum(rows[k]["no_lengths"] for k in rows if k[1] == arm),
               "parsed": sum(rows[k]["parsed"] for k in rows if k[1] == arm)}
        dist[arm] = acc
    tests = {arm: compare(dist[ref], dist[arm]) for arm in arms if arm != ref}
    for (cond, arm) in rows:
        mine = [x for x in runs if x["arm"] == arm and x["condition"] == cond]
        secs = sum(x["seconds"] for x in mine)
        n = sum(x["samples"] for x in mine)
        tps = sum(x["tokens"] for x in mine) / secs
        dtype = arm.split(":")[1]
        rf = roof if cond == "idle" else roof_loaded  # (measured on an idle machine at the arm's thread count)
        peak = rf["matmul_bfloat16_gflop_s"] if dtype in ("bfloat16", "bf16") else rf["matmul_float32_gflop_s"]
        d = dist[arm]
        summary[f"{cond}|{arm}"] = {
            "condition": cond, "arm": arm, "samples": n, "samples_per_s": round(n / secs, 3), "tokens_per_s": round(tps, 1),
            "per_round_samples_per_s": [round(x["samples"] / x["seconds"], 3) for x in mine],
            "cpu_seconds_per_sample": round(sum(x["cpu_seconds"] for x in mine) / n, 4),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in mine),
            "matmul_roofline_share": round(tps * 2 * n_params / 1e9 / peak, 3),
            "parse_rate": round(d["parsed"] / d["samples"], 4),
            "label_shares": {k: round(v / max(d["parsed"], 1), 4) for k, v in d["label_counts"].items()},
            "hypothesis_words_mean": round(float(np.mean(d["_hyp"])), 2)}
    for cond in args.conditions.split(","):
        here = [k for k in summary if summary[k]["condition"] == cond]
        best_peer = max((summary[k]["samples_per_s"] for k in here if summary[k]["arm"].split(":")[0] in PEERS + ("ctranslate2",)),
                        default=None)
        same = lambda a: a == ref or verdict(tests[a]).startswith("same")  # noqa: E731
        best_same = max((summary[k]["samples_per_s"] for k in here if summary[k]["arm"].split(":")[0] in PEERS + ("ctranslate2",)
                         and same(summary[k]["arm"])), default=None)
        for k in here:
            summary[k]["ratio_to_best_peer"] = round(summary[k]["samples_per_s"] / best_peer, 3) if best_peer else None
            summary[k]["ratio_to_best_peer_same_output"] = (round(summary[k]["samples_per_s"] / best_same, 3)
                                                            if best_same else None)
            summary[k]["same_output_as_reference"] = same(summary[k]["arm"])
    command = "python benchmarks/bench_engines.py " + " ".join(sys.argv[1:] if argv is None else argv)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(
        {"command": command, "prepared": args.prepared, "roofline": roof, "roofline_loaded_threads": roof_loaded, "params": n_params, "reference": ref,
         "runs": runs, "summary": summary,
         "distribution": {arm: {k: v for k, v in dist[arm].items() if not k.startswith("_")} for arm in arms},
         "tests": tests}, indent=2))
    md = [f"# Sampling engines side by side ({args.samples:,} samples per arm and round, {args.rounds} rounds, interleaved)",
          "", f"Command: `{command}`", ""]
    if args.prepared:
        md += [f"Peers' models: {args.prepared}", ""]
    md += [f"This CPU in the same run: copy {roof['copy_gb_s']} GB/s; matrix multiply {roof['matmul_float32_gflop_s']} "
           f"GFLOP/s float32, {roof['matmul_bfloat16_gflop_s']} GFLOP/s bfloat16 ({args.threads} threads; at "
           f"{args.loaded_threads}: {roof_loaded['matmul_float32_gflop_s']} and {roof_loaded['matmul_bfloat16_gflop_s']}). "
           f"Loaded: a second job (one thread of float32 matrix products) runs beside every arm, which then uses "
           f"{args.loaded_threads} thread(s). The generator "
           f"has {n_params / 1e6:.1f} M parameters: 2 x that many FLOP per token.", "",
           "Peers: CTranslate2, llama.cpp, ONNX Runtime GenAI; \"at the same output\": among the arms whose output "
           "distribution passes every test against the reference (below).", "",
           "| condition | engine:dtype:batch | samples/s | tokens/s | ratio to the best peer | ratio to the best peer at the same output "
           "| same output | per round | CPU s per sample | share of matmul roofline | peak memory MB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, s in summary.items():
        md.append(f"| {s['condition']} | {s['arm']} | {s['samples_per_s']} | {s['tokens_per_s']} | {s['ratio_to_best_peer']} | "
                  f"{s['ratio_to_best_peer_same_output']} | {'yes' if s['same_output_as_reference'] else 'no'} | "
                  f"{s['per_round_samples_per_s']} | {s['cpu_seconds_per_sample']} | {s['matmul_roofline_share']} | {s['peak_rss_mb']:,} |")
    missing = {a: d["samples_without_lengths"] for a, d in dist.items() if d["samples_without_lengths"]}
    md += ["", f"Output distribution (both conditions pooled) against `{ref}`: chi-square on the label counts, "
           "Kolmogorov-Smirnov on hypothesis and premise word counts; verdict at alpha 0.01 per test."
           + (" Lengths were not kept for " + ", ".join(f"{n:,} samples of {a}" for a, n in missing.items())
              + " (runs from before the unit files; their speed and label counts come from the run's log): the length "
              "tests and means use the others." if missing else ""), "",
           "| engine:dtype:batch | samples | parse rate | " + " | ".join(labels)
           + " | hyp. words | labels p | entailment - reference (95%) | hyp. length KS p | verdict |",
           "|---|---|---|" + "---|" * len(labels) + "---|---|---|---|---|"]
    for arm in arms:
        d, c = dist[arm], tests.get(arm)
        shares = [d["label_counts"][k] / max(d["parsed"], 1) for k in labels]
        cells = [arm + (" (reference)" if arm == ref else ""), f"{d['samples']:,}", f"{d['parsed'] / d['samples']:.4f}",
                 *[f"{x:.4f}" for x in shares], f"{np.mean(d['_hyp']):.2f}"]
        if c:
            e = c["label_share_diff_ci95"][labels[0]]
            cells += [f"{c['labels_p']:.3g}", f"{e[0]:+.4f} [{e[1]:+.4f}, {e[2]:+.4f}]", f"{c['hypothesis_length_p']:.3g}", verdict(c)]
        else:
            cells += ["", "", "", ""]
        md.append("| " + " | ".join(cells) + " |")
    (OUT / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
