"""The self-audit fixed point of a composed config (issue 45, item 4): z-filter a config again, with features
computed on the config itself, until its own audit is under the threshold.

Wu et al.'s compositions (Z-Aug, Par-Z, Seq-Z) z-filter the generated rows D_G through D0's features: the
hypothesis-only model that gives the ``hypo_only_pred`` feature is fitted on D0, and the z-statistics that
decide are those of D0 (or Z(D0)) plus the rows added so far. Artifacts that only the generated rows carry,
or that a hypothesis-only model fitted on the config would find, pass. Audited on its own (``debiased-nli
audit`` of the config: its own out-of-fold hypothesis-only model, its own z-statistics), the CPU Seq-Z v1
had max |z| 20.7 and hypothesis-only accuracy 0.476, where Z(D0) had 6.9 and 0.376.

The fixed point: audit the config as ``debiased-nli audit`` does (Gardner et al. 2021's z-statistics, the
Bonferroni-corrected threshold at ``alpha`` over every (feature, label) test unless a threshold is given);
while its largest |z| is above the threshold, z-filter the config with features computed on it alone
(:func:`debiased_nli.bias.compose.z_filtered_original`: Algorithm 1 on the config as its own D0), and audit
again, for at most ``max_rounds`` rounds. Each round's dropped rows keep the biased features that rejected
them and the round. The stopping rule and the default of 5 rounds are the project's choice; the paper has
no such step.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..data.tasks import TaskSpec
from ..utils.errors import ConfigError

if TYPE_CHECKING:
    from .zfilter import ZFilterParams

MAX_ROUNDS = 5  # project's choice


@dataclasses.dataclass
class SelfAuditResult:
    kept: Any                 # the config's rows after the last round
    rejected: Any             # the rows the rounds dropped, with ``rejected_by`` and ``self_audit_round``
    rounds: list[dict]        # per round: rows in, the audit before it (max |z|, threshold, hypothesis-only
                              # accuracy, features above), rows dropped
    converged: bool           # the last audit is under the threshold
    final_audit: dict


def _audit_summary(report: dict) -> dict:
    return {"rows": report["n_rows"], "max_abs_z": report["max_abs_z"], "z_threshold": report["z_threshold"],
            "z_threshold_rule": report["z_threshold_rule"], "hypothesis_only_accuracy": report["hypothesis_only_accuracy"],
            "features_above_threshold": report["features_above_threshold"]}


def self_audit_fixed_point(ds, task: TaskSpec, *, z_threshold: float | None = None, alpha: float = 0.01,
                           max_rounds: int = MAX_ROUNDS, hypothesis_only: str = "tfidf", folds: int = 5, seed: int = 0,
                           zfilter: "ZFilterParams | None" = None, progress: bool = True) -> SelfAuditResult:
    """Rounds of (own audit, own z-filter) until the config's own max |z| is at most the threshold, no row is
    dropped any more, or ``max_rounds`` rounds have run. ``zfilter``: the z-filter's settings (its ``top_k`` and
    ``p0`` are the audit's too; default: :class:`~debiased_nli.bias.zfilter.ZFilterParams`'s)."""
    import datasets

    from ..data.loading import materialize
    from .audit import audit_dataset
    from .compose import z_filtered_original
    from .zfilter import ZFilterParams

    zp = zfilter or ZFilterParams()
    top_k, p0 = zp.top_k, zp.p0
    if max_rounds < 1:
        raise ConfigError(f"max_rounds must be at least 1, not {max_rounds}")
    current, dropped, rounds = ds, [], []
    feature_cols = [c for c in ds.column_names if c.startswith("feat_") or c == "hypo_only_pred"]
    if feature_cols:  # features of another set (D0's) are not this config's own: computed again
        current = current.remove_columns(feature_cols)
    report = audit_dataset(current, task, top_k=top_k, p0=p0, z_threshold=z_threshold, alpha=alpha,
                           hypothesis_only=hypothesis_only, seed=seed, progress=progress)
    for r in range(1, max_rounds + 1):
        if report["max_abs_z"] <= report["z_threshold"]:
            break
        z = z_filtered_original(current, task, hypothesis_only=hypothesis_only, folds=folds, seed=seed, params=zp,
                                progress=progress)
        n_out = len(z.rejected)
        rounds.append({"round": r, "before": _audit_summary(report), "dropped": n_out, "kept": len(z.kept)})
        if n_out == 0:
            break
        rej = z.rejected.add_column("self_audit_round", [r] * n_out)
        dropped.append(rej.remove_columns([c for c in rej.column_names if c.startswith("feat_") or c == "hypo_only_pred"]))
        keep_cols = [c for c in z.kept.column_names if not (c.startswith("feat_") or c == "hypo_only_pred")]
        current = materialize(z.kept.select_columns(keep_cols))
        report = audit_dataset(current, task, top_k=top_k, p0=p0, z_threshold=z_threshold, alpha=alpha,
                               hypothesis_only=hypothesis_only, seed=seed, progress=progress)
    rejected = datasets.concatenate_datasets(dropped) if dropped else None
    return SelfAuditResult(kept=current, rejected=rejected, rounds=rounds,
                           converged=report["max_abs_z"] <= report["z_threshold"], final_audit=_audit_summary(report))
