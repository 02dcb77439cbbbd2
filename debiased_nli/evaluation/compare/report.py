"""The report of a plan: the table (mean ± std over seeds per row and set), the differences of the declared
comparisons with seed-row t intervals (:mod:`.stats`), and the units' data, size and cost, as markdown,
JSON (``debiased-nli/efficacy-table/v2``, which ``debiased-nli build --efficacy`` reads) and a plot.

Every figure is rounded once, when it is written: the JSON holds the unrounded values.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from ...release.efficacy import TABLE_SCHEMA_V2, difference_cells, train_rows_text
from . import stats
from .plan import Plan, report_outputs, write_json_atomic
from .rows import per_unit_subset
from .units import load_units, unit_states

BREAKDOWNS = [("hans", "heuristic/label"), ("anli", "round"), ("snli_test", "hard")]
# sets whose predicted-label shares the report shows: a model that drifts to one label out of domain, or that
# answers HANS by word overlap (entailment on nearly every row, McCoy et al. 2019), shows it here
SHARE_SETS = ["snli_dev", "mnli_dev_matched", "mnli_dev_mismatched", "hans"]
SEEDS_ONLY_RULE = ("* = more than 2 standard errors of the seeds' means and 1 point: an unpaired rule over the seeds "
                   "alone, blind to the test rows' sampling variance and uncorrected for the number of comparisons")


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    import numpy as np

    a = np.asarray(values, dtype=float)
    return float(a.mean()), (float(a.std(ddof=1)) if len(a) > 1 else None)


def _row_command(us: list[dict]) -> str:
    """How a row's data was made, from its first unit's record; a subset drawn anew for each seed says so
    (its first unit's shuffle seed is only that unit's)."""
    d = us[0]["data"]
    if d.get("kind") == "random_subset" and d.get("subset_seed_is_unit_seed"):
        seeds = ", ".join(str(u["seed"]) for u in sorted(us, key=lambda u: u["seed"]))
        return (d["command"].replace(f".shuffle(seed={d['seed']})", ".shuffle(seed=s)", 1)
                + f"; s = the unit's seed ({seeds})")
    return d["command"]


def _predicted_shares(units: list[dict], share_sets: Sequence[str]) -> dict:
    """Per set of ``share_sets``: the mean share of rows predicted as each label, and the gold shares, over the
    units that recorded a confusion matrix (units evaluated before it was recorded have none)."""
    out = {}
    for s in share_sets:
        mats = [u["sets"][s]["confusion"] for u in units if "confusion" in (u["sets"].get(s) or {})]
        if not mats:
            continue
        labels = list(mats[0])
        total = [sum(sum(r.values()) for r in m.values()) for m in mats]
        pred = {lab: sum(sum(m[g][lab] for g in labels) / n for m, n in zip(mats, total)) / len(mats) for lab in labels}
        gold = {lab: sum(mats[0][lab].values()) / total[0] for lab in labels}
        out[s] = {"predicted": pred, "gold": gold, "n_seeds": len(mats)}
    return out


def _breakdowns(units: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for s, b in BREAKDOWNS:
        groups: dict[str, list[float]] = {}
        for u in units:
            for g, v in ((u["sets"].get(s) or {}).get("breakdowns", {}).get(b) or {}).items():
                groups.setdefault(g, []).append(v["accuracy"])
        if groups:
            out[f"{s}: {b}"] = {g: dict(zip(("mean", "std"), _mean_std(v))) | {"n_seeds": len(v)} for g, v in groups.items()}
    return out


def build_of(data: dict) -> str | None:
    """Which build of its data a unit read, where the unit has no content fingerprint to say which rows:
    the release's manifest sha256 (a release folder) or the commit it was built at (a release the plan
    built). Two seeds with different builds may have trained on different rows. (``datasets``' own
    fingerprint is no such sign: it hashes the path and modification time, which change on a copy.)"""
    for key in ("release_manifest_sha256", "built_at_commit"):
        if data.get(key):
            return f"{key}:{data[key]}"
    return None


def same_rows(fingerprints: dict, per_seed: bool = False, sizes: dict | None = None,
              builds: dict | None = None) -> str:
    """Whether the finished seeds of a row trained on the same rows, from their content fingerprints
    (:func:`debiased_nli.data.loading.content_fingerprint`; units finished before it was recorded have none) and,
    failing those, their sizes and which build of the data they read (``builds``, :func:`build_of`): a
    seed without a content fingerprint that read another build than another seed is marked, since the
    two may have trained on different rows. ``per_seed``: a random control drawn anew for each seed, whose
    rows are meant to differ."""
    known = {s: f for s, f in fingerprints.items() if f}
    if per_seed:
        return f"no, drawn anew per seed ({len(set(known.values()))} distinct in {len(known)} seeds)"
    if sizes and len(set(sizes.values())) > 1:
        return "**no**: " + ", ".join(f"s{s} {n:,} rows" for s, n in sorted(sizes.items()))
    missing = sorted(s for s in fingerprints if s not in known)
    builds = {s: b for s, b in (builds or {}).items() if b}
    unverified = sorted(s for s in missing if s in builds and any(builds.get(o) not in (None, builds[s])
                                                                  for o in fingerprints if o != s))
    if unverified and len(set(known.values())) <= 1:
        ids = {b: f"b{i + 1}" for i, b in enumerate(dict.fromkeys(builds[s] for s in sorted(builds)))}
        return ("**maybe not**: the seeds read different builds (" +
                ", ".join(f"s{s} {ids[builds[s]]}" for s in sorted(builds)) +
                f"); contents not recorded for seed {', '.join(map(str, missing))}")
    if not known:
        return "not recorded"
    distinct = sorted(set(known.values()))
    if len(distinct) == 1:
        text = f"yes (`{distinct[0][:8]}`)" if len(known) > 1 else f"one seed (`{distinct[0][:8]}`)"
    else:
        text = "**no**: " + ", ".join(f"s{s} `{f[:8]}`" for s, f in sorted(known.items()))
    return text + (f"; not recorded for seed {', '.join(map(str, missing))}" if missing else "")


def _selection_of(units: list[dict]) -> dict | None:
    """How the row's units selected their epoch (units without a ``selection`` record: from their train config)."""
    for u in units:
        if u.get("selection"):
            return {k: v for k, v in u["selection"].items() if k != "dev_fingerprint"}
    return None


