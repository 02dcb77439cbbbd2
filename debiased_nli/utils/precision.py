"""The arithmetic of inference forward passes: ``float32`` (the model's own) or ``bfloat16``.

``bfloat16`` runs the matrix products and attention in bfloat16 under :func:`torch.autocast` (layer norms,
softmax and the returned probabilities stay float32): on a CPU with AVX512-BF16 or AMX, or any recent GPU,
about twice as fast. On a CPU without them (no ``avx512_bf16`` / ``amx_bf16`` flag) torch emulates
bfloat16 and it is several times *slower* (measured: the documentation's PDD page); :func:`compute_context` warns.
It moves probabilities by ~1e-3 to 1e-2, so the argmax of a near-tied row can differ from float32's;
whoever uses it records it (the PDD run's identity, an evaluation's config). The project's option: none
of the papers says in which precision its models ran at inference.
"""
from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 CPU flags of native bfloat16 matrix arithmetic


def check_dtype(dtype: str, what: str = "compute dtype") -> str:
    if dtype not in DTYPES:
        from .errors import ConfigError
        raise ConfigError(f"unknown {what} {dtype!r}; known: {list(DTYPES)}")
    return dtype


@functools.lru_cache(maxsize=4)
def _cpuinfo(path: str = "/proc/cpuinfo") -> "dict[str, str] | None":
    """The first value of each key of /proc/cpuinfo (Linux), or None where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        return None
    return fields


def cpu_flags(path: str = "/proc/cpuinfo") -> "frozenset[str] | None":
    """The CPU's feature flags (Linux), or None where they cannot be read."""
    info = _cpuinfo(path)
    flags = info and (info.get("flags") or info.get("Features"))
    return frozenset(flags.split()) if flags else None


def native_bfloat16_cpu() -> "bool | None":
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); None: unknown (not Linux x86)."""
    flags = cpu_flags()
    if not flags or not any(f.startswith(("avx", "sse")) for f in flags):
        return None
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def cpu_description() -> dict:
    """The CPU a measurement ran on (model name, cores, torch's vector ISA, the bfloat16 flags), for results files."""
    import os
    import platform

    import torch

    model = (_cpuinfo() or {}).get("model name") or platform.processor()
    flags = cpu_flags() or frozenset()
    return {"model": model, "cpus": os.cpu_count(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512f": "avx512f" in flags, **{f: f in flags for f in NATIVE_BF16_FLAGS},
            "native_bfloat16": native_bfloat16_cpu()}


_warned: set = set()


def compute_context(device: "str | object", dtype: str):
    """The context the forward passes run in for ``dtype`` (see :data:`DTYPES`)."""
    import contextlib

    import torch

    check_dtype(dtype)
    if dtype == "float32":
        return contextlib.nullcontext()
    on_cpu = not str(device).startswith("cuda")
    if on_cpu and native_bfloat16_cpu() is False and "cpu" not in _warned:
        _warned.add("cpu")
        log.warning("bfloat16 on a CPU without native bfloat16 arithmetic (none of %s in /proc/cpuinfo): torch "
                    "emulates it and it is usually several times slower than float32 here; use float32",
                    "/".join(NATIVE_BF16_FLAGS))
    return torch.autocast(device_type="cuda" if str(device).startswith("cuda") else "cpu", dtype=torch.bfloat16)
