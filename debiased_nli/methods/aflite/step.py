"""AFLite as a recipe step and a dataset filter: the paper's protocol (warm-up fine-tuning, first-token
embeddings, rounds of :func:`~debiased_nli.methods.aflite.algorithm.aflite`), the rows it removes kept with
their reason, and the audit of the kept rows."""
from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from ...data.loading import labels_of
from ...data.tasks import TaskSpec
from ...utils.errors import ConfigError, InvalidInputError
from .algorithm import AFLITE_REASON, WARMUP_REASON, AFLiteParams, AFLiteResult, aflite, paper_target_size
from .params import PARAMS

log = logging.getLogger(__name__)

RUN_OPTIONS = ("precondition", "dtype", "device", "progress")
"""The keywords of :func:`aflite_filter` that say how to run :func:`.algorithm.aflite`, not what it computes."""


def aflite_filter(ds, embeddings: np.ndarray, *, num_labels: int | None = None, **params) -> tuple[Any, Any, AFLiteResult]:
    """AFLite on a canonical dataset with one embedding per row (same order); ``params``: the fields of
    :class:`~.algorithm.AFLiteParams` and the keywords of :data:`RUN_OPTIONS`. Returns
    (kept_ds, removed_ds, result); removed rows carry ``aflite_score``, ``aflite_round`` and
    ``reason`` = "aflite", so nothing is lost."""
    import datasets
    emb = np.asarray(embeddings)
    if emb.ndim != 2 or len(emb) != len(ds):
        raise InvalidInputError(f"the dataset has {len(ds)} rows but the embeddings have "
                                f"{emb.shape[0] if emb.ndim else 0} rows (shape {emb.shape}); compute the "
                                f"embeddings of this dataset (debiased_nli.methods.embeddings.compute_embeddings)")
    if "label" not in ds.column_names:
        raise InvalidInputError(f"the dataset has no 'label' column (columns: {ds.column_names})", column="label")
    if num_labels is None and hasattr(ds.features.get("label"), "num_classes"):
        num_labels = ds.features["label"].num_classes
    run = {k: params.pop(k) for k in RUN_OPTIONS if k in params}
    res = aflite(emb, labels_of(ds), num_labels, AFLiteParams(**params), **run)
    kept = ds.select(res.kept_indices)
    order = np.argsort(res.removed_indices, kind="stable")  # removed rows in input order
    removed = ds.select(res.removed_indices[order])
    # explicit types: with no row removed the columns would otherwise be typed "null"
    removed = removed.add_column("aflite_score", res.removed_scores[order].astype(np.float64).tolist(),
                                 feature=datasets.Value("float64"))
    removed = removed.add_column("aflite_round", res.removed_round[order].astype(np.int64).tolist(),
                                 feature=datasets.Value("int64"))
    removed = removed.add_column("reason", [AFLITE_REASON] * len(removed), feature=datasets.Value("string"))
    return kept, removed, res


def _audit_summary(ds, task, top_k: int, seed: int, progress: bool) -> dict:
    from ...bias.audit import audit_dataset
    rep = audit_dataset(ds, task, top_k=top_k, seed=seed, progress=progress)
    keep = ("n_rows", "labels", "hypothesis_only_accuracy", "max_abs_z", "z_threshold", "features_above_threshold",
            "features")
    return {k: rep[k] for k in keep if k in rep}


