"""Fine-tune a sentence-pair classifier on a task or a release, optionally with a product of experts.

Any ``AutoModelForSequenceClassification`` (a Hub id or a folder; an encoder without a classification
head, such as all-MiniLM-L6-v2, gets a fresh one) is trained with the ``transformers`` ``Trainer``,
which runs on ``accelerate``: ``accelerate launch --multi_gpu --num_processes N -m debiased_nli.cli
train ...`` trains data-parallel on N GPUs, and on a machine without GPUs the same command runs N CPU
processes (gloo): with no accelerator visible ``TrainingArguments(use_cpu=True)`` makes the Trainer's
``Accelerator(cpu=True)``, which is what lets several CPU processes form a group. (``accelerate launch
--cpu`` itself starts a single process unless an MPI launcher is configured.) Training is seeded
(``transformers.set_seed``), checkpoints are written every evaluation, and a rerun of the same command
resumes from the last checkpoint.

**Hyper-parameters.** ``TRAIN_PRESETS["paper"]`` (``train --preset paper``) is Table 9 of Wu et al.
(2022), "Hyperparameters for training the NLI models": learning rate 1e-5, batch 32, 5 epochs, Adam
eps 1e-6, betas (0.9, 0.999), "constant with warmup" over 2,000 steps, length 128, early stopping
patience 3 epochs (each value quoted in :data:`TRAIN_PRESETS`). The plain defaults (:class:`TrainConfig`)
are the project's choice for small data: the paper's lr 1e-5, batch 32, length 128 and patience 3,
but 3 epochs, a linear schedule warming up over 10% of the steps and weight decay 0.01 (2,000 warm-up
steps exceed a whole run on the 20k-row samples this project is measured on).

**Product of experts** (Clark et al. 2019; Karimi Mahabadi et al. 2020; Wu et al. 2022, appendix
A.2). With the main model's distribution ``p = softmax(f(x))`` and a hypothesis-only bias model's
distribution ``b``, training minimises

    L = CE(softmax(log p + beta * log b), y) + gamma * CE(b, y)

and at test time only ``p`` is used. Three bias models:

* ``joint`` (the paper's): a hypothesis-only head trained together with the main model. Wu et al.
  "adapt the PoE implementation by Karimi Mahabadi et al. (2020)", whose bias-only model is a
  classifier on the *same* encoder run on the hypothesis alone, with the encoder's gradient from that
  path multiplied by 0 (``grad_mul_const(pooled_h, 0.0)``): the head learns from ``gamma * CE(b, y)``
  and from the ensemble term, the encoder only from the ensemble term. Here: the model's base encoder
  on the hypothesis (no gradient), its pooled output (or first token when it has no pooler), dropout,
  and a linear head (Wu et al.'s script's default, ``nonlinear_h_classifier=None``). Only ``p`` is saved.
* ``tfidf``: the out-of-fold TF-IDF + logistic-regression hypothesis-only predictions of
  :func:`debiased_nli.bias.task_features.add_features`, fixed.
* a folder: a trained hypothesis-only classifier, fixed.

With a fixed bias model ``gamma * CE(b, y)`` is a constant: it is computed and logged but changes no
gradient, so ``gamma`` only matters for ``joint`` (a warning says so). ``POE_PRESETS`` are Table 10's
beta and gamma, "the best hyperparameters found for each evaluation dataset".
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..data.tasks import TaskSpec, get_task
from ..utils.errors import ConfigError, EmptyResultError

logger = logging.getLogger(__name__)

BIAS_COLUMN = "bias_log_probs"
HYPOTHESIS_INPUTS = ("h_input_ids", "h_attention_mask")  # the hypothesis alone, for the joint bias head
TRAIN_CONFIG_FILE = "debiased_nli_train.json"


WU = "Wu et al. 2022"
PROJECT = "project's choice"

# `train --preset paper`: Wu et al. (2022), appendix A.1, Table 9 "Hyperparameters for training the NLI
# models" (Table 8 of the submission). field -> (value, the paper's words).
TRAIN_PRESETS: dict[str, dict[str, tuple[Any, str]]] = {
    "paper": {
        "learning_rate": (1e-5, f'{WU}, Table 9: "learning rate 1e-5"'),
        "batch_size": (32, f'{WU}, Table 9: "batch size 32"'),
        "epochs": (5.0, f'{WU}, Table 9: "epoch 5"'),
        "adam_epsilon": (1e-6, f'{WU}, Table 9: "Adam ϵ 1e-6"'),
        "adam_betas": ((0.9, 0.999), f'{WU}, Table 9: "Adam (β1, β2) (0.9, 0.999)"'),
        "lr_scheduler": ("constant_with_warmup", f'{WU}, Table 9: "learning rate scheduler constant with warmup"'),
        "warmup_steps": (2000, f'{WU}, Table 9: "warm up steps 2000"'),
        "weight_decay": (0.0, f'{WU}, Table 9: "optimiser Adam" (no weight decay; AdamW with 0 is Adam)'),
        "max_length": (128, f'{WU}, Table 9: "max sequence length 128"'),
        "early_stopping_patience": (3, f'{WU}, Table 9: "early stop patience 3 epochs" (one evaluation per epoch)'),
        "eval_steps": (None, f'{WU}, Table 9: patience in epochs, so evaluate once per epoch'),
    },
}
# the model itself is the user's: Table 9 says "pretrained model BERT-base" (`--model bert-base-uncased`)
PAPER_NLI_MODEL = "bert-base-uncased"

# Table 10 of Wu et al. (2022), "Best hyperparameters found for PoE models with different training and
# evaluation datasets" (read from the ACL text, whose extraction lists the table column by column:
# "SNLI SNLI-hard 2.0 0.4", "Seq-Z SNLI SNLI-hard 2.0 0.4", "MNLI MNLI-m hard MNLI-mm hard HANS 0.8 2.0
# 2.0 1.0 0.4 0.8", "Z-Aug MNLI MNLI-m hard MNLI-mm hard HANS 2.0 2.0 2.0 0.4 0.8 1.0"), found by grid
# search "β ∈ {0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 2.0} and γ ∈ {0.05, 0.1, 0.2, 0.4, 0.8, 1.0}" (A.2).
# name -> (beta, gamma, training data, evaluation data)
POE_PRESETS: dict[str, tuple[float, float, str, str]] = {
    "snli": (2.0, 0.4, "SNLI", "SNLI-hard"),
    "seq-z-snli": (2.0, 0.4, "Seq-Z SNLI", "SNLI-hard"),
    "mnli-m-hard": (0.8, 1.0, "MNLI", "MNLI-m hard"),
    "mnli-mm-hard": (2.0, 0.4, "MNLI", "MNLI-mm hard"),
    "mnli-hans": (2.0, 0.8, "MNLI", "HANS"),
    "z-aug-mnli-m-hard": (2.0, 0.4, "Z-Aug MNLI", "MNLI-m hard"),
    "z-aug-mnli-mm-hard": (2.0, 0.8, "Z-Aug MNLI", "MNLI-mm hard"),
    "z-aug-mnli-hans": (2.0, 1.0, "Z-Aug MNLI", "HANS"),
}
FROZEN_BIAS_MODELS = ("tfidf",)  # and any classifier folder; "joint" is trained


def poe_preset(name: str) -> tuple[float, float, str]:
    """(beta, gamma, source) of a Table 10 preset."""
    if name not in POE_PRESETS:
        import difflib
        close = difflib.get_close_matches(name, list(POE_PRESETS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"no PoE preset {name!r}; the presets (Wu et al. 2022, Table 10) are "
                          f"{sorted(POE_PRESETS)}.{hint}")
    beta, gamma, train, ev = POE_PRESETS[name]
    return beta, gamma, f'{WU}, Table 10: train "{train}", eval "{ev}": "β {beta}", "γ {gamma}"'


@dataclasses.dataclass
class TrainConfig:
    """Hyper-parameters of :func:`train_classifier`. The defaults are the project's choice (module
    docstring); :func:`paper_config` gives Table 9's."""

    model: str
    output_dir: str
    learning_rate: float = 1e-5      # Table 9: "learning rate 1e-5"
    batch_size: int = 32             # Table 9: "batch size 32"
    eval_batch_size: int = 128
    max_length: int = 128            # Table 9: "max sequence length 128"
    epochs: float = 3.0              # project's choice (Table 9: 5)
    warmup_ratio: float = 0.1        # project's choice: linear warm-up over 10% of the steps
    warmup_steps: int | None = None  # a number of warm-up steps instead of warmup_ratio (Table 9: 2000)
    lr_scheduler: str = "linear"     # project's choice (Table 9: "constant with warmup")
    adam_epsilon: float = 1e-8       # transformers' default (Table 9: 1e-6)
    adam_betas: tuple[float, float] = (0.9, 0.999)  # Table 9: "(0.9, 0.999)"
    weight_decay: float = 0.01       # project's choice (Table 9: "Adam", none)
    seed: int = 42
    data_seed: int = 0               # which rows --max-train-rows keeps (same subset for every seed)
    max_train_rows: int | None = None
    max_dev_rows: int | None = None
    eval_steps: int | None = None    # None: evaluate (and checkpoint) once per epoch
    early_stopping_patience: int = 3
    save_total_limit: int = 2
    poe: bool = False
    poe_beta: float = 1.0
    poe_gamma: float = 1.0
    bias_model: str = "tfidf"        # "joint" (trained head, the paper's), "tfidf" (out-of-fold) or a folder
    group_by_length: bool = True     # batches of similar length: less padding, same examples
    resume: bool = True
    use_cpu: bool | None = None      # None: CPU when no accelerator is visible
    num_threads: int | None = None
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def paper_config(model: str, output_dir: str, preset: str = "paper", **overrides) -> tuple[TrainConfig, dict]:
    """A :class:`TrainConfig` with a preset's values (``overrides`` win) and the source of each value."""
    if preset not in TRAIN_PRESETS:
        raise ConfigError(f"no training preset {preset!r}; the presets are {sorted(TRAIN_PRESETS)}")
    values = {k: v for k, (v, _) in TRAIN_PRESETS[preset].items()}
    sources = {k: src for k, (_, src) in TRAIN_PRESETS[preset].items()}
    for k, v in overrides.items():
        if k in sources and v != values[k]:
            sources[k] = f"given (the preset's is {values[k]!r}: {sources[k]})"
        values[k] = v
    return TrainConfig(model=model, output_dir=output_dir, **values), sources


