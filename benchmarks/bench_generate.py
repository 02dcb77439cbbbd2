"""Generation speed on the CPU. Two comparisons:

``--compare plain-generate`` (the default; issue 31, item 3): plain transformers ``model.generate`` at
its best batch size and dtype against ``debiased-nli generate`` (the CLI, default fast engine), on the
same real SNLI premises (``--condition premise``: the prompt is a premise, the model writes the label
and the hypothesis), the same sampling (plain sampling: top-p 1.0, temperature 1.0) and the same limit
of new tokens, both stopping a sequence at the end marker.

    python benchmarks/bench_generate.py --model ~/.cache/debiased-nli/models/smollm2-135m-instruct \
        --threads 2 --max-new-tokens 48 --samples-per-round 256 --rounds 3 --fast-batch 256

1. Pilot: plain ``generate`` at each batch size of --plain-batches (32, 64, 128) in each dtype of
   --plain-dtypes (float32, bfloat16), one call on that many prompts, twice (the second pass in the
   reverse order; the better try counts): its best (batch, dtype).
2. Rounds: --rounds times, plain generate at its best and ``debiased-nli generate`` (--fast-batch,
   --fast-dtype) each sample the round's --samples-per-round prompts, one after the other, the order
   alternating between rounds, so that the load of a shared machine falls on both.
Model loading is not timed; each arm's time covers tokenizing, sampling, decoding and parsing
(``debiased-nli generate``'s also writing its shards: its report's seconds). Writes
benchmarks/results/generate_cpu.{json,md}.

``--compare loop`` (the older comparison): ``debiased-nli generate`` against a one-prompt-at-a-time
``model.generate`` loop (unconditional prompt, top-p 0.9); writes benchmarks/results/generate.{json,md}:

    python benchmarks/bench_generate.py --compare loop --num-samples 48 --batch-size 16 --max-new-tokens 32

Tokens per second count the generated tokens up to and including the end marker.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a CPU benchmark: both paths on the CPU (the plain loop never moves its model), also on a machine with a GPU
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, SHARED_DATA  # noqa: E402


def generated_tokens(tok, texts: list[str], end: str) -> int:
    n = 0
    for t in texts:
        cut = t.find(end)
        body = t if cut < 0 else t[:cut]
        n += len(tok(body, add_special_tokens=False)["input_ids"]) + (cut >= 0)
    return n


def plain_loop(model_path: str, task: str, n: int, max_new_tokens: int, seed: int, top_p: float) -> dict:
    import torch
    from debiased_nli.methods.generation.format import SequenceFormat
    from debiased_nli.methods.generation.models import load_generator
    from debiased_nli.data.tasks import get_task
    model, tok = load_generator(model_path)
    model.eval()
    fmt = SequenceFormat.for_tokenizer(tok, get_task(task).labels)
    prompt = fmt.prompt()
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(seed)
    texts, parsed = [], 0
    t0 = time.perf_counter()
    for _ in range(n):
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, top_p=top_p, top_k=0, temperature=1.0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=False)
        texts.append(text)
        parsed += fmt.parse(prompt + text)[0] is not None
    seconds = time.perf_counter() - t0
    toks = generated_tokens(tok, texts, fmt.end)
    return {"samples": n, "seconds": round(seconds, 2), "samples_per_s": round(n / seconds, 3),
            "generated_tokens": toks, "tokens_per_s": round(toks / seconds, 2), "parsed": parsed}


def cli_run(model_path: str, task: str, n: int, batch_size: int, max_new_tokens: int, seed: int, top_p: float) -> dict:
    from debiased_nli.cli import main
    from debiased_nli.methods.generation.format import SequenceFormat
    from debiased_nli.methods.generation.models import load_tokenizer
    from debiased_nli.methods.generation.sample import REPORT_FILE, load_generated
    from debiased_nli.data.tasks import get_task
    out = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    try:
        main(["generate", task, "--generator", model_path, "--out", str(out), "--num-samples", str(n),
              "--num-shards", "1", "--batch-size", str(batch_size), "--max-new-tokens", str(max_new_tokens),
              "--seed", str(seed), "--top-p", str(top_p)])
        rep = json.loads((out / REPORT_FILE).read_text())
        tok = load_tokenizer(model_path)
        fmt = SequenceFormat.for_tokenizer(tok, get_task(task).labels)
        texts = []
        rows = load_generated(str(out))
        for r in rows:
            texts.append(fmt.text(r["premise"], int(r["label"]), r["hypothesis"])[len(fmt.prompt()):])
        texts += [t[len(fmt.prompt()):] for t in load_generated(str(out), "rejects")["text"]]
        seconds = rep["this_run"]["seconds"]
        toks = generated_tokens(tok, texts, fmt.end)
        return {"samples": n, "seconds": seconds, "samples_per_s": round(n / seconds, 3), "generated_tokens": toks,
                "tokens_per_s": round(toks / seconds, 2), "parsed": rep["parsed"], "batch_size": batch_size}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=["plain-generate", "loop"], default="plain-generate")
    ap.add_argument("--model", default=str(Path.home() / ".cache/debiased-nli/models/smollm2-135m-instruct"))
    ap.add_argument("--task", default="snli")
    ap.add_argument("--max-new-tokens", type=int, help="default: 48 (plain-generate), 32 (loop)")
    ap.add_argument("--top-p", type=float, help="default: 1.0 (plain-generate), 0.9 (loop)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="", help="suffix of the result files (generate_cpu<tag> / generate<tag>)")
    g = ap.add_argument_group("--compare plain-generate")
    g.add_argument("--premises", default=str(SHARED_DATA / "snli" / "train_sample.parquet"))
    g.add_argument("--samples-per-round", type=int, default=256)
    g.add_argument("--rounds", type=int, default=3)
    g.add_argument("--plain-batches", default="32,64,128")
    g.add_argument("--plain-dtypes", default="float32,bfloat16")
    g.add_argument("--fast-batch", type=int, default=256, help="debiased-nli generate --batch-size")
    g.add_argument("--fast-dtype", default="auto", help="debiased-nli generate --dtype")
    g = ap.add_argument_group("--compare loop")
    g.add_argument("--num-samples", type=int, default=48)
    g.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    plain_generate = args.compare == "plain-generate"
    if args.max_new_tokens is None:
        args.max_new_tokens = 48 if plain_generate else 32
    if args.top_p is None:
        args.top_p = 1.0 if plain_generate else 0.9
    import torch
    torch.set_num_threads(args.threads)
    (compare_plain_generate if plain_generate else compare_loop)(args)


def compare_loop(args) -> None:
    """`debiased-nli generate` against a one-prompt-at-a-time loop (generate.{json,md})."""
    import torch
    batched = cli_run(args.model, args.task, args.num_samples, args.batch_size, args.max_new_tokens, args.seed, args.top_p)
    plain = plain_loop(args.model, args.task, args.num_samples, args.max_new_tokens, args.seed, args.top_p)
    res = {"model": args.model, "device": "cpu", "threads": args.threads, "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens,
           "top_p": args.top_p, "debiased_nli_generate": batched, "plain_one_prompt_loop": plain,
           "speedup_samples_per_s": round(batched["samples_per_s"] / plain["samples_per_s"], 2),
           "speedup_tokens_per_s": round(batched["tokens_per_s"] / plain["tokens_per_s"], 2),
           "torch": torch.__version__}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"generate{args.tag}.json").write_text(json.dumps(res, indent=2))
    cmd = (f"python benchmarks/bench_generate.py --model {args.model} --num-samples {args.num_samples} "
           f"--batch-size {args.batch_size} --max-new-tokens {args.max_new_tokens} --threads {args.threads}")
    md = f"""# `debiased-nli generate` vs a one-prompt-at-a-time loop (CPU)

