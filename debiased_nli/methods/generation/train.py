"""Training the generator G (MLE + lambda * label-consistency unlikelihood) and its debiased
fine-tune G* (MLE on Z(D0) + alpha * L_UL on Z-(D0)), under ``accelerate``.

Runs unchanged on CPU, one GPU, or many (``accelerate launch`` / ``torchrun``: DDP). Mixed precision is
accelerate's: ``accelerate launch --mixed_precision bf16`` or ``accelerate config`` set it, and
``mixed_precision="no"|"fp16"|"bf16"`` overrides them only when given. Gradient accumulation is
``accelerator.accumulate`` (no gradient sync between processes on the accumulating micro-batches; an
epoch's last, shorter window still steps). Every ``checkpoint_every`` optimizer steps
``accelerator.save_state`` writes the optimizer, scheduler, GradScaler (fp16) and every process's RNG
states, plus the trainable weights (``trainable.pt``, the LoRA weights alone for an adapter) and
``state.json`` (the step), to ``<out>/checkpoints/step-<N>`` (a temporary folder renamed when complete;
the last ``keep_checkpoints`` are kept). A rerun with the same output folder restores all of it with
``accelerator.load_state`` and skips the batches already seen, so killing and relaunching is the same
run. The data order of epoch e is ``ds.shuffle(seed + e)`` (with ``group_by_length``, the same shuffle
with rows of similar length batched together: :func:`epoch_order`), and the perturbed label l' of a row
is drawn once from ``seed`` (``l' = (l + u) mod K``, u uniform in 1..K-1), so neither depends on when
the run was resumed.

The optimiser is Adam(W) with ``betas``, ``eps`` and ``weight_decay`` (0: Adam), the schedule one of
``transformers.get_scheduler``'s (``constant``, ``constant_with_warmup``, ``linear``, ``cosine``). The
defaults are Table 7 of Wu et al. (2022), each quoted in :data:`debiased_nli.methods.generation.GENERATOR_TRAINING`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...data.loading import labels_of
from ...data.tasks import TaskSpec
from ...utils.errors import ConfigError, EmptyResultError
from .params import GENERATOR_TRAINING, paper_value
from .format import SequenceFormat
from .models import LoraOptions, count_parameters, load_generator, save_generator

log = logging.getLogger(__name__)

MODES = ("generator", "debias", "conditional")  # conditional: MLE of x given a prefix (conditional.py)
BIASED_COLUMN = "rejected_by"      # z_filter's list of the biased features that rejected a row
REJECTED_COLUMN = "in_rejected"    # 1 for Z-(D0) rows in a debiasing fine-tune set


def perturbed_labels(labels: np.ndarray, num_labels: int, seed: int) -> np.ndarray:
    """A wrong label l' != l for every row: ``(l + u) mod K`` with u uniform in 1..K-1 (seeded)."""
    if num_labels < 2:
        raise ConfigError("label-consistency unlikelihood needs at least two labels")
    u = np.random.default_rng(seed).integers(1, num_labels, size=len(labels))
    return (np.asarray(labels, dtype=np.int64) + u) % num_labels


def debias_training_set(kept, rejected):
    """Z(D0) (``in_rejected`` = 0, no biased features) + Z-(D0) (``in_rejected`` = 1, ``rejected_by``)
    as one training set for G*; ``rejected`` is ``z_filter(...).rejected``."""
    import datasets
    if BIASED_COLUMN not in rejected.column_names:
        raise ConfigError(f"the rejected rows need the column {BIASED_COLUMN!r} (the biased features that "
                          f"rejected them, as z_filter writes it); it has {rejected.column_names}")
    cols = ["premise", "hypothesis", "label"]
    z = kept.select_columns(cols)
    features = datasets.Features({**kept.features.copy(), BIASED_COLUMN: datasets.List(datasets.Value("string")),
                                  REJECTED_COLUMN: datasets.Value("int64")})
    features = datasets.Features({k: features[k] for k in cols + [BIASED_COLUMN, REJECTED_COLUMN]})
    z = z.add_column(BIASED_COLUMN, [[] for _ in range(len(z))])
    z = z.add_column(REJECTED_COLUMN, [0] * len(z)).cast(features)
    zm = rejected.select_columns(cols + [BIASED_COLUMN])
    zm = zm.add_column(REJECTED_COLUMN, [1] * len(zm)).cast(features)
    return datasets.concatenate_datasets([z, zm])


