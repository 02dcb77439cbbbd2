"""Run the efficacy table's GPU plan (``benchmarks/efficacy_gpu.yaml``) on a GPU machine with no network.

A lent GPU machine (this project's ``device`` tool, a cluster node behind a firewall) has PyTorch and
transformers but not the Hub, the shared data, this project's releases or ``datasets`` / ``evaluate``;
and what travels there is limited (64 MiB here). Three steps:

    python benchmarks/gpu_kit.py make                        # here: .gpu/ (git-ignored), size checked
    python benchmarks/gpu_kit.py run --workers 10 --deadline 555 --out "$OUT"    # there
    python benchmarks/gpu_kit.py collect efficacy_gpu.tar.gz # here: unit files into results_dir

``make`` packs, for the plan's rows that have their data here:
  - the model folder, its weights stored as float16 (all-MiniLM-L6-v2's 90.9 MB of float32 do not fit in
    64 MiB with the data); ``run`` writes them back as float32 before training, so the GPU table starts
    from the float32 weights rounded to float16 (relative error at most 2**-11 per weight; ``kit.json``
    records the largest absolute change), and trains and evaluates in float32 like the CPU table;
  - the data files the plan reads (training files, SNLI dev, every challenge set), under ``shared/data``;
  - the releases the plan uses, only the configs its rows train on (with their manifests);
  - wheels of the Python packages such an image lacks (``datasets``, ``evaluate`` and their own needs),
    for Python 3.12 (the image's), downloaded with pip;
  - ``kit.json``: the commit, the rows, the float16 rounding, the sizes.

``run`` (on the GPU machine, from the repository root) installs the wheels into /tmp/site, puts each
file where the plan's paths point (the model under ``~/.cache``, ``../shared/data``, ``/work/releases``),
starts ``--workers`` processes of ``efficacy.py run --claims DIR --seed-major`` (each takes the next
unclaimed unit; every row's seed 0 comes first), stops them at ``--deadline`` seconds, and packs the
finished result files, the training records and the logs into ``OUT/efficacy_gpu.tar.gz`` every 20 s,
so what finished comes back even when the machine's time runs out. A unit stopped half-way is simply
run again by the next ``run`` (its result file is what counts).

The generator pipeline's kit (issue 31: the SmolLM2 GGUF shipped in two parts, G, M, sampling, confidence filter
and throughput on one GPU, in a chain of calls; benchmarks/GPU_GENERATOR.md) is ``benchmarks/gpu_generator.py``,
which builds on this module's tree, wheel and kit-folder helpers (the imports go one way: this module imports
nothing of it).
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_PLAN = ROOT / "benchmarks" / "efficacy_gpu.yaml"
KIT = ROOT / ".gpu"
LIMIT_MIB = 64  # what travels to the device tool's machine: the working tree and the carried paths together
# Python packages the GPU image lacks (its pip list: ../.library/device/KINDS.md) and that
# efficacy.py needs: datasets and evaluate, with the needs of theirs the image lacks too
WHEELS = ["datasets", "evaluate", "dill", "multiprocess", "fsspec"]
# datasets 5.x needs pyarrow >= 24; this older set (datasets 4.4.1: pyarrow >= 21, and the dill,
# multiprocess and fsspec it pins) is carried too and installed instead when the image's pyarrow is older
FALLBACK = ["datasets==4.4.1", "dill==0.4.0", "multiprocess==0.70.18", "fsspec==2025.10.0"]
PY = "3.12"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tree_files() -> dict[str, int]:
    """What the device tool sends besides the kit (tracked and untracked-not-ignored files): path -> bytes."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.split(b"\0")
    return {f.decode(): (ROOT / f.decode()).stat().st_size for f in out if f and (ROOT / f.decode()).is_file()}


def _tree_size() -> int:
    return sum(tree_files().values())


