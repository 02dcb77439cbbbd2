"""Build the offline masked-LM stand-in for PDD's fills (a tool for this machine, not library API).

PDD (Guo et al. 2023, section 4.5) fills its masks with "XLM-large (Conneau et al., 2019)", i.e.
``xlm-roberta-large``. No English masked-LM checkpoint can be had on this machine (no Hub; the
offline all-MiniLM-L6-v2 has no MLM head, see ../shared/models/README.md), so this script makes an
honest stand-in:

- ``BertForMaskedLM`` loaded from the all-MiniLM-L6-v2 folder: the encoder is pretrained, the head
  (transform + LayerNorm + output bias) is new, and the decoder is tied to the word embeddings;
- trained on real text in PDD's prompt format ``P ? Yes/Maybe/No . H`` (section 3.3.2), with the
  gold label's word, so the fills can learn to use the label prompt;
- masking as PDD masks: whole words, each masked word is ONE mask token (the word must be one
  token of the vocabulary to be a target), at ratio 0.25 or 0.4 (Table 10's ratios), never the
  prompt's ``? w .``;
- trained parameters: the head and the top ``--train-layers`` encoder layers (the word embeddings,
  hence the tied decoder, stay frozen); AdamW, linear warm-up then cosine decay.

Training text: the 20k SNLI *train* sample only (../shared/data/snli/train_sample.parquet), which no
evaluation of this project scores on. Held-out masked-word recovery is measured on 1,000 SNLI *dev*
prompts (never trained on): top-1 / top-5 over the whole vocabulary, and top-1 among the tokens the
PDD fill may use (word-initial alphabetic tokens), before and after training.

Runs in resumable stages (the heavy-lock rule: at most ~20 min a stage): each invocation trains for
at most ``--stage-minutes``, checkpoints (trainable weights, optimizer, step, RNG) and exits with
code 3 while steps remain; rerun the same command to continue. When all steps are done it writes the
model folder (``save_pretrained`` + tokenizer) and ``standin.json`` (settings, timings, recovery).

    flock /tmp/debiased-heavy.lock python benchmarks/pdd_mlm_standin.py --steps 1200 --stage-minutes 18
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DEBIASED_NLI_SHARED", ROOT.parent / "shared")) / "data"
MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
PROMPT_WORDS = {0: "Yes", 1: "Maybe", 2: "No"}  # Guo et al. 2023, section 3.3.2 (SNLI/MNLI label order)
NOT_DONE = 3


def prompt_parts(premise: str, label: int, hypothesis: str) -> list[tuple[str, bool]]:
    """(text piece, maskable) pieces of ``P ? w . H``; the words of P and H are maskable pieces."""
    from debiased_nli.methods.generation.format import word_spans

    out: list[tuple[str, bool]] = []
    for side, text in (("p", premise), ("h", hypothesis)):
        pos = 0
        for _, s, e in word_spans(text):
            if s > pos:
                out.append((text[pos:s], False))
            out.append((text[s:e], True))
            pos = e
        if pos < len(text):
            out.append((text[pos:], False))
        if side == "p":
            out.append((f" ? {PROMPT_WORDS[label]} . ", False))
    return out


def encode_masked(tok, pieces, rng, ratio: float, max_length: int):
    """Mask ``ratio`` of the single-token words (one mask token each); returns (ids, targets)."""
    ids = [tok.cls_token_id]
    targets = [-100]
    words = [i for i, (text, m) in enumerate(pieces) if m]
    k = max(1, int(round(ratio * len(words)))) if words else 0
    chosen = set(rng.choice(words, size=min(k, len(words)), replace=False).tolist()) if k else set()
    for i, (text, maskable) in enumerate(pieces):
        piece_ids = tok(text, add_special_tokens=False)["input_ids"]
        if i in chosen and len(piece_ids) == 1:
            ids.append(tok.mask_token_id)
            targets.append(piece_ids[0])
        else:
            ids.extend(piece_ids)
            targets.extend([-100] * len(piece_ids))
    ids, targets = ids[: max_length - 1] + [tok.sep_token_id], targets[: max_length - 1] + [-100]
    return ids, targets


def load_rows(path: Path):
    import pandas as pd

    df = pd.read_parquet(path)
    return list(zip(df["premise"].astype(str), df["label"].astype(int), df["hypothesis"].astype(str)))


def pad(batch, pad_id):
    import torch

    n = max(len(i) for i, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    tgt = torch.full((len(batch), n), -100, dtype=torch.long)
    att = torch.zeros((len(batch), n), dtype=torch.long)
    for r, (i, t) in enumerate(batch):
        ids[r, : len(i)] = torch.tensor(i)
        tgt[r, : len(t)] = torch.tensor(t)
        att[r, : len(i)] = 1
    return ids, att, tgt


def masked_logits(model, ids, att, positions):
    """Logits at the masked positions only (the vocabulary projection of the other positions is skipped)."""
    hidden = model.bert(input_ids=ids, attention_mask=att).last_hidden_state
    return model.cls(hidden[positions])


def recovery(model, tok, rows, seed: int = 123, batch_size: int = 64, max_length: int = 96) -> dict:
    """Masked-word recovery on held-out prompts (ratio 0.25): top-1, top-5, and top-1 among fill tokens."""
    import torch

    from debiased_nli.methods.pdd.fill import fill_vocabulary

    allowed = torch.tensor(fill_vocabulary(tok), dtype=torch.bool)
    rng = np.random.default_rng(seed)
    enc = [encode_masked(tok, prompt_parts(p, l, h), rng, 0.25, max_length) for p, l, h in rows]
    hit1 = hit5 = hitf = total = 0
    model.eval()
    with torch.no_grad():
        for s in range(0, len(enc), batch_size):
            ids, att, tgt = pad(enc[s:s + batch_size], tok.pad_token_id)
            pos = tgt != -100
            if not pos.any():
                continue
            logits = masked_logits(model, ids, att, pos)
            gold = tgt[pos]
            top5 = logits.topk(5, dim=-1).indices
            hit1 += int((top5[:, 0] == gold).sum())
            hit5 += int((top5 == gold[:, None]).any(-1).sum())
            hitf += int((logits.masked_fill(~allowed, -1e9).argmax(-1) == gold).sum())
            total += int(pos.sum())
    return {"masked_words": total, "top1": round(hit1 / max(total, 1), 4), "top5": round(hit5 / max(total, 1), 4),
            "top1_fill_vocabulary": round(hitf / max(total, 1), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=str(MODELS / "all-minilm-l6-v2"))
    ap.add_argument("--out", default=str(MODELS / "minilm-mlm-pdd-standin"))
    ap.add_argument("--steps", type=int, default=1200, help="total optimizer steps")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--train-layers", type=int, default=3, help="train the top N encoder layers (and the head)")
    ap.add_argument("--max-length", type=int, default=96)
    ap.add_argument("--stage-minutes", type=float, default=18.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-rows", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if (out / "standin.json").exists():
        print(json.dumps(json.loads((out / "standin.json").read_text())["recovery"]))
        return 0
    ckpt_dir = out.parent / (out.name + ".training")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.base)
    model = BertForMaskedLM.from_pretrained(args.base)
    model.tie_weights()
    assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    n_layers = model.config.num_hidden_layers
    for p in model.parameters():
        p.requires_grad = False
    trainable = [model.cls.predictions.transform, *model.bert.encoder.layer[n_layers - args.train_layers:]]
    params = [p for m in trainable for p in m.parameters()] + [model.cls.predictions.bias]
    for p in params:
        p.requires_grad = True
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    train_rows = load_rows(SHARED / "snli" / "train_sample.parquet")
    dev_rows = load_rows(SHARED / "snli" / "dev.parquet")
    dev_rows = [dev_rows[i] for i in np.random.default_rng(7).choice(len(dev_rows), args.eval_rows, replace=False)]
    state_path = ckpt_dir / "state.pt"
    info_path = ckpt_dir / "info.json"
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, rng_state, info = state["step"], state["rng"], json.loads(info_path.read_text())
        rng = np.random.default_rng()
        rng.bit_generator.state = rng_state
        print(f"resumed at step {step}", flush=True)
    else:
        step, rng = 0, np.random.default_rng(args.seed)
        info = {"settings": vars(args), "train_text": "snli/train_sample.parquet (20,000 SNLI train rows)",
                "eval_text": f"{args.eval_rows} rows of snli/dev.parquet (held out)",
                "recovery_before": recovery(model, tok, dev_rows), "stages": [], "train_seconds": 0.0}
        print("before:", info["recovery_before"], flush=True)
    start = time.time()
    losses = []
    model.train()
    while step < args.steps and time.time() - start < args.stage_minutes * 60:
        picks = rng.choice(len(train_rows), args.batch_size, replace=False)
        batch = [encode_masked(tok, prompt_parts(*train_rows[i]), rng, float(rng.choice([0.25, 0.4])),
                               args.max_length) for i in picks]
        ids, att, tgt = pad(batch, tok.pad_token_id)
        pos = tgt != -100
        if not pos.any():
            continue
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = torch.nn.functional.cross_entropy(masked_logits(model, ids, att, pos), tgt[pos])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 25 == 0:
            print(f"step {step}/{args.steps} loss {np.mean(losses[-25:]):.3f} "
                  f"({(time.time() - start) / len(losses):.2f} s/step)", flush=True)
    elapsed = time.time() - start
    info["train_seconds"] += elapsed
    info["stages"].append({"steps_to": step, "seconds": round(elapsed, 1),
                           "mean_loss_last_50": round(float(np.mean(losses[-50:])), 4) if losses else None})
    trainable_state = {k: v for k, v in model.state_dict().items()
                       if any(k.startswith(prefix) for prefix in
                              ["cls."] + [f"bert.encoder.layer.{i}." for i in range(n_layers - args.train_layers, n_layers)])}
    torch.save({"model": trainable_state, "opt": opt.state_dict(), "step": step, "rng": rng.bit_generator.state},
               state_path)
    info_path.write_text(json.dumps(info, indent=2))
    if step < args.steps:
        print(f"stage done at step {step}; rerun to continue", flush=True)
        return NOT_DONE
    info["recovery_after"] = recovery(model, tok, dev_rows)
    info["steps"] = step
    info["seconds_per_step"] = round(info["train_seconds"] / max(step, 1), 3)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info["recovery"] = info["recovery_after"]
    (out / "standin.json").write_text(json.dumps(info, indent=2))
    (out / "README.md").write_text(
        "# MiniLM masked-LM stand-in for PDD fills (debiased-nli, benchmarks/pdd_mlm_standin.py)\n\n"
        "all-MiniLM-L6-v2 + a masked-LM head tied to its word embeddings, trained on the 20k SNLI train sample in "
        "PDD's prompt format `P ? Yes/Maybe/No . H`. NOT xlm-roberta-large (the paper's MLM); a weak stand-in.\n\n"
        f"Held-out recovery (1,000 SNLI dev prompts, 25% of words masked): {json.dumps(info['recovery'])}\n")
    print(json.dumps(info["recovery"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
