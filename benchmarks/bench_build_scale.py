"""`debiased-nli build` at the paper's scale: 550k base rows D0 + 5M new rows D_G, from Parquet files.

    python benchmarks/bench_build_scale.py generate [--data /work/benchdata]     # once: the input Parquet
    python benchmarks/bench_build_scale.py run --scale 10                       # one build (1, 2, 5 or 10 x)
    python benchmarks/bench_build_scale.py same --rows 200000                   # chunked == in-memory, row for row
    python benchmarks/bench_build_scale.py report                               # md, json and png
    python benchmarks/bench_build_scale.py compare --scale 1 --old ../scale2base  # old code vs this one
    python benchmarks/bench_build_scale.py speedup                              # build_scale_speedup.{md,json}
    python benchmarks/bench_build_scale.py overlap --scale 10 --old ../old22    # fits started early vs not
    python benchmarks/bench_build_scale.py overlap-report                       # build_scale_overlap.{md,json}

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

**Old code against new.** ``compare`` times the same build with another checkout's code (``--old``, e.g.
a worktree of an earlier commit) and this one, interleaved (old, new, old, new: a shared, noisy machine
slows both alike), and reports ratios measured in the same run. It also builds once with this code and
the old hypothesis-only solver put back (scikit-learn's L-BFGS, 300 iterations), whose data/, rejected/
and images/ must be the old release's byte for byte (every other change only changes the speed), and
compares the old and new releases config by config (rows, shared uids). Each build is a unit of
``<work>/speedup-<s>.json``, skipped when done.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
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



# ------------------------------------------------------------------------------------------ runs

WORK = Path(os.environ.get("BENCH_WORK", "/work/benchdata/work"))


def _files(data: Path, scale: int) -> tuple[list[Path], list[Path]]:
    base = [data / f"base-{i:02d}.parquet" for i in range(scale)]
    new = [data / f"new-{i:02d}.parquet" for i in range(scale)]
    missing = [p for p in base + new if not p.exists()]
    if missing:
        raise SystemExit(f"missing input {missing[0]}; run `generate` first")
    return base, new


class TreeMemory(threading.Thread):
    """Peak memory of a process tree, sampled every ``every`` seconds: the sum of RSS and the sum of
    PSS (proportional set size: pages shared by forked workers are counted once in all)."""

    def __init__(self, pid: int, every: float = 0.1):
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.every = every
        self.peak_rss = self.peak_pss = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            rss = pss = 0
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                break
            for p in procs:
                try:
                    info = p.memory_full_info()
                    rss += info.rss
                    pss += getattr(info, "pss", info.rss)
                except psutil.Error:
                    pass
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.stop.wait(self.every)


def timed_build(base: list[Path], new: list[Path], out: Path, cache: Path, recipe: Path | None = None,
                extra: list[str] = (), code: Path = ROOT, prelude: str | None = None) -> dict:
    """Run ``debiased-nli build`` as its own process tree with empty caches; wall, CPU, peak memory,
    and the manifest's per-stage seconds. ``code``: the checkout whose ``debiased_nli`` runs (and whose
    builders/snli.yaml is the recipe); ``prelude``: Python run in the build's process before the command."""
    import resource

    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache / "hf"), DEBIASED_NLI_CACHE=str(cache / "dn"),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(code))
    head = [sys.executable, "-m", "debiased_nli.cli"] if prelude is None else \
        [sys.executable, "-c", f"{prelude}\nimport sys\nfrom debiased_nli.cli import main\nsys.exit(main(sys.argv[1:]))"]
    cmd = head + ["build", str(recipe or code / "builders/snli.yaml"),
                  "--data-files", *[f"train={p}" for p in base], "--out", str(out), "--quiet", "--timings", *extra]
    if new:
        cmd += ["--new-rows", *map(str, new)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=code, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mem = TreeMemory(proc.pid)
    mem.start()
    log = proc.communicate()[0]
    wall = time.perf_counter() - start
    mem.stop.set()
    mem.join()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"build failed ({proc.returncode}):\n{log[-4000:]}")
    manifest = json.loads((out / "manifest.json").read_text())
    stages = [{"stage": st["stage"], "seconds": st.get("seconds"), **({"parts": st["seconds_by_part"]}
              if "seconds_by_part" in st else {})} for st in manifest["stages"]]
    configs = {c: sum(f["rows"] for f in sp["train"]) for c, sp in manifest["files"].items()}
    return {"command": " ".join(map(str, cmd)), "wall_s": round(wall, 1),
            "peak_rss_mb": round(mem.peak_rss / 2**20), "peak_pss_mb": round(mem.peak_pss / 2**20),
            "cpu_s": round(usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime, 1), "stages": stages, "configs": configs,
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


# The "new code with the old solver" equality check put scikit-learn's L-BFGS back into the new code through
# LOGREG_SOLVER. Since the hypothesis-only model is the machine-independent fit of bias/logreg.py (issue 32),
# LOGREG_SOLVER no longer selects a scikit-learn solver, so that check cannot be made; old and new code are
# compared by speed and by how much their configs overlap.
RUNS = ("old", "new")


def _release_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.parts[len(folder.parts)] in ("data", "rejected", "images"))