# What a device call never needs: the committed results (measurements, unit files, reports: 43 MiB of the
# 46.5 MiB tree at 3aec037). ``slim`` takes them out of the working tree with git's sparse checkout (they stay
# committed, `git status` stays clean, no file is deleted from the repository) and ``unslim`` brings them back.
SLIM_OUT = ["benchmarks/results/"]


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def slim_tree(keep: tuple[str, ...] = (), cwd: Path = ROOT) -> list[str]:
    """Take ``SLIM_OUT`` (but the paths in ``keep``) out of this worktree's files with a sparse checkout
    (``git sparse-checkout set --no-cone``; per worktree: other worktrees of the repository keep their files).
    Refused when a file there has uncommitted changes (the sparse checkout would leave it, and it would travel)."""
    dirty = [x for x in _git("status", "--porcelain", "--", *SLIM_OUT, cwd=cwd).splitlines() if x.strip()]
    if dirty:
        raise SystemExit(f"slim: {len(dirty)} uncommitted change(s) under {', '.join(SLIM_OUT)} (first: {dirty[0][3:]}); "
                         f"commit them first, nothing was changed")
    for k in keep:
        if ".." in Path(k).parts or Path(k).is_absolute():
            raise SystemExit(f"slim: --keep {k!r} must be a path inside the repository")
    patterns = ["/*", *(f"!/{p}" for p in SLIM_OUT), *(f"/{k.strip('/')}/" for k in keep)]
    _git("sparse-checkout", "set", "--no-cone", *patterns, cwd=cwd)
    return patterns


def unslim_tree(cwd: Path = ROOT) -> None:
    """Every committed file back in the worktree (``git sparse-checkout disable``)."""
    _git("sparse-checkout", "disable", cwd=cwd)


def committed_tree_bytes(cwd: Path = ROOT, rev: str = "HEAD", slim: bool = True) -> int:
    """The bytes of the files committed at ``rev`` that a call sends, without ``SLIM_OUT`` when ``slim``."""
    total = 0
    for line in _git("ls-tree", "-r", "-l", rev, cwd=cwd).splitlines():
        meta, path = line.split("\t", 1)
        size = meta.split()[3]
        if size == "-" or (slim and any(path.startswith(x) for x in SLIM_OUT)):
            continue
        total += int(size)
    return total


def largest_folders(files: dict[str, int], depth: int = 3, n: int = 6) -> list[tuple[str, int]]:
    """The working tree's largest folders (their first ``depth`` path parts), for the over-the-limit message."""
    sizes: dict[str, int] = {}
    for f, b in files.items():
        key = "/".join(Path(f).parts[:depth]) if len(Path(f).parts) > depth else f
        sizes[key] = sizes.get(key, 0) + b
    return sorted(sizes.items(), key=lambda kv: -kv[1])[:n]


# ------------------------------------------------------------------------------------------ make

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


def _default_configs(readme: Path) -> set[str]:
    """The config(s) a release card marks ``default: true``: ``datasets`` resolves its data files
    whichever config is loaded, so the kit carries it too."""
    import yaml

    text = readme.read_text() if readme.exists() else ""
    if not text.startswith("---"):
        return set()
    head = yaml.safe_load(text.split("---", 2)[1]) or {}
    return {c["config_name"] for c in head.get("configs") or [] if c.get("default")}


def _copy_release(src: Path, dst: Path, configs: set[str]) -> None:
    configs = set(configs) | _default_configs(src / "README.md")
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("efficacy_build.json", "manifest.json", "README.md"):  # README.md: the configs' data files
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    for cfg in sorted(configs):
        shutil.copytree(src / "data" / cfg, dst / "data" / cfg, dirs_exist_ok=True)


def _float16_model(src: Path, dst: Path) -> dict:
    """Copy a model folder with its safetensors weights as float16; the largest change of a weight."""
    import torch
    from safetensors.torch import load_file, save_file

    from debiased_nli.utils.provenance import file_sha256

    dst.mkdir(parents=True, exist_ok=True)
    info = {"source": str(src), "weights": {}}
    for p in src.iterdir():
        if p.is_dir() or p.name.startswith(".") or p.name == "README.md":
            continue
        if p.suffix == ".safetensors":
            tensors = load_file(str(p))
            half, worst, rel = {}, 0.0, 0.0
            for k, t in tensors.items():
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
            info["weights"][p.name] = {"sha256_float32": file_sha256(p), "bytes_float32": p.stat().st_size,
                                       "bytes_float16": (dst / p.name).stat().st_size,
                                       "max_abs_change": worst, "max_rel_change_above_1e-4": rel}
        else:
            shutil.copy2(p, dst / p.name)
    for sub in src.iterdir():  # sentence-transformers' pooling config and the like (small)
        if sub.is_dir() and not sub.name.startswith("."):
            shutil.copytree(sub, dst / sub.name, dirs_exist_ok=True)
    return info


