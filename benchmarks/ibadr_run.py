"""The real IBADR run of issue 11 on CPU (see results/ibadr_snli.md for the commands and the results).

D0 = the 20k SNLI sample; theta_s = all-MiniLM-L6-v2 fine-tuned on 2K rows (3 epochs, lr 5e-5, the paper's);
theta_g = SmolLM2-135M + LoRA; N_bi 5; 2 iterations of a few hundred samples; M = all-MiniLM-L6-v2
fine-tuned with `debiased-nli train`, epsilon 0.5.

Stages (each resumable; a finished stage is skipped; `all` runs them in order, each unit under the heavy
lock `flock /tmp/debiased-heavy.lock`, at most ~20 minutes per acquisition):
  train_m   M: `debiased-nli train` on 4,000 rows of the 20k sample (sessions of at most 19 minutes);
            skipped when RUN/M exists: the committed run reuses PDD's teacher (benchmarks/pdd_run.py:
            MiniLM on 6,000 rows of the sample, 1 epoch, dev accuracy 0.729), copied to RUN/M
  ibadr     `debiased-nli ibadr snli ... --time-budget 600` (killed after 19 minutes at the latest),
            repeated until its last iteration is complete
  check     the paper-level check: samples with b1 and with b5 from the last generator, compared on beta,
            hypothesis-only accuracy (a TF-IDF model fitted on D0) and max |z|
  release   the `ibadr` release of the 20k sample (plus z_filtered / z_aug / par_z / seq_z with the IBADR rows
            as D_G) at /work/releases/ibadr-snli (IBADR_RELEASE overrides)
  report    results/ibadr_snli.json and results/ibadr_snli.md
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RUN = Path(os.environ.get("IBADR_RUN_DIR", Path.home() / "runs" / "ibadr_run"))
RELEASE = Path(os.environ.get("IBADR_RELEASE", "/work/releases/ibadr-snli"))
MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SNLI = SHARED / "snli" / "train_sample.parquet"
SNLI_DEV = SHARED / "snli" / "dev.parquet"
HERE = Path(__file__).resolve().parent / "results"
LOCK = "/tmp/debiased-heavy.lock"
THREADS = "2"  # the heavy lock is held: both cores

M_ROWS = 4000
UNIT_TIMEOUT = "1140"  # seconds: a unit holding the heavy lock is killed after 19 minutes and resumes on the next
EPSILON = 0.5  # M (MiniLM) is never 0.95-confident on real SNLI dev rows (generator_run.md)
CHECK_SAMPLES = 150

IBADR_ARGS = [
    "--generator", str(MODELS / "smollm2-135m-instruct"), "--lora", "--lora-r", "8", "--lora-alpha", "16",
    "--confidence-model", str(RUN / "M"), "--epsilon", str(EPSILON),
    "--shallow-model", str(MODELS / "all-minilm-l6-v2"), "--shallow-rows", "2000", "--shallow-epochs", "3",
    "--shallow-lr", "5e-5", "--shallow-max-length", "64", "--usm-rows", "2000",
    "--n-bi", "5", "--n-iter", "2", "--samples-per-iter", "240",
    # CPU budget: theta_g sees 200 indicator-stratified pool rows per iteration (3 epochs = 75 steps of 8,
    # then 1 epoch = 25 steps), lr 3e-4 for LoRA (the paper's 5e-5 is for fully fine-tuning GPT-2 large)
    "--gen-rows", "200", "--gen-batch-size", "8", "--gen-lr", "3e-4", "--gen-max-length", "64",
    "--gen-epochs-first", "3", "--gen-epochs-later", "1",
    "--top-p", "0.9", "--max-new-tokens", "64", "--sample-batch-size", "16", "--shard-size", "80",
    "--seed", "0", "--cpu", "--threads", THREADS,
]


def sh(cmd: list[str], check: bool = True) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=check).returncode


def _timed(name: str, fn) -> None:
    path = RUN / "stage_seconds.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    t0 = time.perf_counter()
    fn()
    data[name] = round(data.get(name, 0.0) + time.perf_counter() - t0, 1)
    path.write_text(json.dumps(data, indent=2))


def train_m() -> None:
    """One session of training M (checkpoints every 50 steps; a rerun resumes from the last one)."""
    if (RUN / "M" / "debiased_nli_train.json").exists():
        return
    _timed("train_m", lambda: sh([
        "timeout", UNIT_TIMEOUT, "debiased-nli", "train", "snli", "--data-files", str(SNLI), "--dev-files", str(SNLI_DEV),
        "--model", str(MODELS / "all-minilm-l6-v2"), "--out", str(RUN / "M"), "--lr", "5e-5", "--batch-size", "16",
        "--max-length", "64", "--epochs", "1", "--max-train-rows", str(M_ROWS), "--max-dev-rows", "500",
        "--eval-steps", "50", "--cpu", "--threads", THREADS], check=False))


def ibadr_done() -> bool:
    return (RUN / "ibadr" / "pool.parquet").exists()


def ibadr_unit() -> None:
    """One session of the IBADR run (at most ~12 minutes of new units, then it pauses)."""
    if ibadr_done():
        return
    rc = []
    _timed("ibadr", lambda: rc.append(sh(["timeout", UNIT_TIMEOUT, "debiased-nli", "ibadr", "snli", "--data-files",
                                          str(SNLI), "--out", str(RUN / "ibadr"), *IBADR_ARGS, "--time-budget", "600",
                                          "--gen-chunk-steps", "10"], check=False)))
    if rc[0] not in (0, 3, 124):  # 3: paused at the time budget; 124: killed by the timeout; both resume
        raise SystemExit(rc[0])


def _load_d0():
    from debiased_nli.data.loading import load_task
    return load_task("snli", data_files=str(SNLI)).dataset


def check() -> None:
    """Samples with b1 and with b5 (the same label sequence) from the last iteration's generator."""
    import numpy as np

    from debiased_nli.methods.generation.conditional import ConditionalFormat
    from debiased_nli.methods.generation.models import load_tokenizer
    from debiased_nli.methods.generation.sample import generate_samples
    from debiased_nli.methods.ibadr.indicators import sample_labels

    gen = RUN / "ibadr" / "iter-2" / "generator"
    tok = load_tokenizer(str(gen))
    labels = ("entailment", "neutral", "contradiction")
    fmt = ConditionalFormat.for_tokenizer(tok, labels, ("bias",))
    ybar = sample_labels(CHECK_SAMPLES, 3, np.random.default_rng(12345))
    t0 = time.perf_counter()
    for b in ("b1", "b5"):
        prompts = [fmt.prompt(int(y), {"bias": b}) for y in ybar]
        generate_samples(str(gen), str(RUN / f"check_{b}"), "snli", CHECK_SAMPLES, shard_size=100, seed=777,
                         batch_size=16, top_p=0.9, max_new_tokens=64, condition="prompts", prompts=prompts,
                         parse=fmt.parse, cpu=True)
    seconds = time.perf_counter() - t0
    measure_check(seconds)


