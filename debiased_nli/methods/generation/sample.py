"""Sampling new rows from a trained generator: sharded by rank, one Parquet file per shard, resumable.

The requested number of samples is split into ``num_shards`` shards (default: one per
``shard_size`` samples, at least one per process); process ``rank`` of ``world`` takes shards
``rank, rank + world, ...``. Shard i has its own seed (``SeedSequence([seed, i])``), so its content
does not depend on which process made it, how many there were, or whether the run was interrupted: a
2-process run writes the same shards as a 1-process run.

A shard is written to a temporary name (``.shard-*.tmp``) and renamed when complete; its rejects
file is renamed before it, so a present shard file means the shard is done, and a rerun skips it
(killing a run and starting it again gives the same final set as an uninterrupted run). The run's
parameters are stored in ``generate_config.json``; a rerun with other parameters into the same
folder is refused rather than mixing two runs.

Two engines sample, up to ``max_new_tokens`` each (default 128: a sequence as long as the longest the
generator was trained on, Table 7's "max sequence length 128", is never cut and rejected):

* ``fast`` (the default), :class:`SlotSampler`: ``batch_size`` sequences in flight; a sequence that
  writes its end marker leaves the batch at once and the next prompt takes its slot (prompts sorted by
  length, so a refill carries little padding); keys and values are written in place and attended with
  an attention function made for one-token steps (grouped-query heads without copies). Sample j of
  shard i draws token t as the inverse CDF of the model's distribution at its own uniform number
  ``u[t]``, ``u = default_rng([seed_i, j]).random(max_new_tokens)``: exact sampling from that
  distribution (the same temperature and top-p warpers as ``model.generate``), and a sample does not
  depend on the batch size, the other samples or their order.
* ``generate``: ``model.generate(do_sample=True)`` on consecutive, left-padded batches, torch's
  generator seeded with ``seed_i`` once per shard (every sequence runs until the whole batch ends).
* ``ctranslate2`` (:mod:`.ct2`, the optional extra ``[ctranslate2]``): the generator, its LoRA adapter
  merged, converted once into a cached CTranslate2 model and sampled by CTranslate2 in float32 (``--dtype``:
  its compute type; int8 shifts the label shares), each shard with a fresh generator seeded with ``seed_i``;
  like ``generate``, a sample depends on the batch it ran in.

For one seed the two give different samples, and cannot give the same: ``generate`` draws each step's
tokens with ``torch.multinomial`` over the whole batch from one shared generator, so a sample's tokens
depend on which samples share its batch, their padding and the rows that already ended (which keep
drawing). Reproducing those draws would mean keeping exactly that batch composition, the waste the fast
engine removes. Both sample from the same distributions; the fast engine's draws are, in addition,
independent of the batching. (In float32 a sample can still differ across batch sizes in the rare
case where its uniform falls within rounding distance of a CDF boundary.)

By default it is plain ancestral sampling (``top_p=1.0``, ``temperature=1.0``): Wu et al.
(2022, Sec. 2.1) "randomly sample from the trained generator" and give no nucleus mass; ``top_p < 1``
gives nucleus sampling. Prompts are the format's start (unconditional, as Wu et al. 2022 sample whole
examples), or with ``condition="premise"`` / ``"premise+label"`` a premise from a given set (and a
label, cycling through the task's labels). Every sample is parsed back (see ``format.py``); the
unparseable ones are kept with their text and reason in ``rejects-*.parquet``. Parsed samples are
canonical rows (``origin="generated"``, ``method="generator:<name>"``) with their provenance:
``generator``, ``checkpoint``, ``shard``, ``seed``, ``sample_index``.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ...data.loading import labels_of
from ...data.tasks import TaskSpec
from ...utils.errors import ConfigError, EmptyResultError
from .params import SAMPLING, paper_value
from .format import SequenceFormat

log = logging.getLogger(__name__)

CONDITIONS = ("none", "premise", "premise+label", "prompts")  # prompts: one given prompt per sample
CONFIG_FILE = "generate_config.json"
REPORT_FILE = "generate_report.json"
PROVENANCE = ("generator", "checkpoint", "shard", "seed", "sample_index")
REJECT_COLUMNS = ("sample_index", "shard", "seed", "text", "reason")
ENGINES = ("fast", "generate", "ctranslate2")
DTYPES = (None, "auto", "float32", "bfloat16", "float16")


def shard_sizes(num_samples: int, num_shards: int) -> list[int]:
    """``num_samples`` split into ``num_shards`` near-equal shards (the first ones one larger)."""
    if num_samples < 1 or num_shards < 1:
        raise ConfigError(f"need at least one sample and one shard, got {num_samples} samples, {num_shards} shards")
    base, extra = divmod(num_samples, num_shards)
    return [base + (i < extra) for i in range(num_shards)]


def shard_seed(seed: int, shard: int) -> int:
    return int(np.random.SeedSequence([seed, shard]).generate_state(1)[0])


def shard_name(i: int, n: int, kind: str = "shard") -> str:
    return f"{kind}-{i:05d}-of-{n:05d}.parquet"


def generator_provenance(generator: str) -> tuple[str, str]:
    """(name, checkpoint) of a generator folder or Hub id; the checkpoint is its training step when known."""
    path = Path(generator)
    name = path.name if path.exists() else generator
    checkpoint = generator
    report = path / "train_report.json"
    if report.exists():
        info = json.loads(report.read_text())
        checkpoint = f"{path.name}@step-{info.get('steps')}"
    return name, checkpoint


def _features(task: TaskSpec):
    import datasets

    from ...data.loading import canonical_features
    f = canonical_features(task)
    return datasets.Features({**f, "generator": datasets.Value("string"), "checkpoint": datasets.Value("string"),
                              "shard": datasets.Value("int64"), "seed": datasets.Value("int64"),
                              "sample_index": datasets.Value("int64")})


def _rows(task: TaskSpec, parsed: list[dict], name: str, prov: dict[str, list]):
    import datasets

    from ...data.loading import new_rows
    if not parsed:
        return datasets.Dataset.from_dict({k: [] for k in _features(task)}, features=_features(task))
    ds = new_rows(task, [r["premise"] for r in parsed], [r["hypothesis"] for r in parsed],
                  [r["label"] for r in parsed], origin="generated", method=f"generator:{name}", extra=prov)
    return ds.cast(_features(task))


def _write(ds, final: Path) -> None:
    tmp = final.with_name(f".{final.name}.tmp")
    ds.to_parquet(str(tmp))
    os.replace(tmp, final)


def prompts_for(fmt: SequenceFormat, indices: Sequence[int], condition: str, premises: Sequence[str] | None,
                order: np.ndarray | None) -> list[str]:
    if condition == "none":
        return [fmt.prompt()] * len(indices)
    if condition == "prompts":
        return [premises[j] for j in indices]
    assert premises is not None and order is not None
    out = []
    for j in indices:
        premise = premises[int(order[j % len(order)])]
        label = fmt.labels[j % len(fmt.labels)] if condition == "premise+label" else None
        out.append(fmt.prompt(premise, label))
    return out


def context_length(model) -> tuple[int, str] | None:
    """How many tokens the model reads at most (prompt and new tokens together), and the config field
    that says so; None when its config does not say."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(model.config, name, None)
        if isinstance(value, int) and value > 0:
            return value, name
    return None


