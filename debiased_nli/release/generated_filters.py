"""Filters past the paper (issue 45, item 4): what the build may do to generated rows beyond Wu et al. (2022).

Wu et al.'s pipeline keeps a generated row when the confidence model M is sure of its label and z-filtering
accepts it. Neither looks at whether the row is a sentence, whether it repeats a D0 row, or whether the
composed config carries artifacts of its own. Read blind, a third of the CPU Seq-Z v1's generated rows were
nonsense and its own audit found max |z| 20.7 (see ``docs/methods/generator.md``). Three recipe options,
each off by default, each recorded like every other step's decisions:

``generated_filters.near_duplicates`` (applied to D_G, the new rows, before composition)
    drops a new row whose premise and hypothesis are both copies or near-duplicates (character 5-gram Jaccard
    at least ``threshold`` each, MinHash-LSH candidates checked exactly:
    :func:`debiased_nli.methods.quality.pair_near_duplicates`) of one D0 row's, or of an earlier new row's
    (``within: true``; the first of each group stays);
``generated_filters.fluency`` (then)
    drops a new row whose mean token log-probability under ``lm`` (a causal LM not trained on D0, e.g. the
    generator's base model) is under the ``quantile`` of a seeded sample of D0's rows' scores
    (:func:`debiased_nli.methods.quality.fluency_scores`); by construction that share of real rows would fail;
``self_audit`` (applied to each named config after composition)
    the self-audit fixed point (:func:`debiased_nli.bias.self_audit.self_audit_fixed_point`): the config is
    audited with its own hypothesis-only model and z-statistics and z-filtered again as its own D0 until its
    own max |z| is under the Bonferroni threshold at ``alpha``, at most ``max_rounds`` times.

The dropped new rows are recorded under ``decisions/new_rows/filter-<name>/`` (the rows kept and the rows
dropped with their ``reason``), so ``build --replay`` reuses the LM's decisions; the rows the self-audit
drops join the config's ``rejected/<config>/`` rows with ``rejected_by`` naming the round and the features.
Every threshold here is the project's choice (the papers have no such step); each default is off until a
measurement on held-out real rows says it helps (docs/methods/generator.md).
"""
from __future__ import annotations

import time
from typing import Any, Mapping

from ..utils.errors import ConfigError, excerpt

