"""Run PDD end to end on a canonical dataset: features, the family schedule, Algorithm 1, the report."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ...bias.zstats import group_labels
from ...data.loading import labels_of
from ...data.tasks import TaskSpec
from ...utils.errors import ConfigError
from .algorithm import (
    CACHE_FILE,
    META_FILE,
    Algorithm1,
    PairFeaturizer,
    PDDConfig,
    PDDState,
    Perturber,
    ResultCache,
    default_overlap_extractor,
)
from .fill import prompt_words_for
from .hypothesis_folds import HypothesisOnlyFolds
from .masking import FAMILIES, HYPO_ONLY, PAPER_RATIOS


@dataclasses.dataclass
class PDDOutput:
    state: PDDState
    log: list[dict]
    report: dict
    input_hypo_pred: np.ndarray | None
    hyponly: Any


def resolve_families(families: "str | Sequence[str]") -> list[str] | None:
    """``"auto"`` -> None (all three, ordered by z); ``"hypo_only,overlap"`` or a list -> that order."""
    if families == "auto" or families is None:
        return None
    names = [f.strip() for f in (families.split(",") if isinstance(families, str) else families) if f.strip()]
    bad = [f for f in names if f not in FAMILIES]
    if bad or not names:
        raise ConfigError(f"unknown PDD feature famil{'ies' if len(bad) > 1 else 'y'} {bad}; known: {list(FAMILIES)}")
    return names


def _summary(state: PDDState, families: Sequence[str], overlap_feature: str, K: int, p0: float, tau: float) -> dict:
    out = {}
    for fam in families:
        zs = state.family_z(fam, overlap_feature, K, p0)
        above = {x: float(np.max(np.abs(z))) for x, (c, z) in zs.items() if np.max(np.abs(z)) > tau}
        out[fam] = {"features": len(zs), "above_tau": len(above),
                    "max_abs_z": round(max((float(np.max(np.abs(z))) for _, z in zs.values()), default=0.0), 4)}
    return out


@dataclasses.dataclass(frozen=True)
class Perturbation:
    """What PDD's features and prompts are made with, besides :class:`~.algorithm.PDDConfig`: the share of a
    row's words each family masks (``ratios``, over the paper's :data:`~.masking.PAPER_RATIOS`), the word that
    names each label in a prompt (``prompt_words``, over :func:`~.fill.prompt_words_for`'s defaults), the
    extractor of the overlap feature (default: the task's, :func:`~.algorithm.default_overlap_extractor`) and
    the folds of the out-of-fold hypothesis-only model."""

    ratios: Mapping[str, float] | None = None
    prompt_words: Mapping[str, str] | None = None
    overlap_extractor: str | None = None
    hypo_only_folds: int = 5


def run_pdd(ds, task: TaskSpec, *, filler, teacher, config: PDDConfig | None = None,
            perturbation: Perturbation | None = None, work_dir: "str | Path | None" = None,
            fingerprint: Mapping[str, Any] | None = None, progress: bool = True) -> PDDOutput:
    """PDD over ``ds`` (canonical rows with ``uid``). ``filler`` fills :class:`~.fill.FillRequest` s (a
    :class:`~.fill.MaskFiller` or a stand-in), ``teacher`` gives ``label_probs(premises, hypotheses)``;
    ``perturbation``: the masking ratios, prompt words, overlap extractor and hypothesis-only folds
    (:class:`Perturbation`; default: the paper's).
    With ``work_dir`` the perturbations are checkpointed there and a rerun continues (see algorithm.py)."""
    cfg = config or PDDConfig()
    pert = perturbation or Perturbation()
    _check_input(ds, cfg)
    t_start = time.perf_counter()
    group_of, group_names = group_labels(task.labels, cfg.label_groups)
    K = len(group_names)
    p0 = 1.0 / K
    fixed = resolve_families(cfg.families)
    families = fixed or list(FAMILIES)
    ratios = {**PAPER_RATIOS, **(pert.ratios or {})}
    words = prompt_words_for(task.labels, pert.prompt_words)
    ov_extractor = pert.overlap_extractor or default_overlap_extractor(cfg.overlap_feature, task.features)

    t0 = time.perf_counter()
    state, featurizer, hyponly, hypo_pred = _initial_state(ds, task, cfg, families, ov_extractor, group_of,
                                                           pert.hypo_only_folds)
    seconds_features = time.perf_counter() - t0

    perturber = Perturber(task.labels, featurizer, filler, teacher, words, ratios)
    params = {**cfg.to_dict(), "families": families if fixed else "auto", "ratios": ratios, "prompt_words": words,
              "overlap_extractor": ov_extractor, "hypo_only_folds": pert.hypo_only_folds,
              "group_names": list(group_names)}
    cache = ResultCache(None)
    if work_dir is not None:
        cache = _open_work_dir(Path(work_dir), params, filler, teacher, fingerprint, len(ds), cfg)
    algo = Algorithm1(state, perturber, cfg, task.labels, K, cache, group_names=group_names)

    before = {fam: state.family_z(fam, cfg.overlap_feature, K, p0) for fam in families}
    fam_max = {fam: max((float(np.max(np.abs(z))) for _, z in before[fam].values()), default=0.0) for fam in families}
    if cfg.order not in ("z", "given"):
        raise ConfigError(f"order must be 'z' or 'given', got {cfg.order!r}")
    # section 4.1: "The order is determined by ranking the z-value from highest to lowest"
    order = families if cfg.order == "given" else sorted(families, key=lambda f: (-fam_max[f], f))
    summary_before = _summary(state, families, cfg.overlap_feature, K, p0, cfg.tau)
    records = _sweeps(state, algo, cache, cfg, order, families, K, p0, progress=progress)
    seconds = time.perf_counter() - t_start

    after = {fam: state.family_z(fam, cfg.overlap_feature, K, p0) for fam in families}
    report = _report(task, _Walked(
        state=state, algo=algo, records=records, params=params, before=before, after=after, order=order,
        fam_max=fam_max, summary_before=summary_before,
        summary_after=_summary(state, families, cfg.overlap_feature, K, p0, cfg.tau), group_names=group_names,
        cfg=cfg, seconds=seconds, seconds_features=seconds_features, perturber=perturber, filler=filler,
        teacher=teacher, hyponly=hyponly, cache=cache))
    if work_dir is not None:
        report["work_dir"] = str(Path(work_dir).resolve())
    return PDDOutput(state, algo.log, report, hypo_pred, hyponly)


def _check_input(ds, cfg: PDDConfig) -> None:
    if cfg.tau < 0:
        raise ConfigError(f"tau must be >= 0, got {cfg.tau}")
    if cfg.max_passes < 1 or cfg.batch_size < 1 or cfg.max_sweeps < 1:
        raise ConfigError("max_passes, batch_size and max_sweeps must be >= 1")
    for col in ("premise", "hypothesis", "label", "uid"):
        if col not in ds.column_names:
            raise ConfigError(f"PDD needs the column {col!r}; the data has {ds.column_names}")
    if not len(ds):
        raise ConfigError("PDD got no rows")


def _initial_state(ds, task: TaskSpec, cfg: PDDConfig, families: Sequence[str], ov_extractor: str, group_of,
                   hypo_only_folds: int):
    """The features of every input row and the state Algorithm 1 starts from: (state, featurizer, the
    out-of-fold hypothesis-only model or None, its predictions or None)."""
    cols = ds.select_columns(["premise", "hypothesis", "uid"]).to_dict()
    labels = labels_of(ds)
    hyponly, hypo_pred = None, None
    if HYPO_ONLY in families or "hypo_only_pred" in ds.column_names:  # new rows then need its prediction too
        hyponly = HypothesisOnlyFolds(task.labels, folds=hypo_only_folds, seed=cfg.seed)
        hypo_pred = hyponly.fit(cols["premise"], cols["hypothesis"], labels)
    featurizer = PairFeaturizer(task.labels, families, cfg.overlap_feature, ov_extractor, hyponly)
    feats = featurizer.features(cols["premise"], cols["hypothesis"], hypo_pred=hypo_pred)
    folds = hyponly.fold_of if hyponly is not None else np.zeros(len(ds), dtype=np.int64)
    state = PDDState(cols["premise"], cols["hypothesis"], labels, cols["uid"], folds, feats, group_of)
    return state, featurizer, hyponly, hypo_pred


def _open_work_dir(work: Path, params: dict, filler, teacher, fingerprint: Mapping[str, Any] | None, n_input: int,
                   cfg: PDDConfig) -> ResultCache:
    """The checkpoint cache in ``work``, after checking that the run there (``META_FILE``) has the same settings
    and inputs (or recording them for a new run)."""
    work.mkdir(parents=True, exist_ok=True)
    meta = {"params": params, "models": {"filler": _describe(filler), "teacher": _describe(teacher)},
            "input": dict(fingerprint or {}), "n_input": n_input}
    meta_path = work / META_FILE
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != json.loads(json.dumps(meta, sort_keys=True, default=str)):
            raise ConfigError(f"{work} holds a PDD run with other settings or inputs ({meta_path}); use another "
                              f"work dir, or delete that one to start over")
    else:
        meta_path.write_text(json.dumps(meta, sort_keys=True, indent=2, default=str))
    return ResultCache(work / CACHE_FILE, cfg.checkpoint_every)


def _sweeps(state: PDDState, algo: Algorithm1, cache: ResultCache, cfg: PDDConfig, order: Sequence[str],
            families: Sequence[str], K: int, p0: float, *, progress: bool) -> list:
    """Up to ``cfg.max_sweeps`` sweeps over the families in ``order``, each reducing every feature whose
    |z| > tau (largest first); stops when a sweep targets nothing or no feature is above tau. Returns the
    record of every feature reduced."""
    from tqdm.auto import tqdm
    records = []
    bar = tqdm(desc="PDD perturbations", unit="op", disable=not progress)
    algo._bar = bar
    try:
        for sweep in range(cfg.max_sweeps):
            targeted = 0
            for fam in order:
                zs = state.family_z(fam, cfg.overlap_feature, K, p0)
                x_b = sorted((x for x, (c, z) in zs.items() if np.max(np.abs(z)) > cfg.tau),
                             key=lambda x: (-float(np.max(np.abs(zs[x][1]))), x))
                targeted += len(x_b)
                for x in x_b:
                    bar.set_postfix_str(f"{fam}: {x}"[:40])
                    records.append(algo.reduce_feature(x, fam, sweep))
            if not targeted:
                break
            if not any(s["above_tau"] for s in _summary(state, families, cfg.overlap_feature, K, p0, cfg.tau).values()):
                break
    finally:
        bar.close()
        cache.flush()
    return records


def _describe(obj) -> Any:
    d = getattr(obj, "describe", None)
    return d() if callable(d) else type(obj).__name__


@dataclasses.dataclass
class _Walked:
    """What one PDD walk leaves for its report: the state and the algorithm after it, the features' z before and
    after, the order of the families, the timings and the pieces that did the work."""

    state: Any
    algo: Any
    records: list
    params: dict
    before: dict
    after: dict
    order: list
    fam_max: dict
    summary_before: dict
    summary_after: dict
    group_names: Any
    cfg: PDDConfig
    seconds: float
    seconds_features: float
    perturber: Any
    filler: Any
    teacher: Any
    hyponly: Any
    cache: Any


def _operations(w: _Walked) -> tuple[dict, dict]:
    """The report's ``operations`` and ``candidates``: what was attempted, what succeeded and why not."""
    log, algo = w.algo.log, w.algo
    keep = sum(1 for e in log if e["status"] == "ok" and e["case"] == "keep")
    lose = sum(1 for e in log if e["status"] == "ok" and e["case"] == "lose")
    reasons: dict[str, int] = {}
    for e in log:
        if e["status"] != "ok":
            reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
    rejected: dict[str, int] = {}
    n_cands = 0
    for e in log:
        for c in e["candidates"]:
            n_cands += 1
            if c["rejected_by"]:
                rejected[c["rejected_by"]] = rejected.get(c["rejected_by"], 0) + 1
    chosen_conf = [e["candidates"][e["chosen"]]["confidence"] for e in log if e["status"] == "ok"]
    agree = [e["candidates"][e["chosen"]].get("teacher_pred") == e["label"] for e in log
             if e["status"] == "ok" and "teacher_pred" in e["candidates"][e["chosen"]]]
    n_ops = len(log)
    operations = {"attempted": n_ops, "succeeded": keep + lose, "keep": keep, "lose": lose,
                  "failed": sum(reasons.values()), "failures": dict(sorted(reasons.items())),
                  "acceptance": round((keep + lose) / n_ops, 4) if n_ops else None,
                  "computed": algo.computed, "from_checkpoint": w.cache.loaded, "discarded_ahead": algo.discarded,
                  # prepared ahead (masking, fill, containment) and dropped without a teacher pass
                  "prepared_never_scored": algo.never_scored}
    candidates = {"total": n_cands, "rejected": dict(sorted(rejected.items())),
                  "chosen_confidence_mean": round(float(np.mean(chosen_conf)), 4) if chosen_conf else None,
                  "chosen_teacher_agrees": round(float(np.mean(agree)), 4) if agree else None}
    return operations, candidates


def _feature_rows(w: _Walked) -> list[dict]:
    """Every feature above tau before or after the walk, with its z before and after."""
    rows = []
    for fam in w.order:
        for x in sorted(set(w.before[fam]) | set(w.after[fam])):
            zb = w.before[fam].get(x)
            za = w.after[fam].get(x)
            mb = float(np.max(np.abs(zb[1]))) if zb else 0.0
            ma = float(np.max(np.abs(za[1]))) if za else 0.0
            if mb > w.cfg.tau or ma > w.cfg.tau:
                rows.append({"feature": x, "family": fam, "n_before": int(zb[0].sum()) if zb else 0,
                             "max_abs_z_before": round(mb, 3), "z_before": np.round(zb[1], 3).tolist() if zb else None,
                             "n_after": int(za[0].sum()) if za else 0, "max_abs_z_after": round(ma, 3),
                             "z_after": np.round(za[1], 3).tolist() if za else None})
    return rows


def _report(task, w: _Walked) -> dict:
    state, algo, group_names = w.state, w.algo, w.group_names
    operations, candidates = _operations(w)
    keep, lose = operations["keep"], operations["lose"]
    labels_in = np.bincount(np.asarray(state.label[:state.n_input]), minlength=task.num_labels)
    alive_labels = [l for l, a in zip(state.label, state.alive) if a]
    labels_out = np.bincount(np.asarray(alive_labels, dtype=np.int64), minlength=task.num_labels)
    statuses: dict[str, int] = {}
    for r in w.records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "method": "pdd", "task": task.name, "params": w.params,
        "models": {"filler": _describe(w.filler), "teacher": _describe(w.teacher),
                   "hypothesis_only": w.hyponly.describe() if w.hyponly is not None else None},
        "label_groups": list(group_names), "p0": 1.0 / len(group_names),
        "family_order": [{"family": f, "max_abs_z_before": round(w.fam_max[f], 3)} for f in w.order],
        "rows": {"input": state.n_input, "output": sum(state.alive), "added": keep, "replaced": lose, "removed": lose,
                 "perturbed_rows_in_output": sum(1 for i in range(state.n_input, len(state)) if state.alive[i]),
                 "labels_input": dict(zip(task.labels, labels_in.tolist())),
                 "labels_output": dict(zip(task.labels, labels_out.tolist()))},
        "operations": operations,
        "candidates": candidates,
        "features": [r.to_dict() for r in w.records],
        "feature_status": statuses,
        "z": {"before": w.summary_before, "after": w.summary_after, "features": _feature_rows(w)},
        "seconds": {"total": round(w.seconds, 2), "features": round(w.seconds_features, 2),
                    **{k: round(v, 2) for k, v in w.perturber.seconds.items()}},
        "scoring": {"texts_scored": w.perturber.scored, "duplicate_texts_scored_once": w.perturber.deduplicated,
                    "engine": getattr(w.teacher, "engine", None), "fill_engine": getattr(w.filler, "engine", None),
                    "dtype": getattr(w.teacher, "dtype", None), "fill_dtype": getattr(w.filler, "dtype", None)},
        # perturbations computed by this invocation per second (those read from a checkpoint cost nothing)
        "operations_per_second": round(algo.computed / w.seconds, 3) if w.seconds > 0 else None,
    }
