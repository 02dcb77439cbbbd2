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
over the process tree, sampled every 0.1 s, and its peak PSS the same with shared pages counted once. The
per-stage split is the ``seconds`` of each stage in the release's manifest. Each unit writes
``<work>/scale-<s>.json`` and is skipped when present.

The old-code-against-new studies (``compare``, ``speedup``, ``overlap``: build_scale_speedup.md,
build_scale_overlap.md) are in the history: ``git show b65411f:benchmarks/bench_build_scale.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import NLI_FILES, RESULTS, ROOT, SHARED_DATA, machine, md_table, run_process  # noqa: E402

DATA = Path(os.environ.get("BENCH_DATA", "/work/benchdata"))
BASE_SHARD, NEW_SHARD, SHARDS = 55_000, 500_000, 10
SCALES = (1, 2, 5, 10)
CONFIGS = ("z_filtered", "z_aug", "par_z", "seq_z")


# ------------------------------------------------------------------------------------------ input

def _pool():
    """(premises, hypotheses, labels) of every real 3-way NLI row in ../shared/data."""
    import pyarrow.parquet as pq

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



# ------------------------------------------------------------------------------------------ runs

WORK = Path(os.environ.get("BENCH_WORK", "/work/benchdata/work"))


def _files(data: Path, scale: int) -> tuple[list[Path], list[Path]]:
    base = [data / f"base-{i:02d}.parquet" for i in range(scale)]
    new = [data / f"new-{i:02d}.parquet" for i in range(scale)]
    missing = [p for p in base + new if not p.exists()]
    if missing:
        raise SystemExit(f"missing input {missing[0]}; run `generate` first")
    return base, new


def timed_build(base: list[Path], new: list[Path], out: Path, cache: Path, recipe: Path | None = None) -> dict:
    """``debiased-nli build`` as its own process tree with empty caches: wall, CPU, peak memory, and the manifest's
    per-stage seconds."""
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache / "hf"), DEBIASED_NLI_CACHE=str(cache / "dn"),
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "debiased_nli.cli", "build", str(recipe or ROOT / "builders/snli.yaml"), "--data-files",
           *[f"train={p}" for p in base], "--out", str(out), "--quiet", "--timings", *(["--new-rows", *map(str, new)] if new else [])]
    out.parent.mkdir(parents=True, exist_ok=True)
    res = run_process(cmd, out.with_suffix(".log"), env=env, cwd=ROOT)
    manifest = json.loads((out / "manifest.json").read_text())
    stages = [{"stage": st["stage"], "seconds": st.get("seconds"), **({"parts": st["seconds_by_part"]}
              if "seconds_by_part" in st else {})} for st in manifest["stages"]]
    return {"command": " ".join(map(str, cmd)), **{k: res[k] for k in ("wall_s", "peak_rss_mb", "peak_pss_mb", "cpu_s")},
            "stages": stages, "configs": {c: sum(f["rows"] for f in sp["train"]) for c, sp in manifest["files"].items()},
            "hypothesis_only": manifest["features"]["hypothesis_only"]}


