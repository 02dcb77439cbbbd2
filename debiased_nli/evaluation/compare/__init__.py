"""``debiased-nli compare``: does training on a release help? Train one model per row of a plan and seed, score
each on challenge sets, keep every row's predictions, and report the differences with seed-row t intervals (the seeds
as the unit of replication, the test rows' variance added).

A plan (YAML, :mod:`.plan`) names the rows (release configs, the original data, random controls of a named
row's size, product of experts), a model, a training recipe, seeds, the challenge sets, how the epoch is
selected (``select_on``: a held-out part of a set that is then scored without those rows) and the primary
comparisons, named in advance. Each (row, seed) is a *unit* (:mod:`.units`): trained, scored on every set,
and written as one result file plus one predictions file; a rerun skips finished units, so ``run`` resumes
after a stop, and retrains a *stale* unit (its row's training rows changed since it ran). ``report`` (:mod:`.report`, :mod:`.stats`) writes markdown, JSON and a plot; :mod:`.hub` pushes
an evaluation report (model-index) beside a release on the Hub.

    debiased-nli compare status plan.yaml
    debiased-nli compare run plan.yaml --workers 2
    debiased-nli compare report plan.yaml [--push-to ORG/NAME]

The project's efficacy table (documentation page "Does it help?") is a plan run by this package.
"""
from __future__ import annotations

from .plan import Plan, load_plan
from .rows import NotBuilt, Pending, RowData, resolve_row
from .units import run, run_workers, unit_states

# the report: debiased_nli.evaluation.compare.report.report (the module keeps its name)
__all__ = ["Plan", "load_plan", "NotBuilt", "Pending", "RowData", "resolve_row", "run", "run_workers",
           "unit_states"]
