"""`debiased-nli build` at the paper's scale: 550k base rows D0 + 5M new rows D_G, from Parquet files.

    python benchmarks/bench_build_scale.py generate [--data /work/benchdata]     # once: the input Parquet
    python benchmarks/bench_build_scale.py run --scale 10                       # one build (1, 2, 5 or 10 x)
    python benchmarks/bench_build_scale.py same --rows 200000                   # chunked == in-memory, row for row
    python benchmarks/bench_build_scale.py report                               # md, json and png

**Input.** Every row is distinct (no (premise, hypothesis) pair twice, across D0 and D_G), so that every
row has to be featurised. Rows are made from the 59,313 real NLI rows of ../shared/data (SNLI train
sample, dev, test; MNLI dev matched and mismatched): a source row gives the hypothesis and the label;
the premise is its own (half the rows) or another row's (recombined); then light edits: one of
substitute a word (drawn from the pool's word frequencies), delete a word, swap two adjacent words,
insert a word, on the hypothesis, and a substitution on the premise of half the rows; a row whose pair
was already made is edited again until it is new. Base rows are 10 files of 55,000 rows
(``base-0X.parquet``), new rows 10 files of 500,000 (``new-0X.parquet``); scale s uses the first s
files of each (1x = 55k + 500k, 10x = 550k + 5M).

**Timing.** Each build runs as its own process tree (``debiased-nli build builders/snli.yaml
--data-files train=... --new-rows ... --quiet``), with empty ``datasets`` and debiased-nli caches (a
cold run: the Parquet-to-Arrow conversion is part of the time). Its peak RSS is the peak of the sum
over the process tree, sampled every 0.1 s. The per-stage split is the ``seconds`` of each stage in
the release's manifest. Each unit writes ``<work>/scale-<s>.json`` and is skipped when present.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, ROOT, SHARED_DATA, machine  # noqa: E402

DATA = Path(os.environ.get("BENCH_DATA", "/work/benchdata"))
BASE_SHARD, NEW_SHARD, SHARDS = 55_000, 500_000, 10
SCALES = (1, 2, 5, 10)


# ------------------------------------------------------------------------------------------ input

def _pool():
    """(premises, hypotheses, labels) of every real 3-way NLI row in ../shared/data."""
    import pyarrow.parquet as pq

    from benchmarks.common import NLI_FILES

    prem, hyp, lab = [], [], []
    for f in NLI_FILES:
        t = pq.read_table(SHARED_DATA / f, columns=["premise", "hypothesis", "label"])
        prem += t.column("premise").to_pylist()
        hyp += t.column("hypothesis").to_pylist()
        lab += t.column("label").to_pylist()
    return prem, hyp, lab


def generate(data: Path, seed: int = 0) -> None:
    """Write base-00..09 (55k rows each) and new-00..09 (500k rows each): every pair distinct."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    data.mkdir(parents=True, exist_ok=True)
    prem, hyp, lab = _pool()
    rng = np.random.default_rng(seed)
    words = [w for h in hyp for w in h.split()]
    vocab, freq = np.unique(np.array(words, dtype=object), return_counts=True)
    vocab = vocab.tolist()
    cdf = np.cumsum(freq / freq.sum())
    cdf[-1] = 1.0
    seen: set[int] = set()
    n_pool = len(hyp)
    plan = [(f"base-{i:02d}", BASE_SHARD) for i in range(SHARDS)] + [(f"new-{i:02d}", NEW_SHARD) for i in range(SHARDS)]

    def edit(tokens: list[str], kind: int, word: str, pos: float) -> list[str]:
        n = len(tokens)
        if n == 0:
            return [word]
        i = int(pos * n)
        if kind == 0:                       # substitute
            return tokens[:i] + [word] + tokens[i + 1:]
        if kind == 1 and n > 3:             # delete
            return tokens[:i] + tokens[i + 1:]
        if kind == 2 and n > 1:             # swap with the next word
            j = min(i, n - 2)
            return tokens[:j] + [tokens[j + 1], tokens[j]] + tokens[j + 2:]
        return tokens[:i] + [word] + tokens[i:]  # insert

    for name, n in plan:
        path = data / f"{name}.parquet"
        if path.exists():  # resumable; the pairs it holds are still marked as seen
            t = pq.read_table(path, columns=["premise", "hypothesis"])
            seen.update(hash((p, h)) for p, h in zip(t.column(0).to_pylist(), t.column(1).to_pylist()))
            continue
        src = rng.integers(0, n_pool, n)
        other = rng.integers(0, n_pool, n)
        own_premise = rng.random(n) < 0.5
        edit_premise = rng.random(n) < 0.5
        kinds = rng.integers(0, 4, n)
        h_word = np.searchsorted(cdf, rng.random(n))
        p_word = np.searchsorted(cdf, rng.random(n))
        h_pos, p_pos = rng.random(n), rng.random(n)
        out_p, out_h, out_l = [], [], []
        for k in tqdm(range(n), desc=name, mininterval=10):
            s = int(src[k])
            p_tokens = (prem[s] if own_premise[k] else prem[int(other[k])]).split()
            h_tokens = edit(hyp[s].split(), int(kinds[k]), vocab[h_word[k]], h_pos[k])
            if edit_premise[k]:
                p_tokens = edit(p_tokens, 0, vocab[p_word[k]], p_pos[k])
            pp, hh = " ".join(p_tokens), " ".join(h_tokens)
            while hash((pp, hh)) in seen:  # made before: edit the hypothesis once more
                h_tokens = edit(h_tokens, int(rng.integers(0, 4)), vocab[int(np.searchsorted(cdf, rng.random()))],
                                rng.random())
                hh = " ".join(h_tokens)
            seen.add(hash((pp, hh)))
            out_p.append(pp)
            out_h.append(hh)
            out_l.append(lab[s])
        table = pa.table({"premise": pa.array(out_p, pa.string()), "hypothesis": pa.array(out_h, pa.string()),
                          "label": pa.array(out_l, pa.int64())})
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp, compression="zstd", row_group_size=100_000)
        tmp.rename(path)
    (data / "README.md").write_text(
        "Input of benchmarks/bench_build_scale.py (debiased-nli), made by\n"
        f"`python benchmarks/bench_build_scale.py generate --data {data}` (seed {seed}).\n"
        "base-0X.parquet: 55,000 rows each; new-0X.parquet: 500,000 rows each; every (premise, hypothesis) distinct.\n")



# ------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write the input Parquet (once; resumable per file)")
    g.add_argument("--data", type=Path, default=DATA)
    g.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "generate":
        generate(args.data, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
