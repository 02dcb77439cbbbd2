"""The IBADR loop (Wang et al. 2023, section 2.2, Figure 1): every iteration in its own resumable folder.

    <out>/config.json                 the run's settings (a rerun with other settings is refused)
    <out>/iter-<k>/shallow.json       which theta_s scored the pool (trained here, or reused)
    <out>/iter-<k>/shallow/           theta_s of this iteration (when trained in it)
    <out>/iter-<k>/scores.parquet     uid, label, beta, indicator of every pool row
    <out>/iter-<k>/generator/         theta_g after this iteration (LoRA adapter or full model, checkpoints)
    <out>/iter-<k>/prompts.parquet    sample_index, indicator b-bar, label y-bar of every sample
    <out>/iter-<k>/samples/           sharded samples and unparseable rejects (debiased_nli.methods.generation.sample)
    <out>/iter-<k>/kept.parquet       the pseudo samples added to the pool (canonical + provenance)
    <out>/iter-<k>/rejected.parquet   parsed samples not added, with ``reason``
    <out>/iter-<k>/report.json        counts, rates and seconds per stage
    <out>/iter-<k>/.complete          written last: the iteration is done and is only read on a rerun

A rerun of the same call skips what is complete and continues inside the iteration that was cut
(theta_s and theta_g resume from their checkpoints, sampling from its complete shards), so killing
and relaunching gives the same pool as an uninterrupted run. ``deadline`` (a ``time.time()``) stops
between units of work (a stage, ``gen_chunk_steps`` generator steps, a shard) once passed, so a long
run can be cut into sessions; the result then has ``complete = False``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...data.loading import content_uid, labels_of
from ...data.tasks import TaskSpec
from ...utils.errors import ConfigError, EmptyResultError
from .params import PARAMS
from .indicators import STRATEGIES, assign_indicators, indicator_name, sample_indicators, sample_labels

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
COMPLETE = ".complete"
SCORE_PARTS = "scores.parts"
SCORE_SHARD_ROWS = 4096  # the project's choice: rows of beta scored between two resumable saves
CANONICAL = ["premise", "hypothesis", "label", "uid", "origin", "method"]
BIAS_CONTROL = "bias"


_D = PARAMS.defaults()


@dataclasses.dataclass
class IbadrConfig:
    """Settings of one IBADR run; the defaults are declared once, with the paper's
    values and words, in :data:`.params.PARAMS`."""

    generator: str                       # theta_g's starting point: a causal LM (Hub id or folder)
    confidence_model: str                # M of the confidence filter (a sequence classifier)
    shallow_model: str = _D["shallow_model"]
    lora: dict | None = None             # LoraOptions fields (r, alpha, dropout, target_modules); None: full model
    n_bi: int = _D["n_bi"]
    n_iter: int = _D["n_iter"]
    samples_per_iter: int = _D["samples_per_iter"]
    epsilon: float = _D["epsilon"]
    shallow_rows: int = _D["shallow_rows"]
    shallow_epochs: float = _D["shallow_epochs"]
    shallow_lr: float = _D["shallow_lr"]
    shallow_batch_size: int = _D["shallow_batch_size"]
    shallow_max_length: int = _D["shallow_max_length"]
    update_shallow: bool = _D["update_shallow"]          # USM; False: the "w/o USM" ablation
    usm_rows: int = _D["usm_rows"]
    usm_continue: bool = _D["usm_continue"]           # fine-tune the previous theta_s instead of the pretrained model
    indicator: str = _D["indicator"]        # random_low | lowest (b_r => b_1) | none (w/o bias indicator)
    iterate: bool = _D["iterate"]                 # False: "w/o iterative generation"
    gen_lr: float = _D["gen_lr"]
    gen_epochs_first: int = _D["gen_epochs_first"]
    gen_epochs_later: int = _D["gen_epochs_later"]
    gen_batch_size: int = _D["gen_batch_size"]
    gen_grad_accum: int = _D["gen_grad_accum"]
    gen_max_length: int = _D["gen_max_length"]
    gen_rows: int | None = _D["gen_rows"]          # train theta_g on a bin-stratified sample of this many pool rows
    gen_checkpoint_every: int = _D["gen_checkpoint_every"]
    top_p: float = _D["top_p"]
    temperature: float = _D["temperature"]
    max_new_tokens: int = _D["max_new_tokens"]
    sample_batch_size: int = _D["sample_batch_size"]
    shard_size: int = _D["shard_size"]
    confidence_batch_size: int = _D["confidence_batch_size"]
    seed: int = _D["seed"]
    cpu: bool = _D["cpu"]
    mixed_precision: str = _D["mixed_precision"]
    dtype: str | None = _D["dtype"]

    def validate(self) -> None:
        if self.indicator not in STRATEGIES:
            raise ConfigError(f"indicator must be one of {STRATEGIES}, not {self.indicator!r}")
        if self.n_bi < 1 or self.n_iter < 1 or self.samples_per_iter < 1:
            raise ConfigError(f"n_bi, n_iter and samples_per_iter must be >= 1 (got {self.n_bi}, {self.n_iter}, "
                              f"{self.samples_per_iter})")
        if not 0.0 <= self.epsilon < 1.0:
            raise ConfigError(f"epsilon must be in [0, 1), got {self.epsilon}")
        if self.gen_epochs_first < 1 or self.gen_epochs_later < 1:
            raise ConfigError("generator epochs must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class IbadrResult:
    pool: Any                  # S after the last finished iteration (canonical columns)
    generated: Any             # the pseudo samples in S, with provenance (iteration, indicator, confidence)
    rejected: Any              # parsed samples not added, with ``reason`` and ``stage``
    report: dict
    complete: bool


class _Paused(Exception):
    """The deadline passed between two units of work."""


def iteration_plan(cfg: IbadrConfig) -> tuple[int, int]:
    """(iterations, samples per iteration): "w/o iterative generation" samples everything from the
    generator of the first iteration (Table 5), so one iteration of n_iter x samples_per_iter."""
    return (cfg.n_iter, cfg.samples_per_iter) if cfg.iterate else (1, cfg.n_iter * cfg.samples_per_iter)


def stratified_sample(indicators: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Positions of about ``n`` rows with every indicator equally represented (seeded, sorted)."""
    rng = np.random.default_rng(seed)
    groups = [np.nonzero(indicators == g)[0] for g in np.unique(indicators)]
    per = [n // len(groups) + (1 if i < n % len(groups) else 0) for i in range(len(groups))]
    picked = [rng.choice(g, size=min(k, len(g)), replace=False) for g, k in zip(groups, per)]
    return np.sort(np.concatenate(picked))


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


def _write_parquet(ds, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    ds.to_parquet(str(tmp))
    tmp.replace(path)


def _read_parquet(path: Path):
    import datasets
    import pyarrow.parquet as pq
    return datasets.Dataset(pq.read_table(str(path)))


class _Timer:
    """Seconds per stage, summed over the sessions of a resumed iteration (``timings.json``)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {}

    def add(self, stage: str, seconds: float) -> None:
        self.data[stage] = round(self.data.get(stage, 0.0) + seconds, 2)
        _write_json(self.path, self.data)


def run_ibadr(d0, task: TaskSpec, cfg: IbadrConfig, out_dir: "str | Path", *, deadline: float | None = None,
              gen_chunk_steps: int | None = None, progress: bool = True, stop_after: str | None = None) -> IbadrResult:
    """Run (or resume) IBADR on the canonical dataset ``d0`` into ``out_dir``.

    ``stop_after`` ("iter-<k>:<stage>", stage one of shallow, scores, generator, samples) ends the
    call right after that stage, as a kill would (for tests of resuming).
    """
    import datasets
    from accelerate import PartialState

    cfg.validate()
    if len(d0) == 0:
        raise EmptyResultError("IBADR needs a non-empty pool D0")
    state = PartialState(cpu=cfg.cpu)
    if deadline is not None and state.num_processes > 1:
        raise ConfigError("a deadline would let the processes disagree on when to stop; run without one "
                          "under accelerate launch (every unit is resumable anyway)")
    out = Path(out_dir)
    import hashlib
    # D0's identity: its uids and labels (the same rows loaded again, or with other columns, match)
    digest = hashlib.sha256("\n".join(f"{u}\t{l}" for u, l in zip(d0["uid"], labels_of(d0).tolist())).encode())
    record = {"task": task.name, "d0_rows": len(d0), "d0_sha256": digest.hexdigest(), **cfg.to_dict()}
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        path = out / CONFIG_FILE
        if path.exists():
            old = json.loads(path.read_text())
            diff = {k: (old.get(k), v) for k, v in record.items() if old.get(k) != v}
            if diff:
                raise ConfigError(f"{out} holds an IBADR run with other settings (old -> new: {diff}); use another "
                                  f"output folder or the same settings to resume")
        else:
            _write_json(path, record)
    state.wait_for_everyone()

    session = _Session(out, task, cfg, state, deadline, gen_chunk_steps, progress)
    base = d0.select_columns(CANONICAL)
    n_iters, per_iter = iteration_plan(cfg)
    kept_parts, rejected_parts, reports = [], [], []
    pool = base
    complete = True
    for k in range(1, n_iters + 1):
        it = out / f"iter-{k}"
        if not (it / COMPLETE).exists():
            try:
                _iteration(k, it, pool, per_iter, session, stop_after)
            except _Paused:
                complete = False
                break
            if not (it / COMPLETE).exists():  # stopped on purpose (stop_after)
                complete = False
                break
        kept = _read_parquet(it / "kept.parquet")
        kept_parts.append(kept)
        if (it / "rejected.parquet").exists():
            rejected_parts.append(_read_parquet(it / "rejected.parquet"))
        reports.append(json.loads((it / "report.json").read_text()))
        if len(kept):
            pool = datasets.concatenate_datasets([pool, kept.select_columns(CANONICAL).cast(pool.features)])
    generated = datasets.concatenate_datasets(kept_parts) if kept_parts else None
    rejected = datasets.concatenate_datasets(rejected_parts) if rejected_parts else None
    report = {"method": "ibadr", "task": task.name, "config": cfg.to_dict(), "iterations_planned": n_iters,
              "samples_per_iteration": per_iter, "iterations_complete": len(reports), "complete": complete,
              "d0_rows": len(d0), "pool_rows": len(pool), "generated_rows": len(pool) - len(d0),
              "iterations": reports}
    return IbadrResult(pool, generated, rejected, report, complete)


def _pool_bias_degree(pool, model: str, task: TaskSpec, cfg: IbadrConfig, parts: Path, deadline,
                      progress: bool) -> np.ndarray:
    """beta of every pool row, scored in shards of ``SCORE_SHARD_ROWS`` saved under ``parts``.

    A stopped or paused session keeps the finished shards and the next one starts at the first missing
    shard, so scoring a large pool on a CPU needs no single session long enough for all of it. A shard is
    scored exactly as ``bias_degree`` scores a whole dataset (the same model, batch size and length), and
    the deadline is checked between shards (a paused scoring resumes where it stopped).
    """
    from ...models.classifier import load_classifier
    from .shallow import bias_degree

    parts.mkdir(parents=True, exist_ok=True)
    n = len(pool)
    # a whole number of batches per shard: the batches, and so every beta bit for bit, are those of one call
    step = -(-SCORE_SHARD_ROWS // cfg.confidence_batch_size) * cfg.confidence_batch_size
    bounds = [(a, min(n, a + step)) for a in range(0, n, step)]
    clf = None
    out = []
    for i, (a, b) in enumerate(bounds):
        f = parts / f"beta-{a:010d}-{b:010d}.npy"
        if not f.exists():
            _check_deadline(deadline)
            if clf is None:
                clf = load_classifier(model)
            if progress and len(bounds) > 1:
                print(f"bias degree: rows {a:,}-{b:,} of {n:,} (shard {i + 1}/{len(bounds)})", flush=True)
            beta = bias_degree(pool.select(range(a, b)), clf, task, batch_size=cfg.confidence_batch_size,
                               max_length=cfg.shallow_max_length, progress=progress)
            tmp = f.with_name(f".{f.stem}.tmp.npy")
            np.save(tmp, np.asarray(beta, dtype=np.float64))
            tmp.replace(f)
        out.append(np.load(f))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float64)


@dataclasses.dataclass
class _Session:
    """What every stage of one call of :func:`run_ibadr` shares: the run folder, the task, the settings,
    accelerate's state, the deadline, the generator's steps between deadline checks and the progress bars."""

    out: Path
    task: TaskSpec
    cfg: IbadrConfig
    state: Any
    deadline: float | None
    gen_chunk_steps: int | None
    progress: bool


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.time() > deadline:
        raise _Paused()


def _iteration(k: int, it: Path, pool, n_samples: int, session: _Session, stop_after) -> None:
    """Iteration k of IBADR in ``it``: each stage not yet on disk runs (theta_s, the bias indicators of
    the pool, theta_g, the samples, the confidence filter) and the iteration is marked complete. Returns
    early after the stage ``stop_after`` names."""
    task, cfg, state, deadline, progress = session.task, session.cfg, session.state, session.deadline, session.progress
    main = state.is_main_process
    if main:
        it.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    timer = _Timer(it / "timings.json")

    def stop(stage: str) -> bool:
        return stop_after == f"iter-{k}:{stage}"

    # ---- step 1: theta_s and the bias indicators --------------------------------------------------
    uses_indicator = cfg.indicator != "none"
    if uses_indicator:
        if not (it / "shallow.json").exists():
            _shallow_stage(k, it, pool, session, timer)
            if stop("shallow"):
                return
        shallow = json.loads((it / "shallow.json").read_text())
        if not (it / "scores.parquet").exists():
            _scores_stage(it, pool, shallow["model"], session, timer)
            if stop("scores"):
                return
        scores = _read_parquet(it / "scores.parquet")
        indicators = np.asarray(scores["indicator"], dtype=np.int64)
    else:
        shallow, scores, indicators = None, None, None

    # ---- step 2: fine-tune theta_g on S with L_g = -sum log p(x | b, y) ---------------------------
    gen_dir = it / "generator"
    if not (gen_dir / "train_report.json").exists():
        _train_generator(k, gen_dir, pool, indicators, session, timer)
        if stop("generator"):
            return
    gen_report = json.loads((gen_dir / "train_report.json").read_text())

    # ---- step 3: sample x-bar ~ p_g(. | b-bar, y-bar) ----------------------------------------------
    from ..generation.sample import REPORT_FILE, load_generated

    fmt, bbar, ybar, prompts = _draw_prompts(k, gen_dir, task, cfg, n_samples, uses_indicator)
    if main and not (it / "prompts.parquet").exists():
        import datasets
        _write_parquet(datasets.Dataset.from_dict({"sample_index": list(range(n_samples)), "indicator": bbar.tolist(),
                                                   "label": ybar.tolist()}), it / "prompts.parquet")
    samples = it / "samples"
    if not (samples / REPORT_FILE).exists():
        _samples_stage(k, gen_dir, samples, n_samples, fmt, prompts, session, timer)
        if stop("samples"):
            return
    if not main:
        state.wait_for_everyone()
        return

    # ---- step 4: confidence filter, expand S -------------------------------------------------------
    _check_deadline(deadline)
    t0 = time.perf_counter()
    rows = load_generated(str(samples))
    kept, rejected, filt = _filter(k, rows, pool, bbar, task, cfg, progress)
    if uses_indicator:  # the bias degree of the new rows under this iteration's theta_s, for the report
        kept = _with_beta(kept, shallow["model"], task, cfg)
        rejected = _with_beta(rejected, shallow["model"], task, cfg)
        filt["beta_mean_kept"] = round(float(np.mean(kept["beta"])), 4) if len(kept) else None
    _write_parquet(kept, it / "kept.parquet")
    _write_parquet(rejected, it / "rejected.parquet")
    timer.add("filter", time.perf_counter() - t0)
    report = _iteration_report(k, pool, kept, {"shallow": shallow, "scores": scores, "generator": gen_report,
                                               "samples": samples, "indicators": bbar if uses_indicator else None,
                                               "filter": filt}, session, timer)
    _write_json(it / "report.json", report)
    (it / COMPLETE).write_text("")
    state.wait_for_everyone()


def _shallow_stage(k: int, it: Path, pool, session: _Session, timer: _Timer) -> None:
    """Step 1a: theta_s of iteration k (see :func:`_shallow`), recorded in ``shallow.json``."""
    out, task, cfg, state, deadline, progress = (session.out, session.task, session.cfg, session.state,
                                                 session.deadline, session.progress)
    _check_deadline(deadline)
    t0 = time.perf_counter()
    info = _shallow(k, it, out, pool, task, cfg, progress)
    if state.is_main_process:
        _write_json(it / "shallow.json", info)
        timer.add("shallow", time.perf_counter() - t0)
    state.wait_for_everyone()


def _scores_stage(it: Path, pool, shallow_model: str, session: _Session, timer: _Timer) -> None:
    """Step 1b: beta of every pool row under theta_s and its bias indicator, in ``scores.parquet``."""
    task, cfg, state, deadline, progress = session.task, session.cfg, session.state, session.deadline, session.progress
    _check_deadline(deadline)
    t0 = time.perf_counter()
    if state.is_main_process:
        beta = _pool_bias_degree(pool, shallow_model, task, cfg, it / SCORE_PARTS, deadline, progress)
        ind = assign_indicators(beta, pool["uid"], cfg.n_bi)
        import datasets
        scores = datasets.Dataset.from_dict({"uid": pool["uid"], "label": labels_of(pool).tolist(),
                                             "beta": beta.tolist(), "indicator": ind.tolist()})
        _write_parquet(scores, it / "scores.parquet")
        timer.add("scores", time.perf_counter() - t0)
        shutil.rmtree(it / SCORE_PARTS, ignore_errors=True)  # scores.parquet holds them now
    state.wait_for_everyone()


def _draw_prompts(k: int, gen_dir: Path, task: TaskSpec, cfg: IbadrConfig, n_samples: int, uses_indicator: bool):
    """The conditional format of theta_g and, seeded by iteration, the indicator b-bar and label y-bar of
    every sample and its prompt: (format, b-bar, y-bar, prompts)."""
    from ..generation.conditional import ConditionalFormat
    from ..generation.models import load_tokenizer

    tok = load_tokenizer(str(gen_dir))
    fmt = ConditionalFormat.for_tokenizer(tok, task.labels, (BIAS_CONTROL,) if uses_indicator else ())
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, k, 1]))
    bbar = (sample_indicators(n_samples, cfg.n_bi, rng, cfg.indicator) if uses_indicator
            else np.zeros(n_samples, dtype=np.int64))
    ybar = sample_labels(n_samples, task.num_labels, rng)
    prompts = [fmt.prompt(int(y), {BIAS_CONTROL: indicator_name(b)} if uses_indicator else None)
               for b, y in zip(bbar, ybar)]
    return fmt, bbar, ybar, prompts


def _samples_stage(k: int, gen_dir: Path, samples: Path, n_samples: int, fmt, prompts: list, session: _Session,
                   timer: _Timer) -> None:
    """Step 3: the samples of theta_g from ``prompts`` into ``samples`` (one shard per session unit under a
    deadline)."""
    task, cfg, deadline, progress = session.task, session.cfg, session.deadline, session.progress
    main = session.state.is_main_process
    from ..generation.sample import Prompting, SamplingOptions, generate_samples

    sampling = SamplingOptions(shard_size=cfg.shard_size, seed=cfg.seed + k, batch_size=cfg.sample_batch_size,
                               top_p=cfg.top_p, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                               dtype=cfg.dtype)
    while True:
        _check_deadline(deadline)
        t0 = time.perf_counter()
        res = generate_samples(str(gen_dir), str(samples), task, n_samples, sampling,
                               Prompting("prompts", prompts=prompts, parse=fmt.parse), cpu=cfg.cpu, progress=progress,
                               stop_after_shards=1 if deadline is not None else None)
        if main:
            timer.add("samples", time.perf_counter() - t0)
        if "stopped_after_shards" not in res:
            break


def _with_beta(ds, shallow_model: str, task: TaskSpec, cfg: IbadrConfig):
    """``ds`` with the bias degree of its rows under theta_s (column ``beta``)."""
    from .shallow import bias_degree

    beta = bias_degree(ds, shallow_model, task, batch_size=cfg.confidence_batch_size,
                       max_length=cfg.shallow_max_length, progress=False) if len(ds) else []
    return _add(ds, "beta", [float(b) for b in beta])


def _iteration_report(k: int, pool, kept, stages: dict, session: _Session, timer: _Timer) -> dict:
    """``report.json`` of iteration k: pool sizes, theta_s, the score summary, theta_g's training, the
    samples, the indicators drawn (``stages["indicators"]``: b-bar, None without indicators), the filter and the
    seconds per stage."""
    task, cfg = session.task, session.cfg
    shallow, scores, gen_report, samples = stages["shallow"], stages["scores"], stages["generator"], stages["samples"]
    bbar, filt, uses_indicator = stages["indicators"], stages["filter"], stages["indicators"] is not None
    from ..generation.sample import summarize

    return {"iteration": k, "pool_before": len(pool), "pool_after": len(pool) + len(kept), "kept": len(kept),
            "shallow": shallow, "scores": _score_summary(scores, cfg.n_bi) if scores is not None else None,
            "generator": {key: gen_report.get(key) for key in ("model", "rows", "steps", "epochs", "seconds",
                                                               "seconds_per_step", "batch_size", "lr", "lora",
                                                               "parameters")}
            | {"loss_first": (gen_report.get("history") or [{}])[0].get("loss"),
               "loss_last": (gen_report.get("history") or [{}])[-1].get("loss")},
            "samples": {key: v for key, v in summarize(samples, task).items() if key != "config"},
            "indicators_drawn": {indicator_name(b): int(c) for b, c in zip(*np.unique(bbar, return_counts=True))}
            if uses_indicator else None,
            "filter": filt, "seconds": timer.data}


def _shallow(k: int, it: Path, out: Path, pool, task: TaskSpec, cfg: IbadrConfig, progress: bool) -> dict:
    """theta_s of iteration k: trained on D0 in the first iteration; afterwards re-trained on a fresh
    sample of the pool (USM) or the first one reused (w/o USM)."""
    from .shallow import ShallowTraining, train_shallow

    if k > 1 and not cfg.update_shallow:
        first = json.loads((out / "iter-1" / "shallow.json").read_text())
        return {**first, "reused_from": "iter-1"}
    rows = cfg.shallow_rows if k == 1 else cfg.usm_rows
    start = cfg.shallow_model
    if k > 1 and cfg.usm_continue:
        start = json.loads((out / f"iter-{k - 1}" / "shallow.json").read_text())["model"]
    training = ShallowTraining(rows=rows, epochs=cfg.shallow_epochs, lr=cfg.shallow_lr, seed=cfg.seed + k,
                               batch_size=cfg.shallow_batch_size, max_length=cfg.shallow_max_length)
    res = train_shallow(pool, task, start, it / "shallow", training, progress=progress)
    return {"model": str(it / "shallow"), "started_from": start, "train_rows": min(rows, len(pool)),
            "pool_rows": len(pool), "sample_seed": cfg.seed + k, "epochs": cfg.shallow_epochs, "lr": cfg.shallow_lr,
            "train_seconds": res.get("train_seconds")}


def _train_generator(k, gen_dir: Path, pool, indicators, session: _Session, timer: _Timer) -> None:
    """Step 2: theta_g of iteration k, continued from the previous iteration's (in chunks under a deadline)."""
    out, task, cfg, deadline, progress = session.out, session.task, session.cfg, session.deadline, session.progress
    gen_chunk_steps, main = session.gen_chunk_steps, session.state.is_main_process
    from ..generation.conditional import CONTROL_PREFIX
    from ..generation.models import LoraOptions
    from ..generation.train import GeneratorTraining, checkpoints, train_generator

    train = pool.select_columns(["premise", "hypothesis", "label"])
    if indicators is not None:
        train = train.add_column(CONTROL_PREFIX + BIAS_CONTROL, [indicator_name(b) for b in indicators])
    if cfg.gen_rows and cfg.gen_rows < len(train):
        strata = indicators if indicators is not None else np.zeros(len(train), dtype=np.int64)
        train = train.select(stratified_sample(strata, cfg.gen_rows, cfg.seed + k))
    start = cfg.generator if k == 1 else str(out / f"iter-{k - 1}" / "generator")
    lora = LoraOptions(**cfg.lora) if (cfg.lora is not None and k == 1) else None
    epochs = cfg.gen_epochs_first if k == 1 else cfg.gen_epochs_later
    chunk = gen_chunk_steps if deadline is not None else None
    # train_generator's stop_after stops like a kill (no final save), so the last chunk runs without it
    total = max(math.ceil(len(train) / cfg.gen_batch_size) // cfg.gen_grad_accum, 1) * epochs
    training = GeneratorTraining(mode="conditional", lora=lora, epochs=epochs, batch_size=cfg.gen_batch_size,
                                 grad_accum=cfg.gen_grad_accum, lr=cfg.gen_lr, max_length=cfg.gen_max_length,
                                 checkpoint_every=chunk or cfg.gen_checkpoint_every, seed=cfg.seed + k,
                                 mixed_precision=cfg.mixed_precision, log_every=1 if chunk else 10)
    while True:
        _check_deadline(deadline)
        done = [int(p.name.split("-")[1]) for p in checkpoints(gen_dir)]
        stop_after = chunk if chunk and total - max(done, default=0) > chunk else None
        t0 = time.perf_counter()
        res = train_generator(train, task, start, str(gen_dir), training, cpu=cfg.cpu, progress=progress,
                              stop_after=stop_after)
        if main:
            timer.add("generator", time.perf_counter() - t0)
        if "stopped_at" not in res:
            break
    if main:
        report = json.loads((gen_dir / "train_report.json").read_text())
        report["epochs"] = epochs
        report["started_from"] = start
        _write_json(gen_dir / "train_report.json", report)


def _add(ds, name: str, values) -> Any:
    """``add_column`` on a selection (``datasets`` refuses it on an index mapping, empty or not; and an empty
    selection can flatten to its table's rows, so an empty one starts from no rows)."""
    if not len(ds):
        import datasets
        ds = datasets.Dataset.from_dict({c: [] for c in ds.column_names}, features=ds.features)
    return ds.flatten_indices().add_column(name, list(values))


def _filter(k: int, rows, pool, bbar: np.ndarray, task: TaskSpec, cfg: IbadrConfig, progress: bool):
    """Confidence filtering (keep p_M(y-bar | x-bar) > epsilon) of the parsed samples, after dropping
    exact repeats within the iteration; the kept rows get iteration uids and their provenance."""
    import datasets

    from ..confidence import confidence_filter, confidence_report

    method = stage = f"ibadr:iter-{k}"
    names = task.labels
    labels = labels_of(rows) if len(rows) else np.zeros(0, dtype=np.int64)
    uids = [content_uid(p, h, names[l], prefix=f"{method}:") for p, h, l in zip(rows["premise"], rows["hypothesis"], labels)]
    seen, first = set(), []
    for i, u in enumerate(uids):
        if u not in seen:
            seen.add(u)
            first.append(i)
    dup = sorted(set(range(len(rows))) - set(first))
    sample_index = np.asarray(rows["sample_index"], dtype=np.int64)
    features = datasets.Features({**{c: pool.features[c] for c in CANONICAL}, "sample_index": datasets.Value("int64"),
                                  "indicator": datasets.Value("int64")})
    base = datasets.Dataset.from_dict({
        "premise": list(rows["premise"]), "hypothesis": list(rows["hypothesis"]), "label": labels.tolist(),
        "uid": uids, "origin": ["generated"] * len(rows), "method": [method] * len(rows),
        "sample_index": sample_index.tolist(), "indicator": [int(bbar[i]) for i in sample_index]}, features=features)
    reason_features = datasets.Features({**features, "confidence": datasets.Value("float64"),
                                         "reason": datasets.Value("string")})
    filt: dict[str, Any] = {"parsed": len(rows), "repeats_within_iteration": len(dup), "epsilon": cfg.epsilon}
    unique = base.select(first).flatten_indices()
    if len(unique):
        kept, conf_rej = confidence_filter(unique, cfg.confidence_model, task, cfg.epsilon,
                                           batch_size=cfg.confidence_batch_size, progress=progress)
        filt.update(confidence_report(kept, conf_rej, task, cfg.epsilon))
        reasons = [f"confidence {c:.4f} <= epsilon {cfg.epsilon}" for c in conf_rej["confidence"]]
        conf_rej = _add(conf_rej.remove_columns(["rejected_by"]), "reason", reasons).cast(reason_features)
    else:
        kept = datasets.Dataset.from_dict({c: [] for c in reason_features if c != "reason"},
                                          features=datasets.Features({c: v for c, v in reason_features.items() if c != "reason"}))
        conf_rej = datasets.Dataset.from_dict({c: [] for c in reason_features}, features=reason_features)
        filt.update({"kept": 0, "rejected": 0, "acceptance_rate": None})
    pool_keys = set(zip(pool["premise"], pool["hypothesis"], labels_of(pool).tolist()))
    filt["copies_of_pool_rows_kept"] = int(sum((p, h, l) in pool_keys for p, h, l in
                                               zip(kept["premise"], kept["hypothesis"], labels_of(kept).tolist())))
    kept = _add(kept, "ibadr_iteration", [k] * len(kept))
    dups = base.select(dup).flatten_indices()
    dups = _add(_add(dups, "confidence", [None] * len(dups)), "reason",
                [f"repeat of an earlier sample of iteration {k}"] * len(dups)).cast(reason_features)
    rejected = datasets.concatenate_datasets([conf_rej, dups])
    rejected = _add(_add(rejected, "stage", [stage] * len(rejected)), "ibadr_iteration", [k] * len(rejected))
    return kept, rejected, filt


def _score_summary(scores, n_bi: int) -> dict:
    beta = np.asarray(scores["beta"], dtype=np.float64)
    ind = np.asarray(scores["indicator"], dtype=np.int64)
    groups = {}
    for g in range(1, n_bi + 1):
        b = beta[ind == g]
        groups[indicator_name(g)] = {"rows": int(len(b)), "beta_min": round(float(b.min()), 4),
                                     "beta_mean": round(float(b.mean()), 4), "beta_max": round(float(b.max()), 4)}
    return {"rows": int(len(beta)), "beta_mean": round(float(beta.mean()), 4),
            "beta_quantiles": {q: round(float(np.quantile(beta, q)), 4) for q in (0.1, 0.25, 0.5, 0.75, 0.9)},
            "groups": groups}