def download_wheels(dest: Path) -> list[str]:
    import importlib.metadata as md

    dest.mkdir(parents=True, exist_ok=True)
    alt = dest.parent / "whl-alt"
    alt.mkdir(parents=True, exist_ok=True)
    got = []
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", PY,
            "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "--platform", "any"]
    for name in WHEELS:
        spec = f"{name}=={md.version(name)}"
        subprocess.run([*base, "-d", str(dest), spec], check=True)
        got.append(spec)
    subprocess.run([*base, "-d", str(alt), *FALLBACK], check=True)
    return got + [f"{' '.join(FALLBACK)} (instead, where the image's pyarrow is older than 24)"]


MARKER = ".debiased-nli-gpu-kit"  # written first into every kit folder: only such a folder is ever emptied


def clear_kit(kit: Path) -> None:
    """An empty kit folder: a folder an earlier ``make`` created (it holds MARKER) is removed and made
    again; any other existing file or folder (a user's, given by mistake as ``--kit``) is refused."""
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
    (kit / MARKER).write_text("made by benchmarks/gpu_kit.py make; `make` empties this folder when run again\n")


def make(plan_path: Path, kit: Path, limit_mib: float, releases_from: str | None = None) -> dict:
    from benchmarks import efficacy
    from debiased_nli.models.challenge import default_data_root, resolve_sets
    from debiased_nli.utils.provenance import git_hash

    # the releases this table builds itself are read from where they were built (the CPU plan's runs_dir)
    plan = efficacy.load_plan(plan_path, runs_dir=releases_from)
    clear_kit(kit)
    exclude = ROOT / ".git" / "info" / "exclude"  # the kit travels as a carried path, not in the working tree
    if exclude.parent.exists() and f"/{kit.name}/" not in (exclude.read_text() if exclude.exists() else ""):
        with open(exclude, "a") as f:
            f.write(f"/{kit.name}/\n")
    rows, pending = _rows_with_data(plan)
    log(f"rows with their data here: {', '.join(r['name'] for r in rows)}"
        + (f"; pending: {', '.join(pending)}" if pending else ""))
    shared = (ROOT.parent / "shared").resolve()
    data_root = default_data_root().resolve()
    files: set[Path] = {efficacy._path(p) for p in plan.train.get("dev_files") or []}
    files |= {data_root / s.local for s in resolve_sets(sets=plan.evaluate["sets"])}
    releases: dict[str, set[str]] = {}
    release_dirs: dict[str, set[str]] = {}

    def need(d: dict) -> None:  # the release config a row's data reads
        if "release" in d:
            releases.setdefault(d["release"], set()).add(d["config"])
        if "release_dir" in d:
            release_dirs.setdefault(str(efficacy._path(d["release_dir"])), set()).add(d["config"])

    for row in rows:
        d = row["data"]
        files |= {efficacy._path(p) for p in d.get("files", [])}
        need(d)
        if "random_subset_of" in d:  # its size comes from another row's release
            need(plan.row(d["size_of"])["data"])
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
        _copy_release(Path(folder), kit / "release_dirs" / f"{k}-{Path(folder).name}", configs)
        dir_map[folder] = f"release_dirs/{k}-{Path(folder).name}"
    model = _float16_model(Path(plan.model), kit / "model")
    wheels = download_wheels(kit / "whl")
    info = {"plan": efficacy.show(plan_path), "git": git_hash(), "made": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rows": [r["name"] for r in rows], "pending": pending, "model_path": plan.raw["model"], "model": model,
            "shared_files": sorted(str(f.relative_to(shared)) for f in files),
            "releases": {k: sorted(v) for k, v in releases.items()},
            "release_dirs": {k: {"kit": dir_map[k], "configs": sorted(v)} for k, v in release_dirs.items()},
            "wheels": wheels}
    (kit / "kit.json").write_text(json.dumps(info, indent=2))
    parts = {p.name: _size(p) for p in kit.iterdir()}
    files_now = tree_files()
    tree = sum(files_now.values())
    total = tree + sum(parts.values())
    info["bytes"] = {"working_tree": tree, **parts, "total": total}
    (kit / "kit.json").write_text(json.dumps(info, indent=2))
    log("sizes (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in info["bytes"].items()))
    if total > limit_mib * 2**20:
        big = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in largest_folders(files_now))
        raise SystemExit(f"the kit and the working tree are {total / 2**20:.1f} MiB, over {limit_mib} MiB. The working "
                         f"tree's largest paths (MiB): {big}. Everything git tracks travels: `python benchmarks/gpu_kit.py "
                         f"slim --keep <the plan's results folder>` takes the other results out of the tree for the calls "
                         f"(`unslim` after), or give --limit-mib where the transfer allows more")
    return info