def describe_config(cfg: TrainConfig, sources: dict | None = None) -> dict[str, str]:
    """The source of every hyper-parameter of ``cfg``: ``sources`` where given, else the defaults' comments."""
    defaults = {
        "learning_rate": f'{WU}, Table 9: "learning rate 1e-5"', "batch_size": f'{WU}, Table 9: "batch size 32"',
        "max_length": f'{WU}, Table 9: "max sequence length 128"',
        "adam_betas": f'{WU}, Table 9: "Adam (β1, β2) (0.9, 0.999)"',
        "early_stopping_patience": f'{WU}, Table 9: "early stop patience 3 epochs"',
        "epochs": f"{PROJECT} (Table 9: 5; --preset paper)",
        "warmup_ratio": f"{PROJECT}: 10% of the steps (Table 9: 2000 steps; --preset paper)",
        "lr_scheduler": f'{PROJECT} (Table 9: "constant with warmup"; --preset paper)',
        "adam_epsilon": "transformers' default (Table 9: 1e-6; --preset paper)",
        "weight_decay": f'{PROJECT} (Table 9: "Adam", none; --preset paper)',
    }
    out = {}
    base = TrainConfig(model=cfg.model, output_dir=cfg.output_dir)
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("model", "output_dir", "progress", "num_threads", "use_cpu", "resume"):
            continue
        value = getattr(cfg, f.name)
        if sources and f.name in sources:
            out[f.name] = sources[f.name]
        elif value == getattr(base, f.name):
            out[f.name] = defaults.get(f.name, PROJECT)
        else:
            out[f.name] = "given"
    return out


