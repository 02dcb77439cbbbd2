"""The statistics of a comparison: the seed-row t interval of :mod:`debiased_nli.evaluation.significance` on the units'
stored predictions, the correction over the plan's primary comparisons with the intervals that match its calls,
and the seeds-only view for units that have no predictions (written before they were kept).

For a comparison A - B on a set, each side is the seeds x rows matrix of 0/1 correctness of its units' stored
predictions; both must have scored the same rows (the same content fingerprint), and
:func:`~debiased_nli.evaluation.significance.seed_row_interval` takes the seeds as the unit of replication (their
unbiased variance, Welch-Satterthwaite degrees of freedom) and adds the paired variance of the test rows:

    per (comparison, set):
        A, B     = seeds x rows correctness of each side           (a side needs >= 2 seeds)
        clusters = the set's `cluster:` column (HANS: subcase)     (from the predictions file, else the set on disk
                                                                    when its content fingerprint is the units')
        strata   = each seed's machine, when both sides ran the same number of seeds on each machine
        d, [low, high], p = seed_row_interval(A, B, clusters, strata)
    primary tests: p_adjusted and the matching adjusted interval (Holm's step level, Bonferroni's 1 - alpha/m,
                   or BH's 1 - R alpha/m), so that the interval excludes 0 exactly when the call is made

The primary comparisons, named in the plan before the run, form the family over which Holm's correction (or
Bonferroni's, or Benjamini-Hochberg's with ``correction: bh``) runs, one test per (comparison, set); every other
comparison is reported uncorrected, and says so. The interval is in closed form: no replicates, no Monte Carlo
error, the same figures on every run.

The seeds-only view (the efficacy table's old rule) compares the seeds' mean accuracies: a difference is
*called* when it exceeds both twice the unpaired standard error sqrt(s_A^2/n_A + s_B^2/n_B) and one point. It
sees neither the test rows' sampling variance nor the number of comparisons; it is shown only where a side has
no stored predictions (or one seed), and labelled as such.
"""
from __future__ import annotations

import math
from collections import Counter

from .plan import Plan
from .units import read_predictions

# cluster codes read from a set on disk, by (spec, content fingerprint of the rows scored): the fingerprint was
# checked, so the codes stay right for those rows whatever the disk holds later
_CLUSTER_CODES: dict[tuple[str, str, str], object] = {}
CORRECTION_NAMES = {"holm": "Holm (family-wise error rate)", "bonferroni": "Bonferroni (family-wise error rate)",
                    "bh": "Benjamini-Hochberg (false discovery rate)"}
# which interval of a primary test matches its call, per correction (the report says which); alpha = 1 - level
FAMILY_INTERVALS = {
    "holm": "the interval at the level of the Holm step that tested it (1 - {alpha}/(m - r) for the r-th smallest p "
            "from 0, and the level of the first step that failed for every later one): it excludes 0 exactly when "
            "the Holm-adjusted p is under {alpha}",
    "bonferroni": "Bonferroni's simultaneous interval at 1 - {alpha}/m: every interval of the family covers its true "
                  "difference at once with probability at least 1 - {alpha}, and excludes 0 exactly when the adjusted "
                  "p is under {alpha}",
    "bh": "Benjamini & Yekutieli's (2005) false-coverage-rate interval at 1 - {alpha} R/m (R rejections): it excludes "
          "0 exactly when the BH-adjusted p is under {alpha}",
}
METHOD = ("seed-row t interval (debiased_nli.evaluation.significance.seed_row_interval): the seeds are the unit of "
          "replication (unbiased variance, Welch-Satterthwaite degrees of freedom), the test rows' paired variance "
          "added (between clusters where the set declares them), closed form")


# ------------------------------------------------------------------------------------------ seeds only

