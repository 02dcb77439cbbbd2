"""The real generator run of issue 4 on CPU (see generator_run.md for the commands and the results).

Stages (each resumable; a finished stage is skipped):
  train_g   LoRA-tune SmolLM2-135M on the 20k SNLI sample: MLE + 0.5 * label-consistency unlikelihood
  train_m   fine-tune all-MiniLM-L6-v2 on the same sample as the confidence model M (debiased_nli.models.training)
  generate  sample from G (debiased-nli generate; premise-conditioned on SNLI dev premises, see below)
  filter    confidence-filter with M (tau 0.95), z-filter the accepted rows conditionally on Z(D0): seq_z
  report    generator_run.json / generator_run.md
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RUN = Path(os.environ.get("GENERATOR_RUN_DIR", Path.home() / "runs" / "generator_run"))
MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SNLI = SHARED / "snli" / "train_sample.parquet"
SNLI_DEV = SHARED / "snli" / "dev.parquet"
HERE = Path(__file__).resolve().parent / "results"

G_STEPS, G_BATCH, G_LEN = 60, 8, 48
M_ROWS = 6000
N_SAMPLES, SHARD = 512, 128


def sh(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def train_g() -> None:
    sh(["debiased-nli", "train-generator", "snli", "--data-files", str(SNLI), "--model", str(MODELS / "smollm2-135m-instruct"),
        "--out", str(RUN / "G"), "--lora", "--lora-r", "8", "--lora-alpha", "16", "--max-steps", str(G_STEPS),
        "--batch-size", str(G_BATCH), "--max-length", str(G_LEN), "--lr", "3e-4", "--checkpoint-every", "10",
        "--cpu", "--threads", "1", "--log-every", "5",
        # the values this run was measured with (the defaults became Table 7's since: eps 1e-6, constant)
        "--eps", "1e-8", "--scheduler", "linear"])


def train_m() -> None:
    import torch
    from debiased_nli.data.loading import load_task
    from debiased_nli.models.training import TrainConfig, train_classifier
    torch.set_num_threads(1)
    if (RUN / "M" / "config.json").exists():
        return
    train = load_task("snli", data_files=str(SNLI)).dataset
    dev = load_task("snli", data_files=str(SNLI_DEV)).dataset
    cfg = TrainConfig(model=str(MODELS / "all-minilm-l6-v2"), output_dir=str(RUN / "M"), learning_rate=5e-5,
                      batch_size=16, max_length=64, epochs=1.0, max_train_rows=M_ROWS, max_dev_rows=1000,
                      num_threads=1)
    res = train_classifier(cfg, "snli", train, dev)
    (RUN / "M_report.json").write_text(json.dumps(res.to_dict(), indent=2, default=str))


def generate() -> None:
    sh(["debiased-nli", "generate", "snli", "--generator", str(RUN / "G"), "--out", str(RUN / "samples"),
        "--num-samples", str(N_SAMPLES), "--shard-size", str(SHARD), "--batch-size", "16", "--top-p", "0.9",
        "--max-new-tokens", "40", "--seed", "0", "--cpu", "--threads", "1",
        # CPU budget: prompt with a premise of SNLI dev (unseen in training) and a label (cycling through
        # the three), G writes the hypothesis; the paper samples whole rows (--condition none).
        "--condition", "premise+label", "--premises-from", str(SNLI_DEV)])
    # a smaller run where G also writes the label (closer to the paper's whole-row sampling)
    sh(["debiased-nli", "generate", "snli", "--generator", str(RUN / "G"), "--out", str(RUN / "samples_premise_only"),
        "--num-samples", "128", "--shard-size", "128", "--batch-size", "16", "--top-p", "0.9",
        "--max-new-tokens", "40", "--seed", "0", "--cpu", "--threads", "1",
        "--condition", "premise", "--premises-from", str(SNLI_DEV)])


TAU_USED = 0.5  # M here (MiniLM, 1 epoch on 6k rows) is never 0.95-confident: see the report


def filter_() -> None:
    for tau, out in ((0.95, RUN / "confident"), (TAU_USED, RUN / f"confident_tau{TAU_USED}")):
        if not (out / "confidence_report.json").exists():
            sh(["debiased-nli", "confidence-filter", "snli", "--data-files", str(RUN / "samples" / "shard-*.parquet"),
                "--model", str(RUN / "M"), "--tau", str(tau), "--out", str(out), "--threads", "1"])
    # reference: M's confidence in the gold label of real SNLI dev rows (the same number of rows)
    import numpy as np
    from debiased_nli.methods.confidence import confidence_filter
    from debiased_nli.data.loading import load_task as _load
    dev = _load("snli", data_files=str(SNLI_DEV), max_rows=512).dataset
    k, r = confidence_filter(dev, str(RUN / "M"), "snli", tau=0.95, progress=False)
    conf = np.concatenate([np.asarray(k["confidence"]), np.asarray(r["confidence"])])
    (RUN / "dev_reference.json").write_text(json.dumps({
        "rows": len(dev), "acceptance_at_tau": {str(t): round(float((conf > t).mean()), 4) for t in (0.5, 0.7, 0.9, 0.95)},
        "confidence_quantiles": {q: round(float(np.quantile(conf, q)), 4) for q in (0.1, 0.25, 0.5, 0.75, 0.9)}}))
    import datasets
    from debiased_nli.data.loading import load_task
    from debiased_nli.bias.featurize import add_features
    from debiased_nli.bias.zfilter import z_filter
    d0 = load_task("snli", data_files=str(SNLI)).dataset
    d0f, _ = add_features(d0, "snli")
    z0 = z_filter(d0f, "snli", top_k=20, batch_size=1000, seed=0)
    accepted = datasets.Dataset.from_parquet(str(RUN / f"confident_tau{TAU_USED}" / "kept.parquet"))
    gen = accepted.select_columns(["premise", "hypothesis", "label", "uid", "origin", "method"]).cast(d0.features)
    if len(gen) < 10:
        (RUN / "seq_z.json").write_text(json.dumps({"z_d0": z0.counts, "seq_z": None,
                                                    "note": f"only {len(gen)} accepted rows: too few to featurize"}))
        return
    # the hypothesis-only feature of the generated rows is the out-of-fold TF-IDF model over those rows
    genf, _ = add_features(gen, "snli")
    cols = [c for c in genf.column_names if c in z0.kept.column_names]
    seq = z_filter(genf.select_columns(cols), "snli", top_k=20, batch_size=1000, seed=0,
                   seed_dataset=z0.kept.select_columns(cols), allow_empty=True)
    out = {"z_d0": z0.counts, "seq_z": seq.counts,
           "seq_z_generated_kept": int(len(seq.outcome.kept)),
           "seq_z_generated_rejected": int(len(seq.outcome.rejected)),
           "rejected_examples": [{"hypothesis": r["hypothesis"], "rejected_by": r["rejected_by"]}
                                 for r in seq.rejected.select(range(min(5, len(seq.rejected))))]}
    (RUN / "seq_z.json").write_text(json.dumps(out, indent=2))
    seq.kept.to_parquet(str(RUN / "seq_z.parquet"))


def report() -> None:
    import datasets
    import numpy as np
    gen = json.loads((RUN / "samples" / "generate_report.json").read_text())
    conf = json.loads((RUN / "confident" / "confidence_report.json").read_text())
    conf_used = json.loads((RUN / f"confident_tau{TAU_USED}" / "confidence_report.json").read_text())
    dev_ref = json.loads((RUN / "dev_reference.json").read_text())
    g = json.loads((RUN / "G" / "train_report.json").read_text())
    m = json.loads((RUN / "M_report.json").read_text())
    seq = json.loads((RUN / "seq_z.json").read_text())
    kept = datasets.Dataset.from_parquet(str(RUN / f"confident_tau{TAU_USED}" / "kept.parquet"))
    rej = datasets.Dataset.from_parquet(str(RUN / f"confident_tau{TAU_USED}" / "rejected.parquet"))
    labels = ("entailment", "neutral", "contradiction")
    examples = []
    for d, tag in ((kept, "kept"), (rej, "rejected")):
        for r in d.select(range(min(10, len(d)))):
            examples.append({"filter": tag, "premise": r["premise"], "label": labels[r["label"]],
                             "hypothesis": r["hypothesis"], "confidence": round(r["confidence"], 4)})
    allconf = np.concatenate([np.asarray(kept["confidence"]), np.asarray(rej["confidence"])])
    summary = {
        "generator": {k: g[k] for k in ("model", "steps", "seconds", "seconds_per_step", "batch_size", "max_length",
                                        "lr", "lambda", "lora", "parameters")} | {"loss_history": g["history"]},
        "confidence_model": m,
        "generation": gen,
        "confidence_filter": conf,
        "confidence_filter_tau_used": conf_used,
        "confidence_on_real_snli_dev": dev_ref,
        "acceptance_at_other_tau": {str(t): round(float((allconf > t).mean()), 4) for t in (0.5, 0.7, 0.9, 0.95)},
        "seq_z": seq,
        "examples": examples,
    }
    from debiased_nli.methods.generation.sample import summarize
    from debiased_nli.data.tasks import get_task
    if (RUN / "samples_premise_only").exists():
        summary["premise_only"] = summarize(RUN / "samples_premise_only", get_task("snli"))
    bug = RUN / "samples_trailing_space_bug"
    if bug.exists():
        b = summarize(bug, get_task("snli"))
        hyps = datasets.concatenate_datasets([datasets.Dataset.from_parquet(str(f)) for f in sorted(bug.glob("shard-*"))])["hypothesis"]
        b["hypotheses_starting_with_a_digit"] = round(float(np.mean([h[:1].isdigit() for h in hyps])), 4)
        summary["before_the_prompt_fix"] = {"premise+label": b}
        if (RUN / "samples_premise_only_trailing_space_bug").exists():
            summary["before_the_prompt_fix"]["premise"] = summarize(RUN / "samples_premise_only_trailing_space_bug", get_task("snli"))
    elif (HERE / "generator_run.json").exists():
        # a rerun on another machine has no samples of the bug (they came from code fixed in 3428ffe):
        # keep what the committed report measured then
        before = json.loads((HERE / "generator_run.json").read_text()).get("before_the_prompt_fix")
        if before:
            summary["before_the_prompt_fix"] = before
    hyps_now = list(kept["hypothesis"]) + list(rej["hypothesis"])
    summary["generation"]["hypotheses_starting_with_a_digit"] = round(float(np.mean([h[:1].isdigit() for h in hyps_now])), 4)
    (HERE / "generator_run.json").write_text(json.dumps(summary, indent=2, default=str))
    (HERE / "generator_run.md").write_text(markdown(summary))
    print(json.dumps({k: summary[k] for k in ("generation", "confidence_filter", "acceptance_at_other_tau")}, indent=2))


def markdown(s: dict) -> str:
    g, gen, conf, seq = s["generator"], s["generation"], s["confidence_filter"], s["seq_z"]
    m = s["confidence_model"]
    lines = [
        "# Generator run on CPU (issue 4): SmolLM2-135M + LoRA on the 20k SNLI sample",
        "",
        "Commands (each stage resumable; outputs under `~/runs/generator_run`, not in the repo):",
        "",
        "```",
        *[f"python benchmarks/generator_run.py {st}" for st in ("train_g", "train_m", "generate", "filter", "report")],
        "```",
        "",
        "`train_g`, `generate` and the first half of `filter` call the CLI (`debiased-nli train-generator`, "
        "`debiased-nli generate`, `debiased-nli confidence-filter`); the exact arguments are in the script.",
        "",
        "## Setup",
        "",
        f"* **G**: `{Path(g['model']).name}` + LoRA (r={g['lora']['r']}, alpha={g['lora']['alpha']}, all linear layers), "
        f"{g['steps']} steps of {g['batch_size']} rows (max {g['max_length']} tokens), lr {g['lr']}, "
        f"loss MLE + {g['lambda']} x label-consistency unlikelihood; {g['seconds']:.0f} s "
        f"({g['seconds_per_step']} s/step on 1 thread of a shared 2-core machine); "
        f"{g['parameters']['trainable']:,} of {g['parameters']['total']:,} parameters trained. "
        f"Loss {g['loss_history'][0]['loss']} (first 5 steps) -> {g['loss_history'][-1]['loss']} (last 5).",
        f"* **M**: all-MiniLM-L6-v2 fine-tuned (`debiased_nli.models.training.train_classifier`) on {m['train_rows']:,} rows "
        f"of the same sample, 1 epoch; SNLI dev accuracy {m['dev_accuracy']} (first {m['dev_rows']} dev rows).",
        f"* **Sampling**: {gen['config']['num_samples']} samples, {gen['config']['num_shards']} shards, top-p "
        f"{gen['config']['top_p']}, at most {gen['config']['max_new_tokens']} new tokens, condition "
        f"`{gen['config']['condition']}`: the prompt is a premise of SNLI dev (not in the training sample) and a "
        "label (cycling through the three); G writes the hypothesis. **Deviation from the paper**, for the CPU budget: "
        "Wu et al. sample whole rows (`--condition none`, implemented and tested), which costs about three times the "
        "tokens and needs a generator trained long enough to write the label well (see the first try below).",
        "",
        "## Results",
        "",
        "| measure | value |",
        "|---|---|",
        f"| parse rate | {gen['parsed']}/{gen['samples']} = {gen['parse_rate']} |",
        f"| unparseable, by reason | {gen['unparseable_reasons']} |",
        f"| label distribution of the parsed rows | {gen['labels']} |",
        f"| distinct-2 of the hypotheses | {gen['distinct_2_hypothesis']} |",
        f"| generation speed (this run) | {gen['this_run']['samples_per_s_rank0']} samples/s |",
        f"| confidence filter acceptance (tau {conf['tau']}) | {conf['kept']}/{conf['rows']} = {conf['acceptance_rate']} |",
        f"| acceptance at other tau | {s['acceptance_at_other_tau']} |",
        f"| M's confidence quantiles, generated rows | {conf['confidence_quantiles']} |",
        f"| the same for {s['confidence_on_real_snli_dev']['rows']} real SNLI dev rows (gold label) | "
        f"{s['confidence_on_real_snli_dev']['confidence_quantiles']}; acceptance at tau "
        f"{s['confidence_on_real_snli_dev']['acceptance_at_tau']} |",
        f"| **tau used downstream: {s['confidence_filter_tau_used']['tau']}** (M is never 0.95-confident) | "
        f"kept {s['confidence_filter_tau_used']['kept']}/{s['confidence_filter_tau_used']['rows']} = "
        f"{s['confidence_filter_tau_used']['acceptance_rate']}; per label "
        f"{ {k: v['acceptance'] for k, v in s['confidence_filter_tau_used']['per_label'].items()} } |",
    ]
    if seq.get("seq_z"):
        lines += [f"| Z(D0) of the 20k sample (top-k 20, batch 1000) | {seq['z_d0']} |",
                  f"| seq_z = Z(D_G \\| Z(D0)): generated rows kept / rejected | "
                  f"{seq['seq_z_generated_kept']} / {seq['seq_z_generated_rejected']} (seq_z: {seq['seq_z']['output']} rows) |"]
    else:
        lines += [f"| seq_z | {seq.get('note')} |"]
    po = s.get("premise_only")
    if po:
        lines += ["", "## G writes the label too (`--condition premise`, 128 samples)", "",
                  f"Parse rate {po['parse_rate']}, unparseable by reason {po['unparseable_reasons']}, labels of the "
                  f"parsed rows {po['labels']}, distinct-2 {po['distinct_2_hypothesis']}."]
    bf = s.get("before_the_prompt_fix")
    if bf:
        pl = bf["premise+label"]
        lines += ["", "## A bug this run found (fixed in commit 3428ffe)", "",
                  "The first sampling run used prompts ending in the marker's trailing space (`hypothesis: `). In "
                  "training that space belongs to the field's first token (` A`), so the prompt left G off its "
                  f"training distribution: {pl['hypotheses_starting_with_a_digit']:.0%} of its {pl['parsed']} parsed "
                  "hypotheses started with a digit (`3 women walk ...`), against "
                  f"{s['generation']['hypotheses_starting_with_a_digit']:.0%} after the fix"
                  + (f"; with `--condition premise` only {bf['premise']['parse_rate']:.0%} of "
                     f"{bf['premise']['samples']} samples parsed (label words such as `description`, `2a`: "
                     f"{bf['premise']['unparseable_reasons']})" if "premise" in bf else "")
                  + ". Prompts now end without the space, and a test checks that every prompt's tokens are a "
                  "prefix of the training sequence's tokens for both tokenizers."]
    lines += ["", f"## Twenty examples (ten accepted, ten rejected by the confidence filter at tau {TAU_USED})", "",
              "| filter | premise | label | hypothesis | p_M(label) |", "|---|---|---|---|---|"]
    for e in s["examples"]:
        cells = [e["filter"], e["premise"], e["label"], e["hypothesis"], str(e["confidence"])]
        lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    if seq.get("rejected_examples"):
        lines += ["", "Generated rows the conditional z-filter rejected (with the biased features of Z(D0) they carry):", ""]
        lines += [f"* {r['hypothesis']!r}: {r['rejected_by']}" for r in seq["rejected_examples"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["train_g", "train_m", "generate", "filter", "report"])
    a = ap.parse_args()
    RUN.mkdir(parents=True, exist_ok=True)
    t = time.time()
    {"train_g": train_g, "train_m": train_m, "generate": generate, "filter": filter_, "report": report}[a.stage]()
    print(f"stage {a.stage} done in {time.time() - t:.0f}s", flush=True)
