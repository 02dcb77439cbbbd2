"""The units of a plan: one (row, seed) each, trained, scored on every set, written as one result file and one
predictions file; ``run`` skips a unit whose result file exists, so a stopped run resumes where it stopped, unless
the unit is *stale*: the content fingerprint of its row's training rows now (a release rebuilt, a file edited) is
not the one the unit recorded; then its files are set aside under ``results_dir/stale/`` and it runs again. Unit
files are checked when they are read (:func:`check_unit`: types and ranges, one line naming the field).

    for row in rows, seed in seeds:                   # one unit; skipped when its result file is there and not stale
        data  = the row's training rows               # rows.resolve_row
        model = debiased_nli.models.training.train_classifier(model, data, selection rows)   # `debiased-nli train`
        score = debiased_nli.evaluation.scores.evaluate_models([model], sets, keep_predictions=True)
        write results_dir/predictions/<row>-s<seed>.npz, then results_dir/<row>-s<seed>.json (atomically)

Each stage (build, train, evaluate) takes the heavy lock (``--lock``) on its own; an interrupted training resumes
from its last checkpoint and an interrupted evaluation from its cached chunks. ``--workers N`` starts N
processes that share the machine (one GPU, or the CPU), each taking the next unit no other has claimed.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Sequence

from ...utils.errors import ConfigError
from ...utils.paths import read_json
from .locking import LockTurns, claim, log
from .plan import Plan, write_json_atomic
from .rows import NotBuilt, Pending, RowData, poe_settings, resolve_row

SCHEMA = "debiased-nli/efficacy-unit/v2"
SCHEMAS = ("debiased-nli/efficacy-unit/v1", SCHEMA)   # v1: units written before predictions were kept
PREDICTIONS_SCHEMA = "debiased-nli/unit-predictions/v1"
TRAIN_RECORD = "efficacy_train.json"
SELECTION_FILE = "selection.parquet"
EVAL_CHUNK_ROWS = 5000
EVAL_BATCH_SIZE = 64       # rows per evaluation batch where the plan gives none
EVAL_MAX_LENGTH = 128


def _git() -> str | None:
    from ...utils.provenance import git_hash

    return git_hash()


def _budget(plan: Plan) -> float:
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


# ------------------------------------------------------------------------------------------ epoch selection

def legacy_selection(plan: Plan) -> dict | None:
    """The selection of a plan without ``select_on``: a seeded sample of ``train.dev_files``, and the scored sets
    whose file is one of them (their selection rows are scored too: the sample is not held out)."""
    files = [plan.path_of(p) for p in plan.train.get("dev_files") or []]
    if not files:
        return None
    overlaps = []
    for spec in plan.set_specs():
        path = spec.local_path(plan.data_root)
        if path is not None and any(path.resolve() == f.resolve() for f in files):
            overlaps.append(spec.name)
    return {"kind": "dev_files", "files": [plan.show(f) for f in files], "rows": plan.train.get("max_dev_rows"),
            "seed": int(plan.train.get("data_seed", 0)), "also_scored_in": overlaps}


def selection_rows(plan: Plan) -> tuple:
    """``(dev dataset, {set: excluded row ids}, info)`` of the epoch selection. ``select_on: {set, rows, seed}``:
    a seeded sample of the set's rows (numpy ``default_rng(seed).permutation``), left out when the set is scored;
    ``select_on: {files, rows, seed}``: a seeded sample of other files. Without ``select_on``: the legacy
    ``train.dev_files`` (the sample is drawn inside training; nothing is excluded)."""
    import datasets
    import numpy as np

    from ...data.loading import content_fingerprint
    from ...models.challenge import load_challenge_set
    from ...models.training import load_training_split, subsample

    task = plan.spec
    sel = plan.select_on
    if sel is None:
        files = [str(plan.path_of(p)) for p in plan.train.get("dev_files") or []]
        dev = load_training_split(task, data_files={"validation": files}, split="validation") if files else None
        return dev, {}, legacy_selection(plan)
    rows, seed = int(sel["rows"]), int(sel.get("seed", 0))
    if "set" in sel:
        spec = plan.selection_spec()
        full = load_challenge_set(spec, plan.data_root)
        if rows >= len(full):
            raise ConfigError(f"{plan.path}: select_on holds out {rows:,} rows of {spec.name!r}, which has "
                              f"{len(full):,}: nothing would be left to score")
        pos = np.sort(np.random.default_rng(seed).permutation(len(full))[:rows])
        part = full.select(pos)
        features = datasets.Features({"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
                                      "label": datasets.ClassLabel(names=list(task.labels))})
        dev = datasets.Dataset.from_dict({"premise": part["premise"], "hypothesis": part["hypothesis"],
                                          "label": part["label"]}, features=features)
        scored = spec.name in plan.set_names
        info = {"kind": "held_out", "set": spec.name, "rows": rows, "of": len(full), "seed": seed,
                "how": f"numpy.random.default_rng({seed}).permutation({len(full)})[:{rows}] of the set's rows",
                "excluded_from_scoring": scored, "fingerprint": content_fingerprint(dev)}
        return dev, ({spec.name: [int(r) for r in part["row"]]} if scored else {}), info
    files = [plan.path_of(p) for p in sel["files"]]
    dev = subsample(load_training_split(task, data_files={"validation": [str(f) for f in files]}, split="validation"),
                    rows, seed)
    return dev, {}, {"kind": "files", "files": [plan.show(f) for f in files], "rows": len(dev), "seed": seed,
                     "how": f"datasets' shuffle(seed={seed}).select(range({rows}))",
                     "fingerprint": content_fingerprint(dev)}


# ------------------------------------------------------------------------------------------ training

def train_config(plan: Plan, row: dict, seed: int, progress: bool = True):
    from ...models.training import TrainConfig

    t = plan.train
    poe = poe_settings(row)
    return TrainConfig(model=plan.model, output_dir=str(plan.model_dir(row["name"], seed)),
                       learning_rate=float(t["learning_rate"]), batch_size=int(t["batch_size"]),
                       max_length=int(t["max_length"]), epochs=float(t["epochs"]),
                       warmup_ratio=float(t.get("warmup_ratio", 0.1)), seed=int(seed),
                       data_seed=int(t.get("data_seed", 0)),
                       max_dev_rows=None if plan.select_on else t.get("max_dev_rows"),
                       early_stopping_patience=int(t.get("patience", 3)), poe=poe is not None,
                       poe_beta=poe["beta"] if poe else 1.0, poe_gamma=poe["gamma"] if poe else 1.0,
                       bias_model=poe["bias_model"] if poe else "tfidf",
                       num_threads=t.get("threads"), progress=progress,
                       use_cpu=True if plan.device == "cpu" else None)


def train_cli(cfg, data: RowData, dev_files: list[str], task: str, show=str) -> str:
    """The ``debiased-nli train`` command equivalent to ``cfg`` on the row's data."""
    info = data.info

    def source(i: dict) -> list[str]:
        if "config" in i:
            return ["--release", i["release"], "--config", i["config"]]
        if "files" in i:
            return ["--data-files", *[f"train={f}" for f in i["files"]]]
        return []  # the task's own source

    if info["kind"] == "random_subset":  # train_classifier's --max-train-rows sample is the same shuffle(seed).select
        src = source(info["base"]) + ["--max-train-rows", str(info["rows"]), "--data-seed", str(info["seed"])]
    else:
        src = source(info)
    cmd = ["debiased-nli", "train", task, *src]
    if dev_files:
        cmd += ["--dev-files", *dev_files]
    cmd += ["--model", show(cfg.model), "--out", show(cfg.output_dir),
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
    from ...bias.poe import bias_model_for
    from ...models.training import TRAIN_CONFIG_FILE, train_classifier

    out = plan.model_dir(row["name"], seed)
    rec_path = out / TRAIN_RECORD
    if rec_path.exists():
        return read_json(rec_path, "unit training record", kind=dict)
    cfg = train_config(plan, row, seed, progress)
    dev, _, selection = selection_rows(plan)
    if plan.select_on:  # the selection rows as a file, so that the recorded `debiased-nli train` command reads them
        out.mkdir(parents=True, exist_ok=True)
        from ...utils.outputs import marker_record, record_written

        if not (out / SELECTION_FILE).exists():
            tmp = out / f".{SELECTION_FILE}.tmp-{os.getpid()}"
            dev.to_parquet(str(tmp))
            os.replace(tmp, out / SELECTION_FILE)
        if marker_record(out / SELECTION_FILE) is None:  # this run's folder (a run before the markers wrote it too)
            record_written(out / SELECTION_FILE)  # the model folder is then this tool's (training.is_run_folder)
        shown = [f"validation={plan.show(out / SELECTION_FILE)}"]
    else:
        shown = [plan.show(plan.path_of(p)) for p in plan.train.get("dev_files") or []]
    sessions_path = out / "efficacy_train_sessions.json"
    sessions = read_json(sessions_path, "training sessions", kind=list) if sessions_path.exists() else []
    what = f"train {row['name']} seed {seed}"
    with LockTurns(lock, _budget(plan) if lock else None, what) as turns:
        while True:
            turns.step()
            commit = _git()
            log(f"{what}: {len(data.dataset):,} rows at {commit}, session {len(sessions) + 1}")
            cb = _stop_at_deadline_callback(turns.remaining())
            t0, c0 = time.perf_counter(), time.process_time()
            bias = bias_model_for(cfg, plan.spec) if cfg.poe and cfg.bias_model != "joint" else None
            res = train_classifier(cfg, plan.task, data.dataset, dev, callbacks=[cb], bias_model=bias)
            sessions.append({"git": commit, "seconds": round(time.perf_counter() - t0, 1),
                             "cpu_seconds": round(time.process_time() - c0, 1), "stopped_for_the_lock": cb.stopped,
                             "resumed_from": res.resumed_from})
            write_json_atomic(sessions_path, sessions)
            if not cb.stopped:
                break
            log(f"{what}: checkpointed after {sessions[-1]['seconds']:.0f}s; resuming in the next turn")
        # the rows themselves, as train_classifier hashed them for its run record (not how they were read):
        # seeds of a row whose release was rebuilt in between can then be told apart
        run_record = json.loads((out / TRAIN_CONFIG_FILE).read_text())
        record = {"row": row["name"], "seed": seed, "git": commit, "config": cfg.to_dict(),
                  "command": train_cli(cfg, data, shown, plan.task, plan.show),
                  "data": {k: v for k, v in data.info.items() if k != "content_fingerprint_now"}
                  | {"content_fingerprint": run_record["train_fingerprint"]},
                  "selection": (selection or {}) | {"dev_fingerprint": run_record.get("dev_fingerprint")},
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
    from ..scores import EvalConfig

    e = plan.evaluate
    return EvalConfig(max_examples=e.get("max_examples"), batch_size=int(e.get("batch_size", EVAL_BATCH_SIZE)),
                      max_length=int(e.get("max_length", EVAL_MAX_LENGTH)), max_tokens=e.get("max_tokens"),
                      dtype=str(e.get("dtype", "float32")), data_root=plan.data_root, progress=progress,
                      device="cpu" if plan.device == "cpu" else None)


def write_predictions(path: Path, arrays: dict, meta: dict) -> str:
    """One compressed ``.npz`` per unit: for each set ``<set>/predicted`` and ``<set>/gold`` (int8 set label ids)
    and ``<set>/gold_probability`` (float16), plus ``meta`` (JSON: the schema, the row and seed, the content
    fingerprints of the rows trained on and of each set's rows scored); written atomically. Returns its sha256."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def read_predictions(path: Path) -> tuple[dict, dict]:
    """``(meta, {set: {"predicted", "gold", "gold_probability"}})`` of a unit's predictions file."""
    import numpy as np

    from ...utils.paths import check_input_file, parse_json

    check_input_file(path, "predictions file")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = parse_json(str(z["meta"]), f"{path}: meta")
            sets: dict[str, dict] = {}
            for key in z.files:
                if key != "meta":
                    name, _, field = key.rpartition("/")
                    sets.setdefault(name, {})[field] = z[key]
    except ConfigError:
        raise
    except MemoryError:
        raise
    except Exception as err:  # BadZipFile, EOFError, zlib.error, ValueError, KeyError: a file cut short or another
        raise ConfigError(f"predictions file {path} cannot be read ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:120]}); remove it and its unit's result file to rerun "
                          f"the unit") from None
    if not isinstance(meta, dict) or meta.get("schema") != PREDICTIONS_SCHEMA:
        raise ConfigError(f"{path}: not a predictions file of a unit (schema "
                          f"{meta.get('schema') if isinstance(meta, dict) else type(meta).__name__!r})")
    return meta, sets


def evaluate_unit(plan: Plan, row: dict, seed: int, train_record: dict, lock: str | None, progress: bool = True) -> dict:
    """Score the unit's model on every set (full sets unless the plan says ``max_examples``; a ``select_on`` set
    without its selection rows) with ``debiased-nli evaluate``'s :func:`debiased_nli.evaluation.scores.evaluate_models`,
    the probabilities computed in chunks of at most 5,000 rows, each cached in the model folder (the stage can give
    up the lock between chunks, and an interrupted evaluation continues). Writes the predictions file, then the
    result file."""
    import torch

    from ..scores import evaluate_models
    from ...utils.provenance import library_versions

    path = plan.unit_file(row["name"], seed)
    model = str(plan.model_dir(row["name"], seed))
    cfg = eval_config(plan, progress)
    _, excluded, selection = selection_rows(plan)
    what = f"evaluate {row['name']} seed {seed}"
    threads_set = False
    with LockTurns(lock, _budget(plan) if lock else None, what) as turns:
        def before_chunk() -> None:  # a turn at the lock per chunk; the CPU threads once work starts
            nonlocal threads_set
            turns.step()
            if not threads_set and plan.evaluate.get("threads"):
                torch.set_num_threads(int(plan.evaluate["threads"]))
            threads_set = True

        results = evaluate_models([model], plan.set_specs(), cfg, chunk_rows=EVAL_CHUNK_ROWS,
                                  cache_dirs={model: plan.model_dir(row["name"], seed) / "eval_cache"},
                                  before_chunk=before_chunk, exclude_rows=excluded, keep_predictions=True)
    per_set, commits, arrays, scored = {}, set(), {}, {}
    for name, entry in results["sets"].items():
        run = entry["runs"][0]
        preds = run.pop("predictions")
        for field, values in preds.items():
            arrays[f"{name}/{field}"] = values
        scored[name] = {"rows": entry["n"], "rows_fingerprint": entry["rows_fingerprint"],
                        "excluded_rows": entry.get("excluded_rows", 0)}
        per_set[name] = {"accuracy": run["accuracy"], "n": entry["n"], "n_total": entry["n_total"],
                         "subsampled": entry["subsampled"], "excluded_rows": entry.get("excluded_rows", 0),
                         "rows_fingerprint": entry["rows_fingerprint"], "hub_dataset": entry.get("hub_dataset"),
                         "breakdowns": run.get("breakdowns") or {},
                         "confusion": run["confusion"], "seconds": run["predict_seconds"],
                         "cpu_seconds": run["predict_cpu_seconds"]}
        commits.update(run["predict_git"])
        log(f"{what}: {name} {100 * run['accuracy']:.2f} ({entry['n']:,} rows, {run['predict_seconds']:.0f}s)")
    train_fp = train_record["data"].get("content_fingerprint")
    pred_file = plan.predictions_file(row["name"], seed)
    digest = write_predictions(pred_file, arrays, {"schema": PREDICTIONS_SCHEMA, "row": row["name"], "seed": seed,
                                                   "train_fingerprint": train_fp, "sets": scored})
    n_rows = sum(v["n"] for v in per_set.values())
    seconds = sum(v["seconds"] for v in per_set.values())
    cpu = sum(v["cpu_seconds"] for v in per_set.values())
    command = (["debiased-nli", "evaluate", "--model", plan.show(model), "--sets", *plan.set_names,
                "--max-length", str(cfg.max_length), "--batch-size", str(cfg.batch_size)]
               + (["--max-tokens", str(cfg.max_tokens)] if cfg.max_tokens else [])
               + (["--dtype", cfg.dtype] if cfg.dtype != "float32" else [])
               + (["--max-examples", str(cfg.max_examples)] if cfg.max_examples else []) + ["--out", "<dir>"])
    unit = {
        "schema": SCHEMA, "row": row["name"], "seed": seed, "description": row.get("description", ""),
        "poe": poe_settings(row), "data": train_record["data"],
        "selection": train_record.get("selection") or selection,
        "train": {k: train_record.get(k) for k in ("git", "commits", "command", "seconds", "cpu_seconds",
                                                   "epoch_dev_accuracy", "config", "finished", "sessions", "device")}
                 | {"rows": train_record["result"]["train_rows"], "dev_accuracy": train_record["result"]["dev_accuracy"],
                    "dev_rows": train_record["result"]["dev_rows"]},
        "evaluation": {"git": sorted(commits), "config": results["config"],
                       "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "rows": n_rows,
                       "examples_per_second": round(n_rows / max(seconds, 1e-9), 1),
                       "command": shlex.join(command)
                       + ("" if not excluded else f"  # without the {', '.join(excluded)} rows the epoch was selected on")},
        "predictions": {"file": pred_file.relative_to(plan.results_dir).as_posix(), "sha256": digest,
                        "train_fingerprint": train_fp, "sets": scored},
        "sets": per_set, "versions": library_versions(), "device": device_name(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    write_json_atomic(path, unit)
    log(f"evaluated {row['name']} seed {seed}: {n_rows:,} rows in {seconds:.0f}s ({n_rows / max(seconds, 1e-9):.0f} ex/s); "
        + ", ".join(f"{k} {100 * v['accuracy']:.1f}" for k, v in per_set.items()))
    return unit


# ------------------------------------------------------------------------------------------ run / status

def _field_error(path: Path, field: str, value, want: str) -> ConfigError:
    from ...utils.errors import excerpt

    return ConfigError(f"{path}: {field} is {excerpt(value, 60)}, not {want}; fix the unit file or delete it "
                       f"(`compare run` then runs the unit again)")


def _number(value, lo: float | None = None, hi: float | None = None) -> bool:
    import math

    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (lo is None or value >= lo) and (hi is None or value <= hi))


def check_unit(unit, path: Path) -> None:
    """A unit file's fields have the types and ranges the report reads (an accuracy in [0, 1], a seed that is an
    integer, counts, seconds, the predictions record); else a one-line :class:`ConfigError` naming the file, the
    field and the value."""
    if not isinstance(unit, dict):
        raise _field_error(path, "the file", unit, "a JSON mapping (a unit's result)")
    if not isinstance(unit.get("row"), str) or not unit["row"]:
        raise _field_error(path, "row", unit.get("row"), "a row name")
    seed = unit.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise _field_error(path, "seed", seed, "a non-negative integer")
    if path.name != f"{unit['row']}-s{seed}.json":
        raise ConfigError(f"{path}: holds row {unit['row']!r} seed {seed}, whose file is {unit['row']}-s{seed}.json; "
                          f"rename it or delete it")
    for key in ("data", "train", "evaluation", "sets"):
        if not isinstance(unit.get(key), dict):
            raise _field_error(path, key, unit.get(key), "a mapping")
    if not unit["sets"]:
        raise _field_error(path, "sets", unit["sets"], "the scores of at least one set")
    for name, v in unit["sets"].items():
        if not isinstance(v, dict):
            raise _field_error(path, f"sets.{name}", v, "a mapping")
        if not _number(v.get("accuracy"), 0.0, 1.0):
            raise _field_error(path, f"sets.{name}.accuracy", v.get("accuracy"), "an accuracy in [0, 1]")
        if not isinstance(v.get("n"), int) or isinstance(v.get("n"), bool) or v["n"] < 1:
            raise _field_error(path, f"sets.{name}.n", v.get("n"), "a positive number of rows")
    t, e = unit["train"], unit["evaluation"]
    if not isinstance(t.get("rows"), int) or isinstance(t.get("rows"), bool) or t["rows"] < 1:
        raise _field_error(path, "train.rows", t.get("rows"), "a positive number of rows")
    for field, value in (("train.seconds", t.get("seconds")), ("train.cpu_seconds", t.get("cpu_seconds")),
                         ("evaluation.seconds", e.get("seconds")),
                         ("evaluation.examples_per_second", e.get("examples_per_second"))):
        if not _number(value, 0.0):
            raise _field_error(path, field, value, "a non-negative number")
    if t.get("dev_accuracy") is not None and not _number(t["dev_accuracy"], 0.0, 1.0):
        raise _field_error(path, "train.dev_accuracy", t["dev_accuracy"], "an accuracy in [0, 1] or null")
    if unit.get("device") is not None and not isinstance(unit["device"], str):
        raise _field_error(path, "device", unit["device"], "the name of a machine or null")
    fp = unit["data"].get("content_fingerprint")
    if fp is not None and not isinstance(fp, str):
        raise _field_error(path, "data.content_fingerprint", fp, "a fingerprint (text) or null")
    pred = unit.get("predictions")
    if pred is not None:
        if not isinstance(pred, dict) or not isinstance(pred.get("file"), str) or not isinstance(pred.get("sets"), dict):
            raise _field_error(path, "predictions", pred, "{file, sha256, sets} of the unit's predictions file")
        for name, v in pred["sets"].items():
            if not isinstance(v, dict) or not isinstance(v.get("rows_fingerprint"), str):
                raise _field_error(path, f"predictions.sets.{name}", v, "{rows, rows_fingerprint}")


def read_unit(path: Path) -> dict | None:
    """A unit's result file, checked (:func:`check_unit`); None for a JSON file that is not a unit's (another
    schema)."""
    try:  # a regular file, UTF-8, JSON, bounded in size and nesting
        unit = read_json(path, "unit result file")
    except ConfigError as err:
        raise ConfigError(f"{err}; delete it (`compare run` then runs the unit again)") from None
    if not isinstance(unit, dict) or unit.get("schema") not in SCHEMAS:
        return None
    check_unit(unit, path)
    return unit


def load_units(plan: Plan) -> dict[str, list[dict]]:
    """The finished units of the plan's results folder by row (v1 units have no predictions), seed order; each
    checked on load (:func:`check_unit`)."""
    out: dict[str, list[dict]] = {}
    for p in sorted(plan.results_dir.glob("*-s*.json")):
        unit = read_unit(p)
        if unit is not None:
            out.setdefault(unit["row"], []).append(unit)
    for units in out.values():
        units.sort(key=lambda u: u["seed"])
    return out


def data_fingerprint(data: RowData) -> str:
    """The content fingerprint of a row's training rows as they are now (what ``train_classifier`` records as the
    run's ``train_fingerprint``), computed once per resolved row."""
    from ...data.loading import content_fingerprint

    if "content_fingerprint_now" not in data.info:
        data.info["content_fingerprint_now"] = content_fingerprint(data.dataset)
    return data.info["content_fingerprint_now"]


def stale_reason(plan: Plan, row: dict, seed: int, recorded: str | None, cache: dict) -> str | None:
    """Why a unit (or a trained model) that recorded the fingerprint ``recorded`` of its training rows is stale:
    the row's data as it is now has other rows (a release rebuilt, a file changed); None when it has the same
    rows, or when that cannot be told (no fingerprint recorded, or the data cannot be read without building)."""
    if not recorded:
        return None
    try:
        data = resolve_row(plan, row, build=False, _cache=cache, unit_seed=seed)
    except Pending:
        return None
    now = data_fingerprint(data)
    if now == recorded:
        return None
    return (f"its data changed since it ran: it trained on rows {recorded[:8]}, the row's data now has {now[:8]}; "
            f"`compare run` trains it again")


def _recorded_fingerprint(path: Path) -> str | None:
    rec = json.loads(path.read_text())
    return (rec.get("data") or {}).get("content_fingerprint")


def unit_states(plan: Plan, rows: list[str] | None = None, seeds: list[int] | None = None) -> list[dict]:
    """One entry per (row, seed): done, stale (done or trained on rows the row's data no longer has), trained,
    todo, or pending (with the reason)."""
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
            unit_path = plan.unit_file(row["name"], seed)
            trained = plan.model_dir(row["name"], seed) / TRAIN_RECORD
            stale = None
            if unit_path.exists():
                unit = read_unit(unit_path)
                stale = stale_reason(plan, row, seed, ((unit or {}).get("data") or {}).get("content_fingerprint"), cache)
                state = "stale" if stale else "done"
            elif reason and not buildable:
                state = "pending"
            elif trained.exists():
                stale = stale_reason(plan, row, seed, _recorded_fingerprint(trained), cache)
                state = "stale" if stale else "trained"
            else:
                state = "todo"
            out.append({"row": row["name"], "seed": seed, "state": state,
                        "reason": stale or (reason if state in ("pending", "todo") else None)})
    return out


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
    if plan.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"{plan.show(plan.path)} is a GPU plan (device: cuda) and this machine has no CUDA GPU "
                              f"visible; run it on a GPU machine, or set device: any")


def unit_order(plan: Plan, rows: list[str] | None = None, seeds: list[int] | None = None,
               seed_major: bool = False) -> list[tuple[str, int]]:
    """The (row, seed) units to run, row by row (all seeds of a row, then the next row), or with
    ``seed_major`` seed by seed (every row's seed 0 first), so a run stopped early has whole seeds."""
    names = list(rows) if rows else [r["name"] for r in plan.rows]  # in the order asked for
    for n in names:
        plan.row(n)
    ss = [s for s in plan.seeds if seeds is None or s in seeds]
    return [(n, s) for s in ss for n in names] if seed_major else [(n, s) for n in names for s in ss]


def set_aside_stale(plan: Plan, row: str, seed: int) -> list[Path]:
    """Move a stale unit's result and predictions files to ``results_dir/stale/`` (kept, named by the rows they
    trained on) and delete its model folder (a model of the old rows, and its cached scores), so that the unit is
    trained again. Returns where the files went."""
    moved = []
    unit_path, pred_path = plan.unit_file(row, seed), plan.predictions_file(row, seed)
    fp = None
    if unit_path.exists():
        fp = ((json.loads(unit_path.read_text()).get("data") or {}).get("content_fingerprint") or "unknown")[:8]
    stale_dir = plan.results_dir / "stale"
    for path in (unit_path, pred_path):
        if path.exists():
            stale_dir.mkdir(parents=True, exist_ok=True)
            target = stale_dir / f"{path.stem}-{fp}{path.suffix}"
            os.replace(path, target)
            moved.append(target)
    model = plan.model_dir(row, seed)
    if model.exists():
        shutil.rmtree(model)
    return moved


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_line(index: int, total: int, name: str, seed: int, past: Sequence[float],
                  recorded: Sequence[float] = ()) -> str:
    """``unit 3/25 (aflite seed 2): this unit ~4m10s, all 23 left ~1h36m`` before a unit starts: the estimate is the
    mean wall time of the units this run finished, else of the plan's finished units on record (train + evaluation
    seconds of their result files), else none yet."""
    basis = list(past) or list(recorded)
    head = f"unit {index}/{total} ({name} seed {seed})"
    if not basis:
        return head + ": no estimate until the first unit finishes"
    each = sum(basis) / len(basis)
    left = total - index + 1
    source = "this run's units" if past else "the finished units on record"
    return (f"{head}: this unit ~{_duration(each)}, all {left} left ~{_duration(each * left)} "
            f"(mean of {len(basis)} of {source})")


def _recorded_seconds(plan: Plan) -> list[float]:
    """Train + evaluation wall seconds of the plan's finished units on this kind of machine (their result files)."""
    here = device_name()
    out = []
    for us in load_units(plan).values():
        for u in us:
            if (u.get("device") or here) == here:
                out.append(float(u["train"]["seconds"]) + float(u["evaluation"]["seconds"]))
    return out


def run(plan: Plan, rows: list[str] | None = None, seeds: list[int] | None = None, lock: str | None = None,
        progress: bool = True, stop_after: int | None = None, claims: "str | os.PathLike | None" = None,
        seed_major: bool = False) -> list[dict]:
    """Train and evaluate every unit that has no result file, or whose result is stale (its row's training rows
    changed since: a release rebuilt, a file edited; the old files are set aside, :func:`set_aside_stale`);
    returns the states (pending rows reported). Before each unit it logs how far it is and an estimate of the time
    left (:func:`progress_line`).

    ``claims``: a folder shared by several ``run`` processes (one per GPU share, say); each takes the
    next unit nobody has claimed, so they split the plan between them without running a unit twice."""
    require_device(plan)
    cache: dict = {}
    finished = 0
    pending: set[str] = set()
    failed: dict[str, str] = {}
    todo = []
    for name, seed in unit_order(plan, rows, seeds, seed_major):
        row = plan.row(name)
        path = plan.unit_file(name, seed)
        stale = (stale_reason(plan, row, seed, ((read_unit(path) or {}).get("data") or {}).get("content_fingerprint"),
                              cache) if path.exists() else None)
        if stale:
            log(f"stale {name} seed {seed}: {stale}")
        if not path.exists() or stale:
            todo.append((name, seed, stale))
    recorded = _recorded_seconds(plan) if todo else []
    durations: list[float] = []
    for index, (name, seed, stale) in enumerate(todo, 1):
        row = plan.row(name)
        if name in pending or name in failed:
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
            if plan.unit_file(name, seed).exists():
                if not stale:
                    continue  # another process finished it meanwhile
                moved = set_aside_stale(plan, name, seed)
                log(f"set aside the stale {name} seed {seed}: {', '.join(map(plan.show, moved))}")
            trained = plan.model_dir(name, seed) / TRAIN_RECORD
            if trained.exists() and _recorded_fingerprint(trained) not in (None, data_fingerprint(data)):
                log(f"{name} seed {seed}: its trained model is of other rows than the row's data now; training again")
                shutil.rmtree(plan.model_dir(name, seed))
            log(progress_line(index, len(todo), name, seed, durations, recorded)
                + ("; units left counted over every worker, at one worker's pace" if claims is not None else ""))
            t0 = time.perf_counter()
            rec = train_unit(plan, row, seed, data, lock, progress)
            evaluate_unit(plan, row, seed, rec, lock, progress)
            durations.append(time.perf_counter() - t0)
        except Exception as err:  # noqa: BLE001 - a shared worker logs a broken row and goes on with the next
            if claims is None:
                raise
            import traceback

            log(f"FAILED {name} seed {seed}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
            failed[name] = f"{type(err).__name__}: {err}"
            continue
        finished += 1
        log(f"finished unit {index}/{len(todo)} ({name} seed {seed}) in {_duration(durations[-1])}"
            + (f"; {len(todo) - index} left, ~{_duration(sum(durations) / len(durations) * (len(todo) - index))} at "
               f"this run's pace" if index < len(todo) else ""))
        if stop_after and finished >= stop_after:
            return unit_states(plan, rows, seeds)
    if failed:
        raise ConfigError("rows that failed (the others ran): " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    states = unit_states(plan, rows, seeds)
    for s in states:
        if s["state"] == "pending":
            log(f"pending {s['row']} seed {s['seed']}: {s['reason']}")
    return states


def run_workers(command: Sequence[str], workers: int, claims: Path, logs: Path, *, env: dict | None = None,
                poll_s: float = 2.0) -> int:
    """Start ``workers`` processes of ``command`` (a ``run`` that takes ``--claims``; ``--claims claims`` is added)
    sharing one machine, each taking the next unit no other has claimed; wait for them and return 0 when every
    worker finished cleanly. Each worker's output goes to ``logs/worker-<i>.log``. Stopping this process stops
    the workers (they are in its process group)."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    cmd = [*command, "--claims", str(claims)]
    try:
        for w in range(workers):
            f = open(logs / f"worker-{w}.log", "a")
            f.write(f"\n--- worker {w}: {shlex.join(cmd)}\n")
            f.flush()
            procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), f))
        log(f"{workers} worker(s) started; their logs: {logs}/worker-*.log")
        while any(p.poll() is None for p, _ in procs):
            time.sleep(poll_s)
    finally:
        for p, f in procs:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(30)
            f.close()
    codes = [p.returncode for p, _ in procs]
    for w, code in enumerate(codes):
        if code:
            tail = (logs / f"worker-{w}.log").read_text(errors="replace").splitlines()[-15:]
            log(f"worker {w} exited with {code}; the end of its log:\n" + "\n".join(tail))
    return 0 if not any(codes) else 1
