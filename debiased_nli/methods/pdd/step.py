"""The ``pdd`` recipe step, its outputs (datasets, the operation log, report, markdown, plot).

``pdd_step(ds, task, params, ctx)`` -> (D, removed, report): D holds the input rows PDD kept and the
rows it made (``origin="perturbed"``, ``method="pdd:<feature>:<keep|lose>"``, ``source_uid``,
``teacher_confidence``), in that order; ``removed`` the rows it replaced (``reason="pdd: replaced"``,
``replaced_by`` = the uid of the row that replaced it), input rows or rows it made earlier. Every
operation (masked prompt, candidates with their teacher confidence or rejection reason, the choice)
is written to ``<work_dir>/perturbations.parquet``. |D| = |input| + keep operations; |removed| = lose
operations.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ...bias.features import FEATURE_PREFIX, HYPO_ONLY_COLUMN, add_feature_columns
from ...data.tasks import TaskSpec
from ...utils.errors import ConfigError
from .algorithm import HYPO_PREFIX, PDDConfig
from .params import PARAMS

REPLACED_REASON = "pdd: replaced"
NEW_COLUMNS = ("source_uid", "teacher_confidence")
def _fingerprint(ds) -> str:
    """A hash of the rows PDD reads (uid, premise, hypothesis, label), whatever other columns ``ds`` has, so the
    CLI and a recipe build over the same rows share a checkpoint (however Arrow holds them)."""
    from ...data.loading import content_fingerprint

    return content_fingerprint(ds.select_columns(["uid", "premise", "hypothesis", "label"]))


def pdd_step(ds, task: TaskSpec, params: Mapping[str, Any] | None = None, ctx: Mapping[str, Any] | None = None):
    """The PDD recipe step (see the module docstring). ``ctx`` is given by a recipe build (PDD needs nothing
    from it: it declares no ``needs``); with it and no ``work_dir``, the run is checkpointed in the cache."""
    from .fill import MaskFiller
    from .run import Perturbation, run_pdd
    from .teacher import Teacher

    p = PARAMS.merge(params)
    teacher = Teacher(p["teacher"], task.labels, batch_size=p["teacher_batch_size"], max_length=p["teacher_max_length"],
                      engine=p["engine"], dtype=p["dtype"]) if isinstance(p["teacher"], str) else p["teacher"]
    filler = p["filler"] or MaskFiller.from_pretrained(p["mlm"], candidates=p["candidates"],
                                                       batch_size=p["mlm_batch_size"], max_length=p["mlm_max_length"],
                                                       engine=p["engine"], dtype=p["dtype"])
    cfg = PDDConfig(tau=float(p["tau"]), families=p["families"], order=p["order"], overlap_feature=p["overlap_feature"],
                    label_groups=p["label_groups"], max_passes=int(p["max_passes"]), max_sweeps=int(p["max_sweeps"]),
                    batch_size=int(p["batch_size"]), seed=int(p["seed"]), checkpoint_every=int(p["checkpoint_every"]))
    fingerprint = {"input": _fingerprint(ds), "rows": len(ds), "mlm": p["mlm"] if p["filler"] is None else None,
                   "teacher": p["teacher"] if isinstance(p["teacher"], str) else None}
    work_dir = p["work_dir"]
    if work_dir is None and ctx is not None:
        from ...utils.cache import default_cache_dir
        key = hashlib.sha256(json.dumps([fingerprint, cfg.to_dict(), p["ratios"], p["prompt_words"],
                                         p["overlap_extractor"], p["hypo_only_folds"], p["candidates"]],
                                        sort_keys=True, default=str).encode()).hexdigest()[:16]
        work_dir = default_cache_dir() / "pdd" / key
    perturbation = Perturbation(ratios=p["ratios"], prompt_words=p["prompt_words"],
                                overlap_extractor=p["overlap_extractor"], hypo_only_folds=int(p["hypo_only_folds"]))
    out = run_pdd(ds, task, filler=filler, teacher=teacher, config=cfg, perturbation=perturbation, work_dir=work_dir,
                  fingerprint=fingerprint, progress=p["progress"])
    kept, removed = build_outputs(ds, task, out)
    report = out.report
    report["examples"] = examples_from_log(out.log, int(p["examples"]), int(p["seed"]))
    if HYPO_ONLY_COLUMN in ds.column_names and out.input_hypo_pred is not None:
        from ...data.loading import column_numpy
        given = column_numpy(ds, HYPO_ONLY_COLUMN).astype(np.int64)
        report["hypo_only_agreement_with_input_column"] = round(float((given == out.input_hypo_pred).mean()), 6)
    if work_dir is not None:
        path = Path(work_dir) / "perturbations.parquet"
        log_dataset(out.log).to_parquet(str(path))
        report["log_path"] = str(path.resolve())
    return kept, removed, report


# ------------------------------------------------------------------------------------------------
# outputs

def _new_rows(task, state, rows, extra_reason: bool = False):
    import datasets

    from ...data.loading import canonical_features

    feats = canonical_features(task)
    feats["source_uid"] = datasets.Value("string")
    feats["teacher_confidence"] = datasets.Value("float64")
    data = {"premise": [state.premise[i] for i in rows], "hypothesis": [state.hypothesis[i] for i in rows],
            "label": [state.label[i] for i in rows], "uid": [state.uid[i] for i in rows],
            "origin": ["perturbed"] * len(rows), "method": [state.method[i] for i in rows],
            "source_uid": [state.source[i] for i in rows], "teacher_confidence": [state.confidence[i] for i in rows]}
    if extra_reason:
        feats["reason"] = datasets.Value("string")
        feats["replaced_by"] = datasets.Value("string")
        data["reason"] = [REPLACED_REASON] * len(rows)
        data["replaced_by"] = [state.replaced_by[i] for i in rows]
    return datasets.Dataset.from_dict(data, features=datasets.Features(feats))


def _with_input_columns(new, like, task, out, rows):
    """New rows with the feature columns of the input (same extractors, hypo-only prediction by fold)."""
    import datasets

    feat_cols = [c for c in like.column_names if c.startswith(FEATURE_PREFIX)]
    lexical = [c[len(FEATURE_PREFIX):] for c in feat_cols if c != FEATURE_PREFIX + "hypo_only_v1"]
    if lexical:
        new = add_feature_columns(new, lexical, task.labels, desc="features of the perturbed rows")
    if HYPO_ONLY_COLUMN in like.column_names:
        pred = _hypo_pred(task, out, rows)
        new = new.add_column(HYPO_ONLY_COLUMN, pred.tolist())
        if FEATURE_PREFIX + "hypo_only_v1" in feat_cols:
            new = add_feature_columns(new, ["hypo_only_v1"], task.labels, desc="hypothesis-only feature")
    for col in like.column_names:
        if col not in new.column_names:
            new = new.add_column(col, [None] * len(new))
    new = new.select_columns(list(like.column_names) + [c for c in new.column_names if c not in like.column_names])
    feats = datasets.Features({c: like.features[c] if c in like.features else new.features[c] for c in new.column_names})
    return new.cast(feats)


def _hypo_pred(task, out, rows) -> np.ndarray:
    state = out.state
    if not rows:
        return np.zeros(0, dtype=np.int64)
    names = {HYPO_PREFIX + n: i for i, n in enumerate(task.labels)}
    pred = []
    for i in rows:
        hit = [names[f] for f in state.features[i] if f in names]
        pred.append(hit[0] if hit else -1)
    pred = np.asarray(pred, dtype=np.int64)
    missing = np.nonzero(pred < 0)[0]
    if len(missing):
        if out.hyponly is None:
            raise ConfigError("the input carries hypo_only_pred but PDD fitted no hypothesis-only model")
        pred[missing] = out.hyponly.predict([state.premise[rows[j]] for j in missing],
                                            [state.hypothesis[rows[j]] for j in missing],
                                            [state.fold[rows[j]] for j in missing])
    return pred


def build_outputs(ds, task: TaskSpec, out):
    """(D, removed) as datasets (see the module docstring)."""
    import datasets

    state = out.state
    n = state.n_input
    alive = np.asarray(state.alive, dtype=bool)
    keep_in = np.nonzero(alive[:n])[0]
    gone_in = np.nonzero(~alive[:n])[0]
    new_alive = [int(i) for i in np.nonzero(alive[n:])[0] + n]
    new_gone = [int(i) for i in np.nonzero(~alive[n:])[0] + n]

    base = ds.select(keep_in)
    base = base.add_column("source_uid", [None] * len(base)).add_column("teacher_confidence", [None] * len(base))
    base = base.cast_column("source_uid", datasets.Value("string")).cast_column("teacher_confidence",
                                                                                datasets.Value("float64"))
    new = _with_input_columns(_new_rows(task, state, new_alive), base, task, out, new_alive)
    kept = datasets.concatenate_datasets([base, new]) if len(new) else base

    canon = ["premise", "hypothesis", "label", "uid", "origin", "method"]
    rem_in = ds.select(gone_in).select_columns([c for c in canon if c in ds.column_names])
    rem_in = rem_in.add_column("source_uid", [None] * len(rem_in)).add_column("teacher_confidence", [None] * len(rem_in))
    rem_in = rem_in.add_column("reason", [REPLACED_REASON] * len(rem_in))
    rem_in = rem_in.add_column("replaced_by", [state.replaced_by[int(i)] for i in gone_in])
    rem_new = _new_rows(task, state, new_gone, extra_reason=True)
    rem_in = rem_in.cast(rem_new.features)
    removed = datasets.concatenate_datasets([rem_in, rem_new]) if len(rem_new) else rem_in
    return kept, removed


def log_dataset(log):
    """The operation log as a dataset (candidates as a list of structs)."""
    import datasets

    cand = datasets.Features({"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
                              "confidence": datasets.Value("float64"), "teacher_pred": datasets.Value("string"),
                              "rejected_by": datasets.Value("string")})
    feats = datasets.Features({
        "op": datasets.Value("int64"), "sweep": datasets.Value("int64"), "family": datasets.Value("string"),
        "feature": datasets.Value("string"), "pass": datasets.Value("int64"), "case": datasets.Value("string"),
        "source_uid": datasets.Value("string"), "label": datasets.Value("string"),
        "z_before": datasets.Value("float64"), "z_after": datasets.Value("float64"),
        "masked_prompt": datasets.Value("string"), "candidates": [cand], "chosen": datasets.Value("int64"),
        "new_uid": datasets.Value("string"), "status": datasets.Value("string"), "reason": datasets.Value("string")})
    rows = {k: [] for k in feats}
    for e in log:
        for k in feats:
            if k == "candidates":
                rows[k].append([{c: cd.get(c) for c in cand} for cd in e["candidates"]])
            else:
                rows[k].append(e.get(k))
    return datasets.Dataset.from_dict(rows, features=feats)


def examples_from_log(log, n: int = 20, seed: int = 0) -> list[dict]:
    """``n`` operations spread over features: half succeeded (with a candidate that lost), half failed."""
    if n <= 0 or not log:
        return []
    rng = np.random.default_rng(seed)
    ok = [e for e in log if e["status"] == "ok"]
    bad = [e for e in log if e["status"] != "ok"]
    n_bad = min(len(bad), n // 2)
    picks = []
    for pool, k in ((ok, n - n_bad), (bad, n_bad)):
        if pool and k:
            idx = np.sort(rng.choice(len(pool), size=min(k, len(pool)), replace=False))
            picks.extend(pool[i] for i in idx)
    picks.sort(key=lambda e: e["op"])
    out = []
    for e in picks:
        chosen = e["candidates"][e["chosen"]] if e["chosen"] >= 0 else None
        others = [c for i, c in enumerate(e["candidates"]) if i != e["chosen"]]
        others.sort(key=lambda c: (c["confidence"] is None, -(c["confidence"] or 0)))
        out.append({"op": e["op"], "feature": e["feature"], "case": e["case"], "label": e["label"],
                    "source_uid": e["source_uid"], "masked_prompt": e["masked_prompt"], "status": e["status"],
                    "reason": e["reason"],
                    "chosen": {k: chosen.get(k) for k in ("premise", "hypothesis", "confidence")} if chosen else None,
                    "rejected": [{k: c.get(k) for k in ("premise", "hypothesis", "confidence", "rejected_by")}
                                 for c in others[:2]]})
    return out


OUTPUT_FILES = ("debiased.parquet", "removed.parquet", "perturbations.parquet", "pdd.json", "pdd.md", "pdd_z.png")


def write_pdd_outputs(kept, removed, report, log, out_dir, outputs=None) -> dict[str, Path]:
    """debiased.parquet, removed.parquet, perturbations.parquet, pdd.json, pdd.md, pdd_z.png, each under a
    temporary name first and never over a file this tool did not write (``outputs``: the command's
    :class:`~debiased_nli.utils.outputs.OwnFiles`; the caller then closes it)."""
    from ...utils.outputs import OwnFiles

    out = Path(outputs.paths[0].parent if outputs is not None else out_dir)
    paths = dict(zip(("debiased", "removed", "log", "json", "md", "png"), (out / n for n in OUTPUT_FILES)))
    import contextlib

    own = outputs or OwnFiles(paths.values(), what=f"--out {out_dir}")
    with own if outputs is None else contextlib.nullcontext():  # the caller's OwnFiles: it renames them
        kept.to_parquet(str(own.temp(paths["debiased"])))
        removed.to_parquet(str(own.temp(paths["removed"])))
        log_dataset(log).to_parquet(str(own.temp(paths["log"])))
        own.write_text(paths["json"], json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
        own.write_text(paths["md"], render_pdd_md(report))
        plot_pdd(report, own.temp(paths["png"]))
    return paths


# ------------------------------------------------------------------------------------------------
# report

def render_pdd_md(report: Mapping[str, Any], title: str | None = None) -> str:
    """The card section: settings, rows, operations, z before/after per feature, examples."""
    p, rows, ops = report["params"], report["rows"], report["operations"]
    lines = [f"# {title or 'PDD (Guo et al. 2023)'}", ""]
    lines.append(f"- rows: input {rows['input']:,}, output {rows['output']:,} (+{rows['added']:,} added by keep "
                 f"operations; {rows['replaced']:,} replaced by lose operations, kept in the rejected rows with "
                 f"`replaced_by`)")
    lines.append(f"- threshold tau = {p['tau']}; label groups {report['label_groups']} (p0 = {report['p0']:.3f}); "
                 f"families in order: " + ", ".join(f"{f['family']} (max |z| {f['max_abs_z_before']:.1f})"
                                                      for f in report["family_order"]))
    lines.append(f"- masking ratios {p['ratios']}; prompt words {p['prompt_words']}; overlap feature "
                 f"`{p['overlap_feature']}` ({p['overlap_extractor']})")
    models = report["models"]
    lines.append(f"- fill model: `{json.dumps(models['filler'], default=str)}`; teacher: "
                 f"`{json.dumps(models['teacher'], default=str)}`")
    if models.get("hypothesis_only"):
        lines.append(f"- hypothesis-only model: `{json.dumps(models['hypothesis_only'], default=str)}`")
    lines.append(f"- operations: {ops['attempted']:,} attempted, {ops['succeeded']:,} succeeded (keep {ops['keep']:,}, "
                 f"lose {ops['lose']:,}), {ops['failed']:,} failed; acceptance {ops['acceptance']}")
    if ops["failures"]:
        lines.append("- failures: " + ", ".join(f"{k}: {v:,}" for k, v in ops["failures"].items()))
    cands = report["candidates"]
    lines.append(f"- candidates: {cands['total']:,}; rejected: "
                 + (", ".join(f"{k}: {v:,}" for k, v in cands["rejected"].items()) or "none")
                 + f"; mean teacher confidence of the chosen: {cands['chosen_confidence_mean']}; teacher's argmax = "
                   f"label for {cands['chosen_teacher_agrees']} of them")
    sec = report["seconds"]
    ops = report["operations"]
    lines.append(f"- time of this invocation: {sec['total']:.1f} s ({ops.get('computed', 0):,} perturbations computed, "
                 f"{report['operations_per_second']} per second; {ops.get('from_checkpoint', 0):,} read from the "
                 f"checkpoint); fill {sec['fill']:.1f} s, "
                 f"teacher {sec['teacher']:.1f} s, containment {sec['containment']:.1f} s")
    lines.append("- features: " + ", ".join(f"{k} {v}" for k, v in sorted(report["feature_status"].items())))
    lines += ["", "## z before and after, per family", "", "| family | features | above tau before | above tau after | "
              "max \\|z\\| before | max \\|z\\| after |", "|---|---|---|---|---|---|"]
    for fam in report["z"]["before"]:
        b, a = report["z"]["before"][fam], report["z"]["after"][fam]
        lines.append(f"| {fam} | {a['features']:,} | {b['above_tau']:,} | {a['above_tau']:,} | {b['max_abs_z']:.1f} | "
                     f"{a['max_abs_z']:.1f} |")
    recs = {(r["feature"]): r for r in report["features"]}
    feats = sorted(report["z"]["features"], key=lambda r: -r["max_abs_z_before"])
    lines += ["", f"## Features above tau before or after ({len(feats)}; the 40 largest before)", "",
              "| feature | n before | max \\|z\\| before | n after | max \\|z\\| after | keep | lose | failed | status |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in feats[:40]:
        rec = recs.get(r["feature"])
        lines.append(f"| `{r['feature']}` | {r['n_before']:,} | {r['max_abs_z_before']:.1f} | {r['n_after']:,} | "
                     f"{r['max_abs_z_after']:.1f} | {rec['keep_ops'] if rec else ''} | {rec['lose_ops'] if rec else ''} | "
                     f"{rec['failed_ops'] if rec else ''} | {rec['status'] if rec else 'not targeted'} |")
    unreachable = [r for r in report["features"] if r["status"] in ("unreachable", "max_passes")]
    if unreachable:
        lines += ["", "## Features that did not reach tau", ""]
        lines += [f"- `{r['feature']}`: {r['status']}: {r['reason']}" for r in unreachable[:30]]
    if report.get("examples"):
        lines += ["", "## Examples", ""]
        for e in report["examples"]:
            lines.append(f"- op {e['op']} `{e['feature']}` ({e['case']}, {e['label']}): {e['status']}"
                         + (f" ({e['reason']})" if e["reason"] else ""))
            lines.append(f"  - masked: {e['masked_prompt']}")
            if e["chosen"]:
                c = e["chosen"]
                lines.append(f"  - chosen ({c['confidence']:.3f}): P: {c['premise']} | H: {c['hypothesis']}")
            for c in e["rejected"]:
                why = c["rejected_by"] or (f"lower confidence {c['confidence']:.3f}" if c["confidence"] is not None else "")
                lines.append(f"  - not chosen ({why}): P: {c['premise']} | H: {c['hypothesis']}")
    lines += ["", "z*(l, x) = (p_hat(l|x) - p0) / sqrt(p0 (1 - p0) / n) over the label groups; a keep operation adds a "
                  "perturbed copy that still contains x (p_hat < p0), a lose operation replaces the row by one without "
                  "x (p_hat > p0); the candidate the teacher gives the label the highest probability is kept."]
    return "\n".join(lines) + "\n"


def plot_pdd(report: Mapping[str, Any], path) -> None:
    """max |z| before against after for every feature above tau before or after, with the tau lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tau = report["params"]["tau"]
    rows = report["z"]["features"]
    fig, ax = plt.subplots(figsize=(6, 5))
    for i, fam in enumerate(f["family"] for f in report["family_order"]):
        pts = [(r["max_abs_z_before"], r["max_abs_z_after"]) for r in rows if r["family"] == fam]
        if pts:
            b, a = zip(*pts)
            ax.scatter(b, a, s=14, alpha=0.7, color=f"C{i}", label=f"{fam} ({len(pts)})")
    top = max([tau * 1.5] + [max(r["max_abs_z_before"], r["max_abs_z_after"]) for r in rows]) * 1.05
    ax.plot([0, top], [0, top], color="0.6", lw=0.8, ls=":", label="no change")
    ax.axhline(tau, color="C3", lw=1, label=f"tau = {tau:g}")
    ax.axvline(tau, color="C3", lw=0.6, ls="--")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("max |z*| before")
    ax.set_ylabel("max |z*| after")
    r = report["rows"]
    ax.set_title(f"PDD: {r['input']:,} -> {r['output']:,} rows", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
