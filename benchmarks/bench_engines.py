"""The generator's sampling engines side by side (issue 50): `debiased-nli generate --engine fast | generate |
ctranslate2` on the same generator, the same prompt (unconditional: the format's start), top-p 1.0, temperature 1.0,
at most 128 new tokens.

    python benchmarks/bench_engines.py --generator /work/runs/seqz_cpu/Gstar --samples 1000 --rounds 2 \
        --arms fast:bfloat16:256,generate:bfloat16:64,ctranslate2:float32:256 \
        --conditions idle,loaded --reference ctranslate2:float32:256

An arm is ENGINE:DTYPE:BATCH (ENGINE:DTYPE:BATCH@N: N samples per round instead of ``--samples``). Each condition
runs ``--rounds`` rounds; a round runs every arm once, each in its own process, in an order that rotates between
rounds (A B C, B C A, ...), so slow drifts of the machine fall on every arm alike. ``loaded``: a second job (one
thread multiplying float32 matrices) runs on the machine during every arm. Per arm and condition: samples/s and
generated tokens/s (new tokens up to and including the end marker, counted with the generator's tokenizer), the
parse rate, label shares and hypothesis length with tests against the ``--reference`` arm
(chi-square on the labels, KS on the lengths: :func:`compare`), peak resident memory (the child's
VmHWM), and the share of this CPU's roofline measured in the same run (matrix-multiply FLOP/s in the arm's
arithmetic, copy bandwidth): achieved FLOP/s is tokens/s x 2 x parameters (the weights' multiply-adds; attention
adds little at these lengths). Writes benchmarks/results/engines/<name>.{json,md}.

The peers llama.cpp and ONNX Runtime GenAI (engines/speed_peers.md, each in a virtual environment of its own) were
measured by ``engine_peers.py`` and this script's peer arms, in the history: ``git show
b65411f:benchmarks/bench_engines.py``; so is ``engine_parity.py``, which tested two generate runs' outputs the same
way (engines/parity_gstar.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, ROOT, command, md_table, roofline, rotations, run_process, write_result  # noqa: E402

LOAD = "import numpy as np\na = np.random.rand(768, 768).astype(np.float32)\nwhile True:\n    a = (a @ a) / 768.0\n"


def run_summary(folder: str) -> dict:
    """Counts and length arrays of a generate run folder (its complete shards and their rejects)."""
    import numpy as np
    import pyarrow.parquet as pq

    from debiased_nli.bias.features import tokenize
    from debiased_nli.data.tasks import get_task

    folder = Path(folder)
    labels = list(get_task(json.loads((folder / "generate_config.json").read_text())["task"]).labels)
    counts, parsed, rejected, hyp_len, prem_len = np.zeros(len(labels), dtype=np.int64), 0, 0, [], []
    for shard in sorted(folder.glob("shard-*-of-*.parquet")):
        rows, rej = pq.read_table(shard).to_pydict(), shard.with_name(shard.name.replace("shard-", "rejects-"))
        parsed, rejected = parsed + len(rows["hypothesis"]), rejected + (pq.read_metadata(rej).num_rows if rej.exists() else 0)
        counts += np.bincount(np.asarray(rows["label"], dtype=np.int64), minlength=len(labels))
        hyp_len += [len(tokenize(h)) for h in rows["hypothesis"]]
        prem_len += [len(tokenize(p)) for p in rows["premise"]]
    return {"samples": parsed + rejected, "parsed": parsed, "label_counts": dict(zip(labels, counts.tolist())),
            "_hyp": hyp_len, "_prem": prem_len}


def compare(ref: dict, run: dict) -> dict:
    """Tests of ``run`` against ``ref`` (p-values; small ones say the distributions differ)."""
    import numpy as np
    from scipy import stats

    labels = list(ref["label_counts"])
    table = np.array([[ref["label_counts"][k] for k in labels], [run["label_counts"][k] for k in labels]])
    chi2, p_labels, dof, _ = stats.chi2_contingency(table)
    parse = np.array([[ref["parsed"], ref["samples"] - ref["parsed"]], [run["parsed"], run["samples"] - run["parsed"]]])
    if parse.min() < 5:
        p_parse = float(stats.fisher_exact(parse)[1])
    else:
        p_parse = float(stats.chi2_contingency(parse)[1])
    ks_h = stats.ks_2samp(ref["_hyp"], run["_hyp"])
    ks_p = stats.ks_2samp(ref["_prem"], run["_prem"])
    # the difference of each label share with its 95% interval (normal approximation)
    share_diff = {}
    for k in labels:
        a, n1 = ref["label_counts"][k], ref["parsed"]
        b, n2 = run["label_counts"][k], run["parsed"]
        p1, p2 = a / n1, b / n2
        se = (p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2) ** 0.5
        share_diff[k] = [round(p2 - p1, 4), round(p2 - p1 - 1.96 * se, 4), round(p2 - p1 + 1.96 * se, 4)]
    return {"labels_chi2": round(float(chi2), 3), "labels_dof": int(dof), "labels_p": float(p_labels),
            "label_share_diff_ci95": share_diff, "parse_p": p_parse,
            "hypothesis_length_ks": round(float(ks_h.statistic), 4), "hypothesis_length_p": float(ks_h.pvalue),
            "premise_length_ks": round(float(ks_p.statistic), 4), "premise_length_p": float(ks_p.pvalue)}


def verdict(c: dict, alpha: float = 0.01) -> str:
    bad = [name for name, key in (("label shares", "labels_p"), ("parse rate", "parse_p"),
                                  ("hypothesis length", "hypothesis_length_p"), ("premise length", "premise_length_p"))
           if c[key] < alpha]
    return "same (no test below %g)" % alpha if not bad else "differs: " + ", ".join(bad)


def run_arm(args, arm: str, seed: int, out: Path, threads: int) -> dict:
    """One arm's `debiased-nli generate` in its own process: its sampling seconds (the report's), wall, CPU, peak."""
    engine, dtype, batch = arm.split("@")[0].split(":")
    n = int(arm.split("@")[1]) if "@" in arm else args.samples  # ARM@N: N samples per round for this arm
    cmd = [sys.executable, "-m", "debiased_nli.cli", "generate", "snli", "--generator", args.generator, "--out", out,
           "--num-samples", n, "--shard-size", n, "--batch-size", batch, "--seed", seed, "--engine", engine,
           "--dtype", dtype, "--cpu", "--threads", threads, "--max-new-tokens", "128", "--top-p", "1.0",
           "--temperature", "1.0"]
    load0 = os.getloadavg()[0]
    res = run_process(cmd, out.with_suffix(".log"), env={**os.environ, "PYTHONPATH": str(ROOT),
                                                          "OMP_NUM_THREADS": str(threads)}, every=0.2)
    return {"arm": arm, "seconds": json.loads((out / "generate_report.json").read_text())["this_run"]["seconds"],
            "wall_seconds": res["wall_s"], "cpu_seconds": res["cpu_s"], "peak_rss_mb": res["peak_root_rss_mb"],
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)}


def arm_rows(out: Path, tok, fmt, labels: list[str]) -> dict:
    """Parsed rows of one arm's run: label counts, lengths, parse counts and generated tokens."""
    import pyarrow.parquet as pq

    s, tokens, end = run_summary(str(out)), 0, tok.eos_token or ""
    for f in out.glob("*.parquet"):
        t = pq.read_table(f).to_pydict()
        texts = t["text"] if "text" in t else [f" {p}\nlabel: {labels[x]}\nhypothesis: {h}{end}" for p, x, h in
                                               zip(t["premise"], t["label"], t["hypothesis"])]
        tokens += sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]) if texts else 0
    return {"samples": s["samples"], "parsed": s["parsed"], "counts": [s["label_counts"][k] for k in labels],
            "hyp": s["_hyp"], "prem": s["_prem"], "tokens": tokens}


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
    ap.add_argument("--name", default="speed")
    ap.add_argument("--units", default=None, help="a folder for one result file per arm run: a rerun skips the runs "
                    "already there (resume after an interruption)")
    args = ap.parse_args(argv)
    args.loaded_threads = args.loaded_threads or max(1, args.threads - 1)
    import numpy as np

    from debiased_nli.data.tasks import get_task
    from debiased_nli.methods.generation.format import SequenceFormat
    from debiased_nli.methods.generation.models import load_generator, load_tokenizer

    tok, labels = load_tokenizer(args.generator), list(get_task("snli").labels)
    fmt = SequenceFormat.for_tokenizer(tok, labels)
    model, _ = load_generator(args.generator)
    # the multiply-adds per token: every weight once (the merged LoRA; the tied output layer counted once)
    n_params = sum(p.numel() for p in (model.merge_and_unload() if hasattr(model, "merge_and_unload") else model).parameters())
    del model
    conditions = args.conditions.split(",")
    arms = [a.split("@")[0] for a in args.arms.split(",")]  # results are keyed by the arm without its @N
    ref = (args.reference or arms[0]).split("@")[0]
    threads = {"idle": args.threads, "loaded": args.loaded_threads}
    roof = {c: roofline(threads[c]) for c in conditions}
    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    runs, rows = [], {}
    try:
        for cond in conditions:
            for r, arm in rotations((args.loaded_arms if cond == "loaded" and args.loaded_arms else args.arms).split(","),
                                    args.rounds):
                name = f"{cond}-r{r}-{arm.replace(':', '_').replace('@', '_')}"
                unit = Path(args.units) / f"{name}.json" if args.units else None
                if unit and unit.exists():  # a unit of an earlier, interrupted run of this benchmark
                    res, got = (lambda d: (d["run"], d["rows"]))(json.loads(unit.read_text()))
                else:
                    load = subprocess.Popen([sys.executable, "-c", LOAD], env={**os.environ, "OMP_NUM_THREADS": "1"}) \
                        if cond == "loaded" else None
                    try:
                        res = run_arm(args, arm, 100 + r, work / name, threads[cond])
                    finally:
                        if load:
                            load.kill()
                            load.wait()
                    got = arm_rows(work / name, tok, fmt, labels)
                    res.update(arm=arm.split("@")[0], condition=cond, round=r, samples=got["samples"],
                               parsed=got["parsed"], tokens=got["tokens"], labels=dict(zip(labels, got["counts"])))
                    shutil.rmtree(work / name, ignore_errors=True)
                    if unit:
                        unit.parent.mkdir(parents=True, exist_ok=True)
                        unit.write_text(json.dumps({"run": res, "rows": got}))
                acc = rows.setdefault((cond, res["arm"]), {"counts": np.zeros(len(labels), dtype=np.int64), "hyp": [],
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
    for c in conditions:  # the best of the start's and the end's readings: another job lowers one, nothing raises it
        again = roofline(threads[c])
        roof[c] = {k: max(v, again[k]) for k, v in roof[c].items()}
    dist = {}  # the output distribution: every arm's rows of both conditions, tested against the reference arm's
    for arm in arms:
        mine = [v for k, v in rows.items() if k[1] == arm]
        dist[arm] = {"label_counts": dict(zip(labels, sum(v["counts"] for v in mine).tolist())),
                     "_hyp": [x for v in mine for x in v["hyp"]], "_prem": [x for v in mine for x in v["prem"]],
                     **{k: sum(v[key] for v in mine) for k, key in (("samples", "samples"), ("parsed", "parsed"),
                                                                    ("samples_without_lengths", "no_lengths"))}}
    tests = {arm: compare(dist[ref], dist[arm]) for arm in arms if arm != ref}
    same = {arm: arm == ref or verdict(tests[arm]).startswith("same") for arm in arms}
    summary = {}
    for (cond, arm) in rows:
        mine = [x for x in runs if x["arm"] == arm and x["condition"] == cond]
        secs, n, d = sum(x["seconds"] for x in mine), sum(x["samples"] for x in mine), dist[arm]
        tps = sum(x["tokens"] for x in mine) / secs
        peak = roof[cond]["matmul_bfloat16_gflop_s" if arm.split(":")[1] in ("bfloat16", "bf16") else "matmul_float32_gflop_s"]
        summary[f"{cond}|{arm}"] = {
            "condition": cond, "arm": arm, "samples": n, "samples_per_s": round(n / secs, 3), "tokens_per_s": round(tps, 1),
            "per_round_samples_per_s": [round(x["samples"] / x["seconds"], 3) for x in mine],
            "cpu_seconds_per_sample": round(sum(x["cpu_seconds"] for x in mine) / n, 4),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in mine), "matmul_roofline_share": round(tps * 2 * n_params / 1e9 / peak, 3),
            "parse_rate": round(d["parsed"] / d["samples"], 4), "same_output_as_reference": same[arm],
            "label_shares": {k: round(v / max(d["parsed"], 1), 4) for k, v in d["label_counts"].items()},
            "hypothesis_words_mean": round(float(np.mean(d["_hyp"])), 2)}
    for cond in conditions:  # against the best CTranslate2 arm (of those with the reference's output)
        here = [s for s in summary.values() if s["condition"] == cond]
        best = max((s["samples_per_s"] for s in here if s["arm"].startswith("ctranslate2")), default=None)
        best_same = max((s["samples_per_s"] for s in here if s["arm"].startswith("ctranslate2") and same[s["arm"]]),
                        default=None)
        for s in here:
            s["ratio_to_ctranslate2"] = round(s["samples_per_s"] / best, 3) if best else None
            s["ratio_to_ctranslate2_same_output"] = round(s["samples_per_s"] / best_same, 3) if best_same else None
    cmd = command("bench_engines.py", argv)
    r0, rl = roof[conditions[0]], roof.get("loaded", roof[conditions[0]])
    md = [f"# Sampling engines side by side ({args.samples:,} samples per arm and round, {args.rounds} rounds, interleaved)",
          "", f"Command: `{cmd}`", "",
          f"This CPU in the same run: copy {r0['copy_gb_s']} GB/s; matrix multiply {r0['matmul_float32_gflop_s']} GFLOP/s "
          f"float32, {r0['matmul_bfloat16_gflop_s']} GFLOP/s bfloat16 ({args.threads} threads; at {args.loaded_threads}: "
          f"{rl['matmul_float32_gflop_s']} and {rl['matmul_bfloat16_gflop_s']}). Loaded: a second job (one thread of "
          f"float32 matrix products) runs beside every arm, which then uses {args.loaded_threads} thread(s). The generator "
          f"has {n_params / 1e6:.1f} M parameters: 2 x that many FLOP per token. \"At the same output\": among the arms "
          f"whose output distribution passes every test against the reference (below).", "",
          *md_table(["condition", "engine:dtype:batch", "samples/s", "tokens/s", "ratio to CTranslate2",
                     "ratio to CTranslate2 at the same output", "same output", "per round", "CPU s per sample",
                     "share of matmul roofline", "peak memory MB"],
                    [[s["condition"], s["arm"], s["samples_per_s"], s["tokens_per_s"], s["ratio_to_ctranslate2"],
                      s["ratio_to_ctranslate2_same_output"], "yes" if s["same_output_as_reference"] else "no",
                      s["per_round_samples_per_s"], s["cpu_seconds_per_sample"], s["matmul_roofline_share"],
                      f"{s['peak_rss_mb']:,}"] for s in summary.values()]),
          "", f"Output distribution (both conditions pooled) against `{ref}`: chi-square on the label counts, "
          "Kolmogorov-Smirnov on hypothesis and premise word counts; verdict at alpha 0.01 per test.", ""]
    table = []
    for arm in arms:
        d, c = dist[arm], tests.get(arm)
        e = c["label_share_diff_ci95"][labels[0]] if c else None
        table.append([arm + (" (reference)" if arm == ref else ""), f"{d['samples']:,}", f"{d['parsed'] / d['samples']:.4f}",
                      *(f"{d['label_counts'][k] / max(d['parsed'], 1):.4f}" for k in labels), f"{np.mean(d['_hyp']):.2f}",
                      *([f"{c['labels_p']:.3g}", f"{e[0]:+.4f} [{e[1]:+.4f}, {e[2]:+.4f}]", f"{c['hypothesis_length_p']:.3g}",
                         verdict(c)] if c else ["", "", "", ""])])
    md += md_table(["engine:dtype:batch", "samples", "parse rate", *labels, "hyp. words", "labels p",
                    "entailment - reference (95%)", "hyp. length KS p", "verdict"], table)
    write_result(RESULTS / "engines" / args.name, {
        "command": cmd, "roofline": roof[conditions[0]], "roofline_loaded_threads": rl, "params": n_params,
        "reference": ref, "runs": runs, "summary": summary,
        "distribution": {arm: {k: v for k, v in dist[arm].items() if not k.startswith("_")} for arm in arms},
        "tests": tests}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
