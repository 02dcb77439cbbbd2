"""The parameters of the generation pipeline, declared once (Wu et al. 2022, ``papers/wu2022_generating_data_acl.txt``): the
recipe steps, the commands' options and the reports' "source" of every value read them from here. Each value
quotes the paper (table or section) or says it is the project's choice. Table numbers are those of the ACL version; its
appendix tables are garbled in the text extraction and were read in the submission version, where Table 7 is
Table 6 and Table 8 is Table 7.
"""
from __future__ import annotations

from typing import Any, Mapping

from ...utils.params import Param, Params

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


TRAIN_M_PARAMS = Params("train_m", [
    Param("out", "str", None, "M's folder (checkpoints, the best model, debiased_nli_train.json)", required=True),
    Param("model", "str", None, "the classifier to fine-tune: a Hub id or folder", required=True),
    Param("dev_files", "str_list", None, "dev rows (the task's columns) on which the best epoch is chosen"),
    Param("lr", "float", None, "learning rate (default: `debiased-nli train`'s)", low=0, low_open=True),
    Param("batch_size", "int", None, "batch size (default: `debiased-nli train`'s)", low=1),
    Param("max_length", "int", None, "tokens of a pair (default: `debiased-nli train`'s)", low=1),
    Param("epochs", "float", None, "epochs (default: `debiased-nli train`'s)", low=0, low_open=True),
    Param("seed", "seed", 42, "training seed (`debiased-nli train`'s default)"),
    Param("cpu", "bool", False, "train on the CPU even when a GPU is visible"),
    Param("threads", "int", None, "torch CPU threads", low=1),
    Param("progress", "bool", True, "show progress bars"),
    Param("source", "any", None, "where D0 came from (load_task's source), for M's card", cli=None),
])
"""M's training in a generator step (``train_m:``): the values of ``debiased-nli train`` that M needs. The paper
gives none for M (Table 8 names the model only: "data filtering model Roberta-large")."""