def _uids(folder: Path, config: str) -> set[str]:
    import pyarrow.parquet as pq

    return {u for f in sorted((folder / "data" / config).glob("train-*.parquet"))
            for u in pq.read_table(f, columns=["uid"]).column("uid").to_pylist()}


def _largest_z(folder: Path) -> dict[str, float]:
    """The card's "Largest |z| (without `<null>`)" of the original and of every config."""
    import re

    text = " ".join((folder / "README.md").read_text().split())
    at = text.find("Largest |z|")
    found = re.findall(r"(?:`(\w+)`|(original)) \*\*([\d.]+)\*\*", text[at:at + 400]) if at >= 0 else []
    return {a or b: float(z) for a, b, z in found}


def compare_scale(scale: int, data: Path, work: Path, old: Path, rounds: int = 2, reseed: bool = False) -> dict:
    """Old code (``old``, a checkout) against this one at ``scale``: ``rounds`` builds of each, interleaved,
    then one with this code and the old solver (equality check), and with ``reseed`` one of the old code
    with another seed (how much a config's rows move when only the seed changes). Resumable unit by unit."""
    path = work / f"speedup-{scale}.json"
    res = json.loads(path.read_text()) if path.exists() else {
        "scale": scale, "base_rows": BASE_SHARD * scale, "new_rows": NEW_SHARD * scale, "old_code": str(old),
        "new_code": str(ROOT), "runs": []}
    base, new = _files(data, scale)
    work.mkdir(parents=True, exist_ok=True)
    units = [(name, r) for r in range(rounds) for name in RUNS] + ([("old_seed_43", 0)] if reseed else [])
    keep = {name: work / f"speedup-{scale}-{name}" for name, _ in units}
    done = {(u["code"], u["round"]) for u in res["runs"]}
    for name, r in units:
        if (name, r) in done:
            continue
        # the first build of each keeps its release for the checks below
        out = keep[name] if r == 0 else work / f"speedup-{scale}-{name}-{r}"
        run = timed_build(base, new, out, work / f"speedup-cache-{scale}", code=old if name.startswith("old") else ROOT,
                          prelude=None,
                          extra=["--seed", "43"] if name == "old_seed_43" else [])
        run.update(code=name, round=r, load_average_at_end=os.getloadavg(), largest_z=_largest_z(out))
        if r:
            shutil.rmtree(out, ignore_errors=True)
        res["runs"].append(run)
        path.write_text(json.dumps(res, indent=2) + "\n")
    if "checks" not in res:

        a, c = keep["old"], keep["new"]
        def overlap(x: Path, y: Path) -> dict:
            out = {}
            for cfg in ("z_filtered", "z_aug", "par_z", "seq_z"):
                ux, uy = _uids(x, cfg), _uids(y, cfg)
                out[cfg] = {"old_rows": len(ux), "new_rows": len(uy), "shared": len(ux & uy),
                            "jaccard": round(len(ux & uy) / max(len(ux | uy), 1), 4)}
            return out

        res["checks"] = {"old_solver_same_files": None, "configs_old_vs_new": overlap(a, c)}
        if reseed:
            res["checks"]["configs_old_seed_42_vs_43"] = overlap(a, keep["old_seed_43"])
        path.write_text(json.dumps(res, indent=2) + "\n")
        for folder in keep.values():
            shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(work / f"speedup-cache-{scale}", ignore_errors=True)
    return res