def check_context(model, tok, prompts: "Sequence[str] | int", max_new_tokens: int, generator: str) -> None:
    """A :class:`ConfigError` when the longest of ``prompts`` (or a prompt of that many tokens) and
    ``max_new_tokens`` new tokens do not fit the generator's context: generating past it fails inside
    the model (an index error of its position embeddings) instead of with a line that says why."""
    ctx = context_length(model)
    if ctx is None:
        return
    n_ctx, field = ctx
    longest = prompts if isinstance(prompts, int) else max(
        (len(ids) for ids in tok(list(prompts), add_special_tokens=False)["input_ids"]), default=0)
    if longest + max_new_tokens > n_ctx:
        room = n_ctx - longest
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: the generator {generator} reads at most {n_ctx} tokens "
                          f"({field}) and its prompt takes {longest} of them; "
                          + (f"use --max-new-tokens {room} or less" if room >= 1 else
                             "the prompt alone fills it: use a generator with a longer context"))


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How a run samples (recorded in its ``generate_config.json``): ``num_shards`` shards (default: one per
    ``shard_size`` samples, at least one per process), each seeded from ``seed``; ``batch_size`` sequences in
    flight; ``top_p`` and ``temperature`` (plain sampling by default: :data:`..SAMPLING` quotes the paper);
    up to ``max_new_tokens`` new tokens each; the ``engine`` (:data:`ENGINES`) and its ``dtype``
    (:data:`DTYPES`; for ``ctranslate2`` a compute type of :data:`.ct2.COMPUTE_TYPES`)."""

    num_shards: int | None = None
    shard_size: int = paper_value(SAMPLING, "shard_size")
    seed: int = paper_value(SAMPLING, "seed")
    batch_size: int = paper_value(SAMPLING, "batch_size")
    top_p: float = paper_value(SAMPLING, "top_p")
    temperature: float = paper_value(SAMPLING, "temperature")
    max_new_tokens: int = paper_value(SAMPLING, "max_new_tokens")
    engine: str = "fast"
    dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class Prompting:
    """What each sample starts from (``condition``, one of :data:`CONDITIONS`): ``"none"``, the format's start
    (unconditional); ``"premise"`` / ``"premise+label"``, a premise of ``premises`` (in a seeded order) and, for
    the latter, a label cycling through the task's; ``"prompts"``, ``prompts[i]`` for sample i, the prompt and
    its continuation parsed by ``parse`` (text -> (row, None) or (None, reason)), e.g. a
    :class:`.conditional.ConditionalFormat`'s."""

    condition: str = "none"
    premises: Sequence[str] | None = None
    prompts: Sequence[str] | None = None
    parse: Callable | None = None