def comparisons_seeds_only(plan: Plan, table: dict) -> list[dict]:
    """Each declared ``compare_with`` pair whose rows both have finished units: the seeds-only difference and call."""
    from .plan import compare_with

    out = []
    for row in plan.rows:
        a = table["rows"][row["name"]].get("sets") or {}
        for c in compare_with(row):
            calls = stats.seeds_only_calls(a, table["rows"][c["row"]].get("sets") or {})
            if calls:
                out.append({"row": row["name"], "against": c["row"], "why": c["why"], "sets": calls})
    return out


def verdicts(table: dict) -> dict:
    ref = table["rows"].get(table["reference"], {}).get("sets")
    if not ref:
        return {}
    return {name: stats.seeds_only_calls(entry["sets"], ref) for name, entry in table["rows"].items()
            if name != table["reference"] and entry.get("sets")}


def summarise(plan: Plan, *, share_sets: Sequence[str] = SHARE_SETS, statistics: bool = True,
              replicates_of=None) -> dict:
    """The table: per row its status, training size/time, mean ± std per set (and breakdowns), the seeds-only
    differences (``verdict``, ``comparisons``) and, with ``statistics``, the seed-row t intervals of every
    declared comparison (``statistics``). ``replicates_of``: a function of a plan path giving the plan it names in
    ``replicates:`` (the report then adds each row's difference from that table)."""
    states = unit_states(plan)
    stale = {(st["row"], st["seed"]) for st in states if st["state"] == "stale"}
    # a stale unit trained on rows its row no longer has: not a result of the row as it is (`run` trains it again)
    # only this plan's rows and seeds: a results folder shared with another plan (efficacy_seqz beside the headline
    # plan) holds units of other seeds, on other machines, that this report neither shows nor may name
    rows_of_plan = {row["name"] for row in plan.rows}
    units = {row: [u for u in us if (row, u["seed"]) not in stale and u["seed"] in plan.seeds]
             for row, us in load_units(plan).items() if row in rows_of_plan}
    table: dict[str, Any] = {"schema": TABLE_SCHEMA_V2, "plan": plan.raw, "reference": plan.reference,
                             "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                             "sets": plan.set_names, "rows": {},
                             "devices": sorted({u.get("device") or "not recorded" for us in units.values() for u in us}),
                             "device_units": device_units(plan, units)}
    for row in plan.rows:
        name = row["name"]
        us = [u for u in units.get(name, []) if u["seed"] in plan.seeds]
        st = [s for s in states if s["row"] == name]
        entry: dict[str, Any] = {"description": row.get("description", ""), "seeds_done": [u["seed"] for u in us],
                                 "seeds_planned": plan.seeds, "data": row["data"], "poe": row.get("poe"),
                                 "states": {s["seed"]: s["state"] for s in st},
                                 "seeds_stale": [s["seed"] for s in st if s["state"] == "stale"],
                                 "stale_reason": next((s["reason"] for s in st if s["state"] == "stale"), None),
                                 "pending_reason": next((s["reason"] for s in st if s["state"] == "pending"), None),
                                 "todo_note": next((s["reason"] for s in st if s["state"] == "todo" and s["reason"]), None)}
        if us:
            entry["train_rows"] = us[0]["train"]["rows"]
            entry["train_rows_by_seed"] = {u["seed"]: u["train"]["rows"] for u in us}
            # a release_dir row's own `command` (how its folder is built) over what its first unit recorded
            entry["data_command"] = row["data"].get("command") or _row_command(us)
            entry["config"] = us[0]["data"].get("config")
            entry["train_seconds"] = _mean_std([u["train"]["seconds"] for u in us])[0]
            entry["train_cpu_seconds"] = _mean_std([u["train"]["cpu_seconds"] for u in us])[0]
            entry["eval_seconds"] = _mean_std([u["evaluation"]["seconds"] for u in us])[0]
            entry["eval_examples_per_second"] = _mean_std([u["evaluation"]["examples_per_second"] for u in us])[0]
            entry["dev_accuracy_selection"] = _mean_std([u["train"]["dev_accuracy"] for u in us
                                                         if u["train"]["dev_accuracy"] is not None] or [math.nan])[0]
            entry["commits"] = sorted({c for u in us for c in (u["train"].get("commits") or [u["train"]["git"]])}
                                      | {c for u in us for c in u["evaluation"]["git"]})
            entry["sets"] = {}
            for s in plan.set_names:
                vals = [u["sets"][s]["accuracy"] for u in us if s in u["sets"]]
                if not vals:
                    continue
                m, sd = _mean_std(vals)
                entry["sets"][s] = {"mean": m, "std": sd, "n_seeds": len(vals), "runs": vals,
                                    "n": us[0]["sets"][s]["n"], "subsampled": us[0]["sets"][s]["subsampled"]}
                if us[0]["sets"][s].get("excluded_rows"):
                    entry["sets"][s]["excluded_rows"] = us[0]["sets"][s]["excluded_rows"]
            entry["breakdowns"] = _breakdowns(us)
            entry["data_fingerprints"] = {u["seed"]: u["data"].get("content_fingerprint") for u in us}
            entry["data_builds"] = {u["seed"]: build_of(u["data"]) for u in us}
            entry["subset_per_seed"] = per_unit_subset(row)
            entry["predicted_shares"] = _predicted_shares(us, share_sets)
            entry["predictions"] = {"seeds_with": [u["seed"] for u in us if u.get("predictions")],
                                    "seeds_without": [u["seed"] for u in us if not u.get("predictions")]}
            entry["selection"] = _selection_of(us)
            entry["data_revision"] = _data_revision(us)
        table["rows"][name] = entry
    table["verdict"] = verdicts(table)
    table["comparisons"] = comparisons_seeds_only(plan, table)
    if statistics:
        table["statistics"] = stats.compute(plan, units, table["rows"])
    if plan.raw.get("replicates"):  # relative to the plan's own file
        if replicates_of is None:
            from .plan import load_plan

            replicates_of = lambda path: load_plan(path, base=plan.base)  # noqa: E731
        other = Path(plan.raw["replicates"]).expanduser()
        table["replication"] = replication(plan, table, replicates_of(
            other if other.is_absolute() else (plan.path.resolve().parent / other).resolve()))
    return table


