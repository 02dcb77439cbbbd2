"""The model side of the API: :func:`train` a classifier on a release (and push it), :func:`evaluate` models on
challenge sets (and push the results), :func:`compare` the rows of a plan. Each is what its command does
(``debiased-nli train``, ``evaluate``, ``compare``), with the same checks and files, returning a result object."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:  # the heavy modules are imported when a function runs, not with the package
    from ..data.tasks import TaskSpec
    from ..models.training import TrainConfig, TrainResult


@dataclasses.dataclass
class TrainOutcome:
    """What :func:`train` did: the training's result, the values it used and their sources, the model card
    written beside the model, and the push (None without ``push_to``)."""

    result: "TrainResult"
    config: "TrainConfig"
    sources: dict[str, str]
    card: Path | None
    pushed: dict[str, Any] | None = None

    @property
    def model_dir(self) -> Path:
        return Path(self.result.output_dir)


def train(task: "str | TaskSpec", *, model: str, out: "str | os.PathLike[str]",
          release: str | None = None, config: str | None = None,
          data_files: "str | Sequence[str] | Mapping[str, Any] | None" = None,
          dev_files: "Sequence[str] | None" = None, split: str = "train", revision: str | None = None,
          max_rows: int | None = None, on_invalid: str = "error", preset: str | None = None,
          learning_rate: float | None = None, batch_size: int | None = None, max_length: int | None = None,
          epochs: float | None = None, warmup_ratio: float | None = None, warmup_steps: int | None = None,
          lr_scheduler: str | None = None, adam_epsilon: float | None = None, weight_decay: float | None = None,
          eval_steps: int | None = None, early_stopping_patience: int | None = None, seed: int = 42,
          data_seed: int = 0, max_train_rows: int | None = None, max_dev_rows: int | None = None,
          poe: bool = False, poe_preset: str | None = None, poe_beta: float | None = None,
          poe_gamma: float | None = None, bias_model: str | None = None, group_by_length: bool = True,
          resume: bool = True, cpu: bool = False, threads: int | None = None,
          push_to: str | None = None, push_revision: str | None = None, private: bool = False,
          token: str | None = None, endpoint: str | None = None, progress: bool = False,
          show_values: bool = False) -> TrainOutcome:
    """Fine-tune a sentence-pair classifier (``debiased-nli train``) and write its model card; optionally push it.

    The best model (by dev accuracy), its tokenizer (``config.id2label`` = the task's labels), the training record
    ``debiased_nli_train.json`` and the model card ``README.md`` (base model, what it trained on with the content
    fingerprint of the rows, every hyper-parameter with its source, the dev accuracy) go into ``out``; a rerun
    resumes from the last checkpoint.

    Args:
        task: a registered task, a task YAML file or a :class:`~debiased_nli.data.tasks.TaskSpec`.
        model: a Hub id or a folder of any ``AutoModelForSequenceClassification`` (an encoder gets a new head).
        out: the training folder (new, empty, or a training folder of this tool).
        release: a release folder or Hub dataset repo to train on (with ``config``).
        config: the release's config, e.g. ``"z_filtered"``.
        data_files: local files instead (``["train=a.parquet", "validation=b.parquet"]``).
        dev_files: dev rows for early stopping (default: the ``validation`` split of ``data_files``).
        split: the split to train on.
        revision: the Hub revision of the training data (a Hub release or the task's Hub dataset).
        max_rows: read at most this many training rows.
        on_invalid: ``"error"`` or ``"set_aside"`` for bad rows.
        preset: ``"paper"``: Wu et al. (2022), Table 9; the values given here override it.
        learning_rate: the learning rate (default 1e-5, Table 9). Each hyper-parameter left None is the preset's or
            the project's default; the card says which.
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
    from ..data.loading import parse_data_files
    from ..data.tasks import get_task
    from ..models.training import check_train_folder, load_training_split, resolve_config, train_classifier
    from ..utils.errors import ConfigError
    from ..utils.paths import check_model_reference, check_release_reference

    task = get_task(task)
    if release and data_files:
        raise ConfigError("give either --release (with --config) or --data-files, not both")
    if push_to:
        from ..models.hub import check_version_tag
        from ..utils.hub import check_repo_id

        check_repo_id(push_to, "--push-to")
        check_version_tag(push_revision, "--push-revision")
    check_train_folder(out)  # before any work: never a folder of the user's
    check_model_reference(model, "--model")
    if (poe or poe_preset) and bias_model not in (None, "tfidf", "joint"):
        check_model_reference(bias_model, "--bias-model")
    if release:
        check_release_reference(release, "--release")
    given = dict(learning_rate=learning_rate, batch_size=batch_size, max_length=max_length, epochs=epochs,
                 warmup_ratio=warmup_ratio, warmup_steps=warmup_steps, lr_scheduler=lr_scheduler,
                 adam_epsilon=adam_epsilon, weight_decay=weight_decay, eval_steps=eval_steps,
                 early_stopping_patience=early_stopping_patience)
    cfg, sources = resolve_config(model, str(out), preset=preset, given=given, poe=poe, poe_preset_name=poe_preset,
                                  poe_beta=poe_beta, poe_gamma=poe_gamma, bias_model=bias_model, seed=seed,
                                  data_seed=data_seed, max_train_rows=max_train_rows, max_dev_rows=max_dev_rows,
                                  group_by_length=group_by_length, resume=resume, use_cpu=True if cpu else None,
                                  num_threads=threads, progress=progress)
    files = parse_data_files(data_files) if data_files else None
    train_rows, train_src = load_training_split(task, data_files=files, release=release, config=config, split=split,
                                                on_invalid=on_invalid, revision=revision, with_source=True)
    if max_rows:
        train_rows = train_rows.select(range(min(max_rows, len(train_rows))))
    dev, dev_src = None, None
    if dev_files:
        dev, dev_src = load_training_split(task, data_files={"validation": list(dev_files)}, split="validation",
                                           on_invalid=on_invalid, with_source=True)
    elif files and "validation" in files:
        dev, dev_src = load_training_split(task, data_files=files, split="validation", on_invalid=on_invalid,
                                           with_source=True)
    from accelerate import PartialState

    main = PartialState(cpu=cpu).is_main_process
    if main and show_values:
        from ..utils.outputs import print_values

        print_values("train values", {k: v for k, v in cfg.to_dict().items() if k in sources}, sources)
    bias = None
    if cfg.poe and cfg.bias_model != "joint":
        from ..bias.poe import bias_model_for

        bias = bias_model_for(cfg, task)
    result = train_classifier(cfg, task, train_rows, dev, bias_model=bias,
                              data={"train": train_src, **({"dev": dev_src} if dev_src else {})}, sources=sources)
    card = Path(out) / "README.md"
    pushed = None
    if push_to and main:
        from ..models.hub import push_model

        pushed = push_model(out, push_to, revision=push_revision, private=private, token=token, endpoint=endpoint)
    return TrainOutcome(result=result, config=cfg, sources=sources, card=card if card.exists() else None,
                        pushed=pushed)


@dataclasses.dataclass
class EvaluateOutcome:
    """What :func:`evaluate` did: the results (the ``results.json`` object), the files written, the push."""

    results: dict[str, Any]
    paths: dict[str, Path]
    pushed: dict[str, Any] | None = None

    def accuracy(self, set_name: str) -> float:
        """The (mean) accuracy on one set."""
        return float(self.results["sets"][set_name]["accuracy"])


def evaluate(models: "str | Sequence[str]", *, suite: str | None = None, sets: "Sequence[str] | None" = None,
             out: "str | os.PathLike[str] | None" = None, name: str | None = None,
             compare: "Mapping[str, str | os.PathLike[str]] | Sequence[str] | None" = None,
             max_examples: int | None = None, sample_seed: int = 0, batch_size: int = 64,
             max_tokens: int | None = None, max_length: int = 128, data_root: "str | os.PathLike[str] | None" = None,
             device: str | None = None, dtype: str = "float32", label_order: "Sequence[str] | None" = None,
             notes: str | None = None, push_to: str | None = None, private: bool = False, token: str | None = None,
             endpoint: str | None = None, progress: bool = False) -> EvaluateOutcome:
    """Score classifiers on challenge sets (``debiased-nli evaluate``) and optionally record them on the Hub.

    Args:
        models: a model folder or Hub id, or several (the seeds of one recipe: mean ± std).
        suite: a named suite (``"nli"``, ``"fever"``, ``"qqp"``).
        sets: challenge sets by name (added to the suite's).
        out: write ``results.json``, ``report.md`` and ``accuracy.png`` there (an evaluation folder of this tool, or
            new); None writes nothing.
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
    from ..models.challenge import resolve_sets
    from ..evaluation.scores import EvalConfig, evaluate_models, evaluation_outputs, load_results, render_report
    from ..evaluation.scores import write_outputs
    from ..utils.errors import ConfigError
    from ..utils.paths import check_model_reference

    models = [models] if isinstance(models, (str, os.PathLike)) else list(models)
    if not models:
        raise ConfigError("evaluate needs at least one model (--model DIR [DIR ...])")
    if push_to:
        from ..utils.hub import check_repo_id

        check_repo_id(push_to, "--push-to")
    for model in models:
        check_model_reference(str(model), "--model")
    label_order = list(label_order) if label_order is not None else None
    if label_order is not None and (not all(label_order) or len(set(label_order)) != len(label_order)):
        raise ConfigError(f"--label-order {','.join(label_order)!r}: give each label name once, comma-separated")
    chosen = resolve_sets(suite, list(sets) if sets else None)
    others = {}
    items = compare.items() if isinstance(compare, Mapping) else [_named(item) for item in compare or []]
    for key, path in items:
        others[key] = load_results(path)
    outputs = evaluation_outputs(out) if out is not None else None  # before any model: never a file of the user's
    cfg = EvalConfig(max_examples=max_examples, sample_seed=sample_seed, batch_size=batch_size, max_length=max_length,
                     max_tokens=max_tokens, data_root=str(data_root) if data_root is not None else None, device=device,
                     label_order=label_order, dtype=dtype, progress=progress)
    results = evaluate_models([str(m) for m in models], chosen, cfg)
    results["suite"] = suite
    name = name or (Path(out).name if out is not None else "this model")
    title = f"Evaluation report: {name}"
    paths = {}
    if outputs is not None:
        paths = write_outputs(results, out, outputs=outputs, name=name, compare=others, notes=notes or "", title=title)
    pushed = None
    if push_to:
        from ..models.hub import push_results

        pushed = push_results(push_to, results, token=token, endpoint=endpoint, private=private,
                              report_md=render_report(results, title=title, name=name, compare=others,
                                                      notes=notes or ""))
    return EvaluateOutcome(results=results, paths=dict(paths), pushed=pushed)


def _named(item: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (named by its folder) of ``--compare``."""
    key, sep, path = str(item).partition("=")
    if not sep:
        p = Path(item)
        key, path = (p.parent.name if p.suffix == ".json" else p.name), str(item)
    return key, path


@dataclasses.dataclass
class CompareOutcome:
    """What :func:`compare` did: the units' states (``status``), the report's table and files (``report``, and
    ``run`` unless ``report=False``), the push (``push_to``)."""

    action: str
    states: list[dict[str, Any]] | None = None
    table: dict[str, Any] | None = None
    files: list[Path] = dataclasses.field(default_factory=list)
    stem: Path | None = None         # the report's path without its suffix
    planned: int = 0                 # units in the plan: rows x seeds
    pushed: dict[str, Any] | None = None
    exit_code: int = 0               # run with workers: the first failed worker's exit code
    logs: Path | None = None         # ... and the folder of the workers' logs


def compare(plan: "str | os.PathLike[str]", action: str = "report", *, runs_dir: str | None = None,
            results_dir: str | None = None, rows: "Sequence[str] | None" = None,
            seeds: "Sequence[int] | None" = None, out: "str | os.PathLike[str] | None" = None,
            workers: int = 1, device: str | None = None, lock: str | None = None, seed_major: bool = False,
            stop_after: int | None = None, report: bool = True, push_to: str | None = None,
            revision: str | None = None, token: str | None = None, claims: str | None = None,
            progress: bool = False) -> CompareOutcome:
    """Does training on a release help? (``debiased-nli compare``): the ``status`` of a plan's units, ``run`` them
    (train and score every (row, seed) not done yet; resumable), or ``report`` the finished ones (markdown, JSON
    and plots with seed-row t intervals; ``push_to`` also pushes the report beside the release on the Hub).

    Args:
        plan: the plan (YAML; see docs/efficacy.md).
        action: ``"status"``, ``"run"`` or ``"report"``.
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
    import sys
    import time

    from ..evaluation.compare import load_plan, run_workers, unit_states
    from ..evaluation.compare import run as run_units
    from ..evaluation.compare.report import intervals_path
    from ..evaluation.compare.report import report as write_report
    from ..utils.errors import ConfigError

    if action not in ("status", "run", "report"):
        raise ConfigError(f"compare: the action is status, run or report, not {action!r}")
    p = load_plan(plan, runs_dir=runs_dir, results_dir=results_dir)
    if device:
        p.raw["device"] = device
    rows = list(rows) if rows else None
    seeds = list(seeds) if seeds else None
    for row in rows or []:
        p.row(row)
    if action == "status":
        return CompareOutcome(action, states=unit_states(p, rows, seeds))
    if action == "run":
        if workers > 1 and not claims:
            folder = p.runs_dir / "claims" / time.strftime("%Y%m%d-%H%M%S")
            cmd = [sys.executable, "-m", "debiased_nli.cli", "compare", "run", str(Path(plan).resolve()),
                   "--no-report", "--quiet"]
            for opt, value in (("runs-dir", runs_dir), ("results-dir", results_dir), ("lock", lock),
                               ("device", device)):
                if value:
                    cmd += [f"--{opt}", str(value)]
            if rows:
                cmd += ["--rows", *rows]
            if seeds:
                cmd += ["--seeds", *map(str, seeds)]
            if seed_major:
                cmd.append("--seed-major")
            code = run_workers(cmd, workers, folder, p.runs_dir / "logs", env=dict(os.environ))
            if code:  # the workers' logs say why
                return CompareOutcome(action, exit_code=code, logs=p.runs_dir / "logs")
        else:
            run_units(p, rows, seeds, lock, progress=progress, stop_after=stop_after, claims=claims,
                      seed_major=seed_major)
        if not report or claims:
            return CompareOutcome(action)
    if push_to:  # before the report: a wrong repo id wastes no bootstrap
        from ..utils.hub import check_repo_id

        check_repo_id(push_to, "--push-to")
    stem = Path(out).resolve() if out else None
    table = write_report(p, stem)
    stem = stem or p.results_dir.parent / p.results_dir.name
    files = [stem.with_suffix(x) for x in (".md", ".json", ".png")] + [intervals_path(stem)]
    pushed = None
    if push_to:
        from ..evaluation.compare.hub import push_report

        pushed = push_report(p, table, stem, push_to, revision=revision, token=token)
    return CompareOutcome(action, table=table, files=[f for f in files if f.exists()], stem=stem,
                          planned=len(p.rows) * len(p.seeds), pushed=pushed)