def overlap_scale(scale: int, data: Path, work: Path, old: Path, rounds: int = 1) -> dict:
    """The TF-IDF fits started on D0's own vocabulary while D_G is extracted (this code) against the fits
    after the whole extraction (``old``): old and new builds alternate; the releases must be the same
    byte for byte (the change moves work in time, not what is computed). Resumable per build:
    ``<work>/overlap-<s>.json``."""
    path = work / f"overlap-{scale}.json"
    res = json.loads(path.read_text()) if path.exists() else {
        "scale": scale, "base_rows": BASE_SHARD * scale, "new_rows": NEW_SHARD * scale, "old_code": str(old),
        "new_code": str(ROOT), "runs": []}
    base, new = _files(data, scale)
    work.mkdir(parents=True, exist_ok=True)
    keep = {name: work / f"overlap-{scale}-{name}" for name in RUNS}
    done = {(u["code"], u["round"]) for u in res["runs"]}
    for r in range(rounds):
        for name in RUNS:
            if (name, r) in done:
                continue
            out = keep[name] if r == 0 else work / f"overlap-{scale}-{name}-{r}"
            run = timed_build(base, new, out, work / f"overlap-cache-{scale}", code=old if name == "old" else ROOT)
            run.update(code=name, round=r, load_average_at_end=os.getloadavg())
            if r:
                shutil.rmtree(out, ignore_errors=True)
            res["runs"].append(run)
            path.write_text(json.dumps(res, indent=2) + "\n")
    if "checks" not in res:
        import pyarrow.parquet as pq

        a, b = keep["old"], keep["new"]
        files = _release_files(a)
        differ = [f for f in files if not (b / f).exists() or (a / f).read_bytes() != (b / f).read_bytes()]
        same_rows = [f for f in differ if f.endswith(".parquet") and (b / f).exists()
                     and pq.read_table(a / f).equals(pq.read_table(b / f))]
        res["checks"] = {"same_files": not differ and files == _release_files(b), "files_compared": len(files),
                         "differing": [f for f in differ if f not in same_rows],
                         "same_rows_other_row_groups": same_rows}
        path.write_text(json.dumps(res, indent=2) + "\n")
        for folder in keep.values():
            shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(work / f"overlap-cache-{scale}", ignore_errors=True)
    return res


