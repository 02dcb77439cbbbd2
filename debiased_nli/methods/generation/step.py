"""Builder steps of the generation pipeline: ``step(ds, task, params) -> (out_ds, dropped_or_None, report)``.

* :func:`train_generator_step` trains G (``mode: generator``) or G* (``mode: debias``; the input is
  z-filtered into Z(D0) and Z-(D0) first) and returns the input unchanged (the model is the product,
  its folder is ``report["out"]``).
* :func:`generate_step` samples ``num_samples`` rows from ``params["generator"]``; the unparseable
  samples are the dropped set.
* :func:`train_m_step` fine-tunes the confidence model M on D0 (Sec. 2.2.2: "We train an NLI model M with the
  original dataset D0") and returns the input unchanged (M's folder is ``report["out"]``).
* :func:`confidence_filter_step` keeps the rows M is confident of (tau); the others are dropped.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...data.tasks import TaskSpec
from ...utils.outputs import print_values
from .params import GENERATOR_TRAINING, PAPER_DEFAULTS, SAMPLING, TRAIN_M_PARAMS, resolve


def _p(params: dict, key: str, default: Any = None) -> Any:
    value = params.get(key)
    return default if value is None else value


def _is_main_process(cpu: bool = False) -> bool:
    from accelerate import PartialState
    return PartialState(cpu=bool(cpu)).is_main_process  # the first state decides: keep --cpu


def generator_training_values(params: dict) -> tuple[dict, dict]:
    """The training values a generator step uses (``params`` where set, else Table 7's) and their sources."""
    return resolve(GENERATOR_TRAINING, params)


def sampling_values(params: dict, task: TaskSpec) -> tuple[dict, dict]:
    """The sampling values a generate step uses and their sources (``num_samples``: Table 8's for
    SNLI/MNLI, 1,000 for other tasks, the project's choice)."""
    values, sources = resolve(SAMPLING, params)
    if values["num_samples"] is None:
        n = PAPER_DEFAULTS["num_samples"].get(task.name)
        values["num_samples"] = 1000 if n is None else n
        if n is None:
            sources["num_samples"] = f"project's choice (the paper samples SNLI and MNLI only, not {task.name})"
    return values, sources


def train_generator_step(ds, task: TaskSpec, params: dict, *, show_values: bool = False):
    from .models import LoraOptions
    from .train import GeneratorTraining, debias_training_set, train_generator

    mode = _p(params, "mode", "generator")
    v, sources = generator_training_values(params)
    if show_values and _is_main_process(_p(params, "cpu", False)):
        print_values(f"train-generator ({mode}) values", v, sources)
    lora = None
    if _p(params, "lora", False):
        lora = LoraOptions(r=_p(params, "lora_r", 8), alpha=_p(params, "lora_alpha", 16),
                           dropout=_p(params, "lora_dropout", 0.05),
                           target_modules=_p(params, "lora_targets", "all-linear"))
    train_ds, zinfo = ds, None
    if mode == "debias":
        # Z(D0) as the build makes it (generator_source passes the recipe's seed and settings)
        from ...bias.compose import z_filtered_original
        z = z_filtered_original(ds, task, hypothesis_only=_p(params, "hypothesis_only", "tfidf"),
                                folds=_p(params, "folds", 5), seed=_p(params, "z_seed", _p(params, "seed", 0)),
                                top_k=_p(params, "top_k", 20), batch_size=_p(params, "z_batch_size", 1000),
                                p0=_p(params, "p0", "uniform"), min_z=_p(params, "min_z", 0.0),
                                progress=_p(params, "progress", True))
        train_ds = debias_training_set(z.kept, z.rejected)
        zinfo = z.counts
    training = GeneratorTraining(
        mode=mode, lora=lora, max_steps=params.get("max_steps"), epochs=v["epochs"], batch_size=v["batch_size"],
        grad_accum=v["grad_accum"], lr=v["lr"], eps=v["eps"], betas=tuple(v["betas"]), scheduler=v["scheduler"],
        warmup_steps=v["warmup_steps"], weight_decay=v["weight_decay"], lam=v["lam"], alpha=v["alpha"],
        max_length=v["max_length"], checkpoint_every=v["checkpoint_every"], seed=v["seed"],
        group_by_length=bool(v["group_by_length"]), mixed_precision=v["mixed_precision"],
        log_every=_p(params, "log_every", 10))
    report = train_generator(train_ds, task, v["model"], params["out"], training, cpu=_p(params, "cpu", False),
                             merge=_p(params, "merge", False), progress=_p(params, "progress", True))
    report["out"] = params["out"]
    report["value_sources"] = sources
    if zinfo is not None:
        report["z_filter"] = zinfo
        if int(os.environ.get("RANK", "0")) == 0:  # the card written at save time, now with the z-filter counts
            import json

            from .models import is_adapter_folder, write_generator_card
            rp = Path(params["out"]) / "train_report.json"  # the saved report has the z-filter's counts too
            if rp.is_file():
                saved = json.loads(rp.read_text())
                saved["z_filter"] = zinfo
                tmp = rp.with_name(f".{rp.name}.tmp")
                tmp.write_text(json.dumps(saved, indent=2, default=str))
                os.replace(tmp, rp)
            # an adapter: a new LoRA, or one continued (G* from a LoRA G, with no --lora given)
            write_generator_card(params["out"], report, task,
                                 adapter=report.get("lora") is not None or is_adapter_folder(params["out"]))
    return ds, None, report


def generate_step(ds, task: TaskSpec, params: dict, *, show_values: bool = False):
    """Samples from ``params["generator"]``; ``ds`` gives the premises when ``condition`` is not none."""
    from .sample import Prompting, SamplingOptions, generate_samples, load_generated

    v, sources = sampling_values(params, task)
    if show_values and _is_main_process(_p(params, "cpu", False)):
        print_values("generate values", v, sources)
    condition = _p(params, "condition", "none")
    premises = list(ds["premise"]) if condition != "none" and ds is not None else None
    sampling = SamplingOptions(num_shards=params.get("num_shards"), shard_size=v["shard_size"], seed=v["seed"],
                               batch_size=v["batch_size"], top_p=v["top_p"], temperature=v["temperature"],
                               max_new_tokens=v["max_new_tokens"], engine=_p(params, "engine", "fast"),
                               dtype=params.get("dtype"))
    report = generate_samples(params["generator"], params["out"], task, v["num_samples"], sampling,
                              Prompting(condition, premises=premises), cpu=_p(params, "cpu", False),
                              progress=_p(params, "progress", True),
                              stop_after_shards=params.get("stop_after_shards"), extend=bool(params.get("extend")))
    rows = load_generated(params["out"])
    rejects = load_generated(params["out"], "rejects")
    return rows, rejects, report


def train_m_step(ds, task: TaskSpec, params: dict):
    """Fine-tune M on ``ds`` (D0) into ``params["out"]``, as ``debiased-nli train TASK --data-files train=D0
    validation=DEV`` does; a rerun resumes from M's last checkpoint. Returns (ds, None, M's training result)."""
    from ...models.training import (check_train_folder, load_training_split, resolve_config, train_classifier,
                                    training_source)

    p = TRAIN_M_PARAMS.merge(params, "the train_m step")
    check_train_folder(p["out"])
    given = {"learning_rate": p["lr"], "batch_size": p["batch_size"], "max_length": p["max_length"],
             "epochs": p["epochs"]}
    cfg, sources = resolve_config(p["model"], str(p["out"]), given=given, seed=p["seed"],
                                  use_cpu=True if p["cpu"] else None, num_threads=p["threads"],
                                  progress=p["progress"])
    dev = dev_src = None
    if p["dev_files"]:
        files = [p["dev_files"]] if isinstance(p["dev_files"], str) else list(p["dev_files"])
        dev, dev_src = load_training_split(task, data_files={"validation": files}, split="validation",
                                           with_source=True)
    train_src = training_source(inputs=(p["source"] or {}).get("inputs") or ())
    result = train_classifier(cfg, task, ds, dev, data={"train": train_src, **({"dev": dev_src} if dev_src else {})},
                              sources=sources)
    return ds, None, {**result.to_dict(), "out": str(p["out"])}


def confidence_filter_step(ds, task: TaskSpec, params: dict):
    """(kept, rejected, report) of the confidence filter (its parameters: :data:`..confidence.PARAMS`).
    ``params["calibration"]`` (held-out real rows with gold labels, a Dataset) calibrates M first and applies tau
    to the calibrated probabilities; the report then holds the calibration (``report["calibration"]``: the method,
    NLL and ECE before and after). ``tau_rule: min_kept`` chooses tau from M's acceptance curve
    (:func:`..confidence.choose_tau`); the report then has the curve (``acceptance_curve``), the tau tried first
    (``tau_given``), the tau used (``tau``) and why (``tau_note``)."""
    from ..confidence import (PARAMS, MScoring, acceptance_curve, calibrate, check_taus, choose_tau,
                              confidence_report, load_calibrator, score_confidence, split_at_tau)

    p = PARAMS.merge(params, "the confidence filter")
    model = p["model"]
    scoring = MScoring(batch_size=p["batch_size"], max_length=p["max_length"], progress=p["progress"])
    taus = check_taus(p["taus"]) if p["tau_rule"] == "min_kept" else None
    calibration = calibrator = None
    held_out = p["calibration"]
    if isinstance(held_out, str):  # a recipe names a file of held-out real rows
        from ...data.loading import load_task
        held_out = load_task(task, "train", data_files={"train": [held_out]}).dataset
    if held_out is not None and p["calibrator"] is not None:
        from ...utils.errors import ConfigError
        raise ConfigError("the confidence filter takes held-out rows to calibrate M on (calibration) or an earlier "
                          "run's fitted calibrator (calibrator), not both")
    if p["calibrator"] is not None:
        calibrator, calibration = load_calibrator(p["calibrator"])
    elif held_out is not None:
        model, calibrator, calibration = calibrate(held_out, model, task, method=p["calibration_method"],
                                                   scoring=scoring)
    scored = score_confidence(ds, model, task, scoring=scoring, calibrator=calibrator, probabilities=p["probabilities"],
                              reuse_probabilities=p["reuse_probabilities"])
    tau, extra = p["tau"], {}
    if taus is not None:
        from ...data.loading import labels_of
        curve = acceptance_curve(scored["confidence"], sorted(set(taus) | {tau}), labels=labels_of(scored),
                                 label_names=list(task.labels))
        tau, note = choose_tau(curve, p["tau"], p["min_kept"])
        extra = {"tau_rule": "min_kept", "tau_given": p["tau"], "min_kept": p["min_kept"], "acceptance_curve": curve,
                 "tau_note": note}
    kept, rejected = split_at_tau(scored, tau)
    report = {**confidence_report(kept, rejected, task, tau), **extra}
    if calibration is not None:
        report["calibration"] = calibration
    return kept, rejected, report


# the generator step's values that name a model or a file (a leading ~ is the user's home, as on a command line)
PATH_KEYS = {"train": ("model",), "debias": ("model",), "train_m": ("model", "dev_files"),
             "confidence": ("model", "calibration", "calibrator"), None: ("generator",)}


def expand_paths(params: dict) -> dict:
    """A copy of a generator step's values with ``~`` expanded in the values that name a model or a file."""
    out = dict(params)
    for part, keys in PATH_KEYS.items():
        holder = out if part is None else out.get(part)
        if not isinstance(holder, dict):
            continue
        holder = dict(holder)
        for k in keys:
            v = holder.get(k)
            if isinstance(v, str) and v.startswith("~"):
                holder[k] = os.path.expanduser(v)
            elif isinstance(v, list):
                holder[k] = [os.path.expanduser(x) if isinstance(x, str) and x.startswith("~") else x for x in v]
        if part is None:
            out = holder
        else:
            out[part] = holder
    return out


def debias_params(debias: dict, recipe: dict, seed: int) -> dict:
    """G*'s training values: ``debias`` on top of the build's own Z(D0) settings (the recipe's seed, hypothesis-only
    model and z-filter values), so that G* learns from the Z(D0) the release has."""
    zc, fc = recipe.get("z_filter", {}), recipe.get("features", {})
    same_z = {"z_seed": seed, "hypothesis_only": fc.get("hypothesis_only", "tfidf"), "folds": fc.get("folds", 5),
              "top_k": zc.get("top_k", 20), "z_batch_size": zc.get("batch_size", 1000), "p0": zc.get("p0", "uniform"),
              "min_z": zc.get("min_z", 0.0)}
    return {**same_z, **dict(debias)}


def generator_source(task: TaskSpec, params: dict, ctx: dict | None = None):
    """A recipe *source step* (``(task, params, ctx) -> (new rows, None, reports)``) running the paper's whole
    generation pipeline: train G on D0 (``train``), optionally fine-tune G* (``debias``), sample (``generate``)
    and confidence-filter (``confidence``). Each sub-dict holds that step's params; ``generator`` names an
    already trained G and skips ``train``. D0 is read from ``params["data_files"]`` or ``ctx["recipe"]``'s
    data; G* learns from the Z(D0) of ``params["seed"]`` (the build's seed). The reports are returned by part (``train``,
    ``debias``, ``generate``, ``confidence``: its counts). The rows the confidence filter drops are
    returned as the step's dropped rows, each with M's ``confidence`` and its ``rejected_by``: the build
    records them beside the new rows (``decisions/new_rows/...``, :mod:`debiased_nli.release.decisions`)."""
    from ...data.loading import load_task

    ctx = ctx if ctx is not None else {}
    params = expand_paths(params)
    reports: dict[str, Any] = {}
    generator = params.get("generator")
    d0 = d0_source = None
    # D0 is read for training G or G*, and for the premises a premise-conditioned sampler starts from
    needs_premises = "premise" in str((params.get("generate") or {}).get("condition") or "none")
    if generator is None or params.get("debias") or needs_premises or params.get("train_m"):
        data = (ctx.get("recipe") or {}).get("data", {})
        loaded = load_task(task, data.get("split", "train"),
                           data_files=params.get("data_files") or data.get("data_files"),
                           on_invalid=data.get("on_invalid", "error"), max_rows=data.get("max_rows"))
        d0, d0_source = loaded.dataset, loaded.source
    if generator is None:
        train = dict(params["train"])
        _, _, reports["train"] = train_generator_step(d0, task, {**train, "mode": "generator"}, show_values=True)
        generator = train["out"]
    if params.get("debias"):
        debias = debias_params(params["debias"], ctx.get("recipe") or {}, int(params.get("seed") or 0))
        _, _, reports["debias"] = train_generator_step(d0, task, {"model": generator, **debias, "mode": "debias"},
                                                       show_values=True)
        generator = debias["out"]
    rows, rejects, reports["generate"] = generate_step(d0, task, {**params["generate"], "generator": generator},
                                                       show_values=True)
    dropped = None
    confidence = dict(params.get("confidence") or {})
    if params.get("train_m"):  # M trained on D0 here; the filter scores with it
        _, _, reports["train_m"] = train_m_step(d0, task, {**params["train_m"], "source": d0_source})
        confidence["model"] = params["train_m"]["out"]
    if confidence:
        rows, dropped, reports["confidence"] = confidence_filter_step(rows, task, confidence)
    keep = ["premise", "hypothesis", "label", "uid", "origin", "method"]
    return rows.select_columns(keep), dropped, reports
