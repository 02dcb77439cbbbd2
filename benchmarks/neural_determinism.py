"""How many rows a neural step decides differently on another CPU (issue 32, item 2).

The z-path of a release is bit-identical across CPUs and thread counts (``bias/logreg.py``,
``tests/test_determinism.py``). The neural steps compute in float32 with kernels that depend on the
instruction set and the number of threads, so a score near a threshold can land on the other side.
This script runs one step twice on the same inputs, from fresh caches:

  native2   the machine's own kernels (AVX-512 here), 2 torch threads
  avx2_1    the kernels an AVX2-only machine would run, 1 thread: OPENBLAS_CORETYPE=Haswell (numpy,
            scipy), MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 (torch's BLAS and oneDNN),
            ATEN_CPU_CAPABILITY=avx2 (torch's own vectorised kernels)

and counts the rows whose keep/drop decision differs, with the scores on both sides.

    python benchmarks/neural_determinism.py aflite      # both settings (a finished one is skipped), then compare
    python benchmarks/neural_determinism.py confidence --model M --rows 'samples/shard-*.parquet'
    python benchmarks/neural_determinism.py pdd         # the teacher and masked LM trained once (native), then PDD
    python benchmarks/neural_determinism.py ibadr       # theta_s trained under each setting, beta and indicator groups
    python benchmarks/neural_determinism.py report      # benchmarks/results/neural_determinism.{json,md}

Outputs under ``$NEURAL_DET_RUN`` (default /work/runs/neural_det); one result file per step and
setting, so a killed run continues where it stopped.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUN = Path(os.environ.get("NEURAL_DET_RUN", "/work/runs/neural_det"))
MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SNLI = SHARED / "snli" / "train_sample.parquet"
RESULTS = Path(__file__).resolve().parent / "results"

SETTINGS = {
    "native2": {"threads": 2, "env": {}},
    "avx2_1": {"threads": 1, "env": {"OPENBLAS_CORETYPE": "Haswell", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                     "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}},
}

# the committed AFLite run's settings (benchmarks/results/aflite_snli.md): MiniLM, warm-up 1 epoch, batch 16,
# lr 5e-5, pairs cut at 64 tokens, seed 0; the audit is skipped (it decides nothing)
AFLITE_ARGS = ["--encoder", str(MODELS / "all-minilm-l6-v2"), "--warmup-epochs", "1", "--warmup-batch-size", "16",
               "--warmup-lr", "5e-5", "--max-length", "64", "--seed", "0", "--no-audit"]


def env_for(setting: str) -> dict:
    s = SETTINGS[setting]
    env = {**os.environ, **s["env"], "OMP_NUM_THREADS": str(s["threads"]), "MKL_NUM_THREADS": str(s["threads"]),
           "OPENBLAS_NUM_THREADS": str(s["threads"]), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "DEBIASED_NLI_CACHE": str(RUN / setting / "cache")}  # a fresh cache per setting: nothing is shared
    return env


def run_setting(step: str, setting: str, cmd: list[str], done: Path, label: str | None = None) -> None:
    """Run ``cmd`` under ``setting`` unless ``done`` exists; its wall time goes to RUN/step/<label>.seconds
    (``label``: the setting's name by default)."""
    if done.exists():
        print(f"{step} {label or setting}: done before ({done})", flush=True)
        return
    print(f"+ [{setting}] {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env_for(setting))
    (RUN / step / f"{label or setting}.seconds").write_text(f"{time.perf_counter() - t:.1f}\n")


def check_settings_apply() -> dict:
    """What each setting's torch reports (the capability torch dispatches to, its threads)."""
    out = {}
    code = "import torch, json; print(json.dumps({'cpu_capability': torch.backends.cpu.get_cpu_capability(), " \
           "'threads': torch.get_num_threads()}))"
    for setting in SETTINGS:
        res = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                             env=env_for(setting))
        out[setting] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def aflite() -> dict:
    import datasets
    import numpy as np
    for setting, s in SETTINGS.items():
        out = RUN / "aflite" / setting
        cmd = ["debiased-nli", "aflite", "snli", "--data-files", str(SNLI), *AFLITE_ARGS, "--threads", str(s["threads"]),
               "--out", str(out)]
        run_setting("aflite", setting, cmd, out / "removed.parquet")
    sides = {}
    for setting in SETTINGS:
        rem = datasets.Dataset.from_parquet(str(RUN / "aflite" / setting / "removed.parquet"))
        sides[setting] = {u: (r, s, k) for u, r, s, k in zip(rem["uid"], rem["reason"], rem["aflite_score"],
                                                           rem["aflite_round"])}
    a, b = (sides[s] for s in SETTINGS)
    warm_a = {u for u, v in a.items() if v[0] == "warm-up"}
    warm_b = {u for u, v in b.items() if v[0] == "warm-up"}
    rem_a = {u for u, v in a.items() if v[0] != "warm-up"}
    rem_b = {u for u, v in b.items() if v[0] != "warm-up"}
    both = rem_a & rem_b
    same_round = sum(a[u][2] == b[u][2] for u in both)
    score_diff = [abs(a[u][1] - b[u][1]) for u in both if a[u][2] == b[u][2]]
    result = {
        "step": "aflite", "rows": 20000, "command_args": AFLITE_ARGS,
        "warm_up_rows_same": warm_a == warm_b,
        "removed": {s: len(x) for s, x in zip(SETTINGS, (rem_a, rem_b))},
        "removed_by_one_setting_only": len(rem_a ^ rem_b),
        "decisions_differing_share": round(len(rem_a ^ rem_b) / 20000, 5),
        "removed_by_both_in_the_same_round": int(same_round),
        "score_difference_same_round": {"max": float(np.max(score_diff)) if score_diff else None,
                                        "mean": float(np.mean(score_diff)) if score_diff else None},
        "seconds": {s: float((RUN / "aflite" / f"{s}.seconds").read_text()) for s in SETTINGS
                    if (RUN / "aflite" / f"{s}.seconds").exists()},
    }
    (RUN / "aflite" / "compare.json").write_text(json.dumps(result, indent=2))
    return result


PDD_TAU = 4.52  # the committed PDD run's tau' (benchmarks/pdd_run.py: the paper's 20 scaled to the 20k sample)


def pdd() -> dict:
    """PDD on the 20k sample under both settings with the same teacher and masked LM (trained once, natively, as
    benchmarks/pdd_run.py trains its stand-ins): what the inference kernels alone change. A rebuild that also
    retrains the models on the other machine differs more; the decision records make both exact."""
    import datasets
    teacher, mlm = RUN / "pdd" / "teacher", MODELS / "minilm-mlm-pdd-standin"
    (RUN / "pdd").mkdir(parents=True, exist_ok=True)
    if not (teacher / "debiased_nli_train.json").exists():
        subprocess.run(["debiased-nli", "train", "snli", "--data-files", f"train={SNLI}", "--dev-files",
                        str(SHARED / "snli" / "dev.parquet"), "--model", str(MODELS / "all-minilm-l6-v2"), "--out",
                        str(teacher), "--epochs", "1", "--max-length", "64", "--batch-size", "16", "--lr", "5e-5",
                        "--max-train-rows", "6000", "--max-dev-rows", "1000", "--eval-steps", "50", "--threads", "2"],
                       check=True, env=env_for("native2"))
    while not (mlm / "config.json").exists():  # the stand-in trains in resumable stages of --stage-minutes
        subprocess.run([sys.executable, str(Path(__file__).with_name("pdd_mlm_standin.py")), "--steps", "600",
                        "--threads", "2"], check=True, env=env_for("native2"))
    for setting, s in SETTINGS.items():
        out = RUN / "pdd" / setting
        cmd = ["debiased-nli", "pdd", "snli", "--data-files", str(SNLI), "--mlm", str(mlm), "--teacher", str(teacher),
               "--tau", str(PDD_TAU), "--threads", str(s["threads"]), "--no-progress", "--out", str(out)]
        run_setting("pdd", setting, cmd, out / "debiased.parquet")
    sides = {}
    for setting in SETTINGS:
        d = datasets.Dataset.from_parquet(str(RUN / "pdd" / setting / "debiased.parquet"))
        r = datasets.Dataset.from_parquet(str(RUN / "pdd" / setting / "removed.parquet"))
        sides[setting] = {"rows": set(zip(d["premise"], d["hypothesis"], d["label"])), "removed": set(r["uid"]),
                          "n": len(d), "perturbed": sum(o == "perturbed" for o in d["origin"])}
    a, b = (sides[s] for s in SETTINGS)
    result = {"step": "pdd", "rows": 20000, "tau": PDD_TAU, "teacher": str(teacher), "mlm": str(mlm),
              "output_rows": {s: sides[s]["n"] for s in SETTINGS},
              "perturbed_rows": {s: sides[s]["perturbed"] for s in SETTINGS},
              "output_rows_in_one_setting_only": len(a["rows"] ^ b["rows"]),
              "originals_replaced_in_one_setting_only": len(a["removed"] ^ b["removed"]),
              "examples_in_one_setting_only": {s: [list(r) for r in sorted(sides[s]["rows"] - sides[o]["rows"])[:5]]
                                               for s, o in zip(SETTINGS, list(SETTINGS)[::-1])},
              "seconds": {s: float((RUN / "pdd" / f"{s}.seconds").read_text()) for s in SETTINGS
                          if (RUN / "pdd" / f"{s}.seconds").exists()}}
    (RUN / "pdd" / "compare.json").write_text(json.dumps(result, indent=2))
    return result


# the committed IBADR run's theta_s (benchmarks/results/ibadr_snli.md): MiniLM + a new head on 2,000 random rows of D0,
# 3 epochs, lr 5e-5 (Wang et al. 2023, section 3.1), batch 16, max length 64, iteration 1's sample seed (seed 0 + 1)
IBADR_SHALLOW = {"rows": 2000, "epochs": 3.0, "lr": 5e-5, "seed": 1, "batch_size": 16, "max_length": 64}
IBADR_N_BI = 5  # the committed run's N_bi


def ibadr() -> dict:
    """IBADR's neural decisions under both settings: theta_s is trained from the same rows and seed under each
    setting, every row of D0 gets its bias degree beta = p(y | x; theta_s), and the rows are cut into the N_bi
    indicator groups that condition the generator (the groups decide which rows train theta_g and with which
    indicator). The other neural decision, the confidence filter of the samples, is the ``confidence`` step."""
    import numpy as np
    code = ("import sys, json, numpy as np, torch\n"
            "from debiased_nli.data.loading import load_task\n"
            "from debiased_nli.data.tasks import get_task\n"
            "from debiased_nli.methods.ibadr.shallow import train_shallow, bias_degree\n"
            "torch.set_num_threads(int(sys.argv[2]))\n"
            "cfg = json.loads(sys.argv[4])\n"
            "task = get_task('snli')\n"
            "pool = load_task(task, data_files=sys.argv[1]).dataset\n"
            "train_shallow(pool, task, sys.argv[5], sys.argv[3] + '/theta_s', rows=cfg['rows'], epochs=cfg['epochs'],\n"
            "              lr=cfg['lr'], seed=cfg['seed'], batch_size=cfg['batch_size'], max_length=cfg['max_length'],\n"
            "              progress=False)\n"
            "beta = bias_degree(pool, sys.argv[3] + '/theta_s', task, max_length=cfg['max_length'], progress=False)\n"
            "np.save(sys.argv[3] + '/beta.npy', np.asarray(beta, dtype=np.float64))\n"
            "json.dump(list(pool['uid']), open(sys.argv[3] + '/uids.json', 'w'))\n")
    for setting, s in SETTINGS.items():
        out = RUN / "ibadr" / setting
        out.mkdir(parents=True, exist_ok=True)
        run_setting("ibadr", setting, [sys.executable, "-c", code, str(SNLI), str(s["threads"]), str(out),
                                       json.dumps(IBADR_SHALLOW), str(MODELS / "all-minilm-l6-v2")], out / "beta.npy")
    from debiased_nli.methods.ibadr.indicators import assign_indicators
    beta = {s: np.load(RUN / "ibadr" / s / "beta.npy") for s in SETTINGS}
    uids = {s: json.loads((RUN / "ibadr" / s / "uids.json").read_text()) for s in SETTINGS}
    a, b = SETTINGS
    if uids[a] != uids[b]:
        raise SystemExit("ibadr: the two settings scored different rows")
    groups = {s: assign_indicators(beta[s], uids[s], IBADR_N_BI) for s in SETTINGS}
    diff = np.abs(beta[a] - beta[b])
    result = {"step": "ibadr", "rows": int(len(beta[a])), "shallow": IBADR_SHALLOW, "n_bi": IBADR_N_BI,
              "indicator_differs": int(np.sum(groups[a] != groups[b])),
              "indicator_differs_by_more_than_one_group": int(np.sum(np.abs(groups[a] - groups[b]) > 1)),
              "beta_max_abs_difference": float(diff.max()), "beta_mean_abs_difference": float(diff.mean()),
              "seconds": {s: float((RUN / "ibadr" / f"{s}.seconds").read_text()) for s in SETTINGS
                          if (RUN / "ibadr" / f"{s}.seconds").exists()}}
    (RUN / "ibadr" / "compare.json").write_text(json.dumps(result, indent=2))
    return result


def replay_marks(node, where: str = "stages") -> dict:
    """Every ``replay`` entry of the manifest's stages (``replayed`` or why the record was not used), by place."""
    out = {}
    if isinstance(node, dict):
        if "replay" in node:
            out[f"{where}/{node.get('step') or node.get('name') or ''}".rstrip("/")] = node["replay"]
        for k, v in node.items():
            out.update(replay_marks(v, f"{where}/{k}"))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.update(replay_marks(v, f"{where}/{i}"))
    return out


def replay() -> dict:
    """The decision records at work on the step that differed: the SNLI release with PDD (the ``pdd`` step's
    models and tau') built under ``native2``, then under ``avx2_1`` twice: with ``--replay`` of the native build
    (PDD does not run; its recorded decisions and rows are reused) and without (PDD runs on the AVX2 kernels).
    Every file of the release is compared byte for byte with the native build."""
    import hashlib
    teacher, mlm = RUN / "pdd" / "teacher", MODELS / "minilm-mlm-pdd-standin"
    if not (teacher / "debiased_nli_train.json").exists() or not (mlm / "config.json").exists():
        raise SystemExit("replay: run `neural_determinism.py pdd` first (it trains the teacher and the masked LM)")
    base = RUN / "replay"
    base.mkdir(parents=True, exist_ok=True)
    recipe = base / "recipe.yaml"
    recipe.write_text(
        "# builders/snli.yaml's z-path with the PDD step of benchmarks/neural_determinism.py (stand-in models, tau' 4.52)\n"
        "name: debiased-snli-pdd\ntask: snli\nrelease_version: 1.0.0\npretty_name: Debiased SNLI sample (PDD)\n"
        "repo_id: debiased-nli/debiased-snli-pdd\nsummary: The 20k SNLI sample with PDD perturbations.\nseed: 42\n"
        "data: {split: train, on_invalid: set_aside, eval_splits: []}\nfeatures: {hypothesis_only: tfidf, folds: 5}\n"
        "z_filter: {top_k: 20, batch_size: 1000, p0: uniform}\n"
        f"filters:\n  - {{step: pdd, config: pdd, mlm: {mlm}, teacher: {teacher}, tau: {PDD_TAU}, progress: false}}\n"
        "configs: auto\nhistory:\n  - {version: 1.0.0, notes: first release}\n")
    builds = {"native2": ("native2", []), "avx2_1_replay": ("avx2_1", ["--replay", str(base / "native2")]),
              "avx2_1": ("avx2_1", [])}
    for name, (setting, extra) in builds.items():
        out = base / name
        cmd = ["debiased-nli", "build", str(recipe), "--data-files", f"train={SNLI}", *extra, "--out", str(out)]
        run_setting("replay", setting, cmd, out / "manifest.json", label=name)

    def files(root: Path) -> dict:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*.parquet"))}
    ref = files(base / "native2")
    result = {"step": "replay", "recipe": str(recipe), "data_files": len(ref)}
    for name in ("avx2_1_replay", "avx2_1"):
        other = files(base / name)
        differ = sorted(k for k in set(ref) | set(other) if ref.get(k) != other.get(k))
        result[name] = {"parquet_files_differing": differ, "identical": not differ,
                        "replay": replay_marks(json.loads((base / name / "manifest.json").read_text()).get("stages"))}
    result["seconds"] = {n: float((base / f"{n}.seconds").read_text()) for n in builds if (base / f"{n}.seconds").exists()}
    (base / "compare.json").write_text(json.dumps(result, indent=2))
    return result


def confidence(model: str, rows: str) -> dict:
    """M's confidence on the same rows under both settings: rows whose keep/drop at tau flips."""
    import numpy as np
    import pandas as pd
    code = ("import sys, json, numpy as np, datasets, torch\n"
            "from debiased_nli.methods.confidence import confidence_filter\n"
            "torch.set_num_threads(int(sys.argv[3]))\n"
            "ds = datasets.Dataset.from_parquet(sorted(__import__('glob').glob(sys.argv[2])))\n"
            "k, r = confidence_filter(ds, sys.argv[1], 'snli', tau=0.95, progress=False)\n"
            "conf = dict(zip(list(k['uid']) + list(r['uid']), list(k['confidence']) + list(r['confidence'])))\n"
            "np.save(sys.argv[4], np.array([conf[u] for u in ds['uid']]))\n")
    for setting, s in SETTINGS.items():
        out = RUN / "confidence" / f"{setting}.npy"
        out.parent.mkdir(parents=True, exist_ok=True)
        run_setting("confidence", setting, [sys.executable, "-c", code, model, rows, str(s["threads"]), str(out)], out)
    a, b = (np.load(RUN / "confidence" / f"{s}.npy") for s in SETTINGS)
    result = {"step": "confidence", "rows": int(len(a)), "model": model, "files": rows,
              "max_abs_difference": float(np.max(np.abs(a - b))) if len(a) else None,
              "flips_at_tau": {str(t): int(np.sum((a > t) != (b > t))) for t in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)},
              "seconds": {s: float((RUN / "confidence" / f"{s}.seconds").read_text()) for s in SETTINGS
                          if (RUN / "confidence" / f"{s}.seconds").exists()}}
    del pd
    (RUN / "confidence" / "compare.json").write_text(json.dumps(result, indent=2))
    return result


