"""The real PDD run of issue 10 on the 20k SNLI sample (results: benchmarks/results/pdd_snli.{md,json,png}).

Stages (each resumable; run each under the heavy lock, at most ~20 minutes at a time):
  run --tau T   `debiased-nli build` of the SNLI recipe's `pdd` profile on the 20k sample, with the offline
                stand-ins: teacher = all-MiniLM-L6-v2 fine-tuned by `debiased-nli train` (~/runs/pdd/teacher),
                MLM = the MiniLM masked-LM stand-in (benchmarks/pdd_mlm_standin.py). The perturbations are
                checkpointed in ~/runs/pdd/tau<T>/work: stop it (SIGINT, e.g. `timeout -s INT 1140`) and rerun
                to continue. The release goes to /work/releases/pdd-snli (tau' = 4.52) or
                /work/releases/pdd-snli-tau20.
  report        independent hypothesis-only accuracy before/after, and the markdown/JSON/plot.

tau' = 20 * sqrt(20000 / 391120) = 4.52: the paper's threshold (Table 10, on MNLI's 391,120 rows) scaled to
the sample, since z grows with sqrt(n) for a feature of the same relative frequency (spec, Part C).

    flock /tmp/debiased-heavy.lock timeout -s INT 1140 python benchmarks/pdd_run.py run --tau 4.52
    flock /tmp/debiased-heavy.lock timeout -s INT 1140 python benchmarks/pdd_run.py run --tau 20
    python benchmarks/pdd_run.py report

A fresh run that leaves the committed one alone: add `--run-dir ~/runs/pdd-2 --releases /work/releases/pdd-2`
to every command (the teacher is still read from ~/runs/pdd/teacher, or $PDD_TEACHER). `--engine padded`
runs the straightforward forward passes (benchmarks/bench_pdd.py compares the two).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("DEBIASED_NLI_SHARED", ROOT.parent / "shared")) / "data"
RUNS = Path(os.environ.get("PDD_RUN_DIR", Path.home() / "runs" / "pdd"))
MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
RELEASES = Path(os.environ.get("PDD_RELEASES", "/work/releases"))
SNLI = SHARED / "snli" / "train_sample.parquet"
SNLI_DEV = SHARED / "snli" / "dev.parquet"
RESULTS = ROOT / "benchmarks" / "results"
TEACHER = Path(os.environ.get("PDD_TEACHER", RUNS / "teacher"))
MLM = Path(os.environ.get("PDD_MLM", MODELS / "minilm-mlm-pdd-standin"))
TAU_SCALED = round(20 * math.sqrt(20000 / 391120), 2)  # 4.52


# the runs the report shows: (tau, dtype of the teacher and fill forward passes)
RUN_KEYS = ((TAU_SCALED, "float32"), (TAU_SCALED, "bfloat16"), (20.0, "float32"))
_DTYPE_SUFFIX = {"float32": "", "bfloat16": "-bf16"}


def tau_dir(tau: float, dtype: str = "float32") -> Path:
    return RUNS / f"tau{tau:g}{_DTYPE_SUFFIX[dtype]}"


def release_dir(tau: float, dtype: str = "float32") -> Path:
    name = "pdd-snli" if abs(tau - TAU_SCALED) < 1e-9 else f"pdd-snli-tau{tau:g}"
    return RELEASES / f"{name}{_DTYPE_SUFFIX[dtype]}"


def run_name(tau: float, dtype: str = "float32") -> str:
    """The run's key in pdd_snli.json and the suffix of its files (``4.52``, ``4.52-bf16``, ``20``)."""
    return f"{tau:g}{_DTYPE_SUFFIX[dtype]}"


