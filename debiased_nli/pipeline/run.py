"""A recipe's generator step as resumable stages in one run folder, with done-records and a status.

Everything a run writes is under its run folder (``--run``); the ``out`` folders a recipe's generator step names
are not used (a recipe is not trusted to say where files go). The layout:

    RUN/pipeline.json             what the run is (recipe, profile, task, D0's files): the folder's marker
    RUN/G, RUN/G_star, RUN/M      the trained models (each resumes from its own checkpoints)
    RUN/samples/                  shard-<i>-of-<n>.parquet, rejects-..., generate_config.json, generate_report.json
    RUN/confident/                kept.parquet, rejected.parquet, confidence_report.json (calibration.json)
    RUN/release/                  the release (a Hub dataset repo folder)
    RUN/audits/<config>/          audit.json, audit.md, zstats.png
    RUN/logs/<stage>.log          the stderr of each stage run in a process of its own (``--deadline``), whose
                                  last progress bar ``status`` reads for a stage stopped unfinished
    RUN/stages/<stage>.json       the done-record of each finished stage: the command that reruns it, its
                                  parameters, the fingerprints of its inputs and outputs, when it finished

A stage is *done* when its record is there and its parameters and inputs are still the ones recorded; *stale*
when they changed (a rerun redoes a filter, build or audit; a model or sample folder made with other values
is refused, to be moved away, except more samples of the same run); *partial* when some of its work is there (G's checkpoints, 44/182 shards);
*pending* otherwise; *skipped* when the recipe does not ask for it (no ``debias``: no G*) or gives its product (a
trained ``generator``; M as ``confidence.model``).

Sampling runs in RUN with relative names (the generator ``G`` or ``G_star``, the folder ``samples``), so
``generate_config.json`` names no machine's path and the shards of a run continue on another machine whose run
folder lies elsewhere (``samples_from`` copies the finished shards of the same run in first).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as _dt
import json
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..utils.errors import ConfigError

STAGES = ("train_g", "train_g_star", "train_m", "sample", "filter", "build", "audit")
PLAN_FILE = "pipeline.json"
RECORDS = "stages"
G, G_STAR, M, SAMPLES, CONFIDENT, RELEASE, AUDITS = "G", "G_star", "M", "samples", "confident", "release", "audits"
LOGS = "logs"  # RUN/logs/<stage>.log: the stderr of a stage run in a process of its own (``run(deadline=...)``)
ORIGINAL = "original"  # the audit of D0


@dataclasses.dataclass
class StageState:
    """Where one stage stands: ``state`` is done, stale, partial, pending or skipped; ``detail`` says more in a
    line (e.g. "44/182 shards (44,000 samples); ETA ~3.1 h"); ``record`` is its done-record, if any."""

    stage: str
    state: str
    detail: str = ""
    record: dict | None = None

    def to_dict(self) -> dict:
        return {"stage": self.stage, "state": self.state, "detail": self.detail}


def _sha256(path: Path) -> str:
    from ..utils.provenance import file_sha256

    return file_sha256(path)


def _files_digest(paths: Sequence[Path]) -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted(paths)}


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _plain(obj: Any) -> Any:
    """``obj`` as JSON holds it (tuples become lists), so that a record compares equal to what it was made from."""
    return json.loads(json.dumps(obj, default=str))


@contextlib.contextmanager
def _chdir(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _shards(folder: Path, kind: str = "shard") -> list[Path]:
    return sorted(folder.glob(f"{kind}-*-of-*.parquet")) if folder.is_dir() else []


class Pipeline:
    """The stages of one recipe profile's generator step in the run folder ``run``.

    ``recipe``: a recipe file or packaged recipe name (``snli``), or the recipe as a mapping; ``profile``: one of its
    profiles (``gpu`` of ``seqz``, ``paper`` of ``snli``); ``data_files``: D0's files instead of the
    recipe's source (as ``build --data-files``); ``samples_from``: a folder of finished shards of the same sampling
    run (e.g. committed ones), copied into RUN/samples where it lacks them; ``probabilities_from``: M's stored
    probabilities (uid, m_prob_<label>) for the filter, which then needs no M (as ``confidence-filter
    --probabilities-from``)."""

    def __init__(self, recipe: "str | os.PathLike[str] | Mapping[str, Any]", run: "str | os.PathLike[str]", *,
                 profile: str | None = None, data_files: "Sequence[str] | Mapping[str, Any] | str | None" = None,
                 samples_from: "str | os.PathLike[str] | None" = None,
                 probabilities_from: "str | os.PathLike[str] | None" = None, progress: bool = True,
                 echo: Callable[[str], None] = print):
        from ..data.tasks import get_task
        from ..release.recipe import load_recipe
        from ..utils.resources import find_recipe

        self.recipe_ref = None if isinstance(recipe, Mapping) else str(recipe)
        self.recipe_path = recipe if isinstance(recipe, Mapping) else find_recipe(recipe)
        self.recipe = load_recipe(self.recipe_path, profile)
        self.profile = profile
        steps = [s for s in self.recipe["new_rows"] if s["step"] == "generator"]
        if len(steps) != 1:
            where = f"profile {profile!r}" if profile else "the recipe without a profile"
            raise ConfigError(f"{where} has {len(steps)} generator steps in `new_rows`: a pipeline runs exactly one "
                              f"(e.g. the recipe `seqz`, or `--profile paper` of `snli`)")
        from ..methods.generation.step import expand_paths

        self.spec = expand_paths(copy.deepcopy(dict(steps[0])))
        self.task = get_task(self.recipe["task"])
        self.data_files = data_files
        self.run_dir = Path(run).expanduser()
        self.samples_from = Path(samples_from).expanduser() if samples_from else None
        self.probabilities_from = Path(probabilities_from).expanduser() if probabilities_from else None
        self.progress = progress
        self.echo = echo
        for name, given in (("--samples-from", self.samples_from), ("--probabilities-from", self.probabilities_from)):
            if given is not None and not given.exists():
                raise ConfigError(f"{name} {given}: no such file or folder")
        self._d0 = None

    # ------------------------------------------------------------------ where things are

    def path(self, name: str) -> Path:
        return self.run_dir / name

    def record_path(self, stage: str) -> Path:
        return self.run_dir / RECORDS / f"{stage}.json"

    def d0_files(self) -> list[Path]:
        """D0's local files (none when it comes from the Hub)."""
        from ..data.loading import parse_data_files

        spec = self.data_files if self.data_files is not None else self.recipe["data"]["data_files"]
        files = parse_data_files(spec) or {}
        return [Path(f) for f in files.get(self.recipe["data"]["split"], [])]

    def d0_inputs(self) -> dict:
        files = self.d0_files()
        if files:
            return {"d0": _files_digest(files)}
        return {"d0": {"hub": self.task.name, "revision": self.recipe["data"].get("revision")}}

    def d0(self):
        """D0 (loaded once) as the build reads it: the recipe's split, its on_invalid and max_rows."""
        if self._d0 is None:
            from ..data.loading import load_task

            data = self.recipe["data"]
            self._d0 = load_task(self.task, data.get("split", "train"),
                                 data_files=self.data_files if self.data_files is not None else data.get("data_files"),
                                 on_invalid=data.get("on_invalid", "error"), max_rows=data.get("max_rows"))
        return self._d0

    def generator_name(self) -> str:
        """The generator the samples come from: G* when the step fine-tunes one, else G (both relative to RUN), or
        the step's trained ``generator``."""
        if self.spec.get("debias"):
            return G_STAR
        if self.spec.get("generator"):
            return str(Path(self.spec["generator"]).expanduser().resolve())
        return G

    def model_of_m(self) -> str | None:
        if self.spec.get("train_m"):
            return str(self.path(M))
        return (self.spec.get("confidence") or {}).get("model")

    # ------------------------------------------------------------------ the stages' parameters and inputs

    def params(self, stage: str) -> dict:
        """What a stage runs with (the recipe's values, without the ``out`` folders the pipeline sets)."""
        s = self.spec

        def strip(d):
            return {k: v for k, v in dict(d or {}).items() if k != "out"}
        if stage == "train_g":
            return _plain(strip(s.get("train")))
        if stage == "train_g_star":
            from ..methods.generation.step import debias_params

            return _plain(strip(debias_params(s.get("debias") or {}, self.recipe, int(self.recipe["seed"]))))
        if stage == "train_m":
            return _plain(strip(s.get("train_m")))
        if stage == "sample":
            return _plain(strip(s.get("generate")))
        if stage == "filter":
            conf = strip(s.get("confidence"))
            if s.get("train_m") or self.probabilities_from:
                conf.pop("model", None)
            return _plain(conf)
        if stage == "build":
            rec = {k: v for k, v in self.build_recipe().items() if k != "profiles"}
            return _plain({"recipe": rec, "data_files": self.data_files})
        if stage == "audit":
            return {"on_invalid": "set_aside"}
        raise ConfigError(f"unknown stage {stage!r}; the stages are {list(STAGES)}")

    def inputs(self, stage: str) -> dict:
        """Fingerprints of what a stage reads (sha256 of files; a name for a model given by reference)."""
        if stage == "train_g":
            return self.d0_inputs()
        if stage == "train_g_star":
            return {**self.d0_inputs(), "G": self._model_fingerprint(G)}
        if stage == "train_m":
            dev = (self.spec.get("train_m") or {}).get("dev_files")
            dev = [dev] if isinstance(dev, str) else list(dev or [])
            return {**self.d0_inputs(), "dev": _files_digest([Path(f) for f in dev if Path(f).is_file()])}
        if stage == "sample":
            gen = self.generator_name()
            return {"generator": self._model_fingerprint(gen) if gen in (G, G_STAR) else gen}
        if stage == "filter":
            out = {"samples": _files_digest(_shards(self.path(SAMPLES)))}
            if self.probabilities_from:
                out["probabilities_from"] = _sha256(self.probabilities_from)
            elif self.spec.get("train_m"):
                out["M"] = self._model_fingerprint(M)
            else:
                out["M"] = self.model_of_m()
            cal = (self.spec.get("confidence") or {}).get("calibration")
            if isinstance(cal, str) and Path(cal).is_file():
                out["calibration"] = _sha256(Path(cal))
            return out
        if stage == "build":
            kept = self.path(CONFIDENT) / "kept.parquet"
            return {**self.d0_inputs(), "kept": _sha256(kept) if kept.is_file() else None}
        if stage == "audit":
            return {cfg: _files_digest(files) for cfg, files in self.audit_inputs().items()}
        raise ConfigError(f"unknown stage {stage!r}; the stages are {list(STAGES)}")

    def _model_fingerprint(self, name: str) -> str | None:
        """A trained model's fingerprint: the sha256 of its training report (G, G*) or record (M)."""
        folder = self.path(name)
        for f in ("train_report.json", "debiased_nli_train.json"):
            if (folder / f).is_file():
                return _sha256(folder / f)
        return None

    def build_recipe(self) -> dict:
        """The recipe the build stage runs: the profile's, the generator step replaced by the kept rows."""
        rec = copy.deepcopy(self.recipe)
        rec["new_rows"] = [s for s in rec["new_rows"] if s["step"] != "generator"]
        return rec

    def release_configs(self) -> list[str]:
        data = self.path(RELEASE) / "data"
        return sorted(p.name for p in data.iterdir() if p.is_dir()) if data.is_dir() else []

    def audit_inputs(self) -> dict[str, list[Path]]:
        out = {}
        if self.d0_files():
            out[ORIGINAL] = self.d0_files()
        for cfg in self.release_configs():
            files = sorted((self.path(RELEASE) / "data" / cfg).glob(f"{self.recipe['data']['split']}-*.parquet"))
            if files:
                out[cfg] = files
        return out

    def argv(self, stages: Sequence[str] | None = None, recipe: str | None = None) -> list[str]:
        """``pipeline run``'s arguments for these stages of this pipeline (``recipe``: in place of its name)."""
        parts = ["pipeline", "run", recipe or self.recipe_ref or "<recipe>"]
        if self.profile:
            parts += ["--profile", self.profile]
        if self.data_files is not None:
            files = self.data_files
            if isinstance(files, Mapping):
                files = [f"{k}={f}" for k, v in files.items() for f in ([v] if isinstance(v, (str, os.PathLike)) else v)]
            parts += ["--data-files", *map(str, [files] if isinstance(files, (str, os.PathLike)) else files)]
        if self.samples_from:
            parts += ["--samples-from", str(self.samples_from)]
        if self.probabilities_from:
            parts += ["--probabilities-from", str(self.probabilities_from)]
        parts += ["--run", str(self.run_dir)]
        if stages:
            parts += ["--stages", *stages]
        return parts

    def command(self, stages: Sequence[str] | None = None) -> str:
        """The command line that runs these stages of this pipeline again."""
        parts = ["debiased-nli", *self.argv(stages)]
        # a recipe handed over as a mapping has no name to rerun it by: `<recipe>` says so, unquoted
        return " ".join(p if p == "<recipe>" and not self.recipe_ref else shlex.quote(p) for p in parts)

    # ------------------------------------------------------------------ status

    def skipped(self, stage: str) -> str | None:
        """Why the recipe does not ask for ``stage`` (None: it does)."""
        if stage == "train_g" and self.spec.get("generator"):
            return f"the step gives a trained generator: {self.spec['generator']}"
        if stage == "train_g_star" and not self.spec.get("debias"):
            return "the step has no `debias` (samples come from G)"
        if stage == "train_m" and self.probabilities_from:
            return f"the filter reads M's stored probabilities: {self.probabilities_from}"
        if stage == "train_m" and not self.spec.get("train_m"):
            return f"M is given: {self.model_of_m()}"
        return None

    def state(self, stage: str) -> StageState:
        why = self.skipped(stage)
        if why:
            return StageState(stage, "skipped", why)
        rec = _read_json(self.record_path(stage))
        if rec is not None:
            changed = [what for what, key, now in (("parameters", "params", self.params(stage)),
                                                   ("inputs", "inputs", self.inputs(stage)))
                       if rec.get(key) != _plain(now)]
            if not changed:
                return StageState(stage, "done", rec.get("summary", ""), rec)
            return StageState(stage, "stale", f"its {' and '.join(changed)} changed since it ran; a run redoes it",
                              rec)
        st = getattr(self, f"_progress_{stage}", lambda: StageState(stage, "pending"))()
        rate = _last_rate(self.path(LOGS) / f"{stage}.log")
        if rate:
            st.detail = "; ".join(x for x in (st.detail, rate) if x)
        return st

    def status(self) -> list[StageState]:
        return [self.state(s) for s in STAGES]

    def _progress_train_g(self, stage: str = "train_g", name: str = G) -> StageState:
        from ..methods.generation.train import checkpoints

        folder = self.path(name)
        cps = checkpoints(folder) if folder.is_dir() else []
        if cps:
            return StageState(stage, "partial", f"last checkpoint {cps[-1].name} in {folder}")
        return StageState(stage, "pending")

    def _progress_train_g_star(self) -> StageState:
        return self._progress_train_g("train_g_star", G_STAR)

    def _progress_train_m(self) -> StageState:
        cps = sorted(self.path(M).glob("checkpoint-*")) if self.path(M).is_dir() else []
        if cps:
            return StageState("train_m", "partial", f"{len(cps)} checkpoint(s), the last {cps[-1].name}")
        return StageState("train_m", "pending")

    def _progress_sample(self) -> StageState:
        folder = self.path(SAMPLES)
        cfg = _read_json(folder / "generate_config.json") or {}
        shards = _shards(folder)
        if not shards:
            return StageState("sample", "pending")
        n = cfg.get("num_shards") or "?"
        rows = _rows(shards) + _rows(_shards(folder, "rejects"))
        detail = f"{len(shards)}/{n} shards ({rows:,} samples)"
        if isinstance(n, int) and len(shards) < n:
            eta = _eta(shards, n - len(shards))
            if eta:
                detail += f"; ETA ~{eta} (from the last shards' times)"
        return StageState("sample", "partial", detail)

    # ------------------------------------------------------------------ run

    def check_run_folder(self) -> Path:
        """The run folder: new, empty or one of this tool's pipelines (``pipeline.json``), never a folder of the
        user's, an input's folder or the current folder; a run folder of another recipe, profile or task is
        refused."""
        from ..utils.outputs import check_output_folder

        inputs = [*self.d0_files(), *([self.samples_from] if self.samples_from else []),
                  *([self.probabilities_from] if self.probabilities_from else [])]
        target = check_output_folder(self.run_dir, what="a pipeline run", option="--run", inputs=inputs,
                                     is_ours=lambda p: (p / PLAN_FILE).is_file())
        plan = self.plan()
        old = _read_json(target / PLAN_FILE)
        if old is not None and {k: old.get(k) for k in ("recipe", "profile", "task")} != \
                {k: plan[k] for k in ("recipe", "profile", "task")}:
            raise ConfigError(f"--run {self.run_dir} holds the pipeline of {old.get('recipe')!r} profile "
                              f"{old.get('profile')!r} ({old.get('task')}), not {plan['recipe']!r} profile "
                              f"{plan['profile']!r}: use another --run")
        return target

    def plan(self) -> dict:
        return {"recipe": self.recipe["name"], "profile": self.profile, "task": self.task.name,
                "generator_step": _plain(self.spec), "data_files": _plain(self.data_files)}

    def run(self, stages: Sequence[str] | None = None, *, units: int | None = None, until: str | None = None,
            deadline: float | None = None) -> list[StageState]:
        """Run the stages that are not done, in order (``stages``: only these, each whatever its state but
        skipped ones). Without ``stages``, a stage that ends unfinished (``units``: sampling stops after that many
        new shards) ends the run there. ``until``: the last stage to run (the later ones are left to another run,
        e.g. on another machine). ``deadline``: seconds from now; each stage then runs in a process of its own
        (``pipeline run ... --stages STAGE``), stopped when the time is up, and the run ends there: what the stage
        finished stays (the trainers' checkpoints, whole sample shards) and the next run continues it. Returns the
        status afterwards."""
        from ..utils.outputs import lock_target

        for s in [*(stages or ()), *([until] if until is not None else [])]:
            if s not in STAGES:
                raise ConfigError(f"unknown stage {s!r}; the stages are {list(STAGES)}")
        if units is not None and (not isinstance(units, int) or isinstance(units, bool) or units < 1):
            raise ConfigError(f"units must be a positive integer, got {units!r}")
        if deadline is not None and not (isinstance(deadline, (int, float)) and deadline > 0):
            raise ConfigError(f"deadline must be a positive number of seconds, got {deadline!r}")
        end = None if deadline is None else time.monotonic() + deadline
        target = self.check_run_folder()
        self.run_dir = target  # absolute from here on: sampling runs inside it
        order = [s for s in (stages or STAGES) if until is None or STAGES.index(s) <= STAGES.index(until)]
        unlock = lock_target(target)
        try:
            target.mkdir(parents=True, exist_ok=True)
            _write_json(target / PLAN_FILE, self.plan())
            if end is not None:  # each stage's process takes the lock itself
                unlock()
                unlock = lambda: None  # noqa: E731
            for stage in order:
                st = self.state(stage)
                if st.state == "skipped" or (st.state == "done" and not stages):
                    self.echo(f"{stage}: {st.state}{' (' + st.detail + ')' if st.detail else ''}")
                    continue
                if end is not None and end <= time.monotonic():
                    self.echo(f"{stage}: not started, the deadline has come; run again to continue")
                    break
                self.echo(f"{stage}: running ({st.state}{': ' + st.detail if st.detail else ''})")
                if end is not None:
                    if not self._run_process(stage, units, end) and not stages:
                        break
                    continue
                t0 = time.perf_counter()
                finished, summary, outputs = getattr(self, f"_run_{stage}")(units)
                if not finished:
                    self.echo(f"{stage}: {summary}; run again to continue")
                    if not stages:
                        break
                    continue
                _write_json(self.record_path(stage), {
                    "stage": stage, "command": self.command([stage]), "params": self.params(stage),
                    "inputs": self.inputs(stage), "outputs": outputs, "summary": summary,
                    "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "seconds": round(time.perf_counter() - t0, 1)})
                self.echo(f"{stage}: done ({summary})")
        finally:
            unlock()
        return self.status()

    def _run_process(self, stage: str, units: int | None, end: float, grace: float = 15.0) -> bool:
        """``stage`` in a process of its own (this package's CLI, the same working folder), stopped at ``end``
        (``time.monotonic()``): SIGTERM to its process group, SIGKILL ``grace`` seconds later. Its stdout is this
        process's; its stderr (the progress bars, the log lines) goes to this process's stderr and to
        ``RUN/logs/<stage>.log``, which ``status`` reads for the rate of a stage stopped unfinished. Returns whether
        the stage is done afterwards; a process that failed raises."""
        import subprocess
        import sys
        import threading

        from ..utils.processes import stop_groups

        recipe = self.recipe_ref
        if recipe is None:  # a recipe given as a mapping: the process reads it from the run folder
            import yaml

            recipe = str(self.run_dir / ".pipeline-recipe.yaml")
            Path(recipe).write_text(yaml.safe_dump(_plain(self.recipe_path), sort_keys=False))
        cmd = [sys.executable, "-m", "debiased_nli.cli", *([] if self.progress else ["-q"]),
               *self.argv([stage], recipe), *(["--units", str(units)] if units else [])]
        root = str(Path(__file__).resolve().parents[2])  # this package, also where it is not installed
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        log = self.path(LOGS) / f"{stage}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)  # stdout stays ours
        copier = threading.Thread(target=_tee, args=(proc.stderr, log, shlex.join(cmd)), daemon=True)
        copier.start()
        try:
            code = proc.wait(max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_groups(proc, grace=grace)
            copier.join(10)
        st = self.state(stage)
        if code not in (0, None):
            raise ConfigError(f"{stage}: its process exited with {code} (its output is above; its stderr is also in {log}); "
                              f"{st.state}{': ' + st.detail if st.detail else ''}")
        if st.state != "done":
            self.echo(f"{stage}: {'stopped at the deadline' if code is None else 'unfinished'} "
                      f"({st.state}{': ' + st.detail if st.detail else ''}); run again to continue")
        return st.state == "done"

    def _require(self, stage: str, *needed: str) -> None:
        for n in needed:
            st = self.state(n)
            if st.state not in ("done", "skipped"):
                raise ConfigError(f"{stage} needs {n}, which is {st.state}"
                                  f"{' (' + st.detail + ')' if st.detail else ''}: run it first")

    def _refuse_stale_product(self, stage: str, folder: Path) -> None:
        """A model or sample folder made with other parameters or inputs is not continued as if it were this run's
        (a trainer or the sampler would resume it, or count its shards as done): it must be moved away first. The
        one change that continues: more samples of the same sampling run (generate --extend grows it)."""
        st = self.state(stage)
        if st.state == "stale" and stage == "sample" and st.record:
            old, new = dict(st.record.get("params") or {}), dict(self.params(stage))
            grown = int(new.pop("num_samples", 0) or 0) >= int(old.pop("num_samples", 0) or 0)
            if grown and old == new and st.record.get("inputs") == _plain(self.inputs(stage)):
                return
        if st.state == "stale" and folder.exists():
            raise ConfigError(f"{stage}: {folder} was made with other parameters or inputs ({st.detail.split(';')[0]}); "
                              f"move it away (or use another --run) to redo it")

    def _run_train_g(self, units):
        from ..methods.generation.step import train_generator_step

        self._refuse_stale_product("train_g", self.path(G))
        _, _, report = train_generator_step(self.d0().dataset, self.task,
                                            {**self.spec["train"], "out": str(self.path(G)), "mode": "generator"},
                                            show_values=True)
        return True, f"{report.get('steps')} steps, loss {_last_loss(report)}", \
            {"train_report.json": self._model_fingerprint(G)}

    def _run_train_g_star(self, units):
        from ..methods.generation.step import train_generator_step

        self._require("train_g_star", "train_g")
        self._refuse_stale_product("train_g_star", self.path(G_STAR))
        base = self.spec.get("generator") or str(self.path(G))
        params = {"model": base, **self.params("train_g_star"), "out": str(self.path(G_STAR)), "mode": "debias"}
        _, _, report = train_generator_step(self.d0().dataset, self.task, params, show_values=True)
        return True, f"{report.get('steps')} steps, loss {_last_loss(report)}", \
            {"train_report.json": self._model_fingerprint(G_STAR)}

    def _run_train_m(self, units):
        from ..methods.generation.step import train_m_step

        self._refuse_stale_product("train_m", self.path(M))
        d0 = self.d0()
        _, _, report = train_m_step(d0.dataset, self.task, {**self.spec["train_m"], "out": str(self.path(M)),
                                                            "source": d0.source})
        return True, f"dev accuracy {report.get('dev_accuracy')}", \
            {"debiased_nli_train.json": self._model_fingerprint(M)}

    def _run_sample(self, units):
        from ..methods.generation.step import generate_step

        gen = self.generator_name()
        self._refuse_stale_product("sample", self.path(SAMPLES))
        self.path(SAMPLES).mkdir(parents=True, exist_ok=True)
        if self.samples_from:
            n = seed_shards(self.samples_from, self.path(SAMPLES), self.params("sample"))
            if n:
                self.echo(f"sample: {n} finished shard(s) copied from {self.samples_from}")
        if gen in (G, G_STAR) and not (self.path(gen) / "train_report.json").is_file() \
                and not _complete(self.path(SAMPLES)):
            raise ConfigError(f"sample needs the trained generator {self.path(gen)}: run "
                              f"{'train_g_star' if gen == G_STAR else 'train_g'} first")
        cond = str(self.params("sample").get("condition") or "none")
        ds = self.d0().dataset if "premise" in cond else None
        params = {**self.params("sample"), "generator": gen, "out": SAMPLES, "extend": True,
                  "progress": self.progress and self.params("sample").get("progress", True),
                  "stop_after_shards": units}
        with _chdir(self.path("")):  # relative names: generate_config.json names no machine's folder
            generate_step(ds, self.task, params, show_values=True)
            if units is not None and _complete(Path(SAMPLES)) and not (Path(SAMPLES) / "generate_report.json").is_file():
                # the bounded session sampled the last shards: the run's report (nothing left to sample)
                generate_step(ds, self.task, {**params, "stop_after_shards": None})
        done = _complete(self.path(SAMPLES))
        state = self._progress_sample()
        if done and not (self.path(SAMPLES) / "generate_report.json").is_file():
            done = False
        return done, state.detail, {"shards": len(_shards(self.path(SAMPLES)))}

    def _run_filter(self, units):
        from ..methods.confidence import join_probabilities
        from ..methods.generation.sample import load_generated
        from ..methods.generation.step import confidence_filter_step

        self._require("filter", "sample", "train_m")
        rows = load_generated(str(self.path(SAMPLES)))
        params = {**self.params("filter"), "progress": self.progress}
        if self.probabilities_from:
            rows = join_probabilities(rows, str(self.probabilities_from), self.task)
            params["reuse_probabilities"] = True
        else:
            params["model"] = self.model_of_m()
        kept, rejected, report = confidence_filter_step(rows, self.task, params)
        report["model"] = None if self.probabilities_from else params["model"]
        if self.probabilities_from:
            report["probabilities_from"] = {"file": self.probabilities_from.name,
                                            "sha256": _sha256(self.probabilities_from)}
        out = self.path(CONFIDENT)
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        kept.to_parquet(str(tmp / "kept.parquet"))
        rejected.to_parquet(str(tmp / "rejected.parquet"))
        _write_json(tmp / "confidence_report.json", report)
        if "calibration" in report:
            _write_json(tmp / "calibration.json", report["calibration"])
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        summary = f"{len(kept):,} of {len(kept) + len(rejected):,} rows kept at tau {report['tau']}"
        if report.get("tau_note"):
            summary += f" ({report['tau_note']})"
        return True, summary, {"kept.parquet": _sha256(out / "kept.parquet")}

    def _run_build(self, units):
        from ..release.recipe import build

        self._require("build", "filter")
        kept = self.path(CONFIDENT) / "kept.parquet"
        res = build(self.build_recipe(), self.path(RELEASE), data_files=self.data_files,
                    new_rows_files=[str(kept)], overwrite=True, progress=self.progress)
        return True, ", ".join(f"{c} {n:,}" for c, n in res.configs.items()), \
            {"manifest.json": _sha256(self.path(RELEASE) / "manifest.json")}

    def _run_audit(self, units):
        from ..api import audit

        self._require("audit", "build")
        done = {}
        for cfg, files in self.audit_inputs().items():
            res = audit(self.task, data_files=[str(f) for f in files], out=self.path(AUDITS) / cfg,
                        on_invalid="set_aside", progress=self.progress)
            done[cfg] = res.report.get("max_abs_z")
        return True, "max |z|: " + ", ".join(f"{c} {z}" for c, z in done.items()), \
            {cfg: _sha256(self.path(AUDITS) / cfg / "audit.json") for cfg in done}


def _tee(stream, log: Path, command: str) -> None:
    """The bytes of ``stream`` (a stage process's stderr) to this process's stderr and to ``log``, as they come:
    tqdm's bars (carriage returns) stay bars on the terminal and stay readable in the log."""
    import sys

    out = getattr(sys.stderr, "buffer", None)
    with open(log, "ab") as f:
        f.write(f"\n=== {_dt.datetime.now().isoformat(timespec='seconds')}: {command}\n".encode())
        for chunk in iter(lambda: stream.read1(65536), b""):
            f.write(chunk)
            f.flush()
            if out is not None:
                with contextlib.suppress(OSError, ValueError):
                    out.write(chunk)
                    out.flush()


_BAR = (r"(?P<desc>[A-Za-z][\w ()*/-]*?): +\d+%\|[^|]*\| *(?P<n>\d+)/(?P<total>\d+) \[(?P<elapsed>[\d:]+)<[^,\]]*"
        r"(?:, *(?P<rate>[\d.]+)(?:(?P<per>[A-Za-z]+)/s|s/(?P<each>[A-Za-z]+)))?")


def bar_rates(text: str, min_seconds: float = 10) -> dict[str, dict]:
    """The last tqdm bar of each description in ``text`` (a log; carriage returns as line ends) that ran
    ``min_seconds`` or more (not the loading and encoding bars) and has steps done: its steps ``done`` of ``total``
    after the ``seconds`` of its process, the rate ``per_s`` (tqdm's own, which leaves out the steps a resumed run
    started from; else done / seconds), the time ``whole_stage_s`` of all the steps at that rate and ``left_s`` of
    those not done. The only record of a stage stopped at a deadline between checkpoints."""
    import re

    out: dict[str, dict] = {}
    for m in re.finditer(_BAR, text.replace("\r", "\n")):
        n, total, hms = int(m["n"]), int(m["total"]), m["elapsed"].split(":")
        secs = sum(int(x) * 60 ** i for i, x in enumerate(reversed(hms)))
        rate = float(m["rate"]) if m["rate"] else 0.0
        per_s = (rate if m["per"] else 1 / rate) if rate > 0 else n / secs if secs else 0.0
        if secs >= min_seconds and n and per_s > 0:
            out[m["desc"].strip()] = {"done": n, "total": total, "seconds": secs, "per_s": round(per_s, 3),
                                      "whole_stage_s": round(total / per_s), "left_s": round((total - n) / per_s)}
    return out


def _last_rate(log: Path) -> str:
    """``status``'s line on the last run of a stage from its log: the longest bar's steps, rate and whole."""
    if not log.is_file():
        return ""
    text = log.read_bytes().decode(errors="replace")
    text = text[text.rfind("\n=== ") + 1:] if "\n=== " in text else text  # the last run's process only
    rates = bar_rates(text)
    if not rates:
        return ""
    desc, r = max(rates.items(), key=lambda kv: kv[1]["seconds"])
    return (f"its last run ({LOGS}/{log.name}): {desc} {r['done']:,}/{r['total']:,} in {r['seconds']:,} s "
            f"({r['per_s']:g}/s: the whole ~{r['whole_stage_s']:,} s, ~{r['left_s']:,} s left at that rate)")


def _last_loss(report: dict) -> Any:
    hist = report.get("history") or []
    last = hist[-1] if hist else {}
    return last.get("loss") if isinstance(last, dict) else None


def _rows(files: Sequence[Path]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(str(f)).num_rows for f in files)


def _complete(folder: Path) -> bool:
    cfg = _read_json(folder / "generate_config.json") or {}
    return bool(cfg.get("num_shards")) and len(_shards(folder)) >= int(cfg["num_shards"])


def _eta(shards: Sequence[Path], remaining: int) -> str | None:
    """The time the remaining shards take at the pace of the last ones written (gaps under a second, shards
    copied in, are not a pace)."""
    times = sorted(p.stat().st_mtime for p in shards)[-11:]
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b - a >= 1.0)
    if not gaps:
        return None
    seconds = gaps[len(gaps) // 2] * remaining
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


SAMPLING_KEYS = ("num_samples", "seed", "top_p", "temperature", "max_new_tokens", "condition", "batch_size",
                 "engine")


def seed_shards(src: Path, dst: Path, sample_params: Mapping[str, Any]) -> int:
    """Copy the finished shards (each with its rejects file, copied first) of ``src`` that ``dst`` lacks, when both
    hold the same sampling run (the same generate_config.json; a new ``dst`` takes ``src``'s) and ``src``'s run has
    this stage's sampling values. A present shard file is a finished shard (generate writes it last), and each
    shard depends only on the seed and its sample indices, so the run continues where ``src`` stopped. Returns the
    number of shards copied."""
    cfg = _read_json(src / "generate_config.json")
    if not isinstance(cfg, dict):
        raise ConfigError(f"--samples-from {src}: no generate_config.json of a sampling run there")
    wanted = {k: sample_params[k] for k in SAMPLING_KEYS if sample_params.get(k) is not None}
    differ = {k: (cfg.get(k), v) for k, v in wanted.items() if cfg.get(k) != v}
    if differ:
        raise ConfigError(f"--samples-from {src} holds another sampling run (its value, the recipe's: {differ})")
    mine = _read_json(dst / "generate_config.json")
    if mine is not None and mine != cfg:
        raise ConfigError(f"--samples-from {src} and {dst} hold different sampling runs (generate_config.json "
                          f"differs); move {dst} away to start from {src}")
    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    for shard in _shards(src):
        if (dst / shard.name).exists():
            continue
        rejects = shard.with_name("rejects-" + shard.name[len("shard-"):])
        for f in ((rejects,) if rejects.exists() else ()) + (shard,):
            tmp = dst / f".{f.name}.tmp"
            shutil.copyfile(f, tmp)
            os.replace(tmp, dst / f.name)
        n += 1
    if mine is None:
        shutil.copyfile(src / "generate_config.json", dst / "generate_config.json")
    return n
