"""Which output of a classifier is which of the task's labels."""
from __future__ import annotations

from typing import Sequence

from ..utils.errors import ConfigError


def map_model_labels(id2label: dict[int, str], label_names: Sequence[str], model: str = "model") -> list[int]:
    """For each task label, the model's output index with that name (case-insensitive).

    Generic names (LABEL_0, ...) are taken to be in the task's order; other mismatches are refused.
    """
    names = {i: l.lower() for i, l in id2label.items()}
    if len(names) != len(label_names):
        raise ConfigError(f"{model} has {len(names)} labels {list(id2label.values())}, the task has "
                          f"{len(label_names)} {list(label_names)}")
    if all(l.startswith("label_") for l in names.values()):
        return list(range(len(label_names)))
    order = []
    for name in label_names:
        hits = [i for i, l in names.items() if l == name.lower()]
        if not hits:
            raise ConfigError(f"{model}: no output named {name!r}; its labels are {id2label}. "
                              f"Use a model whose id2label names the task's labels {list(label_names)}.")
        order.append(hits[0])
    return order
