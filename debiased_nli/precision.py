"""The arithmetic of inference forward passes: ``float32`` (the model's own) or ``bfloat16``.

``bfloat16`` runs the matrix products and attention in bfloat16 under :func:`torch.autocast` (layer norms,
softmax and the returned probabilities stay float32): on a CPU with AVX512-BF16 or AMX, or any recent GPU,
about twice as fast. It moves probabilities by ~1e-3 to 1e-2, so the argmax of a near-tied row can differ
from float32's; whoever uses it records it (the PDD run's identity, an evaluation's config). The project's
option: none of the papers says in which precision its models ran at inference.
"""
from __future__ import annotations

DTYPES = ("float32", "bfloat16")


def check_dtype(dtype: str, what: str = "compute dtype") -> str:
    if dtype not in DTYPES:
        from .errors import ConfigError
        raise ConfigError(f"unknown {what} {dtype!r}; known: {list(DTYPES)}")
    return dtype


def compute_context(device: "str | object", dtype: str):
    """The context the forward passes run in for ``dtype`` (see :data:`DTYPES`)."""
    import contextlib

    import torch

    check_dtype(dtype)
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda" if str(device).startswith("cuda") else "cpu", dtype=torch.bfloat16)
