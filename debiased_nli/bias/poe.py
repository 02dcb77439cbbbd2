"""The bias model of product-of-experts training (Wu et al. 2022, appendix A.2; Clark et al. 2019):
the hypothesis-only model's per-row log-probabilities, which :func:`debiased_nli.models.training.train_classifier`
combines with the main model's in :func:`~debiased_nli.models.training.poe_loss`."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..data.tasks import TaskSpec
from ..utils.errors import ConfigError
from .task_features import add_features


def bias_log_probabilities(ds, task: TaskSpec, bias_model: str = "tfidf", *, seed: int = 0,
                           progress: bool = True) -> tuple[np.ndarray, dict]:
    """Per-row log-probabilities of the hypothesis-only bias model, rows x K, in the task's label order.

    ``"tfidf"``: the out-of-fold predictions of :func:`debiased_nli.bias.task_features.add_features` (no row is
    scored by a model that saw it); otherwise a fine-tuned classifier folder run on the hypothesis.
    Probabilities are clipped at 1e-6 before the log, so a confident bias model cannot give -inf.
    """
    _, result = add_features(ds, task, hypothesis_only=bias_model, seed=seed, progress=progress)
    if result is None:
        raise ConfigError(f"task {task.name!r} has no hypothesis-only feature (hypo_only_v1); cannot build "
                          f"a PoE bias model for it")
    probs = np.clip(np.asarray(result.probabilities, dtype=np.float64), 1e-6, 1.0)
    probs /= probs.sum(axis=1, keepdims=True)
    return np.log(probs).astype(np.float32), result.to_dict()


def bias_model_for(cfg: Any, task: TaskSpec) -> Callable[[Any], tuple[np.ndarray, dict]]:
    """The fixed bias model a :class:`~debiased_nli.models.training.TrainConfig` names (``cfg.bias_model``:
    ``"tfidf"`` or a hypothesis-only classifier folder), as the function of the training rows that
    ``train_classifier(..., bias_model=...)`` calls on the rows it trains on."""
    return lambda ds: bias_log_probabilities(ds, task, cfg.bias_model, seed=cfg.data_seed, progress=cfg.progress)
