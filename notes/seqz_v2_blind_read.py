"""A blind read of generated rows (issue 45): sample rows of one or more releases' seq_z configs and original rows,
shuffle them, print premise and hypothesis only (no label, no origin, no config), then score a reader's
judgements against the rows' labels.

usage:
  python notes/seqz_v2_blind_read.py sample KEY.parquet SEED NAME=RELEASE_DIR:N [NAME=RELEASE_DIR:N ...] \
      [--original RELEASE_DIR:N] [--exclude OLD_KEY.parquet ...]
  python notes/seqz_v2_blind_read.py score KEY.parquet JUDGEMENTS.txt OUT.json

`sample` draws N generated rows (origin == generated) of RELEASE_DIR/data/seq_z for each NAME, and N original rows
of --original's seq_z, with numpy default_rng(SEED), skipping the uids of earlier keys; it writes the key (uid,
label, origin, config) and prints the rows numbered in the shuffled order. The reader writes one line per row,
"INDEX JUDGEMENT", where JUDGEMENT is e / n / c (the reader's own label) or X (no coherent scene: the premise or
the hypothesis is nonsense, so no label can be right). `score` gives, per config: the share of nonsense (Wilson
95% interval), the agreement of the reader's label with the row's among the judgeable, and the usable share
(judgeable and agreeing). The categories follow issue 45's own blind read; the reader is the project's.
"""
import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from wilson import wilson_rounded  # notes/wilson.py (the script runs as `python notes/...`)

LABELS = {0: "e", 1: "n", 2: "c"}


def seq_z(release: str) -> pd.DataFrame:
    files = sorted(Path(release, "data", "seq_z").glob("*.parquet"))
    if not files:
        raise SystemExit(f"no seq_z Parquet files under {release}/data/seq_z")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def spec(text: str) -> tuple:
    where, _, n = text.rpartition(":")
    if not where or not n.isdigit():
        raise SystemExit(f"expected RELEASE_DIR:N, got {text!r}")
    return where, int(n)


def sample(args) -> None:
    rng = np.random.default_rng(args.seed)
    seen = set()
    for old in args.exclude:
        seen |= set(pd.read_parquet(old).uid)
    parts = []
    for item in args.configs:
        name, eq, rest = item.partition("=")
        if not eq:
            raise SystemExit(f"expected NAME=RELEASE_DIR:N, got {item!r}")
        release, n = spec(rest)
        d = seq_z(release)
        pool = d[(d.origin == "generated") & ~d.uid.isin(seen)]
        parts.append(pool.iloc[rng.choice(len(pool), n, replace=False)].assign(config=name))
    if args.original:
        release, n = spec(args.original)
        d = seq_z(release)
        pool = d[(d.origin == "original") & ~d.uid.isin(seen)]
        parts.append(pool.iloc[rng.choice(len(pool), n, replace=False)].assign(config="original"))
    rows = pd.concat(parts)
    rows = rows.iloc[rng.permutation(len(rows))].reset_index(drop=True)
    rows[["uid", "label", "origin", "config"]].to_parquet(args.key)
    for i, r in rows.iterrows():
        print(f"{i:3d} P: {r.premise}\n    H: {r.hypothesis}")


def score(args) -> None:
    key = pd.read_parquet(args.key)
    judged = {}
    for lineno, line in enumerate(Path(args.judgements).read_text().splitlines(), 1):
        if not line.strip():
            continue
        index, _, judgement = line.strip().partition(" ")
        if judgement.strip() not in ("e", "n", "c", "X"):
            raise SystemExit(f"{args.judgements}:{lineno}: judgement {judgement!r} is not e, n, c or X")
        judged[int(index)] = judgement.strip()
    missing = sorted(set(range(len(key))) - set(judged))
    if missing:
        raise SystemExit(f"{args.judgements}: no judgement for rows {missing[:10]}")
    key["reader"] = [judged[i] for i in range(len(key))]
    key["row_label"] = key.label.map(LABELS)
    out = {"key": str(args.key), "rows": len(key), "configs": {}}
    for name, g in key.groupby("config"):
        nonsense = int((g.reader == "X").sum())
        judgeable = g[g.reader != "X"]
        agree = int((judgeable.reader == judgeable.row_label).sum())
        out["configs"][name] = {
            "rows": len(g), "nonsense": nonsense, "nonsense_share": round(nonsense / len(g), 4),
            "nonsense_ci95": wilson_rounded(nonsense, len(g)), "judgeable": len(judgeable), "agree": agree,
            "agree_share_of_judgeable": round(agree / len(judgeable), 4) if len(judgeable) else None,
            "usable_share": round(agree / len(g), 4), "usable_ci95": wilson_rounded(agree, len(g)),
        }
    out["judgements"] = key[["uid", "config", "row_label", "reader"]].to_dict("records")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for name, c in out["configs"].items():
        print(f"{name}: {c['rows']} rows, nonsense {c['nonsense_share']:.1%} {c['nonsense_ci95']}, label agrees "
              f"{c['agree']}/{c['judgeable']} of the judgeable, usable {c['usable_share']:.1%} {c['usable_ci95']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample")
    s.add_argument("key")
    s.add_argument("seed", type=int)
    s.add_argument("configs", nargs="+")
    s.add_argument("--original")
    s.add_argument("--exclude", nargs="*", default=[])
    s.set_defaults(run=sample)
    c = sub.add_parser("score")
    c.add_argument("key")
    c.add_argument("judgements")
    c.add_argument("out")
    c.set_defaults(run=score)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