def _data_revision(units: list[dict]) -> dict | None:
    """What the row's models trained on, for the Hub's model-index: the release (folder, config, version, manifest
    sha256) or the files; from the first unit (the report says where the seeds read different builds)."""
    d = units[0]["data"]
    keep = ("kind", "release", "config", "release_version", "release_manifest_sha256", "built_at_commit", "files",
            "split", "of", "seed", "subset_seed_is_unit_seed", "base", "content_fingerprint")
    return {k: d[k] for k in keep if d.get(k) is not None}


def device_units(plan: Plan, units: dict) -> dict[str, dict[str, list[int]]]:
    """Which units ran where: device -> row -> seeds, over the plan's rows and seeds (a plan whose seeds ran on
    different machines, e.g. seeds 0-2 on a CPU and 3-4 on a lent GPU, says so in its report)."""
    out: dict[str, dict[str, list[int]]] = {}
    for row in plan.rows:
        for u in units.get(row["name"], []):
            if u["seed"] in plan.seeds:
                out.setdefault(u.get("device") or "not recorded", {}).setdefault(row["name"], []).append(u["seed"])
    return {d: {r: sorted(s) for r, s in rows.items()} for d, rows in sorted(out.items())}


def where_text(table: dict, threads) -> str | None:
    """Where the units ran, for the header; None where they all ran on one machine (the caller says which)."""
    placed = table.get("device_units") or {}
    if len(placed) < 2:
        return None
    parts = []
    for device, rows in placed.items():
        seed_lists = {tuple(s) for s in rows.values()}
        one = next(iter(seed_lists))
        what = (f"seed{'s' if len(one) > 1 else ''} {', '.join(map(str, one))} of every row" if len(seed_lists) == 1
                and len(rows) == sum(1 for e in table["rows"].values() if e.get("seeds_done"))
                else f"{sum(len(s) for s in rows.values())} units ({'; '.join(f'{r}: {s}' for r, s in rows.items())})")
        on = f"{threads} CPU threads ({device})" if device.startswith("CPU") else device
        parts.append(f"{what} on {on}")
    return "units on different machines: " + "; ".join(parts)


def replication(plan: Plan, table: dict, other: Plan) -> dict:
    """With ``replicates: other.yaml`` (a GPU plan naming the CPU one): per row finished in both tables, this
    table's mean minus the other's on each set, with the seeds-only call: does the other table replicate here?"""
    from ...utils.errors import ConfigError

    if other.results_dir == plan.results_dir:
        raise ConfigError(f"{plan.path}: replicates {plan.raw['replicates']!r}, which writes to the same results_dir")
    their_table = summarise(other, statistics=False)
    theirs = their_table["rows"]
    rows = {name: stats.seeds_only_calls(e["sets"], theirs[name]["sets"]) for name, e in table["rows"].items()
            if e.get("sets") and (theirs.get(name) or {}).get("sets")}
    calls = [c for r in rows.values() for c in r.values() if c["se"] is not None]
    return {"against": plan.show(other.path), "results": plan.show(other.results_dir), "rows": rows,
            "differences": len(calls), "called": sum(c["call"] in ("helps", "hurts") for c in calls),
            "devices": their_table["devices"]}


# ------------------------------------------------------------------------------------------ markdown

def _cell(v: dict | None) -> str:
    if not v:
        return "–"
    return f"{100 * v['mean']:.1f}" + (f" ± {100 * v['std']:.1f}" if v["std"] is not None else "") + \
        (f" ({v['n_seeds']})" if v["n_seeds"] < 3 else "")


def _call_line(label: str, calls: dict) -> str:
    """One seeds-only verdict line: where the first row helps, hurts or makes no clear change against the second."""
    helps = [s for s, c in calls.items() if c["call"] == "helps"]
    hurts = [s for s, c in calls.items() if c["call"] == "hurts"]
    same = [s for s, c in calls.items() if c["call"] == "no clear change"]
    if not (helps or hurts or same):
        return f"- {label}: one seed only, no call yet."
    fmt = lambda ss: ", ".join(f"{s} ({calls[s]['difference']:+.1f})" for s in ss)  # noqa: E731
    parts = [f"helps on {fmt(helps)}" if helps else "helps on no set"]
    if hurts:
        parts.append(f"hurts on {fmt(hurts)}")
    if same:
        parts.append(f"no clear change on {fmt(same)}")
    return f"- {label}: " + "; ".join(parts) + "."


def _interval_line(label: str, sets: dict) -> str:
    """One verdict line from the intervals: where the first row is higher or lower than the second, distinguishably
    from 0, and where the difference is not distinguishable from 0."""
    up = [s for s, e in sets.items() if e["distinguishable"] and e["estimate"] > 0]
    down = [s for s, e in sets.items() if e["distinguishable"] and e["estimate"] < 0]
    flat = [s for s, e in sets.items() if not e["distinguishable"]]
    fmt = lambda ss: ", ".join(f"{s} ({_interval(sets[s])})" for s in ss)  # noqa: E731
    parts = [f"higher on {fmt(up)}" if up else "higher on no set"]
    if down:
        parts.append(f"lower on {fmt(down)}")
    if flat:
        parts.append("not distinguishable from 0 on " + ", ".join(f"{s} ({sets[s]['estimate']:+.1f})" for s in flat))
    return f"- {label}: " + "; ".join(parts) + "."


def _stat_cell(e: dict | None) -> str:
    if e is None:
        return "–"
    if "unavailable" in e:
        return "no predictions"
    return e["text"]


def _stats_index(table: dict) -> dict[tuple[str, str], dict]:
    return {(c["row"], c["against"]): c for c in (table.get("statistics") or {}).get("comparisons", [])}


def _has_stats(comp: dict | None) -> bool:
    return bool(comp and comp["sets"] and all("unavailable" not in e for e in comp["sets"].values()))