def overlap_report(work: Path, old_commit: str) -> None:
    """benchmarks/results/build_scale_overlap.{md,json} from every ``<work>/overlap-<s>.json``."""
    results = [json.loads(p.read_text()) for p in sorted(work.glob("overlap-*.json"))]
    (RESULTS / "build_scale_overlap.json").write_text(json.dumps({"old_commit": old_commit, "scales": results},
                                                                 indent=2) + "\n")
    lines = ["# `debiased-nli build`: the hypothesis-only fits started while the new rows are featurised", "",
             f"Old code: main at {old_commit} (the TF-IDF model's fits start after every row of D0 and D_G is "
             "extracted). New code: the fits start as soon as D0's chunks are in, on D0's own vocabulary, "
             "in their own processes, while the fork pool extracts D_G's features.", "",
             "```", f"git -C /work/main worktree add --detach /work/wt/old22 {old_commit}",
             "python benchmarks/bench_build_scale.py overlap --scale 10 --old /work/wt/old22",
             "python benchmarks/bench_build_scale.py overlap-report", "```", "",
             "Each build is the whole command as its own process tree, empty caches, `OMP_NUM_THREADS=1`; "
             "old and new alternate.", "",
             "| scale | D0 + new rows | old wall (s) | new wall (s) | **wall old/new** | old CPU (s) | new CPU (s) | "
             "old peak PSS (MB) | new peak PSS (MB) | releases the same |",
             "|---|---|---|---|---:|---|---|---|---|---|"]
    for res in results:
        by = {name: [u for u in res["runs"] if u["code"] == name] for name in RUNS}
        w = {n: _mean([u["wall_s"] for u in by[n]]) for n in RUNS}
        fmt = lambda n, k: " / ".join(f"{u[k]:,}" for u in by[n])  # noqa: E731
        ch = res.get("checks", {})
        same = ("yes, byte for byte" if ch.get("same_files") else
                f"no: {', '.join(ch.get('differing', []))}") if ch else "not checked yet"
        if ch.get("same_rows_other_row_groups"):
            same += f" ({len(ch['same_rows_other_row_groups'])} Parquet files: same rows, other row groups)"
        lines.append(f"| {res['scale']}x | {res['base_rows']:,} + {res['new_rows']:,} | {fmt('old', 'wall_s')} | "
                     f"{fmt('new', 'wall_s')} | **{w['old'] / w['new']:.2f}** | {fmt('old', 'cpu_s')} | "
                     f"{fmt('new', 'cpu_s')} | {fmt('old', 'peak_pss_mb')} | {fmt('new', 'peak_pss_mb')} | {same} |")
    lines += ["", "Seconds per stage of the features (manifest, mean over the rounds):", ""]
    for res in results:
        rows = {}
        for u in res["runs"]:
            for st in u["stages"]:
                if st["stage"] == "features":
                    for part, sec in (st.get("parts") or {}).items():
                        rows.setdefault(part, {}).setdefault(u["code"], []).append(sec)
                    rows.setdefault("features (whole stage)", {}).setdefault(u["code"], []).append(st["seconds"])
        lines += [f"**{res['scale']}x**", "", "| | old | new |", "|---|---:|---:|"]
        cell = lambda xs: f"{_mean(xs):.1f}" if xs else "–"  # noqa: E731
        for part, v in rows.items():
            lines.append(f"| {part} | {cell(v.get('old', []))} | {cell(v.get('new', []))} |")
        lines.append("")
        ho, lex = rows.get("hypothesis-only model", {}), rows.get("lexical features", {})
        if ho.get("old") and ho.get("new") and lex.get("old") and lex.get("new"):
            cores = (res["runs"][0].get("machine") or {}).get("cpus") or os.cpu_count()
            lines += [f"What it shows: the hypothesis-only time left after D_G's features went from "
                      f"{_mean(ho['old']):.1f} s to {_mean(ho['new']):.1f} s, but extracting the lexical features took "
                      f"{_mean(lex['new']) - _mean(lex['old']):+.1f} s, because on {cores} cores the fits and the fork "
                      f"pool compete for the same CPUs: the overlap only pays where cores are idle during extraction.", ""]
    (RESULTS / "build_scale_overlap.md").write_text("\n".join(lines) + "\n")


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


# The old code's 10x build as it measured itself (benchmarks/results/build_scale.json at f166379, run alone)
OLD_CODE_COMMIT = "f166379"
OLD_CODE_10X = {"wall_s": 640.4, "peak_pss_mb": 13352, "peak_rss_mb": 13473}