def measure_check(seconds: float | None = None) -> None:
    import numpy as np
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    from debiased_nli.bias.audit import audit_dataset
    from debiased_nli.methods.confidence import confidence_filter
    from debiased_nli.data.loading import labels_of
    from debiased_nli.methods.generation.sample import load_generated, summarize
    from debiased_nli.data.tasks import get_task
    from debiased_nli.methods.ibadr.shallow import bias_degree

    d0 = _load_d0()
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    hyp_model = LogisticRegression(max_iter=1000).fit(vec.fit_transform(d0["hypothesis"]), labels_of(d0))
    shallow = json.loads((RUN / "ibadr" / "iter-2" / "shallow.json").read_text())["model"]
    out = {"samples_per_indicator": CHECK_SAMPLES, "shallow_model": shallow, "seconds": seconds}
    for b in ("b1", "b5"):
        folder = RUN / f"check_{b}"
        rows = load_generated(str(folder))
        s = summarize(folder, get_task("snli"))
        beta = bias_degree(rows, shallow, get_task("snli"), max_length=64, progress=False)
        y = labels_of(rows)
        hyp_acc = float((hyp_model.predict(vec.transform(rows["hypothesis"])) == y).mean())
        audit = audit_dataset(rows.select_columns(["premise", "hypothesis", "label", "uid", "origin", "method"]),
                              "snli", progress=False)
        kept, rej = confidence_filter(rows, str(RUN / "M"), "snli", EPSILON, progress=False)
        out[b] = {"parsed": len(rows), "parse_rate": s["parse_rate"], "labels": s["labels"],
                  "distinct_2": s["distinct_2_hypothesis"], "beta_mean": round(float(beta.mean()), 4),
                  "beta_median": round(float(np.median(beta)), 4),
                  "hypothesis_only_accuracy_d0_model": round(hyp_acc, 4),
                  "hypothesis_only_accuracy_oof": audit["hypothesis_only_accuracy"],
                  "max_abs_z": audit["max_abs_z"], "top_features": audit["features"][:6],
                  "acceptance_at_epsilon": round(len(kept) / max(len(rows), 1), 4)}
    # the same measures on D0's rows of each indicator group (iteration 1's theta_s), for scale
    import datasets
    scores = datasets.Dataset.from_parquet(str(RUN / "ibadr" / "iter-1" / "scores.parquet"))
    ind = np.asarray(scores["indicator"])
    d0_groups = {}
    for g in (1, 5):
        idx = np.nonzero(ind[:len(d0)] == g)[0]
        sub = d0.select(idx)
        d0_groups[f"b{g}"] = {"rows": len(sub), "beta_mean": round(float(np.asarray(scores["beta"])[idx].mean()), 4),
                              "hypothesis_only_accuracy_d0_model_in_sample": round(float(
                                  (hyp_model.predict(vec.transform(sub["hypothesis"])) == labels_of(sub)).mean()), 4)}
    out["d0_groups_iter1"] = d0_groups
    (RUN / "check.json").write_text(json.dumps(out, indent=2, default=str))