def seeds_only(a: dict, b: dict) -> tuple[float, float | None, str]:
    """(difference in points, its standard error, 'helps'/'hurts'/'no clear change'/'one seed') of two table
    cells (mean, std, n_seeds over seeds): the seeds-only rule, |d| > max(2 SE, 1 point); no call with fewer
    than 2 seeds on either side."""
    diff = 100 * (a["mean"] - b["mean"])
    if a["std"] is None or b["std"] is None:
        return diff, None, "one seed"
    se = 100 * math.sqrt(a["std"] ** 2 / a["n_seeds"] + b["std"] ** 2 / b["n_seeds"])
    if abs(diff) > max(2 * se, 1.0):
        return diff, se, "helps" if diff > 0 else "hurts"
    return diff, se, "no clear change"


def seeds_only_calls(a: dict, b: dict) -> dict:
    """Per set that both rows have: row a's difference from row b (points, unrounded), its standard error and the
    seeds-only call."""
    calls = {}
    for s, v in a.items():
        if s in b:
            diff, se, call = seeds_only(v, b[s])
            calls[s] = {"difference": diff, "se": se, "call": call}
    return calls


# ------------------------------------------------------------------------------------------ the sides

class Sides:
    """Each row's correctness matrices per set, read from its units' predictions files (once each), and each
    set's clusters."""

    def __init__(self, plan: Plan, units: dict[str, list[dict]]):
        self.plan, self.units, self._files, self._clusters = plan, units, {}, {}

    def _read(self, unit: dict):
        rel = unit["predictions"]["file"]
        if rel not in self._files:
            path = self.plan.results_dir / rel
            self._files[rel] = read_predictions(path)[1] if path.exists() else None
        return self._files[rel]

    def coverage(self, row: str) -> dict:
        """Which of the row's finished seeds have stored predictions."""
        us = [u for u in self.units.get(row, []) if u["seed"] in self.plan.seeds]
        return {"with": [u["seed"] for u in us if u.get("predictions")],
                "without": [u["seed"] for u in us if not u.get("predictions")]}

    def side(self, row: str, set_name: str) -> tuple[dict | None, str | None]:
        """``({"matrix", "seeds", "devices", "fingerprint", "clusters"}, None)`` or ``(None, why not)``;
        ``clusters``: the codes stored with the predictions, where they were."""
        import numpy as np

        us = [u for u in self.units.get(row, []) if u["seed"] in self.plan.seeds]
        if not us:
            return None, f"`{row}` has no finished unit"
        with_p = [u for u in us if u.get("predictions") and set_name in u["predictions"].get("sets", {})]
        if not with_p:
            return None, f"`{row}` has no stored per-row predictions (its units predate them)"
        fps = {u["predictions"]["sets"][set_name]["rows_fingerprint"] for u in with_p}
        if len(fps) > 1:
            return None, f"`{row}`'s seeds scored different rows of {set_name} ({len(fps)} fingerprints)"
        rows, clusters = [], None
        for u in with_p:
            arrays = self._read(u)
            if arrays is None or set_name not in arrays:
                return None, f"`{row}` seed {u['seed']}: its predictions file {u['predictions']['file']} is missing"
            rows.append(arrays[set_name]["predicted"] == arrays[set_name]["gold"])
            clusters = arrays[set_name].get("cluster", clusters)
        return {"matrix": np.vstack(rows), "seeds": [u["seed"] for u in with_p],
                "devices": [u.get("device") or "not recorded" for u in with_p], "fingerprint": fps.pop(),
                "clusters": clusters}, None

    def clusters(self, set_name: str, fingerprint: str, stored) -> dict:
        """The set's clusters for the scored rows: ``{"column", "codes", "groups", "source"}``, ``{"column",
        "codes": None, "note"}`` where they cannot be had (the rows are then treated as independent, and the
        report says so), or ``{}`` where the set declares none. Units written before the codes were stored
        have them recomputed from the set on disk, when its rows are the ones scored (the same content
        fingerprint)."""
        import numpy as np

        spec = next((s for s in self.plan.set_specs() if s.name == set_name), None)
        if spec is None or not spec.cluster:
            return {}
        if stored is not None:
            codes = np.asarray(stored)
            return {"column": spec.cluster, "codes": codes, "groups": int(len(np.unique(codes))),
                    "source": "stored with the predictions"}
        key = (set_name, fingerprint)
        if key not in self._clusters:
            self._clusters[key] = self._clusters_from_disk(spec, fingerprint)
        return self._clusters[key]

    @staticmethod
    def _column(ds, name: str):
        import numpy as np

        return np.asarray(ds.with_format("arrow")[name].to_numpy(zero_copy_only=False))

    def _clusters_from_disk(self, spec, fingerprint: str) -> dict:
        import numpy as np

        from ...data.loading import content_fingerprint
        from ...models.challenge import load_challenge_set
        from ..scores import sample_rows
        from ...utils.errors import ConfigError
        from .units import eval_config, selection_rows

        import json

        cache_key = (json.dumps(spec.to_dict(), sort_keys=True, default=str), spec.cluster, fingerprint)
        if cache_key in _CLUSTER_CODES:
            codes = _CLUSTER_CODES[cache_key]
            return {"column": spec.cluster, "codes": codes, "groups": int(codes.max()) + 1,
                    "source": "the set's column, read from disk (content fingerprint checked)"}
        why = None
        try:
            ds = load_challenge_set(spec, self.plan.data_root)
            if spec.name == (self.plan.select_on or {}).get("set"):
                _, excluded, _ = selection_rows(self.plan)
                keep = ~np.isin(np.asarray(ds["row"], dtype=np.int64), np.asarray(excluded.get(spec.name, []), np.int64))
                ds = ds.select(np.flatnonzero(keep))
            cfg = eval_config(self.plan, progress=False)
            ds = sample_rows(ds, cfg.max_examples, cfg.sample_seed)
            if content_fingerprint(ds) != fingerprint:
                why = "the set on disk holds other rows than the ones scored (another content fingerprint)"
        except ConfigError as err:
            why = f"the set is not on disk ({str(err).split(';')[0][:160]})"
        if why is not None:
            return {"column": spec.cluster, "codes": None,
                    "note": f"its clusters (`{spec.cluster}`) are unknown: {why}; rows treated as independent, "
                            f"so the interval is too narrow"}
        codes = np.unique(self._column(ds, spec.cluster), return_inverse=True)[1]
        _CLUSTER_CODES[cache_key] = codes
        return {"column": spec.cluster, "codes": codes, "groups": int(codes.max()) + 1,
                "source": "the set's column, read from disk (content fingerprint checked)"}