def encode_dataset(ds, task: TaskSpec, tokenizer, *, mode: str = "generator", max_length: int = 128,
                   seed: int = 0, progress: bool = True):
    """Tokenised training rows: ``input_ids``, ``hypothesis`` (mask), ``bias`` (mask) and, for G, the
    perturbed-label sequence ``p_input_ids``/``p_hypothesis``; for G*, ``in_rejected``."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, not {mode!r}")
    if mode == "conditional":
        from .conditional import encode_conditional
        return encode_conditional(ds, task, tokenizer, max_length=max_length, progress=progress)
    fmt = SequenceFormat.for_tokenizer(tokenizer, task.labels)
    labels = labels_of(ds)
    if mode == "generator":
        ds = ds.add_column("_perturbed", perturbed_labels(labels, task.num_labels, seed).tolist())
    elif BIASED_COLUMN not in ds.column_names or REJECTED_COLUMN not in ds.column_names:
        raise ConfigError(f"the debiasing fine-tune needs the columns {BIASED_COLUMN!r} and {REJECTED_COLUMN!r} "
                          f"(build the set with debias_training_set(z_kept, z_rejected)); "
                          f"got {ds.column_names}")

    def cut(x: list[int]) -> list[int]:
        return x[:max_length]

    def enc(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "hypothesis": [], "bias": []}
        if mode == "generator":
            out.update(p_input_ids=[], p_hypothesis=[])
        for i, (p, lab, h) in enumerate(zip(batch["premise"], batch["label"], batch["hypothesis"])):
            feats = batch[BIASED_COLUMN][i] if mode == "debias" else ()
            e = fmt.encode(tokenizer, p, lab, h, biased_features=feats or ())
            for k in ("input_ids", "hypothesis", "bias"):
                out[k].append(cut(e[k]))
            if mode == "generator":
                q = fmt.encode(tokenizer, p, batch["_perturbed"][i], h)
                out["p_input_ids"].append(cut(q["input_ids"]))
                out["p_hypothesis"].append(cut(q["hypothesis"]))
        return out

    keep = [REJECTED_COLUMN] if mode == "debias" else []
    return ds.map(enc, batched=True, batch_size=256, remove_columns=[c for c in ds.column_names if c not in keep],
                  desc=f"encoding ({mode})" if progress else None)


def collate(rows: Sequence[dict[str, Any]], pad_id: int):
    """Right-padded tensors (``mask`` 1 on real tokens); padding never enters a loss."""
    import torch

    def pad(key: str, value: int = 0, src: str | None = None):
        seqs = [r[key] for r in rows]
        n = max(len(s) for s in seqs)
        return torch.tensor([list(s) + [value] * (n - len(s)) for s in seqs], dtype=torch.long)

    out = {"input_ids": pad("input_ids", pad_id), "hypothesis": pad("hypothesis"), "bias": pad("bias")}
    out["mask"] = torch.tensor([[1] * len(r["input_ids"]) + [0] * (out["input_ids"].shape[1] - len(r["input_ids"]))
                                for r in rows], dtype=torch.long)
    if "p_input_ids" in rows[0]:
        out["p_input_ids"] = pad("p_input_ids", pad_id)
        out["p_hypothesis"] = pad("p_hypothesis")
        out["p_mask"] = torch.tensor([[1] * len(r["p_input_ids"]) + [0] * (out["p_input_ids"].shape[1] - len(r["p_input_ids"]))
                                      for r in rows], dtype=torch.long)
    if "loss_mask" in rows[0]:
        out["loss_mask"] = pad("loss_mask")
    if REJECTED_COLUMN in rows[0]:
        out[REJECTED_COLUMN] = torch.tensor([r[REJECTED_COLUMN] for r in rows], dtype=torch.long)
    return out


GROUP_MEGABATCH = 50  # the project's choice (as transformers' LengthGroupedSampler): batches sorted within 50


def epoch_order(lengths: Sequence[int], seed: int, batch_size: int, group_by_length: bool) -> list[int]:
    """The rows of one epoch in training order.

    Without grouping: the permutation of ``datasets``' ``shuffle(seed=seed)``. With grouping (the
    project's choice, as ``transformers``' ``LengthGroupedSampler``): that permutation cut into
    mega-batches of ``GROUP_MEGABATCH * batch_size`` rows, each sorted by length (longest first, ties
    in shuffled order) and cut into batches, and the batches put in a seeded random order (the last,
    shorter batch stays last). A batch then holds rows of similar length, so right padding, which the
    model computes for nothing, shrinks: on SNLI (mean 28 tokens, batch 24) a step costs about 0.57 of
    an ungrouped one. The rows seen per epoch, and the losses per row, are the same; only which rows
    share a batch changes.
    """
    n = len(lengths)
    perm = np.random.default_rng(seed).permutation(n)  # what datasets.Dataset.shuffle(seed=seed) draws
    if not group_by_length or n <= batch_size:
        return perm.tolist()
    lengths = np.asarray(lengths)
    mega = GROUP_MEGABATCH * batch_size
    batches: list[list[int]] = []
    for start in range(0, n, mega):
        chunk = np.asarray(perm[start:start + mega])
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        batches.extend(chunk[i:i + batch_size].tolist() for i in range(0, len(chunk), batch_size))
    tail = [batches.pop()] if len(batches[-1]) < batch_size else []
    rng = np.random.default_rng([seed, 1])  # a stream apart from the row permutation's
    return [i for b in [batches[j] for j in rng.permutation(len(batches))] + tail for i in b]


def batch_loss(model, batch, *, mode: str, lam: float, alpha: float):
    """The objective of ``mode`` on one collated batch -> (loss, parts)."""
    from .losses import debias_loss, generator_loss
    if mode == "generator":
        if batch["input_ids"].is_cuda:  # one pass where a step is bound by dispatching operations (joint_logits)
            logits, p_logits, b = joint_logits(model, batch)
        else:  # on a CPU the arithmetic binds, and one pass's larger logits cost more memory traffic than it saves
            b, logits = batch, model(input_ids=batch["input_ids"], attention_mask=batch["mask"]).logits
            p_logits = model(input_ids=batch["p_input_ids"], attention_mask=batch["p_mask"]).logits
        return generator_loss(logits, b["input_ids"], b["mask"], p_logits, b["p_input_ids"], b["p_hypothesis"], lam=lam)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["mask"]).logits
    if mode == "conditional":
        from .losses import mle_loss
        mle = mle_loss(logits, batch["input_ids"], batch["mask"] * batch["loss_mask"])
        return mle, {"mle": float(mle.detach())}
    return debias_loss(logits, batch["input_ids"], batch["mask"], batch["bias"], batch[REJECTED_COLUMN], alpha=alpha)


def joint_logits(model, batch):
    """G's two sequences of a batch (the row and the row with a perturbed label) in **one** forward pass: both
    right-padded to the longer one and stacked (2B rows). Returns the logits of each and the batch's sequences and
    masks padded to that width (the losses read only masked positions, so the padding adds nothing to them).

    The same logits as two passes: attention is causal and the padding comes after every real token, which are at
    the same positions (0..n-1) either way, so a real token sees exactly what it saw alone. One pass dispatches
    0.66x the operations of two (benchmarks/gpu_throughput.py's training step, tiny GPT-2: 2,082 against 3,153;
    half the bf16 casts of float32 weights under autocast): on an H200 (2026-11-28) G's step at batch 24 was bound by them (16% GPU utilisation,
    3.75 steps/s), not by arithmetic. The logits are split along the rows only (``split``): cutting the width too
    would make backward write a zero-filled copy of the whole logits tensor per half. Used on CUDA only: on a CPU
    the step is bound by arithmetic and memory traffic, and one pass was slower (tiny GPT-2, vocabulary 50,257:
    2.72 s against 2.10 s a step, the larger logits' log-softmax and the split's backward)."""
    import torch
    import torch.nn.functional as F

    width = max(batch["input_ids"].shape[1], batch["p_input_ids"].shape[1])
    b = {k: F.pad(batch[k], (0, width - batch[k].shape[1])) for k in
         ("input_ids", "mask", "p_input_ids", "p_mask", "p_hypothesis")}
    ids, mask = torch.cat([b["input_ids"], b["p_input_ids"]]), torch.cat([b["mask"], b["p_mask"]])
    logits, p_logits = model(input_ids=ids, attention_mask=mask).logits.split(batch["input_ids"].shape[0])
    return logits, p_logits, b


# ---------------------------------------------------------------------------------------------
# checkpoints (accelerator.save_state / load_state)

CHECKPOINT_WEIGHTS = "trainable.pt"
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")


def checkpoints(out_dir: Path) -> list[Path]:
    root = out_dir / "checkpoints"
    if not root.exists():
        return []
    cps = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / "state.json").exists()]
    return sorted(cps, key=lambda p: int(p.name.split("-")[1]))


def _trainable_state(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def _register_weight_hooks(accelerator) -> None:
    """Let ``save_state``/``load_state`` store only the trainable weights (a LoRA checkpoint is the
    adapter, not the 7B base), in ``trainable.pt``; accelerate saves and restores everything else."""
    import torch

    def save_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            for i, model in enumerate(models):
                name = CHECKPOINT_WEIGHTS if i == 0 else CHECKPOINT_WEIGHTS.replace(".pt", f"_{i}.pt")
                torch.save(_trainable_state(accelerator.unwrap_model(model)), Path(output_dir) / name)
        weights.clear()  # accelerate writes no full model copy

    def load_hook(models, input_dir):
        for i, model in enumerate(models):
            name = CHECKPOINT_WEIGHTS if i == 0 else CHECKPOINT_WEIGHTS.replace(".pt", f"_{i}.pt")
            _load_trainable(accelerator.unwrap_model(model), Path(input_dir) / name)
        models.clear()  # loaded here; accelerate loads no model weights

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def _load_trainable(target, path: Path) -> None:
    import torch
    state = torch.load(path, map_location="cpu")
    params = dict(target.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise ConfigError(f"checkpoint {path.parent} does not fit the model (e.g. parameter {missing[0]!r}); "
                          f"use another output folder or the same model/LoRA options as the first run")
    with torch.no_grad():
        for n, v in state.items():
            params[n].copy_(v.to(params[n].device, params[n].dtype))


def save_checkpoint(accelerator, out_dir: Path, step: int, keep: int) -> None:
    """``accelerator.save_state`` into a temporary folder, renamed to ``step-<step>`` when complete."""
    root = out_dir / "checkpoints"
    tmp, final = root / f".tmp-step-{step}", root / f"step-{step}"
    # a `step-N` folder is replaced only when it is one of ours (it has state.json, which this function
    # writes last); anything else under that name is the user's and is never deleted (every process
    # checks, so that all stop together)
    if final.exists() and not (final / "state.json").is_file():
        raise ConfigError(f"{final} exists and is not a checkpoint of debiased-nli (no state.json); "
                          f"it is left as it is: move it, or choose another --out")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "state.json").write_text(json.dumps({"step": step, "processes": accelerator.num_processes}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, path: Path) -> int:
    """Restore a checkpoint written by :func:`save_checkpoint`; returns its optimizer step."""
    if (path / "optimizer.pt").exists() and not (path / "optimizer.bin").exists():
        raise ConfigError(f"{path} was written by an older debiased-nli (hand-written checkpoint without the "
                          f"GradScaler and per-process RNG states); continue it with that version or start "
                          f"over in another output folder")
    saved = json.loads((path / "state.json").read_text())
    if saved.get("processes", accelerator.num_processes) != accelerator.num_processes:
        log.warning("checkpoint %s was written by %d processes, resuming with %d: the RNG states of the "
                    "missing processes are not restored", path, saved["processes"], accelerator.num_processes)
    accelerator.load_state(str(path))
    return int(saved["step"])


# ---------------------------------------------------------------------------------------------

def _default(name: str):
    """The default of a training value, as :data:`..GENERATOR_TRAINING` declares it (with its source)."""
    return paper_value(GENERATOR_TRAINING, name)


@dataclasses.dataclass(frozen=True)
class GeneratorTraining:
    """What a generator's training does: the objective (``mode``, one of :data:`MODES`, with ``lam`` and
    ``alpha``), the model (a new LoRA adapter with ``lora``, else every weight or the adapter it continues), the
    length (``max_steps``, else ``epochs``), the batches (``batch_size`` rows, ``grad_accum`` of them per
    optimizer step, of up to ``max_length`` tokens, grouped by length with ``group_by_length``), Adam(W) and its
    schedule, the ``seed``, ``mixed_precision`` (None: accelerate's setting), a checkpoint every
    ``checkpoint_every`` steps (the last ``keep_checkpoints`` kept) and the losses logged every ``log_every``.
    The defaults are Table 7 of Wu et al. (2022), quoted in :data:`..GENERATOR_TRAINING`."""

    mode: str = "generator"
    lora: LoraOptions | None = None
    max_steps: int | None = None
    epochs: int = _default("epochs")
    batch_size: int = _default("batch_size")
    grad_accum: int = _default("grad_accum")
    lr: float = _default("lr")
    eps: float = _default("eps")
    betas: Sequence[float] = _default("betas")
    scheduler: str = _default("scheduler")
    warmup_steps: int = _default("warmup_steps")
    weight_decay: float = _default("weight_decay")
    lam: float = _default("lam")
    alpha: float = _default("alpha")
    max_length: int = _default("max_length")
    checkpoint_every: int = _default("checkpoint_every")
    keep_checkpoints: int = 2
    seed: int = _default("seed")
    mixed_precision: str | None = _default("mixed_precision")
    group_by_length: bool = _default("group_by_length")
    log_every: int = 10


def train_generator(ds, task: TaskSpec, model: str, out_dir: str, training: GeneratorTraining | None = None, *,
                    cpu: bool = False, merge: bool = False, progress: bool = True,
                    stop_after: int | None = None) -> dict:
    """Train G (``mode="generator"``: MLE + lam * L_LC) or G* (``mode="debias"``: MLE on Z(D0) +
    alpha * L_UL on Z-(D0)) from ``model`` (Hub id or folder; a LoRA adapter folder continues it), as
    ``training`` says (:class:`GeneratorTraining`).

    Defaults: Wu et al. (2022), Table 7 (lr 1e-5, batch 24, 5 epochs, Adam eps 1e-6, betas (0.9, 0.999),
    constant schedule, length 128, lambda 0.5, alpha 1.0). ``training.mixed_precision=None`` leaves it to
    accelerate (``accelerate launch --mixed_precision`` / ``accelerate config``).
    Saves the adapter (LoRA) or full model and the tokenizer to ``out_dir`` (``merged/`` too with
    ``merge``) and returns a report (steps, losses, seconds per step, parameter counts).
    ``training.group_by_length`` batches rows of similar length together (:func:`epoch_order`).
    ``stop_after`` ends the process's work after that many optimizer steps without the final save
    (what a kill does; used to test resuming).
    """
    import torch
    from tqdm.auto import tqdm

    opts = training or GeneratorTraining()
    _check_training_options(ds, opts.scheduler, opts.warmup_steps, opts.batch_size, opts.grad_accum)
    trainer, tok, data, params = _prepare(ds, task, model, Path(out_dir), opts, cpu=cpu, progress=progress)
    accelerator = trainer.accelerator
    step = 0
    cps = checkpoints(trainer.out)
    if cps:
        step = load_checkpoint(accelerator, cps[-1])
        log.info("resuming from %s (step %d)", cps[-1], step)
    bar = tqdm(total=trainer.total, initial=step, desc=f"train {opts.mode}",
               disable=not (progress and accelerator.is_main_process))
    trainer.net.train()
    t0 = time.perf_counter()
    run = _optimizer_steps(trainer, data, tok.pad_token_id, bar, step=step, stop_after=stop_after)
    bar.close()
    if run.stopped:
        return {"stopped_at": run.step}
    seconds = time.perf_counter() - t0
    accelerator.wait_for_everyone()
    tokens = int(accelerator.reduce(torch.tensor(run.tokens, device=accelerator.device), reduction="sum"))
    report = _train_report(trainer, run, {"model": model, "task": task.name, "rows": len(ds)}, seconds, tokens)
    report.update({"parameters": params, "history": run.history, "resumed_from": cps[-1].name if cps else None})
    if accelerator.is_main_process:
        _save_trained(accelerator.unwrap_model(trainer.net), tok, trainer.out, report, task, merge=merge)
    accelerator.wait_for_everyone()
    return report


@dataclasses.dataclass
class _Trainer:
    """What the training loop works with: accelerate's state, the prepared model, optimizer and schedule, the
    output folder, the options, and the run's length in optimizer steps (in all, and per epoch)."""

    accelerator: Any
    net: Any
    optim: Any
    sched: Any
    out: Path
    opts: GeneratorTraining
    total: int
    steps_per_epoch: int


def _prepare(ds, task: TaskSpec, model: str, out: Path, opts: GeneratorTraining, *, cpu: bool, progress: bool):
    """Accelerate's state, the generator and its tokenizer, the encoded rows, the optimizer and the schedule,
    prepared: (trainer, tokenizer, encoded rows, parameter counts)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    kwargs = {} if opts.mixed_precision is None else {"mixed_precision": opts.mixed_precision}
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=opts.grad_accum, **kwargs)
    _register_weight_hooks(accelerator)
    set_seed(opts.seed)
    net, tok = load_generator(model, lora=opts.lora, trainable=True)
    params = count_parameters(net)
    data = encode_dataset(ds, task, tok, mode=opts.mode, max_length=opts.max_length, seed=opts.seed,
                          progress=progress and accelerator.is_main_process)
    batches_per_epoch = math.ceil(math.ceil(len(data) / opts.batch_size) / accelerator.num_processes)
    steps_per_epoch = math.ceil(batches_per_epoch / opts.grad_accum)  # accumulate() steps at an epoch's end too
    total = opts.max_steps or steps_per_epoch * opts.epochs
    optim, sched = _optimizer_and_schedule(net, accelerator, total, lr=opts.lr, betas=opts.betas, eps=opts.eps,
                                           weight_decay=opts.weight_decay, scheduler=opts.scheduler,
                                           warmup_steps=opts.warmup_steps)
    net, optim, sched = accelerator.prepare(net, optim, sched)
    return _Trainer(accelerator, net, optim, sched, out, opts, total, steps_per_epoch), tok, data, params


def _train_report(trainer: _Trainer, run: "_StepsRun", what: dict, seconds: float, tokens: int) -> dict:
    """The report's settings and figures (``what``: the model, task and rows trained on)."""
    opts, accelerator, lora = trainer.opts, trainer.accelerator, trainer.opts.lora
    return {"mode": opts.mode, **what, "steps": run.step,
            "steps_this_run": run.steps_run, "seconds": round(seconds, 2),
            "seconds_per_step": round(seconds / max(run.steps_run, 1), 3), "batch_size": opts.batch_size,
            # real tokens (no padding) through forward and backward, every process, this run (G: both sequences)
            "tokens_this_run": tokens, "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "grad_accum": opts.grad_accum, "processes": accelerator.num_processes, "lr": opts.lr, "eps": opts.eps,
            "betas": list(opts.betas), "scheduler": opts.scheduler, "warmup_steps": opts.warmup_steps,
            "weight_decay": opts.weight_decay, "epochs": opts.epochs, "lambda": opts.lam,
            "alpha": opts.alpha, "max_length": opts.max_length, "seed": opts.seed,
            "group_by_length": opts.group_by_length, "mixed_precision": str(accelerator.mixed_precision),
            "lora": None if lora is None else {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout,
                                                 "target_modules": lora.target_modules}}


def _check_training_options(ds, scheduler: str, warmup_steps: int, batch_size: int, grad_accum: int) -> None:
    if len(ds) == 0:
        raise EmptyResultError("the generator's training set is empty")
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"scheduler must be one of {SCHEDULERS}, not {scheduler!r}")
    if scheduler == "constant" and warmup_steps:
        raise ConfigError(f"the constant schedule has no warm-up ({warmup_steps} warm-up steps given); use "
                          f"scheduler='constant_with_warmup'")
    if grad_accum < 1 or batch_size < 1:
        raise ConfigError(f"batch_size and grad_accum must be >= 1 (got {batch_size}, {grad_accum})")