def run(tau: float, threads: int, candidates: int, max_rows: int | None = None, engine: str = "auto",
        dtype: str = "float32") -> None:
    import torch

    from debiased_nli.release.recipe import build, load_recipe

    torch.set_num_threads(threads)
    for need in (TEACHER / "config.json", MLM / "config.json"):
        if not need.exists():
            raise SystemExit(f"missing {need}: train the teacher / build the MLM stand-in first (see pdd_snli.md)")
    recipe = load_recipe(ROOT / "builders" / "snli.yaml", profile="pdd")
    step = next(f for f in recipe["filters"] if f["step"] == "pdd")
    step.update({"mlm": str(MLM), "teacher": str(TEACHER), "tau": tau, "candidates": candidates,
                 "work_dir": str(tau_dir(tau, dtype) / "work"), "teacher_max_length": 64, "engine": engine,
                 "dtype": dtype, "progress": True})
    recipe["name"], recipe["pretty_name"] = "debiased-snli-pdd-20k", "SNLI 20k sample, PDD (offline stand-in models)"
    start = time.time()
    res = build(recipe, release_dir(tau, dtype), data_files={"train": [str(SNLI)]}, overwrite=True, progress=True,
                max_rows=max_rows)
    seconds = time.time() - start
    report = next(s["report"] for s in res.manifest["stages"] if s["stage"] == "pdd: pdd")
    out = tau_dir(tau, dtype)
    stages = out / "stages.jsonl"
    with open(stages, "a") as f:
        f.write(json.dumps({"completed": True, "seconds": round(seconds, 1),
                            "computed": report["operations"]["computed"]}) + "\n")
    (out / "pdd.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    print(json.dumps({"tau": tau, "dtype": dtype, "rows": report["rows"], "release": str(release_dir(tau, dtype))}))


def hypothesis_only_eval(ds, task, seed: int = 0) -> dict:
    """Out-of-fold accuracy of a fresh TF-IDF hypothesis-only model on ``ds``, and the accuracy on SNLI dev of
    one trained on all of ``ds`` (how much hypothesis-only signal the data teaches)."""
    import numpy as np
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    from debiased_nli.data.loading import labels_of, load_task
    from debiased_nli.bias.features import build_feature_matrix
    from debiased_nli.bias.featurize import add_features
    from debiased_nli.bias.hypothesis_only import out_of_fold_tfidf

    feats, _ = add_features(ds.select_columns(["premise", "hypothesis", "label", "uid", "origin", "method"]), task,
                            hypothesis_only=None, seed=seed, progress=False)
    oof = out_of_fold_tfidf(build_feature_matrix(feats), labels_of(ds), 3, seed=seed, progress=False)
    dev = load_task("snli", data_files=str(SNLI_DEV)).dataset
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    X = vec.fit_transform(ds["hypothesis"])
    clf = LogisticRegression(max_iter=300, random_state=seed).fit(X, labels_of(ds))
    dev_acc = float((clf.predict(vec.transform(dev["hypothesis"])) == labels_of(dev)).mean())
    return {"rows": len(ds), "oof_accuracy": round(oof.accuracy, 4), "dev_accuracy_trained_on_it": round(dev_acc, 4)}


def report() -> None:
    import datasets

    from debiased_nli.data.loading import load_task
    from debiased_nli.methods.pdd.step import plot_pdd, render_pdd_md

    RESULTS.mkdir(parents=True, exist_ok=True)
    original = load_task("snli", data_files=str(SNLI)).dataset
    out = {"teacher": None, "mlm": None, "runs": {}, "hypothesis_only": {"original": hypothesis_only_eval(original, "snli")}}
    if (TEACHER / "debiased_nli_train.json").exists():
        t = json.loads((TEACHER / "debiased_nli_train.json").read_text())
        out["teacher"] = {"path": str(TEACHER), **t["result"], "config": {k: t["config"][k] for k in (
            "model", "learning_rate", "batch_size", "max_length", "epochs", "max_train_rows", "max_dev_rows")}}
    if (MLM / "standin.json").exists():
        out["mlm"] = {"path": str(MLM), **json.loads((MLM / "standin.json").read_text())}
    for tau, dtype in RUN_KEYS:
        path = tau_dir(tau, dtype) / "pdd.json"
        if not path.exists():
            continue
        name = run_name(tau, dtype)
        rep = json.loads(path.read_text())
        stages = [json.loads(l) for l in (tau_dir(tau, dtype) / "stages.jsonl").read_text().splitlines() if l.strip()]
        kept = datasets.load_dataset(str(release_dir(tau, dtype)), "pdd", split="train")
        cache = tau_dir(tau, dtype) / "work" / "perturbations.cache.jsonl"
        n_perturbed = sum(1 for line in open(cache) if line.strip()) if cache.exists() else 0
        seconds = sum(s["seconds"] for s in stages)
        out["runs"][name] = {"tau": tau, "dtype": dtype, "report": rep, "release": str(release_dir(tau, dtype)),
                             "stages": stages, "perturbations_computed": n_perturbed, "stage_seconds": round(seconds, 1),
                             "perturbations_per_second": round(n_perturbed / seconds, 3) if seconds else None,
                             "hypothesis_only_after": hypothesis_only_eval(kept, "snli")}
        title = f"PDD on the 20k SNLI sample, tau = {tau:g}" + (f", {dtype} forward passes" if dtype != "float32" else "")
        (RESULTS / f"pdd_snli_tau{name}.md").write_text(render_pdd_md(rep, title))
        plot_pdd(rep, RESULTS / f"pdd_snli_tau{name}.png")
    (RESULTS / "pdd_snli.json").write_text(json.dumps(out, indent=2, sort_keys=True, default=str) + "\n")
    (RESULTS / "pdd_snli.md").write_text(render_summary(out))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1, default=str))


