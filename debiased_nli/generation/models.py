"""Loading generators: any ``AutoModelForCausalLM`` by Hub id or folder, full fine-tune or LoRA (peft).

GPT-2 family models are fine-tuned fully (the paper's setting, GPT-2 large) or with LoRA; LLaMA family
models (IBADR: LLaMA-7b) with LoRA. A trained generator folder holds either a full model or a peft
adapter (``adapter_config.json``) plus the tokenizer; :func:`load_generator` reads both, and
:func:`merge_adapter` writes a merged full model for plain ``from_pretrained`` users.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError


@dataclasses.dataclass
class LoraOptions:
    """peft LoRA settings: rank r, scaling alpha, dropout and the target modules (``all-linear`` or names)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: "str | Sequence[str]" = "all-linear"

    def to_peft(self):
        from peft import LoraConfig, TaskType
        targets = self.target_modules
        if isinstance(targets, str) and targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        return LoraConfig(task_type=TaskType.CAUSAL_LM, r=self.r, lora_alpha=self.alpha,
                          lora_dropout=self.dropout, target_modules=targets)


def is_adapter_folder(path: "str | os.PathLike") -> bool:
    return (Path(path) / "adapter_config.json").exists()


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except OSError as err:
        raise ConfigError(f"cannot load a tokenizer from {name_or_path!r} ({err}); give a Hub id (with "
                          f"internet) or a folder with tokenizer files") from err
    if tok.pad_token is None:
        # padding is masked out of every loss and generation: any existing token will do
        tok.pad_token = tok.eos_token or tok.unk_token
    if tok.pad_token is None:
        raise ConfigError(f"the tokenizer of {name_or_path!r} has no pad, eos or unk token to pad with")
    return tok


def load_generator(name_or_path: str, *, lora: LoraOptions | None = None, dtype: str | None = None,
                   tokenizer: str | None = None, trainable: bool = False):
    """(model, tokenizer) from a Hub id or folder.

    A folder with a peft adapter loads its base model (``base_model_name_or_path``) and the adapter
    (trainable when ``trainable``). ``lora`` wraps a plain model in a new LoRA adapter.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    kwargs: dict[str, Any] = {"dtype": torch_dtype} if torch_dtype is not None else {}
    if os.path.isdir(name_or_path) and is_adapter_folder(name_or_path):
        from peft import PeftModel
        base = json.loads((Path(name_or_path) / "adapter_config.json").read_text())["base_model_name_or_path"]
        model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
        model = PeftModel.from_pretrained(model, name_or_path, is_trainable=trainable)
        if lora is not None:
            raise ConfigError(f"{name_or_path} already holds a LoRA adapter; continue training it without "
                              f"--lora, or merge it first (debiased-nli train-generator --merge)")
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
        except OSError as err:
            raise ConfigError(f"cannot load a causal LM from {name_or_path!r} ({err}); give a Hub id (with "
                              f"internet) or a folder written by save_pretrained") from err
        if lora is not None:
            from peft import get_peft_model
            model = get_peft_model(model, lora.to_peft())
    tok = load_tokenizer(tokenizer or (name_or_path if _has_tokenizer(name_or_path) else _base_of(model)))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model, tok


def _has_tokenizer(path: str) -> bool:
    return not os.path.isdir(path) or any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


def _base_of(model) -> str:
    cfg = getattr(model, "peft_config", None)
    if cfg:
        return next(iter(cfg.values())).base_model_name_or_path
    return model.config._name_or_path


def count_parameters(model) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": int(total), "trainable": int(trainable)}


def save_generator(model, tokenizer, out_dir: "str | os.PathLike", *, merge: bool = False) -> str:
    """Save the adapter (LoRA) or the full model, and the tokenizer; with ``merge`` a LoRA model is
    merged into its base and saved as a full model."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if merge and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def merge_adapter(adapter_dir: str, out_dir: str) -> str:
    """Merge a saved LoRA adapter into its base model and save the full model to ``out_dir``."""
    if not is_adapter_folder(adapter_dir):
        raise ConfigError(f"{adapter_dir} has no adapter_config.json: nothing to merge")
    model, tok = load_generator(adapter_dir)
    return save_generator(model, tok, out_dir, merge=True)
