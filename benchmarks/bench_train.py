"""Training throughput of `debiased-nli train` against the plain `transformers.Trainer` defaults.

Same model, same rows, same batch size, learning rate and number of steps; only what the harness
changes differs:

* ``trainer_pad_max_length``: the common recipe (HF course): tokenize with ``padding="max_length"``,
  plain ``Trainer`` with its defaults (random batches).
* ``trainer_dynamic_padding``: plain ``Trainer`` defaults with unpadded rows (its default collator,
  ``DataCollatorWithPadding``, pads each batch to its longest row).
* ``debiased_nli_train``: :func:`debiased_nli.models.training.train_classifier` (what `debiased-nli train`
  runs): dynamic padding and length-grouped batches (``train_sampling_strategy="group_by_length"``).

Each configuration runs ``--repeats`` times, interleaved (the machine is shared), and the median of
train examples / s (``Trainer``'s ``train_samples_per_second``, the whole ``train()`` call) is
reported, with the ratio to the first configuration measured in the same run.

    python benchmarks/bench_train.py --model ~/.cache/debiased-nli/models/all-minilm-l6-v2 \
        --rows 256 --batch-size 32 --max-length 128 --repeats 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import MODELS, RESULTS, SHARED_DATA, command, machine, md_table, write_result  # noqa: E402


def plain_trainer(model_path, task, train, *, pad_max_length: bool, args, out_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments, set_seed

    set_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=task.num_labels, id2label=dict(enumerate(task.labels)),
        label2id={l: i for i, l in enumerate(task.labels)})

    def encode(batch):
        return tok(batch["premise"], batch["hypothesis"], truncation=True, max_length=args.max_length,
                   padding="max_length" if pad_max_length else False)

    ds = train.map(encode, batched=True, remove_columns=[c for c in train.column_names if c != "label"])
    ds = ds.rename_column("label", "labels")
    targs = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=args.batch_size,
                              learning_rate=args.lr, num_train_epochs=1, seed=args.seed, report_to="none",
                              save_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=targs, train_dataset=ds, processing_class=tok)
    return trainer.train().metrics


def harness(model_path, task, train, *, args, out_dir):
    from debiased_nli.models.training import TrainConfig, train_classifier

    cfg = TrainConfig(model=str(model_path), output_dir=str(out_dir), learning_rate=args.lr,
                      batch_size=args.batch_size, max_length=args.max_length, epochs=1, seed=args.seed,
                      progress=False, use_cpu=True, resume=False, save_total_limit=1)
    res = train_classifier(cfg, task, train)
    return {"train_samples_per_second": res.train_examples_per_second, "train_runtime": res.train_seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(MODELS / "all-minilm-l6-v2"))
    p.add_argument("--data", default=str(SHARED_DATA / "snli/train_sample.parquet"))
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "train_bench"))
    args = p.parse_args()
    import numpy as np
    import torch
    import transformers
    from transformers import AutoTokenizer

    from debiased_nli.data.loading import load_task
    from debiased_nli.data.tasks import get_task

    torch.set_num_threads(args.threads)
    task = get_task("snli")
    train = load_task(task, data_files=args.data).dataset.shuffle(seed=0).select(range(args.rows))
    configs = ["trainer_pad_max_length", "trainer_dynamic_padding", "debiased_nli_train"]
    runs = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for c in configs:
                out, start = Path(tmp) / f"{c}-{rep}", time.perf_counter()
                m = harness(args.model, task, train, args=args, out_dir=out) if c == "debiased_nli_train" else \
                    plain_trainer(args.model, task, train, pad_max_length=c == "trainer_pad_max_length", args=args,
                                  out_dir=out)
                runs[c].append({"examples_per_second": float(m["train_samples_per_second"]),
                                "train_seconds": float(m["train_runtime"]),
                                "wall_seconds_incl_setup": round(time.perf_counter() - start, 2)})
                print(c, rep, runs[c][-1], flush=True)
    med = {c: statistics.median(r["examples_per_second"] for r in runs[c]) for c in configs}
    summary = {c: {"median_examples_per_second": med[c], "ratio_vs_trainer_pad_max_length": med[c] / med[configs[0]],
                   "runs": runs[c]} for c in configs}
    lengths = [len(x) for x in AutoTokenizer.from_pretrained(args.model)(
        list(train["premise"]), list(train["hypothesis"]), truncation=True, max_length=args.max_length)["input_ids"]]
    tok_len = {"mean": float(np.mean(lengths)), "p90": float(np.percentile(lengths, 90)), "max": int(max(lengths))}
    record = {"command": command("bench_train.py"), "args": vars(args), "results": summary,
              "machine": machine(torch_threads=torch.get_num_threads(), shared_cpu=True),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "data": {"rows": args.rows, "pair_word_pieces": tok_len}}
    write_result(args.out, record, [
        "# Training throughput: `debiased-nli train` vs plain `Trainer`", "", f"Command: `{record['command']}`", "",
        f"{args.rows} SNLI rows, batch {args.batch_size}, max length {args.max_length}, lr {args.lr}, one epoch, model "
        f"`{Path(args.model).name}`, CPU ({record['machine']['cpus']} cores, torch threads {args.threads}; the cores are "
        f"shared with other jobs, so absolute figures are noisy: compare the ratios). Median of {args.repeats} "
        "interleaved runs.", "",
        *md_table(["configuration", "examples/s (median)", "ratio vs Trainer padded to max length", "runs"],
                  [[c, f"{summary[c]['median_examples_per_second']:.2f}",
                    f"{summary[c]['ratio_vs_trainer_pad_max_length']:.2f}",
                    ", ".join(f"{r['examples_per_second']:.2f}" for r in runs[c])] for c in configs], "lrrl"), "",
        "Notes:", "- `debiased_nli_train`'s time includes what `debiased-nli train` does inside `Trainer.train()`: writing "
        "the end-of-epoch checkpoint (model + optimizer state); the plain Trainer runs use `save_strategy=\"no\"`, so the "
        "comparison is slightly unfavourable to the harness.",
        "- The padding to max length costs most where rows are much shorter than the limit (on these SNLI rows a pair "
        f"is {tok_len['mean']:.0f} word pieces on average, {tok_len['p90']:.0f} at the 90th percentile, {tok_len['max']} "
        f"at most, against {args.max_length}). Length-grouped batches (the harness) save a little more than dynamic "
        "padding alone.",
        "- Each run is one epoch of rows/batch steps including the first (slow) step; with few steps and shared cores, "
        "single runs vary by about 30%: read the medians and ratios, not single figures."])


if __name__ == "__main__":
    main()