HYPER_PARAMETERS = ("learning_rate", "batch_size", "max_length", "epochs", "warmup_ratio", "warmup_steps",
                    "lr_scheduler", "adam_epsilon", "weight_decay", "eval_steps", "early_stopping_patience")


def resolve_config(model: str, output_dir: str, *, preset: str | None = None, given: "dict[str, Any] | None" = None,
                   poe: bool = False, poe_preset_name: str | None = None, poe_beta: float | None = None,
                   poe_gamma: float | None = None, bias_model: str | None = None, **common) -> tuple[TrainConfig, dict]:
    """The :class:`TrainConfig` of a run (``preset``'s values, then the ``given`` hyper-parameters of
    :data:`HYPER_PARAMETERS` that are not None; ``common``: the other fields) and the source of each value. A PoE
    preset (``poe_preset_name``, Table 10: :func:`poe_preset`) sets beta, gamma and the joint bias model, each
    overridden by an explicit value."""
    unknown = set(given or {}) - set(HYPER_PARAMETERS)
    if unknown:
        raise ConfigError(f"unknown hyper-parameter(s) {sorted(unknown)}; the hyper-parameters are {list(HYPER_PARAMETERS)}")
    given = {k: v for k, v in (given or {}).items() if v is not None}
    if preset:
        cfg, sources = paper_config(model, output_dir, preset, **given, **common)
    else:
        cfg, sources = TrainConfig(model=model, output_dir=output_dir, **given, **common), None
    extra: dict[str, Any] = {"poe": bool(poe or poe_preset_name)}
    poe_sources: dict[str, str] = {}
    if poe_preset_name:
        beta, gamma, src = poe_preset(poe_preset_name)
        extra.update(poe_beta=beta, poe_gamma=gamma, bias_model="joint")
        poe_sources = {"poe_beta": src, "poe_gamma": src,
                       "bias_model": f'{WU}, A.2: "We adapt the PoE implementation by Karimi Mahabadi et al. (2020)", '
                                     f'whose bias-only head is trained jointly'}
    for key, value in (("poe_beta", poe_beta), ("poe_gamma", poe_gamma), ("bias_model", bias_model)):
        if value is not None:
            extra[key] = value
            poe_sources[key] = "given"
    cfg = dataclasses.replace(cfg, **extra)
    sources = {**describe_config(cfg, sources), **poe_sources}
    if not cfg.poe:
        for key in ("poe_beta", "poe_gamma", "bias_model"):
            sources.pop(key, None)
    return cfg, sources


# ----------------------------------------------------------------------------------------------- PoE

def poe_loss(main_logits, bias_log_probs, labels, beta: float = 1.0, gamma: float = 1.0,
             return_parts: bool = False):
    """Product-of-experts loss (Wu et al. 2022, appendix A.2).

    ``L = CE(softmax(log_softmax(main_logits) + beta * bias_log_probs), y) + gamma * CE(b, y)``,
    averaged over the batch. ``bias_log_probs`` are the bias model's log-probabilities ``log b``.
    """
    import torch.nn.functional as F

    log_p = F.log_softmax(main_logits.float(), dim=-1)
    combined = log_p + beta * bias_log_probs.float()
    ensemble = F.cross_entropy(combined, labels)  # cross_entropy re-normalises: softmax(log p + beta log b)
    bias_ce = F.nll_loss(bias_log_probs.float(), labels)
    loss = ensemble + gamma * bias_ce
    return (loss, ensemble, bias_ce) if return_parts else loss


# ------------------------------------------------------------------------------------------- data

def _local_release_files(release: str, config: str | None, split: str) -> list[str] | None:
    """The parquet files of ``config``'s ``split`` in a local release folder, from its card's ``configs:``; None
    for a Hub repo, or where the card does not list them (``load_dataset`` then reads the folder and says why not)."""
    import glob
    from pathlib import Path

    readme = Path(release) / "README.md"
    if not readme.is_file():
        return None
    from huggingface_hub import DatasetCard

    configs = DatasetCard.load(readme).data.to_dict().get("configs") or []
    entry = next((c for c in configs if c.get("config_name") == (config or "default")), None)
    if entry is None:
        return None
    patterns = [d["path"] for d in entry.get("data_files") or [] if isinstance(d, dict) and d.get("split") == split]
    patterns = [p for item in patterns for p in ([item] if isinstance(item, str) else item)]
    files = sorted(f for p in patterns for f in glob.glob(str(Path(release) / p)))
    return files if files and all(f.endswith(".parquet") for f in files) else None


