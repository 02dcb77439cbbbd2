"""A release card's link to its rows of an efficacy table (``debiased-nli compare report``).

``debiased-nli build ... --efficacy results/compare.json`` puts, for every config of the release that has a
row in the table, the measured accuracies (mean ± std over seeds) and their difference from the table's
reference row (the model trained on the original data) into the card, so a user sees what training on a
config costs or gains before picking it. Two formats are read: v2 (``compare report``), whose comparisons
carry intervals where the units stored their predictions (seed-row t intervals; reports written before issue 46:
nested paired-bootstrap intervals, which the card names as such), and v1 (reports written before that), whose
comparisons are the seeds-only calls (``*``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..utils.errors import ConfigError

TABLE_SCHEMA = "debiased-nli/efficacy-table/v1"
TABLE_SCHEMA_V2 = "debiased-nli/efficacy-table/v2"  # + statistics (intervals), unrounded differences
TABLE_SCHEMAS = (TABLE_SCHEMA, TABLE_SCHEMA_V2)


def load_table(path: "str | Path") -> dict:
    """The efficacy table at ``path``; anything else (missing, not a regular file, not UTF-8, not JSON,
    JSON that is not the table) is a one-line :class:`ConfigError`."""
    from ..utils.errors import excerpt
    from ..utils.paths import read_json

    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise ConfigError(f"efficacy table {p} does not exist; give the JSON that `debiased-nli compare report` "
                          f"writes")
    table = read_json(p, "efficacy table")  # a regular UTF-8 file, JSON, not nested without end
    if not isinstance(table, dict):
        raise ConfigError(f"{p} is not an efficacy table (a JSON {type(table).__name__}: {excerpt(table, 60)}; "
                          f"expected a mapping with schema one of {list(TABLE_SCHEMAS)})")
    if table.get("schema") not in TABLE_SCHEMAS:
        raise ConfigError(f"{p} is not an efficacy table (schema {excerpt(table.get('schema'), 60)}, "
                          f"expected one of {list(TABLE_SCHEMAS)})")
    return table


def _cell(v: dict | None) -> str:
    if not v:
        return "–"
    return f"{100 * v['mean']:.1f}" + (f" ± {100 * v['std']:.1f}" if v.get("std") is not None else "")


def train_rows_text(entry: dict) -> str:
    """A table row's training size; each seed's where they differ (a release rebuilt on another machine
    need not keep the same rows). Seeds are JSON keys once the table is read back, hence ``int``."""
    sizes = entry.get("train_rows_by_seed") or {}
    if len(set(sizes.values())) > 1:
        return " / ".join(f"{n:,} (s{s})" for s, n in sorted(sizes.items(), key=lambda kv: int(kv[0])))
    return f"{entry['train_rows']:,}"


def difference_cells(calls: dict, sets: Sequence[str]) -> str:
    """A table row's cells: the difference per set, starred where it is called, – where a set is missing."""
    cells = []
    for s in sets:
        c = calls.get(s)
        cells.append("–" if not c else f"{c['difference']:+.1f}" + ("*" if c["call"] in ("helps", "hurts") else ""))
    return " | ".join(cells)


def _interval_cell(e: dict | None) -> str:
    """A v2 statistics cell: ``+3.1 [+1.2, +5.0]``, with ``, not distinguishable from 0`` where it is not; each
    figure rounded once, from the unrounded values."""
    if not e:
        return "–"
    if "unavailable" in e:
        so = e.get("seeds_only") or {}
        return (f"{so['difference']:+.1f}" + ("*" if so.get("call") in ("helps", "hurts") else "") + " (seeds only)"
                if so else "–")
    return e.get("text") or f"{e['estimate']:+.1f} [{e['low']:+.1f}, {e['high']:+.1f}]"


def _comparisons_md(table: dict, rows: Sequence[str]) -> str | None:
    """The comparisons whose first row is one of ``rows``: against the reference (the original data), where the
    table has their intervals, then the table's other comparisons (above all: a config against a random subset of
    the original of its own size, which separates debiased data from less data); with their intervals in a v2
    table (for a primary test, the adjusted interval that matches its call), else the seeds-only calls."""
    sets = table["sets"]
    stats = {(c["row"], c["against"]): c for c in (table.get("statistics") or {}).get("comparisons", [])}
    ref = table["reference"]
    comps = [{"row": n, "against": ref,
              "why": "against the original data" + (" (primary)" if st.get("primary") else "")}
             for n in rows if (st := stats.get((n, ref))) and any("unavailable" not in e for e in st["sets"].values())]
    shown = {(c["row"], c["against"]) for c in comps}  # a declared comparison with the reference: one line, not two
    comps += [c for c in table.get("comparisons") or []
              if c["row"] in set(rows) and (c["row"], c["against"]) not in shown]
    if not comps:
        return None
    lines = ["| comparison | why | " + " | ".join(sets) + " |", "|---|---|" + "---:|" * len(sets)]
    with_intervals = seeds_only = False
    for c in comps:
        st = stats.get((c["row"], c["against"]))
        if st and any("unavailable" not in e for e in st["sets"].values()):
            cells = " | ".join(_interval_cell(st["sets"].get(s)) for s in sets)
            with_intervals = True
            seeds_only |= any("unavailable" in e for e in st["sets"].values())
        else:
            cells = difference_cells(c["sets"], sets)
            seeds_only = True
        lines.append(f"| `{c['row']}` − `{c['against']}` | {c['why'] or '–'} | " + cells + " |")
    how = []
    if with_intervals:
        st = table["statistics"]
        if "replicates" in st:  # a report written before issue 46
            how.append(f"[low, high] = the {100 * st['level']:.0f}% nested paired-bootstrap interval over test rows "
                       f"and seeds ({st['replicates']:,} replicates)"
                       + (f"; primary comparisons corrected with {st['correction']}" if st.get("correction") else
                          "; no correction for the number of comparisons"))
        else:
            how.append(f"[low, high] = the {100 * st['level']:.0f}% seed-row t interval (seeds as the unit of "
                       f"replication, the test rows' variance added; closed form)"
                       + (f"; a primary comparison's interval is the {st['correction']}-adjusted one that matches "
                          f"its call" if st.get("correction") else "; no correction for the number of comparisons"))
    if seeds_only:
        how.append("* = more than 2 standard errors of the seeds' means and 1 point (seeds only: no per-row "
                   "predictions were stored for these units)")
    return (f"Against other rows of the table (first minus second, points; {'; '.join(how)}):\n\n" + "\n".join(lines))