def render_summary(out: dict) -> str:
    """benchmarks/results/pdd_snli.md: models, per-run figures, the hypothesis-only check, the commands."""
    L = ["# PDD on the 20k SNLI sample (offline stand-in models, CPU)", "",
         "Produced by `benchmarks/pdd_run.py` (commands at the end). PDD was not evaluated on SNLI in the paper; "
         "this is an NLI stand-in for its MNLI setting, with stand-in models (no XLM-R large, no BERT-base here). "
         "No GPU was lent to this task: every figure is from the shared 2-core CPU machine.", ""]
    t, m = out.get("teacher"), out.get("mlm")
    if t:
        L.append(f"- teacher: all-MiniLM-L6-v2 fine-tuned by `debiased-nli train` on {t['train_rows']:,} rows of the sample "
                 f"({t['config']['epochs']} epoch, max length {t['config']['max_length']}, lr {t['config']['learning_rate']}, "
                 f"batch {t['config']['batch_size']}): dev accuracy {t['dev_accuracy']:.3f} on {t['dev_rows']:,} SNLI dev rows, "
                 f"{t['train_seconds']:.0f} s of training")
    if m:
        L.append(f"- masked LM: MiniLM + tied MLM head trained {m['steps']} steps ({m['train_seconds']:.0f} s) on the 20k SNLI "
                 f"train sample in the prompt format; held-out recovery (1,000 SNLI dev prompts, 25% of words masked): "
                 f"top-1 {m['recovery']['top1']}, top-5 {m['recovery']['top5']}, top-1 among fill tokens "
                 f"{m['recovery']['top1_fill_vocabulary']} (before training: top-1 {m['recovery_before']['top1']})")
    h0 = out["hypothesis_only"]["original"]
    L += ["", "| | original | " + " | ".join(
        f"PDD tau = {r['tau']:g}" + (f" ({r['dtype']})" if r["dtype"] != "float32" else "") for r in out["runs"].values()) + " |",
          "|---|---|" + "---|" * len(out["runs"])]
    runs = out["runs"]

    def row(name, orig, f):
        L.append(f"| {name} | {orig} | " + " | ".join(str(f(r)) for r in runs.values()) + " |")

    row("rows", f"{h0['rows']:,}", lambda r: f"{r['report']['rows']['output']:,}")
    row("added (keep) / replaced (lose)", "", lambda r: f"{r['report']['rows']['added']:,} / {r['report']['rows']['replaced']:,}")
    row("operations attempted / failed", "", lambda r: f"{r['report']['operations']['attempted']:,} / "
                                                        f"{r['report']['operations']['failed']:,}")
    row("acceptance", "", lambda r: r["report"]["operations"]["acceptance"])
    row("features above tau (unigram / overlap / hypo-only), before", "",
        lambda r: " / ".join(str(r["report"]["z"]["before"].get(f, {}).get("above_tau", "")) for f in ("unigram", "overlap", "hypo_only")))
    row("features above tau, after", "",
        lambda r: " / ".join(str(r["report"]["z"]["after"].get(f, {}).get("above_tau", "")) for f in ("unigram", "overlap", "hypo_only")))
    row("largest \\|z\\| before / after (hypo-only)", "", lambda r: f"{r['report']['z']['before']['hypo_only']['max_abs_z']:.1f} / "
                                                                  f"{r['report']['z']['after']['hypo_only']['max_abs_z']:.1f}")
    row("hypothesis-only accuracy, out-of-fold on the data", h0["oof_accuracy"],
        lambda r: r["hypothesis_only_after"]["oof_accuracy"])
    row("hypothesis-only model trained on the data: SNLI dev accuracy", h0["dev_accuracy_trained_on_it"],
        lambda r: r["hypothesis_only_after"]["dev_accuracy_trained_on_it"])
    row("perturbations computed / stage seconds / per second", "",
        lambda r: f"{r['perturbations_computed']:,} / {r['stage_seconds']:.0f} / {r['perturbations_per_second']}")
    row("release", "", lambda r: f"`{r['release']}`")
    L += ["", "Per-run details (features, failures, twenty examples): " + ", ".join(
        f"`pdd_snli_tau{k}.md`" for k in runs) + ".", ""]
    findings = RESULTS / "pdd_snli_findings.md"  # the hand-written reading of the figures above, kept across reports
    if findings.exists():
        L += [findings.read_text().rstrip(), ""]
    L += ["## Commands", "", "```",
        "flock /tmp/debiased-heavy.lock timeout 1140 debiased-nli train snli --data-files train=../shared/data/snli/train_sample.parquet \\",
        "    --dev-files ../shared/data/snli/dev.parquet --model ~/.cache/debiased-nli/models/all-minilm-l6-v2 --out ~/runs/pdd/teacher \\",
        "    --epochs 1 --max-length 64 --batch-size 16 --lr 5e-5 --max-train-rows 6000 --max-dev-rows 1000 --eval-steps 50 --threads 2",
        "flock /tmp/debiased-heavy.lock python benchmarks/pdd_mlm_standin.py --steps 600 --stage-minutes 18 --threads 2   # rerun until done",
        f"flock /tmp/debiased-heavy.lock timeout -s INT 1140 python benchmarks/pdd_run.py run --tau {TAU_SCALED}   # rerun until done",
        f"flock /tmp/debiased-heavy.lock timeout -s INT 1140 python benchmarks/pdd_run.py run --tau {TAU_SCALED} --dtype bfloat16"
        "   # only on a CPU with avx512_bf16 / amx_bf16",
        f"flock /tmp/debiased-heavy.lock timeout -s INT 1140 python benchmarks/pdd_run.py run --tau {TAU_SCALED} --engine padded \\",
        "    --run-dir ~/runs/pdd-padded --releases /work/releases/pdd-padded   # the same-day baseline of the packed engine",
        "flock /tmp/debiased-heavy.lock timeout -s INT 1140 python benchmarks/pdd_run.py run --tau 20",
        "python benchmarks/pdd_run.py report", "```", ""]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    global RUNS, RELEASES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["run", "report"])
    ap.add_argument("--tau", type=float, default=TAU_SCALED)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--max-rows", type=int, help="only the first N rows (a smoke test; use other --run-dir/--releases)")
    ap.add_argument("--engine", choices=["auto", "packed", "bucketed", "padded"], default="auto",
                    help="forward passes of fill and teacher (debiased_nli/methods/pdd/teacher.py); the committed runs of "
                         "2026-11-23 used the straightforward one, now `padded`")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="arithmetic of the teacher's and the fill's forward passes (debiased_nli/methods/pdd/encoder.py); "
                         "a bfloat16 run has its own folders (tau<T>-bf16, pdd-snli-bf16)")
    ap.add_argument("--run-dir", help=f"where the tau<T> folders go (default $PDD_RUN_DIR or ~/runs/pdd, now {RUNS}); "
                                      f"the teacher is still read from $PDD_TEACHER (now {TEACHER})")
    ap.add_argument("--releases", help=f"where the releases go (default $PDD_RELEASES or /work/releases, now {RELEASES})")
    args = ap.parse_args(argv)
    if args.run_dir:
        RUNS = Path(args.run_dir).expanduser()
    if args.releases:
        RELEASES = Path(args.releases).expanduser()
    if args.stage == "run":
        tau_dir(args.tau, args.dtype).mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        try:
            run(args.tau, args.threads, args.candidates, args.max_rows, args.engine, args.dtype)
        except KeyboardInterrupt:
            with open(tau_dir(args.tau, args.dtype) / "stages.jsonl", "a") as f:
                f.write(json.dumps({"completed": False, "seconds": round(time.time() - t0, 1)}) + "\n")
            print("interrupted; rerun the same command to continue", flush=True)
            return 3
    else:
        report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
