"""Issue 31's throughput figures on the CPU (the fallback of item 5, stated as such): the paper's own models
built from their configs on this machine, and the paper's whole SNLI pipeline projected from them.

No GPU has been lent to a session since the generator kit was ready, so the figures item 1 asks of one H100 (GPT-2 large's samples/s
against the paper's ~40, the fraction of the memory-bandwidth roofline, the projected pipeline time) are
measured here on the 2-core CPU with the same code the GPU kit runs (``gpu_throughput.run_gpt2``), with
``cpu_full``: full-size GPT-2 large (774M) and RoBERTa-large (355M), random weights (a decoding step costs
the same whatever the weights), bfloat16 where the CPU has native bf16 (avx512_bf16 / AMX), a KV cache,
every sample forced to a length drawn from the SNLI training rows' distribution (GPT-2 tokens of the whole
row a generator writes: premise, label, hypothesis, end marker). The roofline's ceiling is this machine's
measured copy bandwidth (no datasheet figure exists for a VM's share of its host).

The projection (``gpu_generator.project``) uses two sets of inputs:
- the paper's models: GPT-2 large's training step (Table 7's batch 24, MLE + 0.5 label-consistency
  unlikelihood, bf16 autocast) and sampling rate, RoBERTa-large's inference rows/s, all measured here;
- this project's CPU run (``benchmarks/results/seqz_cpu.json``): SmolLM2-135M + LoRA G's training
  tokens/s, its sampling samples/s, and M (all-MiniLM-L6-v2 fine-tuned, the run's confidence model)
  scoring rows/s measured here.

    python benchmarks/paper_models_cpu.py                  # about 15 minutes on 2 threads
    python benchmarks/paper_models_cpu.py --deadline 600   # cut the later length buckets (scaled, marked)

A run cut short after sampling leaves it in ``--work``; the next run keeps it (``--fresh`` measures it again)
and times only the training step and RoBERTa.

Writes ``benchmarks/results/paper_models_cpu.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from benchmarks import gpu_generator as gg  # noqa: E402
from benchmarks import gpu_throughput as tp  # noqa: E402


def _num(x, spec=",.1f") -> str:
    return "n/a" if x is None else format(x, spec)


def m_rows_per_s(m_dir: Path, pair_hist: dict, *, batch: int = 64, batches: int = 4) -> dict | None:
    """M (the CPU run's confidence model, a fine-tuned all-MiniLM-L6-v2) scoring random pairs of the SNLI
    pair-length distribution, as ``confidence-filter`` batches them."""
    import torch
    from transformers import AutoModelForSequenceClassification

    source, stand_in = m_dir, False
    if not (m_dir / "config.json").is_file():
        # M's trained weights stay on the machine that ran seqz_cpu.py; its architecture (the base encoder with a
        # 3-way head) scores at the same rate whatever the weights, so time that and say so
        source, stand_in = gg.MODELS / "all-minilm-l6-v2", True
        if not (source / "config.json").is_file():
            return None
    model = AutoModelForSequenceClassification.from_pretrained(str(source), num_labels=3, dtype=torch.float32)
    r = tp.bench_classifier(model, pair_hist, device="cpu", batch=batch, batches=batches, warmup=1)
    return {"model": str(source), "stand_in": stand_in, "dtype": "float32", **r}


def this_run_inputs(seqz: dict, m: dict | None) -> dict:
    """``project``'s summary keys from the CPU Seq-Z run: G's row tokens per second (each row once, as the GPU
    kit counts them), its tokens per row, the sampling rate of its last full CLI run and M's rows/s."""
    g = seqz["generator"]
    row_tokens = g["tokens"]["sequence_tokens"]
    return {"G": {"tokens_per_s": round(row_tokens / g["seconds"], 1), "tokens": {"row_tokens": row_tokens}},
            "kit": {"data": {"train_rows": g["rows"]}},
            "sampling": {"samples_per_s": seqz["generation"]["this_run"]["samples_per_s_rank0"]},
            "filter": {"rows_per_s": m["rows_per_s"]} if m else {}}


def render(r: dict) -> str:
    g2, s = r["gpt2"], r["gpt2"]["sampling"]
    tr, cl = g2.get("training"), g2.get("classifier")
    L = ["# The paper's models on this CPU (issue 31, CPU fallback of item 1)", "",
         "No GPU has been lent to a session since the generator kit was ready. These are the figures item 1 asks of one H100, measured on "
         "the 2-core CPU with the GPU kit's own code (`gpu_throughput.run_gpt2(cpu_full=True)`), and the paper's "
         "SNLI pipeline projected from them. They are CPU figures, stated as such; the GPU run stays the goal "
         "(`benchmarks/GPU_GENERATOR.md`).", "",
         f"Command: `{r['command']}` ({r['seconds']:.0f} s). Machine: {r['machine']}; torch {r['torch']}, "
         f"{r['threads']} threads" + (f"; {r['note']}" if r.get("note") else "") + "."
         + (f" The sampling figures are an earlier run of the same command, cut short after sampling (written "
            f"{r['gpt2'].get('sampling_measured_at')}), kept by this one, which timed the rest."
            if r["gpt2"].get("sampling_resumed") else ""), "",
         "## GPT-2 large sampling (the paper's G: Table 7, \"pretrained model GPT-2 large\")", "",
         f"{g2['parameters'] / 1e6:,.0f}M parameters from `GPT2Config` (random weights), {g2['dtype']}"
         f"{' (this CPU has no native bfloat16)' if g2['dtype'] == 'float32' else ''}, KV cache, plain sampling; every sample "
         f"forced to a length of the SNLI training rows' distribution (whole row after the prompt, GPT-2 tokens, "
         f"mean {s['mean_length']}), buckets of 8 tokens weighted by their share.", "",
         "| batch (median length %d) | samples/s | tokens/s |" % s["median_length"], "|---|---|---|"]
    for b in s["batch_sweep"]:
        L.append(f"| {b['batch']} | {b.get('samples_per_s', b.get('error'))} | {b.get('tokens_per_s', '')} |")
    measured = sum(1 for b in s["buckets"] if b["measured"])
    L += ["", f"- **{s['samples_per_s']} samples/s** at batch {s['best_batch']} over the length distribution "
          f"({measured} of {len(s['buckets'])} length buckets timed, the rest scaled from the longest timed one by length): "
          f"**{s['x_paper']}x the paper's ~40 samples/s** (5M samples in ~35 h on one A100); {s['tokens_per_s']} tokens/s.",
          f"- Roofline: every decoding step reads all weights ({s['weight_bytes'] / 1e9:.2f} GB) once plus the KV "
          f"cache so far; that is {s['bandwidth_tb_s'] * 1e3:.1f} GB/s at this rate"
          + (f" against this machine's measured copy bandwidth of {s['peak_bandwidth_tb_s'] * 1e3:.1f} GB/s: "
             f"**{s['roofline_fraction']:.3f} of the memory-bandwidth roofline**. On 2 CPU cores decoding at these "
             "batches is bound by arithmetic, not by memory: the roofline that binds a GPU is not the one that binds here."
             if s.get("peak_bandwidth_tb_s") else " (no bandwidth ceiling measured: tiny dry run).")]
    if g2.get("sampling_hypothesis_lengths_only"):
        h = g2["sampling_hypothesis_lengths_only"]
        L.append(f"- Hypothesis lengths only (mean {h['mean_length']} tokens; a generator conditioned on the premise "
                 f"writes only these): {h['samples_per_s']} samples/s.")
    if tr:
        L += ["", "## GPT-2 large training step", "",
              f"Table 7's batch of 24 rows of the SNLI length distribution, MLE + 0.5 label-consistency unlikelihood "
              f"(two forward passes), AdamW, {'bf16 autocast over ' if g2['dtype'] == 'bfloat16' else ''}float32 weights"
              + (f", gradients accumulated over chunks of {tr['micro_batch']} rows (24 rows at once do not fit this "
                 f"machine's memory)" if tr.get("micro_batch", tr["batch"]) < tr["batch"] else "") + ": "
              f"**{_num(tr['seconds_per_step'])} s per step**, "
              f"{_num(tr['tokens_per_s'])} row tokens/s ({tr['steps_timed']} step(s) timed after a warm-up)."]
    if cl:
        L += ["", "## RoBERTa-large inference (the paper's M: Table 8, \"data filtering model Roberta-large\")", "",
              f"Batch {cl['batch']}, pairs of the SNLI pair-length distribution, {cl['dtype']}: **{cl['rows_per_s']} rows/s**."]
    m = r.get("m")
    if m:
        what = ("all-MiniLM-L6-v2 with an untrained 3-way head (M's architecture: the fine-tuned M is not on this "
                "machine, and the rate does not depend on the weights)" if m.get("stand_in")
                else f"all-MiniLM-L6-v2 fine-tuned (`{Path(m['model']).name}`)")
        L += ["", "## This run's M", "", f"{what}, batch {m['batch']}, {m['dtype']}: **{m['rows_per_s']} rows/s**."]
    P = r["projection"]
    L += ["", "## Projection: the paper's SNLI pipeline on this CPU", "",
          "550k rows x 5 epochs of G, 5M samples, confidence filter of 5M rows, z-filter (the CPU z-filter's measured "
          f"rates, `zfilter_bench.json`); one machine, {r['threads']} threads. Paper: 24 h + 35 h = 59 h on one A100.", "",
          "| models | train G (h) | sample 5M (h) | confidence filter (h) | z-filter (h) | total (h) | total (days) | paper 59 h / total |",
          "|---|---|---|---|---|---|---|---|"]
    for key, title in (("paper_models", "GPT-2 large G, RoBERTa-large M (measured here)"),
                       ("this_run_models", "this run's SmolLM2-135M + LoRA G and MiniLM M")):
        t = (P.get(key) or {}).get("1_gpu")
        if t:
            tot = t["total_h"]
            L.append(f"| {title} | {_num(t['train_g_h'])} | {_num(t['sample_h'])} | {_num(t['confidence_filter_h'], ',.2f')} | "
                     f"{_num(t['z_filter_h'], ',.2f')} | {_num(tot)} | {_num(tot and tot / 24)} | {_num(tot and 59.0 / tot, '.2g')} |")
    if P.get("this_run_models"):
        i = P["this_run_models"]["inputs"]
        L += ["", f"This run's inputs: G {i['g_tokens_per_s']} row tokens/s ({i['g_tokens_per_row']} tokens per row, "
              f"`seqz_cpu.json`), {i['g_samples_per_s']} samples/s (its last full sampling run), M {_num(i['m_rows_per_s'])} rows/s."]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64], help="GPT-2 large sampling batch sweep")
    ap.add_argument("--train-steps", type=int, default=1, help="GPT-2 large training steps timed after one warm-up")
    ap.add_argument("--deadline", type=float, default=1500, help="seconds for the GPT-2 large part")
    ap.add_argument("--reserve", type=float, default=600,
                    help="seconds of --deadline kept for the training step and RoBERTa after sampling")
    ap.add_argument("--fresh", action="store_true",
                    help="measure sampling again even when WORK holds an interrupted run's sampling result")
    ap.add_argument("--m-dir", default="/work/runs/seqz_cpu/M", help="the CPU run's confidence model M")
    ap.add_argument("--out", default=str(RESULTS / "paper_models_cpu"), help="STEM: writes STEM.json and STEM.md")
    ap.add_argument("--work", default="~/runs/paper_models_cpu", help="the partial result of an interrupted run")
    ap.add_argument("--note", help="a line on the conditions of the run (e.g. other work on the same cores)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a dry run of the script and its report)")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from debiased_nli.utils.precision import cpu_description, native_bfloat16_cpu

    t0 = time.monotonic()
    out = Path(a.out)
    work = Path(a.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    lengths = gg.length_tables(gg.SHARED_DATA / "snli" / "train_sample.parquet", gg.MODELS / "gpt2-tokenizer", None)
    dtype = "bfloat16" if native_bfloat16_cpu() else "float32"
    # the partial result (sampling first) lands in WORK: a run cut short still leaves what it measured
    g2 = tp.run_gpt2(lengths, work / "gpt2.partial.json", tiny=a.tiny, cpu_full=not a.tiny, cpu_dtype=dtype,
                     batches=a.batches, deadline_s=a.deadline, train_steps=a.train_steps, classifier_batch=32,
                     reserve_s=0 if a.tiny else a.reserve, resume=not a.fresh)
    m = m_rows_per_s(Path(a.m_dir), lengths["pair_lengths_gpt2"], batches=1 if a.tiny else 4)
    seqz = json.loads((RESULTS / "seqz_cpu.json").read_text())
    summary = {"gpt2": g2, **this_run_inputs(seqz, m)}
    cpu = cpu_description()
    r = {"command": shlex.join(["python", "benchmarks/paper_models_cpu.py", *(argv if argv is not None else sys.argv[1:])]),
         "machine": f"{cpu.get('model') or cpu}", "note": a.note, "cpu": cpu, "torch": torch.__version__, "threads": a.threads,
         "gpt2": g2, "m": m, "projection": gg.project(summary, gpus=(1,)), "seconds": round(time.monotonic() - t0, 1),
         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(r, indent=2))
    out.with_suffix(".md").write_text(render(r))
    print(render(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
