"""Training the generator: `train_generator` (what `debiased-nli train-generator` runs) against plain peft +
`transformers.Trainer` on the same work (issue 50, item 3).

Same base model and LoRA adapter (``LoraOptions()``: r 8, alpha 16, all linear layers), the same SNLI rows in
the same format, batch ``--batch-size``, at most ``--max-length`` tokens, Adam lr 1e-5 (eps 1e-6, Table 7),
bfloat16 autocast on the CPU, ``--steps`` optimizer steps, every arm in its own process, interleaved over
``--repeats`` rounds:

* ``project``: ``train_generator(mode="generator")``: MLE + lambda * the label-consistency unlikelihood
  (two forward passes per row: the row and its perturbed-label copy), accelerate, dynamic padding.
* ``trainer_same_loss``: ``Trainer`` (``bf16=True``) whose ``compute_loss`` is the project's ``batch_loss``
  on the project's collated batches: the same objective through the plain training loop.
* ``trainer_mle``: ``Trainer`` with the model's own causal-LM loss on the row alone (what a user fine-tuning
  with peft would write; one forward pass per row, so half the work of the two above).

Reported: tokens/s (real tokens through forward and backward, both sequences where there are two; padding not
counted) over the steps after the first (the first includes one-off set-up), and seconds per step.

    python benchmarks/bench_generator_train.py --model ~/.cache/debiased-nli/models/smollm2-135m-instruct \
        --rows ../shared/data/snli/train_sample.parquet --steps 6 --batch-size 24 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, ROOT, command, md_table, rotations, write_result  # noqa: E402

ARMS = ("project", "trainer_same_loss", "trainer_mle")


def _rows(path: str, n: int):
    import datasets
    ds = datasets.Dataset.from_parquet(path)
    ds = ds.filter(lambda r: r["label"] in (0, 1, 2))
    return ds.select(range(n))


def _tokens(batch, two: bool) -> int:
    n = int(batch["mask"].sum())
    return n + (int(batch["p_mask"].sum()) if two else 0)


def run_one(arm: str, args) -> dict:
    """One arm in this process; prints its result as JSON."""
    import torch
    torch.manual_seed(0)
    from debiased_nli.data.tasks import get_task
    from debiased_nli.methods.generation.models import LoraOptions, load_generator
    from debiased_nli.methods.generation.train import batch_loss, collate, encode_dataset, train_generator
    task = get_task("snli")
    ds = _rows(args.rows, args.steps * args.batch_size)
    if arm == "project":
        with tempfile.TemporaryDirectory() as tmp:
            rep = train_generator(ds, task, args.model, tmp, mode="generator", lora=LoraOptions(),
                                  max_steps=args.steps, batch_size=args.batch_size, max_length=args.max_length,
                                  mixed_precision="bf16", cpu=True, progress=False, log_every=1,
                                  checkpoint_every=10**9)
        hist = rep["history"]
        return {"arm": arm, "history": hist, "report_tokens_per_s": rep["tokens_per_s"],
                "seconds": rep["seconds"], "tokens": rep["tokens_this_run"]}
    from transformers import Trainer, TrainerCallback, TrainingArguments
    net, tok = load_generator(args.model, lora=LoraOptions(), trainable=True)
    data = encode_dataset(ds, task, tok, mode="generator", max_length=args.max_length, progress=False)
    two = arm == "trainer_same_loss"
    times, toks = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    def collator(rows):
        b = collate(rows, tok.pad_token_id)
        toks.append(_tokens(b, two))
        if not two:  # the model's own causal-LM loss on the row: labels = ids, padding ignored
            return {"input_ids": b["input_ids"], "attention_mask": b["mask"],
                    "labels": b["input_ids"].masked_fill(b["mask"] == 0, -100)}
        return b

    class SameLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, _ = batch_loss(model, inputs, mode="generator", lam=0.5, alpha=1.0)
            return loss

    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(output_dir=tmp, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
                                  learning_rate=1e-5, adam_epsilon=1e-6, lr_scheduler_type="constant", bf16=True,
                                  use_cpu=True, save_strategy="no", report_to=[], logging_steps=10**6,
                                  remove_unused_columns=False, dataloader_num_workers=0, seed=0,
                                  disable_tqdm=True)
        cls = SameLoss if two else Trainer
        tr = cls(model=net, args=targs, train_dataset=data, data_collator=collator, callbacks=[Clock()])
        t0 = time.perf_counter()
        tr.train()
        seconds = time.perf_counter() - t0
    return {"arm": arm, "step_seconds": times, "step_tokens": toks[:len(times)], "seconds": seconds, "tokens": sum(toks)}


def summarize(res: dict) -> dict:
    """tokens/s over the steps after the first, and seconds per step."""
    if res["arm"] == "project":
        h = res["history"]  # per logged step: its tokens and seconds, if recorded
        steps = [x for x in h if "seconds" in x and "tokens" in x]
        if len(steps) > 1:
            secs = [x["seconds"] for x in steps[1:]]
            tk = [x["tokens"] for x in steps[1:]]
            return {"tokens_per_s": sum(tk) / sum(secs), "seconds_per_step": statistics.mean(secs)}
        return {"tokens_per_s": res["tokens"] / res["seconds"], "seconds_per_step": None, "note": "whole run"}
    secs, tk = res["step_seconds"][1:], res["step_tokens"][1:]
    return {"tokens_per_s": sum(tk) / sum(secs), "seconds_per_step": statistics.mean(secs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", required=True, help="a Parquet file of SNLI rows (premise, hypothesis, label)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", choices=ARMS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        import torch
        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    runs = []
    passthrough = ["--model", args.model, "--rows", args.rows, "--steps", str(args.steps), "--batch-size",
                   str(args.batch_size), "--max-length", str(args.max_length), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    for r, arm in rotations(list(ARMS), args.repeats):
        p = subprocess.run([sys.executable, __file__, "--one", arm, *passthrough], env=env, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            raise SystemExit(f"{arm} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        res = json.loads(line[-1][7:])
        res.update(summarize(res), round=r)
        runs.append(res)
        print(arm, r, round(res["tokens_per_s"], 1), "tokens/s", flush=True)
    summary = {}
    for arm in ARMS:
        mine = [x for x in runs if x["arm"] == arm]
        summary[arm] = {"tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in mine), 1),
                        "per_round": [round(x["tokens_per_s"], 1) for x in mine],
                        "seconds_per_step": round(statistics.median(x["seconds_per_step"] for x in mine
                                                                    if x["seconds_per_step"] is not None), 2)}
    for arm in ARMS:
        summary[arm]["ratio_to_trainer_same_loss"] = round(summary[arm]["tokens_per_s"] /
                                                           summary["trainer_same_loss"]["tokens_per_s"], 3)
    cmd = command("bench_generator_train.py", argv)
    what = {"project": "MLE + 0.5 L_LC (2 passes)", "trainer_same_loss": "MLE + 0.5 L_LC (2 passes)",
            "trainer_mle": "MLE (1 pass)"}
    write_result(RESULTS / "engines" / "train_generator", {"command": cmd, "runs": runs, "summary": summary}, [
        "# Training the generator: the project's loop against peft + `transformers.Trainer`", "", f"Command: `{cmd}`", "",
        f"{args.steps} optimizer steps of {args.batch_size} SNLI rows (at most {args.max_length} tokens), LoRA r 8 on all "
        "linear layers, bfloat16 autocast, CPU; tokens/s over the steps after the first, median of the rounds "
        "(interleaved, each arm its own process).", "",
        *md_table(["arm", "objective", "tokens/s", "per round", "s per step", "ratio to Trainer (same loss)"],
                  [[arm, what[arm], s["tokens_per_s"], s["per_round"], s["seconds_per_step"],
                    s["ratio_to_trainer_same_loss"]] for arm, s in summary.items()])])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