def load_training_split(task: TaskSpec, *, data_files=None, release: str | None = None, config: str | None = None,
                        split: str = "train", on_invalid: str = "error", revision: str | None = None,
                        with_source: bool = False):
    """The canonical rows of one split: from ``data_files`` (or the task's Hub source at ``revision``) through
    :func:`debiased_nli.data.loading.load_task`, or from a release folder/repo with ``load_dataset(release, config)``
    (a Hub release at ``revision``). ``with_source``: ``(rows, where they came from)``, the second as
    :func:`training_source` describes it (what a model card says the model was trained on)."""
    import datasets

    from ..data.loading import canonicalize, load_task

    if release is None:
        loaded = load_task(task, split, data_files=data_files, on_invalid=on_invalid, revision=revision)
        return (loaded.dataset, training_source(inputs=loaded.source["inputs"], split=split)) if with_source \
            else loaded.dataset
    try:
        raw = _release_split(Path(release), config, split)
        if raw is None:  # no manifest's file list: a folder's card-listed parquet files, else as `datasets` reads it
            files = _local_release_files(release, config, split)
            # a local folder's files are read as parquet files: datasets' folder loader keys its cache on the folder's
            # name and configs, not on the files, and serves the old rows after a release is rebuilt in place
            raw = (datasets.load_dataset("parquet", data_files={split: files}, split=split) if files
                   else datasets.load_dataset(release, config, split=split, revision=revision))
    except ConfigError:
        raise
    except ValueError as err:  # unknown config / split: datasets lists the available ones
        raise ConfigError(f"cannot load split {split!r} of config {config!r} from {release}: {err}") from err
    except Exception as err:  # a missing, unreachable or corrupt release: one line, naming it
        from ..data.loading import root_cause
        raise ConfigError(f"cannot load split {split!r} of config {config!r} from {release}: "
                          f"{root_cause(err)}") from err
    if all(c in raw.column_names for c in ("uid", "origin", "method")) and isinstance(
            raw.features.get("label"), datasets.ClassLabel) and list(raw.features["label"].names) == list(task.labels):
        ds = raw
    else:
        ds, _ = canonicalize(raw, task, split=split, columns={"premise": "premise", "hypothesis": "hypothesis",
                                                              "label": "label"}, on_invalid=on_invalid, where=release)
    return (ds, training_source(release=release, config=config, split=split, revision=revision)) if with_source \
        else ds


def training_source(*, inputs: Sequence[dict] = (), release: str | None = None, config: str | None = None,
                    split: str = "train", revision: str | None = None) -> dict[str, Any]:
    """Where a model's rows came from, as its card and ``debiased_nli_train.json`` record it (no local path):

    * a release folder: ``{"type": "release", "release": its folder name, "config", "split", "repo_id"`` (the Hub
      repo its manifest names, None for the recipe's placeholder) ``, "release_version", "version"`` (the last of its
      history) ``, "manifest_sha256"}``;
    * a Hub release: ``{"type": "hub_release", "repo_id", "config", "split", "revision"}``;
    * files or the task's Hub dataset (``inputs``: :func:`~debiased_nli.data.loading.load_task`'s sources):
      ``{"type": "files", "files": [{"file", "bytes", "sha256"}]}`` or ``{"type": "hub", "path", "name", "split",
      "revision"}``."""
    if release is not None:
        folder = Path(release)
        if folder.is_dir():
            from ..utils.outputs import json_of
            from ..utils.provenance import file_sha256

            manifest = json_of(folder / "manifest.json")
            manifest = manifest if isinstance(manifest, dict) else {}
            repo_id = manifest.get("repo_id") if isinstance(manifest.get("repo_id"), str) else None
            history = [h for h in manifest.get("history") or [] if isinstance(h, dict) and "version" in h]
            recipe = manifest.get("recipe") if isinstance(manifest.get("recipe"), dict) else {}
            return {"type": "release", "release": folder.resolve().name, "config": config, "split": split,
                    "repo_id": None if repo_id is None or repo_id.startswith("<") else repo_id,
                    "release_version": recipe.get("release_version"),
                    "version": str(history[-1]["version"]) if history else None,
                    "manifest_sha256": file_sha256(folder / "manifest.json") if (folder / "manifest.json").is_file()
                    else None}
        return {"type": "hub_release", "repo_id": release, "config": config, "split": split, "revision": revision}
    hub = [i for i in inputs if i.get("type") == "hub"]
    if hub:
        h = hub[0]
        return {"type": "hub", "path": h.get("path"), "name": h.get("name"), "split": h.get("split"),
                "revision": h.get("revision")}
    return {"type": "files", "split": split,
            "files": [{"file": Path(i["path"]).name, "bytes": i.get("bytes"), "sha256": i.get("sha256")}
                      for i in inputs if i.get("type") == "file"]}


def _release_split(folder: Path, config: str | None, split: str):
    """The rows of ``config``/``split`` of a local release folder, read from the files its manifest lists, each a
    regular file inside the folder with the manifest's sha256 (:func:`~debiased_nli.utils.paths.release_file`), or
    None where there is no such list (a Hub repo id, a folder without ``manifest.json`` or without its ``files``)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..utils.paths import read_json, release_file

    if not folder.is_dir() or not (folder / "manifest.json").exists():
        return None
    manifest = read_json(folder / "manifest.json", "the release's manifest", kind=dict)
    files = manifest.get("files")
    if not isinstance(files, dict):
        return None
    if config not in files or not isinstance(files[config], dict):
        raise ConfigError(f"cannot load split {split!r} of config {config!r} from {folder}: the release has the "
                          f"configs {sorted(map(str, files))}")
    entries = files[config].get(split)
    if not isinstance(entries, list) or not entries or not all(isinstance(f, dict) for f in entries):
        raise ConfigError(f"cannot load split {split!r} of config {config!r} from {folder}: its manifest lists no "
                          f"files for it (splits: {sorted(map(str, files[config]))})")
    tables = []
    for f in entries:
        path = release_file(folder, f.get("path"), sha256=f.get("sha256"), what=f"release file of {config}/{split}")
        try:
            tables.append(pq.read_table(str(path)))
        except Exception as err:  # ArrowInvalid, OSError: a file the manifest records no sha256 of, damaged
            raise ConfigError(f"cannot load split {split!r} of config {config!r} from {folder}: {path} is not "
                              f"readable Parquet ({type(err).__name__})") from None
    return datasets.Dataset(pa.concat_tables(tables))


def subsample(ds, n: int | None, seed: int):
    """A seeded random subset of ``n`` rows (the same rows for every training seed)."""
    if n is None or n >= len(ds):
        return ds
    return ds.shuffle(seed=seed).select(range(n))


def model_label_order(model, task: TaskSpec, name: str) -> list[int]:
    """For each task label, the model head's output index (by ``config.id2label`` names)."""
    from .labels import map_model_labels

    id2label = {int(i): str(l) for i, l in (model.config.id2label or {}).items()}
    return map_model_labels(id2label, task.labels, name)