def release() -> None:
    if (RELEASE / "README.md").exists():
        return
    from debiased_nli.release.recipe import build, load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "builders" / "snli.yaml", profile="ibadr")
    params = ibadr_params()
    recipe["filters"] = [{"step": "ibadr", "config": "ibadr", **params}]
    recipe["new_rows"] = [{"step": "ibadr_rows", **params}]
    recipe.pop("profile", None)
    recipe["profiles"] = {}
    t0 = time.perf_counter()
    res = build(recipe, RELEASE, data_files=str(SNLI), overwrite=False)
    (RUN / "release.json").write_text(json.dumps({"out": str(res.out_dir), "configs": res.configs,
                                                  "seconds": round(time.perf_counter() - t0, 1)}, indent=2))


def ibadr_params() -> dict:
    """The run's settings as recipe parameters (they must equal the run's config.json to reuse it)."""
    cfg = json.loads((RUN / "ibadr" / "config.json").read_text())
    drop = {"task", "d0_rows", "d0_sha256"}
    return {"out": str(RUN / "ibadr"), **{k: v for k, v in cfg.items() if k not in drop}}


def audit_pool() -> dict:
    import datasets

    from debiased_nli.bias.audit import audit_dataset
    d0 = _load_d0()
    pool = datasets.Dataset.from_parquet(str(RUN / "ibadr" / "pool.parquet"))
    out = {}
    for name, ds in (("before", d0), ("after", pool)):
        a = audit_dataset(ds.cast(d0.features), "snli", progress=False)
        out[name] = {k: a[k] for k in ("n_rows", "labels", "hypothesis_only_accuracy", "max_abs_z", "z_threshold",
                                       "features_above_threshold")} | {"top": a["features"][:9]}
    return out


