"""Engine ``ctranslate2``: sampling with CTranslate2 (``pip install 'debiased-nli[ctranslate2]'``).

The generator (its LoRA adapter merged into the base model first) is converted once into a CTranslate2
model folder, cached in ``$DEBIASED_NLI_CACHE/ctranslate2/ct2-<fingerprint>-<weights>`` (the fingerprint
hashes the generator's and, for an adapter, its base model's weight and config files, and the
CTranslate2 version; ``<weights>`` is the stored weight type: ``int8`` for the int8 compute types, else
the compute type). A later run with the same generator loads it again without converting; a changed
adapter or base model gets a new entry. ``debiased-nli cache clear`` deletes these entries too.

Sampling is CTranslate2's own (``Generator.generate_batch``), with the settings that make it plain
ancestral sampling from the model's distribution, as the other engines do:

* ``sampling_topk=0``: the whole vocabulary. CTranslate2's default, ``sampling_topk=1``, is greedy
  decoding (its ``make_sampler`` returns the best-token sampler for top-k 1), whatever top-p and
  temperature say.
* ``sampling_topp=top_p``, ``sampling_temperature=temperature`` (temperature first, then the top-p mask,
  as transformers' warpers).
* ``include_prompt_in_result=False``: the prompt is run into the model state, and then ``max_length``
  counts new tokens only (with the default ``True`` it counts the prompt too, so ``max_length=128`` gives
  128 - prompt tokens).
* ``return_end_token=True``: the end marker stays at the end of a finished sample (by default CTranslate2
  strips it, and a sample could not be told from one cut at the length limit, which the parser rejects).
* ``end_token``: the tokenizer's EOS token, the end marker of the sequence format.

Random numbers: CTranslate2 draws from a ``std::mt19937`` per thread, seeded from
``ctranslate2.set_random_seed`` when the thread first samples. So each shard sets its seed and opens a
new ``Generator`` (new worker thread, about 1 s for a 135M model), and a shard's samples depend on the
seed, the shard's prompts, the batch size and the compute type only, not on the other shards, the number
of processes or an interruption. As with ``--engine generate``, a sample depends on the batch it ran in
(the draws of one step are taken row after row from one generator), so another ``--batch-size`` gives
other samples, from the same distribution.

Compute types (``--dtype``): ``int8`` (int8 weights, float32 activations; ``int8_float32`` is its
other name on a CPU), ``float32``, and on a GPU ``float16``, ``bfloat16``, ``int8_float16``,
``int8_bfloat16``. ``auto`` (and no ``--dtype``): float32 on a CPU (:data:`DEFAULT_COMPUTE_TYPE`: int8 moves the
label shares), float16 on a GPU.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

from ...utils.errors import ConfigError

log = logging.getLogger(__name__)

COMPUTE_TYPES = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "float32", "float16", "bfloat16")
# --dtype auto (and no --dtype) for this engine on a CPU: float32, the one that samples the generator's own
# distribution. int8 moves the label a generator writes after a premise: on G* (SmolLM2-135M + LoRA), scored
# exactly on 1,000 premises, entailment +7.5 points and contradiction -5.2 against float32, where CTranslate2
# float32 equals torch float32 (benchmarks/results/engines/label_probs.md); sampled, 4,000 int8 samples against
# 3,000 float32 ones: entailment +6.4 points, chi-square p 4e-8 (parity_gstar.md).
DEFAULT_COMPUTE_TYPE = "float32"
CACHE_SUBDIR = "ctranslate2"
INSTALL_HINT = "pip install 'debiased-nli[ctranslate2]' (or pip install ctranslate2)"
# the files of a model folder that decide its weights (checkpoints/ and the card are not read)
_MODEL_FILES = ("config.json", "adapter_config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")


def require_ctranslate2():
    """The ``ctranslate2`` module, or a :class:`ConfigError` saying how to install it."""
    try:
        import ctranslate2
    except ImportError as err:
        raise ConfigError(f"--engine ctranslate2 needs the ctranslate2 package: {INSTALL_HINT} ({err})") from err
    return ctranslate2


def compute_type_for(dtype: str | None, device_type: str) -> str:
    """The CTranslate2 compute type of ``--dtype`` (None and ``auto``: :data:`DEFAULT_COMPUTE_TYPE` on a CPU,
    ``int8_float16`` on a GPU), checked against what this device supports."""
    ct2 = require_ctranslate2()
    device = "cuda" if device_type == "cuda" else "cpu"
    if dtype in (None, "auto"):
        ct = DEFAULT_COMPUTE_TYPE if device == "cpu" else "float16"
    else:
        ct = dtype
    if ct not in COMPUTE_TYPES:
        raise ConfigError(f"--dtype {ct!r} is not a CTranslate2 compute type; use one of {list(COMPUTE_TYPES)}")
    supported = ct2.get_supported_compute_types(device)
    if ct not in supported:
        raise ConfigError(f"--dtype {ct}: CTranslate2 {ct2.__version__} cannot compute in it on this {device} "
                          f"(it can in: {sorted(supported)})")
    return ct


def weight_type(compute_type: str) -> str:
    """The weight type stored in the converted folder for ``compute_type`` (what it loads without converting)."""
    return "int8" if compute_type.startswith("int8") else compute_type


def _model_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file()
                  and (p.name in _MODEL_FILES or p.name.endswith(_WEIGHT_SUFFIXES)))


def _resolve(name_or_path: str) -> Path:
    """A local folder for a generator or base model: itself, or the Hub snapshot in the local cache."""
    if os.path.isdir(name_or_path):
        return Path(name_or_path)
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as err:  # offline without a cached copy, an unknown id
        raise ConfigError(f"--generator {name_or_path}: no local folder and no Hub snapshot to convert for "
                          f"CTranslate2 ({err})") from err


def generator_fingerprint(generator: str) -> str:
    """16 hex digits that change when the generator's weights or config change (its base model's too, for a
    LoRA adapter), or the CTranslate2 version (which may write another model format)."""
    from ...utils.provenance import file_sha256
    from .models import is_adapter_folder

    ct2 = require_ctranslate2()
    folders = [_resolve(generator)]
    if is_adapter_folder(folders[0]):
        base = json.loads((folders[0] / "adapter_config.json").read_text())["base_model_name_or_path"]
        folders.append(_resolve(base))
    h = hashlib.sha256(f"ctranslate2={ct2.__version__}".encode())
    for k, folder in enumerate(folders):
        files = _model_files(folder)
        if not files:
            raise ConfigError(f"--generator {generator}: {folder} has no model files (config.json, "
                              f"adapter_config.json, *.safetensors, *.bin) to convert")
        for f in files:
            h.update(f"{k}/{f.name}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()[:16]


def converted_model(generator: str, compute_type: str, cache_dir: "str | Path | None" = None) -> Path:
    """The cached CTranslate2 folder of ``generator`` for ``compute_type``, converted now if absent (a LoRA
    adapter is merged into its base model first). Written under a temporary name and renamed when complete,
    then recorded as a cache entry of this tool; an entry whose bytes changed is discarded and converted again."""
    from ...utils.cache import default_cache_dir, record_entry, usable

    ct2 = require_ctranslate2()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / CACHE_SUBDIR / f"ct2-{generator_fingerprint(generator)}-{weight_type(compute_type)}"
    if final.exists() and usable(final):
        return final
    if final.exists():  # unrecorded (not ours): left alone, converted beside it under another name
        final = final.with_name(f"{final.name}-{os.getpid()}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        source = _merged_source(generator, tmp / "merged")
        from ctranslate2.converters import TransformersConverter
        TransformersConverter(str(source)).convert(str(tmp / "model"), quantization=weight_type(compute_type),
                                                   force=True)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp / "model", final)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"--generator {generator}: CTranslate2 {ct2.__version__} could not convert it "
                          f"({type(err).__name__}: {err}); use --engine fast") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record_entry(final)
    log.info("converted %s for CTranslate2 (%s weights) into %s in %.1f s", generator, weight_type(compute_type),
             final, time.perf_counter() - t0)
    return final


def _merged_source(generator: str, merged: Path) -> Path:
    """A folder CTranslate2's converter reads: the generator itself, or its adapter merged into the base model
    and saved to ``merged`` (in the base model's dtype)."""
    from .models import is_adapter_folder, load_generator
    folder = _resolve(generator)
    if not is_adapter_folder(folder):
        return folder
    model, tok = load_generator(str(folder))
    model = model.merge_and_unload()
    model.save_pretrained(merged)
    tok.save_pretrained(merged)
    return merged


def open_generator(model_dir: Path, compute_type: str, device_type: str, device_index: int, threads: int):
    ct2 = require_ctranslate2()
    device = "cuda" if device_type == "cuda" else "cpu"
    return ct2.Generator(str(model_dir), device=device, device_index=device_index, compute_type=compute_type,
                         inter_threads=1, intra_threads=threads if device == "cpu" else 0)


def ct2_shards(model_dir: Path, tok, shards, prompts_of, opts, *, tick, compute_type: str, device=None,
               threads: int = 1):
    """Yield ``(shard, seed, [(sample_index, prompt, continuation), ...])`` as the other engines do: shard i's
    prompts, sorted by length (stable), go in batches of ``opts.batch_size`` to a ``Generator`` opened after
    ``set_random_seed(seed_i)``, sampling with ``opts``' top-p, temperature and new tokens
    (:class:`.sample.SamplingOptions`) in ``compute_type`` on ``device`` (a torch device; None: the CPU). A
    batch runs until its last sample ends; CTranslate2 drops the finished rows from the batch as it goes."""
    ct2 = require_ctranslate2()
    end = tok.eos_token
    batch_size = opts.batch_size
    device_type, device_index = getattr(device, "type", "cpu"), getattr(device, "index", None) or 0
    options = dict(max_length=opts.max_new_tokens, sampling_topk=0, sampling_topp=opts.top_p,
                   sampling_temperature=opts.temperature, include_prompt_in_result=False, return_end_token=True,
                   **({"end_token": end} if end else {}))
    for i, s, indices in shards:
        idx = list(indices)
        prompts = prompts_of(idx)
        starts = _start_tokens(tok, prompts)
        order = sorted(range(len(idx)), key=lambda k: len(starts[k]))
        ct2.set_random_seed(int(s) % 2**32)
        gen = open_generator(model_dir, compute_type, device_type, device_index, threads)
        new: list = [None] * len(idx)
        for b in range(0, len(order), batch_size):
            part = order[b:b + batch_size]
            for k, r in zip(part, gen.generate_batch([starts[k] for k in part], **options)):
                new[k] = r.sequences_ids[0]
            tick(len(part))
        del gen
        texts = tok.batch_decode(new, skip_special_tokens=False)
        yield i, s, list(zip(idx, prompts, texts))


def _start_tokens(tok, prompts: Sequence[str]) -> list[list[str]]:
    """The prompts as token strings (CTranslate2's generator takes tokens, not ids), tokenized as the other
    engines do (no special tokens added: the format's start token is part of the prompt text)."""
    unique = list(dict.fromkeys(prompts))
    enc = {p: tok.convert_ids_to_tokens(ids) for p, ids in zip(unique, tok(unique, add_special_tokens=False)["input_ids"])}
    out = [enc[p] for p in prompts]
    for p, toks in zip(prompts, out):
        if not toks:
            raise ConfigError(f"prompt {p!r} has no tokens: CTranslate2 needs at least one start token")
    return out