# ------------------------------------------------------------------------------------------ run (there)

def install_wheels(kit: Path, site: Path) -> dict:
    """pip-install the kit's wheels into ``site`` (no index, no deps); the older datasets where the
    image's pyarrow is older than 24."""
    import importlib.metadata as md

    pa = md.version("pyarrow")
    have = {}
    for name in ("datasets", "evaluate"):
        try:
            have[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    if len(have) == 2:  # an image that has them: its own versions are used (and recorded in each unit)
        return {"pyarrow": pa, "installed": [], "image_has": have}
    wheels = sorted(str(p) for p in (kit / "whl").glob("*.whl"))
    if int(pa.split(".")[0]) < 24:
        alt = sorted(str(p) for p in (kit / "whl-alt").glob("*.whl"))
        names = {Path(w).name.split("-")[0] for w in alt}
        wheels = [w for w in wheels if Path(w).name.split("-")[0] not in names] + alt
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
    return {"pyarrow": pa, "installed": [Path(w).name for w in wheels]}


def _link(target: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target.resolve(), target_is_directory=target.is_dir())


def unpack(kit: Path, plan_path: Path) -> tuple[dict, object]:
    """Put the kit's files where the plan's paths point; the float16 weights back as float32.
    Returns the kit's record and the plan."""
    import torch
    from safetensors.torch import load_file, save_file

    info = json.loads((kit / "kit.json").read_text())
    model_dst = Path(os.path.expanduser(info["model_path"]))
    if not (model_dst / ".from_gpu_kit").exists():
        model_dst.mkdir(parents=True, exist_ok=True)
        for p in (kit / "model").iterdir():
            if p.suffix == ".safetensors":
                tensors = {k: (t.float() if t.dtype == torch.float16 else t) for k, t in load_file(str(p)).items()}
                save_file(tensors, str(model_dst / p.name))
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
    sys.path.insert(0, str(ROOT))
    from benchmarks import efficacy

    plan = efficacy.load_plan(plan_path)
    for name in info["releases"]:
        _link(kit / "releases" / name, efficacy.release_dir(plan, name))
    for folder, v in info["release_dirs"].items():
        _link(kit / v["kit"], Path(folder))
    return info, plan


def _pack(plan, logs: Path, out: Path) -> int:
    """Result files, training records and logs into out/efficacy_gpu.tar.gz (written atomically)."""
    tmp = out / ".efficacy_gpu.tar.gz.tmp"
    n = 0
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
    t_start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("GPU_KIT_LOGS", "/tmp/gpu_kit_logs"))
    logs.mkdir(parents=True, exist_ok=True)
    site = Path(os.environ.get("GPU_KIT_SITE", "/tmp/site"))
    env_info = install_wheels(kit, site)
    info, plan = unpack(kit, plan_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", DEBIASED_NLI_GIT_COMMIT=str(info.get("git") or ""))
    smoke = subprocess.run([sys.executable, "-c",
                            "import torch, transformers, datasets, evaluate, pyarrow; import debiased_nli.models.training, "
                            "debiased_nli.evaluation.scores; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), "
                            "torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'transformers', "
                            "transformers.__version__, 'datasets', datasets.__version__, 'evaluate', evaluate.__version__, "
                            "'pyarrow', pyarrow.__version__)"], env=env, capture_output=True, text=True)
    log(f"environment: {smoke.stdout.strip()} {smoke.stderr.strip()[-2000:]} (wheels: {env_info})")
    if smoke.returncode != 0:
        return smoke.returncode
    claims = Path(os.environ.get("GPU_KIT_CLAIMS", "/tmp/efficacy_claims"))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "efficacy.py"), "run", "--plan", str(plan_path),
           "--claims", str(claims), "--seed-major", "--no-report", "--quiet", *(["--rows", *rows] if rows else [])]

    def start(w: int, k: int):
        f = open(logs / f"worker{w}.log", "a")
        f.write(f"=== start {k} at {time.strftime('%H:%M:%S')}\n")
        f.flush()
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True), f

    smi = None
    if shutil.which("nvidia-smi"):  # utilisation every 10 s: how busy the workers kept the GPU
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used,power.draw",
                                "--format=csv", "-l", "10"], stdout=open(logs / "gpu_utilisation.csv", "w"),
                               stderr=subprocess.DEVNULL)
    procs, restarts = [], [0] * workers
    for w in range(workers):
        procs.append(start(w, 0))
        time.sleep(2)  # staggered: the first ones claim (and start loading) before the next
    last_pack = 0.0
    while any(p.poll() is None for p, _ in procs):
        for w, (p, f) in enumerate(procs):
            # a unit that failed stays claimed (its error is in the log); the worker goes on with the next
            if p.poll() not in (None, 0) and restarts[w] < 3:
                f.close()
                restarts[w] += 1
                log(f"worker {w} exited {p.poll()}; starting it again ({restarts[w]}/3)")
                procs[w] = start(w, restarts[w])
        if time.monotonic() - t_start > deadline:
            log(f"deadline {deadline:.0f}s: stopping the workers")
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            time.sleep(5)
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        if time.monotonic() - last_pack > 20:
            n = _pack(plan, logs, out)
            last_pack = time.monotonic()
            log(f"{n} units finished, {sum(p.poll() is None for p, _ in procs)} workers running")
        time.sleep(2)
    for _, f in procs:
        f.close()
    if smi is not None:
        smi.terminate()
    n = _pack(plan, logs, out)
    codes = [p.poll() for p, _ in procs]
    log(f"done in {time.monotonic() - t_start:.0f}s: {n} unit files in {out / 'efficacy_gpu.tar.gz'}; worker exits {codes}")
    for w in range(workers):  # the end of each worker's log: what it finished or why it failed
        tail = (logs / f"worker{w}.log").read_text(errors="replace").splitlines()[-4:]
        print(f"--- worker{w}: " + " | ".join(t[-300:] for t in tail), flush=True)
    return 0


