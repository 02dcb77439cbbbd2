"""Samples per second of `debiased-nli generate` (batched, left-padded, sharded) against a plain
one-prompt-at-a-time `model.generate` loop over the same model, same prompts and sampling settings.

    python benchmarks/bench_generate.py --model ~/.cache/debiased-nli/models/smollm2-135m-instruct \
        --num-samples 48 --batch-size 16 --max-new-tokens 32 --threads 2

Both paths load the model once (not timed), sample with top-p 0.9 / temperature 1.0 and stop at the end
marker or max-new-tokens. Tokens per second count the generated tokens up to and including the end
marker. Writes benchmarks/results/generate.{json,md}.
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

RESULTS = Path(__file__).resolve().parent / "results"


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
    ap.add_argument("--model", default=str(Path.home() / ".cache/debiased-nli/models/smollm2-135m-instruct"))
    ap.add_argument("--task", default="snli")
    ap.add_argument("--num-samples", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="", help="suffix of the result files (generate<tag>.json/md)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
