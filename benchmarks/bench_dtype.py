"""float32 against bfloat16 autocast for the inference forward passes that `--dtype` switches
(`debiased-nli evaluate --dtype`, `debiased-nli pdd --dtype`), on this machine's CPU.

Whether bfloat16 helps depends on the CPU: with AVX512-BF16 or AMX (recent Xeon, AMD Zen 4) the matrix
products run natively and autocast is about twice as fast; without them torch emulates bfloat16 and it
is slower. This script measures both on real SNLI dev pairs with the same code path as the commands
(`debiased_nli.utils.precision.compute_context`), alternating float32 and bfloat16 round by round, and records
the CPU's flags beside the figures:

    python benchmarks/bench_dtype.py --rows 512 --rounds 3      # writes benchmarks/results/dtype_bench.{json,md}

Models: a sequence classifier (default: the PDD teacher ~/runs/pdd/teacher when it exists, else
all-MiniLM-L6-v2 with a fresh seeded 3-way head) and a masked LM (default: the PDD stand-in when it
exists). Agreement: largest probability difference and the share of rows (classifier) or masked positions
(masked LM) whose argmax is the same as float32's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import MODELS, RESULTS, SHARED_DATA, command, md_table, write_result  # noqa: E402

DTYPES = ("float32", "bfloat16")


def batches(tok, pairs, batch_size, max_length, mlm=False, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(0, len(pairs), batch_size):
        p, h = zip(*pairs[i:i + batch_size])
        enc = tok(list(p), list(h), truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        if mlm:  # mask 25% of the non-special tokens, as PDD's unigram rule does
            special = torch.tensor([[t in tok.all_special_ids for t in row] for row in enc["input_ids"].tolist()])
            pick = (torch.rand(enc["input_ids"].shape, generator=g) < 0.25) & ~special & enc["attention_mask"].bool()
            enc["input_ids"][pick] = tok.mask_token_id
            enc["pick"] = pick
        out.append(enc)
    return out


def forward_all(model, encs, dtype, mlm=False):
    import torch

    from debiased_nli.utils.precision import compute_context

    probs = []
    t0 = time.perf_counter()
    with torch.inference_mode(), compute_context("cpu", dtype):
        for enc in encs:
            inputs = {k: v for k, v in enc.items() if k != "pick"}
            logits = model(**inputs).logits.float()
            probs.append(logits[enc["pick"]].softmax(-1) if mlm else logits.softmax(-1))
    return time.perf_counter() - t0, torch.cat(probs)


def measure(name, path, model, tok, pairs, args, mlm=False):
    encs = batches(tok, pairs, args.batch_size, args.max_length, mlm=mlm)
    n = int(sum(e["pick"].sum() for e in encs)) if mlm else len(pairs)
    forward_all(model, encs[:1], "float32", mlm)  # warm-up of both paths
    forward_all(model, encs[:1], "bfloat16", mlm)
    secs = {d: [] for d in DTYPES}
    probs = {}
    for r in range(args.rounds):
        for d in (DTYPES if r % 2 == 0 else DTYPES[::-1]):
            s, p = forward_all(model, encs, d, mlm)
            secs[d].append(s)
            probs[d] = p
    med = {d: statistics.median(v) for d, v in secs.items()}
    same = (probs["bfloat16"].argmax(-1) == probs["float32"].argmax(-1)).float().mean().item()
    return {"model": name, "path": str(path), "what": "masked positions" if mlm else "rows", "n": n,
            "rows": len(pairs), "seconds": secs,
            "per_second": {d: round(len(pairs) / med[d], 1) for d in DTYPES},
            "bfloat16_speedup": round(med["float32"] / med["bfloat16"], 3),
            "max_prob_diff": float((probs["bfloat16"] - probs["float32"]).abs().max()),
            "same_argmax": round(same, 5)}


def render(out: dict) -> list[str]:
    c = out["cpu"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in c.items() if k in ("avx512f", "avx512_bf16", "amx_bf16"))
    return ["# float32 vs bfloat16 autocast for inference on this CPU", "", f"Command: `{out['command']}`", "",
            f"CPU: {c['model']}, {c['cpus']} cores, torch CPU capability {c['torch_cpu_capability']}; {flags}. Native "
            f"bfloat16: **{'yes' if c['native_bfloat16'] else 'no'}**. torch {out['torch']}, {out['threads']} thread(s); "
            f"{out['rows']} SNLI dev pairs, batch {out['batch_size']}, max length {out['max_length']}, {out['rounds']} "
            f"rounds alternating float32 and bfloat16 (median time). Measured {out['created']}.", "",
            *md_table(["model", "float32 rows/s", "bfloat16 rows/s", "**bfloat16 / float32**", "max prob. diff.",
                       "same argmax"], [[m["model"], m["per_second"]["float32"], m["per_second"]["bfloat16"],
                                         f"**{m['bfloat16_speedup']}x**", f"{m['max_prob_diff']:.1e}",
                                         f"{100 * m['same_argmax']:.2f}% (of {m['n']:,} {m['what']})"]
                                        for m in out["models"]], "lrrrrr"),
            "", "A ratio below 1 means bfloat16 is slower. `--dtype bfloat16` is worth it only where it is above 1: on CPUs "
            "with AVX512-BF16/AMX and on GPUs. The commands warn when the CPU lacks native bfloat16."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    teacher = Path.home() / "runs" / "pdd" / "teacher"
    ap.add_argument("--classifier", default=str(teacher if teacher.exists() else MODELS / "all-minilm-l6-v2"))
    standin = MODELS / "minilm-mlm-pdd-standin"
    ap.add_argument("--mlm", default=str(standin) if standin.exists() else None,
                    help="a masked LM folder (default: the PDD stand-in when it exists; none: skipped)")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "dtype_bench"))
    args = ap.parse_args(argv)

    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = pq.read_table(SHARED_DATA / "snli" / "dev.parquet").to_pylist()
    pairs = [(r["premise"], r["hypothesis"]) for r in dev[:args.rows]]
    from debiased_nli.utils.precision import cpu_description

    out = {"command": command("bench_dtype.py", argv),
           "created": time.strftime("%Y-%m-%d"), "cpu": cpu_description(), "torch": torch.__version__,
           "threads": args.threads, "rows": len(pairs), "batch_size": args.batch_size,
           "max_length": args.max_length, "rounds": args.rounds, "models": []}
    clf = AutoModelForSequenceClassification.from_pretrained(args.classifier, num_labels=3).eval()
    tok = AutoTokenizer.from_pretrained(args.classifier)
    out["models"].append(measure(f"classifier `{Path(args.classifier).name}`", args.classifier, clf, tok, pairs, args))
    if args.mlm:
        mlm = AutoModelForMaskedLM.from_pretrained(args.mlm).eval()
        mtok = AutoTokenizer.from_pretrained(args.mlm)
        out["models"].append(measure(f"masked LM `{Path(args.mlm).name}`", args.mlm, mlm, mtok, pairs, args, mlm=True))
    write_result(args.out, out, render(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
