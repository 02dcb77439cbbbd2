"""Quality reports of a release's generated rows in its card and manifest (issue 45, item 1).

``debiased-nli quality`` measures a set of generated rows against real ones (copies, near-duplicates, fluency,
a cross-fitted ensemble's label agreement, train-on-generated; :mod:`debiased_nli.methods.quality`) and writes
``quality.json``. ``build --quality FILE ...`` puts each report into the card of the release whose rows it
measured, so a reader sees the quality of ``seq_z`` beside its size without opening a Parquet file. A report is
matched to a set of the release by its rows' fingerprint (the sorted rows' sha256,
:func:`~debiased_nli.methods.quality.set_fingerprint`): the new rows D_G, or the generated rows of one config;
a report of other rows, or measured against another D0, is refused with the fingerprints side by side.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..utils.errors import ConfigError


def load_reports(paths: Sequence[str]) -> list[tuple[str, dict, str]]:
    """(file name, report, sha256) of each ``quality.json`` (a folder: its ``quality.json``), read with the JSON
    bounds and checked to be a report of this tool."""
    from ..utils.outputs import TOOL, WRITTEN_BY_KEY
    from ..utils.paths import read_json
    from ..utils.provenance import file_sha256

    out = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            path = path / "quality.json"
        report = read_json(path, "quality report", kind=dict)
        if report.get(WRITTEN_BY_KEY) != TOOL:
            raise ConfigError(f"--quality {raw}: not a report of `debiased-nli quality` (no {WRITTEN_BY_KEY!r} mark)")
        if "rows_fingerprint" not in report:
            raise ConfigError(f"--quality {raw}: the report has no rows_fingerprint (written by an older "
                              f"`debiased-nli quality`); run it again on the same rows")
        out.append((path.name if path.name != "quality.json" else f"{path.parent.name}/quality.json", report,
                    file_sha256(path)))
    return out


def match_reports(reports, d0, dg, configs) -> list[dict]:
    """Each report with the set of this release it measured: ``new rows`` (D_G) or ``<config>: generated rows``."""
    from ..methods.quality import set_fingerprint

    if not reports:
        return []
    d0_fp = set_fingerprint(d0)
    sets: dict[str, str] = {}
    if dg is not None and len(dg):
        sets[set_fingerprint(dg)] = "new rows (D_G, as composed)"
    for c in configs:
        train = c.splits.get("train")
        if train is None or "origin" not in train.column_names:
            continue
        gen = train.filter(lambda b: [o != "original" for o in b["origin"]], batched=True)
        if len(gen):
            sets.setdefault(set_fingerprint(gen), f"{c.name}: its generated rows")
    matched = []
    for name, report, sha in reports:
        if report.get("reference_fingerprint") != d0_fp:
            raise ConfigError(f"--quality {name}: measured against a D0 with fingerprint "
                              f"{report.get('reference_fingerprint')}, not this release's D0 ({d0_fp}); "
                              f"run `debiased-nli quality` with --reference the D0 of this build")
        fp = report["rows_fingerprint"]
        if fp not in sets:
            raise ConfigError(f"--quality {name}: its {report.get('rows', '?'):,} rows (fingerprint {fp}) are none of "
                              f"this release's sets of generated rows: "
                              + "; ".join(f"{v} ({k})" for k, v in sets.items()))
        matched.append({"file": name, "sha256": sha, "set": sets[fp], "report": report})
    return matched


def manifest_entries(matched: list[dict]) -> list[dict]:
    """What the manifest records of each report: its file, sha256, the set and the headline figures."""
    out = []
    for m in matched:
        r = m["report"]
        entry: dict[str, Any] = {"file": m["file"], "sha256": m["sha256"], "set": m["set"], "rows": r.get("rows"),
                                 "rows_fingerprint": r["rows_fingerprint"],
                                 "pair_copy_share": r.get("copies", {}).get("pair_copy_share"),
                                 "near_duplicate_share": r.get("near_duplicates", {}).get("near_duplicate_share")}
        if r.get("fluency"):
            entry["fluency_under_bound_share"] = r["fluency"].get("under_bound_share")
            entry["fluency_real_under_bound_share"] = r["fluency"].get("real_under_bound_share")
        if r.get("agreement"):
            entry["ensemble_agreement"] = r["agreement"].get("agreement")
            entry["ensemble_agreement_real"] = r["agreement"].get("d0_agreement_cross_fitted")
        if r.get("train_on_generated"):
            entry["train_on_generated_ratio"] = r["train_on_generated"].get("ratio")
        out.append(entry)
    return out


def card_markdown(matched: list[dict]) -> str:
    """The card's section: each report's tables and examples under a heading naming the set it measured."""
    from ..methods.quality import render_report

    parts = ["Measured with `debiased-nli quality` against real rows of the task (copies and near-duplicates of "
             "D0, fluency under a base language model with real rows' 5th percentile as the bound, the labels "
             "against a cross-fitted classifier ensemble, a classifier trained on the generated rows against one "
             "trained on as many real rows; every bound is the project's choice). The reports' files and sha256 "
             "are in `manifest.json` under `quality`."]
    for m in matched:
        body = render_report(m["report"]).splitlines()
        body = [("##" + line if line.startswith("## ") else line) for line in body[1:]]  # the title: ours below
        parts += ["", f"### {m['set']}", *body]
    return "\n".join(parts).rstrip() + "\n"