def selection_text(plan: Plan, table: dict) -> str:
    """How the epoch was selected, for the report: held out and not scored, or a sample that is also scored."""
    sel = plan.select_on
    if sel and "set" in sel:
        scored = sel["set"] in table["sets"]
        return (f"the best epoch by accuracy on {sel['rows']:,} rows of `{sel['set']}` held out with seed "
                f"{sel.get('seed', 0)} (numpy's `default_rng(seed).permutation`)"
                + (f", which are not scored: `{sel['set']}` is scored without them" if scored else ""))
    if sel:
        return (f"the best epoch by accuracy on a seeded {sel['rows']:,}-row sample of "
                + ", ".join(f"`{f}`" for f in sel["files"]) + ", a file of its own (not scored)")
    from .units import legacy_selection

    legacy = legacy_selection(plan)
    if legacy is None:
        return "the last epoch (no selection rows)"
    rows = legacy["rows"]
    text = (f"the best epoch by accuracy on a seeded {rows or 'full'}-row sample of "
            + ("SNLI dev" if any("snli/dev" in f for f in legacy["files"]) else ", ".join(f"`{f}`" for f in legacy["files"])))
    if legacy["also_scored_in"]:
        text += (" (**not held out**: those rows are also among the rows scored as "
                 + ", ".join(f"`{s}`" for s in legacy["also_scored_in"])
                 + "; a plan's `select_on:` holds them out and scores the set without them)")
    return text


def _interval(e: dict) -> str:
    """The interval that matches the entry's call: for a primary test the adjusted one, else the plain one."""
    low, high = ((e["adjusted_low"], e["adjusted_high"]) if e.get("adjusted_low") is not None else (e["low"], e["high"]))
    return f"{e['estimate']:+.1f} [{low:+.1f}, {high:+.1f}]"


def _rows_cell(e: dict) -> str:
    return f"{e['rows']:,}" + (f" in {e['clusters']} {e['cluster_column']}s" if e.get("clusters") else "")


def _method_md(st: dict) -> list[str]:
    """How the intervals were computed, in words, with what the data's structure changed (machines, clusters)."""
    level = 100 * st["level"]
    L = [f"Row A minus row B, accuracy points, from the units' stored per-row predictions, with a {level:.0f}% "
         f"**seed-row t interval** (`debiased_nli.evaluation.significance.seed_row_interval`): the seeds are the unit of "
         f"replication (the unbiased variance of each side's seed accuracies), the test rows add their paired "
         f"variance (the variance over rows of the difference, less the seed-by-row noise already in the seeds' "
         f"term), and the t quantile has Welch-Satterthwaite degrees of freedom. It is in closed form: **no Monte "
         f"Carlo error** (MC standard error of every p-value: 0) and no resampling seed; the same units give the "
         f"same figures on every run (`docs/efficacy.md` has its coverage simulated at 3, 5 and 10 seeds, beside "
         f"that of the nested bootstrap it replaces)."]
    machines = Counter(e.get("machines") for c in st["comparisons"] for e in c["sets"].values() if "machines" in e)
    stratified = sum(v for k, v in machines.items() if k and k.startswith("stratified"))
    if stratified:
        L[-1] += (f" **Machines:** {stratified} of the {sum(machines.values())} differences have seeds on more than "
                  f"one machine with the same number of each side's seeds on each; their seed variance is pooled "
                  f"within machines (k - M degrees of freedom): the machine mix is a fixed part of the design, and "
                  f"the difference is the one on this mix.")
    for k in machines:
        if k and k.startswith("not stratified"):
            L[-1] += f" {machines[k]} difference(s) {k}."
    for s, cl in (st.get("clusters") or {}).items():
        if cl.get("groups"):
            L[-1] += (f" **Clusters:** `{s}`'s rows are {cl['groups']} clusters (`{cl['column']}`, {cl['source']}), "
                      f"not independent rows: its rows' variance is taken between clusters.")
        else:
            L[-1] += f" **`{s}`**: {cl['note']}."
    if st.get("ignored"):
        L[-1] += (f" The plan's `bootstrap:` settings {st['ignored']['bootstrap']} are not used (no resampling); "
                  f"`statistics: {{level: ...}}` sets the level.")
    return L


