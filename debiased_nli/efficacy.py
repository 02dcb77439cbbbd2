"""A release card's link to its rows of the efficacy table (``benchmarks/efficacy.py``, issue 14).

``debiased-nli build ... --efficacy benchmarks/results/efficacy.json`` puts, for every config of the
release that has a row in the table, the measured accuracies (mean ± std over seeds) and their
difference from the table's reference row (the model trained on the original data) into the card, so a
user sees what training on a config costs or gains before picking it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .errors import ConfigError

TABLE_SCHEMA = "debiased-nli/efficacy-table/v1"


def load_table(path: "str | Path") -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"efficacy table {p} does not exist; give the efficacy.json that "
                          f"`python benchmarks/efficacy.py report` writes")
    table = json.loads(p.read_text())
    if table.get("schema") != TABLE_SCHEMA:
        raise ConfigError(f"{p} is not an efficacy table (schema {table.get('schema')!r}, expected {TABLE_SCHEMA!r})")
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


def card_markdown(path: "str | Path", configs: Sequence[str], *, source: str | None = None) -> str | None:
    """Markdown for the card: the reference row and the rows trained on one of ``configs`` (finished or
    pending); None when the table has no row for any of them."""
    table = load_table(path)
    ref_name = table["reference"]
    rows = {n: e for n, e in table["rows"].items() if (e.get("data") or {}).get("config") in set(configs)}
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
    if pending:
        text += "\n\nNot measured yet: " + "; ".join(pending) + "."
    return text + "\n"