def speedup_report(work: Path) -> None:
    """benchmarks/results/build_scale_speedup.{md,json} from every ``<work>/speedup-<s>.json``."""
    results = [json.loads(p.read_text()) for p in sorted(work.glob("speedup-*.json"))]
    (RESULTS / "build_scale_speedup.json").write_text(json.dumps({"scales": results}, indent=2) + "\n")
    if not results:
        return
    lines = ["# `debiased-nli build` at scale: the old code against the new, measured in the same run", "",
             "Commands (inputs of `bench_build_scale.py generate`; the old code is a worktree of main at f166379):", "",
             "```", "git -C /work/main worktree add --detach /work/wt/scale2base f166379",
             "python benchmarks/bench_build_scale.py compare --scale 1 --old /work/wt/scale2base",
             "python benchmarks/bench_build_scale.py compare --scale 2 --old /work/wt/scale2base",
             "python benchmarks/bench_build_scale.py speedup", "```", "",
             "Each build is the whole command (`debiased-nli build builders/snli.yaml --data-files train=base-0X "
             "--new-rows new-0X --timings --quiet`) as its own process tree, with empty caches, "
             "`OMP_NUM_THREADS=1`; wall time, CPU time (user + system, every process) and the peak PSS of "
             "the process tree (sampled every 0.1 s). Old and new builds alternate (old, new, old, new).", "",
             "| scale | D0 + new rows | old wall (s) | new wall (s) | **wall old/new** | old CPU (s) | new CPU (s) | "
             "CPU old/new | old peak PSS (MB) | new peak PSS (MB) | **PSS old/new** |",
             "|---|---|---|---|---:|---|---|---:|---|---|---:|"]
    for r in results:
        by = {name: [u for u in r["runs"] if u["code"] == name] for name in RUNS}
        w = {k: [u["wall_s"] for u in v] for k, v in by.items()}
        c = {k: [u["cpu_s"] for u in v] for k, v in by.items()}
        m = {k: [u["peak_pss_mb"] for u in v] for k, v in by.items()}
        fmt = lambda xs: " / ".join(f"{x:,.0f}" for x in xs)
        lines.append(f"| {r['scale']}x | {r['base_rows']:,} + {r['new_rows']:,} | {fmt(w['old'])} | {fmt(w['new'])} | "
                     f"**{_mean(w['old']) / _mean(w['new']):.2f}** | {fmt(c['old'])} | {fmt(c['new'])} | "
                     f"{_mean(c['old']) / _mean(c['new']):.2f} | {fmt(m['old'])} | {fmt(m['new'])} | "
                     f"**{_mean(m['old']) / _mean(m['new']):.2f}** |")
    lines += ["", "Ratios are of the means over the rounds (each round's value is listed, old / old or new / new).",
              "", "Seconds per stage (from each release's manifest, mean over the rounds; the new code's walks over "
              "the new rows run at once, so their seconds overlap, as do Parquet and z-statistics):", ""]
    for r in results:
        names = []
        for u in r["runs"]:
            for st in u["stages"]:
                if st["stage"] not in names:
                    names.append(st["stage"])
        lines += [f"**{r['scale']}x**", "", "| stage | old | new |", "|---|---:|---:|"]
        for name in names:
            row = []
            for code in RUNS:
                vals = [st["seconds"] for u in r["runs"] if u["code"] == code for st in u["stages"]
                        if st["stage"] == name and st.get("seconds") is not None]
                row.append(f"{_mean(vals):.1f}" if vals else "")
            lines.append(f"| {name.replace('|', chr(92) + '|')} | " + " | ".join(row) + " |")
            parts = sorted({p for u in r["runs"] for st in u["stages"] if st["stage"] == name for p in st.get("parts", {})})
            for part in parts:
                row = []
                for code in RUNS:
                    vals = [st["parts"][part] for u in r["runs"] if u["code"] == code for st in u["stages"]
                            if st["stage"] == name and part in st.get("parts", {})]
                    row.append(f"{_mean(vals):.1f}" if vals else "")
                lines.append(f"| &nbsp;&nbsp;{part} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["## What the new code changes", "",
              "- Lexical features (same features): the tokeniser's separator regex leaves the single spaces "
              "between words alone (Arrow's regex replace pays per match); repeats inside a row are found with a "
              "stable sort, not a hash table; extractors that make their rows unique (`unigram_v1`, `bigram_v1`, "
              "the bins, `overlap_v2`, `null_v1`, ...) skip the second dedup pass.",
              "- Hypothesis-only model (a different fit, see below): Newton-CG instead of L-BFGS for the TF-IDF "
              "logistic regressions; L-BFGS stopped at its 300-iteration cap without converging on the 10x folds. "
              "The folds are fitted in processes only from 200k rows of D0, and those processes exit after the fits.",
              "- z-filtering (same rows): each batch's bookkeeping touches the batch's entries and the top-k only "
              "(before, every batch cleared and scanned arrays over the whole vocabulary); the walks over the new "
              "rows (z_aug, Par-Z's Z(D_G), seq_z) run at once in forked processes.",
              "- New rows and release (same files): uids are hashed from one Arrow join per chunk (in processes "
              "from 200k rows); D0 and D_G are held contiguous, and a config's rows are taken chunk by chunk (Arrow "
              "copied every chunk of a table together for each take); Parquet is written shard by shard from the "
              "selections, never a whole split in memory; the z-statistics and plots run in a forked process "
              "beside the Parquet writing.", ""]
    lines += ["## What changes in the release", ""]
    for r in results:
        ch = r.get("checks")
        if not ch:
            continue
        acc = {code: next(u["hypothesis_only"] for u in r["runs"] if u["code"] == code) for code in RUNS}
        regrouped = ch.get("same_rows_other_row_groups", [])
        if ch.get("old_solver_same_files") is None:  # runs since the machine-independent fit: no such check
            lines += [f"**{r['scale']}x.** Out-of-fold hypothesis-only accuracy: {acc['old']['accuracy']:.4f} "
                      f"(old code) and {acc['new']['accuracy']:.4f} (this code).", ""]
            continue
        lines += [f"**{r['scale']}x.** With the old hypothesis-only solver put back, the new code writes "
                  f"{'the same' if ch['old_solver_same_files'] else 'NOT the same'} data/, rejected/ and images/ "
                  f"files as the old code ({ch['files_compared']} files: "
                  f"{ch['files_compared'] - len(regrouped) - len(ch['differing'])} byte for byte"
                  + (f"; {len(regrouped)} with the same rows in the same order, cut into other Parquet row groups "
                     f"(a split of more than one 500k-row shard is now gathered shard by shard, and datasets sizes "
                     f"row groups from a shard's Arrow bytes): {', '.join(regrouped)}" if regrouped else "")
                  + (f"; differing: {ch['differing']}" if ch["differing"] else "") + "). "
                  f"Out-of-fold hypothesis-only accuracy: {acc['old']['accuracy']:.4f} (L-BFGS) and "
                  f"{acc['new']['accuracy']:.4f} (Newton-CG).", "",
                  "| config | rows, old | rows, new | rows in both | Jaccard |", "|---|---:|---:|---:|---:|"]
        for cfg, v in ch["configs_old_vs_new"].items():
            lines.append(f"| {cfg} | {v['old_rows']:,} | {v['new_rows']:,} | {v['shared']:,} | {v['jaccard']:.3f} |")
        zs = {code: next((u.get("largest_z") for u in r["runs"] if u["code"] == code), None) for code in RUNS}
        if all(zs.values()):
            lines += ["", "Largest |z| left in each config (the card's figure, without `<null>`), old / new: " +
                      ", ".join(f"{cfg} {zs['old'].get(cfg, float('nan')):.2f} / {zs['new'].get(cfg, float('nan')):.2f}"
                                for cfg in ("original", "z_filtered", "z_aug", "par_z", "seq_z")) + "."]
        if "configs_old_seed_42_vs_43" in ch:
            lines += ["", "For scale: the old code with only the seed changed (`--seed 43` against the recipe's 42; the "
                      "seed draws the hypothesis-only folds and the walk order) keeps these rows in common:", "",
                      "| config | rows, seed 42 | rows, seed 43 | rows in both | Jaccard |", "|---|---:|---:|---:|---:|"]
            for cfg, v in ch["configs_old_seed_42_vs_43"].items():
                lines.append(f"| {cfg} | {v['old_rows']:,} | {v['new_rows']:,} | {v['shared']:,} | {v['jaccard']:.3f} |")
        lines.append("")
    # the 10x build (550k + 5M rows): the old code's figures are those it measured on an otherwise idle machine
    # (build_scale.json as committed at f166379), the new code's those of build_scale.json now; two different
    # runs, so this is a second look at the ratio, not the result (the same-run 1x and 2x ratios above are)
    measured = RESULTS / "build_scale.json"
    new10 = next((u for u in json.loads(measured.read_text())["scales"] if u["scale"] == 10), None) \
        if measured.exists() else None
    if new10 is not None:
        o, n = OLD_CODE_10X, new10
        lines += ["## The 10x build (550k + 5M rows), measured alone", "",
                  f"| code | wall (s) | peak PSS (MB) | peak RSS sum (MB) |", "|---|---:|---:|---:|",
                  f"| old ({OLD_CODE_COMMIT}, build_scale.json as committed there) | {o['wall_s']:.0f} | "
                  f"{o['peak_pss_mb']:,} | {o['peak_rss_mb']:,} |",
                  f"| new (build_scale.json as it stands when this table is written) | {n['wall_s']:.0f} | {n['peak_pss_mb']:,} | {n['peak_rss_mb']:,} |",
                  f"| **old/new** | **{o['wall_s'] / n['wall_s']:.2f}** | **{o['peak_pss_mb'] / n['peak_pss_mb']:.2f}** | "
                  f"{o['peak_rss_mb'] / n['peak_rss_mb']:.2f} |", "",
                  "Each 10x build ran alone on an otherwise idle machine, but in different sessions: these ratios agree "
                  "with, and do not replace, the same-run ratios above.", ""]
    loads = [u["load_average_at_end"][0] for r in results for u in r["runs"]]
    lines += [f"The machine (2 CPU cores) was shared with other jobs during these builds (1-minute load average "
              f"at the end of the builds: {min(loads):.1f} to {max(loads):.1f}), which slows old and new alike: "
              "the ratios, not the seconds, are the result."]
    (RESULTS / "build_scale_speedup.md").write_text("\n".join(lines) + "\n")


