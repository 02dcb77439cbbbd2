"""IBADR as recipe steps, and its card section.

* ``ibadr`` (filter step, config ``ibadr``): D0 -> the final pool S (D0 plus every kept pseudo
  sample); the "removed" rows are the parsed samples that were not added, with their reason.
* ``ibadr_rows`` (source step): the pseudo samples of S alone, as new rows D_G, so they can be
  composed with D0 through z-filtering (``z_aug`` = Z(D_G | D0), ``seq_z`` = Z(D_G | Z(D0)), ...).

Both take the same parameters (the fields of :class:`.loop.IbadrConfig`, plus ``out``: the run
folder, required). A recipe that uses both with the same ``out`` runs IBADR once: the second step
reads the finished iterations.
"""
from __future__ import annotations

from typing import Any, Mapping

from ...data.tasks import TaskSpec
from ...utils.errors import ConfigError
from . import loop
from .loop import IbadrConfig
from .params import PARAMS, SHALLOW_ROWS, STEP_ONLY

def config_from_params(task: TaskSpec, params: Mapping[str, Any]) -> IbadrConfig:
    """An :class:`IbadrConfig` from recipe/CLI parameters, checked against their declaration
    (:data:`.params.PARAMS`); the paper's values where none is given (``shallow_rows``: the paper's for the task).
    ``lora: true`` means the default LoRA options (r 8, alpha 16, dropout 0.05, all linear layers)."""
    merged = PARAMS.merge(params)
    kw = {k: v for k, v in merged.items() if k not in STEP_ONLY}
    if kw.get("lora") is True:
        kw["lora"] = {}
    elif kw.get("lora") is False:
        kw["lora"] = None
    if params.get("shallow_rows") is None:
        kw["shallow_rows"] = SHALLOW_ROWS.get(task.name, PARAMS["shallow_rows"].default)
    return IbadrConfig(**kw)


def _run(ds, task: TaskSpec, params: Mapping[str, Any]):
    if not params.get("out"):
        raise ConfigError("the IBADR step needs `out`: the folder of its iterations (resumable)")
    cfg = config_from_params(task, params)
    cols = ["premise", "hypothesis", "label", "uid", "origin", "method"]
    # looked up at call time (loop.run_ibadr), not bound at import: a stand-in for the loop reaches the step
    res = loop.run_ibadr(ds.select_columns(cols), task, cfg, params["out"], gen_chunk_steps=params.get("gen_chunk_steps"),
                    progress=params.get("progress", True))
    if not res.complete:
        raise ConfigError(f"IBADR in {params['out']} stopped before its last iteration; run it again to resume")
    return res


def ibadr_step(ds, task: TaskSpec, params: Mapping[str, Any], ctx: Mapping[str, Any] | None = None):
    """Filter step: (S, rejected samples, report). S carries the task's features (recomputed on S,
    so the release's z-statistics describe it); the report has the audit of D0 and of S. ``ctx``: what a
    recipe build gives the step (it needs nothing from it)."""
    from ...bias.audit import audit_dataset
    from ...bias.task_features import add_features

    res = _run(ds, task, params)
    pool, _ = add_features(res.pool, task, seed=params.get("seed", 0), progress=params.get("progress", True))
    report = dict(res.report)
    audits = {}
    for name, data in (("before", ds), ("after", pool)):
        ready = any(c.startswith("feat_") for c in data.column_names)
        a = audit_dataset(data, task, features_ready=ready, seed=params.get("seed", 0), progress=False)
        audits[name] = {k: a[k] for k in ("n_rows", "labels", "max_abs_z", "hypothesis_only_accuracy", "z_threshold",
                                          "features_above_threshold")} | {"top": a["features"][:3 * task.num_labels]}
    report["audit"] = audits
    removed = res.rejected
    if removed is not None:
        keep = [c for c in ("premise", "hypothesis", "label", "uid", "origin", "method", "reason", "stage")
                if c in removed.column_names]
        removed = removed.select_columns(keep)
    return pool, removed, report


def ibadr_rows(task: TaskSpec, params: Mapping[str, Any], ctx: Mapping[str, Any] | None = None):
    """Source step: (the pseudo samples IBADR added to the pool (canonical columns), None, IBADR's report).
    ``ctx["recipe"]`` gives D0 (its ``data``), unless ``params["data_files"]`` does."""
    from ...data.loading import load_task

    ctx = ctx if ctx is not None else {}
    data = (ctx.get("recipe") or {}).get("data", {})
    d0 = load_task(task, data.get("split", "train"), data_files=params.get("data_files") or data.get("data_files"),
                   on_invalid=data.get("on_invalid", "error"), max_rows=data.get("max_rows")).dataset
    res = _run(d0, task, params)
    added = range(len(d0), len(res.pool))  # S = D0 then the kept pseudo samples (none: an empty selection)
    return res.pool.select(added if len(added) else []), None, res.report


def render_ibadr_md(report: Mapping[str, Any], title: str | None = None) -> str:
    """The card section: settings, one row per iteration, and the audit of D0 and S."""
    c = report["config"]
    lines = [f"# {title or 'IBADR (Wang et al. 2023)'}", ""]
    lines.append(f"- D0: {report['d0_rows']:,} rows; S: {report['pool_rows']:,} rows "
                 f"({report['generated_rows']:,} pseudo samples over {report['iterations_complete']} iteration(s))")
    lines.append(f"- generator `{c['generator']}`" + (f" + LoRA {c['lora']}" if c.get("lora") is not None else "")
                 + f", lr {c['gen_lr']}, {c['gen_epochs_first']} epoch(s) in the first iteration, "
                 f"{c['gen_epochs_later']} after" + (f", trained on {c['gen_rows']:,} indicator-stratified rows of S"
                                                    if c.get("gen_rows") else ""))
    lines.append(f"- shallow model `{c['shallow_model']}` on {c['shallow_rows']:,} rows, {c['shallow_epochs']} epochs, "
                 f"lr {c['shallow_lr']}; USM: {'on, ' + format(c['usm_rows'], ',') + ' rows' if c['update_shallow'] else 'off'}")
    lines.append(f"- N_bi = {c['n_bi']}, indicator {c['indicator']}, {report['samples_per_iteration']:,} samples per "
                 f"iteration (top-p {c['top_p']}), confidence filter `{c['confidence_model']}` with epsilon = {c['epsilon']}")
    lines += ["", "| iteration | pool before | samples | parsed | kept | acceptance | distinct-2 | labels kept |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report["iterations"]:
        s, f = r["samples"], r["filter"]
        labels = ", ".join(f"{k} {v['kept']}" for k, v in (f.get("per_label") or {}).items())
        lines.append(f"| {r['iteration']} | {r['pool_before']:,} | {s['samples']:,} | {s['parsed']:,} | {r['kept']:,} | "
                     f"{f.get('acceptance_rate', '')} | {s.get('distinct_2_hypothesis')} | {labels} |")
    audit = report.get("audit")
    if audit:
        lines += ["", "| audit | D0 | S |", "|---|---|---|"]
        for key, name in (("n_rows", "rows"), ("hypothesis_only_accuracy", "hypothesis-only accuracy (out-of-fold)"),
                          ("max_abs_z", "largest |z|")):
            lines.append(f"| {name} | {audit['before'][key]} | {audit['after'][key]} |")
    return "\n".join(lines) + "\n"