# ------------------------------------------------------------------------------------------ collect (here)

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
            name = Path(m.name)
            data = tar.extractfile(m).read()
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
                dst = logs_to / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)
    log(f"added {len(added)} unit files to {efficacy.show(plan.results_dir)}"
        + (f"; kept the {len(kept)} already there: {', '.join(kept)}" if kept else ""))
    return added


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["make", "run", "collect", "slim", "unslim"],
                    help="slim / unslim: take the committed results out of this worktree for device calls (git "
                         "sparse checkout: nothing is deleted, `git status` stays clean) and bring them back")
    ap.add_argument("archive", nargs="?", help="`collect`: the efficacy_gpu.tar.gz that `run` wrote")
    ap.add_argument("--plan", default=str(DEFAULT_PLAN), help="the GPU plan (default benchmarks/efficacy_gpu.yaml)")
    ap.add_argument("--kit", default=str(KIT), help="the kit folder (default .gpu, git-ignored)")
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB, help="`make`: refuse a kit larger than this, "
                    "with the working tree (default 64: the device tool's limit)")
    ap.add_argument("--releases-from", default="~/runs/efficacy",
                    help="`make`: the runs_dir whose releases/ holds the releases the plan builds itself (default: the "
                         "CPU plan's, ~/runs/efficacy)")
    ap.add_argument("--workers", type=int, default=10, help="`run`: efficacy.py processes at once on the GPU")
    ap.add_argument("--deadline", type=float, default=500, help="`run`: stop the workers after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"), help="`run`: where efficacy_gpu.tar.gz goes")
    ap.add_argument("--rows", nargs="+", help="`run`: only these rows")
    ap.add_argument("--logs-to", help="`collect`: also extract the training records and logs here")
    ap.add_argument("--keep", nargs="*", default=[], help="`slim`: results folders a call needs (e.g. a plan's unit files)")
    a = ap.parse_args(argv)
    if a.command == "slim":
        slim_tree(tuple(a.keep))
        log(f"slim: the working tree that travels is {_tree_size() / 2**20:.1f} MiB now; `unslim` after the calls")
        return 0
    if a.command == "unslim":
        unslim_tree()
        log(f"unslim: every committed file is back ({_tree_size() / 2**20:.1f} MiB)")
        return 0
    plan = Path(a.plan).resolve()
    if a.command == "make":
        make(plan, Path(a.kit).resolve(), a.limit_mib, a.releases_from)
        return 0
    if a.command == "run":
        return run_there(Path(a.kit).resolve(), plan, a.workers, a.deadline, Path(a.out).resolve(), a.rows)
    if not a.archive:
        ap.error("collect needs the archive")
    collect(Path(a.archive), plan, Path(a.logs_to) if a.logs_to else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
