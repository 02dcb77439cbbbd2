"""The efficacy table (issue 14): does training on a debiased release make a model more robust?

Every row of ``benchmarks/efficacy.yaml`` (a release config, a method, or a control) is trained with the
same model and settings and scored on every challenge set in full:

    for row in rows, seed in seeds:                   # one unit; its result file is skipped when present
        data  = the row's training rows               # a file, a config of a release (built here when it
                                                      # is one of `releases:`), or a random control subset
        train = debiased_nli.models.training.train_classifier(model, data, dev)       # `debiased-nli train`
        score = debiased_nli.models.evaluation.evaluate_models([train], sets)         # `debiased-nli evaluate`
        write results_dir/<row>-s<seed>.json atomically

A row whose data does not exist yet (a release another branch has not written, generated rows not on
disk, a row on ``hold``) is *pending*: ``status`` and ``report`` list it with the reason; it is never
dropped. Each stage (build, train, evaluate) takes the heavy lock (``--lock``) on its own, so other
work interleaves between stages; an interrupted training resumes from its last checkpoint.

Each result records the row's training size, wall and CPU time of each stage, the git commit each stage
ran at, and the command that built its data (and the equivalent ``debiased-nli train`` / ``evaluate``
commands). ``report`` aggregates the finished units into ``efficacy.md`` / ``.json`` / ``.png``
(mean ± sample std over seeds) and says, per method and set, whether it differs from the reference row
by more than twice the standard error of the difference.

    python benchmarks/efficacy.py status
    nohup python benchmarks/efficacy.py run --lock /tmp/debiased-heavy.lock > efficacy.log 2>&1 &
    python benchmarks/efficacy.py run --rows original --seeds 0          # one unit
    python benchmarks/efficacy.py report
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PLAN = Path(__file__).resolve().with_suffix(".yaml")
SCHEMA = "debiased-nli/efficacy-unit/v1"
TRAIN_RECORD = "efficacy_train.json"


class Pending(Exception):
    """A row whose training data does not exist yet; the message says why and what would make it."""


class NotBuilt(Pending):
    """A release of ``releases:`` whose inputs exist but which is not built yet (``run`` builds it)."""


def log(msg: str) -> None:
    print(f"[{_dt.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def _path(value: str | os.PathLike, base: Path = ROOT) -> Path:
    p = Path(os.path.expanduser(str(value)))
    return p if p.is_absolute() else (base / p).resolve()


def show(p: str | os.PathLike) -> str:
    """A path as the commands in this project write it: relative to the repository, or ``../shared/...``."""
    p = Path(p)
    shared = (ROOT.parent / "shared").resolve()
    for base, prefix in ((ROOT, ""), (shared, "../shared/")):
        try:
            return prefix + str(p.relative_to(base))
        except ValueError:
            continue
    return str(p)


def _split_file(item: str) -> tuple[str, str]:
    split, sep, path = item.partition("=")
    return (split, path) if sep else ("train", item)


def write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ the plan

@dataclasses.dataclass
class Plan:
    path: Path
    raw: dict
    task: str
    model: str
    seeds: list[int]
    runs_dir: Path
    results_dir: Path
    reference: str
    train: dict
    evaluate: dict
    releases: dict[str, dict]
    rows: list[dict]

    def row(self, name: str) -> dict:
        for r in self.rows:
            if r["name"] == name:
                return r
        raise SystemExit(f"{self.path}: no row named {name!r}; rows: {', '.join(r['name'] for r in self.rows)}")

    def unit_file(self, row: str, seed: int) -> Path:
        return self.results_dir / f"{row}-s{seed}.json"

    def model_dir(self, row: str, seed: int) -> Path:
        return self.runs_dir / "models" / f"{row}-s{seed}"


def _read_plan(path: Path, _seen: tuple = ()) -> dict:
    """The plan's YAML; ``extends: other.yaml`` (relative to this file) starts from that plan: a key given
    here replaces the other's, except the mappings ``train``, ``evaluate`` and ``releases``, which are
    updated key by key (so a GPU plan restates only what differs from the CPU one)."""
    import yaml

    path = path.resolve()
    if path in _seen:
        raise SystemExit(f"{path}: `extends` loops: {' -> '.join(map(str, (*_seen, path)))}")
    raw = yaml.safe_load(path.read_text()) or {}
    base = raw.pop("extends", None)
    if not base:
        return raw
    parent_path = _path(base, path.parent)
    if not parent_path.exists():
        raise SystemExit(f"{path}: extends {base!r}, which does not exist ({parent_path})")
    merged = _read_plan(parent_path, (*_seen, path))
    for key, value in raw.items():
        if key in ("train", "evaluate", "releases") and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    merged["extends"] = show(parent_path)
    return merged


def load_plan(path: str | os.PathLike = DEFAULT_PLAN, *, runs_dir: str | None = None,
              results_dir: str | None = None) -> Plan:
    path = Path(path)
    raw = _read_plan(path)
    if raw.get("device", "any") not in ("any", "cpu", "cuda"):
        raise SystemExit(f"{path}: device {raw['device']!r} is not one of any, cpu, cuda")
    for key in ("task", "model", "seeds", "train", "evaluate", "rows"):
        if key not in raw:
            raise SystemExit(f"{path}: the plan needs {key!r}")
    names = [r["name"] for r in raw["rows"]]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: row names repeat: {names}")
    for r in raw["rows"]:
        if not isinstance(r.get("data"), dict):
            raise SystemExit(f"{path}: row {r['name']!r} needs a `data:` mapping")
        for c in _compare_with(r):
            if c["row"] not in names or c["row"] == r["name"]:
                raise SystemExit(f"{path}: row {r['name']!r} has compare_with {c['row']!r}, which is not another row "
                                 f"of the plan; rows: {', '.join(names)}")
    runs = runs_dir or os.environ.get("EFFICACY_RUNS") or raw.get("runs_dir", "~/runs/efficacy")
    return Plan(path=path, raw=raw, task=raw["task"], model=str(_path(raw["model"])), seeds=list(raw["seeds"]),
                runs_dir=_path(runs), results_dir=_path(results_dir or raw.get("results_dir", "benchmarks/results/efficacy")),
                reference=raw.get("reference", raw["rows"][0]["name"]), train=dict(raw["train"]),
                evaluate=dict(raw["evaluate"]), releases=dict(raw.get("releases") or {}), rows=list(raw["rows"]))


# ------------------------------------------------------------------------------------------ locking

@contextlib.contextmanager
def heavy_lock(path: str | None, what: str):
    """Hold ``flock(path)`` for one short stage (the project's heavy lock)."""
    with LockTurns(path, None, what) as turns:
        turns.step()
        yield


class LockTurns:
    """The heavy lock held across the steps of one stage, given up between steps once it has been held
    for ``budget_s`` (the project's rule: at most ~20 minutes at a time), so other work interleaves
    on a shared machine; the stage then queues for it again. ``path=None``: no locking."""

    pause_s = 10.0

    def __init__(self, path: str | None, budget_s: float | None, what: str):
        self.path, self.budget, self.what = path, budget_s, what
        self.fh, self.since, self.turns = None, None, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def held_for(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def remaining(self) -> float | None:
        return None if self.budget is None else max(0.0, self.budget - self.held_for())

    def step(self) -> None:
        """Before a step: take the lock, or give it up and queue again if this turn is over."""
        if not self.path:
            return
        if self.fh is not None and self.budget is not None and self.held_for() >= self.budget:
            self.release()
            time.sleep(self.pause_s)  # let a waiting process take it before we queue again
        if self.fh is None:
            import fcntl

            self.fh = open(self.path, "a")
            log(f"{self.what}: waiting for {self.path}")
            t0 = time.time()
            fcntl.flock(self.fh, fcntl.LOCK_EX)
            self.since, self.turns = time.monotonic(), self.turns + 1
            log(f"{self.what}: lock acquired after {time.time() - t0:.0f}s (turn {self.turns})")

    def release(self) -> None:
        if self.fh is not None:
            import fcntl

            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()
            self.fh, self.since = None, None
            log(f"{self.what}: lock released")


def _budget(plan: "Plan") -> float:
    return 60.0 * float(plan.raw.get("lock_budget_minutes", 18))


def _stop_at_deadline_callback(seconds: float | None):
    """A ``TrainerCallback`` that checkpoints and stops training once ``seconds`` have passed; the next
    ``train_classifier`` call resumes from that checkpoint (optimizer, schedule, RNG and data order)."""
    from transformers import TrainerCallback

    class StopAtDeadline(TrainerCallback):
        def __init__(self):
            self.deadline = None if seconds is None else time.monotonic() + seconds
            self.stopped = False

        def on_step_end(self, args, state, control, **kwargs):
            if self.deadline is not None and time.monotonic() >= self.deadline and state.global_step < state.max_steps:
                control.should_save = True
                control.should_training_stop = True
                self.stopped = True
            return control

    return StopAtDeadline()


def _git() -> str | None:
    from debiased_nli.utils.provenance import git_hash

    return git_hash()


# ------------------------------------------------------------------------------------------ row data

@dataclasses.dataclass
class RowData:
    dataset: Any
    info: dict  # what the rows are and the command that made them


def release_dir(plan: Plan, name: str) -> Path:
    return plan.runs_dir / "releases" / name


def _release_inputs(plan: Plan, name: str) -> tuple[list[str], list[str]]:
    """(data_files, new_rows) of a release this table builds; Pending when an input is not on disk."""
    import glob

    if name not in plan.releases:
        raise SystemExit(f"{plan.path}: unknown release {name!r}; releases: {', '.join(plan.releases)}")
    spec = plan.releases[name]
    files = []
    for item in spec.get("data_files") or []:
        split, p = _split_file(item)
        if not _path(p).exists():
            raise Pending(f"release {name!r}: input {_path(p)} does not exist")
        files.append(f"{split}={_path(p)}")
    new_rows = []
    for pattern in spec.get("new_rows") or []:
        found = sorted(glob.glob(str(_path(pattern))))
        if not found:
            raise Pending(f"release {name!r}: the new rows {_path(pattern)} are not on disk"
                          + (f" (make them: {spec['how_to_get']})" if spec.get("how_to_get") else ""))
        new_rows += found
    return files, new_rows


def build_command(plan: Plan, name: str) -> list[str]:
    files, new_rows = _release_inputs(plan, name)
    files = [f"{s}={show(p)}" for s, p in map(_split_file, files)]
    cmd = ["debiased-nli", "build", show(_path(plan.releases[name]["recipe"])), "--data-files", *files]
    if new_rows:
        cmd += ["--new-rows", *map(show, new_rows)]
    return cmd + ["--out", show(release_dir(plan, name))]


def build_release(plan: Plan, name: str, lock: str | None, progress: bool = True) -> Path:
    """Build one of the plan's releases (``debiased-nli build``) if it is not there; records the commit."""
    from debiased_nli.release.recipe import build

    out = release_dir(plan, name)
    if (out / "efficacy_build.json").exists():
        return out
    cmd = build_command(plan, name)
    files, new_rows = _release_inputs(plan, name)
    with heavy_lock(lock, f"build release {name}"):
        if (out / "efficacy_build.json").exists():
            return out
        log("+ " + shlex.join(cmd))
        t0, c0 = time.perf_counter(), time.process_time()
        res = build(_path(plan.releases[name]["recipe"]), out, data_files=files, new_rows_files=new_rows or None,
                    overwrite=True, progress=progress)
        write_json_atomic(out / "efficacy_build.json", {
            "command": shlex.join(cmd), "git": _git(), "configs": res.configs,
            "seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(time.process_time() - c0, 1)})
    return out


def _load_release(plan: Plan, folder: Path, config: str):
    from debiased_nli.data.tasks import get_task
    from debiased_nli.models.training import load_training_split

    return load_training_split(get_task(plan.task), release=str(folder), config=config)


def per_unit_subset(row: dict) -> bool:
    """A random control drawn anew for each seed (``seed: unit``): its seeds vary the subset as well as
    the model, so its spread includes which rows a random subset happens to hold."""
    return "random_subset_of" in row["data"] and row["data"].get("seed") == "unit"


def resolve_row(plan: Plan, row: dict, *, build: bool = False, lock: str | None = None,
                _cache: dict | None = None, unit_seed: int | None = None) -> RowData:
    """The row's training rows, or :class:`Pending`. With ``build``, releases of ``releases:`` are built.
    ``unit_seed``: the seed of the unit, which draws the subset of a ``seed: unit`` random control."""
    from debiased_nli.data.tasks import get_task
    from debiased_nli.models.training import load_training_split

    cache = _cache if _cache is not None else {}
    per_unit = per_unit_subset(row)
    if per_unit and unit_seed is None:
        raise ValueError(f"row {row['name']!r} draws its subset with the unit's seed: give unit_seed")
    key = f"{row['name']}@{unit_seed}" if per_unit else row["name"]
    if key in cache:
        return cache[key]
    if row.get("hold"):
        raise Pending(f"on hold: {row['hold']}")
    d = row["data"]
    if "files" in d:
        paths = [_path(p) for p in d["files"]]
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise Pending(f"training file(s) not on disk: {missing}")
        ds = load_training_split(get_task(plan.task), data_files={"train": [str(p) for p in paths]})
        info = {"kind": "files", "files": [show(p) for p in paths], "command": "the file(s) as they are: "
                + " ".join(show(p) for p in paths)}
    elif "release" in d:
        name = d["release"]
        folder = release_dir(plan, name)
        if not (folder / "efficacy_build.json").exists():
            cmd = build_command(plan, name)  # Pending when an input is missing
            if not build:
                raise NotBuilt(f"release {name!r} is not built yet; `run` builds it: {shlex.join(cmd)}")
            build_release(plan, name, lock)
        rec = json.loads((folder / "efficacy_build.json").read_text())
        if d["config"] not in rec["configs"]:
            raise Pending(f"release {name!r} has no config {d['config']!r} (it has {sorted(rec['configs'])})")
        ds = _load_release(plan, folder, d["config"])
        info = {"kind": "release", "release": show(folder), "config": d["config"], "command": rec["command"],
                "built_at_commit": rec["git"]}
    elif "release_dir" in d:
        folder = _path(d["release_dir"])
        owner = f" ({d['owner']})" if d.get("owner") else ""
        if not folder.exists():
            raise Pending(f"release {folder} does not exist yet{owner}")
        configs = sorted(p.name for p in (folder / "data").iterdir() if p.is_dir()) if (folder / "data").is_dir() else []
        if d["config"] not in configs:
            raise Pending(f"release {folder} has no config {d['config']!r} (it has {configs}){owner}")
        manifest, digest = {}, None
        if (folder / "manifest.json").exists():
            import hashlib

            text = (folder / "manifest.json").read_bytes()
            manifest, digest = json.loads(text), hashlib.sha256(text).hexdigest()
        ds = _load_release(plan, folder, d["config"])
        info = {"kind": "release_dir", "release": show(folder), "config": d["config"],
                "command": d.get("command") or manifest.get("command")
                or f"the release folder {show(folder)} (its manifest.json records the recipe and every stage)",
                "release_manifest_sha256": digest, "release_git": manifest.get("git"),
                "release_stages": [{"stage": st.get("stage"), "counts": st.get("counts")}
                                   for st in manifest.get("stages", [])],
                "release_versions": manifest.get("versions")}
    elif "random_subset_of" in d:
        if not per_unit and not isinstance(d.get("seed", 0), int):
            raise SystemExit(f"{plan.path}: row {row['name']!r}: random subset seed {d['seed']!r} is neither an "
                             f"integer nor 'unit' (the unit's seed)")
        base = resolve_row(plan, plan.row(d["random_subset_of"]), build=build, lock=lock, _cache=cache,
                           unit_seed=unit_seed)
        size = resolve_row(plan, plan.row(d["size_of"]), build=build, lock=lock, _cache=cache, unit_seed=unit_seed)
        n, seed = len(size.dataset), (int(unit_seed) if per_unit else int(d.get("seed", 0)))
        ds = base.dataset.shuffle(seed=seed).select(range(min(n, len(base.dataset))))
        info = {"kind": "random_subset", "of": d["random_subset_of"], "size_of": d["size_of"], "seed": seed,
                "subset_seed_is_unit_seed": per_unit,
                "base": {k: v for k, v in base.info.items() if k in ("files", "release", "config")},
                "command": f"{d['random_subset_of']}.shuffle(seed={seed}).select(range(len({d['size_of']}) = {n})); "
                           f"{d['random_subset_of']}: {base.info['command']}; {d['size_of']}: {size.info['command']}"}
    else:
        raise SystemExit(f"{plan.path}: row {row['name']!r}: data needs files, release, release_dir or random_subset_of")
    info["rows"] = len(ds)
    info["fingerprint"] = ds._fingerprint
    cache[key] = RowData(ds, info)
    return cache[key]


# ------------------------------------------------------------------------------------------ training

def poe_settings(row: dict) -> dict | None:
    """``{beta, gamma, bias_model}`` of a PoE row: explicit values, or a preset of Wu et al.'s Table 10
    (``debiased_nli.models.training.poe_preset``, with the table's words as its source)."""
    poe = row.get("poe")
    if not poe:
        return None
    out = {"bias_model": str(poe.get("bias_model", "tfidf"))}
    if "preset" in poe:
        import debiased_nli.models.training as training

        if not hasattr(training, "poe_preset"):
            raise SystemExit(f"row {row['name']!r}: PoE preset {poe['preset']!r} needs "
                             f"debiased_nli.models.training.poe_preset (not in this checkout); give beta and gamma")
        beta, gamma, source = training.poe_preset(poe["preset"])
        return out | {"beta": float(beta), "gamma": float(gamma), "preset": poe["preset"], "source": source}
    return out | {"beta": float(poe["beta"]), "gamma": float(poe["gamma"])}


def train_config(plan: Plan, row: dict, seed: int, progress: bool = True):
    from debiased_nli.models.training import TrainConfig

    t = plan.train
    poe = poe_settings(row)
    return TrainConfig(model=plan.model, output_dir=str(plan.model_dir(row["name"], seed)),
                       learning_rate=float(t["learning_rate"]), batch_size=int(t["batch_size"]),
                       max_length=int(t["max_length"]), epochs=float(t["epochs"]),
                       warmup_ratio=float(t.get("warmup_ratio", 0.1)), seed=int(seed),
                       data_seed=int(t.get("data_seed", 0)), max_dev_rows=t.get("max_dev_rows"),
                       early_stopping_patience=int(t.get("patience", 3)), poe=poe is not None,
                       poe_beta=poe["beta"] if poe else 1.0, poe_gamma=poe["gamma"] if poe else 1.0,
                       bias_model=poe["bias_model"] if poe else "tfidf",
                       num_threads=t.get("threads"), progress=progress,
                       use_cpu=True if plan.raw.get("device") == "cpu" else None)


def train_cli(cfg, data: RowData, dev_files: list[str], task: str) -> str:
    """The ``debiased-nli train`` command equivalent to ``cfg`` on the row's data."""
    info = data.info
    if info["kind"] == "random_subset":  # train_classifier's --max-train-rows sample is the same shuffle(seed).select
        base = info["base"]
        src = (["--release", base["release"], "--config", base["config"]] if "config" in base
               else ["--data-files", *[f"train={f}" for f in base["files"]]])
        src += ["--max-train-rows", str(info["rows"]), "--data-seed", str(info["seed"])]
    else:
        src = (["--release", info["release"], "--config", info["config"]] if "config" in info
               else ["--data-files", *[f"train={f}" for f in info["files"]]])
    cmd = ["debiased-nli", "train", task, *src, "--dev-files", *dev_files, "--model", show(cfg.model),
           "--out", show(cfg.output_dir),
           "--lr", str(cfg.learning_rate), "--batch-size", str(cfg.batch_size), "--max-length", str(cfg.max_length),
           "--epochs", str(cfg.epochs), "--warmup-ratio", str(cfg.warmup_ratio), "--seed", str(cfg.seed),
           *([] if info["kind"] == "random_subset" else ["--data-seed", str(cfg.data_seed)])]
    if cfg.max_dev_rows:
        cmd += ["--max-dev-rows", str(cfg.max_dev_rows)]
    if cfg.poe:
        cmd += ["--poe", "--poe-beta", str(cfg.poe_beta), "--poe-gamma", str(cfg.poe_gamma), "--bias-model", cfg.bias_model]
    if cfg.num_threads:
        cmd += ["--threads", str(cfg.num_threads)]
    return shlex.join(cmd)


def train_unit(plan: Plan, row: dict, seed: int, data: RowData, lock: str | None, progress: bool = True) -> dict:
    """Train one (row, seed) unless its model folder already has the record; returns the record.

    Training runs in turns of the heavy lock: when a turn is over the Trainer checkpoints and stops, the
    lock is given up, and the next turn resumes from the checkpoint; wall and CPU time are summed."""
    from debiased_nli.data.tasks import get_task
    from debiased_nli.bias.poe import bias_model_for
    from debiased_nli.models.training import TRAIN_CONFIG_FILE, load_training_split, train_classifier

    out = plan.model_dir(row["name"], seed)
    rec_path = out / TRAIN_RECORD
    if rec_path.exists():
        return json.loads(rec_path.read_text())
    cfg = train_config(plan, row, seed, progress)
    dev_files = [str(_path(p)) for p in plan.train["dev_files"]]
    shown = [show(p) for p in dev_files]
    dev = load_training_split(get_task(plan.task), data_files={"validation": dev_files}, split="validation")
    sessions_path = out / "efficacy_train_sessions.json"
    sessions = json.loads(sessions_path.read_text()) if sessions_path.exists() else []
    what = f"train {row['name']} seed {seed}"
    with LockTurns(lock, _budget(plan) if lock else None, what) as turns:
        while True:
            turns.step()
            commit = _git()
            log(f"{what}: {len(data.dataset):,} rows at {commit}, session {len(sessions) + 1}")
            cb = _stop_at_deadline_callback(turns.remaining())
            t0, c0 = time.perf_counter(), time.process_time()
            bias = bias_model_for(cfg, plan.task) if cfg.poe and cfg.bias_model != "joint" else None
            res = train_classifier(cfg, plan.task, data.dataset, dev, callbacks=[cb], bias_model=bias)
            sessions.append({"git": commit, "seconds": round(time.perf_counter() - t0, 1),
                             "cpu_seconds": round(time.process_time() - c0, 1), "stopped_for_the_lock": cb.stopped,
                             "resumed_from": res.resumed_from})
            write_json_atomic(sessions_path, sessions)
            if not cb.stopped:
                break
            log(f"{what}: checkpointed after {sessions[-1]['seconds']:.0f}s; resuming in the next turn")
        # the rows themselves, as train_classifier hashed them for its run record (not how they were read):
        # seeds of a row whose release was rebuilt in between (AFLite, PDD and IBADR rebuilds are not
        # bit-identical across machines) can then be told apart
        hashed = json.loads((out / TRAIN_CONFIG_FILE).read_text())["train_fingerprint"]
        record = {"row": row["name"], "seed": seed, "git": commit, "config": cfg.to_dict(),
                  "command": train_cli(cfg, data, shown, plan.task),
                  "data": data.info | {"content_fingerprint": hashed},
                  "result": res.to_dict(), "seconds": round(sum(x["seconds"] for x in sessions), 1),
                  "cpu_seconds": round(sum(x["cpu_seconds"] for x in sessions), 1), "sessions": sessions,
                  "commits": sorted({x["git"] or "?" for x in sessions}), "device": device_name(),
                  "epoch_dev_accuracy": _epoch_history(out, res.best_checkpoint),
                  "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        for ck in out.glob("checkpoint-*"):  # the best model is saved in `out`; checkpoints are only for resuming
            shutil.rmtree(ck, ignore_errors=True)
        write_json_atomic(rec_path, record)
    log(f"trained {row['name']} seed {seed} in {record['seconds']:.0f}s ({len(sessions)} session(s)): "
        f"dev accuracy {res.dev_accuracy} ({res.dev_rows} rows)")
    return record


def _epoch_history(out: Path, best_checkpoint: str | None) -> list[dict]:
    """Dev accuracy after each evaluation, from the Trainer's state (the curve that sized the settings)."""
    states = sorted(out.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not states:
        return []
    hist = json.loads(states[-1].read_text()).get("log_history", [])
    return [{"epoch": h.get("epoch"), "step": h.get("step"), "dev_accuracy": h["eval_accuracy"]}
            for h in hist if "eval_accuracy" in h]


# ------------------------------------------------------------------------------------------ evaluation

def eval_config(plan: Plan, progress: bool = True):
    from debiased_nli.models.evaluation import EvalConfig

    e = plan.evaluate
    return EvalConfig(max_examples=e.get("max_examples"), batch_size=int(e.get("batch_size", 64)),
                      max_length=int(e.get("max_length", 128)), max_tokens=e.get("max_tokens"),
                      dtype=str(e.get("dtype", "float32")),
                      data_root=str(_path(e["data_root"])) if e.get("data_root") else None, progress=progress,
                      device="cpu" if plan.raw.get("device") == "cpu" else None)


EVAL_CHUNK_ROWS = 5000


def evaluate_unit(plan: Plan, row: dict, seed: int, train_record: dict, lock: str | None, progress: bool = True) -> dict:
    """Score the unit's model on every set (full sets unless the plan says ``max_examples``) with
    ``debiased-nli evaluate``'s :func:`debiased_nli.models.evaluation.evaluate_models`, the probabilities
    computed in chunks of at most 5,000 rows, each cached in the model folder, so the stage can give up the
    lock between chunks and an interrupted evaluation continues."""
    import torch

    from debiased_nli.models.challenge import resolve_sets
    from debiased_nli.models.evaluation import evaluate_models
    from debiased_nli.utils.provenance import library_versions

    path = plan.unit_file(row["name"], seed)
    model = str(plan.model_dir(row["name"], seed))
    cfg = eval_config(plan, progress)
    what = f"evaluate {row['name']} seed {seed}"
    threads_set = False
    with LockTurns(lock, _budget(plan) if lock else None, what) as turns:
        def before_chunk() -> None:  # a turn at the lock per chunk; the CPU threads once work starts
            nonlocal threads_set
            turns.step()
            if not threads_set and plan.evaluate.get("threads"):
                torch.set_num_threads(int(plan.evaluate["threads"]))
            threads_set = True

        results = evaluate_models([model], resolve_sets(sets=plan.evaluate["sets"]), cfg, chunk_rows=EVAL_CHUNK_ROWS,
                                  cache_dirs={model: plan.model_dir(row["name"], seed) / "eval_cache"},
                                  before_chunk=before_chunk)
    per_set, commits = {}, set()
    for name, entry in results["sets"].items():
        run = entry["runs"][0]
        per_set[name] = {"accuracy": run["accuracy"], "n": entry["n"], "n_total": entry["n_total"],
                         "subsampled": entry["subsampled"], "breakdowns": run.get("breakdowns") or {},
                         "confusion": run["confusion"], "seconds": run["predict_seconds"],
                         "cpu_seconds": run["predict_cpu_seconds"]}
        commits.update(run["predict_git"])
        log(f"{what}: {name} {100 * run['accuracy']:.2f} ({entry['n']:,} rows, {run['predict_seconds']:.0f}s)")
    n_rows = sum(v["n"] for v in per_set.values())
    seconds = sum(v["seconds"] for v in per_set.values())
    cpu = sum(v["cpu_seconds"] for v in per_set.values())
    unit = {
        "schema": SCHEMA, "row": row["name"], "seed": seed, "description": row.get("description", ""),
        "poe": poe_settings(row), "data": train_record["data"],
        "train": {k: train_record.get(k) for k in ("git", "commits", "command", "seconds", "cpu_seconds",
                                                   "epoch_dev_accuracy", "config", "finished", "sessions", "device")}
                 | {"rows": train_record["result"]["train_rows"], "dev_accuracy": train_record["result"]["dev_accuracy"],
                    "dev_rows": train_record["result"]["dev_rows"]},
        "evaluation": {"git": sorted(commits), "config": results["config"],
                       "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "rows": n_rows,
                       "examples_per_second": round(n_rows / max(seconds, 1e-9), 1),
                       "command": shlex.join(["debiased-nli", "evaluate", "--model", show(model), "--sets", *plan.evaluate["sets"],
                                              "--max-length", str(cfg.max_length), "--batch-size", str(cfg.batch_size)]
                                             + (["--max-tokens", str(cfg.max_tokens)] if cfg.max_tokens else [])
                                             + (["--dtype", cfg.dtype] if cfg.dtype != "float32" else [])
                                             + (["--max-examples", str(cfg.max_examples)] if cfg.max_examples else [])
                                             + ["--out", "<dir>"])},
        "sets": per_set, "versions": library_versions(), "device": device_name(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    write_json_atomic(path, unit)
    log(f"evaluated {row['name']} seed {seed}: {n_rows:,} rows in {seconds:.0f}s ({n_rows / max(seconds, 1e-9):.0f} ex/s); "
        + ", ".join(f"{k} {100 * v['accuracy']:.1f}" for k, v in per_set.items()))
    return unit


# ------------------------------------------------------------------------------------------ run / status

def unit_states(plan: Plan, rows: list[str] | None = None, seeds: list[int] | None = None) -> list[dict]:
    """One entry per (row, seed): done, trained, todo, or pending (with the reason)."""
    cache: dict = {}
    out = []
    for row in plan.rows:
        if rows and row["name"] not in rows:
            continue
        reason, buildable = None, False
        try:
            resolve_row(plan, row, build=False, _cache=cache, unit_seed=plan.seeds[0])
        except Pending as p:
            reason, buildable = str(p), isinstance(p, NotBuilt)
        for seed in plan.seeds:
            if seeds is not None and seed not in seeds:
                continue
            if plan.unit_file(row["name"], seed).exists():
                state = "done"
            elif reason and not buildable:
                state = "pending"
            elif (plan.model_dir(row["name"], seed) / TRAIN_RECORD).exists():
                state = "trained"
            else:
                state = "todo"
            out.append({"row": row["name"], "seed": seed, "state": state, "reason": reason if state in ("pending", "todo") else None})
    return out


def _row_command(us: list[dict]) -> str:
    """How a row's data was made, from its first unit's record; a subset drawn anew for each seed says so
    (its first unit's shuffle seed is only that unit's)."""
    d = us[0]["data"]
    if d.get("kind") == "random_subset" and d.get("subset_seed_is_unit_seed"):
        seeds = ", ".join(str(u["seed"]) for u in sorted(us, key=lambda u: u["seed"]))
        return (d["command"].replace(f".shuffle(seed={d['seed']})", ".shuffle(seed=s)", 1)
                + f"; s = the unit's seed ({seeds})")
    return d["command"]


def device_name() -> str:
    """What a unit ran on, as its result file records it: the GPU's name, or the CPU's model."""
    import platform

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}, torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), cpu)
    return f"CPU: {cpu} (torch {torch.__version__})"


def require_device(plan: Plan) -> None:
    """A plan with ``device: cuda`` refuses to run where no GPU is visible (a GPU table is never
    quietly computed on a CPU)."""
    if plan.raw.get("device") == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"{show(plan.path)} is the GPU plan (device: cuda) and this machine has no CUDA GPU "
                             f"visible; run benchmarks/efficacy.yaml here, or this plan on a GPU machine")


def unit_order(plan: Plan, rows: list[str] | None = None, seeds: list[int] | None = None,
               seed_major: bool = False) -> list[tuple[str, int]]:
    """The (row, seed) units to run, row by row (all seeds of a row, then the next row), or with
    ``seed_major`` seed by seed (every row's seed 0 first), so a run stopped early has whole seeds."""
    names = list(rows) if rows else [r["name"] for r in plan.rows]  # in the order asked for
    for n in names:
        plan.row(n)
    ss = [s for s in plan.seeds if seeds is None or s in seeds]
    return [(n, s) for s in ss for n in names] if seed_major else [(n, s) for n in names for s in ss]


def claim(claims: Path, row: str, seed: int) -> bool:
    """Take the unit for this process (``O_CREAT | O_EXCL``: of several processes sharing ``claims``,
    exactly one gets each unit). A claim is never released: a unit whose process died is run again by
    a later ``run`` with a fresh claims folder (it resumes from its checkpoint)."""
    claims.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(claims / f"{row}-s{seed}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}\n")
    return True


def run(plan: Plan, rows: list[str] | None = None, seeds: list[int] | None = None, lock: str | None = None,
        progress: bool = True, stop_after: int | None = None, claims: str | os.PathLike | None = None,
        seed_major: bool = False) -> list[dict]:
    """Train and evaluate every unit that has no result file; returns the states (pending rows reported).

    ``claims``: a folder shared by several ``run`` processes (one per GPU share, say); each takes the
    next unit nobody has claimed, so they split the table between them without running a unit twice."""
    require_device(plan)
    cache: dict = {}
    finished = 0
    pending: set[str] = set()
    failed: dict[str, str] = {}
    for name, seed in unit_order(plan, rows, seeds, seed_major):
        row = plan.row(name)
        if name in pending or name in failed or plan.unit_file(name, seed).exists():
            continue
        try:
            try:
                data = resolve_row(plan, row, build=True, lock=lock, _cache=cache, unit_seed=seed)
            except Pending as p:
                log(f"pending {name}: {p}")
                pending.add(name)
                continue
            if claims is not None and not claim(Path(claims), name, seed):
                continue
            rec = train_unit(plan, row, seed, data, lock, progress)
            evaluate_unit(plan, row, seed, rec, lock, progress)
        except Exception as err:  # noqa: BLE001 - a shared worker logs a broken row and goes on with the next
            if claims is None:
                raise
            import traceback

            log(f"FAILED {name} seed {seed}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
            failed[name] = f"{type(err).__name__}: {err}"
            continue
        finished += 1
        if stop_after and finished >= stop_after:
            return unit_states(plan, rows, seeds)
    if failed:
        raise SystemExit("rows that failed (the others ran): " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    states = unit_states(plan, rows, seeds)
    for s in states:
        if s["state"] == "pending":
            log(f"pending {s['row']} seed {s['seed']}: {s['reason']}")
    return states


# ------------------------------------------------------------------------------------------ report

def load_units(plan: Plan) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in sorted(plan.results_dir.glob("*-s*.json")):
        unit = json.loads(p.read_text())
        if unit.get("schema") == SCHEMA:
            out.setdefault(unit["row"], []).append(unit)
    for units in out.values():
        units.sort(key=lambda u: u["seed"])
    return out


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    import numpy as np

    a = np.asarray(values, dtype=float)
    return float(a.mean()), (float(a.std(ddof=1)) if len(a) > 1 else None)


def _compare_with(row: dict) -> list[dict]:
    """A row's `compare_with:` as a list of {row, why}: the rows it is compared with besides the reference
    (e.g. z_filtered with the random subset of its size, which separates "debiased data" from "less data")."""
    raw = row.get("compare_with") or []
    items = raw if isinstance(raw, list) else [raw]
    return [{"row": c, "why": ""} if isinstance(c, str) else {"row": c["row"], "why": c.get("why", "")} for c in items]


def comparisons(plan: Plan, table: dict) -> list[dict]:
    """Each declared `compare_with` pair whose rows both have finished units: difference and call per set."""
    out = []
    for row in plan.rows:
        a = table["rows"][row["name"]].get("sets") or {}
        for c in _compare_with(row):
            calls = _calls(a, table["rows"][c["row"]].get("sets") or {})
            if calls:
                out.append({"row": row["name"], "against": c["row"], "why": c["why"], "sets": calls})
    return out


def summarise(plan: Plan) -> dict:
    """The table: per row its status, training size/time, and mean ± std per set (and breakdowns)."""
    from debiased_nli.release.efficacy import TABLE_SCHEMA  # the schema the release card reads

    units = load_units(plan)
    states = unit_states(plan)
    table: dict[str, Any] = {"schema": TABLE_SCHEMA, "plan": plan.raw, "reference": plan.reference,
                             "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                             "sets": list(plan.evaluate["sets"]), "rows": {},
                             "devices": sorted({u.get("device") or "not recorded" for us in units.values() for u in us})}
    for row in plan.rows:
        name = row["name"]
        us = [u for u in units.get(name, []) if u["seed"] in plan.seeds]
        st = [s for s in states if s["row"] == name]
        entry: dict[str, Any] = {"description": row.get("description", ""), "seeds_done": [u["seed"] for u in us],
                                 "seeds_planned": plan.seeds, "data": row["data"], "poe": row.get("poe"),
                                 "states": {s["seed"]: s["state"] for s in st},
                                 "pending_reason": next((s["reason"] for s in st if s["state"] == "pending"), None),
                                 "todo_note": next((s["reason"] for s in st if s["state"] == "todo" and s["reason"]), None)}
        if us:
            entry["train_rows"] = us[0]["train"]["rows"]
            entry["train_rows_by_seed"] = {u["seed"]: u["train"]["rows"] for u in us}
            # a release_dir row's own `command` (how its folder is built) over what its first unit recorded
            entry["data_command"] = row["data"].get("command") or _row_command(us)
            entry["config"] = us[0]["data"].get("config")
            entry["train_seconds"] = _mean_std([u["train"]["seconds"] for u in us])[0]
            entry["train_cpu_seconds"] = _mean_std([u["train"]["cpu_seconds"] for u in us])[0]
            entry["eval_seconds"] = _mean_std([u["evaluation"]["seconds"] for u in us])[0]
            entry["eval_examples_per_second"] = _mean_std([u["evaluation"]["examples_per_second"] for u in us])[0]
            entry["dev_accuracy_selection"] = _mean_std([u["train"]["dev_accuracy"] for u in us])[0]
            entry["commits"] = sorted({c for u in us for c in (u["train"].get("commits") or [u["train"]["git"]])}
                                      | {c for u in us for c in u["evaluation"]["git"]})
            entry["sets"] = {}
            for s in plan.evaluate["sets"]:
                vals = [u["sets"][s]["accuracy"] for u in us if s in u["sets"]]
                if not vals:
                    continue
                m, sd = _mean_std(vals)
                entry["sets"][s] = {"mean": m, "std": sd, "n_seeds": len(vals), "runs": vals,
                                    "n": us[0]["sets"][s]["n"], "subsampled": us[0]["sets"][s]["subsampled"]}
            entry["breakdowns"] = _breakdowns(us)
            entry["data_fingerprints"] = {u["seed"]: u["data"].get("content_fingerprint") for u in us}
            entry["data_builds"] = {u["seed"]: _build_of(u["data"]) for u in us}
            entry["subset_per_seed"] = per_unit_subset(row)
            entry["predicted_shares"] = _predicted_shares(us)
        table["rows"][name] = entry
    table["verdict"] = verdicts(table)
    table["comparisons"] = comparisons(plan, table)
    rep = replication(plan, table)
    if rep:
        table["replication"] = rep
    return table


def replication(plan: Plan, table: dict) -> dict | None:
    """With ``replicates: other.yaml`` (the GPU plan names the CPU one): per row finished in both tables,
    this table's mean minus the other's on each set, with the same call as between rows (more than twice
    the standard error of the difference and one point): does the other table replicate here?"""
    if not plan.raw.get("replicates"):
        return None
    other = load_plan(_path(plan.raw["replicates"], plan.path.parent))
    if other.results_dir == plan.results_dir:
        raise SystemExit(f"{plan.path}: replicates {plan.raw['replicates']!r}, which writes to the same results_dir")
    their_table = summarise(other)
    theirs = their_table["rows"]
    rows = {name: _calls(e["sets"], theirs[name]["sets"]) for name, e in table["rows"].items()
            if e.get("sets") and (theirs.get(name) or {}).get("sets")}
    calls = [c for r in rows.values() for c in r.values() if c["se"] is not None]
    return {"against": show(other.path), "results": show(other.results_dir), "rows": rows,
            "differences": len(calls), "called": sum(c["call"] in ("helps", "hurts") for c in calls),
            "devices": their_table["devices"]}


BREAKDOWNS = [("hans", "heuristic/label"), ("anli", "round"), ("snli_test", "hard")]
# sets whose predicted-label shares the report shows: a model that drifts to one label out of domain
# (a random subset's model predicts neutral on 56% of MNLI matched, the original's on 43%), or that
# answers HANS by word overlap (entailment on nearly every row, McCoy et al. 2019), shows it here
SHARE_SETS = ["snli_dev", "mnli_dev_matched", "mnli_dev_mismatched", "hans"]


def _predicted_shares(units: list[dict]) -> dict:
    """Per set of SHARE_SETS: the mean share of rows predicted as each label, and the gold shares, over the
    units that recorded a confusion matrix (units evaluated before it was recorded have none)."""
    out = {}
    for s in SHARE_SETS:
        mats = [u["sets"][s]["confusion"] for u in units if "confusion" in (u["sets"].get(s) or {})]
        if not mats:
            continue
        labels = list(mats[0])
        total = [sum(sum(r.values()) for r in m.values()) for m in mats]
        pred = {lab: sum(sum(m[g][lab] for g in labels) / n for m, n in zip(mats, total)) / len(mats) for lab in labels}
        gold = {lab: sum(mats[0][lab].values()) / total[0] for lab in labels}
        out[s] = {"predicted": pred, "gold": gold, "n_seeds": len(mats)}
    return out


def _breakdowns(units: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for s, b in BREAKDOWNS:
        groups: dict[str, list[float]] = {}
        for u in units:
            for g, v in ((u["sets"].get(s) or {}).get("breakdowns", {}).get(b) or {}).items():
                groups.setdefault(g, []).append(v["accuracy"])
        if groups:
            out[f"{s}: {b}"] = {g: dict(zip(("mean", "std"), _mean_std(v))) | {"n_seeds": len(v)} for g, v in groups.items()}
    return out


def compare(a: dict, b: dict) -> tuple[float, float | None, str]:
    """(difference in points, its standard error, 'helps'/'hurts'/'no clear change'/'one seed').

    A difference counts when it exceeds twice the standard error of the difference of two means
    (sqrt(s_a^2/n_a + s_b^2/n_b)) and one point; with fewer than 2 seeds on either side, no call is made.
    """
    diff = 100 * (a["mean"] - b["mean"])
    if a["std"] is None or b["std"] is None:
        return diff, None, "one seed"
    se = 100 * math.sqrt(a["std"] ** 2 / a["n_seeds"] + b["std"] ** 2 / b["n_seeds"])
    if abs(diff) > max(2 * se, 1.0):
        return diff, se, "helps" if diff > 0 else "hurts"
    return diff, se, "no clear change"


def _calls(a: dict, b: dict) -> dict:
    """Per set that both rows have: row a's difference from row b, its standard error and the call."""
    calls = {}
    for s, v in a.items():
        if s in b:
            diff, se, call = compare(v, b[s])
            calls[s] = {"difference": round(diff, 2), "se": None if se is None else round(se, 2), "call": call}
    return calls


def verdicts(table: dict) -> dict:
    ref = table["rows"].get(table["reference"], {}).get("sets")
    if not ref:
        return {}
    return {name: _calls(entry["sets"], ref) for name, entry in table["rows"].items()
            if name != table["reference"] and entry.get("sets")}


def _cell(v: dict | None) -> str:
    if not v:
        return "–"
    return f"{100 * v['mean']:.1f}" + (f" ± {100 * v['std']:.1f}" if v["std"] is not None else "") + \
        (f" ({v['n_seeds']})" if v["n_seeds"] < 3 else "")


def _call_line(label: str, calls: dict) -> str:
    """One verdict line: where the first row helps, hurts or makes no clear change against the second."""
    helps = [s for s, c in calls.items() if c["call"] == "helps"]
    hurts = [s for s, c in calls.items() if c["call"] == "hurts"]
    same = [s for s, c in calls.items() if c["call"] == "no clear change"]
    if not (helps or hurts or same):
        return f"- {label}: one seed only, no call yet."
    fmt = lambda ss: ", ".join(f"{s} ({calls[s]['difference']:+.1f})" for s in ss)  # noqa: E731
    parts = [f"helps on {fmt(helps)}" if helps else "helps on no set"]
    if hurts:
        parts.append(f"hurts on {fmt(hurts)}")
    if same:
        parts.append(f"no clear change on {fmt(same)}")
    return f"- {label}: " + "; ".join(parts) + "."


def verdict_paragraph(table: dict) -> str:
    ref = table["reference"]
    finished = [n for n, e in table["rows"].items() if e.get("sets")]
    lines = []
    for name, calls in table["verdict"].items():
        lines.append(_call_line(f"**{name}** vs {ref}", calls))
    for comp in table.get("comparisons", []):
        lines.append(_call_line(f"**{comp['row']}** vs {comp['against']}"
                                + (f" ({comp['why']})" if comp["why"] else ""), comp["sets"]))
    pending = [f"`{n}`" for n, e in table["rows"].items() if not e.get("sets") and e["pending_reason"]]
    todo = [f"`{n}`" for n, e in table["rows"].items() if not e.get("sets") and not e["pending_reason"]]
    head = (f"Finished rows: {', '.join(f'`{n}`' for n in finished) or 'none'}. A method *helps* (or *hurts*) on a "
            f"set when its mean differs from `{ref}`'s by more than twice the standard error of the difference "
            f"and at least one point; differences in points.")
    tail = " ".join(([f"Not run yet: {', '.join(todo)}."] if todo else [])
                    + ([f"Pending (their data does not exist yet; reasons below): {', '.join(pending)}."] if pending else []))
    return "\n".join([head, ""] + lines + ([""] + [tail] if tail else []))


def write_markdown(table: dict, plan: Plan, path: Path, figure: str | None) -> None:
    from debiased_nli.release.efficacy import difference_cells, train_rows_text

    sets = table["sets"]
    ref = table["rows"].get(table["reference"], {})
    L = ["# The efficacy table: every method, one model, every challenge set", "",
         "Does training on a debiased release make a model more robust? all-MiniLM-L6-v2, the same settings for "
         "every row, scored on every challenge set **in full** (no samples). Accuracy (%), mean ± sample std over "
         "the finished seeds (a number in brackets: fewer than 3 seeds finished).", "",
         f"Commands (resumable; one result file per (row, seed) in `{show(plan.results_dir)}/`):", "", "```"]
    plan_arg = "" if plan.path.resolve() == DEFAULT_PLAN.resolve() else f" --plan {show(plan.path)}"
    L += plan.raw.get("commands") or [
        f"python benchmarks/efficacy.py status{plan_arg}",
        f"nohup python benchmarks/efficacy.py run{plan_arg} --lock /tmp/debiased-heavy.lock > efficacy.log 2>&1 &",
        f"python benchmarks/efficacy.py report{plan_arg}"]
    L += ["```", ""]
    if plan.raw.get("note"):
        L += [" ".join(str(plan.raw["note"]).split()), ""]
    t = plan.train
    gpus = [d for d in table.get("devices", []) if not d.startswith("CPU") and d != "not recorded"]
    where = (f"on {', '.join(gpus)}" if gpus else f"{t.get('threads')} CPU threads")
    L += [f"- Model: `{Path(plan.model).name}` (a fresh 3-way head). Training: lr {t['learning_rate']}, batch "
          f"{t['batch_size']}, max length {t['max_length']}, {t['epochs']} epochs, {int(100 * t.get('warmup_ratio', 0.1))}% linear "
          f"warm-up, the best epoch by accuracy on a seeded {t.get('max_dev_rows') or 'full'}-row sample of SNLI dev, "
          f"{where}; seeds {', '.join(map(str, plan.seeds))}.",
          f"- Evaluation: {len(sets)} sets in full, max length {plan.evaluate.get('max_length')}, batches by token length "
          f"(at most {plan.evaluate.get('batch_size')} rows"
          + (f" and {plan.evaluate['max_tokens']} padded tokens" if plan.evaluate.get("max_tokens") else "")
          + " per batch, padded to the batch's longest row; the batching changes no probability by more than 3e-8)"
          + (f", forward passes in {plan.evaluate['dtype']} autocast" if plan.evaluate.get("dtype", "float32") != "float32" else "")
          + ", "
          "HANS scored 2-way (neutral and contradiction -> non-entailment), MNLI zero-shot from SNLI.", ""]
    speed_file = path.parent / f"{path.stem}_speed.json"
    if speed_file.exists():
        sp = json.loads(speed_file.read_text())
        L += [f"Evaluation speed (`python benchmarks/efficacy.py speed`: the same {sp['rows']:,} rows, "
              f"{next(iter(sp['rows_per_set'].values()))} per set, {sp['threads']} threads, one model"
              + (f" (`{sp['model']}`)" if sp.get("model") else "") + "; ratios, probability differences and "
              "argmax agreement against the first row, measured in the same run on the shared machine):", "",
              "| rows per batch | padded tokens per batch | dtype | examples/s | ratio | max prob. diff. | same argmax |",
              "|---:|---:|---|---:|---:|---:|---:|"]
        L += [f"| {r['batch_size']} | {r['max_tokens'] or '–'} | {r.get('dtype', 'float32')} | {r['examples_per_second']} | "
              f"{r['ratio_vs_first']} | {r['max_abs_prob_diff_vs_first']:.1e} | "
              + (f"{100 * r['same_argmax_vs_first']:.2f}%" if "same_argmax_vs_first" in r else "–") + " |"
              for r in sp["runs"]]
        cpu = sp.get("cpu")
        L += ["", (f"CPU: {cpu['model']}, torch CPU capability {cpu['torch_cpu_capability']}, native bfloat16 "
                   f"(avx512_bf16 / amx_bf16): {'yes' if cpu['native_bfloat16'] else 'no'}." if cpu else
                   "The CPU's flags were not recorded with this measurement.")
              + " bfloat16 autocast is faster only on CPUs with avx512_bf16 or amx_bf16; elsewhere torch emulates it "
                "and it is several times slower (`benchmarks/bench_dtype.py`, `benchmarks/results/dtype_bench.md`).", ""]
    if figure:
        L += [f"![efficacy]({figure})", ""]
    L += ["## Accuracy by set", "", "| row | train rows | " + " | ".join(sets) + " |",
          "|---|---:|" + "---:|" * len(sets)]
    for name, e in table["rows"].items():
        if e.get("sets"):
            L.append(f"| `{name}` | {train_rows_text(e)} | " + " | ".join(_cell(e["sets"].get(s)) for s in sets) + " |")
        else:
            L.append(f"| `{name}` | {'pending' if e['pending_reason'] else 'not run yet'} | "
                     + " | ".join("–" for _ in sets) + " |")
    if ref.get("sets"):
        L += ["", f"### Difference from `{table['reference']}` (points; * = more than 2 standard errors and 1 point)", "",
              "| row | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
        for name, calls in table["verdict"].items():
            L.append(f"| `{name}` | " + difference_cells(calls, sets) + " |")
    if table.get("comparisons"):
        L += ["", "### Other comparisons (first row minus second, points; * = more than 2 standard errors and 1 point)", "",
              "| rows | why | " + " | ".join(sets) + " |", "|---|---|" + "---:|" * len(sets)]
        for comp in table["comparisons"]:
            L.append(f"| `{comp['row']}` − `{comp['against']}` | {comp['why'] or '–'} | "
                     + difference_cells(comp["sets"], sets) + " |")
    rep = table.get("replication")
    if rep and rep["rows"]:
        L += ["", f"### Against `{rep['results']}.md` ({rep['against']}: the same rows, model, recipe and sets; "
                  f"this table minus that one, points; * = more than 2 standard errors and 1 point)", "",
              f"{rep['called']} of the {rep['differences']} differences with at least two seeds on both sides are called.",
              "", "| row | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
        for name, calls in rep["rows"].items():
            L.append(f"| `{name}` | " + difference_cells(calls, sets) + " |")
    L += ["", "## Verdict (from finished units only)", "", verdict_paragraph(table), ""]
    L += ["## Breakdowns", ""]
    keys = sorted({k for e in table["rows"].values() for k in (e.get("breakdowns") or {})})
    for key in keys:
        groups = sorted({g for e in table["rows"].values() for g in (e.get("breakdowns") or {}).get(key, {})})
        L += [f"### {key}", "", "| row | " + " | ".join(groups) + " |", "|---|" + "---:|" * len(groups)]
        for name, e in table["rows"].items():
            b = (e.get("breakdowns") or {}).get(key)
            if b:
                L.append(f"| `{name}` | " + " | ".join(_cell(b.get(g)) for g in groups) + " |")
        L.append("")
    shares = {n: e["predicted_shares"] for n, e in table["rows"].items() if e.get("predicted_shares")}
    if shares:
        cols = [(s, lab) for s in SHARE_SETS for lab in next((v[s]["gold"] for v in shares.values() if s in v), {})]
        L += ["### Predicted labels (% of each set's rows; mean over the seeds that recorded a confusion matrix, "
              "their number in brackets)", "",
              "| row | " + " | ".join(f"{s}: {lab}" for s, lab in cols) + " |", "|---|" + "---:|" * len(cols)]
        gold = {s: v[s]["gold"] for v in shares.values() for s in v}
        L.append("| *gold* | " + " | ".join(f"{100 * gold[s][lab]:.1f}" if s in gold else "–" for s, lab in cols) + " |")
        for name, v in shares.items():
            L.append(f"| `{name}` | " + " | ".join(f"{100 * v[s]['predicted'][lab]:.1f} ({v[s]['n_seeds']})" if s in v
                                                  else "–" for s, lab in cols) + " |")
        L.append("")
    L += ["## Rows: data, size, cost, status", "",
          "| row | status | train rows | same rows in every seed | train wall / CPU s (mean) | eval wall s (mean) | eval ex/s | dev acc. (selection sample) | commits |",
          "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for name, e in table["rows"].items():
        done = len(e["seeds_done"])
        status = f"{done}/{len(e['seeds_planned'])} seeds" + ("; pending" if e["pending_reason"] else "")
        if e.get("sets"):
            L.append(f"| `{name}` | {status} | {train_rows_text(e)} | "
                     f"{_same_rows(e.get('data_fingerprints') or {}, e.get('subset_per_seed', False), e.get('train_rows_by_seed'), e.get('data_builds'))} | "
                     f"{e['train_seconds']:.0f} / {e['train_cpu_seconds']:.0f} | "
                     f"{e['eval_seconds']:.0f} | {e['eval_examples_per_second']:.0f} | {100 * e['dev_accuracy_selection']:.1f} | "
                     + ", ".join(f"`{c[:10]}{'-dirty' if c.endswith('-dirty') else ''}`" for c in e["commits"]) + " |")
        else:
            L.append(f"| `{name}` | {status} | – | – | – | – | – | – | – |")
    L += ["", "How each row's data was built:", ""]
    for name, e in table["rows"].items():
        if e.get("data_command"):
            how = f"`{e['data_command']}`"
        elif e["pending_reason"]:
            how = f"**pending**: {e['pending_reason']}"
        else:
            how = "not run yet" + (f" ({e['todo_note']})" if e.get("todo_note") else "")
        L.append(f"- `{name}` ({e['description']}): {how}")
    L += ["", ((f"Times are wall-clock on {', '.join(gpus)}, shared by the units that ran at once (CPU seconds "
                "beside them)") if gpus else
               "Times are wall-clock on a 2-core machine shared with other work (CPU seconds beside them)")
          + "; the exact `debiased-nli train` / `evaluate` commands of each unit are in its result file.", ""]
    path.write_text("\n".join(L))


def _build_of(data: dict) -> str | None:
    """Which build of its data a unit read, where the unit has no content fingerprint to say which rows:
    the release's manifest sha256 (a release folder) or the commit it was built at (a release the harness
    built). Two seeds with different builds may have trained on different rows. (``datasets``' own
    fingerprint is no such sign: it hashes the path and modification time, which change on a copy.)"""
    for key in ("release_manifest_sha256", "built_at_commit"):
        if data.get(key):
            return f"{key}:{data[key]}"
    return None


def _same_rows(fingerprints: dict, per_seed: bool = False, sizes: dict | None = None,
               builds: dict | None = None) -> str:
    """Whether the finished seeds of a row trained on the same rows, from their content fingerprints
    (``debiased_nli.data.loading.content_fingerprint``; units finished before it was recorded have none) and,
    failing those, their sizes and which build of the data they read (``builds``, :func:`_build_of`): a
    seed without a content fingerprint that read another build than another seed is marked, since the
    two may have trained on different rows (a release rebuilt on another machine or at another commit).
    ``per_seed``: a random control drawn anew for each seed, whose rows are meant to differ."""
    known = {s: f for s, f in fingerprints.items() if f}
    if per_seed:
        return f"no, drawn anew per seed ({len(set(known.values()))} distinct in {len(known)} seeds)"
    if sizes and len(set(sizes.values())) > 1:
        return "**no**: " + ", ".join(f"s{s} {n:,} rows" for s, n in sorted(sizes.items()))
    missing = sorted(s for s in fingerprints if s not in known)
    builds = {s: b for s, b in (builds or {}).items() if b}
    unverified = sorted(s for s in missing if s in builds and any(builds.get(o) not in (None, builds[s])
                                                                  for o in fingerprints if o != s))
    if unverified and len(set(known.values())) <= 1:
        ids = {b: f"b{i + 1}" for i, b in enumerate(dict.fromkeys(builds[s] for s in sorted(builds)))}
        return ("**maybe not**: the seeds read different builds (" +
                ", ".join(f"s{s} {ids[builds[s]]}" for s in sorted(builds)) +
                f"); contents not recorded for seed {', '.join(map(str, missing))}")
    if not known:
        return "not recorded"
    distinct = sorted(set(known.values()))
    if len(distinct) == 1:
        text = f"yes (`{distinct[0][:8]}`)" if len(known) > 1 else f"one seed (`{distinct[0][:8]}`)"
    else:
        text = "**no**: " + ", ".join(f"s{s} `{f[:8]}`" for s, f in sorted(known.items()))
    return text + (f"; not recorded for seed {', '.join(map(str, missing))}" if missing else "")


def plot(table: dict, path: Path) -> Path | None:
    """Methods x sets: one panel per set, a bar per finished row (mean ± std), the reference as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [n for n, e in table["rows"].items() if e.get("sets")]
    if not rows:
        return None
    sets = table["sets"]
    ncol = 4
    nrow = math.ceil(len(sets) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.8 * nrow), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ref = table["rows"].get(table["reference"], {}).get("sets", {})
    for k, s in enumerate(sets):
        ax = axes[k // ncol][k % ncol]
        x = np.arange(len(rows))
        means = [100 * table["rows"][r]["sets"].get(s, {}).get("mean", np.nan) for r in rows]
        stds = [table["rows"][r]["sets"].get(s, {}).get("std") for r in rows]
        errs = [100 * (v or 0.0) for v in stds]
        # no error bar where a row has one seed: a zero-height cap would read as "no variance"
        ax.bar(x, means, yerr=np.where([v is None for v in stds], np.nan, errs), capsize=2,
               color=[colors[i % len(colors)] for i in range(len(rows))])
        if s in ref:
            ax.axhline(100 * ref[s]["mean"], color="black", ls="--", lw=1)
        ax.set_title(s, fontsize=9)
        seeds = [table["rows"][r]["sets"].get(s, {}).get("n_seeds", 0) for r in rows]
        ax.set_xticks(x, [f"{r} ({n})" for r, n in zip(rows, seeds)], rotation=45, ha="right", fontsize=7)
        lo = np.nanmin(np.asarray(means) - np.asarray(errs))
        hi = np.nanmax(np.asarray(means) + np.asarray(errs))
        ax.set_ylim(max(0, lo - 5), min(100, hi + 5))
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    for k in range(len(sets), nrow * ncol):
        axes[k // ncol][k % ncol].axis("off")
    fig.suptitle(f"accuracy (%), mean ± std over seeds (seeds finished in brackets; no bar with one seed); "
                 f"dashed: {table['reference']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(plan: Plan, out_stem: Path | None = None) -> dict:
    stem = out_stem or plan.results_dir.parent / plan.results_dir.name
    table = summarise(plan)
    fig = plot(table, stem.with_suffix(".png"))
    write_json_atomic(stem.with_suffix(".json"), table)
    write_markdown(table, plan, stem.with_suffix(".md"), fig.name if fig else None)
    return table


# ------------------------------------------------------------------------------------------ speed

# (rows per batch, padded tokens per batch, dtype)
SPEED_GRID = [(64, None, "float32"), (64, None, "bfloat16"), (16, None, "float32"), (32, None, "float32"),
              (128, None, "float32"), (256, 8192, "float32"), (32, None, "bfloat16"), (128, None, "bfloat16")]


def speed(plan: Plan, model: str | None = None, rows_per_set: int = 150, threads: int = 2,
          grid: list[tuple[int, int | None, str]] = SPEED_GRID) -> dict:
    """Examples/s of ``predict_probabilities`` for batch sizes / token budgets / dtypes, on the same seeded
    rows of every set of the plan (so the mix of short Dasgupta and long MNLI rows is the table's). The first
    setting (64 rows per batch, no token budget, float32) is the default; ratios are against it, and so
    are the largest probability difference and the share of rows whose argmax is unchanged (meaningful
    with a trained ``model``; the default is the pretrained encoder with a fresh head)."""
    import numpy as np
    import torch

    from debiased_nli.models.challenge import load_challenge_set, resolve_sets
    from debiased_nli.models.classifier import load_classifier, predict_probabilities
    from debiased_nli.models.evaluation import sample_rows
    from debiased_nli.data.tasks import get_task
    from debiased_nli.models.training import load_model_for_task

    torch.set_num_threads(threads)
    if model is None:  # the pretrained encoder with a fresh head: the same cost as a trained one
        folder = plan.runs_dir / "speed_model"
        if not (folder / "config.json").exists():
            tok, m = load_model_for_task(plan.model, get_task(plan.task))
            m.save_pretrained(folder)
            tok.save_pretrained(folder)
        model = str(folder)
    clf = load_classifier(model, "cpu")
    prem, hyp, counts = [], [], {}
    for spec in resolve_sets(sets=plan.evaluate["sets"]):
        ds = sample_rows(load_challenge_set(spec), rows_per_set, 0)
        prem += ds["premise"]
        hyp += ds["hypothesis"]
        counts[spec.name] = len(ds)
    max_length = int(plan.evaluate.get("max_length", 128))
    from debiased_nli.utils.precision import cpu_description

    out = {"rows": len(prem), "rows_per_set": counts, "threads": threads, "max_length": max_length,
           "cpu": cpu_description(), "runs": []}
    predict_probabilities(clf, prem[:256], hyp[:256], batch_size=64, max_length=max_length, progress=False)  # warm-up
    out["model"] = show(model)
    ref = None
    for bs, mt, dtype in grid:
        t0 = time.perf_counter()
        probs = predict_probabilities(clf, prem, hyp, batch_size=bs, max_length=max_length, max_tokens=mt,
                                      progress=False, dtype=dtype)
        sec = time.perf_counter() - t0
        ref = probs if ref is None else ref
        out["runs"].append({"batch_size": bs, "max_tokens": mt, "dtype": dtype, "seconds": round(sec, 2),
                            "examples_per_second": round(len(prem) / sec, 1),
                            "max_abs_prob_diff_vs_first": float(np.abs(probs - ref).max()),
                            "same_argmax_vs_first": float((probs.argmax(1) == ref.argmax(1)).mean())})
        log(f"speed: batch {bs}, max_tokens {mt}, {dtype}: {len(prem) / sec:.0f} ex/s")
    base = out["runs"][0]["examples_per_second"]
    for r in out["runs"]:
        r["ratio_vs_first"] = round(r["examples_per_second"] / base, 2)
    return out


# ------------------------------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["status", "run", "report", "speed"])
    ap.add_argument("--plan", default=str(DEFAULT_PLAN), help="the rows YAML (default benchmarks/efficacy.yaml)")
    ap.add_argument("--rows", nargs="+", help="only these rows, in this order")
    ap.add_argument("--seeds", nargs="+", type=int, help="only these seeds")
    ap.add_argument("--lock", help="take this flock for each stage (build, train, evaluate): /tmp/debiased-heavy.lock")
    ap.add_argument("--runs-dir", help="models and built releases (default: the plan's runs_dir or $EFFICACY_RUNS)")
    ap.add_argument("--results-dir", help="result files (default: the plan's results_dir)")
    ap.add_argument("--stop-after", type=int, help="stop after this many finished units")
    ap.add_argument("--no-report", action="store_true", help="`run`: do not rewrite the report at the end")
    ap.add_argument("--claims", help="`run`: a folder shared by several run processes; each takes the next unit no "
                                     "other has claimed (parallel workers on one GPU or several)")
    ap.add_argument("--seed-major", action="store_true",
                    help="`run`: every row's seed 0 first, then seed 1, ... (a run stopped early has whole seeds)")
    ap.add_argument("--rows-per-set", type=int, default=150, help="`speed`: rows timed per set (seeded sample)")
    ap.add_argument("--model", help="`speed`: a trained classifier folder (default: the encoder with a fresh head)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    a = ap.parse_args(argv)
    plan = load_plan(a.plan, runs_dir=a.runs_dir, results_dir=a.results_dir)
    if a.command == "speed":
        with heavy_lock(a.lock, "speed"):
            res = speed(plan, model=a.model, rows_per_set=a.rows_per_set)
        write_json_atomic(plan.results_dir.parent / "efficacy_speed.json", res)
        print(json.dumps(res, indent=2))
        return 0
    if a.command == "status":
        for s in unit_states(plan, a.rows, a.seeds):
            print(f"{s['row']:16s} seed {s['seed']}  {s['state']:8s} {s['reason'] or ''}")
        return 0
    if a.command == "run":
        run(plan, a.rows, a.seeds, a.lock, progress=not a.quiet, stop_after=a.stop_after, claims=a.claims,
            seed_major=a.seed_major)
        if a.no_report:
            return 0
    table = report(plan)
    done = sum(len(e["seeds_done"]) for e in table["rows"].values())
    print(f"report: {done} finished units; pending rows: "
          + ", ".join(n for n, e in table["rows"].items() if e["pending_reason"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
