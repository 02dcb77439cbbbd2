"""The resumable multi-stage run of a recipe's generation pipeline (``debiased-nli pipeline run|status``).

A recipe profile with a ``generator`` step (Wu et al. 2022: train G, fine-tune G*, sample, confidence-filter)
builds in one go with ``debiased-nli build``. The same profile run as a pipeline splits it into stages, each
resumable and each leaving a done-record, so that a run of days can stop and continue, on this machine or
another one, and say where it stands:

    train_g       G on D0 (the step's ``train``; skipped when the step names a trained ``generator``)
    train_g_star  G* on Z(D0) / Z-(D0) (the step's ``debias``; skipped without one)
    train_m       the confidence model M on D0 (the step's ``train_m``; skipped when ``confidence.model`` is given)
    sample        sharded sampling (the step's ``generate``): one Parquet file per shard, a rerun samples the
                  missing shards only
    filter        the confidence filter (the step's ``confidence``: tau, or tau chosen by ``tau_rule: min_kept``),
                  M calibrated first when the step gives ``calibration_data``
    build         the recipe's release with the kept rows as new rows (z_filtered, z_aug, par_z, seq_z, ...)
    audit         ``debiased-nli audit`` of D0 and of every config of the release

The same step functions as the build's run each stage (:mod:`debiased_nli.methods.generation.step`, the
release's :func:`~debiased_nli.release.recipe.build`, :func:`debiased_nli.api.audit`); the pipeline adds the
run folder, the done-records and the status. See :mod:`.run`.
"""
from __future__ import annotations

from .run import STAGES, Pipeline, StageState

__all__ = ["STAGES", "Pipeline", "StageState"]