def _statistics_md(plan: Plan, table: dict, intervals_figure: str | None = None) -> list[str]:
    st = table.get("statistics")
    if not st or not st["comparisons"]:
        return []
    sets = table["sets"]
    have = [c for c in st["comparisons"] if any("unavailable" not in e for e in c["sets"].values())]
    lacking = [r for r, cov in st["coverage"].items() if cov["without"]]
    level = 100 * st["level"]
    L = ["", f"## Differences with {level:.0f}% intervals", ""]
    if intervals_figure:
        L += [f"![differences with {level:.0f}% intervals]({intervals_figure})", ""]
    corr = stats.CORRECTION_NAMES.get(st["correction"] or plan.correction, plan.correction)
    L += _method_md(st) + [""]
    primary = [(c, s, e) for c in st["comparisons"] for s, e in c["sets"].items() if e["family"] == "primary"]
    if primary:
        L += [f"**Primary comparisons** (named in the plan before the run): {st['primary_tests']} tests (comparison × "
              f"set), corrected with {corr}. Each call is shown with the interval that matches it: "
              f"{st['family_intervals']}. A primary difference is *distinguishable from 0* exactly when that interval "
              f"excludes 0; the {level:.0f}% interval beside it is uncorrected."
              + (f" {st['primary_tests_unavailable']} primary test(s) could not be computed (no stored predictions, or "
                 f"one seed) and are not in the correction's family." if st["primary_tests_unavailable"] else "")
              + (f" {st['primary_tests_pending']} more primary test(s) of the plan wait for rows with no finished "
                 f"unit; until then they count as p = 1 in the correction (its family is the plan's "
                 f"{st['primary_tests'] + st['primary_tests_pending']}), so an adjusted p can only fall when they "
                 f"arrive." if st.get("primary_tests_pending") else ""), "",
              f"| A − B | set | difference [adjusted interval] (the call) | adjusted level | {level:.0f}% interval | p "
              f"| adjusted p | df | seeds' share of the variance | seeds A / B | rows |",
              "|---|---|---|---:|---|---:|---:|---:|---:|---|---:|"]
        for c, s, e in primary:
            if "unavailable" in e:
                L.append(f"| `{c['row']}` − `{c['against']}` | {s} | not computed: {e['unavailable']} | – | – | – | – | "
                         f"– | – | – | – |")
                continue
            share = (e.get("components") or {}).get("seed_share")
            L.append(f"| `{c['row']}` − `{c['against']}` | {s} | {e['text']} | {100 * e['adjusted_level']:.2f}% | "
                     f"[{e['low']:+.1f}, {e['high']:+.1f}] | {e['p_value']:.4f} | {e['p_adjusted']:.4f} | "
                     f"{e['df']:.1f} | {'–' if share is None else f'{100 * share:.0f}%'} | {e['seeds_a']} / "
                     f"{e['seeds_b']} | {_rows_cell(e)} |")
        L.append("")
    elif st.get("primary_tests_pending"):
        L += [f"**Primary comparisons** (named in the plan before the run): all {st['primary_tests_pending']} tests "
              f"wait for rows with no finished unit.", ""]
    else:
        L += ["**No primary comparisons** are named in the plan (`primary:`), so no correction for multiple "
              "comparisons is made" + (f": every interval below is a single-comparison {level:.0f}% interval." if have
                                       else ". No comparison has stored predictions on both sides yet."), ""]
    secondary = [c for c in have if any(e["family"] == "secondary" and "unavailable" not in e for e in c["sets"].values())]
    if secondary:
        L += [f"**Secondary comparisons** (every other declared one: each row against the reference and the rows' "
              f"`compare_with`), **uncorrected** {level:.0f}% intervals: read them as descriptions, not as tests.", "",
              "| A − B | why | " + " | ".join(sets) + " |", "|---|---|" + "---|" * len(sets)]
        for c in secondary:
            cells = [_stat_cell(c["sets"].get(s)) if (c["sets"].get(s) or {}).get("family") == "secondary" else
                     ("primary" if s in c["sets"] else "–") for s in sets]
            L.append(f"| `{c['row']}` − `{c['against']}` | {c['why'] or '–'} | " + " | ".join(cells) + " |")
        L.append("")
    if lacking:
        cov = st["coverage"]
        L += ["**Without stored predictions** (units run before per-row predictions were kept): "
              + ", ".join(f"`{r}` (seed{'s' if len(cov[r]['without']) > 1 else ''} "
                          f"{', '.join(map(str, cov[r]['without']))})" for r in lacking)
              + ". A comparison with one of them has no interval; it is shown in the seeds-only view below, "
                "clearly labelled." + (" Where a row has both kinds of units, its intervals use only the seeds "
                                       "with predictions (columns *seeds A / B*)." if any(cov[r]["with"] for r in lacking)
                                       else "")]
    while L and L[-1] == "":
        L.pop()
    return L


def write_markdown(table: dict, plan: Plan, path: Path, figure: str | None, *, title: str | None = None,
                   commands: Sequence[str] | None = None, share_sets: Sequence[str] = SHARE_SETS,
                   times_note: str | None = None, intervals_figure: str | None = None,
                   stem: Path | None = None) -> None:
    """The report's markdown: what was run, the accuracy table, the statistics, the seeds-only view, the
    verdict, the breakdowns, predicted-label shares, and each row's data, cost and status. ``title``: the
    heading (default: the plan's ``title``); ``commands``: the commands shown where the plan gives none (its
    ``commands``); the plan's ``intro`` is the opening paragraph. ``stem``: the report's (``path`` may be the
    temporary name it is written under)."""
    gpus = [d for d in table.get("devices", []) if not d.startswith("CPU") and d != "not recorded"]
    L = _header_md(table, plan, title=title, commands=commands, gpus=gpus)
    speed_file = (stem or path.with_suffix("")).with_name(f"{(stem or path.with_suffix('')).name}_speed.json")
    if speed_file.exists():
        L += _speed_md(json.loads(speed_file.read_text()))
    if figure:
        L += [f"![efficacy]({figure})", ""]
    L += _accuracy_md(table)
    L += _statistics_md(plan, table, intervals_figure)
    L += _seeds_only_md(table)
    L += ["", "## Verdict (from finished units only)", "", verdict_paragraph(table), ""]
    L += _breakdowns_md(table)
    L += _shares_md(table, share_sets)
    L += _rows_md(table)
    mixed = len(table.get("device_units") or {}) > 1
    L += ["", ("Times are wall-clock on the machine each unit ran on (the header says which ran where), shared by "
               "the units that ran at once there (CPU seconds beside them)" if mixed else
               (f"Times are wall-clock on {', '.join(gpus)}, shared by the units that ran at once (CPU seconds "
                "beside them)") if gpus else
               times_note or "Times are wall-clock on a machine that may be shared with other work (CPU seconds "
               "beside them)")
          + "; the exact `debiased-nli train` / `evaluate` commands of each unit are in its result file.", ""]
    path.write_text("\n".join(L))