def run_scale(scale: int, data: Path, work: Path) -> dict:
    """One build at ``scale`` x (55k + 500k rows); resumable: skipped when its JSON exists."""
    path = work / f"scale-{scale}.json"
    if path.exists():
        return json.loads(path.read_text())
    base, new = _files(data, scale)
    res = timed_build(base, new, work / f"release-{scale}", work / f"cache-{scale}")
    res.update(scale=scale, base_rows=BASE_SHARD * scale, new_rows=NEW_SHARD * scale, machine=machine(),
               load_average_at_end=os.getloadavg())
    shutil.rmtree(work / f"release-{scale}", ignore_errors=True)
    shutil.rmtree(work / f"cache-{scale}", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    return res


def same_as_in_memory(rows: int, data: Path, work: Path, base_share: float = 0.25) -> dict:
    """A ``rows``-row slice (a quarter D0, the rest new rows) built twice: chunked (the default) and
    with ``features.storage: columns`` (every feature string in memory, the reference). Every file
    under data/, rejected/ and images/ must be the same byte for byte."""
    import pyarrow.parquet as pq
    import yaml

    path = work / f"same-{rows}.json"
    if path.exists():
        return json.loads(path.read_text())
    work.mkdir(parents=True, exist_ok=True)
    n0 = int(rows * base_share)
    inputs = work / f"same-{rows}-inputs"
    inputs.mkdir(exist_ok=True)
    b, g = inputs / "base.parquet", inputs / "new.parquet"
    pq.write_table(pq.read_table(data / "base-00.parquet").slice(0, n0), b)
    new = pq.read_table(data / "new-00.parquet").slice(0, rows - n0)
    pq.write_table(new, g)
    recipe = yaml.safe_load((ROOT / "builders/snli.yaml").read_text())
    recipe["features"] = {**recipe.get("features", {}), "storage": "columns"}
    columns_recipe = inputs / "snli_columns.yaml"
    columns_recipe.write_text(yaml.safe_dump(recipe))
    runs = {}
    for name, rec in (("chunked", None), ("columns", columns_recipe)):
        runs[name] = timed_build([b], [g], work / f"same-{rows}-{name}", work / f"same-{rows}-cache-{name}", rec)
    a, c = work / f"same-{rows}-chunked", work / f"same-{rows}-columns"
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file() and p.parts[len(a.parts)] in
                   ("data", "rejected", "images"))
    other = sorted(str(p.relative_to(c)) for p in c.rglob("*") if p.is_file() and p.parts[len(c.parts)] in
                   ("data", "rejected", "images"))
    differ = [f for f in files if f not in other or (a / f).read_bytes() != (c / f).read_bytes()]
    res = {"rows": rows, "base_rows": n0, "new_rows": rows - n0, "files_compared": files,
           "same_files": not differ and files == other, "differing": differ + sorted(set(other) - set(files)),
           "runs": runs}
    for d in (a, c, inputs, work / f"same-{rows}-cache-chunked", work / f"same-{rows}-cache-columns"):
        shutil.rmtree(d, ignore_errors=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    return res


# ------------------------------------------------------------------------------------------ report

def report(work: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads((work / f"scale-{s}.json").read_text()) for s in SCALES if (work / f"scale-{s}.json").exists()]
    same_res = [json.loads(p.read_text()) for p in sorted(work.glob("same-*.json"))]
    (RESULTS / "build_scale.json").write_text(json.dumps({"scales": runs, "same_as_in_memory": same_res}, indent=2) + "\n")
    if not runs:
        return
    lines = ["# `debiased-nli build` at scale: D0 + new rows from Parquet, every row featurised", "",
             "Commands (inputs written once by `python benchmarks/bench_build_scale.py generate`, see its docstring):", "",
             "```", "python benchmarks/bench_build_scale.py run --scale {1,2,5,10}   # one build per call, under the heavy lock",
             "python benchmarks/bench_build_scale.py same --rows 200000", "python benchmarks/bench_build_scale.py report",
             "```", "", "Each build is the whole command, as its own process tree, with empty caches:", "",
             f"`{runs[-1]['command'].replace(sys.executable, 'python').replace(str(ROOT) + '/', '')}`", "",
             *md_table(["scale", "D0 rows", "new rows", "wall (s)", "CPU (s)", "peak PSS (MB)", "peak RSS sum (MB)",
                        *CONFIGS], [[f"{r['scale']}x", f"{r['base_rows']:,}", f"{r['new_rows']:,}", f"{r['wall_s']:.0f}",
                                     f"{r['cpu_s']:.0f}", f"{r['peak_pss_mb']:,}", f"{r['peak_rss_mb']:,}",
                                     *(f"{r['configs'].get(c, 0):,}" for c in CONFIGS)] for r in runs], "r" * 11)]
    names = [st["stage"] for st in runs[-1]["stages"]]
    lines += ["", "Peak PSS is the memory the build's process tree holds (a page shared by k processes counts 1/k in "
              "each); the RSS sum counts every shared page once per process, so it overstates what the build needs "
              "once it forks its walks and Parquet writer (they share the parent's arrays copy-on-write). Both are "
              "sampled every 0.1 s.",
              "", "Seconds per stage (from the release's manifest, `--timings`):", "",
              "| stage | " + " | ".join(f"{r['scale']}x" for r in runs) + " |", "|---|" + "---:|" * len(runs)]
    for name in names:
        st = [next((x for x in r["stages"] if x["stage"] == name), {}) for r in runs]
        for label, vals in [(name.replace("|", "\\|"), [x.get("seconds") for x in st]), *(
                (f"&nbsp;&nbsp;{part}", [(x.get("parts") or {}).get(part) for x in st])
                for part in next((x.get("parts") for x in runs[-1]["stages"] if x["stage"] == name), None) or {})]:
            lines.append(f"| {label} | " + " | ".join("" if v is None else f"{v:.1f}" for v in vals) + " |")
    for res in same_res:
        lines += ["", f"**Chunked == in memory ({res['rows']:,} rows: {res['base_rows']:,} D0 + {res['new_rows']:,} new):** "
                  f"{'every' if res['same_files'] else 'NOT every'} file under data/, rejected/ and images/ "
                  f"({len(res['files_compared'])} files) is the same byte for byte"
                  + ("" if res["same_files"] else f"; differing: {res['differing']}") + ". "
                  f"Chunked: {res['runs']['chunked']['wall_s']:.0f} s, peak PSS {res['runs']['chunked']['peak_pss_mb']:,} MB; "
                  f"in memory (`features.storage: columns`): {res['runs']['columns']['wall_s']:.0f} s, "
                  f"peak PSS {res['runs']['columns']['peak_pss_mb']:,} MB."]
    (RESULTS / "build_scale.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    total = [(r["base_rows"] + r["new_rows"]) / 1e6 for r in runs]
    axes[0].plot(total, [r["wall_s"] for r in runs], "o-", label="wall")
    axes[0].plot(total, [r["cpu_s"] for r in runs], "s--", label="CPU (user + sys)")
    axes[1].plot(total, [r["peak_pss_mb"] / 1024 for r in runs], "o-", label="peak PSS (process tree)")
    axes[1].axhline(8, color="C3", ls=":", lw=1, label="target 8 GB")
    for ax, unit in zip(axes, ("seconds", "GB")):
        ax.set(xlabel="rows (millions, D0 + new)", ylabel=unit)
        ax.legend(fontsize=8)
    fig.suptitle("debiased-nli build builders/snli.yaml (all four configs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "build_scale.png", dpi=130)


# ------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = {name: sub.add_parser(name, help=h) for name, h in (
        ("generate", "write the input Parquet (once; resumable per file)"),
        ("run", "one timed build (resumable: skipped when its result exists)"),
        ("same", "chunked build == in-memory build on a slice"),
        ("report", "write benchmarks/results/build_scale.{md,json,png}"))}
    p["generate"].add_argument("--seed", type=int, default=0)
    p["run"].add_argument("--scale", type=int, choices=SCALES, required=True)
    p["same"].add_argument("--rows", type=int, default=200_000)
    for q in p.values():
        q.add_argument("--data", type=Path, default=DATA)
        q.add_argument("--work", type=Path, default=WORK)
    args = ap.parse_args(argv)
    if args.cmd == "generate":
        generate(args.data, args.seed)
    elif args.cmd == "run":
        print(json.dumps(run_scale(args.scale, args.data, args.work), indent=1))
    elif args.cmd == "same":
        print(json.dumps(same_as_in_memory(args.rows, args.data, args.work), indent=1)[:3000])
    else:
        report(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
