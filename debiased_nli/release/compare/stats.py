"""The statistics of a comparison: the paired bootstrap of :mod:`debiased_nli.models.significance` on the units'
stored predictions, the correction over the plan's primary comparisons, and the seeds-only view for units that
have no predictions (written before they were kept).

For a comparison A - B on a set, each side is the seeds x rows matrix of 0/1 correctness of its units' stored
predictions; both must have scored the same rows (the same content fingerprint), and
:func:`~debiased_nli.models.significance.paired_bootstrap` resamples the rows (shared) and each side's seeds.
The primary comparisons, named in the plan before the run, form the family over which Holm's correction (or
Benjamini-Hochberg, ``correction: bh``) runs, one test per (comparison, set); every other comparison is reported
uncorrected, and says so.

The seeds-only view (the efficacy table's old rule) compares the seeds' mean accuracies: a difference is
*called* when it exceeds both twice the unpaired standard error sqrt(s_A^2/n_A + s_B^2/n_B) and one point. It
sees neither the test rows' sampling variance nor the number of comparisons; it is shown only where a side has
no stored predictions, and labelled as such.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from .locking import log
from .plan import Plan, write_json_atomic
from .units import read_predictions

CACHE_FILE = "bootstrap_cache.json"
CORRECTION_NAMES = {"holm": "Holm (family-wise error rate)", "bh": "Benjamini-Hochberg (false discovery rate)"}


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


# ------------------------------------------------------------------------------------------ paired bootstrap

class Sides:
    """Each row's correctness matrices per set, read from its units' predictions files (once each)."""

    def __init__(self, plan: Plan, units: dict[str, list[dict]]):
        self.plan, self.units, self._files = plan, units, {}

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
        """``({"matrix", "seeds", "fingerprint", "digests"}, None)`` or ``(None, why not)``."""
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
        rows = []
        for u in with_p:
            arrays = self._read(u)
            if arrays is None or set_name not in arrays:
                return None, f"`{row}` seed {u['seed']}: its predictions file {u['predictions']['file']} is missing"
            rows.append(arrays[set_name]["predicted"] == arrays[set_name]["gold"])
        return {"matrix": np.vstack(rows), "seeds": [u["seed"] for u in with_p], "fingerprint": fps.pop(),
                "digests": [u["predictions"]["sha256"] for u in with_p]}, None


def _cache_key(a: dict, b: dict, set_name: str, boot: dict) -> str:
    text = json.dumps({"a": a["digests"], "b": b["digests"], "set": set_name, **boot}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _in_primary_family(comp: dict, set_name: str) -> bool:
    """Whether the plan names this comparison on this set as a primary test (``sets`` absent: every set)."""
    return bool(comp["primary"]) and (comp["sets"] is None or set_name in comp["sets"])


def compute(plan: Plan, units: dict[str, list[dict]], table_rows: dict[str, dict], *,
            use_cache: bool = True) -> dict:
    """The statistics of every declared comparison on every scored set: ``{method, replicates, seed, level,
    correction, primary_tests, comparisons: [{row, against, why, kind, primary, sets: {set: ...}}], coverage}``.

    A set's entry is the :class:`~debiased_nli.models.significance.Difference` (``to_dict()``, plus ``text``:
    ``describe()``, and ``family``: ``primary`` or ``secondary``), or ``{"family", "unavailable": why, "seeds_only":
    {difference, se, call}}`` where a side has no stored predictions."""
    from ...models.significance import Difference, correct, paired_bootstrap

    boot = plan.bootstrap
    sides = Sides(plan, units)
    cache_path = plan.results_dir / "predictions" / CACHE_FILE
    cache = json.loads(cache_path.read_text()) if use_cache and cache_path.exists() else {}
    new_cache: dict[str, Any] = {}
    comparisons, family = [], []
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
            if why is not None:
                diff, se, call = seeds_only(a_sets[s], b_sets[s])
                entry["sets"][s] = {"family": fam, "unavailable": why,
                                    "seeds_only": {"difference": diff, "se": se, "call": call}}
                continue
            key = _cache_key(a, b, s, boot)
            d = cache.get(key)
            if d is None:
                log(f"bootstrap {comp['row']} - {comp['against']} on {s}: {a['matrix'].shape[1]:,} rows, "
                    f"{len(a['seeds'])} + {len(b['seeds'])} seeds, {boot['replicates']:,} replicates")
                d = paired_bootstrap(a["matrix"], b["matrix"], replicates=boot["replicates"], level=boot["level"],
                                     seed=boot["seed"]).to_dict()
            new_cache[key] = d
            entry["sets"][s] = {"family": fam, "seeds_of_a": a["seeds"], "seeds_of_b": b["seeds"], **d}
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
    if use_cache and new_cache and new_cache != cache:
        write_json_atomic(cache_path, new_cache)
    primary_missing = sum(1 for c in comparisons for e in c["sets"].values()
                          if e["family"] == "primary" and "unavailable" in e)
    return {"method": "paired bootstrap over test rows nested with seeds "
                      "(debiased_nli.models.significance.paired_bootstrap)",
            **boot, "correction": plan.correction if family else None, "primary_tests": len(family),
            "primary_tests_unavailable": primary_missing, "primary_tests_pending": pending, "comparisons": comparisons,
            "coverage": {row: sides.coverage(row) for row in table_rows if table_rows[row].get("sets")}}


def cache_file(plan: Plan) -> Path:
    return plan.results_dir / "predictions" / CACHE_FILE
