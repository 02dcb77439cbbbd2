"""Compute every feature of a task once: the row-local extractors (one ``datasets.map``), then the
hypothesis-only model and its ``hypo-only-pred=<label>`` feature.

The map is cached by fingerprint in ``cache_dir`` (default ``$DEBIASED_NLI_CACHE`` or
``~/.cache/debiased-nli``), and so are the out-of-fold hypothesis-only predictions, so a second run
over the same input reads them instead of recomputing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from . import __version__
from .data import labels_of
from .errors import ConfigError
from .features import (HYPO_ONLY_COLUMN, add_feature_columns, build_feature_matrix, feature_columns,
                       get_extractor)
from .hypothesis_only import HypothesisOnlyResult, out_of_fold_tfidf, transformer_predictions
from .tasks import TaskSpec, get_task

HYPO_ONLY_EXTRACTOR = "hypo_only_v1"


def default_cache_dir() -> Path:
    return Path(os.environ.get("DEBIASED_NLI_CACHE", Path.home() / ".cache" / "debiased-nli"))


def _hash(obj) -> str:
    from datasets.fingerprint import Hasher
    return Hasher.hash(obj)


def add_features(ds, task: "str | TaskSpec", *, extractors: Sequence[str] | None = None,
                 hypothesis_only: str | None = "tfidf", hypo_only_folds: int = 5, seed: int = 0,
                 cache_dir: "str | Path | None" = None, num_proc: int | None = None,
                 progress: bool = True) -> tuple[object, HypothesisOnlyResult | None]:
    """Add the task's feature columns (``feat_<extractor>``) to a canonical dataset.

    ``hypothesis_only``: ``"tfidf"`` (out-of-fold TF-IDF + logistic regression, the default), a
    model folder or Hub id (a fine-tuned sequence classifier run on the hypothesis), or ``None`` to
    leave the hypothesis-only feature out.
    """
    task = get_task(task)
    names = list(extractors if extractors is not None else task.features)
    for name in names:
        get_extractor(name)
    lexical = [n for n in names if HYPO_ONLY_COLUMN not in get_extractor(n).requires]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    key = _hash([ds._fingerprint, lexical, list(task.labels), __version__])
    ds = ds.remove_columns([c for c in feature_columns(ds) + [HYPO_ONLY_COLUMN] if c in ds.column_names])
    out = add_feature_columns(ds, lexical, task.labels, num_proc=num_proc,
                              cache_file_name=str(cache / f"features-{key}.arrow"),
                              desc=f"features ({len(lexical)} extractors)")
    if HYPO_ONLY_EXTRACTOR not in names or hypothesis_only is None:
        return out, None
    labels = labels_of(out)
    if hypothesis_only == "tfidf":
        params = {"folds": hypo_only_folds, "seed": seed}
        pkey = _hash([ds._fingerprint, lexical, params, __version__])
        cached = cache / f"hypo-only-{pkey}.npz"
        if cached.exists():
            z = np.load(cached, allow_pickle=False)
            result = HypothesisOnlyResult(z["pred"], z["probs"], float(z["acc"]), "tfidf-logreg-oof",
                                          json.loads(str(z["params"])))
        else:
            fm = build_feature_matrix(out)
            result = out_of_fold_tfidf(fm, labels, task.num_labels, folds=hypo_only_folds, seed=seed,
                                       progress=progress)
            np.savez(cached, pred=result.predictions, probs=result.probabilities, acc=result.accuracy,
                     params=json.dumps(result.params))
    else:
        result = transformer_predictions(hypothesis_only, out["hypothesis"], labels, task.labels, progress=progress)
    out = out.add_column(HYPO_ONLY_COLUMN, result.predictions.astype(np.int64).tolist())
    out = add_feature_columns(out, [HYPO_ONLY_EXTRACTOR], task.labels, desc="hypothesis-only feature")
    return out, result


def require_features(ds, what: str = "this stage") -> None:
    if not feature_columns(ds):
        raise ConfigError(f"{what} needs feature columns (feat_*); run debiased_nli.featurize.add_features first")