def profile_build(scale: int, data: Path, work: Path, top: int = 30) -> Path:
    """cProfile of the whole build at ``scale`` (in this process); the top functions by cumulative time."""
    import cProfile
    import io
    import pstats

    out = RESULTS / f"build_scale_profile_{scale}x.txt"
    if out.exists():
        return out
    base, new = _files(data, scale)
    cache = work / f"profile-cache-{scale}"
    shutil.rmtree(cache, ignore_errors=True)
    os.environ.update(HF_DATASETS_CACHE=str(cache / "hf"), DEBIASED_NLI_CACHE=str(cache / "dn"))
    from debiased_nli.release.recipe import build

    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    build(ROOT / "builders/snli.yaml", work / f"profile-release-{scale}", data_files=[f"train={p}" for p in base],
          new_rows_files=[str(p) for p in new], overwrite=True, progress=False, timings=True)
    prof.disable()
    wall = time.perf_counter() - start
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    out.write_text(f"cProfile of `debiased-nli build builders/snli.yaml` at {scale}x "
                   f"({BASE_SHARD * scale:,} + {NEW_SHARD * scale:,} rows), in-process, {wall:.0f} s wall\n"
                   f"command: python benchmarks/bench_build_scale.py profile --scale {scale}\n\n" + buf.getvalue())
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(work / f"profile-release-{scale}", ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------ report

def report(work: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads((work / f"scale-{s}.json").read_text()) for s in SCALES if (work / f"scale-{s}.json").exists()]
    same = sorted(work.glob("same-*.json"))
    same_res = [json.loads(p.read_text()) for p in same]
    (RESULTS / "build_scale.json").write_text(json.dumps({"scales": runs, "same_as_in_memory": same_res}, indent=2) + "\n")
    if not runs:
        return
    lines = ["# `debiased-nli build` at scale: D0 + new rows from Parquet, every row featurised", "",
             "Commands (inputs written once by `python benchmarks/bench_build_scale.py generate`, see its docstring):", "",
             "```", "python benchmarks/bench_build_scale.py run --scale {1,2,5,10}   # one build per call, under the heavy lock",
             "python benchmarks/bench_build_scale.py same --rows 200000", "python benchmarks/bench_build_scale.py report",
             "```", "", "Each build is the whole command, as its own process tree, with empty caches:", "",
             f"`{runs[-1]['command'].replace(sys.executable, 'python').replace(str(ROOT) + '/', '')}`", "",
             "| scale | D0 rows | new rows | wall (s) | CPU (s) | peak PSS (MB) | peak RSS sum (MB) | z_filtered | z_aug | par_z | seq_z |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        c = r["configs"]
        lines.append(f"| {r['scale']}x | {r['base_rows']:,} | {r['new_rows']:,} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | "
                     f"{r['peak_pss_mb']:,} | {r['peak_rss_mb']:,} | {c.get('z_filtered', 0):,} | {c.get('z_aug', 0):,} | "
                     f"{c.get('par_z', 0):,} | {c.get('seq_z', 0):,} |")
    names = [st["stage"] for st in runs[-1]["stages"]]
    lines += ["", "Peak PSS is the memory the build's process tree holds (a page shared by k processes counts 1/k in "
              "each); the RSS sum counts every shared page once per process, so it overstates what the build needs "
              "once it forks its walks and Parquet writer (they share the parent's arrays copy-on-write). Both are "
              "sampled every 0.1 s.",
              "", "Seconds per stage (from the release's manifest, `--timings`):", "",
              "| stage | " + " | ".join(f"{r['scale']}x" for r in runs) + " |", "|---|" + "---:|" * len(runs)]
    for name in names:
        row = []
        for r in runs:
            st = next((x for x in r["stages"] if x["stage"] == name), None)
            row.append("" if st is None or st.get("seconds") is None else f"{st['seconds']:.1f}")
        lines.append(f"| {name.replace('|', chr(92) + '|')} | " + " | ".join(row) + " |")
        parts = next((x.get("parts") for x in runs[-1]["stages"] if x["stage"] == name), None)
        for part in parts or {}:
            vals = [next((x.get("parts", {}).get(part) for x in r["stages"] if x["stage"] == name), None) for r in runs]
            lines.append(f"| &nbsp;&nbsp;{part} | " + " | ".join("" if v is None else f"{v:.1f}" for v in vals) + " |")
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
    axes[0].set_xlabel("rows (millions, D0 + new)")
    axes[0].set_ylabel("seconds")
    axes[0].legend(fontsize=8)
    axes[1].plot(total, [r["peak_pss_mb"] / 1024 for r in runs], "o-", label="peak PSS (process tree)")
    axes[1].axhline(8, color="C3", ls=":", lw=1, label="target 8 GB")
    axes[1].set_xlabel("rows (millions, D0 + new)")
    axes[1].set_ylabel("GB")
    axes[1].legend(fontsize=8)
    fig.suptitle("debiased-nli build builders/snli.yaml (all four configs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "build_scale.png", dpi=130)


# ------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write the input Parquet (once; resumable per file)")
    g.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="one timed build (resumable: skipped when its result exists)")
    r.add_argument("--scale", type=int, choices=SCALES, required=True)
    s = sub.add_parser("same", help="chunked build == in-memory build on a slice")
    s.add_argument("--rows", type=int, default=200_000)
    pr = sub.add_parser("profile", help="cProfile of a whole build")
    pr.add_argument("--scale", type=int, default=1)
    sub.add_parser("report", help="write benchmarks/results/build_scale.{md,json,png}")
    c = sub.add_parser("compare", help="old code against this one, interleaved, with equality checks")
    c.add_argument("--scale", type=int, choices=SCALES, required=True)
    c.add_argument("--old", type=Path, required=True, help="a checkout of the old code (e.g. a git worktree)")
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--reseed", action="store_true", help="also build the old code with --seed 43 (row overlap reference)")
    sub.add_parser("speedup", help="write benchmarks/results/build_scale_speedup.{md,json}")
    o = sub.add_parser("overlap", help="old code against this one (fits started on D0's vocabulary), byte-equal releases")
    o.add_argument("--scale", type=int, choices=SCALES, required=True)
    o.add_argument("--old", type=Path, required=True, help="a checkout of the old code (e.g. a git worktree)")
    o.add_argument("--rounds", type=int, default=1)
    orp = sub.add_parser("overlap-report", help="write benchmarks/results/build_scale_overlap.{md,json}")
    orp.add_argument("--old-commit", default="1b846f9")
    for p in (g, r, s, pr, c, o, orp, sub.choices["report"], sub.choices["speedup"]):
        p.add_argument("--data", type=Path, default=DATA)
        p.add_argument("--work", type=Path, default=WORK)
    args = ap.parse_args(argv)
    if args.cmd == "generate":
        generate(args.data, args.seed)
    elif args.cmd == "run":
        print(json.dumps(run_scale(args.scale, args.data, args.work), indent=1))
    elif args.cmd == "same":
        print(json.dumps(same_as_in_memory(args.rows, args.data, args.work), indent=1)[:3000])
    elif args.cmd == "profile":
        print(profile_build(args.scale, args.data, args.work))
    elif args.cmd == "compare":
        res = compare_scale(args.scale, args.data, args.work, args.old.resolve(), args.rounds, args.reseed)
        print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    elif args.cmd == "speedup":
        speedup_report(args.work)
    elif args.cmd == "overlap":
        res = overlap_scale(args.scale, args.data, args.work, args.old.resolve(), args.rounds)
        print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    elif args.cmd == "overlap-report":
        overlap_report(args.work, args.old_commit)
    else:
        report(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
