"""Generating debiased rows (Wu et al. 2022, "Generating Data to Mitigate Spurious Correlations in NLI
Datasets", ACL; the LLaMA + LoRA family as in IBADR, Wang et al. 2023).

Pipeline (each piece a module, each a builder step in :mod:`.steps`):

1. ``format``  -- rows as ``premise, label, hypothesis`` sequences with an end marker, parsed back.
2. ``losses``  -- MLE, label-consistency unlikelihood (lambda), the debiasing L_UL (alpha).
3. ``models``  -- any causal LM by Hub id or folder, full fine-tune or LoRA (peft), save / merge.
4. ``train``   -- G (MLE + lambda L_LC) and G* (MLE on Z(D0) + alpha L_UL on Z-(D0)) under accelerate,
                  with checkpoints and resume.
5. ``sample``  -- sharded, resumable sampling (one Parquet file per shard, rejects kept).
6. :mod:`debiased_nli.methods.confidence` -- confidence filtering with an NLI model M (tau).

``PAPER_DEFAULTS`` are the paper's settings for the ``snli`` / ``mnli`` builder recipes: train G,
fine-tune G*, sample, confidence-filter, then z-filter into Z-Aug / Par-Z / Seq-Z.
``GENERATOR_TRAINING`` and ``SAMPLING`` hold every value the generator's training and sampling use
by default, each with its source: the paper's words (table or section) or "project's choice".
Table numbers are those of the ACL version (``shared/papers/wu2022_generating_data_acl.txt``); its
appendix tables are garbled in the text extraction and were read in the submission version, where
Table 7 is Table 6 and Table 8 is Table 7.
"""
from __future__ import annotations

from typing import Any, Mapping

WU = "Wu et al. 2022"
PROJECT = "project's choice"

PAPER_DEFAULTS = {
    "generator": "gpt2-large",          # Sec. 5.1: "We choose GPT-2 large and Roberta-large as the pretrained
                                        # language models for G* and M"; Table 7 "pretrained model GPT-2 large"
    "generator_llama": "huggyllama/llama-7b",  # not Wu et al.: IBADR's (Wang et al. 2023) LLaMA-7b, with LoRA
    "lambda": 0.5,                       # Table 7: "λ 0.5" (label-consistency unlikelihood weight)
    "alpha": 1.0,                        # Table 7: "α 1.0" (weight of L_UL on Z-(D0))
    "top_p": 1.0,                        # Sec. 2.1: "We can randomly sample from the trained generator": plain
                                         # sampling (top-p 1.0); no nucleus mass is given in the paper
    "num_samples": {"snli": 5_000_000, "mnli": 4_000_000},  # Table 8: "number of samples from G*SNLI
                                                            # 5,000,000", "... G*MNLI 4,000,000"
    "confidence_model": "roberta-large",  # Table 8: "data filtering model Roberta-large"
    "tau": 0.95,                         # Table 8: "data filtering threshold τ 0.95"
    "z_top_k": 20,                       # Table 8: "z-filtering number of biased features 20"
    "order": "premise, label, hypothesis",  # Sec. 2.1 (the sequence the generator is trained on)
}

# Training G and G* (both: the table gives one set, captioned G*, with G's λ in it).
# name -> (value, source); the source quotes the paper or says it is the project's choice.
GENERATOR_TRAINING: dict[str, tuple[Any, str]] = {
    "lr": (1e-5, f'{WU}, Table 7: "learning rate 1e-5"'),
    "batch_size": (24, f'{WU}, Table 7: "batch size 24"'),
    "epochs": (5, f'{WU}, Table 7: "epoch 5"'),
    "eps": (1e-6, f'{WU}, Table 7: "Adam ϵ 1e-6"'),
    "betas": ((0.9, 0.999), f'{WU}, Table 7: "Adam (β1, β2) (0.9, 0.999)"'),
    "scheduler": ("constant", f'{WU}, Table 7: "learning rate scheduler constant"'),
    "warmup_steps": (0, f'{WU}, Table 7: a "constant" schedule has no warm-up'),
    "weight_decay": (0.0, f'{WU}, Table 7: "optimiser Adam" (no weight decay; AdamW with 0 is Adam)'),
    "max_length": (128, f'{WU}, Table 7: "max sequence length 128"'),
    "lam": (0.5, f'{WU}, Table 7: "λ 0.5"'),
    "alpha": (1.0, f'{WU}, Table 7: "α 1.0"'),
    "model": ("gpt2-large", f'{WU}, Table 7: "pretrained model GPT-2 large"'),
    "grad_accum": (1, f"{PROJECT}: the paper's batch of 24 is the batch per optimizer step"),
    "top_k": (20, f'{WU}, Table 8: "z-filtering number of biased features 20" (G*: Z(D0) and Z-(D0))'),
    "z_batch_size": (1000, f"{PROJECT}: Algorithm 1's batch size is not given in the paper"),
    "checkpoint_every": (500, f"{PROJECT}"),
    "group_by_length": (False, f"{PROJECT}: off, so the batches are the plain shuffle's; on, rows of similar length "
                               f"share a batch and less padding is computed (the paper says nothing of batching)"),
    "seed": (0, f"{PROJECT}"),
    "mixed_precision": (None, f"{PROJECT}: accelerate's setting (accelerate launch/config), else none; "
                              f'the paper gives only "device Nvidia A100"'),
}

SAMPLING: dict[str, tuple[Any, str]] = {
    "top_p": (1.0, f'{WU}, Sec. 2.1: "We can randomly sample from the trained generator" (plain sampling; '
                   f"no top-p, top-k or temperature is given)"),
    "temperature": (1.0, f'{WU}, Sec. 2.1: "randomly sample" (temperature 1)'),
    "max_new_tokens": (128, f"{PROJECT}: covers the training length (Table 7: \"max sequence length 128\"), so "
                            f"no row the generator learned is cut and rejected"),
    "num_samples": (None, f'{WU}, Table 8: "number of samples from G*SNLI 5,000,000", "G*MNLI 4,000,000"'),
    "batch_size": (16, PROJECT),
    "shard_size": (1000, PROJECT),
    "seed": (0, PROJECT),
}


def paper_value(table: Mapping[str, tuple[Any, str]], name: str) -> Any:
    return table[name][0]


def resolve(table: Mapping[str, tuple[Any, str]], given: Mapping[str, Any]) -> tuple[dict, dict]:
    """The values to use (``given`` where set, else the table's) and, for each, where it came from."""
    values, sources = {}, {}
    for name, (default, source) in table.items():
        value = given.get(name)
        if isinstance(default, tuple) and value is not None:
            value = tuple(value)  # YAML and JSON give lists
        if value is None or value == default:
            values[name] = default if value is None else value
            sources[name] = source
        else:
            values[name] = value
            sources[name] = f"given (the default is {default!r}: {source})"
    return values, sources


__all__ = ["PAPER_DEFAULTS", "GENERATOR_TRAINING", "SAMPLING", "resolve", "print_values", "paper_value"]
