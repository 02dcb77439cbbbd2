"""The model side of the API: :func:`train` a classifier on a release (and push it), :func:`evaluate` models on
challenge sets (and push the results), :func:`compare` the rows of a plan. Each is what its command does
(``debiased-nli train``, ``evaluate``, ``compare``), with the same checks and files, returning a result object."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..utils.params import options_of
from .options import CompareOptions, EvaluateOptions, TrainOptions

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


def train(task: "str | TaskSpec", *, model: str, out: "str | os.PathLike[str]", options: TrainOptions | None = None,
          **values: Any) -> TrainOutcome:
    """Fine-tune a sentence-pair classifier (``debiased-nli train``) and write its model card; optionally push it.

    The best model (by dev accuracy), its tokenizer (``config.id2label`` = the task's labels), the training record
    ``debiased_nli_train.json`` and the model card ``README.md`` (base model, what it trained on with the content
    fingerprint of the rows, every hyper-parameter with its source, the dev accuracy) go into ``out``; a rerun
    resumes from the last checkpoint.

        dn.train("snli", model="bert-base-uncased", out="runs/zf", release="org/debiased-snli",
                 config="z_filtered", epochs=3, push_to="org/bert-snli-zf")

    Args:
        task: a registered task, a task YAML file or a :class:`~debiased_nli.data.tasks.TaskSpec`.
        model: a Hub id or a folder of any ``AutoModelForSequenceClassification`` (an encoder gets a new head).
        out: the training folder (new, empty, or a training folder of this tool).
        options: every other option at once, a :class:`~debiased_nli.api.options.TrainOptions`.
        **values: any option of :class:`~debiased_nli.api.options.TrainOptions` by name (the rows: ``release``
            with ``config``, or ``data_files``; the hyper-parameters: ``preset``, ``epochs``, ``learning_rate``, ...;
            product of experts: ``poe``, ``poe_preset``, ...; the Hub: ``push_to``, ``push_revision``, ...),
            replacing that field of ``options``. An unknown name is refused with the closest one.
    """
    o = options_of(TrainOptions, options, values, "train()")

    from ..data.tasks import get_task
    from ..models.training import resolve_config, train_classifier

    task = get_task(task)
    _check_train(model, out, o)
    cfg, sources = resolve_config(model, str(out), preset=o.preset, given=o.hyper_parameters(), poe=o.poe,
                                  poe_preset_name=o.poe_preset, poe_beta=o.poe_beta, poe_gamma=o.poe_gamma,
                                  bias_model=o.bias_model, seed=o.seed, data_seed=o.data_seed,
                                  max_train_rows=o.max_train_rows, max_dev_rows=o.max_dev_rows,
                                  group_by_length=o.group_by_length, resume=o.resume,
                                  use_cpu=True if o.cpu else None, num_threads=o.threads, progress=o.progress)
    train_rows, train_src, dev, dev_src = _training_rows(task, o)
    from accelerate import PartialState

    main = PartialState(cpu=o.cpu).is_main_process
    if main and o.show_values:
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
    if o.push_to and main:
        from ..models.hub import push_model

        pushed = push_model(out, o.push_to, revision=o.push_revision, private=o.private, token=o.token,
                            endpoint=o.endpoint)
    return TrainOutcome(result=result, config=cfg, sources=sources, card=card if card.exists() else None,
                        pushed=pushed)


def _check_train(model: str, out: "str | os.PathLike[str]", o: TrainOptions) -> None:
    """The checks of :func:`train` before any work: the inputs named, the Hub repo and tag, the folder."""
    from ..models.training import check_train_folder
    from ..utils.errors import ConfigError
    from ..utils.paths import check_model_reference, check_release_reference

    if o.release and o.data_files:
        raise ConfigError("give either --release (with --config) or --data-files, not both")
    if o.push_to:
        from ..models.hub import check_version_tag
        from ..utils.hub import check_repo_id

        check_repo_id(o.push_to, "--push-to")
        check_version_tag(o.push_revision, "--push-revision")
    check_train_folder(out)  # before any work: never a folder of the user's
    check_model_reference(model, "--model")
    if (o.poe or o.poe_preset) and o.bias_model not in (None, "tfidf", "joint"):
        check_model_reference(o.bias_model, "--bias-model")
    if o.release:
        check_release_reference(o.release, "--release")


def _training_rows(task: "TaskSpec", o: TrainOptions) -> tuple:
    """(the training rows, their source, the dev rows or None, their source or None) of :func:`train`."""
    from ..data.loading import parse_data_files
    from ..models.training import load_training_split

    files = parse_data_files(o.data_files) if o.data_files else None
    train_rows, train_src = load_training_split(task, data_files=files, release=o.release, config=o.config,
                                                split=o.split, on_invalid=o.on_invalid, revision=o.revision,
                                                with_source=True)
    if o.max_rows:
        train_rows = train_rows.select(range(min(o.max_rows, len(train_rows))))
    dev, dev_src = None, None
    if o.dev_files:
        dev, dev_src = load_training_split(task, data_files={"validation": list(o.dev_files)}, split="validation",
                                           on_invalid=o.on_invalid, with_source=True)
    elif files and "validation" in files:
        dev, dev_src = load_training_split(task, data_files=files, split="validation", on_invalid=o.on_invalid,
                                           with_source=True)
    return train_rows, train_src, dev, dev_src


@dataclasses.dataclass
class EvaluateOutcome:
    """What :func:`evaluate` did: the results (the ``results.json`` object), the files written, the push."""

    results: dict[str, Any]
    paths: dict[str, Path]
    pushed: dict[str, Any] | None = None

    def accuracy(self, set_name: str) -> float:
        """The (mean) accuracy on one set."""
        return float(self.results["sets"][set_name]["accuracy"])


def evaluate(models: "str | Sequence[str]", *, out: "str | os.PathLike[str] | None" = None,
             options: EvaluateOptions | None = None, **values: Any) -> EvaluateOutcome:
    """Score classifiers on challenge sets (``debiased-nli evaluate``) and optionally record them on the Hub.

        dn.evaluate("runs/zf", suite="nli", out="eval/zf", push_to="org/bert-snli-zf")

    Args:
        models: a model folder or Hub id, or several (the seeds of one recipe: mean ± std).
        out: write ``results.json``, ``report.md`` and ``accuracy.png`` there (an evaluation folder of this tool, or
            new); None writes nothing.
        options: every other option at once, an :class:`~debiased_nli.api.options.EvaluateOptions`.
        **values: any option of :class:`~debiased_nli.api.options.EvaluateOptions` by name (``suite``, ``sets``,
            ``max_examples``, ``device``, ``push_to``, ...), replacing that field of ``options``. An unknown name is
            refused with the closest one.
    """
    o = options_of(EvaluateOptions, options, values, "evaluate()")

    from ..models.challenge import resolve_sets
    from ..evaluation.scores import EvalConfig, evaluate_models, evaluation_outputs, load_results, render_report
    from ..evaluation.scores import write_outputs
    from ..utils.errors import ConfigError
    from ..utils.paths import check_model_reference

    models = [models] if isinstance(models, (str, os.PathLike)) else list(models)
    if not models:
        raise ConfigError("evaluate needs at least one model (--model DIR [DIR ...])")
    if o.push_to:
        from ..utils.hub import check_repo_id

        check_repo_id(o.push_to, "--push-to")
    for model in models:
        check_model_reference(str(model), "--model")
    label_order = list(o.label_order) if o.label_order is not None else None
    if label_order is not None and (not all(label_order) or len(set(label_order)) != len(label_order)):
        raise ConfigError(f"--label-order {','.join(label_order)!r}: give each label name once, comma-separated")
    chosen = resolve_sets(o.suite, list(o.sets) if o.sets else None)
    others = {}
    items = o.compare.items() if isinstance(o.compare, Mapping) else [_named(item) for item in o.compare or []]
    for key, path in items:
        others[key] = load_results(path)
    outputs = evaluation_outputs(out) if out is not None else None  # before any model: never a file of the user's
    cfg = EvalConfig(max_examples=o.max_examples, sample_seed=o.sample_seed, batch_size=o.batch_size,
                     max_length=o.max_length, max_tokens=o.max_tokens,
                     data_root=str(o.data_root) if o.data_root is not None else None, device=o.device,
                     label_order=label_order, dtype=o.dtype, progress=o.progress)
    results = evaluate_models([str(m) for m in models], chosen, cfg)
    results["suite"] = o.suite
    name = o.name or (Path(out).name if out is not None else "this model")
    title = f"Evaluation report: {name}"
    notes = o.notes or ""
    paths = {}
    if outputs is not None:
        paths = write_outputs(results, out, outputs=outputs, name=name, compare=others, notes=notes, title=title)
    pushed = None
    if o.push_to:
        from ..models.hub import push_results

        pushed = push_results(o.push_to, results, token=o.token, endpoint=o.endpoint, private=o.private,
                              report_md=render_report(results, title=title, name=name, compare=others, notes=notes))
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


def compare(plan: "str | os.PathLike[str]", action: str = "report", *, options: CompareOptions | None = None,
            **values: Any) -> CompareOutcome:
    """Does training on a release help? (``debiased-nli compare``): the ``status`` of a plan's units, ``run`` them
    (train and score every (row, seed) not done yet; resumable), or ``report`` the finished ones (markdown, JSON
    and plots with seed-row t intervals; ``push_to`` also pushes the report beside the release on the Hub).

        dn.compare("plan.yaml", "run", workers=2)

    Args:
        plan: the plan (YAML; see docs/efficacy.md).
        action: ``"status"``, ``"run"`` or ``"report"``.
        options: every other option at once, a :class:`~debiased_nli.api.options.CompareOptions`.
        **values: any option of :class:`~debiased_nli.api.options.CompareOptions` by name (``rows``, ``seeds``,
            ``out``, ``workers``, ``push_to``, ...), replacing that field of ``options``. An unknown name is
            refused with the closest one.
    """
    o = options_of(CompareOptions, options, values, "compare()")

    from ..evaluation.compare import load_plan, unit_states
    from ..evaluation.compare.report import intervals_path
    from ..evaluation.compare.report import report as write_report
    from ..utils.errors import ConfigError

    if action not in ("status", "run", "report"):
        raise ConfigError(f"compare: the action is status, run or report, not {action!r}")
    p = load_plan(plan, runs_dir=o.runs_dir, results_dir=o.results_dir)
    if o.device:
        p.raw["device"] = o.device
    o = dataclasses.replace(o, rows=list(o.rows) if o.rows else None, seeds=list(o.seeds) if o.seeds else None)
    for row in o.rows or []:
        p.row(row)
    if action == "status":
        return CompareOutcome(action, states=unit_states(p, o.rows, o.seeds))
    if action == "run":
        code = _run_units(plan, p, o)
        if code:  # the workers' logs say why
            return CompareOutcome(action, exit_code=code, logs=p.runs_dir / "logs")
        if not o.report or o.claims:
            return CompareOutcome(action)
    if o.push_to:  # before the report: a wrong repo id wastes no bootstrap
        from ..utils.hub import check_repo_id

        check_repo_id(o.push_to, "--push-to")
    stem = Path(o.out).resolve() if o.out else None
    table = write_report(p, stem)
    stem = stem or p.results_dir.parent / p.results_dir.name
    files = [stem.with_suffix(x) for x in (".md", ".json", ".png")] + [intervals_path(stem)]
    pushed = None
    if o.push_to:
        from ..evaluation.compare.hub import push_report

        pushed = push_report(p, table, stem, o.push_to, revision=o.revision, token=o.token)
    return CompareOutcome(action, table=table, files=[f for f in files if f.exists()], stem=stem,
                          planned=len(p.rows) * len(p.seeds), pushed=pushed)


def _run_units(plan: "str | os.PathLike[str]", p, o: CompareOptions) -> int:
    """``compare run``: the units in this process, or (``workers`` > 1) in that many worker processes sharing
    the machine; the first failed worker's exit code (0: none failed)."""
    import sys
    import time

    from ..evaluation.compare import run as run_units
    from ..evaluation.compare import run_workers

    if o.workers > 1 and not o.claims:
        folder = p.runs_dir / "claims" / time.strftime("%Y%m%d-%H%M%S")
        cmd = [sys.executable, "-m", "debiased_nli.cli", "compare", "run", str(Path(plan).resolve()),
               "--no-report", "--quiet"]
        for opt, value in (("runs-dir", o.runs_dir), ("results-dir", o.results_dir), ("lock", o.lock),
                           ("device", o.device)):
            if value:
                cmd += [f"--{opt}", str(value)]
        if o.rows:
            cmd += ["--rows", *o.rows]
        if o.seeds:
            cmd += ["--seeds", *map(str, o.seeds)]
        if o.seed_major:
            cmd.append("--seed-major")
        return run_workers(cmd, o.workers, folder, p.runs_dir / "logs", env=dict(os.environ))
    run_units(p, o.rows, o.seeds, o.lock, progress=o.progress, stop_after=o.stop_after, claims=o.claims,
              seed_major=o.seed_major)
    return 0
