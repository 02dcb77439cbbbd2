"""benchmarks/results/eval_snli_minilm_<name>.{md,png} and _base/_zfiltered.json from a run of
benchmarks/eval_snli_minilm.sh (its training records and the two `debiased-nli evaluate` outputs).

    bash benchmarks/eval_snli_minilm.sh all 1000 out/eval_runs_full
    python benchmarks/eval_snli_minilm_report.py out/eval_runs_full --name full --rows all --examples 1000
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _git_head() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the OUT folder of eval_snli_minilm.sh")
    ap.add_argument("--name", required=True, help="suffix of the result files (e.g. full)")
    ap.add_argument("--rows", default="all", help="the N the script was run with")
    ap.add_argument("--examples", default="1000", help="the E the script was run with")
    ap.add_argument("--release", type=Path, default=ROOT / "out" / "snli-release")
    args = ap.parse_args(argv)
    run = args.run
    for need in ("eval-base/results.json", "eval-zf/results.json", "eval-zf/report.md"):
        if not (run / need).exists():
            raise SystemExit(f"{run / need} is missing: run benchmarks/eval_snli_minilm.sh to the end first")
    manifest = json.loads((args.release / "manifest.json").read_text())
    zf_rows = sum(f["rows"] for f in manifest["files"]["z_filtered"]["train"])
    train = []
    for kind, label in (("base", "SNLI sample"), ("zf", "z_filtered")):
        for seed in (1, 2, 3):
            rec = json.loads((run / f"{kind}-s{seed}" / "debiased_nli_train.json").read_text())
            train.append((label, seed, rec["result"]))
    cfg = json.loads((run / "base-s1" / "debiased_nli_train.json").read_text())["config"]
    rows = "all" if args.rows == "all" else f"{int(args.rows):,}"
    lines = [f"# MiniLM on the 20k SNLI sample vs its z_filtered release ({zf_rows:,} rows), 3 seeds each", "",
             f"Command (2 CPU cores): `bash benchmarks/eval_snli_minilm.sh {args.rows} {args.examples} {run}`, then "
             f"`python benchmarks/eval_snli_minilm_report.py {run} --name {args.name} --rows {args.rows} "
             f"--examples {args.examples}` (this file).", "",
             "- Model: all-MiniLM-L6-v2 from ../shared/models (a fresh 3-way head).",
             f"- Data: {rows} rows of `../shared/data/snli/train_sample.parquet`, and {rows} of the {zf_rows:,} rows of "
             "the `z_filtered` config of `out/snli-release` (`debiased-nli build builders/snli.yaml --data-files "
             "train=../shared/data/snli/train_sample.parquet --out out/snli-release`; report written at commit "
             f"{_git_head()}).",
             f"- `debiased-nli train`: lr {cfg['learning_rate']:g}, batch {cfg['batch_size']}, max length "
             f"{cfg['max_length']}, {cfg['epochs']:g} epoch, {cfg['warmup_ratio']:.0%} warm-up, best checkpoint on "
             f"{cfg['max_dev_rows']} SNLI dev rows, seeds 1-3. **Sized for the CPU budget**: the papers train "
             "RoBERTa-large for several epochs at lr 1e-5 and max length 128. The models trained while other "
             "work shared the machine: the seconds are not a speed figure (`bench_train.py` is).",
             f"- `debiased-nli evaluate`: the same seeded {args.examples}-row sample of each set for every model "
             "(HANS is scored 2-way).", "", "## Training", "",
             "| data | seed | rows | train seconds | examples/s | dev accuracy (500 rows) |",
             "|---|---|---:|---:|---:|---:|"]
    for label, seed, r in train:
        lines.append(f"| {label} | {seed} | {r['train_rows']:,} | {r['train_seconds']:.0f} | "
                     f"{r['train_examples_per_second']:.1f} | {r['dev_accuracy']:.3f} |")
    report = (run / "eval-zf" / "report.md").read_text()
    report = report.replace("accuracy.png", f"eval_snli_minilm_{args.name}.png")
    lines += ["", "## Results (from `eval-zf/report.md`)", "", f"![accuracy](eval_snli_minilm_{args.name}.png)", "",
              report.split("\n", 1)[1] if report.startswith("#") else report]
    (RESULTS / f"eval_snli_minilm_{args.name}.md").write_text("\n".join(lines).rstrip() + "\n")
    if (run / "eval-zf" / "accuracy.png").exists():
        shutil.copyfile(run / "eval-zf" / "accuracy.png", RESULTS / f"eval_snli_minilm_{args.name}.png")
    shutil.copyfile(run / "eval-base" / "results.json", RESULTS / f"eval_snli_minilm_{args.name}_base.json")
    shutil.copyfile(run / "eval-zf" / "results.json", RESULTS / f"eval_snli_minilm_{args.name}_zfiltered.json")
    print(RESULTS / f"eval_snli_minilm_{args.name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
