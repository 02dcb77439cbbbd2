"""Why do two engines' label shares differ? The label a generator writes after a premise, scored exactly by
each engine on the same premises, with no sampling noise.

For each of ``--premises`` premises (taken from a generate run's parsed rows, so from the generator's own
premise distribution), the text ``<start>premise: P\\nlabel: L\\n`` is scored for every label L by:

* the generator in torch (LoRA merged) in float32: the reference;
* the same in bfloat16 (what ``--engine fast --dtype auto`` computes in on a CPU with AVX512-BF16);
* CTranslate2 (``Generator.score_batch``) in each compute type of ``--ct2-compute-types``.

P(L | P) is the product of the probabilities of the label's tokens and the newline after it (the label as the
parser reads it). Its mean over the premises is the label share the engine would sample from those premises;
the paired differences to float32 (mean and 95% interval over premises) say whether an engine's arithmetic
moves the label decision, and by how much, separately from the sampler.

    python benchmarks/engine_label_probs.py --generator /work/runs/seqz_cpu/Gstar \
        --premises-from /work/runs/seqz_cpu/samples_gstar --premises 1000 --out benchmarks/results/engines/label_probs

Writes ``<out>.json`` and ``<out>.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def premises_of(folder: str, n: int, seed: int = 0) -> list[str]:
    import numpy as np
    import pyarrow.parquet as pq
    out = []
    for shard in sorted(Path(folder).glob("shard-*-of-*.parquet")):
        out += pq.read_table(shard, columns=["premise"]).column("premise").to_pylist()
        if len(out) >= 4 * n:
            break
    rng = np.random.default_rng(seed)
    return [out[i] for i in sorted(rng.choice(len(out), size=min(n, len(out)), replace=False))]


def label_texts(fmt, premise: str, labels) -> list[str]:
    return [fmt.text(premise, lab, "x").split("\nhypothesis:")[0] + "\n" for lab in labels]


def torch_scores(model, tok, texts: list[str], prefix_lens: list[int], batch: int = 64):
    """Sum of log-probabilities of each text's tokens after its first ``prefix_lens[i]`` tokens."""
    import torch
    out = []
    for b in range(0, len(texts), batch):
        enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[b:b + batch]]
        width = max(map(len, enc))
        ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, e in enumerate(enc):
            ids[r, :len(e)] = torch.tensor(e)
            mask[r, :len(e)] = 1
        with torch.inference_mode():
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        for r, e in enumerate(enc):
            k = prefix_lens[b + r]
            out.append(float(sum(logp[r, t - 1, e[t]] for t in range(k, len(e)))))
    return out


def ct2_scores(gen, tok, texts: list[str], prefix_lens: list[int], batch: int = 64):
    out = []
    for b in range(0, len(texts), batch):
        toks = [tok.convert_ids_to_tokens(tok(t, add_special_tokens=False)["input_ids"]) for t in texts[b:b + batch]]
        for r, res in enumerate(gen.score_batch(toks)):
            # log_probs[j] is the log-probability of token j + 1 given the tokens before it
            k = prefix_lens[b + r]
            out.append(float(sum(res.log_probs[k - 1:])))
    return out


def main(argv=None) -> int:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generator", required=True)
    ap.add_argument("--premises-from", required=True, help="a generate run folder (its parsed rows' premises)")
    ap.add_argument("--premises", type=int, default=1000)
    ap.add_argument("--ct2-compute-types", default="int8,float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch

    from debiased_nli.data.tasks import get_task
    from debiased_nli.methods.generation.ct2 import converted_model, open_generator
    from debiased_nli.methods.generation.format import SequenceFormat
    from debiased_nli.methods.generation.models import load_generator

    torch.set_num_threads(args.threads)
    labels = get_task("snli").labels
    model, tok = load_generator(args.generator)
    model = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
    model.eval()
    fmt = SequenceFormat.for_tokenizer(tok, labels)
    premises = premises_of(args.premises_from, args.premises)
    texts, prefix = [], []
    for p in premises:
        for t in label_texts(fmt, p, labels):
            texts.append(t)
            head = t[:t.rindex("\nlabel:") + len("\nlabel:")]
            prefix.append(len(tok(head, add_special_tokens=False)["input_ids"]))
    scores, seconds = {}, {}
    t0 = time.perf_counter()
    scores["torch float32"] = torch_scores(model, tok, texts, prefix)
    seconds["torch float32"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    scores["torch bfloat16"] = torch_scores(model.to(torch.bfloat16), tok, texts, prefix)
    seconds["torch bfloat16"] = time.perf_counter() - t0
    for ct in args.ct2_compute_types.split(","):
        gen = open_generator(converted_model(args.generator, ct), ct, "cpu", 0, args.threads)
        t0 = time.perf_counter()
        scores[f"ctranslate2 {ct}"] = ct2_scores(gen, tok, texts, prefix)
        seconds[f"ctranslate2 {ct}"] = time.perf_counter() - t0
    n, k = len(premises), len(labels)
    probs = {name: np.exp(np.array(v).reshape(n, k)) for name, v in scores.items()}
    ref = probs["torch float32"]
    rows = {}
    for name, p in probs.items():
        share = p / p.sum(1, keepdims=True)  # P(L | P, the label is one of the task's)
        d = share - ref / ref.sum(1, keepdims=True)
        rows[name] = {"mean_label_prob": dict(zip(labels, p.mean(0).round(4).tolist())),
                      "mean_label_share": dict(zip(labels, share.mean(0).round(4).tolist())),
                      "share_diff_vs_float32": {lab: [round(float(d[:, j].mean()), 4),
                                                      round(float(1.96 * d[:, j].std(ddof=1) / n ** 0.5), 4)]
                                                for j, lab in enumerate(labels)},
                      "mean_abs_logprob_diff_vs_float32": round(float(np.abs(np.log(p) - np.log(ref)).mean()), 4),
                      "seconds": round(seconds[name], 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/engine_label_probs.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "premises": n, "rows": rows,
                                                    "load_average": os.getloadavg()}, indent=2))
    md = [f"# The label after a premise, scored exactly by each engine ({n} premises of the generator's own)", "",
          f"Command: `{command}`", "",
          "| arithmetic | " + " | ".join(f"share {lab}" for lab in labels) + " | "
          + " | ".join(f"{lab} - float32 (95%)" for lab in labels) + " | mean abs. log-prob diff |",
          "|" + "---|" * (2 + 2 * len(labels))]
    for name, r in rows.items():
        md.append(f"| {name} | " + " | ".join(f"{r['mean_label_share'][lab]:.4f}" for lab in labels) + " | "
                  + " | ".join(f"{r['share_diff_vs_float32'][lab][0]:+.4f} ± {r['share_diff_vs_float32'][lab][1]:.4f}"
                               for lab in labels) + f" | {r['mean_abs_logprob_diff_vs_float32']} |")
    md += ["", "share: P(L | premise) renormalised over the task's labels, averaged over the premises (the label "
           "shares sampling would give for these premises); differences are paired over the same premises."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