def generate_samples(generator: str, out_dir: str, task: TaskSpec, num_samples: int,
                     sampling: SamplingOptions | None = None, prompting: Prompting | None = None, *,
                     cpu: bool = False, progress: bool = True, stop_after_shards: int | None = None,
                     extend: bool = False) -> dict:
    """Sample ``num_samples`` rows from ``generator`` into ``out_dir`` (shards + rejects + report), with the
    settings of ``sampling`` (:class:`SamplingOptions`; default: its defaults) from the prompts ``prompting``
    says (:class:`Prompting`; default: unconditional).

    ``extend=True`` grows a finished or partial run in ``out_dir`` that differs only in ``num_samples`` (and
    so the number of shards) to ``num_samples``: its shards are kept (renamed to the new shard count) and only
    the new ones are sampled. Shard i's samples depend on the seed, i and its sample indices only, so the
    extended run is the one a fresh run of ``num_samples`` makes, provided the old shards' index ranges are the
    first ones of the new split (:func:`extension_of` checks it; both sizes a multiple of ``shard_size``).

    ``engine="fast"`` (the default) samples with :class:`SlotSampler` (each sample its own random
    numbers, finished rows replaced at once, no padding carried along); ``"generate"`` with
    ``model.generate`` in fixed batches, as before (see the module's docstring for why the two give
    different samples for the same seed). ``dtype="auto"``: bfloat16 on a CPU with native bfloat16
    instructions (AMX or AVX512-BF16) or a GPU that has it, else the checkpoint's dtype.

    Run it under ``accelerate launch`` / ``torchrun`` to share the shards between processes.
    ``stop_after_shards`` ends this process's work after that many new shards (what a kill does).
    """
    from accelerate import PartialState

    opts, prompting = sampling or SamplingOptions(), prompting or Prompting()
    _check_request(num_samples, opts, prompting)
    state = PartialState(cpu=cpu)
    opts = dataclasses.replace(opts, dtype=_engine_dtype(opts, state.device))
    plan = _plan_run(generator, Path(out_dir), task, num_samples, opts, prompting, state, extend=extend)
    engine = _load_engine(generator, task, opts, state.device) if plan.todo else _Engine(opts.engine)
    prompts_of = _prompt_source(engine.fmt, opts.seed, prompting)
    if plan.todo:  # the first batch's prompts and the new tokens must fit the generator's context
        first = range(plan.starts[plan.todo[0]], min(plan.starts[plan.todo[0]] + opts.batch_size,
                                                     plan.starts[plan.todo[0] + 1]))
        check_context(engine.model, engine.tok, prompts_of(list(first)), opts.max_new_tokens, generator)
    if state.is_main_process:
        _open_run(plan.out, plan.config, extends=plan.old)
    state.wait_for_everyone()
    t0 = time.perf_counter()
    made, stopped = _sample_into_shards(plan, engine, opts, prompts_of, prompting.parse, state, progress=progress,
                                        stop_after_shards=stop_after_shards)
    if stopped is not None:
        return {"stopped_after_shards": stopped}
    seconds = time.perf_counter() - t0
    state.wait_for_everyone()
    report = summarize(plan.out, task) if state.is_main_process else {}
    if state.is_main_process:
        report["this_run"] = _this_run(engine, opts, state, made, seconds)
        (plan.out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    state.wait_for_everyone()
    return report


def _engine_dtype(opts: SamplingOptions, device) -> str | None:
    """The dtype the engine computes in: the CTranslate2 compute type (float32 by default), or the torch dtype
    to load the generator in (:func:`sampling_dtype`)."""
    if opts.engine == "ctranslate2":
        from .ct2 import compute_type_for
        return compute_type_for(opts.dtype, device.type)
    return sampling_dtype(opts.dtype, device)


@dataclasses.dataclass
class _Plan:
    """A run's shards: where they go, the task, the split (``sizes``, and ``starts``: the first sample index of
    each), the run's config, the run it extends (or None), this process's shards still to sample, and the
    generator's name and checkpoint (the rows' provenance)."""

    out: Path
    task: TaskSpec
    n_shards: int
    sizes: list[int]
    starts: np.ndarray
    config: dict
    old: dict | None
    todo: list[int]
    name: str
    checkpoint: str


def _plan_run(generator: str, out: Path, task: TaskSpec, num_samples: int, opts: SamplingOptions,
              prompting: Prompting, state, *, extend: bool) -> _Plan:
    """The shards of the run, its config and which of this process's shards are not on disk yet (or, with
    ``extend``, in the run it extends)."""
    n_shards = opts.num_shards or max(state.num_processes, -(-num_samples // opts.shard_size))
    sizes = shard_sizes(num_samples, n_shards)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    name, checkpoint = generator_provenance(generator)
    config = {"generator": generator, "task": task.name, "num_samples": num_samples, "num_shards": n_shards,
              "seed": opts.seed, "batch_size": opts.batch_size, "top_p": opts.top_p, "temperature": opts.temperature,
              "max_new_tokens": opts.max_new_tokens, "condition": prompting.condition,
              "premises": None if prompting.premises is None else len(prompting.premises), "engine": opts.engine,
              "dtype": opts.dtype}
    if prompting.prompts is not None:
        import hashlib
        config["prompts"] = hashlib.sha256("\x00".join(prompting.prompts).encode()).hexdigest()
    old = extension_of(out, config, starts) if extend else None
    old_n = old["num_shards"] if old else None
    mine = [i for i in range(n_shards) if i % state.num_processes == state.process_index]
    todo = [i for i in mine if not (out / shard_name(i, n_shards)).exists()
            and not (old_n and i < old_n and (out / shard_name(i, old_n)).exists())]
    return _Plan(out, task, n_shards, sizes, starts, config, old, todo, name, checkpoint)


@dataclasses.dataclass
class _Engine:
    """What samples: the engine's name (``fast`` gives way to ``generate`` for a model it cannot sample), the
    model (for ``ctranslate2``: an object with its config only) and tokenizer, the sequence format, and
    the converted CTranslate2 model's folder."""

    name: str
    model: Any = None
    tok: Any = None
    fmt: SequenceFormat | None = None
    ct2_dir: Path | None = None


def _load_engine(generator: str, task: TaskSpec, opts: SamplingOptions, device) -> _Engine:
    """The generator, loaded and checked before anything is written (for ``ctranslate2``, its tokenizer and
    config, and the converted model, cached)."""
    if opts.engine == "ctranslate2":
        from .ct2 import converted_model
        model, tok = _config_and_tokenizer(generator)
        return _Engine("ctranslate2", model, tok, SequenceFormat.for_tokenizer(tok, task.labels),
                       converted_model(generator, opts.dtype))
    model, tok = _load_for_sampling(generator, opts.dtype, device)
    engine = opts.engine
    if engine == "fast" and (why := fast_engine_unsupported(model)):
        log.warning("engine 'fast' cannot sample from %s (%s): using model.generate", generator, why)
        engine = "generate"
    return _Engine(engine, model, tok, SequenceFormat.for_tokenizer(tok, task.labels))


def _prompt_source(fmt: SequenceFormat | None, seed: int, prompting: Prompting):
    """``prompts_of(indices)``: the prompts of those sample indices (premises in an order seeded by ``seed``)."""
    premises, condition = prompting.premises, prompting.condition
    order = np.random.default_rng(seed).permutation(len(premises)) if premises else None
    if condition == "prompts":
        premises, order = prompting.prompts, np.arange(len(prompting.prompts))
    return lambda idx: prompts_for(fmt, idx, condition, premises, order)


def _sample_into_shards(plan: _Plan, engine: _Engine, opts: SamplingOptions, prompts_of, parse, state, *,
                        progress: bool, stop_after_shards: int | None) -> tuple[int, int | None]:
    """Sample this process's shards still to do and write each as it is done (its rows parsed by ``parse``, or
    the format's). Returns (samples made, shards written when ``stop_after_shards`` stopped it, else None)."""
    from tqdm.auto import tqdm

    todo = plan.todo
    shards = [(i, shard_seed(opts.seed, i), range(plan.starts[i], plan.starts[i + 1])) for i in todo]
    if stop_after_shards is not None:
        # only those shards' prompts enter the sampler: the fast engine refills a finished slot from the next
        # prompt at once, so with the later shards queued it would sample (and then lose) part of shard K+1
        shards, todo = shards[:stop_after_shards], todo[:stop_after_shards]
    bar = tqdm(total=int(sum(plan.sizes[i] for i in todo)), unit="sample", desc=f"generate (rank {state.process_index})",
               disable=not progress, position=state.process_index)
    t0, made, done_now = time.perf_counter(), 0, 0

    def tick(n: int) -> None:
        nonlocal made
        made += n
        bar.update(n)
        bar.set_postfix(samples_per_s=f"{made / (time.perf_counter() - t0):.2f}", refresh=False)

    for i, s, samples in _engine_shards(engine, opts, shards, prompts_of, tick, state.device):
        _write_shard(plan.out, plan.task, i, plan.n_shards, s, samples, parse or engine.fmt.parse, plan.name,
                     plan.checkpoint)
        done_now += 1
        if stop_after_shards is not None and done_now >= stop_after_shards:
            bar.close()
            return made, done_now
    bar.close()
    return made, None


def _engine_shards(engine: _Engine, opts: SamplingOptions, shards, prompts_of, tick, device):
    """``(shard, seed, [(sample_index, prompt, continuation), ...])`` of every shard, from the engine."""
    if engine.name == "ctranslate2":
        import torch

        from .ct2 import ct2_shards
        return ct2_shards(engine.ct2_dir, engine.tok, shards, prompts_of, opts, tick=tick, compute_type=opts.dtype,
                          device=device, threads=torch.get_num_threads())
    sample = _fast_shards if engine.name == "fast" else _plain_shards
    return sample(engine.model, engine.tok, shards, prompts_of, opts, tick=tick)


def _this_run(engine: _Engine, opts: SamplingOptions, state, made: int, seconds: float) -> dict:
    """The report's ``this_run``: processes, samples made and their rate, the engine and its dtype."""
    run = {"processes": state.num_processes, "samples": made, "seconds": round(seconds, 2),
           "samples_per_s_rank0": round(made / seconds, 3) if made else None,
           "engine": engine.name, "dtype": _dtype_name(engine.name, opts.dtype, engine.model)}
    if engine.name == "ctranslate2":
        import ctranslate2
        run["ctranslate2"] = {"version": ctranslate2.__version__, "compute_type": opts.dtype,
                              "model": str(engine.ct2_dir) if engine.ct2_dir else None}
    return run


def _dtype_name(engine: str, dtype: str | None, model) -> str | None:
    """What the samples were computed in: the CTranslate2 compute type, or the torch model's dtype."""
    if engine == "ctranslate2":
        return dtype
    return str(model.dtype).replace("torch.", "") if model is not None else None


def _config_and_tokenizer(generator: str):
    """(an object with the generator's ``config``, its tokenizer), without loading weights: what the
    ctranslate2 engine needs besides the converted model (the context length check and the format)."""
    import types

    from transformers import AutoConfig

    from .models import _has_tokenizer, is_adapter_folder, load_tokenizer
    base = generator
    if os.path.isdir(generator) and is_adapter_folder(generator):
        base = json.loads((Path(generator) / "adapter_config.json").read_text())["base_model_name_or_path"]
    try:
        config = AutoConfig.from_pretrained(base)
        tok = load_tokenizer(generator if _has_tokenizer(generator) else base)
    except Exception as err:
        from ...data.loading import root_cause
        raise ConfigError(f"--generator {generator}: cannot load it ({root_cause(err)})") from err
    return types.SimpleNamespace(config=config), tok


def _check_request(num_samples: int, opts: SamplingOptions, prompting: Prompting) -> None:
    condition, premises, prompts, parse = prompting.condition, prompting.premises, prompting.prompts, prompting.parse
    top_p, temperature, engine, dtype = opts.top_p, opts.temperature, opts.engine, opts.dtype
    if condition not in CONDITIONS:
        raise ConfigError(f"condition must be one of {CONDITIONS}, not {condition!r}")
    if condition == "prompts":
        if prompts is None or len(prompts) != num_samples or parse is None:
            raise ConfigError(f"condition='prompts' needs one prompt per sample ({num_samples}) and a parse function")
    elif condition != "none" and not premises:
        raise ConfigError(f"condition={condition!r} needs premises (--premises-from DATA)")
    if not (0 < top_p <= 1) or temperature <= 0:
        raise ConfigError(f"top_p must be in (0, 1] and temperature > 0; got top_p={top_p}, temperature={temperature}")
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {ENGINES}, not {engine!r}")
    if engine == "ctranslate2":
        from .ct2 import COMPUTE_TYPES
        if dtype not in (None, "auto", *COMPUTE_TYPES):
            raise ConfigError(f"engine ctranslate2: dtype must be auto or a compute type of {COMPUTE_TYPES}, not {dtype!r}")
    elif dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, not {dtype!r}"
                          + (" (int8 types are for --engine ctranslate2)" if str(dtype).startswith("int8") else ""))


GROWABLE = ("num_samples", "num_shards")  # what --extend may change; "extended_from" records the earlier sizes


def _read_config(out: Path) -> dict:
    from ...utils.outputs import json_of

    config = json_of(out / CONFIG_FILE)  # absent, unreadable, not a mapping, nested without end: no config
    return config if isinstance(config, dict) else {}


def _write_config(out: Path, config: dict) -> None:
    tmp_cfg = out / f".{CONFIG_FILE}.tmp"
    tmp_cfg.write_text(json.dumps(config, indent=2))
    os.replace(tmp_cfg, out / CONFIG_FILE)


def _has_shards(out: Path) -> bool:
    return any(out.glob("shard-*-of-*.parquet")) or any(out.glob("rejects-*-of-*.parquet"))


def rename_shards(out: Path, n_old: int, n_new: int) -> None:
    """Rename the shard and reject files of a run of ``n_old`` shards in ``out`` to those of ``n_new`` shards
    (their bytes unchanged): what ``extend`` does before sampling the new shards."""
    for kind in ("shard", "rejects"):
        for i in range(n_old):
            src = out / shard_name(i, n_old, kind)
            if src.exists():
                os.replace(src, out / shard_name(i, n_new, kind))


def extension_of(out: Path, config: dict, starts) -> dict | None:
    """The run in ``out`` that ``config`` extends (its config), or None when ``out`` holds no run or already this
    one. Refused with the reason: parameters other than the sample count differ, the count does not grow, or
    the old shards' sample-index ranges are not the first ones of the new split (shard i's samples depend on
    its index range, so the kept shards would not be those of a fresh run)."""
    old = _read_config(out)
    if not old or not _has_shards(out):
        return None
    if _same_run(old, config):
        return None
    other = {k: (old.get(k), config.get(k)) for k in set(old) | set(config)
             if k not in (*GROWABLE, "extended_from") and old.get(k) != config.get(k)}
    if other:
        raise ConfigError(f"--extend: {out} holds a run with other parameters (old -> new: {other}); only "
                          f"--num-samples may change")
    if config["num_samples"] <= old["num_samples"]:
        raise ConfigError(f"--extend: {out} holds {old['num_samples']:,} samples; --num-samples "
                          f"{config['num_samples']:,} does not grow it")
    old_starts = np.concatenate([[0], np.cumsum(shard_sizes(old["num_samples"], old["num_shards"]))])
    if len(old_starts) > len(starts) or not np.array_equal(old_starts, starts[:len(old_starts)]):
        raise ConfigError(f"--extend: the {old['num_shards']} shards of {out} ({old['num_samples']:,} samples) are "
                          f"not the first shards of {config['num_samples']:,} samples in {config['num_shards']} shards "
                          f"(shard i's samples depend on its sample indices): it extends when both counts are "
                          f"multiples of --shard-size")
    return old


def _same_run(old: dict, config: dict) -> bool:
    return {k: v for k, v in old.items() if k != "extended_from"} == config


def _open_run(out: Path, config: dict, extends: dict | None = None) -> None:
    """Write the run's config, or check that the shards already in ``out`` come from the same parameters.

    ``extends``: the config of the run in ``out`` that this one grows (:func:`extension_of`): its shard and
    reject files are renamed to the new shard count first, the new config (with ``extended_from``) written
    last, so a run killed in between resumes with the same ``--extend`` command.

    A config without ``engine`` was written before there was a choice: its shards came from
    ``model.generate``, so it resumes with ``engine="generate"`` only (its dtype was not recorded)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / CONFIG_FILE
    if extends is not None:
        n_old, n_new = extends["num_shards"], config["num_shards"]
        rename_shards(out, n_old, n_new)
        _write_config(out, {**config, "extended_from": [*extends.get("extended_from", []),
                                                        {k: extends[k] for k in GROWABLE}]})
        log.info("extended %s from %s to %s samples (%s -> %s shards)", out, f"{extends['num_samples']:,}",
                 f"{config['num_samples']:,}", n_old, n_new)
        return
    # a config with no shard beside it is what a failed run left (e.g. a generator that did not
    # load): nothing to protect, so it is replaced rather than refusing every later run
    if cfg_path.exists() and _has_shards(out):
        old = _read_config(out)
        if old and "engine" not in old:  # written before engines and dtypes were recorded
            old.setdefault("engine", "generate")
            old.setdefault("dtype", config["dtype"])
        if not _same_run(old, config):
            diff = {k: (old.get(k), v) for k, v in config.items() if old.get(k) != v}
            grow = (set(diff) <= set(GROWABLE) and config["num_samples"] > old.get("num_samples", 0))
            raise ConfigError(f"{out} holds shards of another run (differences, old -> new: {diff}); "
                              f"use another --out folder or the same parameters to resume"
                              + ("; --extend grows that run to the new number of samples" if grow else ""))
    else:
        _write_config(out, config)


def sampling_dtype(dtype: str | None, device) -> str | None:
    """The dtype to load the generator in: ``"auto"`` is bfloat16 where the device computes it natively
    (a CPU with AMX or AVX512-BF16, a CUDA GPU that supports it), else None (the checkpoint's)."""
    if dtype != "auto":
        return dtype
    import torch
    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else None
    if kind == "cpu":
        cpu = getattr(torch, "cpu", None)
        native = any(getattr(cpu, f, lambda: False)() for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
        return "bfloat16" if native else None
    return None


def _load_for_sampling(generator: str, dtype: str | None, device):
    from .models import load_generator
    try:
        model, tok = load_generator(generator, dtype=dtype)
    except Exception as err:  # missing or corrupt weights: one line naming the generator
        from ...data.loading import root_cause
        raise ConfigError(f"--generator {generator}: cannot load it ({root_cause(err)})") from err
    if hasattr(model, "merge_and_unload"):  # a LoRA adapter: merged weights sample the same, faster
        model = model.merge_and_unload()
    model.to(device).eval()
    contiguous_head_input(model)
    tok.padding_side = "left"
    return model, tok


def _contiguous(module, args):
    return (args[0].contiguous(),) + tuple(args[1:])


def contiguous_head_input(model) -> None:
    """Make the output layer's input contiguous before it is multiplied.

    Sampling asks the model for the last position's logits only (``logits_to_keep=1``), so the head gets
    ``hidden[:, -1:, :]``, a strided view whenever a pass runs more than one position (every prefill).
    PyTorch's CPU ``linear`` turns a 3-D strided input into a ``bmm`` against the weight expanded to the
    batch and copied (pytorch/pytorch#151934): for SmolLM2's 49,152 x 576 head and a prefill of 100 rows
    that is a 5.6 GB bfloat16 copy and about 5 s per pass (float32: 8x slower than contiguous, no copy).
    This was the fast engine's 7 GB peak at batch 256 (issue 50; ``git show b65411f:benchmarks/fast_memory.py``).
    A copy of the rows' last hidden states (rows x hidden) costs nothing next to it."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and not getattr(head, "_dnli_contiguous", False):
        head.register_forward_pre_hook(_contiguous)
        head._dnli_contiguous = True


def _write_shard(out: Path, task: TaskSpec, i: int, n_shards: int, s: int, samples, parse, name: str,
                 checkpoint: str) -> None:
    """Parse shard i's ``(sample_index, prompt, continuation)`` samples; write its rejects, then its rows."""
    import datasets
    parsed, prov, rejects = [], {k: [] for k in PROVENANCE}, {k: [] for k in REJECT_COLUMNS}
    for j, prompt, cont in samples:
        row, why = parse(prompt + cont)
        if row is None:
            for k, v in (("sample_index", j), ("shard", i), ("seed", s), ("text", prompt + cont), ("reason", why)):
                rejects[k].append(v)
            continue
        parsed.append(row)
        for k, v in (("generator", name), ("checkpoint", checkpoint), ("shard", i), ("seed", s), ("sample_index", j)):
            prov[k].append(v)
    rej = datasets.Dataset.from_dict(rejects, features=datasets.Features({
        "sample_index": datasets.Value("int64"), "shard": datasets.Value("int64"), "seed": datasets.Value("int64"),
        "text": datasets.Value("string"), "reason": datasets.Value("string")}))
    _write(rej, out / shard_name(i, n_shards, "rejects"))
    _write(_rows(task, parsed, name, prov), out / shard_name(i, n_shards))


# ---- engine "generate": model.generate in fixed batches ------------------------------------------------

def _plain_shards(model, tok, shards, prompts_of, opts: SamplingOptions, *, tick):
    """Yield ``(shard, seed, [(sample_index, prompt, continuation), ...])``: each shard seeds torch's
    generator once and calls ``model.generate`` on consecutive, left-padded batches of ``opts.batch_size``."""
    import torch
    batch_size, max_new_tokens = opts.batch_size, opts.max_new_tokens
    for i, s, indices in shards:
        torch.manual_seed(s)
        samples = []
        for b in range(indices.start, indices.stop, batch_size):
            idx = list(range(b, min(b + batch_size, indices.stop)))
            prompts = prompts_of(idx)
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            check_context(model, tok, enc["input_ids"].shape[1], max_new_tokens, "the generator")
            with torch.no_grad():
                gen = model.generate(**enc, do_sample=True, top_p=opts.top_p, temperature=opts.temperature, top_k=0,
                                     max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
            samples += list(zip(idx, prompts, texts))
            tick(len(idx))
        yield i, s, samples


# ---- engine "fast": a slot sampler ------------------------------------------------------------------------

def sample_uniforms(shard_seed_: int, index: int, n: int) -> np.ndarray:
    """The ``n`` uniform numbers in [0, 1) that decide sample ``index``'s tokens (one per new token)."""
    return np.random.default_rng([shard_seed_, index]).random(n)


def _fast_shards(model, tok, shards, prompts_of, opts: SamplingOptions, *, tick):
    """Yield ``(shard, seed, samples)`` as :func:`_plain_shards` does, from one :class:`SlotSampler`
    that runs through all the shards (a shard is yielded when its last sample is done, so the batch
    stays full from one shard to the next)."""
    if not shards:
        return
    total = sum(len(indices) for _, _, indices in shards)
    max_new_tokens = opts.max_new_tokens
    sampler = SlotSampler(model, tok, slots=min(opts.batch_size, total), max_new_tokens=max_new_tokens,
                          top_p=opts.top_p, temperature=opts.temperature)
    left: dict[int, int] = {}
    done: dict[int, list] = {}
    seeds: dict[int, int] = {}

    def jobs():
        for i, s, indices in shards:
            left[i], done[i], seeds[i] = len(indices), [], s
            idx = list(indices)
            prompts = prompts_of(idx)
            ids = _token_ids(tok, prompts)
            # shortest prompts first: a refill takes prompts of about one length, so little padding
            for k in sorted(range(len(idx)), key=lambda k: len(ids[k])):
                yield SlotJob(key=(i, idx[k]), prompt=prompts[k], ids=ids[k],
                              uniforms=sample_uniforms(s, idx[k], max_new_tokens))

    order = [i for i, _, _ in shards]
    for job, tokens in sampler.run(jobs()):
        i, j = job.key
        done[i].append((j, job.prompt, tokens))
        tick(1)
        left[i] -= 1
        # shards in order (a later one can end first): a killed run leaves the first shards done
        while order and left.get(order[0]) == 0:
            i = order.pop(0)
            samples = sorted(done.pop(i))
            texts = tok.batch_decode([t for _, _, t in samples], skip_special_tokens=False)
            yield i, seeds[i], [(j, p, text) for (j, p, _), text in zip(samples, texts)]


def _token_ids(tok, prompts: list[str]) -> list[list[int]]:
    unique = list(dict.fromkeys(prompts))  # unconditional sampling: one prompt, tokenized once
    enc = dict(zip(unique, tok(unique, add_special_tokens=False)["input_ids"]))
    return [enc[p] for p in prompts]


SLOT_ATTENTION = "debiased_nli_slots"
_FAST_UNSUPPORTED_GENERATION = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
                                "min_length": 0, "min_new_tokens": None, "suppress_tokens": None,
                                "begin_suppress_tokens": None, "forced_bos_token_id": None,
                                "forced_eos_token_id": None, "sequence_bias": None}


def fast_engine_unsupported(model) -> str | None:
    """Why :class:`SlotSampler` cannot sample from ``model`` the way ``model.generate`` would, or None."""
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if not getattr(model, "_supports_attention_backend", False) or not hasattr(model, "set_attn_implementation"):
        return f"{type(model).__name__} does not take a custom attention function"
    cfg = model.config
    # the slot attention is full causal attention: no sliding window, no capped attention logits
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return "it attends through a sliding window"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "it caps its attention logits"
    gen = getattr(model, "generation_config", None)
    for key, neutral in _FAST_UNSUPPORTED_GENERATION.items():
        value = getattr(gen, key, neutral)
        if value not in (neutral, None) and not (key == "min_length" and value == 0):
            return f"its generation_config sets {key}={value!r}, which only model.generate applies"
    return None


@dataclasses.dataclass
class SlotJob:
    """One sample to draw: its key, its prompt (text and token ids) and its uniforms (one per new token)."""

    key: Any
    prompt: str
    ids: list[int]
    uniforms: np.ndarray


class _Slots:
    """The keys and values of ``n`` sequence slots, ``capacity`` positions each, written in place.

    Every slot writes its next token's key and value at the same column ``col`` (it advances by one per
    decoding step, modulo the capacity), so a decoding step writes one column instead of concatenating
    the whole cache. A new sequence's prompt is written, right-aligned, in the columns just before
    ``col`` of its slot; ``valid`` marks, per slot, the columns that hold its sequence. Attention is
    order-free over the columns (positions are in the keys: rotary embeddings, or in the inputs: GPT-2's
    learned positions), so a sequence needs no particular column order.
    """

    def __init__(self, n: int, capacity: int):
        import torch
        self.n, self.capacity, self.col = n, capacity, 0
        self.keys: dict[int, Any] = {}
        self.values: dict[int, Any] = {}
        self.valid = torch.zeros(n, capacity, dtype=torch.bool)
        self.rows = self.cols = self.mask = None  # set for each forward pass (prefill: rows; decode: None)
        # a prompt prefix shared by the prompts (e.g. the format's start): its keys and values, computed
        # once (`capture`) and copied into the slots of later prompts, which run only what follows it
        self.prefix: dict[int, tuple] = {}
        self.prefix_cols = self.window = None  # prefill with a prefix: its columns per row; all columns

    def attend(self, layer: int, q, k, v, scale: float):
        import torch
        if layer not in self.keys:
            shape = (self.n, k.shape[1], self.capacity, k.shape[-1])
            self.keys[layer], self.values[layer] = k.new_zeros(shape), v.new_zeros(shape)
        keys, values = self.keys[layer], self.values[layer]
        n, heads, _, dim = q.shape
        if self.rows is None:  # decoding: one new token in every slot
            keys[:, :, self.col] = k[:, :, 0]
            values[:, :, self.col] = v[:, :, 0]
            groups = keys.shape[1]  # grouped-query attention: query heads h*g .. h*g+g-1 read key head h
            scores = torch.matmul(q.reshape(n, groups, heads // groups, dim) * scale, keys.transpose(-1, -2))
            probs = scores.masked_fill_(self.mask, float("-inf")).softmax(-1, dtype=torch.float32)
            out = torch.matmul(probs.to(values.dtype), values).reshape(n, heads, 1, dim)
            return out.transpose(1, 2), None
        # prefill of new prompts (left-padded, `length` positions) into slots `rows`
        keys[self.rows[:, None], :, self.cols[None, :]] = k.transpose(1, 2)
        values[self.rows[:, None], :, self.cols[None, :]] = v.transpose(1, 2)
        if self.prefix_cols is not None:  # the shared prefix, then every column of these rows' prompts
            p = self.prefix_cols.shape[1]
            for store, (pk, pv), t in ((keys, self.prefix[layer], 0), (values, self.prefix[layer], 1)):
                store[self.rows[:, None], :, self.prefix_cols] = (pk, pv)[t][:, :p].transpose(0, 1)
            k = keys[self.rows[:, None], :, self.window[None, :]].transpose(1, 2)
            v = values[self.rows[:, None], :, self.window[None, :]].transpose(1, 2)
        if k.shape[1] != heads:
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale)
        return out.transpose(1, 2), None

    def grow(self, capacity: int, live: int, col: int) -> None:
        """``capacity`` positions per slot. The last ``live`` columns (every sequence in flight) keep
        their order and end just before the new write column ``col``."""
        import torch
        src = (self.col - live + torch.arange(live)) % self.capacity
        dst = (col - live + torch.arange(live)) % capacity
        for store in (self.keys, self.values):
            for layer, t in store.items():
                new = t.new_zeros(*t.shape[:2], capacity, t.shape[-1])
                new[:, :, dst.to(t.device)] = t[:, :, src.to(t.device)]
                store[layer] = new
        valid = self.valid.new_zeros(self.n, capacity)
        valid[:, dst] = self.valid[:, src]
        self.valid, self.capacity, self.col = valid, capacity, col % capacity

    def capture(self, slot: int, cols) -> None:
        """Keep the keys and values of columns ``cols`` of ``slot`` as the shared prefix."""
        for layer, t in self.keys.items():
            self.prefix[layer] = (t[slot][:, cols.to(t.device)].clone(),
                                  self.values[layer][slot][:, cols.to(t.device)].clone())

    def keep(self, slots) -> None:
        """Keep only ``slots`` (a LongTensor), in that order."""
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = t.index_select(0, slots.to(t.device))
        self.valid = self.valid.index_select(0, slots.to(self.valid.device))
        self.n = len(slots)


_CDF_BLOCK = 256


def inverse_cdf(scores, u):
    """For each row of ``scores`` (float32 logits, overwritten), the token t with cdf[t-1] <= u * total
    < cdf[t], where cdf is the running sum of exp(scores - max): sampling from softmax(scores) at the
    uniform ``u`` (zero-probability tokens, e.g. cut by top-p, are never chosen).

    The running sum is taken in two levels (sums of blocks of 256 tokens, then within the one block
    that holds u * total), which is several times faster on a CPU than a running sum over the whole
    vocabulary; the two agree up to float rounding."""
    import torch
    rows, vocab = scores.shape
    e = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    blocks = -(-vocab // _CDF_BLOCK)
    if blocks * _CDF_BLOCK != vocab:
        e = torch.nn.functional.pad(e, (0, blocks * _CDF_BLOCK - vocab))
    e = e.view(rows, blocks, _CDF_BLOCK)
    cdf = e.sum(-1).cumsum_(-1)
    total = cdf[:, -1:]
    x = torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(cdf, x, right=True).clamp_(max=blocks - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(x))
    inner = e[torch.arange(rows, device=e.device), block[:, 0]]
    token = torch.searchsorted(inner.cumsum(-1) + before, x, right=True).clamp_(max=_CDF_BLOCK - 1)
    # rounding between the block sums and the running sum inside a block can leave u * total past
    # the block's last token: then the block's last token of non-zero probability
    zero = inner.gather(1, token) == 0
    if zero.any():
        last = torch.where(inner > 0, torch.arange(_CDF_BLOCK, device=e.device), -1).amax(-1, keepdim=True)
        token = torch.where(zero, last, token)
    return (block * _CDF_BLOCK + token)[:, 0]


def _slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, dnli_slots=None,
                    **kwargs):
    """The attention function (transformers' AttentionInterface) of :class:`SlotSampler`'s forward passes."""
    if dnli_slots is None:
        raise RuntimeError(f"attention {SLOT_ATTENTION!r} is only for SlotSampler's forward passes")
    return dnli_slots.attend(module.layer_idx, query, key, value,
                             query.shape[-1] ** -0.5 if scaling is None else scaling)


class SlotSampler:
    """Ancestral sampling from a causal LM in a fixed number of sequence slots.

    * Each sample ends at its end marker (or after ``max_new_tokens``) and its slot is refilled with the
      next prompt (when at least a sixteenth of the slots are free, in prefill passes of about
      ``prefill_tokens`` positions); nothing is computed for finished rows beyond that, and no padding
      is carried through decoding.
    * Keys and values live in :class:`_Slots` and are attended by :func:`_slot_attention`, a
      transformers attention function (GQA without repeating the keys, one column written per step).
    * Token t of a sample is the inverse CDF of its distribution (temperature, then top-p, with
      transformers' own logits warpers: the same distribution ``model.generate(do_sample=True)``
      samples) at the sample's own uniform number ``uniforms[t]``. So a sample depends on its prompt and
      its uniforms only, not on which other samples share its batch, the batch size or the order.
    """

    def __init__(self, model, tok, *, slots: int, max_new_tokens: int, top_p: float = 1.0, temperature: float = 1.0,
                 refill_fraction: float = 1 / 16, prefill_tokens: int = 512):
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper
        self.model, self.slots, self.max_new = model, max(1, int(slots)), int(max_new_tokens)
        self.device = model.device
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else (self.eos or 0)
        self.warpers = ([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []) + \
                       ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
        self.refill_at = max(1, int(self.slots * refill_fraction))
        self.prefill_tokens = prefill_tokens
        self.prefix: tuple[int, ...] = ()  # the prompt prefix whose keys and values the slots keep

    def run(self, jobs):
        """Yield ``(job, new token ids)`` for every :class:`SlotJob` of ``jobs``, as each finishes (an end
        marker ends a sample and is its last token)."""
        import collections

        import torch
        from transformers import AttentionInterface
        AttentionInterface.register(SLOT_ATTENTION, _slot_attention)
        before = self.model.config._attn_implementation
        self.model.set_attn_implementation(SLOT_ATTENTION)
        try:
            with torch.inference_mode():
                yield from self._run(iter(jobs), collections.deque())
        finally:
            self.model.set_attn_implementation(before)

    def _run(self, jobs, queue):
        import torch
        n, dev = self.slots, self.device
        self.kv = _Slots(n, 1)
        self.job: list[SlotJob | None] = [None] * n
        self.active = torch.zeros(n, dtype=torch.bool)
        self.pos = torch.zeros(n, dtype=torch.long)                  # position of each slot's next input token
        self.last = torch.full((n,), self.pad, dtype=torch.long, device=dev)  # that token
        self.count = torch.zeros(n, dtype=torch.long)                # tokens made so far
        self.tokens = torch.zeros(n, self.max_new, dtype=torch.long)
        self.uniforms = torch.zeros(n, self.max_new, dtype=torch.float32, device=dev)
        exhausted = False
        while True:
            free = (~self.active).nonzero().flatten()
            if not exhausted and len(queue) <= len(free):
                want = max(len(free), self.slots)
                got = list(itertools.islice(jobs, want))
                queue.extend(got)
                exhausted = len(got) < want
            busy = self.kv.n - len(free)
            # refill once enough slots are free for an efficient prefill pass, or when the prompts
            # left all fit (else the last few would wait for a whole generation, then run alone)
            if queue and len(free) and (len(free) >= self.refill_at or busy == 0
                                        or (exhausted and len(queue) <= len(free))):
                take = free[: self._prefill_rows(queue, len(free))]
                jobs_now = [queue.popleft() for _ in range(len(take))]
                # room for the longest prompt in sight, so that growing (a copy of every slot) is rare
                longest = max(len(j.ids) for j in itertools.chain(jobs_now, queue))
                if longest + self.max_new > self.kv.capacity:
                    live = int(self.pos[self.active].max()) if self.active.any() else 0
                    self.kv.grow(longest + self.max_new, live, max(live, longest))
                yield from self._prefill(take, jobs_now)
                continue
            if busy == 0:
                return
            if not queue and exhausted and busy <= self.kv.n // 2:
                self._keep(self.active.nonzero().flatten())  # the last samples: a smaller batch
            yield from self._decode()

    def _prefill_rows(self, queue, free: int) -> int:
        """How many of the next prompts one prefill pass takes: at most ``free``, and about
        ``prefill_tokens`` positions in all (a matrix product over many more rows runs slower per row)."""
        rows = 1
        while rows < min(free, len(queue)) and (rows + 1) * len(queue[rows].ids) <= self.prefill_tokens:
            rows += 1
        return rows

    def _prefill(self, slots, jobs):
        """Run the prompts of ``jobs`` into ``slots`` (right-aligned, ending just before the write column)
        and sample their first tokens. Their first ``shared`` tokens, the captured prefix, are copied in
        rather than run again."""
        import torch
        dev, rows, kv = self.device, len(jobs), self.kv
        lengths = [len(j.ids) for j in jobs]
        shared = self._shared_prefix(jobs)
        total = max(lengths)  # columns of the longest prompt; the model runs the last `width` of them
        width = total - shared
        ids = torch.full((rows, width), self.pad, dtype=torch.long)
        pos = torch.zeros(rows, width, dtype=torch.long)
        real = torch.zeros(rows, total, dtype=torch.bool)
        for r, (job, length) in enumerate(zip(jobs, lengths)):
            ids[r, total - length:] = torch.tensor(job.ids[shared:], dtype=torch.long)
            pos[r, total - length:] = torch.arange(shared, length)
            real[r, total - length:] = True
        window = (kv.col - total + torch.arange(total)) % kv.capacity
        kv.valid[slots] = False
        kv.valid[slots[:, None], window[None, :]] = real
        # input position i is window column shared + i: it sees the real columns up to its own
        causal = torch.ones(width, total, dtype=torch.bool).tril(diagonal=shared)
        itself = torch.zeros(width, total, dtype=torch.bool)
        itself[torch.arange(width), shared + torch.arange(width)] = True
        # a padding position attends to itself only (its output is never used; no row is all -inf)
        kv.mask = ((causal & real[:, None, :]) | itself)[:, None].to(dev)
        kv.rows, kv.cols = slots.to(dev), window[shared:].to(dev)
        if shared:
            starts = total - torch.tensor(lengths)
            kv.prefix_cols = window[starts[:, None] + torch.arange(shared)].to(dev)
            kv.window = window.to(dev)
        logits = self._forward(ids.to(dev), pos.to(dev), real[:, shared:].to(dev))
        kv.rows = kv.cols = kv.prefix_cols = kv.window = None
        if not self.prefix:
            self._capture_prefix(jobs, slots, window, total - lengths[0])
        for s, job in zip(slots.tolist(), jobs):
            self.job[s] = job
        self.uniforms[slots] = torch.as_tensor(np.stack([j.uniforms for j in jobs]), dtype=torch.float32).to(dev)
        self.count[slots] = 0
        self.pos[slots] = torch.tensor(lengths)
        self.active[slots] = True
        yield from self._take(slots, logits)

    def _shared_prefix(self, jobs) -> int:
        """How many first tokens of every prompt of ``jobs`` are the captured prefix's (at least one token
        of each prompt is run: its logits give the first new token)."""
        n = len(self.prefix)
        for job in jobs:
            n = min(n, len(job.ids) - 1)
            while n and tuple(job.ids[:n]) != self.prefix[:n]:
                n -= 1
        return n

    def _capture_prefix(self, jobs, slots, window, start: int) -> None:
        """The first tokens all prompts of ``jobs`` share (all but the last of the shortest, at most) become
        the prefix: their keys and values are read from the first job's slot, where they start at column
        ``window[start]``."""
        n = min(len(j.ids) for j in jobs) - 1
        first = jobs[0].ids
        for job in jobs[1:]:
            while n and job.ids[:n] != first[:n]:
                n -= 1
        if n > 0:
            self.kv.capture(int(slots[0]), window[start:start + n])
            self.prefix = tuple(first[:n])

    def _decode(self):
        import torch
        kv = self.kv
        kv.valid[:, kv.col] = True
        # every column is read (a slice of them would make a strided batch, slower to multiply on a CPU)
        kv.mask = ~kv.valid[:, None, None, :].to(self.device)
        logits = self._forward(self.last[:, None], self.pos[:, None].to(self.device), torch.ones_like(self.last[:, None]))
        kv.col = (kv.col + 1) % kv.capacity
        self.pos += self.active  # a free slot stays where it was (never past the model's range)
        rows = self.active.nonzero().flatten()
        yield from self._take(rows, logits if len(rows) == len(logits) else logits[rows.to(self.device)])

    def _forward(self, ids, pos, mask):
        # `mask` (the real tokens of `ids`) is not used by the slot attention, which has its own; it
        # only tells transformers that a padded input is known to be padded
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask.long(), use_cache=False,
                         logits_to_keep=1, dnli_slots=self.kv)
        return out.logits[:, -1]

    def _take(self, slots, logits):
        """Sample the next token of each of ``slots`` from its ``logits``; yield the samples that ended."""
        step = self.count[slots]
        new = self._pick(logits, self.uniforms[slots.to(self.device), step.to(self.device)]).cpu()
        self.tokens[slots, step] = new
        self.count[slots] = step + 1
        self.last[slots.to(self.device)] = new.to(self.device)
        ended = (self.count[slots] >= self.max_new)
        if self.eos is not None:
            ended |= new == self.eos
        for s in slots[ended].tolist():
            self.active[s] = False
            job, self.job[s] = self.job[s], None
            yield job, self.tokens[s, : int(self.count[s])].tolist()

    def _pick(self, logits, u):
        """Token t of each row: the inverse CDF of softmax(warped logits) at ``u``, i.e. the t where
        cdf[t-1] <= u * total < cdf[t] (on a CPU rows are taken 32 at a time: their float32 copies stay
        in cache, and a fresh 50 MB buffer per step would cost more in page faults than the rest)."""
        import torch
        chunk = 32 if logits.device.type == "cpu" else len(logits)
        out = []
        for k in range(0, len(logits), chunk):
            scores = logits[k:k + chunk].float()
            for warp in self.warpers:
                scores = warp(None, scores)
            out.append(inverse_cdf(scores, u[k:k + chunk]))
        return torch.cat(out)

    def _keep(self, slots) -> None:
        """Drop every slot but ``slots`` (the batch shrinks once no prompt is left to fill them)."""
        dev = slots.to(self.device)
        self.kv.keep(slots)
        self.job = [self.job[s] for s in slots.tolist()]
        self.active, self.count, self.tokens = self.active[slots], self.count[slots], self.tokens[slots]
        self.pos, self.last, self.uniforms = self.pos[slots], self.last[dev], self.uniforms[dev]


def load_generated(out_dir: str, kind: str = "shard"):
    """All complete shards (``kind="shard"``) or rejects (``"rejects"``) of a run, in shard order."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    files = sorted(str(p) for p in Path(out_dir).glob(f"{kind}-*-of-*.parquet"))
    if not files:
        raise EmptyResultError(f"{out_dir} has no {kind} files; run `debiased-nli generate` into it first")
    # read with pyarrow: an empty shard is a valid file (the HF metadata keeps the ClassLabel)
    return datasets.Dataset(pa.concat_tables([pq.read_table(f) for f in files]))


def summarize(out_dir: "str | Path", task: TaskSpec) -> dict:
    """Counts over the complete shards: parsed, rejected (by reason), label distribution, distinct-2."""
    cfg = json.loads((Path(out_dir) / CONFIG_FILE).read_text())
    rows, rej = load_generated(str(out_dir)), load_generated(str(out_dir), "rejects")
    total = len(rows) + len(rej)
    labels = np.bincount(labels_of(rows), minlength=task.num_labels) if len(rows) else np.zeros(task.num_labels, int)
    reasons: dict[str, int] = {}
    for r in rej["reason"]:
        reasons[r] = reasons.get(r, 0) + 1
    return {"config": cfg, "samples": total, "parsed": len(rows), "unparseable": len(rej),
            "parse_rate": round(len(rows) / total, 4) if total else None, "unparseable_reasons": reasons,
            "labels": {task.labels[k]: int(v) for k, v in enumerate(labels)},
            "distinct_2_hypothesis": distinct_n(rows["hypothesis"], 2) if len(rows) else None,
            "complete_shards": len(list(Path(out_dir).glob("shard-*-of-*.parquet")))}


def distinct_n(texts: Sequence[str], n: int = 2) -> float:
    """distinct-n (Li et al. 2016): distinct n-grams / all n-grams over the texts (features.tokenize words)."""
    import pyarrow as pa

    from ...bias.features import tokenize_arrow
    grams: list[tuple] = []
    for toks in tokenize_arrow(pa.array(list(texts), pa.string())).to_pylist():
        grams.extend(zip(*[toks[k:] for k in range(n)]))
    return round(len(set(grams)) / len(grams), 4) if grams else 0.0