def _header_md(table: dict, plan: Plan, *, title, commands, gpus: list[str]) -> list[str]:
    """Title, what was run and with which commands, the model, the training and the evaluation."""

    from .units import eval_config

    sets = table["sets"]
    e = plan.evaluate
    cfg = eval_config(plan, progress=False)  # the values the units ran with, defaults included (never "None")
    sample = (f"a seeded sample of at most {e['max_examples']:,} rows of each set" if e.get("max_examples")
              else "every challenge set **in full** (no samples)")
    L = [f"# {title or plan.raw.get('title') or 'Does training on it help? ' + plan.show(plan.path)}", "",
         plan.raw.get("intro") or
         (f"Does training on a debiased release make a model more robust? {plan.model_name}, the same settings for every "
          f"row, scored on {sample}. Accuracy (%), mean ± sample std over the finished seeds (a number in brackets: "
          f"fewer than 3 seeds finished)."), "",
         f"Commands (resumable; one result file per (row, seed) in `{plan.show(plan.results_dir)}/`):", "", "```"]
    L += list(plan.raw.get("commands") or commands or [
        f"debiased-nli compare status {plan.show(plan.path)}",
        f"debiased-nli compare run {plan.show(plan.path)}",
        f"debiased-nli compare report {plan.show(plan.path)}"])
    L += ["```", ""]
    if plan.raw.get("note"):
        L += [" ".join(str(plan.raw["note"]).split()), ""]
    t = plan.train
    where = where_text(table, t.get("threads")) or (f"on {', '.join(gpus)}" if gpus else f"{t.get('threads')} CPU threads")
    n_labels = len(plan.spec.labels)
    L += [f"- Model: `{Path(plan.model).name}` (a fresh {n_labels}-way head). Training: lr {t['learning_rate']}, batch "
          f"{t['batch_size']}, max length {t['max_length']}, {t['epochs']} epochs, {int(100 * t.get('warmup_ratio', 0.1))}% linear "
          f"warm-up, {selection_text(plan, table)}, {where}; seeds {', '.join(map(str, plan.seeds))}.",
          f"- Evaluation: {len(sets)} sets{' in full' if not e.get('max_examples') else ''}, max length "
          f"{cfg.max_length}, batches by token length (at most {cfg.batch_size} rows"
          + (f" and {cfg.max_tokens} padded tokens" if cfg.max_tokens else "")
          + " per batch, padded to the batch's longest row; the batching changes no probability by more than 3e-8)"
          + (f", forward passes in {e['dtype']} autocast" if e.get("dtype", "float32") != "float32" else "")
          + (", HANS scored 2-way (neutral and contradiction -> non-entailment)" if "hans" in sets else "")
          + (", MNLI zero-shot from SNLI" if plan.task == "snli" and any(s.startswith("mnli") for s in sets) else "")
          + ".", ""]
    stale = {n: en for n, en in table["rows"].items() if en.get("seeds_stale")}
    if stale:
        L += ["**Stale units, left out of every figure below**: "
              + "; ".join(f"`{n}` seed{'s' if len(en['seeds_stale']) > 1 else ''} "
                          f"{', '.join(map(str, en['seeds_stale']))} ({en['stale_reason']})" for n, en in stale.items())
              + f". `debiased-nli compare run {plan.show(plan.path)}` trains them again.", ""]
    return L


def _accuracy_md(table: dict) -> list[str]:
    """Each row's accuracy on each set, and which sets were scored without the epoch-selection rows."""
    sets = table["sets"]
    L = ["## Accuracy by set", "", "| row | train rows | " + " | ".join(sets) + " |",
         "|---|---:|" + "---:|" * len(sets)]
    for name, entry in table["rows"].items():
        if entry.get("sets"):
            L.append(f"| `{name}` | {train_rows_text(entry)} | " + " | ".join(_cell(entry["sets"].get(s)) for s in sets) + " |")
        else:
            L.append(f"| `{name}` | {'pending' if entry['pending_reason'] else 'not run yet'} | "
                     + " | ".join("–" for _ in sets) + " |")
    excluded = {s: v["excluded_rows"] for entry in table["rows"].values() for s, v in (entry.get("sets") or {}).items()
                if v.get("excluded_rows")}
    if excluded:
        L += ["", "Scored without the rows the epoch was selected on: " + ", ".join(
            f"`{s}` ({n:,} rows left out)" for s, n in excluded.items()) + "."]
    return L