NEAR_DUPLICATES = {"threshold": 0.8, "within": True}  # project's choice (methods.quality.NEAR_DUP_JACCARD)
FLUENCY = {"lm": None, "quantile": 0.05, "reference_rows": 2000, "batch_size": 32, "max_length": 128}  # project's choice
SELF_AUDIT = {"configs": [], "max_rounds": 5, "alpha": 0.01, "z_threshold": None}  # project's choice


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_CHECKS = {
    "near_duplicates": {
        "threshold": ("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1),
        "within": ("true or false", lambda v: isinstance(v, bool)),
    },
    "fluency": {
        "lm": ("a causal LM folder or Hub id (e.g. the generator's base model)", lambda v: isinstance(v, str) and v.strip()),
        "quantile": ("a number strictly between 0 and 1", lambda v: _is_number(v) and 0 < v < 1),
        "reference_rows": ("a positive integer", lambda v: _is_int(v) and v >= 1),
        "batch_size": ("a positive integer", lambda v: _is_int(v) and v >= 1),
        "max_length": ("an integer >= 2", lambda v: _is_int(v) and v >= 2),
    },
    "self_audit": {
        "configs": ("a list of z-config names (z_aug, par_z, seq_z, z_filtered)",
                    lambda v: isinstance(v, list) and all(c in ("z_filtered", "z_aug", "par_z", "seq_z") for c in v)),
        "max_rounds": ("a positive integer", lambda v: _is_int(v) and v >= 1),
        "alpha": ("a number strictly between 0 and 1", lambda v: _is_number(v) and 0 < v < 1),
        "z_threshold": ("a positive number or null (null: Bonferroni at alpha)", lambda v: v is None or _is_number(v) and v > 0),
    },
}
_DEFAULTS = {"near_duplicates": NEAR_DUPLICATES, "fluency": FLUENCY, "self_audit": SELF_AUDIT}


def resolve(name: str, value: Any, where: str) -> dict | None:
    """The settings of option ``name`` (``near_duplicates``, ``fluency``, ``self_audit``) with its defaults
    filled in, or None when it is off; a wrong key or value is a :class:`ConfigError` naming it."""
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: `{name}` must be null (off), true (the defaults) or a mapping, got {excerpt(value)}")
    checks = _CHECKS[name]
    for key in value:
        if key not in checks:
            from ..utils.errors import did_you_mean
            shown = key if isinstance(key, str) and len(key) <= 100 else excerpt(key)
            raise ConfigError(f"{where}: unknown key {name}.{shown}.{did_you_mean(str(key), list(checks))} "
                              f"Known: {sorted(checks)}")
    out = {**_DEFAULTS[name], **value}
    for key, (says, check) in checks.items():
        if not check(out[key]):
            raise ConfigError(f"{where}: `{name}.{key}` must be {says}, got {excerpt(out[key])}")
    if name == "self_audit" and not out["configs"]:
        return None
    return out


def check(recipe: Mapping[str, Any], where: str) -> None:
    """Validate the recipe's ``generated_filters`` and ``self_audit`` (called while the recipe is read)."""
    for name in ("near_duplicates", "fluency"):
        resolve(name, recipe["generated_filters"].get(name), where)
    resolve("self_audit", recipe["self_audit"] if recipe["self_audit"]["configs"] else None, where)


def near_duplicates_filter(dg, d0, params: Mapping[str, Any], seed: int):
    """(kept, dropped with ``reason``, report): the new rows that are copies or near-duplicates of a D0 row or,
    with ``within``, of an earlier new row."""
    import numpy as np

    from ..methods.quality import pair_near_duplicates

    prem, hyp = dg["premise"], dg["hypothesis"]
    threshold = float(params["threshold"])
    of_d0 = pair_near_duplicates(prem, hyp, d0["premise"], d0["hypothesis"], threshold=threshold, seed=seed)
    reasons: list[str | None] = [None] * len(prem)
    d0_uids = d0["uid"] if "uid" in d0.column_names else None
    for i in np.flatnonzero(of_d0["mask"]):
        j = int(of_d0["match"][i])
        ref = d0_uids[j] if d0_uids is not None else f"row {j}"
        reasons[i] = (f"near_duplicate of D0 {ref} (premise and hypothesis Jaccard >= "
                      f"{of_d0['max_jaccard'][i]:.3f} >= {threshold:g})")
    within = 0
    if params["within"]:
        own = pair_near_duplicates(prem, hyp, threshold=threshold, seed=seed, earlier_only=True)
        uids = dg["uid"] if "uid" in dg.column_names else None
        for i in np.flatnonzero(own["mask"]):
            if reasons[i] is None:
                j = int(own["match"][i])
                ref = uids[j] if uids is not None else f"row {j}"
                reasons[i] = (f"near_duplicate of new row {ref} (premise and hypothesis Jaccard >= "
                              f"{own['max_jaccard'][i]:.3f} >= {threshold:g})")
                within += 1
    drop = [i for i, r in enumerate(reasons) if r is not None]
    keep = [i for i, r in enumerate(reasons) if r is None]
    dropped = dg.select(drop).add_column("reason", [reasons[i] for i in drop])
    report = {"rows": len(dg), "kept": len(keep), "dropped": len(drop), "of_d0": int(of_d0["mask"].sum()),
              "within_new_rows": within, "threshold": threshold, "within": bool(params["within"])}
    return dg.select(keep), dropped, report


def fluency_filter(dg, d0, params: Mapping[str, Any], seed: int, progress: bool):
    """(kept, dropped with ``reason`` and ``fluency``, report): the new rows whose mean token log-probability
    under ``lm`` is at least the ``quantile`` of ``reference_rows`` seeded D0 rows' scores."""
    import numpy as np

    from ..methods.quality import fluency_scores, pair_texts

    rng = np.random.default_rng(seed)
    n_ref = min(int(params["reference_rows"]), len(d0))
    ref_rows = d0.select(np.sort(rng.choice(len(d0), size=n_ref, replace=False)))
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = os.path.expanduser(params["lm"])  # a leading ~ is the user's home, as in the recipe's other model paths
    tokenizer = AutoTokenizer.from_pretrained(name)
    lm = AutoModelForCausalLM.from_pretrained(name)
    kw = dict(tokenizer=tokenizer, batch_size=int(params["batch_size"]), max_length=int(params["max_length"]),
              progress=progress)
    real = fluency_scores(pair_texts(ref_rows), lm, **kw)
    bound = float(np.quantile(real, float(params["quantile"])))
    scores = fluency_scores(pair_texts(dg), lm, **kw)
    under = scores < bound
    drop, keep = np.flatnonzero(under), np.flatnonzero(~under)
    dropped = dg.select(drop)
    dropped = dropped.add_column("fluency", [round(float(s), 6) for s in scores[drop]])
    dropped = dropped.add_column("reason", [f"fluency {s:.3f} < bound {bound:.3f} ({params['quantile']:g} quantile "
                                            f"of {n_ref} D0 rows under {params['lm']})" for s in scores[drop]])
    report = {"rows": len(dg), "kept": int(len(keep)), "dropped": int(len(drop)), "bound": round(bound, 6),
              "quantile": float(params["quantile"]), "reference_rows": n_ref, "lm": str(params["lm"]),
              "mean_new_rows": round(float(scores.mean()), 6) if len(scores) else None,
              "mean_reference_rows": round(float(real.mean()), 6)}
    return dg.select(keep), dropped, report


_FILTERS = {"near_duplicates": near_duplicates_filter, "fluency": fluency_filter}


def run_generated_filters(run, d0, dg):
    """D_G after the recipe's ``generated_filters`` (near-duplicates, then fluency): each one's decisions recorded
    as ``decisions/new_rows/filter-<name>/`` (replayed by ``build --replay``), its counts a manifest stage."""
    from .decisions import input_sha256, rows_record

    if dg is None:
        return None
    where = "recipe"
    for name in ("near_duplicates", "fluency"):
        params = resolve(name, run.recipe["generated_filters"].get(name), where)
        if params is None:
            continue
        clock = time.perf_counter()
        key = f"new_rows/filter-{name}"
        dg_hash = input_sha256(dg)
        replayed = run.replay.lookup_rows(key, name, params, dg_hash) if run.replay is not None else None
        if replayed:
            kept, dropped, report = replayed
        elif name == "fluency":
            kept, dropped, report = fluency_filter(dg, d0, params, run.seed, run.progress)
        else:
            kept, dropped, report = near_duplicates_filter(dg, d0, params, run.seed)
        run.row_records[key] = rows_record(name, params, dg_hash, kept, dropped, report)
        run.reports[f"new rows filter: {name}"] = report
        replay = {"replay": run.replay.used[key]} if run.replay is not None else {}
        run.stage(f"new rows filter: {name}", clock, counts={"rows": len(dg), "kept": len(kept),
                                                             "dropped": len(dg) - len(kept)}, report=report, **replay)
        dg = kept
    return dg


def self_audit_configs(run, configs: list, feats) -> list:
    """The recipe's ``self_audit`` applied to each named z-config: its train split replaced by the fixed point's
    rows, the rows it drops appended to the config's rejected rows (``rejected_by``: the round and features),
    its rounds recorded as a manifest stage; the config's feature parts narrowed to the rows it keeps."""
    import datasets

    from ..bias.self_audit import self_audit_fixed_point
    from ..bias.zfilter import ZFilterParams
    from .step_registry import Rejects

    z_rejects = Rejects(reason="rejected_by")  # as the build writes the z-filter's dropped rows (recipe.Z_REJECTS)

    params = resolve("self_audit", run.recipe["self_audit"] if run.recipe["self_audit"]["configs"] else None, "recipe")
    if params is None:
        return configs
    feat, zc = run.recipe["features"], run.recipe["z_filter"]
    hyp = feat["hypothesis_only"] if isinstance(feat["hypothesis_only"], str) else "tfidf"
    zp = ZFilterParams(top_k=zc["top_k"], batch_size=zc["batch_size"], p0=zc["p0"], min_z=zc["min_z"])
    out = []
    for c in configs:
        if c.name not in params["configs"]:
            out.append(c)
            continue
        clock = time.perf_counter()
        train = c.splits["train"]
        res = self_audit_fixed_point(train, run.task, z_threshold=params["z_threshold"], alpha=params["alpha"],
                                     max_rounds=params["max_rounds"], hypothesis_only=hyp, folds=feat["folds"],
                                     seed=run.seed, zfilter=zp, progress=run.progress)
        keep = set(res.kept["uid"])  # the config's own rows (with any feature columns) that the fixed point kept
        kept = train.select([i for i, u in enumerate(train["uid"]) if u in keep])
        rejected = c.rejected
        if res.rejected is not None and len(res.rejected):
            # the z-filter's reason is the list of biased features that rejected a row: the round goes first
            extra = res.rejected.map(lambda b: {"rejected_by": [[f"self-audit round {r}"] + list(why) for r, why in
                                                                zip(b["self_audit_round"], b["rejected_by"])]},
                                     batched=True)
            extra = z_rejects.table(extra, c.name)
            rejected = extra if rejected is None or not len(rejected) else \
                datasets.concatenate_datasets([rejected, extra.cast(rejected.features)])
        c.splits["train"] = kept
        c.rejected = rejected
        c.features = _narrow_parts(c.features, feats, kept)
        if c.features is not None and sum(len(r) for _, _, r in c.features) != len(kept):
            raise RuntimeError(f"{c.name}: the self-audit kept {len(kept):,} rows but its feature parts hold "
                               f"{sum(len(r) for _, _, r in c.features):,}; the card's z-statistics would be wrong")
        report = {"rows": len(train), "kept": len(kept), "dropped": len(train) - len(kept), "rounds": res.rounds,
                  "converged": res.converged, "final_audit": res.final_audit, **{k: params[k] for k in
                                                                               ("max_rounds", "alpha", "z_threshold")}}
        run.reports[f"{c.name}: self-audit"] = report
        run.stage(f"{c.name}: self-audit", clock, counts={"rows": len(train), "kept": len(kept),
                                                          "dropped": len(train) - len(kept)}, report=report)
        out.append(c)
    return out


def _narrow_parts(parts, feats, kept):
    """The config's feature parts (matrix, labels, row indices) restricted to the rows of ``kept`` (by uid)."""
    import numpy as np

    if parts is None:
        return None
    keep = set(kept["uid"])
    out = []
    for matrix, labels, rows in parts:
        source = feats.d0 if matrix is feats.matrices[0] else feats.dg
        idx = np.arange(len(source)) if rows is None else np.asarray(rows)
        uids = np.asarray(source.select_columns(["uid"])["uid"], dtype=object)[idx]
        mask = np.fromiter((u in keep for u in uids), dtype=bool, count=len(uids))
        out.append((matrix, labels, idx[mask]))
    return out