def load_model_for_task(model_name: str, task: TaskSpec):
    """Tokenizer + classifier whose ``config.id2label`` names the task's labels.

    An encoder without a head (or with a generic ``LABEL_i`` head of the right size) gets the task's
    names; a head with other names is kept only if its names are the task's (in any order).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    try:
        cfg = AutoConfig.from_pretrained(model_name)
    except Exception as err:  # a missing, unreachable or corrupt model folder: one line, naming it
        from ..data.loading import root_cause
        raise ConfigError(f"--model {model_name}: cannot load its config ({root_cause(err)})") from err
    names = [str(v) for _, v in sorted((int(k), v) for k, v in (cfg.id2label or {}).items())]
    generic = all(n.upper().startswith("LABEL_") for n in names)
    has_head = any(a.endswith("ForSequenceClassification") for a in (cfg.architectures or []))
    kwargs: dict[str, Any] = {}
    if not has_head or generic:  # a fresh head, or a generic one: name its outputs with the task's labels
        kwargs = {"num_labels": task.num_labels, "id2label": dict(enumerate(task.labels)),
                  "label2id": {l: i for i, l in enumerate(task.labels)}}
        if has_head and len(names) != task.num_labels:
            kwargs["ignore_mismatched_sizes"] = True
    try:
        tok = AutoTokenizer.from_pretrained(model_name)
        model = AutoModelForSequenceClassification.from_pretrained(model_name, **kwargs)
    except Exception as err:
        from ..data.loading import root_cause
        raise ConfigError(f"--model {model_name}: cannot load the model ({root_cause(err)})") from err
    model_label_order(model, task, model_name)  # refuses a head whose names are not the task's
    return tok, model


def to_head_order(task_columns: np.ndarray, label_order: Sequence[int]) -> np.ndarray:
    """Columns in the task's label order -> columns in the model head's order.

    ``label_order[t]`` is the head's output index of task label ``t`` (:func:`model_label_order`), so
    task column ``t`` goes to head column ``label_order[t]``: a scatter, ``out[:, order] = x``. (The
    gather ``x[:, order]`` is the inverse map; the two agree only when ``order`` is its own inverse,
    e.g. a swap, and differ for a rotated head such as ``{0: contradiction, 1: entailment, 2: neutral}``.)
    """
    order = np.asarray(label_order, dtype=np.int64)
    if not len(order):
        return task_columns
    out = np.empty_like(task_columns)
    out[:, order] = task_columns
    return out


def tokenize_pairs(ds, tokenizer, max_length: int, *, label_order: Sequence[int] | None = None,
                   bias: np.ndarray | None = None, hypothesis_only: bool = False, desc: str = "tokenize"):
    """``premise, hypothesis`` -> ``input_ids, attention_mask[, token_type_ids], labels[, bias_log_probs]``
    (``bias``: rows x K in the task's order, stored in the head's order), plus ``h_input_ids,
    h_attention_mask`` (the hypothesis alone) with ``hypothesis_only``, for the joint PoE bias head.

    No padding here (batches are padded dynamically); a ``length`` column feeds the length-grouped sampler.
    """
    order = np.asarray(label_order if label_order is not None else [], dtype=np.int64)

    def encode(batch, idx):
        enc = tokenizer(batch["premise"], batch["hypothesis"], truncation=True, max_length=max_length)
        labels = np.asarray(batch["label"], dtype=np.int64)
        enc["labels"] = (order[labels] if len(order) else labels).tolist()
        enc["length"] = [len(x) for x in enc["input_ids"]]
        if bias is not None:
            enc[BIAS_COLUMN] = to_head_order(bias[np.asarray(idx)], order).tolist()
        if hypothesis_only:
            h = tokenizer(batch["hypothesis"], truncation=True, max_length=max_length)
            enc["h_input_ids"], enc["h_attention_mask"] = h["input_ids"], h["attention_mask"]
        return enc

    keep = ["input_ids", "attention_mask", "token_type_ids", "labels", "length", BIAS_COLUMN, *HYPOTHESIS_INPUTS]
    out = ds.map(encode, batched=True, with_indices=True, desc=desc,
                 remove_columns=ds.column_names)
    return out.remove_columns([c for c in out.column_names if c not in keep])


class PairCollator:
    """Dynamic padding (``DataCollatorWithPadding``) that carries the PoE bias column along."""

    def __init__(self, tokenizer):
        from transformers import DataCollatorWithPadding

        self.pad = DataCollatorWithPadding(tokenizer)

    def __call__(self, features):
        import torch

        bias = [f.pop(BIAS_COLUMN) for f in features] if features and BIAS_COLUMN in features[0] else None
        hyp = None
        if features and HYPOTHESIS_INPUTS[0] in features[0]:
            hyp = [{"input_ids": f.pop("h_input_ids"), "attention_mask": f.pop("h_attention_mask")} for f in features]
        for f in features:
            f.pop("length", None)
        batch = self.pad(features)
        if bias is not None:
            batch[BIAS_COLUMN] = torch.tensor(bias, dtype=torch.float32)
        if hyp is not None:
            h = self.pad(hyp)
            batch["h_input_ids"], batch["h_attention_mask"] = h["input_ids"], h["attention_mask"]
        return batch


def _joint_poe_class():
    import torch
    from torch import nn

    class JointBiasPoE(nn.Module):
        """The main classifier plus a hypothesis-only bias head on its own encoder (Karimi Mahabadi et
        al. 2020, ``BertDebiasForSequenceClassification``; Wu et al. 2022 adapt it): the head reads the
        encoder's pooled output of the hypothesis alone, with no gradient into the encoder."""

        def __init__(self, model, num_labels: int):
            super().__init__()
            self.model = model
            self.config = model.config
            cfg = model.config
            p = getattr(cfg, "hidden_dropout_prob", None) or getattr(cfg, "dropout", None) or 0.1
            self.bias_dropout = nn.Dropout(float(p))
            self.bias_head = nn.Linear(int(cfg.hidden_size), num_labels)

        def bias_logits(self, h_input_ids, h_attention_mask):
            with torch.no_grad():  # Karimi Mahabadi et al.: grad_mul_const(pooled_h, 0.0)
                enc = self.model.base_model(input_ids=h_input_ids, attention_mask=h_attention_mask)
                pooled = getattr(enc, "pooler_output", None)
                if pooled is None:
                    pooled = enc.last_hidden_state[:, 0]
            return self.bias_head(self.bias_dropout(pooled.detach()))

        def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, h_input_ids=None,
                    h_attention_mask=None, labels=None):  # `labels` in the signature: Trainer finds them
            kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            out = self.model(**kwargs)
            if h_input_ids is not None:
                out["bias_logits"] = self.bias_logits(h_input_ids, h_attention_mask)
            return out

    return JointBiasPoE