def all_() -> None:
    """Every stage, each unit under the heavy lock."""
    me = [sys.executable, str(Path(__file__).resolve())]
    while not (RUN / "M" / "debiased_nli_train.json").exists():
        sh(["flock", LOCK, *me, "train_m"])
    failures = 0
    while not ibadr_done():
        rc = sh(["flock", LOCK, *me, "ibadr"], check=False)
        failures = failures + 1 if rc not in (0, 3) else 0
        if failures >= 2:
            raise SystemExit(f"the IBADR session failed twice in a row (exit {rc}); see the log")
    if not (RUN / "check.json").exists():
        sh(["flock", LOCK, *me, "check"])
    if not (RELEASE / "README.md").exists():
        sh(["flock", LOCK, *me, "release"])
    sh([*me, "report"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["all", "train_m", "ibadr", "check", "measure_check", "release", "report"])
    args = ap.parse_args()
    RUN.mkdir(parents=True, exist_ok=True)
    {"all": all_, "train_m": train_m, "ibadr": ibadr_unit, "check": lambda: _timed("check", check),
     "measure_check": measure_check, "release": lambda: _timed("release", release),
     "report": write_report}[args.stage]()


def _iterations() -> list[dict]:
    out = []
    for it in sorted((RUN / "ibadr").glob("iter-*"), key=lambda p: int(p.name.split("-")[1])):
        if (it / ".complete").exists():
            out.append(json.loads((it / "report.json").read_text()))
    return out


def _examples(total: int = 20) -> list[dict]:
    """Twenty examples: per complete iteration, as many kept as rejected rows (the first ones)."""
    import datasets
    labels = ("entailment", "neutral", "contradiction")
    rows = []
    done = sorted((RUN / "ibadr").glob("iter-*/.complete"))
    each = total // (2 * max(len(done), 1))
    for it in done:
        folder = it.parent
        for name in ("kept", "rejected"):
            ds = datasets.Dataset.from_parquet(str(folder / f"{name}.parquet"))
            for r in ds.select(range(min(each, len(ds)))):
                rows.append({"iteration": folder.name, "filter": name, "indicator": f"b{r['indicator']}",
                             "label": labels[r["label"]], "premise": r["premise"], "hypothesis": r["hypothesis"],
                             "p_M": None if r["confidence"] is None else round(r["confidence"], 3),
                             "beta": round(r["beta"], 3) if r.get("beta") is not None else None})
    return rows


def write_report() -> None:
    import platform
    summary: dict = {"run_dir": str(RUN), "ibadr_args": IBADR_ARGS, "epsilon": EPSILON,
                     "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU"}
    m = RUN / "M" / "debiased_nli_train.json"
    summary["M"] = json.loads(m.read_text())["result"] if m.exists() else None
    summary["stage_seconds"] = json.loads((RUN / "stage_seconds.json").read_text()) if (RUN / "stage_seconds.json").exists() else {}
    summary["iterations"] = _iterations()
    summary["complete"] = ibadr_done()
    summary["check"] = json.loads((RUN / "check.json").read_text()) if (RUN / "check.json").exists() else None
    summary["release"] = json.loads((RUN / "release.json").read_text()) if (RUN / "release.json").exists() else None
    summary["audit"] = audit_pool() if ibadr_done() else None
    summary["examples"] = _examples() if summary["iterations"] else []
    HERE.mkdir(exist_ok=True)
    (HERE / "ibadr_snli.json").write_text(json.dumps(summary, indent=2, default=str))
    (HERE / "ibadr_snli.md").write_text(markdown(summary))
    print((HERE / "ibadr_snli.md").read_text())


def _fmt_counts(d: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (d or {}).items())


def markdown(s: dict) -> str:
    lines = ["# IBADR on CPU (issue 11): the 20k SNLI sample, MiniLM shallow model, SmolLM2-135M + LoRA", ""]
    lines += ["Commands (every stage resumable; outputs under `~/runs/ibadr_run`, the release at "
              f"`{RELEASE}`):", "", "```", "python benchmarks/ibadr_run.py all     # each unit under "
              "flock /tmp/debiased-heavy.lock", "python benchmarks/ibadr_run.py report  # this file", "```", "",
              "`all` runs `train_m` (`debiased-nli train`), then `debiased-nli ibadr snli --data-files "
              "../shared/data/snli/train_sample.parquet --out ~/runs/ibadr_run/ibadr "
              + " ".join(IBADR_ARGS).replace(str(MODELS), "$MODELS").replace(str(RUN), "~/runs/ibadr_run")
              + " --time-budget 600 --gen-chunk-steps 10` (under `timeout 1140`) until it exits 0 (exit 3: paused at the time budget, "
              "or 124: killed by the timeout; rerun to continue), then `check`, `release` and `report`.", "",
              f"Machine: {s['machine']}, shared with other jobs. No GPU was lent to this task, so the larger GPU run "
              "of the issue was not made.", ""]
    if s["M"]:
        m = s["M"]
        lines += [f"* **M** (confidence filter): all-MiniLM-L6-v2 fine-tuned with `debiased-nli train` on {m['train_rows']:,} "
                  f"rows of the sample, 1 epoch, lr 5e-5, max length 64: SNLI dev accuracy {m['dev_accuracy']:.3f} "
                  f"({m['dev_rows']} dev rows), {m['train_seconds']:.0f} s. **epsilon = {s['epsilon']}**: this M is never "
                  "0.95-confident on real dev rows (`generator_run.md`), so Wu et al.'s 0.95 would keep nothing."]
    lines += ["* **theta_s**: all-MiniLM-L6-v2 + a new head, 2,000 random pool rows, 3 epochs, lr 5e-5 (the paper's, "
              "section 3.1), max length 64; re-trained from the pretrained encoder on a fresh 2,000-row sample of the "
              "pool in iteration 2 (USM).",
              "* **theta_g**: SmolLM2-135M-Instruct + LoRA (r 8, alpha 16, all linear layers), trained on 200 "
              "indicator-stratified rows of the pool per iteration (3 epochs in iteration 1, 1 epoch in iteration 2, "
              "continuing the adapter), batch 8, lr 3e-4, max 64 tokens. **Deviation** (CPU budget): the paper trains "
              "on the whole pool with lr 5e-5 (full fine-tuning of GPT-2 large).",
              "* **Sampling**: b-bar uniform in {b1, b2} (N_bi 5), y-bar uniform, top-p 0.9, at most 64 new tokens, "
              "240 samples per iteration (the paper: 200K), 2 iterations (the paper: 5).", ""]
    its = s["iterations"]
    if its:
        lines += ["## Iterations", "",
                  "| | " + " | ".join(f"iteration {r['iteration']}" for r in its) + " |", "|---|" + "---|" * len(its)]

        def row(name, fn):
            vals = []
            for r in its:
                try:
                    vals.append(str(fn(r)))
                except (KeyError, TypeError, IndexError):
                    vals.append("")
            lines.append(f"| {name} | " + " | ".join(vals) + " |")
        row("pool before -> after", lambda r: f"{r['pool_before']:,} -> {r['pool_after']:,}")
        row("theta_s", lambda r: f"{r['shallow']['train_rows']:,} rows, {r['shallow']['train_seconds']:.0f} s")
        row("beta of the pool: mean (q10 / q50 / q90)", lambda r: f"{r['scores']['beta_mean']} ({r['scores']['beta_quantiles']['0.1']} / "
            f"{r['scores']['beta_quantiles']['0.5']} / {r['scores']['beta_quantiles']['0.9']})")
        row("mean beta per group b1..b5", lambda r: " / ".join(str(g["beta_mean"]) for g in r["scores"]["groups"].values()))
        row("theta_g", lambda r: f"{r['generator']['rows']} rows x {r['generator']['epochs']} epoch(s) = "
            f"{r['generator']['steps']} steps, {r['generator']['seconds_per_step']} s/step, loss "
            f"{r['generator']['loss_first']} -> {r['generator']['loss_last']}")
        row("b-bar drawn", lambda r: _fmt_counts(r["indicators_drawn"]))
        row("samples, parse rate", lambda r: f"{r['samples']['samples']}, {r['samples']['parse_rate']}")
        row("unparseable by reason", lambda r: _fmt_counts(r["samples"]["unparseable_reasons"]))
        row("labels of the parsed samples", lambda r: _fmt_counts(r["samples"]["labels"]))
        row("distinct-2 (hypotheses)", lambda r: r["samples"]["distinct_2_hypothesis"])
        row("repeats dropped", lambda r: r["filter"]["repeats_within_iteration"])
        row(f"acceptance at epsilon {s['epsilon']}", lambda r: f"{r['filter']['kept']}/{r['filter']['rows']} = "
            f"{r['filter']['acceptance_rate']}")
        row("acceptance per label", lambda r: ", ".join(f"{k} {v['acceptance']}" for k, v in r["filter"]["per_label"].items()))
        row("labels of the kept rows", lambda r: ", ".join(f"{k} {v['kept']}" for k, v in r["filter"]["per_label"].items()))
        row("M's confidence q10/q50/q90", lambda r: " / ".join(str(r["filter"]["confidence_quantiles"][q]) for q in ("0.1", "0.5", "0.9")))
        row("mean beta of the kept rows", lambda r: r["filter"]["beta_mean_kept"])
        row("kept rows that copy a pool row", lambda r: r["filter"]["copies_of_pool_rows_kept"])
        row("seconds: theta_s / scores / theta_g / sampling / filter",
            lambda r: " / ".join(str(round(r["seconds"].get(k, 0))) for k in ("shallow", "scores", "generator", "samples", "filter")))
        lines.append("")
    if not s["complete"]:
        state = (f"{len(its)} of 2 iterations finished" if s["M"] else
                 "M is not trained yet, no iteration has started (the run waited for the shared heavy lock)")
        lines += [f"**The run is not complete** ({state}). Resume with `python benchmarks/ibadr_run.py all` "
                  "(every unit continues where it stopped), then `python benchmarks/ibadr_run.py report`.", ""]
    c = s["check"]
    if c:
        lines += ["## The paper-level check: samples generated with b1 against samples generated with b5", "",
                  f"{c['samples_per_indicator']} samples each from the last iteration's generator, the same label sequence; "
                  "beta under the last theta_s; hypothesis-only accuracy of a TF-IDF + logistic regression model fitted on "
                  "D0's hypotheses (does a row carry D0's hypothesis-only cues?) and out-of-fold within the set; max |z| "
                  "of the set's own z-statistics (`audit`).", "", "| | b1 | b5 |", "|---|---|---|"]
        for key, name in (("parse_rate", "parse rate"), ("labels", "labels"), ("beta_mean", "mean beta"),
                          ("beta_median", "median beta"),
                          ("hypothesis_only_accuracy_d0_model", "hypothesis-only accuracy (model fitted on D0)"),
                          ("hypothesis_only_accuracy_oof", "hypothesis-only accuracy (out-of-fold)"),
                          ("max_abs_z", "max |z|"), ("acceptance_at_epsilon", f"acceptance at epsilon {s['epsilon']}"),
                          ("distinct_2", "distinct-2")):
            v1, v5 = c["b1"][key], c["b5"][key]
            lines.append(f"| {name} | {_fmt_counts(v1) if isinstance(v1, dict) else v1} | "
                         f"{_fmt_counts(v5) if isinstance(v5, dict) else v5} |")
        g = c["d0_groups_iter1"]
        lines += ["", f"For scale, D0's own groups under iteration 1's theta_s: b1 mean beta {g['b1']['beta_mean']}, "
                  f"b5 {g['b5']['beta_mean']}; in-sample hypothesis-only accuracy b1 "
                  f"{g['b1']['hypothesis_only_accuracy_d0_model_in_sample']}, b5 "
                  f"{g['b5']['hypothesis_only_accuracy_d0_model_in_sample']}.", ""]
        verdict = [("mean beta", c["b1"]["beta_mean"] < c["b5"]["beta_mean"]),
                   ("hypothesis-only accuracy (D0 model)", c["b1"]["hypothesis_only_accuracy_d0_model"]
                    < c["b5"]["hypothesis_only_accuracy_d0_model"]),
                   ("max |z|", c["b1"]["max_abs_z"] < c["b5"]["max_abs_z"])]
        lines += ["Lower for b1 than for b5: " + ", ".join(f"{n}: {'yes' if ok else 'no'}" for n, ok in verdict), ""]
    a = s["audit"]
    if a:
        lines += ["## The pool before and after (`audit`)", "", "| | D0 | S after IBADR |", "|---|---|---|"]
        for key, name in (("n_rows", "rows"), ("labels", "labels"), ("hypothesis_only_accuracy", "hypothesis-only accuracy (out-of-fold)"),
                          ("max_abs_z", "largest |z|"), ("features_above_threshold", "features above the Bonferroni threshold")):
            b, f = a["before"][key], a["after"][key]
            lines.append(f"| {name} | {_fmt_counts(b) if isinstance(b, dict) else b} | {_fmt_counts(f) if isinstance(f, dict) else f} |")
        lines.append("")
    if s["release"]:
        r = s["release"]
        lines += ["## Release", "", f"`{r['out']}` (outside the repo), built in {r['seconds']} s with configs "
                  + ", ".join(f"`{k}` {v:,} rows" for k, v in r["configs"].items())
                  + ": `load_dataset('" + r["out"] + "', 'ibadr')`.", ""]
    if s["examples"]:
        lines += ["## Twenty examples (per iteration, as many kept as rejected by the confidence filter)", "",
                  "| iteration | filter | b-bar | label | premise | hypothesis | p_M(label) | beta |", "|---|---|---|---|---|---|---|---|"]
        for e in s["examples"][:20]:
            lines.append(f"| {e['iteration']} | {e['filter']} | {e['indicator']} | {e['label']} | {e['premise']} | "
                         f"{e['hypothesis']} | {e['p_M']} | {e['beta']} |")
        lines.append("")
    if s["stage_seconds"]:
        lines += ["Wall seconds per stage of this script (summed over sessions, lock waits excluded): "
                  + _fmt_counts(s["stage_seconds"]) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