def _optimizer_and_schedule(net, accelerator, total: int, *, lr: float, betas: Sequence[float], eps: float,
                            weight_decay: float, scheduler: str, warmup_steps: int):
    """Adam(W) over the trainable parameters and the learning-rate schedule of ``total`` optimizer steps."""
    import torch
    from transformers import get_scheduler

    optim = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, betas=tuple(betas),
                              eps=eps, weight_decay=weight_decay)
    # a prepared scheduler steps once per process per optimizer step (accelerate's convention)
    sched = get_scheduler(scheduler, optim, num_warmup_steps=warmup_steps * accelerator.num_processes,
                          num_training_steps=total * accelerator.num_processes)
    return optim, sched


@dataclasses.dataclass
class _StepsRun:
    step: int                 # the optimizer step reached
    steps_run: int            # optimizer steps taken by this call
    history: list[dict]       # the logged losses
    stopped: bool             # ended by ``stop_after`` (no final save)
    tokens: int = 0           # real (unpadded) tokens this process ran forward and backward (both sequences of G)


def _optimizer_steps(trainer: _Trainer, data, pad_id: int, bar, *, step: int, stop_after: int | None) -> _StepsRun:
    """The training loop from optimizer step ``step`` to ``trainer.total``: epoch e reads :func:`epoch_order`
    (``seed + e``) (skipping the batches of a resumed epoch already seen), logs every ``log_every`` steps and
    saves a checkpoint every ``checkpoint_every``; ``stop_after`` steps of this call end it as a kill would."""
    from torch.utils.data import DataLoader

    accelerator, opts, total = trainer.accelerator, trainer.opts, trainer.total
    run = _StepsRun(step, 0, [], stopped=False)
    window = _LogWindow(time.perf_counter())
    epoch, done = divmod(step, trainer.steps_per_epoch)
    skip = done * opts.grad_accum
    lengths = [len(x) for x in data["input_ids"]] if opts.group_by_length else [0] * len(data)
    while run.step < total:
        # one batch per process per micro-step: grouping blocks of batch_size keeps each process's batch even
        order = data.select(epoch_order(lengths, opts.seed + epoch, opts.batch_size, opts.group_by_length))
        dl = accelerator.prepare(DataLoader(order, batch_size=opts.batch_size, shuffle=False,
                                            collate_fn=lambda rows: collate(rows, pad_id)))
        if skip:
            dl = accelerator.skip_first_batches(dl, skip)
        for batch in dl:
            parts = _micro_step(trainer, batch, run, window)
            if not accelerator.sync_gradients:
                continue
            run.step += 1
            run.steps_run += 1
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(window.losses):.3f}")
            if run.step % opts.log_every == 0 or run.step == total:
                run.history.append(window.close(run.step, parts, trainer.sched.get_last_lr()[0], run.tokens))
            if opts.checkpoint_every and run.step % opts.checkpoint_every == 0 and run.step < total:
                save_checkpoint(accelerator, trainer.out, run.step, opts.keep_checkpoints)
            if stop_after is not None and run.steps_run >= stop_after:
                run.stopped = True
                return run
            if run.step >= total:
                break
        epoch, skip = epoch + 1, 0
    return run