def _accuracy_metric():
    from .challenge import load_metric

    metric = load_metric()

    def compute(eval_pred):
        logits, labels = eval_pred.predictions, eval_pred.label_ids
        logits = logits[0] if isinstance(logits, tuple) else logits
        res = metric.compute(predictions=np.asarray(logits).argmax(-1).tolist(), references=np.asarray(labels).tolist())
        return {"accuracy": res["accuracy"]}

    return compute


def _make_trainer_class():
    from transformers import Trainer

    class DebiasTrainer(Trainer):
        """``Trainer`` whose loss is the product of experts when a batch carries bias log-probabilities."""

        poe_beta: float = 1.0
        poe_gamma: float = 1.0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            import torch.nn.functional as F

            bias = inputs.pop(BIAS_COLUMN, None)
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs.logits
            if bias is None and outputs.get("bias_logits") is not None:  # the joint head: b requires grad
                bias = F.log_softmax(outputs["bias_logits"].float(), dim=-1)
            if bias is None:
                loss = F.cross_entropy(logits.float(), labels)
            else:
                loss = poe_loss(logits, bias, labels, self.poe_beta, self.poe_gamma)
            return (loss, outputs) if return_outputs else loss

    return DebiasTrainer


@dataclasses.dataclass
class TrainResult:
    output_dir: str
    train_rows: int
    dev_rows: int
    train_seconds: float
    train_examples_per_second: float
    dev_accuracy: float | None
    best_checkpoint: str | None
    resumed_from: str | None
    bias_model: dict | None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


RUN_FILE = "debiased_nli_run.json"
# may change between resumes of one run (a rerun with more epochs extends it)
_NOT_THE_RUN = ("output_dir", "resume", "use_cpu", "num_threads", "progress", "epochs", "eval_batch_size",
                "save_total_limit", "early_stopping_patience")


def is_run_folder(folder: Path) -> bool:
    """A training folder of this tool: its run record or its training record is there (a JSON mapping), or a
    file it wrote (with its marker: e.g. the selection rows `compare run` puts there first)."""
    from ..utils.outputs import holds_own_file, json_of

    return any(isinstance(json_of(Path(folder) / n), dict) for n in (RUN_FILE, TRAIN_CONFIG_FILE)) or \
        holds_own_file(Path(folder))


def check_train_folder(out: "str | Path") -> Path:
    """``train --out DIR``: DIR is new, empty or a training folder of this tool (:func:`is_run_folder`), never
    a folder of the user's (its ``config.json`` and ``model.safetensors`` would be replaced): checked before
    any work, a refusal names what is there."""
    from ..utils.outputs import check_output_folder

    return check_output_folder(out, what="training run", is_ours=is_run_folder)


def _write_own(folder: Path, name: str, text: str) -> None:
    """A record of the run (``RUN_FILE``, ``TRAIN_CONFIG_FILE``) written whole, with its marker."""
    from ..utils.outputs import OwnFiles

    with OwnFiles([folder / name], what=f"--out {folder}", legacy=lambda p: is_run_folder(p.parent)) as own:
        own.write_text(folder / name, text)