def report() -> None:
    results = {"settings": SETTINGS, "torch_sees": check_settings_apply(), "steps": {}}
    for step in ("aflite", "confidence", "pdd", "ibadr", "replay"):
        f = RUN / step / "compare.json"
        if f.exists():
            results["steps"][step] = json.loads(f.read_text())
    (RESULTS / "neural_determinism.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["# Neural steps on two kernels: how many decisions change (issue 32, item 2)", "",
             "Command: `python benchmarks/neural_determinism.py <step>` then `... report`. Settings:", ""]
    for s, v in SETTINGS.items():
        lines.append(f"* `{s}`: {v['threads']} thread(s), env {v['env'] or '(none)'}; torch reports "
                     f"{results['torch_sees'][s]}")
    lines += ["", "| step | rows | decisions that differ | detail |", "|---|---|---|---|"]
    for step, r in results["steps"].items():
        if step == "aflite":
            lines.append(f"| AFLite (20k SNLI, the committed run's settings) | {r['rows']:,} | "
                         f"{r['removed_by_one_setting_only']:,} ({r['decisions_differing_share']:.2%}) | removed "
                         f"{r['removed']}; warm-up rows the same: {r['warm_up_rows_same']}; score difference of rows "
                         f"removed in the same round by both: {r['score_difference_same_round']} |")
        elif step == "pdd":
            lines.append(f"| PDD (20k SNLI, tau' {r['tau']}; teacher and masked LM trained once) | {r['rows']:,} | "
                         f"{r['output_rows_in_one_setting_only']:,} output rows in one setting only | rows out "
                         f"{r['output_rows']}, perturbed {r.get('perturbed_rows')}; originals replaced in one setting only: "
                         f"{r['originals_replaced_in_one_setting_only']:,}; "
                         + "; ".join(f"{k} only: " + ", ".join(f"{x[0]!r} / {x[1]!r}" for x in v)
                                     for k, v in r.get("examples_in_one_setting_only", {}).items() if v) + " |")
        elif step == "confidence":
            lines.append(f"| confidence filter (M = `{Path(r['model']).name}`) | {r['rows']:,} | "
                         f"{r['flips_at_tau']['0.9']:,} at tau 0.9 (the Seq-Z run's), {r['flips_at_tau']['0.95']:,} at 0.95 | flips by tau {r['flips_at_tau']}; largest "
                         f"|p difference| {r['max_abs_difference']:.3g} |")
        elif step == "replay":
            rp, fresh = r["avx2_1_replay"], r["avx2_1"]
            lines.append(f"| the SNLI release with PDD rebuilt on `avx2_1` (native build first) | 20,000 | with "
                         f"`--replay` of the native build: {len(rp['parquet_files_differing'])} of {r['data_files']} "
                         f"Parquet files differ; without: {len(fresh['parquet_files_differing'])} | differing without "
                         f"replay: {', '.join(fresh['parquet_files_differing']) or 'none'}; replay marks "
                         f"{sorted(set(map(str, rp['replay'].values())))} |")
        elif step == "ibadr":
            lines.append(f"| IBADR bias-degree indicators (theta_s retrained under each setting: {r['shallow']['rows']:,} "
                         f"rows, {r['shallow']['epochs']:g} epochs) | {r['rows']:,} | {r['indicator_differs']:,} rows in "
                         f"another of the {r['n_bi']} groups | {r['indicator_differs_by_more_than_one_group']:,} moved by "
                         f"more than one group; largest |beta difference| {r['beta_max_abs_difference']:.3g}, mean "
                         f"{r['beta_mean_abs_difference']:.3g} |")
    lines += ["", "A rebuild reproduces the release exactly anyway: the build records every filter step's "
              "decisions and scores (`decisions/<config>/` in the release, their sha256 in the manifest), and "
              "`debiased-nli build ... --replay OLD_RELEASE` reuses them when the step, its parameters and its "
              "input rows are the same (docs/data-model.md, \"Decision records and exact rebuilds\")."]
    (RESULTS / "neural_determinism.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["aflite", "pdd", "ibadr", "confidence", "replay", "report", "check"])
    ap.add_argument("--model", help="confidence: the classifier M")
    ap.add_argument("--rows", help="confidence: parquet files (glob) of the rows to score")
    a = ap.parse_args()
    (RUN).mkdir(parents=True, exist_ok=True)
    if a.what == "aflite":
        print(json.dumps(aflite(), indent=2))
    elif a.what == "pdd":
        print(json.dumps(pdd(), indent=2))
    elif a.what == "ibadr":
        print(json.dumps(ibadr(), indent=2))
    elif a.what == "replay":
        print(json.dumps(replay(), indent=2))
    elif a.what == "confidence":
        if not (a.model and a.rows and glob.glob(a.rows)):
            ap.error("confidence needs --model and --rows matching files")
        print(json.dumps(confidence(a.model, a.rows), indent=2))
    elif a.what == "check":
        print(json.dumps(check_settings_apply(), indent=2))
    else:
        report()