def _micro_step(trainer: _Trainer, batch, run: _StepsRun, window: "_LogWindow") -> dict:
    """Forward and backward on one micro-batch (the optimizer and schedule act only when gradients sync);
    counts its loss and real tokens. Returns the loss's parts."""
    accelerator, opts = trainer.accelerator, trainer.opts
    with accelerator.accumulate(trainer.net):
        with accelerator.autocast():
            loss, parts = batch_loss(trainer.net, batch, mode=opts.mode, lam=opts.lam, alpha=opts.alpha)
        accelerator.backward(loss)  # divided by grad_accum inside accumulate()
        trainer.optim.step()       # the prepared optimizer and scheduler act only when gradients sync
        trainer.sched.step()
        trainer.optim.zero_grad(set_to_none=True)
    window.losses.append(float(loss.detach()))
    run.tokens += int(batch["mask"].sum()) + (int(batch["p_mask"].sum()) if "p_mask" in batch else 0)
    return parts


@dataclasses.dataclass
class _LogWindow:
    """The steps since the last logged one: when it began, the tokens counted at that time and the losses."""

    started: float
    tokens_before: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)

    def close(self, step: int, parts: dict, lr: float, tokens: int) -> dict:
        """The history record of the window ending at ``step``; a new window starts."""
        now = time.perf_counter()
        record = {"step": step, "loss": float(f"{np.mean(self.losses):.6g}"),
                  **{k: float(f"{v:.6g}") for k, v in parts.items()}, "lr": lr,
                  "seconds": round(now - self.started, 3), "tokens": tokens - self.tokens_before}
        self.started, self.tokens_before, self.losses = now, tokens, []
        return record


def _save_trained(unwrapped, tok, out: Path, report: dict, task: TaskSpec, *, merge: bool) -> None:
    """The adapter or full model, the tokenizer and the card to ``out`` (``merged/`` too with ``merge``), and
    ``train_report.json``."""
    save_generator(unwrapped, tok, out, card=report, task=task)
    if merge:
        report["merged"] = save_generator(unwrapped, tok, out / "merged", merge=True, card=report, task=task)
    (out / "train_report.json").write_text(json.dumps(report, indent=2, default=str))