def aflite_step(ds, task: TaskSpec, params: Mapping[str, Any] | None = None, ctx: Mapping[str, Any] | None = None):
    """The AFLite recipe step, the paper's protocol: warm-up fine-tuning on a share of the rows ->
    first-token embeddings of the other rows with the fine-tuned encoder -> Algorithm 1 with t = the
    warm-up size and n = |D|/3 -> audit.

    Returns (kept_ds, removed_ds, report). ``removed_ds`` holds the warm-up rows (``reason`` =
    "warm-up", no score: the paper does "not reuse this data") and the filtered rows (``reason`` =
    "aflite", with ``aflite_score`` and ``aflite_round``). The report has the parameters with their
    source (``protocol``), the sizes per round, and (``audit``) the bias audit of the input, of the
    kept rows and of a random subset of the same size (the paper's control). ``warmup_share: 0``
    skips the warm-up (then the encoder is used as it is and t defaults to a tenth of the rows).
    ``ctx``: what a recipe build gives the step (it needs nothing from it; see ``release.step_registry``).
    """
    import datasets

    from ..embeddings import WarmUpParams, compute_embeddings, default_encoder, warm_up_encoder

    p = PARAMS.merge(params)
    given = {k for k, v in (params or {}).items() if v is not None}
    encoder = p["encoder"] or default_encoder()
    n_input = len(ds)
    report: dict[str, Any] = {"method": "aflite", "encoder": encoder, "n_input": n_input, "pooling": p["pooling"],
                              "max_length": p["max_length"]}
    target_n = p["target_n"] if p["target_n"] is not None else paper_target_size(n_input)
    work, warm_rows, train_size = ds, None, p["train_size"]
    if p["warmup_share"]:
        warm_up = WarmUpParams(share=p["warmup_share"], seed=p["seed"], epochs=p["warmup_epochs"], lr=p["warmup_lr"],
                               eps=p["warmup_eps"], batch_size=p["warmup_batch_size"], max_length=p["max_length"])
        wu = warm_up_encoder(ds, encoder, num_labels=task.num_labels, params=warm_up, progress=p["progress"],
                             device=p["device"])
        warm_rows = ds.select(wu.indices)
        work = ds.select(wu.rest(len(ds)))
        encoder = wu.model_dir
        if train_size is None:
            train_size = len(wu.indices)  # t = the warm-up size (§2)
        report["warm_up"] = {"rows": int(len(wu.indices)), "model_dir": wu.model_dir, "train_loss": wu.train_loss,
                             **wu.params}
    emb = compute_embeddings(work, encoder, batch_size=p["batch_size"], max_length=p["max_length"],
                             pooling=p["pooling"], progress=p["progress"], device=p["device"])
    report["embedding_dim"] = int(emb.shape[1])
    report["embedded_with"] = encoder
    if target_n >= len(work):
        raise ConfigError(f"the target size n = {target_n:,} is not below the {len(work):,} rows left after the "
                          f"warm-up; lower target_n or warmup_share")
    algo = {k: p[k] for k in ("m", "k", "tau", "selection", "C", "max_iter", "tol", "seed", "max_rounds", "device")}
    kept, removed, res = aflite_filter(work, emb, num_labels=task.num_labels, progress=p["progress"],
                                       train_size=train_size, target_n=target_n, **algo)
    if warm_rows is not None and len(warm_rows):
        n = len(warm_rows)
        # no score: these rows were never filtered (null, not NaN)
        warm = warm_rows.add_column("aflite_score", [None] * n, feature=datasets.Value("float64"))
        warm = warm.add_column("aflite_round", [-1] * n, feature=datasets.Value("int64"))
        warm = warm.add_column("reason", [WARMUP_REASON] * n, feature=datasets.Value("string"))
        removed = datasets.concatenate_datasets([warm.cast(removed.features), removed])
    report.update(res.to_dict())
    report["n_input"] = n_input
    report["n_removed"] = len(removed)
    report["removed_by_reason"] = {WARMUP_REASON: 0 if warm_rows is None else len(warm_rows),
                                   AFLITE_REASON: int(len(res.removed_indices))}
    report["protocol"] = _protocol(report, p, given)
    if p["audit"] and len(kept):
        report["audit"] = {"before": _audit_summary(ds, task, p["top_k"], p["seed"], p["progress"]),
                           "after": _audit_summary(kept, task, p["top_k"], p["seed"], p["progress"])}
        if p["random_control"]:
            rng = np.random.default_rng(p["seed"] + 1)
            ctrl = ds.select(np.sort(rng.choice(len(ds), size=len(kept), replace=False)))
            report["audit"]["random_same_size"] = _audit_summary(ctrl, task, p["top_k"], p["seed"], p["progress"])
    return kept, removed, report


def _protocol(report: Mapping[str, Any], p: Mapping[str, Any], given: set) -> dict:
    """Every value the run used, with where it comes from (the paper, the project, or the user)."""
    used = dict(report["params"])
    used.update({"encoder": report["encoder"], "pooling": p["pooling"]})
    if "warm_up" in report:
        w = report["warm_up"]
        used.update({"warmup_share": w["share"], "warmup_epochs": w["epochs"], "warmup_lr": w["lr"],
                     "warmup_eps": w["eps"], "warmup_batch_size": w["batch_size"]})
    else:
        used["warmup_share"] = 0
    out = {}
    for key in ("encoder", "warmup_share", "warmup_epochs", "warmup_lr", "warmup_eps", "warmup_batch_size", "pooling",
                "train_size", "target_n", "m", "k", "tau", "C", "tol"):
        if key not in used:
            continue
        if key in given:
            src = "set for this run"
        elif key == "train_size" and "warm_up" not in report:
            src = "project's choice (no warm-up: a tenth of the rows)"
        else:
            src = PARAMS[key].origin()
        out[key] = {"value": used[key], "source": src}
    return out
