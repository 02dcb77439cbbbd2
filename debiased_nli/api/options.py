"""The options of the API's functions, each declared once, as a dataclass.

A function takes its few essential arguments by name and every other option as a keyword, or as one object of
its options class, or both (the keywords replace the object's fields)::

    dn.train("snli", model="bert-base-uncased", out="runs/zf", release="org/debiased-snli", config="z_filtered",
             epochs=3)
    opts = dn.TrainOptions(release="org/debiased-snli", config="z_filtered", preset="paper")
    dn.train("snli", model="bert-base-uncased", out="runs/zf", options=opts, seed=1)

A keyword that names no option is refused before any work, with the closest name
(:class:`~debiased_nli.utils.params.UnknownOptionError`, a ``ConfigError`` and a ``TypeError``):
``train() got an unknown option 'epoch'. Did you mean 'epochs'?``. This module imports nothing heavy.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence


@dataclasses.dataclass
class BuildOptions:
    """The options of :func:`debiased_nli.build` (``debiased-nli build``) besides the recipe and ``out``.

    Attributes:
        data_files: local files for D0 (and evaluation splits: ``["train=a.parquet", "validation=b.parquet"]``)
            instead of the recipe's source.
        new_rows: files of new rows D_G (generated or perturbed) to compose ``z_aug``, ``par_z`` and ``seq_z``.
        profile: one of the recipe's profiles (e.g. ``"paper"``).
        max_rows: use at most this many rows of D0.
        seed: the recipe's seed, overridden.
        overwrite: replace ``out`` when it is a release of this tool.
        efficacy: an efficacy table (the JSON ``compare report`` writes) for the card.
        replay: an earlier release whose recorded filter decisions are reused where they fit.
        timings: record each stage's seconds in the manifest.
        progress: show progress bars.
        prune_cache: afterwards, delete the oldest feature-cache entries beyond ``$DEBIASED_NLI_CACHE_MAX_MB``
            (the result's ``pruned``).
        quality: reports of ``debiased-nli quality`` (``quality.json`` files or their folders) on this release's
            generated rows: shown in the card, recorded in the manifest; one that measured other rows is refused.
    """

    data_files: "str | Sequence[str] | Mapping[str, Any] | None" = None
    new_rows: "Sequence[str] | None" = None
    profile: str | None = None
    max_rows: int | None = None
    seed: int | None = None
    overwrite: bool = False
    efficacy: "str | os.PathLike[str] | None" = None
    replay: "str | os.PathLike[str] | None" = None
    timings: bool = False
    progress: bool = False
    prune_cache: bool = True
    quality: "Sequence[str] | None" = None


@dataclasses.dataclass
class AuditOptions:
    """The options of :func:`debiased_nli.audit` (``debiased-nli audit``) besides the task and ``out``.

    Attributes:
        data_files: local files instead of the task's Hub source (``"a.parquet"`` or ``["train=a.parquet"]``).
        split: the split to audit.
        revision: the Hub revision of the task's dataset.
        max_rows: read at most this many rows.
        on_invalid: ``"error"`` (stop at a bad row, naming it) or ``"set_aside"``.
        top_k: features reported per label.
        z_threshold: the |z| threshold (default: Bonferroni-corrected at ``alpha``).
        alpha: the significance level of the default threshold.
        p0: ``"uniform"`` (1/K), ``"prior"`` or a number.
        hypothesis_only: ``"tfidf"`` (out of fold), a classifier folder or Hub id, or None.
        seed: the seed of the hypothesis-only model's folds.
        progress: show progress bars.
    """

    data_files: "str | Sequence[str] | Mapping[str, Any] | None" = None
    split: str = "train"
    revision: str | None = None
    max_rows: int | None = None
    on_invalid: str = "error"
    top_k: int = 20
    z_threshold: float | None = None
    alpha: float = 0.01
    p0: "str | float" = "uniform"
    hypothesis_only: str | None = "tfidf"
    seed: int = 0
    progress: bool = False


@dataclasses.dataclass
class TrainOptions:
    """The options of :func:`debiased_nli.train` (``debiased-nli train``) besides the task, ``model`` and ``out``.

    Each hyper-parameter left None is the preset's or the project's default; the model card says which.

    Attributes:
        release: a release folder or Hub dataset repo to train on (with ``config``).
        config: the release's config, e.g. ``"z_filtered"``.
        data_files: local files instead (``["train=a.parquet", "validation=b.parquet"]``).
        dev_files: dev rows for early stopping (default: the ``validation`` split of ``data_files``).
        split: the split to train on.
        revision: the Hub revision of the training data (a Hub release or the task's Hub dataset).
        max_rows: read at most this many training rows.
        on_invalid: ``"error"`` or ``"set_aside"`` for bad rows.
        preset: ``"paper"``: Wu et al. (2022), Table 9; the values given here override it.
        learning_rate: the learning rate (default 1e-5, Table 9).
        batch_size: the per-device batch (default 32, Table 9).
        max_length: the most tokens of premise and hypothesis (default 128, Table 9).
        epochs: epochs (default 3; the paper's 5); early stopping may end sooner.
        warmup_ratio: the warm-up share of the steps (default 0.1).
        warmup_steps: warm-up steps instead of ``warmup_ratio`` (the paper's 2,000).
        lr_scheduler: ``"linear"`` (default), ``"constant"``, ``"constant_with_warmup"`` (the paper's), ``"cosine"``.
        adam_epsilon: Adam's epsilon (default 1e-8; the paper's 1e-6).
        weight_decay: AdamW's weight decay (default 0.01; the paper's 0).
        eval_steps: evaluate and checkpoint every N steps (default: every epoch).
        early_stopping_patience: evaluations without improvement before stopping (default 3, Table 9).
        seed: the training seed (the head's initialisation, the order, dropout).
        data_seed: the seed of the ``max_train_rows`` / ``max_dev_rows`` samples.
        max_train_rows: train on a seeded random sample of this many rows.
        max_dev_rows: early-stop on a seeded random sample of this many dev rows.
        poe: product of experts with a hypothesis-only bias model.
        poe_preset: beta and gamma of Wu et al. (2022), Table 10 (implies ``poe`` and the joint bias model).
        poe_beta: the weight of log b in softmax(log p + beta log b).
        poe_gamma: the weight of the bias model's cross-entropy (acts only with the joint bias model).
        bias_model: ``"joint"``, ``"tfidf"`` or a hypothesis-only classifier folder.
        group_by_length: batches of rows of similar length.
        resume: continue from the last checkpoint in ``out``.
        cpu: train on the CPU even when a GPU is visible.
        threads: torch CPU threads.
        push_to: upload the model and its card to this Hub model repo (created if needed), in one commit.
        push_revision: tag that commit (``v1.0``; tags are immutable).
        private: create the repo as private.
        token: a Hub token (default: ``HF_TOKEN`` or the logged-in one); never printed or stored.
        endpoint: another Hub (default: ``HF_ENDPOINT`` or huggingface.co).
        progress: show progress bars.
        show_values: print every value and its source on stderr before training.
    """

    # the rows
    release: str | None = None
    config: str | None = None
    data_files: "str | Sequence[str] | Mapping[str, Any] | None" = None
    dev_files: "Sequence[str] | None" = None
    split: str = "train"
    revision: str | None = None
    max_rows: int | None = None
    on_invalid: str = "error"
    # the hyper-parameters (None: the preset's or the project's default; models.training.HYPER_PARAMETERS)
    preset: str | None = None
    learning_rate: float | None = None
    batch_size: int | None = None
    max_length: int | None = None
    epochs: float | None = None
    warmup_ratio: float | None = None
    warmup_steps: int | None = None
    lr_scheduler: str | None = None
    adam_epsilon: float | None = None
    weight_decay: float | None = None
    eval_steps: int | None = None
    early_stopping_patience: int | None = None
    # the run
    seed: int = 42
    data_seed: int = 0
    max_train_rows: int | None = None
    max_dev_rows: int | None = None
    # product of experts
    poe: bool = False
    poe_preset: str | None = None
    poe_beta: float | None = None
    poe_gamma: float | None = None
    bias_model: str | None = None
    # the machine
    group_by_length: bool = True
    resume: bool = True
    cpu: bool = False
    threads: int | None = None
    # the Hub
    push_to: str | None = None
    push_revision: str | None = None
    private: bool = False
    token: str | None = None
    endpoint: str | None = None
    # the terminal
    progress: bool = False
    show_values: bool = False

    def hyper_parameters(self) -> dict[str, Any]:
        """The hyper-parameters (:data:`~debiased_nli.models.training.HYPER_PARAMETERS`) by their
        :class:`~debiased_nli.models.training.TrainConfig` names (None: not given)."""
        from ..models.training import HYPER_PARAMETERS

        return {name: getattr(self, name) for name in HYPER_PARAMETERS}


@dataclasses.dataclass
class EvaluateOptions:
    """The options of :func:`debiased_nli.evaluate` (``debiased-nli evaluate``) besides the models and ``out``.

    Attributes:
        suite: a named suite (``"nli"``, ``"fever"``, ``"qqp"``).
        sets: challenge sets by name (added to the suite's).
        name: the models' column in the report (default: ``out``'s folder name).
        compare: other results to add as report columns: ``{name: results.json}`` or ``["NAME=PATH", ...]``.
        max_examples: score a seeded random sample of at most this many rows per set.
        sample_seed: the seed of that sample.
        batch_size: the most rows per batch (rows are batched by length).
        max_tokens: the most padded tokens per batch (rows x longest row).
        max_length: the most tokens of premise and hypothesis.
        data_root: where the sets' local files are (default ``$DEBIASED_NLI_DATA_ROOT``).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ... (default: a GPU when one is visible).
        dtype: ``"float32"`` or ``"bfloat16"`` (autocast).
        label_order: the task label of each model output, for heads named ``LABEL_0``, ...
        notes: a paragraph appended to the report.
        push_to: record every scored set in this Hub model repo (created if needed): its card's ``model-index``,
            ``.eval_results/``, ``evaluation/results.json`` and ``report.md``, in one commit.
        private: create the repo as private.
        token: a Hub token (default: ``HF_TOKEN`` or the logged-in one).
        endpoint: another Hub (default: ``HF_ENDPOINT`` or huggingface.co).
        progress: show progress bars.
    """

    suite: str | None = None
    sets: "Sequence[str] | None" = None
    name: str | None = None
    compare: "Mapping[str, str | os.PathLike[str]] | Sequence[str] | None" = None
    max_examples: int | None = None
    sample_seed: int = 0
    batch_size: int = 64
    max_tokens: int | None = None
    max_length: int = 128
    data_root: "str | os.PathLike[str] | None" = None
    device: str | None = None
    dtype: str = "float32"
    label_order: "Sequence[str] | None" = None
    notes: str | None = None
    push_to: str | None = None
    private: bool = False
    token: str | None = None
    endpoint: str | None = None
    progress: bool = False


@dataclasses.dataclass
class CompareOptions:
    """The options of :func:`debiased_nli.compare` (``debiased-nli compare``) besides the plan and the action.

    Attributes:
        runs_dir: the folder of the models and built releases (default: the plan's).
        results_dir: the folder of the result and predictions files (default: the plan's).
        rows: only these rows, in this order.
        seeds: only these seeds.
        out: the report's stem (``STEM.md``, ``.json``, ``.png``; default: the results folder's path).
        workers: ``run`` with this many processes sharing the machine.
        device: ``"any"``, ``"cpu"`` or ``"cuda"`` (default: the plan's).
        lock: a flock file taken for each stage, given up between turns.
        seed_major: every row's first seed first.
        stop_after: stop after this many finished units.
        report: write the report after ``run``.
        push_to: push the report into this Hub dataset repo (the release), beside its data.
        revision: the release's revision the rows trained on (default: found from the rows).
        token: a Hub token (default: ``HF_TOKEN`` or the logged-in one).
        claims: the shared claims folder of a worker of ``workers`` (internal).
        progress: log each unit with an estimate of the time left, and show progress bars.
    """

    runs_dir: str | None = None
    results_dir: str | None = None
    rows: "Sequence[str] | None" = None
    seeds: "Sequence[int] | None" = None
    out: "str | os.PathLike[str] | None" = None
    workers: int = 1
    device: str | None = None
    lock: str | None = None
    seed_major: bool = False
    stop_after: int | None = None
    report: bool = True
    push_to: str | None = None
    revision: str | None = None
    token: str | None = None
    claims: str | None = None
    progress: bool = False