def _seeds_only_md(table: dict) -> list[str]:
    """The comparisons without stored predictions on both sides, by the seeds-only rule, and the replication."""
    sets = table["sets"]
    ref = table["rows"].get(table["reference"], {})
    index = _stats_index(table)
    ref_name = table["reference"]
    seeds_only_ref = {n: c for n, c in table["verdict"].items() if not _has_stats(index.get((n, ref_name)))}
    seeds_only_other = [c for c in table.get("comparisons", []) if not _has_stats(index.get((c["row"], c["against"])))]
    L: list[str] = []
    if ref.get("sets") and seeds_only_ref:
        L += ["", f"### Seeds-only view: difference from `{ref_name}` (points; {SEEDS_ONLY_RULE})", "",
              "| row | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
        for name, calls in seeds_only_ref.items():
            L.append(f"| `{name}` | " + difference_cells(calls, sets) + " |")
    if seeds_only_other:
        L += ["", f"### Seeds-only view: other comparisons (first row minus second, points; {SEEDS_ONLY_RULE})", "",
              "| rows | why | " + " | ".join(sets) + " |", "|---|---|" + "---:|" * len(sets)]
        for comp in seeds_only_other:
            L.append(f"| `{comp['row']}` − `{comp['against']}` | {comp['why'] or '–'} | "
                     + difference_cells(comp["sets"], sets) + " |")
    rep = table.get("replication")
    if rep and rep["rows"]:
        L += ["", f"### Against `{rep['results']}.md` ({rep['against']}: the same rows, model, recipe and sets; "
                  f"this table minus that one, points; seeds-only view, {SEEDS_ONLY_RULE})", "",
              f"{rep['called']} of the {rep['differences']} differences with at least two seeds on both sides are called.",
              "", "| row | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
        for name, calls in rep["rows"].items():
            L.append(f"| `{name}` | " + difference_cells(calls, sets) + " |")
    return L


def _breakdowns_md(table: dict) -> list[str]:
    L = ["## Breakdowns", ""]
    keys = sorted({k for entry in table["rows"].values() for k in (entry.get("breakdowns") or {})})
    for key in keys:
        groups = sorted({g for entry in table["rows"].values() for g in (entry.get("breakdowns") or {}).get(key, {})})
        L += [f"### {key}", "", "| row | " + " | ".join(groups) + " |", "|---|" + "---:|" * len(groups)]
        for name, entry in table["rows"].items():
            b = (entry.get("breakdowns") or {}).get(key)
            if b:
                L.append(f"| `{name}` | " + " | ".join(_cell(b.get(g)) for g in groups) + " |")
        L.append("")
    return L


def _shares_md(table: dict, share_sets: Sequence[str]) -> list[str]:
    """How often each row's models predict each label on the share sets, beside the gold shares."""
    shares = {n: entry["predicted_shares"] for n, entry in table["rows"].items() if entry.get("predicted_shares")}
    if not shares:
        return []
    cols = [(s, lab) for s in share_sets for lab in next((v[s]["gold"] for v in shares.values() if s in v), {})]
    L = ["### Predicted labels (% of each set's rows; mean over the seeds that recorded a confusion matrix, "
         "their number in brackets)", "",
         "| row | " + " | ".join(f"{s}: {lab}" for s, lab in cols) + " |", "|---|" + "---:|" * len(cols)]
    gold = {s: v[s]["gold"] for v in shares.values() for s in v}
    L.append("| *gold* | " + " | ".join(f"{100 * gold[s][lab]:.1f}" if s in gold else "–" for s, lab in cols) + " |")
    for name, v in shares.items():
        L.append(f"| `{name}` | " + " | ".join(f"{100 * v[s]['predicted'][lab]:.1f} ({v[s]['n_seeds']})" if s in v
                                              else "–" for s, lab in cols) + " |")
    L.append("")
    return L


def _rows_md(table: dict) -> list[str]:
    """Each row's status, size, cost and commits, and how its data was built."""
    L = ["## Rows: data, size, cost, status", "",
         "| row | status | train rows | same rows in every seed | train wall / CPU s (mean) | eval wall s (mean) | eval ex/s | dev acc. (selection sample) | commits |",
         "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for name, entry in table["rows"].items():
        done = len(entry["seeds_done"])
        status = (f"{done}/{len(entry['seeds_planned'])} seeds" + ("; pending" if entry["pending_reason"] else "")
                  + (f"; **stale**: seed {', '.join(map(str, entry['seeds_stale']))} left out"
                     if entry.get("seeds_stale") else ""))
        if entry.get("sets"):
            L.append(f"| `{name}` | {status} | {train_rows_text(entry)} | "
                     f"{same_rows(entry.get('data_fingerprints') or {}, entry.get('subset_per_seed', False), entry.get('train_rows_by_seed'), entry.get('data_builds'))} | "
                     f"{entry['train_seconds']:.0f} / {entry['train_cpu_seconds']:.0f} | "
                     f"{entry['eval_seconds']:.0f} | {entry['eval_examples_per_second']:.0f} | {100 * entry['dev_accuracy_selection']:.1f} | "
                     + ", ".join(f"`{c[:10]}{'-dirty' if c.endswith('-dirty') else ''}`" for c in entry["commits"]) + " |")
        else:
            L.append(f"| `{name}` | {status} | – | – | – | – | – | – | – |")
    L += ["", "How each row's data was built:", ""]
    for name, entry in table["rows"].items():
        if entry.get("data_command"):
            how = f"`{entry['data_command']}`"
        elif entry["pending_reason"]:
            how = f"**pending**: {entry['pending_reason']}"
        else:
            how = "not run yet" + (f" ({entry['todo_note']})" if entry.get("todo_note") else "")
        L.append(f"- `{name}` ({entry['description']}): {how}")
    return L


def _speed_md(sp: dict) -> list[str]:
    L = [f"Evaluation speed (the efficacy plan's speed measurement: the same {sp['rows']:,} rows, "
         f"{next(iter(sp['rows_per_set'].values()))} per set, {sp['threads']} threads, one model"
         + (f" (`{sp['model']}`)" if sp.get("model") else "") + "; ratios, probability differences and "
         "argmax agreement against the first row, measured in the same run on the shared machine):", "",
         "| rows per batch | padded tokens per batch | dtype | examples/s | ratio | max prob. diff. | same argmax |",
         "|---:|---:|---|---:|---:|---:|---:|"]
    L += [f"| {r['batch_size']} | {r['max_tokens'] or '–'} | {r.get('dtype', 'float32')} | {r['examples_per_second']} | "
          f"{r['ratio_vs_first']} | {r['max_abs_prob_diff_vs_first']:.1e} | "
          + (f"{100 * r['same_argmax_vs_first']:.2f}%" if "same_argmax_vs_first" in r else "–") + " |"
          for r in sp["runs"]]
    cpu = sp.get("cpu")
    L += ["", (f"CPU: {cpu['model']}, torch CPU capability {cpu['torch_cpu_capability']}, native bfloat16 "
               f"(avx512_bf16 / amx_bf16): {'yes' if cpu['native_bfloat16'] else 'no'}." if cpu else
               "The CPU's flags were not recorded with this measurement.")
          + " bfloat16 autocast is faster only on CPUs with avx512_bf16 or amx_bf16; elsewhere torch emulates it "
            "and it is several times slower (the project's dtype measurement, documentation page PDD).", ""]
    return L


def verdict_paragraph(table: dict) -> str:
    ref = table["reference"]
    finished = [n for n, e in table["rows"].items() if e.get("sets")]
    index = _stats_index(table)
    lines, seeds_only_used, intervals_used = [], False, False
    pairs = [(name, ref, "", calls) for name, calls in table["verdict"].items()]
    pairs += [(c["row"], c["against"], c["why"], c["sets"]) for c in table.get("comparisons", [])]
    for a, b, why, calls in pairs:
        label = f"**{a}** vs {b}" + (f" ({why})" if why else "")
        comp = index.get((a, b))
        if _has_stats(comp):
            lines.append(_interval_line(label, comp["sets"]))
            intervals_used = True
        else:
            lines.append(_call_line(label + (" — seeds only, no stored predictions" if comp is not None else ""), calls))
            seeds_only_used = True
    pending = [f"`{n}`" for n, e in table["rows"].items() if not e.get("sets") and e["pending_reason"]]
    todo = [f"`{n}`" for n, e in table["rows"].items() if not e.get("sets") and not e["pending_reason"]]
    head = f"Finished rows: {', '.join(f'`{n}`' for n in finished) or 'none'}."
    if intervals_used:
        st = table["statistics"]
        head += (f" With stored predictions, a row is *higher* or *lower* on a set when the interval of its difference "
                 f"excludes 0: for a primary comparison the {st['correction'] or 'corrected'}-adjusted interval, which "
                 f"excludes 0 exactly when the adjusted p-value is under {1 - st['level']:.2f}; for the others the "
                 f"{100 * st['level']:.0f}% interval, uncorrected (seed-row t intervals); differences in points, "
                 f"intervals in brackets.")
    if seeds_only_used:
        head += (f" {'Without stored predictions (seeds-only view), a' if intervals_used else 'A'} method *helps* (or "
                 f"*hurts*) on a set when its mean differs from `{ref}`'s by more than twice the standard error of the "
                 f"difference and at least one point; differences in points.")
    tail = " ".join(([f"Not run yet: {', '.join(todo)}."] if todo else [])
                    + ([f"Pending (their data does not exist yet; reasons below): {', '.join(pending)}."] if pending else []))
    return "\n".join([head, ""] + lines + ([""] + [tail] if tail else []))


# ------------------------------------------------------------------------------------------ plot

def intervals_path(stem: Path) -> Path:
    """Where a report written to ``stem`` (.md / .json / .png) puts its forest of intervals."""
    return stem.with_name(stem.name + "_intervals.png")


def plot_intervals(table: dict, path: Path) -> Path | None:
    """The declared comparisons as a forest: one panel per comparison (primary ones first), a line per set with
    the difference and the interval that matches its call: a primary test's adjusted interval (thick) beside its
    uncorrected one (thin), a secondary comparison's uncorrected interval. Filled: distinguishable from 0; hollow:
    not. None where no comparison has an interval (no stored predictions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = table.get("statistics") or {}
    comps = [c for c in st.get("comparisons", []) if any("low" in e for e in c["sets"].values())]
    if not comps:
        return None
    comps.sort(key=lambda c: not c.get("primary"))
    ncol = min(3, len(comps))
    nrow = math.ceil(len(comps) / ncol)
    sets = [s for s in table["sets"] if any("low" in c["sets"].get(s, {}) for c in comps)]
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.4 * ncol, 0.32 * len(sets) * nrow + 1.2 * nrow),
                             squeeze=False, sharey=True)
    for k, c in enumerate(comps):
        ax = axes[k // ncol][k % ncol]
        for y, s in enumerate(sets):
            e = c["sets"].get(s, {})
            if "low" not in e:
                continue
            primary = e.get("family") == "primary"
            color = "tab:red" if primary else "tab:blue"
            if e.get("adjusted_low") is not None:
                ax.plot([e["adjusted_low"], e["adjusted_high"]], [y, y], color=color, lw=2.8, alpha=0.45)
            ax.plot([e["low"], e["high"]], [y, y], color=color, lw=1.2)
            ax.plot([e["estimate"]], [y], "o", ms=5, color=color,
                    mfc=color if e.get("distinguishable") else "white")
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(range(len(sets)), sets, fontsize=7)
        if k == 0:  # the panels share the y axis: inverting each would flip it back and forth
            ax.invert_yaxis()
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"{c['row']} − {c['against']}" + (" (primary)" if c.get("primary") else ""), fontsize=8)
    level = 100 * st.get("level", 0.95)
    return _save_panels(fig, axes, len(comps), path, fontsize=9,
                        title=f"difference in accuracy points, {level:.0f}% seed-row t interval (thin); red: a primary "
                              f"test with its {st.get('correction') or 'corrected'}-adjusted interval (thick), blue: "
                              f"secondary (uncorrected); filled: distinguishable from 0")


def _save_panels(fig, axes, used: int, path: Path, *, title: str, fontsize: int) -> Path:
    """Blank the grid's unused panels, title the figure, write it and close it."""
    import matplotlib.pyplot as plt

    ncol = len(axes[0])
    for k in range(used, len(axes) * ncol):
        axes[k // ncol][k % ncol].axis("off")
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(table: dict, path: Path) -> Path | None:
    """Methods x sets: one panel per set, a bar per finished row (mean ± std), the reference as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [n for n, e in table["rows"].items() if e.get("sets")]
    if not rows:
        return None
    sets = table["sets"]
    ncol = min(4, len(sets))
    nrow = math.ceil(len(sets) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.8 * nrow), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ref = table["rows"].get(table["reference"], {}).get("sets", {})
    for k, s in enumerate(sets):
        ax = axes[k // ncol][k % ncol]
        x = np.arange(len(rows))
        means = [100 * table["rows"][r]["sets"].get(s, {}).get("mean", np.nan) for r in rows]
        stds = [table["rows"][r]["sets"].get(s, {}).get("std") for r in rows]
        errs = [100 * (v or 0.0) for v in stds]
        # no error bar where a row has one seed: a zero-height cap would read as "no variance"
        ax.bar(x, means, yerr=np.where([v is None for v in stds], np.nan, errs), capsize=2,
               color=[colors[i % len(colors)] for i in range(len(rows))])
        if s in ref:
            ax.axhline(100 * ref[s]["mean"], color="black", ls="--", lw=1)
        ax.set_title(s, fontsize=9)
        seeds = [table["rows"][r]["sets"].get(s, {}).get("n_seeds", 0) for r in rows]
        ax.set_xticks(x, [f"{r} ({n})" for r, n in zip(rows, seeds)], rotation=45, ha="right", fontsize=7)
        lo = np.nanmin(np.asarray(means) - np.asarray(errs))
        hi = np.nanmax(np.asarray(means) + np.asarray(errs))
        ax.set_ylim(max(0, lo - 5), min(100, hi + 5))
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    return _save_panels(fig, axes, len(sets), path, fontsize=10,
                        title=f"accuracy (%), mean ± std over seeds (seeds finished in brackets; no bar with one "
                              f"seed); dashed: {table['reference']}")


def report(plan: Plan, out_stem: Path | None = None, *, replicates_of=None, **markdown_options) -> dict:
    """Write ``<stem>.md``, ``<stem>.json`` and ``<stem>.png`` (default stem: the results folder's path) and
    return the table. ``replicates_of``: see :func:`summarise`."""
    stem = out_stem or plan.results_dir.parent / plan.results_dir.name
    # the folder and the files first: the bootstrap before the writing can take minutes
    stem.parent.mkdir(parents=True, exist_ok=True)
    outputs = report_outputs(stem, intervals_path(stem))  # never a file this tool did not write
    share_sets = markdown_options.get("share_sets", SHARE_SETS)
    table = summarise(plan, share_sets=share_sets, replicates_of=replicates_of)
    with outputs:  # each file under a temporary name, renamed into place once all are written
        fig = plot(table, outputs.temp(stem.with_suffix(".png")))
        forest = plot_intervals(table, outputs.temp(intervals_path(stem)))
        write_json_atomic(outputs.temp(stem.with_suffix(".json")), table)
        write_markdown(table, plan, outputs.temp(stem.with_suffix(".md")),
                       stem.with_suffix(".png").name if fig else None,
                       intervals_figure=intervals_path(stem).name if forest else None, stem=stem,
                       **markdown_options)
    return table