def _release_name(data: dict) -> str | None:
    """The release a row trained on, by name: ``release`` (one the plan builds) or ``release_dir``'s folder."""
    if data.get("release"):
        return str(data["release"])
    return Path(str(data["release_dir"])).name if data.get("release_dir") else None


def card_markdown(path: "str | Path", configs: Sequence[str], *, source: str | None = None,
                  sizes: "dict[str, int] | None" = None, release: str | None = None) -> str | None:
    """Markdown for the card: the reference row and the rows trained on one of ``configs`` (finished or
    pending), the table's comparisons of those rows (e.g. against a random subset of the same size), and,
    given ``sizes`` (this release's train rows per config), a note where the table's models trained on a
    build of another size; None when the table has no row for any of them.

    ``release`` (the name of the release being built, its folder's name): when some rows of the table trained
    on a release of that name, the rows that trained on another release are left out (a plan that scores two
    releases with the same config names, e.g. one built with extra filters, shows each its own rows); when
    none did (the release was built under another name), every row of a matching config is shown."""
    table = load_table(path)
    ref_name = table["reference"]
    rows = {n: e for n, e in table["rows"].items() if (e.get("data") or {}).get("config") in set(configs)}
    trained_on = {n: _release_name(e.get("data") or {}) for n, e in rows.items()}
    if release is not None and release in trained_on.values():
        rows = {n: e for n, e in rows.items() if trained_on[n] in (release, None)}
    if not rows:
        return None
    ref = table["rows"].get(ref_name, {})
    sets = table["sets"]
    head = "| model trained on | train rows | seeds | " + " | ".join(sets) + " |"
    lines = [head, "|---|---:|---:|" + "---:|" * len(sets)]
    for name, e in [(ref_name, ref)] + list(rows.items()):
        if not e.get("sets"):
            lines.append(f"| `{name}` | pending | – | " + " | ".join("–" for _ in sets) + " |")
            continue
        cells = []
        for s in sets:
            c = _cell(e["sets"].get(s))
            if name != ref_name and s in e["sets"] and s in (ref.get("sets") or {}):
                c += f" ({100 * (e['sets'][s]['mean'] - ref['sets'][s]['mean']):+.1f})"
            cells.append(c)
        lines.append(f"| `{name}` | {train_rows_text(e)} | {len(e['seeds_done'])} | " + " | ".join(cells) + " |")
    model = Path(str(table["plan"].get("model", "the model"))).name
    pending = [f"`{n}` ({e['pending_reason']})" for n, e in rows.items() if not e.get("sets") and e.get("pending_reason")]
    text = (f"Accuracy (%) of `{model}` trained on each config with the same settings, mean ± std over seeds, "
            f"on the full challenge sets; in brackets the difference from `{ref_name}` (the original data). "
            f"From the efficacy table{f' ({source})' if source else ''}, {table['created']}.\n\n" + "\n".join(lines))
    comps = _comparisons_md(table, [n for n, e in rows.items() if e.get("sets")])
    if comps:
        text += "\n\n" + comps
    if pending:
        text += "\n\nNot measured yet: " + "; ".join(pending) + "."
    notes = []
    for name, e in rows.items():
        config = (e.get("data") or {}).get("config")
        have = (sizes or {}).get(config)
        by_seed = e.get("train_rows_by_seed") or ({0: e["train_rows"]} if e.get("train_rows") else {})
        trained = sorted(set(by_seed.values()))
        if have is not None and any(n != have for n in trained):
            notes.append(f"`{name}` trained on {' / '.join(f'{n:,}' for n in trained)} rows of `{config}`, "
                         f"this release's `{config}` has {have:,}")
    if notes:
        text += ("\n\nThe table's models trained on a build of another size (a release rebuilt on another "
                 "machine need not keep the same rows): " + "; ".join(notes) + ".")
    return text + "\n"
