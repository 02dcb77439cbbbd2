"""GPT-2 large's throughput (issue 31), run by ``gpu_kit.py`` on a lent GPU (tiny on the CPU by its dry run and
tests): the paper's own models, from their configs with random weights (a step costs the same whatever they are).

Sampling with the lengths forced to the SNLI training rows' length distribution: each length bucket L is sampled
with ``min_new_tokens = max_new_tokens = L`` (the end marker cannot come before L tokens, and nothing goes on
after), in bfloat16 with a KV cache, at the best batch size of a sweep. The lengths are those of the *whole row*
the generator writes after its prompt (``premise: P\\nlabel: l\\nhypothesis: H<end>`` in GPT-2 tokens: Wu et al.
sample whole rows); the hypothesis-only lengths are reported beside them. Gives samples/s against the paper's ~40
(5M samples in 35 h on an A100), tokens/s, and the fraction of the GPU's memory-bandwidth roofline: every decoding
step reads all weights once plus the KV cache of every sequence so far, so ``bytes/s = sum over steps (weights +
batch x context x KV bytes per token) / seconds``, against the card's peak (H100 SXM 3.35 TB/s, H200 4.8 TB/s).
Then a GPT-2 large *training* step (MLE + 0.5 label-consistency unlikelihood, Table 7's batch 24, bf16 autocast
over float32 weights, AdamW) and RoBERTa-large's inference rows/s on SNLI-length pairs (the paper's M).

    python benchmarks/gpu_throughput.py gpt2 --lengths lengths.json --out gpt2.json [--tiny] [--deadline S]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_json  # noqa: E402

# peak HBM bandwidth (bytes/s) by device name, most specific first
PEAK_BANDWIDTH = [("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                  ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12)]
LABELS = ("entailment", "neutral", "contradiction")
PAPER_SAMPLES_PER_S = 40.0  # Wu et al. 2022: 5M samples in ~35 h on one A100 (issue 31)
GPT2_LARGE = dict(n_embd=1280, n_layer=36, n_head=20, n_positions=1024, vocab_size=50257)
GPT2_TINY = dict(n_embd=32, n_layer=2, n_head=2, n_positions=256, vocab_size=50257)
ROBERTA_LARGE = dict(vocab_size=50265, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                     intermediate_size=4096, max_position_embeddings=514, type_vocab_size=1)
ROBERTA_TINY = dict(vocab_size=50265, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=514, type_vocab_size=1)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_bandwidth(device_name: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH if key in device_name), None)


def _sync(device) -> None:
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def length_buckets(hist: dict, width: int = 8) -> list[tuple[int, float]]:
    """``{length: count}`` -> ``[(bucket length, share), ...]``: each length rounded *up* to a multiple of
    ``width`` (a sample is never timed shorter than it is), shares summing to 1."""
    counts: dict[int, int] = {}
    for length, n in hist.items():
        b = max(width, int(math.ceil(int(length) / width) * width))
        counts[b] = counts.get(b, 0) + int(n)
    total = sum(counts.values())
    return [(b, n / total) for b, n in sorted(counts.items())]


def forced_length_generate(model, batch: int, length: int, prompt_ids: list[int], *, eos_id: int, pad_id: int,
                           device="cpu"):
    """``batch`` samples of exactly ``length`` new tokens after ``prompt_ids`` (plain sampling, KV cache):
    ``min_new_tokens = max_new_tokens = length`` keeps the end marker out until the length is reached
    and stops there."""
    import torch

    ids = torch.tensor([prompt_ids] * batch, dtype=torch.long, device=device)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                              top_p=1.0, temperature=1.0, min_new_tokens=length, max_new_tokens=length,
                              eos_token_id=eos_id, pad_token_id=pad_id, use_cache=True)


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """Bytes of K and V that one token of context holds over all layers."""
    layers = getattr(config, "n_layer", None) or config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "n_head", None) or config.num_attention_heads
    hidden = getattr(config, "n_embd", None) or config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // (getattr(config, "n_head", None) or config.num_attention_heads)
    return int(layers * 2 * heads * head_dim * dtype_bytes)


def decode_bytes(weight_bytes: int, kv_per_token: int, batch: int, prompt_len: int, length: int) -> int:
    """Bytes a generate call of ``length`` steps must read at least: all weights once per step, plus, at
    step t, the KV cache of ``prompt_len + t - 1`` tokens of every sequence."""
    steps = range(1, length + 1)
    return int(sum(weight_bytes + batch * (prompt_len + t - 1) * kv_per_token for t in steps))


def _weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:  # tied embeddings are read once
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _memory(device) -> dict:
    import torch
    if not str(device).startswith("cuda"):
        return {}
    return {"max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            "device_total_gib": round(torch.cuda.mem_get_info()[1] / 2**30, 2)}


def time_batch(model, batch: int, length: int, prompt_ids, *, eos_id, pad_id, device) -> float:
    _sync(device)
    t = time.perf_counter()
    out = forced_length_generate(model, batch, length, prompt_ids, eos_id=eos_id, pad_id=pad_id, device=device)
    _sync(device)
    dt = time.perf_counter() - t
    if out.shape != (batch, len(prompt_ids) + length):
        raise RuntimeError(f"forced length {length} gave shape {tuple(out.shape)}")
    return dt


def bench_sampling(model, hist: dict, prompt_ids: list[int], *, eos_id: int, pad_id: int, device, batches,
                   width: int = 8, deadline: float | None = None, peak: float | None = None) -> dict:
    """The batch-size sweep at the median bucket, then every bucket at the best batch size; the
    distribution-weighted samples/s, tokens/s and roofline fraction."""
    import torch

    import numpy as np

    buckets = length_buckets(hist, width)
    median = buckets[int(np.searchsorted(np.cumsum([s for _, s in buckets]), 0.5 - 1e-12))][0]
    wbytes, kvpt = _weight_bytes(model), kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    p = len(prompt_ids)
    time_batch(model, min(batches), 4, prompt_ids, eos_id=eos_id, pad_id=pad_id, device=device)  # warm-up
    sweep = []
    for bs in batches:
        if deadline and time.monotonic() > deadline:
            break
        try:
            dt = time_batch(model, bs, median, prompt_ids, eos_id=eos_id, pad_id=pad_id, device=device)
        except torch.OutOfMemoryError:
            sweep.append({"batch": bs, "error": "out of memory"})
            torch.cuda.empty_cache()
            break
        sweep.append({"batch": bs, "length": median, "seconds": round(dt, 4), "samples_per_s": _fig(bs / dt),
                      "tokens_per_s": _fig(bs * median / dt)})
        log(f"sampling: batch {bs} x {median} tokens: {bs / dt:,.0f} samples/s")
        if len(sweep) >= 2 and "samples_per_s" in sweep[-2] and bs / dt < 1.02 * sweep[-2]["samples_per_s"]:
            break  # no longer pays: a larger batch would only cost memory
    ok = [s for s in sweep if "samples_per_s" in s]
    best = max(ok, key=lambda s: s["samples_per_s"])["batch"]
    per_bucket = []
    for b, share in buckets:
        if deadline and time.monotonic() > deadline and per_bucket:
            # out of time: the remaining buckets scaled from the longest one timed (time ~ length)
            last = per_bucket[-1]
            dt = last["seconds"] * b / last["length"]
            measured = False
            bs = last["batch"]
        else:
            bs = per_bucket[-1]["batch"] if per_bucket else best
            while True:  # a long bucket's KV cache may not fit at the best batch: halve it there
                try:
                    dt = time_batch(model, bs, b, prompt_ids, eos_id=eos_id, pad_id=pad_id, device=device)
                    break
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    if bs <= 1:
                        raise
                    bs //= 2
                    log(f"sampling: length {b} does not fit at batch {bs * 2}; batch {bs}")
            measured = True
        by = decode_bytes(wbytes, kvpt, bs, p, b)
        per_bucket.append({"length": b, "share": round(share, 5), "batch": bs, "seconds": round(dt, 4),
                           "measured": measured, "samples_per_s": _fig(bs / dt),
                           "bandwidth_tb_s": float(f"{by / dt / 1e12:.4g}")})
    name = torch.cuda.get_device_name(0) if str(device).startswith("cuda") else "cpu"
    return {"device": name, "batch_sweep": sweep, "best_batch": best, "median_length": median, "buckets": per_bucket,
            **summarise_sampling(per_bucket, weight_bytes=wbytes, kv_bytes_per_token=kvpt, prompt_tokens=p,
                                 peak=peak or peak_bandwidth(name))}


def _fig(x: float) -> float:
    """A rate as reported: one decimal from 10 up, three significant digits below (a CPU's 0.84 samples/s)."""
    return round(x, 1) if abs(x) >= 10 else float(f"{x:.3g}")


def summarise_sampling(buckets: list[dict], *, weight_bytes: int, kv_bytes_per_token: int, prompt_tokens: int,
                       peak: float | None) -> dict:
    """The distribution-weighted figures of timed length buckets (each ``length``, ``share``, ``batch``,
    ``seconds``): samples/s, tokens/s, the paper multiple and the bytes read per second against ``peak``."""
    total = sum(k["share"] for k in buckets)
    sec_per_sample = sum(k["share"] * k["seconds"] / k["batch"] for k in buckets) / total
    tokens = sum(k["share"] * k["length"] for k in buckets) / total
    read = sum(k["share"] * decode_bytes(weight_bytes, kv_bytes_per_token, k["batch"], prompt_tokens, k["length"])
               / k["batch"] for k in buckets) / total
    sps = 1.0 / sec_per_sample
    bw = read * sps  # bytes read per sample x samples per second
    return {"mean_length": round(tokens, 2), "samples_per_s": _fig(sps), "tokens_per_s": _fig(sps * tokens),
            "x_paper": float(f"{sps / PAPER_SAMPLES_PER_S:.3g}"), "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token, "bandwidth_tb_s": float(f"{bw / 1e12:.4g}"),
            "peak_bandwidth_tb_s": peak and peak / 1e12, "roofline_fraction": float(f"{bw / peak:.3g}") if peak else None}


def bench_training(model, hist: dict, *, device, batch: int = 24, steps: int = 8, warmup: int = 3,
                   lam: float = 0.5, seed: int = 0) -> dict:
    """Optimizer steps of G's objective (MLE + lam * label-consistency unlikelihood, bf16 autocast on a GPU) on
    random rows of the SNLI length distribution, two ways in turn on the same rows: the library's on CUDA
    (``batch_loss``: the row and its perturbed-label copy in one forward pass) and two passes (its CPU way). Seconds
    per step of each, their ratio, and tokens/s of the library's (one copy of each row; the copy doubles the
    forward tokens)."""
    import numpy as np
    import torch

    from debiased_nli.methods.generation.losses import generator_loss
    from debiased_nli.methods.generation.train import joint_logits

    rng = np.random.default_rng(seed)
    lengths, counts = zip(*sorted((int(k), int(v)) for k, v in hist.items()))
    probs = np.asarray(counts, dtype=float) / sum(counts)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, eps=1e-6, weight_decay=0.0)
    autocast = torch.autocast("cuda" if str(device).startswith("cuda") else "cpu", dtype=torch.bfloat16,
                              enabled=str(device).startswith("cuda"))
    times, tokens, ops = {"one_pass": [], "two_passes": []}, 0, {}
    for i in range(warmup + steps):
        ls = rng.choice(lengths, size=batch, p=probs) + 3  # + the prompt
        n = int(ls.max())
        ids = torch.tensor(rng.integers(0, model.config.vocab_size, size=(batch, n)), device=device)
        pos = torch.arange(n, device=device)[None, :]
        mask = (pos < torch.tensor(ls, device=device)[:, None]).long()
        hyp = ((pos >= torch.tensor((ls * 0.7).astype(int), device=device)[:, None]) & mask.bool()).long()
        b = {"input_ids": ids, "mask": mask, "p_input_ids": ids.clone(), "p_mask": mask, "p_hypothesis": hyp}
        for way in (("one_pass", "two_passes") if i % 2 else ("two_passes", "one_pass")):
            _sync(device)
            counting = i == warmup - 1  # the operations dispatched in a step (each a kernel launch or more on a GPU)
            t, prof = time.perf_counter(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            with prof if counting else contextlib.nullcontext():
                with autocast:
                    if way == "one_pass":  # what batch_loss runs on CUDA
                        logits, p_logits, j = joint_logits(model, b)
                        loss, _ = generator_loss(logits, j["input_ids"], j["mask"], p_logits, j["p_input_ids"],
                                                 j["p_hypothesis"], lam=lam)
                    else:
                        logits = model(input_ids=ids, attention_mask=mask).logits
                        p_logits = model(input_ids=b["p_input_ids"], attention_mask=mask).logits
                        loss, _ = generator_loss(logits, ids, mask, p_logits, b["p_input_ids"], hyp, lam=lam)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                _sync(device)
            if counting:
                ops[way] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
            if i >= warmup:
                times[way].append(time.perf_counter() - t)
        tokens += int(mask.sum()) if i >= warmup else 0
    sec = {k: float(np.median(v)) for k, v in times.items()}
    return {"batch": batch, "steps_timed": steps, "seconds_per_step": round(sec["one_pass"], 4),
            "seconds_per_step_two_passes": round(sec["two_passes"], 4),
            "two_passes_over_one": round(sec["two_passes"] / sec["one_pass"], 3), "aten_calls_per_step": ops,
            "tokens_per_s": round(tokens / sum(times["one_pass"]), 1),
            "forward_tokens_per_s": round(2 * tokens / sum(times["one_pass"]), 1),
            "rows_per_s": round(batch / sec["one_pass"], 1), **_memory(device)}


def bench_classifier(model, hist: dict, *, device, batch: int = 512, batches: int = 8, warmup: int = 2,
                     seed: int = 0) -> dict:
    """Inference rows/s of a sequence classifier on pairs of the SNLI pair-length distribution
    (random batches, padded to their longest pair, as ``confidence-filter`` batches them)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    lengths, counts = zip(*sorted((int(k), int(v)) for k, v in hist.items()))
    probs = np.asarray(counts, dtype=float) / sum(counts)
    model.eval()
    times, rows = [], 0
    for i in range(warmup + batches):
        ls = rng.choice(lengths, size=batch, p=probs)
        n = int(ls.max())
        ids = torch.tensor(rng.integers(5, model.config.vocab_size, size=(batch, n)), device=device)
        mask = (torch.arange(n, device=device)[None, :] < torch.tensor(ls, device=device)[:, None]).long()
        _sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            torch.softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1).cpu()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
            rows += batch
    return {"batch": batch, "batches_timed": batches, "rows_per_s": round(rows / sum(times), 1), **_memory(device)}


def run_gpt2(lengths: dict, out: Path, *, tiny: bool = False, deadline_s: float | None = None,
             batches: list[int] | None = None) -> dict:
    """GPT-2 large sampling, then (if time is left) its training step and RoBERTa-large's inference, on the GPU;
    ``tiny``: tiny configs on the CPU (the dry run, the tests). ``out`` is written after each part: a run cut at
    its deadline keeps what it measured."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, RobertaConfig, RobertaForSequenceClassification

    t0 = time.monotonic()
    deadline = t0 + deadline_s if deadline_s else None
    cuda = torch.cuda.is_available() and not tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    eos, prompt = int(lengths["eos_id_gpt2"]), [int(x) for x in lengths["prompt_ids_gpt2"]]
    result = {"model": "gpt2-large (random weights, GPT2Config)" if not tiny else "gpt2-tiny (CPU dry run)",
              "dtype": str(dtype).replace("torch.", ""), "prompt_tokens": len(prompt),
              "lengths": "whole row after the prompt (premise, label, hypothesis, end marker), GPT-2 tokens"}
    cfg = GPT2Config(**(GPT2_TINY if tiny else GPT2_LARGE))
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg).to(dtype).eval()
    result["parameters"] = sum(p.numel() for p in model.parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result["sampling"] = bench_sampling(model, lengths["row_lengths_gpt2"], prompt, eos_id=eos, pad_id=eos,
                                        device=device, batches=batches or ([128, 256, 512, 1024, 2048, 4096] if cuda
                                                                           else [2, 4]),
                                        deadline=deadline and deadline - (30 if cuda else 0))
    result["sampling"].update(_memory(device))
    if not deadline or time.monotonic() < deadline - 40:
        hyp = bench_sampling(model, lengths["hypothesis_lengths_gpt2"], prompt, eos_id=eos, pad_id=eos,
                             device=device, batches=[result["sampling"]["best_batch"]], deadline=deadline and deadline - 25)
        result["sampling_hypothesis_lengths_only"] = {k: hyp[k] for k in ("mean_length", "samples_per_s",
                                                                          "tokens_per_s", "roofline_fraction")}
    write_json(out, result)
    del model
    if not deadline or time.monotonic() < deadline - 15:
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT2LMHeadModel(cfg)  # float32 weights, bf16 autocast: how the generator is trained
        result["training"] = bench_training(model, lengths["row_lengths_gpt2"], device=device,
                                            steps=8 if cuda else 2, warmup=3 if cuda else 1)
        del model
        write_json(out, result)
    if not deadline or time.monotonic() < deadline - 8:
        with torch.device(device):
            clf = RobertaForSequenceClassification(RobertaConfig(**(ROBERTA_TINY if tiny else ROBERTA_LARGE),
                                                                 num_labels=3, pad_token_id=1)).to(dtype)
        result["classifier"] = {"model": "roberta-large (random weights)" if not tiny else "roberta-tiny",
                                "dtype": result["dtype"], **bench_classifier(clf, lengths["pair_lengths_gpt2"], device=device,
                                                                             batch=512 if cuda else 8, batches=8 if cuda else 2,
                                                                             warmup=2 if cuda else 1)}
    result["seconds"] = round(time.monotonic() - t0, 1)
    write_json(out, result)
    return result


def length_tables(train: Path, tokenizer: Path) -> dict:
    """The SNLI training rows' lengths in GPT-2 tokens: ``row_lengths_gpt2`` (what a generator writes after its
    prompt: premise, label, hypothesis and the end marker), ``hypothesis_lengths_gpt2`` (the hypothesis and the end
    marker) and ``pair_lengths_gpt2`` (premise + hypothesis + RoBERTa's 4 special tokens), as histograms."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from debiased_nli.methods.generation.format import SequenceFormat

    t = pq.read_table(train, columns=["premise", "hypothesis", "label"]).to_pydict()
    rows = [(p, LABELS[l] if isinstance(l, int) else l, h) for p, h, l in zip(t["premise"], t["hypothesis"], t["label"])
            if l in LABELS or l in range(3)]
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    fmt = SequenceFormat.for_tokenizer(tok, LABELS)
    prompt = tok(fmt.prompt(), add_special_tokens=False).input_ids
    full = tok([fmt.text(p, l, h) for p, l, h in rows], add_special_tokens=False).input_ids
    hyps = tok([" " + " ".join(h.split()) for _, _, h in rows], add_special_tokens=False).input_ids
    prem = tok([p for p, _, _ in rows], add_special_tokens=False).input_ids

    def hist(values) -> dict:
        out: dict[int, int] = {}
        for v in values:
            out[int(v)] = out.get(int(v), 0) + 1
        return dict(sorted(out.items()))

    return {"rows": len(rows), "eos_id_gpt2": tok.eos_token_id, "prompt_ids_gpt2": prompt,
            "row_lengths_gpt2": hist(len(x) - len(prompt) for x in full),
            "hypothesis_lengths_gpt2": hist(len(x) + 1 for x in hyps),
            "pair_lengths_gpt2": hist(len(a) + len(b) + 4 for a, b in zip(prem, hyps))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["gpt2"])
    ap.add_argument("--lengths", required=True, help="the kit's lengths.json (SNLI length distributions, GPT-2 tokens)")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (dry run, tests)")
    ap.add_argument("--deadline", type=float, help="seconds this benchmark may take (it cuts its later parts)")
    a = ap.parse_args(argv)
    r = run_gpt2(json.loads(Path(a.lengths).read_text()), Path(a.out), tiny=a.tiny, deadline_s=a.deadline,
                 batches=a.batches)
    s = r["sampling"]
    print(f"gpt2: {s['samples_per_s']:,.0f} samples/s at batch {s['best_batch']} ({s['x_paper']}x the paper's "
          f"{PAPER_SAMPLES_PER_S:.0f}), roofline fraction {s['roofline_fraction']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