def check_run(cfg: TrainConfig, task: TaskSpec, train_ds, dev_ds) -> dict:
    """Resume only the same run: the output folder's ``debiased_nli_run.json`` (model, task, data
    fingerprints, hyper-parameters) must match this one, as ``generate`` checks its shards. A folder
    with checkpoints but no such file (another tool's run) is refused too; ``--no-resume`` starts over.
    The data fingerprints hash the rows themselves (:func:`debiased_nli.data.loading.content_fingerprint`), so a
    run resumes on the same rows read from a copied or remounted file. Returns the run's record."""
    from ..data.loading import content_fingerprint

    run = {"task": task.name, "train_fingerprint": content_fingerprint(train_ds),
           "dev_fingerprint": content_fingerprint(dev_ds) if dev_ds is not None else None,
           **{k: v for k, v in cfg.to_dict().items() if k not in _NOT_THE_RUN}}
    run = json.loads(json.dumps(run, default=str))  # as the file holds it (tuples are lists there)
    path = Path(cfg.output_dir, RUN_FILE)
    check_train_folder(cfg.output_dir)
    if cfg.resume and _last_checkpoint(cfg.output_dir):
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ConfigError(f"{cfg.output_dir} holds checkpoints of a run this tool did not record; use another "
                              f"--out, or --no-resume to start over there") from None
        if old != run:
            diff = {k: (old.get(k), v) for k, v in run.items() if old.get(k) != v}
            raise ConfigError(f"{cfg.output_dir} holds checkpoints of another run (differences, old -> new: "
                              f"{diff}); use another --out, the same settings to resume, or --no-resume to "
                              f"start over there")
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    _write_own(Path(cfg.output_dir), RUN_FILE, json.dumps(run, indent=2, default=str))
    return run


