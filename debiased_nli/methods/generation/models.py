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

from ...data.tasks import TaskSpec
from ...utils.errors import ConfigError


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


def save_generator(model, tokenizer, out_dir: "str | os.PathLike", *, merge: bool = False,
                   card: "dict[str, Any] | None" = None, task: "TaskSpec | None" = None) -> str:
    """Save the adapter (LoRA) or the full model, and the tokenizer; with ``merge`` a LoRA model is
    merged into its base and saved as a full model. ``card`` (the training report) replaces the
    README.md that peft writes (its template, every field "More Information Needed") by a card that
    says what the generator is (:func:`write_generator_card`; ``task``: the task it was trained on)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter = is_adapter_model(model) and not merge
    if merge and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if card is not None:
        if task is None:
            raise ConfigError("save_generator(card=...) needs the task the generator was trained on (task=)")
        write_generator_card(out, card, task, adapter=adapter)
    return str(out)


def is_adapter_model(model) -> bool:
    return bool(getattr(model, "peft_config", None))


def _hub_id(name_or_path: str) -> str | None:
    """``name_or_path`` when it names a Hub model (``gpt2-large``, ``org/name``), None for a local folder
    (a card must not publish the builder's paths)."""
    if os.path.isdir(name_or_path) or os.path.isabs(name_or_path) or name_or_path.startswith(".") \
            or name_or_path.count("/") > 1:
        return None
    return name_or_path


def render_generator_card(report: dict[str, Any], task: TaskSpec, *, adapter: bool) -> str:
    """A model card for a generator trained by :func:`debiased_nli.methods.generation.train.train_generator`
    on ``task``: the base model, the data, the loss and its weights, the training settings and how to sample."""
    import yaml

    base = str(report.get("model") or "")
    base_id = _hub_id(base)
    mode = report.get("mode", "generator")
    name = "G* (debiased generator)" if mode == "debias" else "G (label-consistent generator)"
    where = f"`{base_id}`" if base_id else f"a local checkpoint (`{Path(base).name}`; not a Hub id)"
    lines = [
        f"# {task.name} {name}, trained with debiased-nli",
        "",
        f"A causal language model fine-tuned to write {task.name} examples as `premise, label, hypothesis` "
        f"sequences, as in Wu, Gardner, Stenetorp and Dasigi (2022). "
        + ("This folder holds a LoRA adapter (peft) for the base model; load both." if adapter
           else "This folder holds the full model."),
        "",
        *_card_model(report, where, adapter=adapter),
        *_card_data_and_training(report, task),
        *_card_how_to_sample(task, adapter=adapter),
        *_GENERATOR_CARD_END,
    ]
    meta = _card_metadata(task, base_id, adapter=adapter)
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + "\n".join(lines)


def _card_metadata(task: TaskSpec, base_id: str | None, *, adapter: bool) -> dict[str, Any]:
    """The card's YAML: base model, library, pipeline, tags, datasets."""
    meta: dict[str, Any] = {}
    if base_id:
        meta["base_model"] = base_id
    meta["library_name"] = "peft" if adapter else "transformers"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ["debiased-nli", "nli-generator", "unlikelihood"] + (["lora"] if adapter else [])
    if task.hub:
        meta["datasets"] = [task.hub.path]
    return meta


def _card_loss(report: dict[str, Any]) -> str:
    """The objective of the report's mode, with its weight."""
    if report.get("mode", "generator") == "debias":
        return (f"L = MLE on Z(D0) + alpha · L_UL on Z-(D0), alpha = {report.get('alpha')}: likelihood on the rows "
                f"z-filtering kept, and unlikelihood only on the tokens that carry a rejected row's biased features "
                f"(Wu et al. 2022, Section 4.1)")
    return (f"L = MLE + lambda · L_LC, lambda = {report.get('lambda')}: maximum likelihood of `premise, label, "
            f"hypothesis` plus the token-level unlikelihood of the hypothesis under a wrong label "
            f"(Wu et al. 2022, Section 2.2)")


def _card_model(report: dict[str, Any], where: str, *, adapter: bool) -> list[str]:
    """## Model: the base model, the LoRA settings, the parameter counts."""
    lines = ["## Model", "", f"- Base model: {where}."]
    lora = report.get("lora")
    if adapter and lora:
        lines.append(f"- LoRA: r = {lora.get('r')}, alpha = {lora.get('alpha')}, dropout = {lora.get('dropout')}, "
                     f"target modules: {lora.get('target_modules')}.")
    params = report.get("parameters") or {}
    if params:
        lines.append(f"- Parameters: {params.get('total', 0):,} in all, {params.get('trainable', 0):,} trained.")
    return lines


def _card_data_and_training(report: dict[str, Any], task: TaskSpec) -> list[str]:
    """## Training data (task, rows, z-filtering counts) and ## Training (loss, steps, settings)."""
    zinfo = report.get("z_filter")
    return [
        "",
        "## Training data",
        "",
        f"- Task: {task.name} ({task.description}); labels {', '.join(task.labels)}.",
        f"- Rows: {report.get('rows', 0):,}"
        + (f" (z-filtering: {', '.join(f'{k} {v:,}' if isinstance(v, int) else f'{k} {v}' for k, v in zinfo.items())})"
           if zinfo else "") + ".",
        "",
        "## Training",
        "",
        f"- Loss: {_card_loss(report)}.",
        f"- Steps: {report.get('steps')} optimizer steps of {report.get('batch_size')} rows per process x "
        f"{report.get('grad_accum')} accumulation x {report.get('processes')} process(es); learning rate "
        f"{report.get('lr')}; sequences cut at {report.get('max_length')} tokens; seed {report.get('seed')}; "
        f"mixed precision {report.get('mixed_precision')}; {report.get('seconds')} s.",
        "- The full training report (loss history included) is `train_report.json` in this folder.",
        "",
    ]


def _card_how_to_sample(task: TaskSpec, *, adapter: bool) -> list[str]:
    """## How to sample: the generate command and the Python loader."""
    return [
        "## How to sample",
        "",
        "```bash",
        f"debiased-nli generate {task.name} --generator <this folder or repo> --num-samples 1000 "
        f"--out samples/ --top-p 0.9",
        "```",
        "",
        "writes parsed `premise, hypothesis, label` rows (unparseable samples are kept apart). Then keep the "
        "rows a classifier is confident of (`debiased-nli confidence-filter`) and compose a release with "
        "`debiased-nli build ... --new-rows samples/*.parquet`. In Python:",
        "",
        "```python",
        "from debiased_nli.methods.generation.models import load_generator",
        'model, tokenizer = load_generator("<this folder or repo>")'
        + ("   # loads the base model and this adapter" if adapter else ""),
        "```",
        "",
    ]


# the card's last sections, the same for every generator
_GENERATOR_CARD_END = (
    "## Limitations",
    "",
    "Generated rows can be ungrammatical, contradict their label, or repeat the biases of the base model "
    "and of the training data; the debiasing pipeline filters them (confidence filter, z-filtering) but no "
    "person checks them.",
    "",
    "## Citation",
    "",
    "```bibtex",
    "@inproceedings{wu-etal-2022-generating,",
    "  title = {Generating Data to Mitigate Spurious Correlations in Natural Language Inference Datasets},",
    "  author = {Wu, Yuxiang and Gardner, Matt and Stenetorp, Pontus and Dasigi, Pradeep},",
    "  booktitle = {Proceedings of the 60th Annual Meeting of the Association for Computational Linguistics "
    "(Volume 1: Long Papers)},",
    "  pages = {2660--2676},",
    "  year = {2022},",
    "  url = {https://aclanthology.org/2022.acl-long.190}",
    "}",
    "```",
    "",
)


def write_generator_card(out_dir: "str | os.PathLike", report: dict[str, Any], task: TaskSpec, *,
                         adapter: bool) -> Path:
    path = Path(out_dir) / "README.md"
    path.write_text(render_generator_card(report, task, adapter=adapter))
    return path


def merge_adapter(adapter_dir: str, out_dir: str) -> str:
    """Merge a saved LoRA adapter into its base model and save the full model to ``out_dir``."""
    if not is_adapter_folder(adapter_dir):
        raise ConfigError(f"{adapter_dir} has no adapter_config.json: nothing to merge")
    model, tok = load_generator(adapter_dir)
    return save_generator(model, tok, out_dir, merge=True)