def machine_strata(a: dict, b: dict) -> tuple[list | None, list | None, str]:
    """``(strata of A, strata of B, what was done)``: the machine of each seed, when the seeds ran on more than one
    and both sides ran the same number of seeds on each (then the seed variance is pooled within machines and
    the machine mix is a fixed part of the design); else ``(None, None, why not)``."""
    ca, cb = Counter(a["devices"]), Counter(b["devices"])
    if len(ca) == 1 and ca == cb:
        return None, None, "one machine"
    if ca != cb:
        return None, None, ("not stratified: the two sides' seeds ran on different mixes of machines, so the "
                            "machine is part of the seeds' variance")
    if min(len(a["devices"]), len(b["devices"])) - len(ca) < 1:
        return None, None, "not stratified: one seed per machine leaves no degree of freedom within machines"
    return a["devices"], b["devices"], f"stratified by machine ({len(ca)} machines)"


def _in_primary_family(comp: dict, set_name: str) -> bool:
    """Whether the plan names this comparison on this set as a primary test (``sets`` absent: every set)."""
    return bool(comp["primary"]) and (comp["sets"] is None or set_name in comp["sets"])


def _unavailable(fam: str, why: str, a_cell: dict, b_cell: dict) -> dict:
    diff, se, call = seeds_only(a_cell, b_cell)
    return {"family": fam, "unavailable": why, "seeds_only": {"difference": diff, "se": se, "call": call}}