def _last_checkpoint(output_dir: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


def train_classifier(cfg: TrainConfig, task: "str | TaskSpec", train_ds, dev_ds=None, *,
                     callbacks: Sequence | None = None, bias_model=None, data: "dict | None" = None,
                     sources: "dict[str, str] | None" = None) -> TrainResult:
    """Fine-tune ``cfg.model`` on the canonical ``train_ds`` (early stopping on ``dev_ds``) and save
    the best model, its tokenizer (``config.id2label`` = the task's label names) and
    ``debiased_nli_train.json`` (config, data fingerprints, bias model, timings) in ``cfg.output_dir``.
    ``callbacks``: extra ``TrainerCallback``s (e.g. one that stops at a checkpoint to share the machine;
    the next call resumes from it). ``bias_model``: with PoE and a fixed bias model (``cfg.bias_model``
    other than ``"joint"``), the function of the training rows that returns the bias model's
    log-probabilities and a description (:func:`debiased_nli.bias.poe.bias_model_for`). ``data``: where the
    rows came from, ``{"train": ..., "dev": ...}`` (:func:`training_source`); ``sources``: the source of each
    hyper-parameter (:func:`describe_config` when not given). Both go into ``debiased_nli_train.json`` and the model
    card, ``README.md`` (:mod:`debiased_nli.models.card`), written beside the model."""
    import torch
    from transformers import set_seed

    task = get_task(task)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if len(train_ds) == 0:
        raise EmptyResultError("the training set has no rows")
    train_ds = subsample(train_ds, cfg.max_train_rows, cfg.data_seed)
    if dev_ds is not None:
        dev_ds = subsample(dev_ds, cfg.max_dev_rows, cfg.data_seed)
    set_seed(cfg.seed)
    tok, model = load_model_for_task(cfg.model, task)
    order = model_label_order(model, task, cfg.model)
    run = check_run(cfg, task, train_ds, dev_ds)
    from ..utils.outputs import refuse_not_ours

    # the model card is written at the end: a README.md of the user's there is refused now, not after the training
    refuse_not_ours([Path(cfg.output_dir) / "README.md"], f"--out {cfg.output_dir}")

    joint = cfg.poe and cfg.bias_model == "joint"
    bias, bias_info = _poe_bias_model(cfg, train_ds, bias_model)
    if joint:
        model = _joint_poe_class()(model, task.num_labels)
    train_tok = tokenize_pairs(train_ds, tok, cfg.max_length, label_order=order, bias=bias, hypothesis_only=joint,
                               desc="tokenize train")
    dev_tok = tokenize_pairs(dev_ds, tok, cfg.max_length, label_order=order, desc="tokenize dev") if dev_ds is not None else None

    has_dev = dev_tok is not None
    trainer = _make_trainer(cfg, model, tok, train_tok, dev_tok, callbacks)
    resume = _last_checkpoint(cfg.output_dir) if cfg.resume else None
    if resume:
        logger.warning("resuming from %s", resume)
    start = time.perf_counter()
    out = trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - start
    dev_acc = None
    if has_dev:
        dev_acc = float(trainer.evaluate()["eval_accuracy"])
    if trainer.is_world_process_zero():
        _save_final(trainer, tok, Path(cfg.output_dir), joint)
    result = TrainResult(
        output_dir=cfg.output_dir, train_rows=len(train_ds), dev_rows=len(dev_ds) if dev_ds is not None else 0,
        train_seconds=round(seconds, 2),
        train_examples_per_second=round(float(out.metrics.get("train_samples_per_second", 0.0)), 3),
        dev_accuracy=dev_acc, best_checkpoint=trainer.state.best_model_checkpoint, resumed_from=resume,
        bias_model=bias_info)
    if trainer.is_world_process_zero():
        record = _write_train_record(cfg, task, run, result, trainer.args.world_size, data=data,
                                     sources=sources or describe_config(cfg))
        from .card import write_model_card

        write_model_card(Path(cfg.output_dir), record)
    return result


def _save_final(trainer, tok, out: Path, joint: bool) -> None:
    """The best model and its tokenizer into ``out``: saved into a folder beside them first, then each file renamed
    into place with its marker (:class:`~debiased_nli.utils.outputs.OwnFiles`): a file there that this tool did
    not write is refused, not replaced, and a full disk leaves the earlier files as they were."""
    import shutil

    from ..utils.outputs import OwnFiles

    stage = out / f".final.tmp-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        if joint:  # at test time only p is used: save the main classifier alone, loadable by from_pretrained
            trainer.accelerator.unwrap_model(trainer.model).model.save_pretrained(stage)
        else:
            trainer.save_model(str(stage))
        tok.save_pretrained(stage)
        names = sorted(p.name for p in stage.iterdir() if p.is_file())
        with OwnFiles([out / n for n in names], what=f"--out {out}", legacy=lambda p: is_run_folder(out)) as own:
            for n in names:
                os.replace(stage / n, own.temp(out / n))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _poe_bias_model(cfg: TrainConfig, train_ds, bias_model) -> tuple[np.ndarray | None, dict | None]:
    """The bias model of PoE training: (the fixed bias model's log-probabilities of the training rows, or None
    for the joint head and without PoE; its description with beta, gamma and source, or None without PoE)."""
    bias, bias_info, joint = None, None, cfg.poe and cfg.bias_model == "joint"
    if cfg.poe and joint:
        bias_info = {"method": "joint-hypothesis-only-head", "head": "linear on the pooled hypothesis encoding, "
                     "no gradient into the encoder (Karimi Mahabadi et al. 2020)"}
    elif cfg.poe:
        if bias_model is None:
            raise ConfigError(f"PoE with the fixed bias model {cfg.bias_model!r} needs its scores: pass "
                              "bias_model=debiased_nli.bias.poe.bias_model_for(cfg, task) (the `train` command does)")
        bias, bias_info = bias_model(train_ds)
        if cfg.poe_gamma:
            logger.warning("PoE with a fixed bias model (%s): gamma * CE(b, y) = %s * const changes no gradient; "
                           "gamma acts only with bias_model='joint' (Wu et al. 2022 train the bias head jointly)",
                           cfg.bias_model, cfg.poe_gamma)
    if bias_info is not None:
        bias_info = {**bias_info, "beta": cfg.poe_beta, "gamma": cfg.poe_gamma, "source": cfg.bias_model}
    return bias, bias_info


def training_arguments(cfg: TrainConfig, has_dev: bool):
    """The ``TrainingArguments`` of ``cfg``: evaluation and checkpoints every epoch (or ``eval_steps``),
    the best model by dev accuracy kept when there is a dev set, and the CPU when no accelerator is visible
    (unless ``cfg.use_cpu`` says otherwise)."""
    import torch
    from transformers import TrainingArguments

    use_cpu = cfg.use_cpu if cfg.use_cpu is not None else not (torch.cuda.is_available() or
                                                              getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    strategy = "steps" if cfg.eval_steps else "epoch"
    return TrainingArguments(
        output_dir=cfg.output_dir,
        learning_rate=cfg.learning_rate,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size,
        num_train_epochs=cfg.epochs,
        warmup_steps=cfg.warmup_steps if cfg.warmup_steps is not None else cfg.warmup_ratio,  # a float in [0, 1): a ratio
        weight_decay=cfg.weight_decay,
        adam_epsilon=cfg.adam_epsilon,
        adam_beta1=float(cfg.adam_betas[0]),
        adam_beta2=float(cfg.adam_betas[1]),
        lr_scheduler_type=cfg.lr_scheduler,
        seed=cfg.seed,
        data_seed=cfg.seed,
        eval_strategy=strategy if has_dev else "no",
        eval_steps=cfg.eval_steps,
        save_strategy=strategy,
        save_steps=cfg.eval_steps,
        save_total_limit=cfg.save_total_limit,
        load_best_model_at_end=has_dev,
        metric_for_best_model="accuracy" if has_dev else None,
        greater_is_better=True,
        logging_steps=max(1, cfg.eval_steps or 50),
        report_to="none",
        remove_unused_columns=False,  # keep the PoE bias column for the collator
        train_sampling_strategy="group_by_length" if cfg.group_by_length else "random",
        use_cpu=use_cpu,
        disable_tqdm=not cfg.progress,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,  # every parameter takes part in the forward pass
    )


def _make_trainer(cfg: TrainConfig, model, tok, train_tok, dev_tok, callbacks: Sequence | None):
    """The PoE-aware ``Trainer`` of ``cfg`` (accuracy and early stopping when there is a dev set)."""
    from transformers import EarlyStoppingCallback

    has_dev = dev_tok is not None
    args = training_arguments(cfg, has_dev)
    Trainer = _make_trainer_class()
    trainer = Trainer(model=model, args=args, train_dataset=train_tok, eval_dataset=dev_tok,
                      data_collator=PairCollator(tok), processing_class=tok,
                      compute_metrics=_accuracy_metric() if has_dev else None,
                      callbacks=([EarlyStoppingCallback(cfg.early_stopping_patience)] if has_dev else []) + list(callbacks or []))
    trainer.poe_beta, trainer.poe_gamma = cfg.poe_beta, cfg.poe_gamma
    if not cfg.progress:  # without progress bars the Trainer prints every log as a dict instead: nothing, here
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
    return trainer


def _write_train_record(cfg: TrainConfig, task: TaskSpec, run: dict, result: TrainResult, world_size: int, *,
                        data: "dict | None" = None, sources: "dict[str, str] | None" = None) -> dict:
    """``debiased_nli_train.json``: the config, the source of each value, task, where the rows came from, data
    fingerprints, result, world size and versions. Returns the record."""
    import datasets as hf_datasets
    import torch
    import transformers

    from .. import __version__

    record = {"config": cfg.to_dict(), "sources": dict(sources or {}), "task": task.name, "labels": list(task.labels),
              "data": dict(data or {}),
              "train_fingerprint": run["train_fingerprint"], "dev_fingerprint": run["dev_fingerprint"],
              "result": result.to_dict(), "world_size": world_size,
              "versions": {"debiased_nli": __version__, "transformers": transformers.__version__,
                           "datasets": hf_datasets.__version__, "torch": torch.__version__}}
    record = json.loads(json.dumps(record, default=str))  # as the file holds it
    _write_own(Path(cfg.output_dir), TRAIN_CONFIG_FILE, json.dumps(record, indent=2))
    return record