Command: `{cmd}`

Model `{Path(args.model).name}`, {args.num_samples} samples, unconditional prompt, top-p {args.top_p},
temperature 1.0, at most {args.max_new_tokens} new tokens, {args.threads} torch threads on a {os.cpu_count()}-core
machine shared with other jobs (absolute numbers are noisy; the ratio is measured in the same run).

| path | samples/s | generated tokens/s | seconds | parsed |
|---|---|---|---|---|
| `debiased-nli generate` (batch {args.batch_size}, left padding) | {batched['samples_per_s']} | {batched['tokens_per_s']} | {batched['seconds']} | {batched['parsed']}/{args.num_samples} |
| plain `model.generate`, one prompt at a time | {plain['samples_per_s']} | {plain['tokens_per_s']} | {plain['seconds']} | {plain['parsed']}/{args.num_samples} |

Speed-up: **{res['speedup_samples_per_s']}x** samples/s, {res['speedup_tokens_per_s']}x tokens/s.
Both paths ran on the CPU (the benchmark hides any GPU); a GPU figure is not measured (see the README).
"""
    (RESULTS / f"generate{args.tag}.md").write_text(md)
    print(json.dumps(res, indent=2))




# ---- --compare plain-generate ------------------------------------------------------------------------

def cpu_info() -> dict:
    """The CPU's model name and the flags that decide the dtype (AMX, AVX512-BF16, AVX512, AVX2)."""
    info = {"model_name": platform.processor() or platform.machine(), "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            info["model_name"] = value.strip()
        if key.strip() == "flags":
            info["flags"] = sorted(f for f in set(value.split()) if f.startswith(("amx", "avx512", "avx2", "avx_vnni")))
            break
    return info


def read_premises(path: str) -> list[str]:
    """The premises `debiased-nli generate --premises-from` reads from ``path`` (non-empty strings, in order)."""
    import pyarrow.parquet as pq
    return [p for p in pq.read_table(path, columns=["premise"]).column("premise").to_pylist()
            if isinstance(p, str) and p.strip()]


def round_prompts(fmt, premises: list[str], n: int, seed: int) -> list[str]:
    """The prompts of `debiased-nli generate --condition premise --seed seed`, samples 0..n-1."""
    import numpy as np

    from debiased_nli.methods.generation.sample import prompts_for
    order = np.random.default_rng(seed).permutation(len(premises))
    return prompts_for(fmt, list(range(n)), "premise", premises, order)


def plain_generate(model, tok, fmt, prompts: list[str], batch: int, max_new_tokens: int, top_p: float,
                   seed: int) -> dict:
    """Plain `model.generate` (do_sample, top_k=0) on consecutive left-padded batches of ``prompts``."""
    import torch
    torch.manual_seed(seed)
    tok.padding_side = "left"
    texts, t0 = [], time.perf_counter()
    for b in range(0, len(prompts), batch):
        enc = tok(prompts[b:b + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, top_k=0, top_p=top_p, temperature=1.0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        texts += tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    parsed = sum(fmt.parse(p + t)[0] is not None for p, t in zip(prompts, texts))
    seconds = time.perf_counter() - t0
    return {"samples": len(prompts), "seconds": round(seconds, 2), "samples_per_s": round(len(prompts) / seconds, 3),
            "parsed": parsed, "texts": texts}


def cli_generate(args, fmt, prompts: list[str], seed: int) -> dict:
    """`debiased-nli generate --condition premise` on the same prompts, into a fresh folder (its report's seconds)."""
    from debiased_nli.cli import main as cli
    from debiased_nli.methods.generation.sample import REPORT_FILE, load_generated
    out = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    try:
        argv = ["generate", args.task, "--generator", args.model, "--out", str(out), "--num-samples", str(len(prompts)),
                "--num-shards", "1", "--batch-size", str(args.fast_batch), "--max-new-tokens",
                str(args.max_new_tokens), "--seed", str(seed), "--top-p", str(args.top_p), "--condition", "premise",
                "--premises-from", args.premises, "--threads", str(args.threads)]
        if args.fast_dtype:
            argv += ["--dtype", args.fast_dtype]
        cli(argv)
        rep = json.loads((out / REPORT_FILE).read_text())
        rows, rejects = load_generated(str(out)), load_generated(str(out), "rejects")
        texts = []
        for j, text in zip(rejects["sample_index"], rejects["text"]):
            if not text.startswith(prompts[j]):
                raise SystemExit(f"sample {j}: the CLI sampled another prompt than the plain arm")
            texts.append(text[len(prompts[j]):])
        for r in rows:  # a parsed row's continuation, rebuilt from its fields (for the token count)
            texts.append(fmt.text(r["premise"], int(r["label"]), r["hypothesis"])[len(fmt.prompt(r["premise"])):])
        seconds = rep["this_run"]["seconds"]
        return {"samples": len(prompts), "seconds": seconds, "samples_per_s": round(len(prompts) / seconds, 3),
                "parsed": rep["parsed"], "engine": rep["this_run"].get("engine"),
                "dtype": rep["this_run"].get("dtype"), "texts": texts}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _arm_summary(runs: list[dict], tok, end: str) -> dict:
    samples = sum(r["samples"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    tokens = sum(generated_tokens(tok, r["texts"], end) for r in runs)
    return {"samples": samples, "seconds": round(seconds, 2), "samples_per_s": round(samples / seconds, 3),
            "generated_tokens": tokens, "tokens_per_s": round(tokens / seconds, 2),
            "parsed": sum(r["parsed"] for r in runs),
            "per_round_samples_per_s": [r["samples_per_s"] for r in runs],
            "per_round_load_average_1min_after": [r["load_average_1min_after"] for r in runs]}


def compare_plain_generate(args) -> None:
    """Plain `generate` at its best (batch, dtype) against `debiased-nli generate` (generate_cpu.{json,md})."""
    import numpy as np
    import torch
    import transformers

    from debiased_nli.methods.generation.format import SequenceFormat
    from debiased_nli.methods.generation.models import load_generator
    from debiased_nli.methods.generation.sample import sampling_dtype
    from debiased_nli.data.tasks import get_task

    premises = read_premises(args.premises)
    batches = [int(b) for b in args.plain_batches.split(",")]
    dtypes = args.plain_dtypes.split(",")
    models = {dt: load_generator(args.model, dtype=dt) for dt in dtypes}
    for model, _ in models.values():
        model.eval()
    tok = models[dtypes[0]][1]
    fmt = SequenceFormat.for_tokenizer(tok, get_task(args.task).labels)

    # 1. pilot: plain generate's best batch and dtype (prompts of a seed the rounds do not use); every
    #    setting twice, the second time in the reverse order, and its better time counts
    configs = [(dt, batch) for dt in dtypes for batch in batches]
    pilot_prompts = round_prompts(fmt, premises, max(batches), 10_000 + args.seed)
    rates: dict = {c: [] for c in configs}
    for order in (configs, configs[::-1]):
        for dt, batch in order:
            r = plain_generate(models[dt][0], tok, fmt, pilot_prompts[:batch], batch, args.max_new_tokens,
                               args.top_p, args.seed)
            rates[(dt, batch)].append(r["samples_per_s"])
            print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f} pilot: plain generate {dt} batch {batch}: "
                  f"{r['samples_per_s']} samples/s", flush=True)
    pilot = [{"dtype": dt, "batch": batch, "samples_per_s": max(rates[(dt, batch)]),
              "both_tries": rates[(dt, batch)]} for dt, batch in configs]
    best = max(pilot, key=lambda p: p["samples_per_s"])

    # 2. rounds: plain generate at its best and debiased-nli generate, on the same prompts, alternating
    plain_runs, fast_runs = [], []
    for k in range(args.rounds):
        seed = args.seed + k
        prompts = round_prompts(fmt, premises, args.samples_per_round, seed)
        arms = ["plain", "fast"] if k % 2 == 0 else ["fast", "plain"]
        for arm in arms:
            if arm == "plain":
                r = plain_generate(models[best["dtype"]][0], tok, fmt, prompts, best["batch"], args.max_new_tokens,
                                   args.top_p, seed)
                plain_runs.append(r)
            else:
                r = cli_generate(args, fmt, prompts, seed)
                fast_runs.append(r)
            r["load_average_1min_after"] = round(os.getloadavg()[0], 2)
            print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f} round {k}: {arm}: {r['samples_per_s']} "
                  f"samples/s ({r['seconds']} s)", flush=True)
    plain, fast = _arm_summary(plain_runs, tok, fmt.end), _arm_summary(fast_runs, tok, fmt.end)
    ratio = round(fast["samples_per_s"] / plain["samples_per_s"], 2)
    per_round = [round(f["samples_per_s"] / p["samples_per_s"], 2) for p, f in zip(plain_runs, fast_runs)]
    fast_dtype = fast_runs[0]["dtype"] if fast_runs else sampling_dtype(args.fast_dtype, "cpu")
    cpu = cpu_info()
    cmd = (f"python benchmarks/bench_generate.py --model {args.model} --threads {args.threads} "
           f"--max-new-tokens {args.max_new_tokens} --samples-per-round {args.samples_per_round} "
           f"--rounds {args.rounds} --plain-batches {args.plain_batches} --plain-dtypes {args.plain_dtypes} "
           f"--fast-batch {args.fast_batch} --fast-dtype {args.fast_dtype}")
    res = {"command": cmd, "model": args.model, "device": "cpu", "threads": args.threads, "cpu": cpu,
           "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "premises": args.premises, "condition": "premise", "max_new_tokens": args.max_new_tokens,
           "top_p": args.top_p, "temperature": 1.0, "samples_per_round": args.samples_per_round,
           "rounds": args.rounds, "pilot": pilot, "plain_best": best,
           "plain_generate": {"batch": best["batch"], "dtype": best["dtype"], **plain},
           "debiased_nli_generate": {"batch": args.fast_batch, "dtype": fast_dtype,
                                     "engine": fast_runs[0]["engine"] if fast_runs else None, **fast},
           "ratio_samples_per_s": ratio, "ratio_per_round": per_round,
           "ratio_per_round_median": float(np.median(per_round)) if per_round else None,
           "ratio_tokens_per_s": round(fast["tokens_per_s"] / plain["tokens_per_s"], 2)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"generate_cpu{args.tag}.json").write_text(json.dumps(res, indent=2))
    pilot_rows = "\n".join(f"| {p['dtype']} | {p['batch']} | {p['samples_per_s']} | {p['both_tries']} |" for p in pilot)
    md = f"""# `debiased-nli generate` against plain `model.generate` at its best (CPU)

Command: `{cmd}`

Machine: {cpu['model_name']}, {os.cpu_count()} cores shared with other jobs, {args.threads} torch threads;
CPU flags: {', '.join(cpu['flags']) or 'none of AMX/AVX512/AVX2'}. torch {torch.__version__},
transformers {transformers.__version__}. Model `{Path(args.model).name}` (real weights). Prompts: real SNLI
premises (`{Path(args.premises).name}`, `--condition premise`: the model writes the label and the
hypothesis), plain sampling (top-p {args.top_p}, temperature 1.0), at most {args.max_new_tokens} new tokens,
each sequence stopping at the end marker.

Plain `generate`'s best batch and dtype (pilot: one call of `batch` prompts per try, two tries in
opposite orders, the better one counts):

| dtype | batch | samples/s | tries |
|---|---|---|---|
{pilot_rows}

Then {args.rounds} rounds of {args.samples_per_round} prompts, both arms on the same prompts one after the
other, the order alternating:

| path | dtype | batch | samples/s | per round | generated tokens/s | seconds | parsed |
|---|---|---|---|---|---|---|---|
| plain `model.generate` | {best['dtype']} | {best['batch']} | {plain['samples_per_s']} | {plain['per_round_samples_per_s']} | {plain['tokens_per_s']} | {plain['seconds']} | {plain['parsed']}/{plain['samples']} |
| `debiased-nli generate` (engine {res['debiased_nli_generate']['engine']}) | {fast_dtype} | {args.fast_batch} | {fast['samples_per_s']} | {fast['per_round_samples_per_s']} | {fast['tokens_per_s']} | {fast['seconds']} | {fast['parsed']}/{fast['samples']} |

**Ratio: {ratio}x** samples/s ({res['ratio_tokens_per_s']}x generated tokens/s; per round {per_round},
median {res['ratio_per_round_median']}).

Where the difference comes from (`debiased_nli.methods.generation.sample.SlotSampler`, the default `--engine
fast`): prompts sorted by length and prefilled in passes of about 512 positions with no padding carried
into decoding, the prompts' shared prefix (`<start>premise:`) run once; keys and values written in place
(no concatenation of the cache per step) and attended by a transformers attention function for
one-token steps (grouped-query heads without repeating the keys); a sequence that writes its end marker
frees its slot for the next prompt at once (plain `generate` keeps stepping a finished row until the
whole batch is done); the next token drawn by a two-level inverse CDF over the vocabulary in chunks of
32 rows. Plain `generate`'s batch sizes are the issue's ({args.plain_batches}; larger ones were not
measured); `debiased-nli generate` keeps {args.fast_batch} sequences in flight.

The untuned SmolLM2 rarely writes a parseable row: the benchmark measures sampling speed, not yield
(every sample is still parsed; the rejected ones are kept with their reason). Absolute numbers move with
the load of the shared machine (load average {', '.join(f'{x:.1f}' for x in res['load_average_at_end'])} at
the end); the ratio comes from arms run one after the other on the same prompts.
"""
    (RESULTS / f"generate_cpu{args.tag}.md").write_text(md)
    print(json.dumps({k: v for k, v in res.items() if k not in ("pilot",)}, indent=2))


if __name__ == "__main__":
    main()