def compute(plan: Plan, units: dict[str, list[dict]], table_rows: dict[str, dict]) -> dict:
    """The statistics of every declared comparison on every scored set: ``{method, level, monte_carlo_se,
    correction, family_intervals, primary_tests, comparisons: [{row, against, why, kind, primary, sets: {set:
    ...}}], coverage, clusters, ignored}``.

    A set's entry is the :class:`~debiased_nli.evaluation.significance.Difference` (``to_dict()``, plus ``text``:
    ``describe()``, ``family``: ``primary`` or ``secondary``, ``machines`` and ``cluster_column``), or
    ``{"family", "unavailable": why, "seeds_only": {difference, se, call}}`` where a side has no stored
    predictions or fewer than 2 seeds."""
    from ..significance import Difference, correct, seed_row_interval

    settings = plan.statistics
    level = settings["level"]
    sides = Sides(plan, units)
    comparisons, family = [], []
    clusters_used: dict[str, dict] = {}
    set_names = plan.set_names
    pending = 0  # primary tests the plan named whose rows have no finished unit yet
    for comp in plan.comparisons():
        a_sets = (table_rows.get(comp["row"]) or {}).get("sets") or {}
        b_sets = (table_rows.get(comp["against"]) or {}).get("sets") or {}
        if not a_sets or not b_sets:
            pending += sum(1 for s in set_names if _in_primary_family(comp, s))
            continue  # a side has no finished unit: nothing to compare yet (the table says pending / not run)
        entry = {k: comp[k] for k in ("row", "against", "why", "kind", "primary")} | {"sets": {}}
        for s in set_names:
            if s not in a_sets or s not in b_sets:
                continue
            fam = "primary" if _in_primary_family(comp, s) else "secondary"
            a, why_a = sides.side(comp["row"], s)
            b, why_b = sides.side(comp["against"], s)
            why = why_a or why_b
            if why is None and a["fingerprint"] != b["fingerprint"]:
                why = f"the two rows' models scored different rows of {s} (content fingerprints differ)"
            if why is None and min(len(a["seeds"]), len(b["seeds"])) < 2:
                why = (f"{len(a['seeds'])} seed(s) of `{comp['row']}` and {len(b['seeds'])} of `{comp['against']}` "
                       f"with predictions: the seeds' variance needs at least 2 a side")
            if why is not None:
                entry["sets"][s] = _unavailable(fam, why, a_sets[s], b_sets[s])
                continue
            cl = sides.clusters(s, a["fingerprint"], a["clusters"] if a["clusters"] is not None else b["clusters"])
            if cl:
                clusters_used[s] = {k: v for k, v in cl.items() if k != "codes"}
            strata_a, strata_b, machines = machine_strata(a, b)
            d = seed_row_interval(a["matrix"], b["matrix"], level=level, clusters=cl.get("codes"),
                                  strata_a=strata_a, strata_b=strata_b)
            entry["sets"][s] = {"family": fam, "seeds_of_a": a["seeds"], "seeds_of_b": b["seeds"],
                                "machines": machines, "cluster_column": cl.get("column") if cl.get("groups") else None,
                                **d.to_dict()}
            if fam == "primary":
                family.append(entry["sets"][s])
        comparisons.append(entry)
    fields = list(Difference.__dataclass_fields__)
    if family:
        diffs = [Difference(**{k: v for k, v in e.items() if k in fields}) for e in family]
        for e, d in zip(family, correct(diffs, plan.correction, family_size=len(family) + pending)):
            e.update(d.to_dict())
    for entry in comparisons:
        for e in entry["sets"].values():
            if "unavailable" not in e:
                d = Difference(**{k: v for k, v in e.items() if k in fields})
                e["distinguishable"], e["text"] = d.distinguishable, d.describe()
    primary_missing = sum(1 for c in comparisons for e in c["sets"].values()
                          if e["family"] == "primary" and "unavailable" in e)
    return {"method": METHOD, "level": level, "monte_carlo_se": 0.0,
            "correction": plan.correction if family else None,
            "family_intervals": (FAMILY_INTERVALS[plan.correction].format(alpha=f"{1 - level:.2g}")
                                 if family else None),
            "primary_tests": len(family), "primary_tests_unavailable": primary_missing,
            "primary_tests_pending": pending, "comparisons": comparisons, "clusters": clusters_used,
            "ignored": settings.get("ignored"),
            "coverage": {row: sides.coverage(row) for row in table_rows if table_rows[row].get("sets")}}
