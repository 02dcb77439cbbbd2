"""Sampling new rows from a trained generator: sharded by rank, one Parquet file per shard, resumable.

The requested number of samples is split into ``num_shards`` shards (default: one per
``shard_size`` samples, at least one per process); process ``rank`` of ``world`` takes shards
``rank, rank + world, ...``. Shard i is generated with its own seed (``SeedSequence([seed, i])``) in
fixed batches, so its content does not depend on which process made it, how many there were, or
whether the run was interrupted: a 2-process run writes the same shards as a 1-process run.

A shard is written to a temporary name (``.shard-*.tmp``) and renamed when complete; its rejects
file is renamed before it, so a present shard file means the shard is done, and a rerun skips it
(killing a run and starting it again gives the same final set as an uninterrupted run). The run's
parameters are stored in ``generate_config.json``; a rerun with other parameters into the same
folder is refused rather than mixing two runs.

Generation is batched with left padding, up to ``max_new_tokens`` (default 128: a sequence as long as
the longest the generator was trained on, Table 7's "max sequence length 128", is never cut and
rejected). By default it is plain ancestral sampling (``top_p=1.0``, ``temperature=1.0``): Wu et al.
(2022, Sec. 2.1) "randomly sample from the trained generator" and give no nucleus mass; ``top_p < 1``
gives nucleus sampling. Prompts are the format's start (unconditional, as Wu et al. 2022 sample whole
examples), or with ``condition="premise"`` / ``"premise+label"`` a premise from a given set (and a
label, cycling through the task's labels). Every sample is parsed back (see ``format.py``); the
unparseable ones are kept with their text and reason in ``rejects-*.parquet``. Parsed samples are
canonical rows (``origin="generated"``, ``method="generator:<name>"``) with their provenance:
``generator``, ``checkpoint``, ``shard``, ``seed``, ``sample_index``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ...data.loading import labels_of
from ...data.tasks import TaskSpec, get_task
from ...utils.errors import ConfigError, EmptyResultError
from .format import SequenceFormat

log = logging.getLogger(__name__)

CONDITIONS = ("none", "premise", "premise+label", "prompts")  # prompts: one given prompt per sample
CONFIG_FILE = "generate_config.json"
REPORT_FILE = "generate_report.json"
PROVENANCE = ("generator", "checkpoint", "shard", "seed", "sample_index")


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


def generate_samples(generator: str, out_dir: str, task: "str | TaskSpec", num_samples: int, *,
                     num_shards: int | None = None, shard_size: int = 1000, seed: int = 0, batch_size: int = 16,
                     top_p: float = 1.0, temperature: float = 1.0, max_new_tokens: int = 128,
                     condition: str = "none", premises: Sequence[str] | None = None, cpu: bool = False,
                     dtype: str | None = None, progress: bool = True, stop_after_shards: int | None = None,
                     prompts: Sequence[str] | None = None, parse=None) -> dict:
    """Sample ``num_samples`` rows from ``generator`` into ``out_dir`` (shards + rejects + report).

    ``condition="prompts"`` samples from ``prompts[i]`` for sample i (one per sample) and parses
    prompt + continuation with ``parse`` (text -> (row, None) or (None, reason)), e.g. a
    :class:`.conditional.ConditionalFormat`'s.

    Run it under ``accelerate launch`` / ``torchrun`` to share the shards between processes.
    ``stop_after_shards`` ends this process's work after that many new shards (what a kill does).
    """
    import torch
    from accelerate import PartialState
    from tqdm.auto import tqdm

    from .models import load_generator

    task = get_task(task)
    if condition not in CONDITIONS:
        raise ConfigError(f"condition must be one of {CONDITIONS}, not {condition!r}")
    if condition == "prompts":
        if prompts is None or len(prompts) != num_samples or parse is None:
            raise ConfigError(f"condition='prompts' needs one prompt per sample ({num_samples}) and a parse function")
    elif condition != "none" and not premises:
        raise ConfigError(f"condition={condition!r} needs premises (--premises-from DATA)")
    if not (0 < top_p <= 1) or temperature <= 0:
        raise ConfigError(f"top_p must be in (0, 1] and temperature > 0; got top_p={top_p}, temperature={temperature}")
    state = PartialState(cpu=cpu)
    n_shards = num_shards or max(state.num_processes, -(-num_samples // shard_size))
    sizes = shard_sizes(num_samples, n_shards)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    name, checkpoint = generator_provenance(generator)
    out = Path(out_dir)
    config = {"generator": generator, "task": task.name, "num_samples": num_samples, "num_shards": n_shards,
              "seed": seed, "batch_size": batch_size, "top_p": top_p, "temperature": temperature,
              "max_new_tokens": max_new_tokens, "condition": condition,
              "premises": None if premises is None else len(premises)}
    if prompts is not None:
        import hashlib
        config["prompts"] = hashlib.sha256("\x00".join(prompts).encode()).hexdigest()
    cfg_path = out / CONFIG_FILE
    # a config with no shard beside it is what a failed run of an older version left: nothing to
    # protect, so it is replaced rather than refusing every later run
    has_shards = any(out.glob("shard-*-of-*.parquet")) or any(out.glob("rejects-*-of-*.parquet"))
    if state.is_main_process and cfg_path.exists() and has_shards:
        try:
            old = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            old = {}
        if old != config:
            diff = {k: (old.get(k), v) for k, v in config.items() if old.get(k) != v}
            raise ConfigError(f"{out} holds shards of another run (differences, old -> new: {diff}); "
                              f"use another --out folder or the same parameters to resume")
    mine = [i for i in range(n_shards) if i % state.num_processes == state.process_index]
    todo = [i for i in mine if not (out / shard_name(i, n_shards)).exists()]
    model = tok = None
    if todo:  # the generator is loaded and checked before anything is written
        try:
            model, tok = load_generator(generator, dtype=dtype)
        except Exception as err:  # missing or corrupt weights: one line naming the generator
            from ...data.loading import root_cause
            raise ConfigError(f"--generator {generator}: cannot load it ({root_cause(err)})") from err
        if hasattr(model, "merge_and_unload"):  # a LoRA adapter: merged weights sample the same, faster
            model = model.merge_and_unload()
        model.to(state.device).eval()
        tok.padding_side = "left"
    fmt = SequenceFormat.for_tokenizer(tok, task.labels) if tok is not None else None
    order = (np.random.default_rng(seed).permutation(len(premises)) if premises else None)
    if condition == "prompts":
        premises, order = prompts, np.arange(len(prompts))
    if todo:  # the first batch's prompts and the new tokens must fit the generator's context
        first = list(range(starts[todo[0]], min(starts[todo[0]] + batch_size, starts[todo[0] + 1])))
        check_context(model, tok, prompts_for(fmt, first, condition, premises, order), max_new_tokens, generator)
    if state.is_main_process and not (cfg_path.exists() and has_shards):
        out.mkdir(parents=True, exist_ok=True)
        tmp_cfg = cfg_path.with_name(f".{CONFIG_FILE}.tmp")
        tmp_cfg.write_text(json.dumps(config, indent=2))
        os.replace(tmp_cfg, cfg_path)
    state.wait_for_everyone()
    bar = tqdm(total=int(sum(sizes[i] for i in todo)), unit="sample", desc=f"generate (rank {state.process_index})",
               disable=not progress, position=state.process_index)
    t0, made, done_now = time.perf_counter(), 0, 0
    for i in todo:
        s = shard_seed(seed, i)
        torch.manual_seed(s)
        parsed, prov, rejects = [], {k: [] for k in PROVENANCE}, {k: [] for k in ("sample_index", "shard", "seed", "text", "reason")}
        for b in range(starts[i], starts[i + 1], batch_size):
            idx = list(range(b, min(b + batch_size, starts[i + 1])))
            prompts = prompts_for(fmt, idx, condition, premises, order)
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(state.device)
            check_context(model, tok, enc["input_ids"].shape[1], max_new_tokens, generator)
            with torch.no_grad():
                gen = model.generate(**enc, do_sample=True, top_p=top_p, temperature=temperature, top_k=0,
                                     max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
            for j, prompt, cont in zip(idx, prompts, texts):
                row, why = (parse or fmt.parse)(prompt + cont)
                if row is None:
                    for k, v in (("sample_index", j), ("shard", i), ("seed", s), ("text", prompt + cont), ("reason", why)):
                        rejects[k].append(v)
                    continue
                parsed.append(row)
                for k, v in (("generator", name), ("checkpoint", checkpoint), ("shard", i), ("seed", s), ("sample_index", j)):
                    prov[k].append(v)
            made += len(idx)
            bar.update(len(idx))
            bar.set_postfix(samples_per_s=f"{made / (time.perf_counter() - t0):.2f}")
        import datasets
        rej = datasets.Dataset.from_dict(rejects, features=datasets.Features({
            "sample_index": datasets.Value("int64"), "shard": datasets.Value("int64"), "seed": datasets.Value("int64"),
            "text": datasets.Value("string"), "reason": datasets.Value("string")}))
        _write(rej, out / shard_name(i, n_shards, "rejects"))
        _write(_rows(task, parsed, name, prov), out / shard_name(i, n_shards))
        done_now += 1
        if stop_after_shards is not None and done_now >= stop_after_shards:
            bar.close()
            return {"stopped_after_shards": done_now}
    bar.close()
    seconds = time.perf_counter() - t0
    state.wait_for_everyone()
    report = summarize(out, task) if state.is_main_process else {}
    if state.is_main_process:
        report["this_run"] = {"processes": state.num_processes, "samples": made, "seconds": round(seconds, 2),
                              "samples_per_s_rank0": round(made / seconds, 3) if made else None}
        (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    state.wait_for_everyone()
    return report


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
