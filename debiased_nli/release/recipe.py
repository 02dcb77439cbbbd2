"""Builder recipes: one YAML per release, run end to end by ``debiased-nli build``.

A recipe names the task, where D0 comes from, how features are computed, the z-filtering
parameters, the steps that make new rows D_G (``new_rows``; each a *source step*) and the steps
that make extra configs from D0 (``filters``; each a *filter step*, e.g. AFLite). It publishes every
config its inputs allow: ``z_filtered`` from D0 alone; ``z_aug``, ``par_z`` and ``seq_z`` when new
rows are given; one config per filter step. The steps are declared in :mod:`.steps` (what each needs
from the build, its card section, how its dropped rows are written); a later stage plugs in by
declaring one::

    @register_source_step("my_generator", needs=("recipe",))
    def my_generator(task, params, ctx) -> Dataset: ...          # canonical new rows

    @register_filter_step("my_filter", needs=(), card_section=render_my_filter_md)
    def my_filter(ds, task, params, ctx) -> (kept, dropped_with_reason, report): ...

A build runs in this order (one function each, below): load D0 and the evaluation splits, run the
source steps (D_G), compute the features, compose the z-configs, run the filter steps, assemble the
configs, write the release.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence


from ..data.tasks import get_task
from ..utils.errors import ConfigError, EmptyResultError, did_you_mean, excerpt
from ..utils.provenance import library_versions
from ..utils.safe_yaml import read_yaml_input
from .step_registry import Rejects, StepResult, get_step, known_steps, register_filter_step, register_source_step

__all__ = ["DEFAULTS", "SCHEMA", "Z_CONFIGS", "BuildResult", "build", "check_recipe_types", "known_steps",
           "load_recipe", "register_filter_step", "register_source_step"]

DEFAULTS: dict[str, Any] = {
    "name": None,
    "task": None,
    "release_version": "1.0.0",
    "pretty_name": None,
    "repo_id": None,
    "summary": "",
    "seed": 0,
    # duplicates: rows of D0 with the premise, hypothesis and label of an earlier row are counted (manifest,
    # terminal) and kept ("keep") or set aside with the row they repeat ("set_aside"); see data/duplicates.py
    "data": {"data_files": None, "split": "train", "eval_splits": [], "on_invalid": "error", "max_rows": None,
             "revision": None, "duplicates": "keep"},
    # hypothesis_only: "tfidf", a fine-tuned classifier (folder or Hub id), {model: PATH, folds, epochs, ...}
    # (a transformer fine-tuned out of fold on D0), or null; chunk_rows: rows featurised at a time;
    # num_proc: processes for the feature extraction, n_jobs: for the TF-IDF model's folds ("auto": the
    # usable CPUs, at most 4); storage: "chunked" (integer ids, text read a chunk at a time) or
    # "columns" (every row's feature strings as in-memory columns: the reference, for small inputs)
    "features": {"hypothesis_only": "tfidf", "folds": 5, "chunk_rows": 100_000, "num_proc": "auto", "n_jobs": "auto",
                 "storage": "chunked"},
    # num_proc: processes for the walks over the new rows (z_aug, par_z, seq_z at once) and for the release's
    # z-statistics and plots (beside its Parquet files); "auto": where 2 CPUs or more are usable and there are
    # 100,000 rows or more (release.PARALLEL_MIN_ROWS); 1: one after the other. It never changes the result
    "z_filter": {"top_k": 20, "batch_size": 1000, "p0": "uniform", "min_z": 0.0, "num_proc": "auto"},
    "new_rows": [],
    # filters past the paper on the new rows before composition, and the self-audit fixed point of composed
    # configs (issue 45; off by default; settings and defaults in release/generated_filters.py)
    "generated_filters": {"near_duplicates": None, "fluency": None},
    "self_audit": {"configs": [], "max_rounds": 5, "alpha": 0.01, "z_threshold": None},
    "filters": [],
    "configs": "auto",
    "default_config": "auto",
    "history": [],
    "extra_citations": [],
    "profiles": {},
}
Z_CONFIGS = ("z_filtered", "z_aug", "par_z", "seq_z")
log = logging.getLogger(__name__)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge mappings; lists and scalars of ``over`` replace those of ``base``."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


class _Kind:
    """One expected type of a recipe value: a check and how to say it."""

    def __init__(self, says: str, check: Callable[[Any], bool]):
        self.says, self.check = says, check


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_p0(v) -> bool:
    if v in ("uniform", "prior"):
        return True
    if _is_number(v):
        return 0 < v < 1
    return isinstance(v, list) and len(v) > 0 and all(_is_number(x) and 0 < x < 1 for x in v)


def _is_data_files(v) -> bool:
    if v is None or isinstance(v, str) or _is_str_list(v):
        return True
    return isinstance(v, Mapping) and all(isinstance(k, str) and (isinstance(f, str) or _is_str_list(f))
                                          for k, f in v.items())


_STR = _Kind("a string (quote numbers such as versions: \"1.10\")", lambda v: isinstance(v, str))
_OPT_STR = _Kind("a string or null", lambda v: v is None or isinstance(v, str))
# the types of every recipe value; a wrong one is an error that names the key, the value and the type
SCHEMA: dict[str, Any] = {
    "name": _OPT_STR, "task": _STR, "release_version": _STR, "pretty_name": _OPT_STR, "repo_id": _OPT_STR,
    "summary": _Kind("a string", lambda v: isinstance(v, str)),
    "seed": _Kind("an integer from 0 to 4294967295 (2**32 - 1)", lambda v: _is_int(v) and 0 <= v <= 2**32 - 1),
    "data": {
        "data_files": _Kind("a path, a list of paths, or a mapping split: path(s)", _is_data_files),
        "split": _STR,
        "eval_splits": _Kind("a list of split names", _is_str_list),
        "on_invalid": _Kind("'error' or 'set_aside'", lambda v: v in ("error", "set_aside")),
        "max_rows": _Kind("a positive integer or null", lambda v: v is None or _is_int(v) and v >= 1),
        "revision": _OPT_STR,
        "duplicates": _Kind("'keep' or 'set_aside'", lambda v: v in ("keep", "set_aside")),
    },
    "features": {
        "hypothesis_only": _Kind("'tfidf', a classifier folder or Hub id, null/'none', or a mapping "
                                 "{model: PATH, folds: 5, epochs: ...} (a transformer fine-tuned out of fold)",
                                 lambda v: v is None or isinstance(v, str) and v.strip() != ""
                                 or isinstance(v, Mapping) and isinstance(v.get("model"), str)),
        "folds": _Kind("an integer >= 2", lambda v: _is_int(v) and v >= 2),
        "chunk_rows": _Kind("a positive integer", lambda v: _is_int(v) and v >= 1),
        "num_proc": _Kind("'auto' or a positive integer", lambda v: v == "auto" or _is_int(v) and v >= 1),
        "n_jobs": _Kind("'auto' or a positive integer", lambda v: v == "auto" or _is_int(v) and v >= 1),
        "storage": _Kind("'chunked' or 'columns'", lambda v: v in ("chunked", "columns")),
    },
    "z_filter": {
        "top_k": _Kind("a positive integer", lambda v: _is_int(v) and v >= 1),
        "batch_size": _Kind("a positive integer", lambda v: _is_int(v) and v >= 1),
        "p0": _Kind("'uniform', 'prior', a number strictly between 0 and 1, or one such number per label", _is_p0),
        "min_z": _Kind("a number", _is_number),
        "num_proc": _Kind("'auto' or a positive integer", lambda v: v == "auto" or _is_int(v) and v >= 1),
    },
    "new_rows": _Kind("a list of steps (mappings with a `step` name)", lambda v: isinstance(v, list)),
    # their keys and values are checked by release.generated_filters.check
    "generated_filters": {
        "near_duplicates": _Kind("null (off), true or a mapping {threshold: 0.8, within: true}",
                                 lambda v: v is None or isinstance(v, (bool, Mapping))),
        "fluency": _Kind("null (off) or a mapping {lm: PATH, quantile: 0.05, reference_rows: 2000}",
                         lambda v: v is None or v is False or isinstance(v, Mapping)),
    },
    "self_audit": {
        "configs": _Kind("a list of z-config names (empty: off)", _is_str_list),
        "max_rounds": _Kind("a positive integer", lambda v: _is_int(v) and v >= 1),
        "alpha": _Kind("a number strictly between 0 and 1", lambda v: _is_number(v) and 0 < v < 1),
        "z_threshold": _Kind("a positive number or null", lambda v: v is None or _is_number(v) and v > 0),
    },
    "filters": _Kind("a list of steps (mappings with a `step` name)", lambda v: isinstance(v, list)),
    "configs": _Kind("'auto' or a list of config names, e.g. [z_filtered, seq_z]",
                     lambda v: v == "auto" or _is_str_list(v) and len(v) > 0),
    "default_config": _STR,
    "history": _Kind("a list of {version: \"1.0.0\", notes: ...} mappings",
                     lambda v: isinstance(v, list) and all(isinstance(h, Mapping) and isinstance(h.get("version"), str)
                                                           and isinstance(h.get("notes", ""), str) for h in v)),
    "extra_citations": _Kind("a list of strings", _is_str_list),
    "profiles": _Kind("a mapping of profile names to recipe keys", lambda v: isinstance(v, Mapping)),
}


def check_recipe_types(recipe: Mapping[str, Any], where: str = "<recipe>") -> None:
    """Every value of a (defaults-merged) recipe has the type :data:`SCHEMA` gives it, or a
    :class:`ConfigError` names the key, the value and the expected type."""
    if isinstance(recipe["features"].get("hypothesis_only"), str) and \
            recipe["features"]["hypothesis_only"].strip().lower() in ("none", "null", "off"):
        recipe["features"]["hypothesis_only"] = None  # YAML reads `none` as a string
    for key, kind in SCHEMA.items():
        values = [(f"{key}.{sub}", recipe[key].get(sub), k) for sub, k in kind.items()] \
            if isinstance(kind, dict) else [(key, recipe.get(key), kind)]
        for name, value, k in values:
            if not k.check(value):
                raise ConfigError(f"{where}: `{name}` must be {k.says}, got {excerpt(value)} ({type(value).__name__})")


def _check_names(recipe: Mapping[str, Any], where: str) -> None:
    """The names that become file names (the splits, each filter step's config) are names, not paths
    (:func:`~debiased_nli.utils.paths.check_name`), and no text that goes into the card contains its markers
    (:func:`~.card.check_card_text`): refused while the recipe is read, before anything is written."""
    from ..utils.paths import check_name
    from .card import check_card_text

    check_name(recipe["data"]["split"], f"{where}: data.split")
    for i, split in enumerate(recipe["data"]["eval_splits"]):
        check_name(split, f"{where}: data.eval_splits[{i}]")
    files = recipe["data"]["data_files"]
    for split in (files if isinstance(files, Mapping) else ()):
        check_name(split, f"{where}: data.data_files split")
    for i, step in enumerate(recipe["filters"] or []):
        if isinstance(step, Mapping) and "config" in step:
            check_name(step["config"], f"{where}: filters[{i}].config")
    check_card_text({k: v for k, v in recipe.items() if k in ("name", "pretty_name", "summary", "release_version",
                                                              "repo_id", "history", "extra_citations", "profiles")},
                    where)


def load_recipe(path_or_dict: "str | Path | Mapping[str, Any]", profile: str | None = None) -> dict[str, Any]:
    """Read and validate a recipe (unknown keys are errors, with "did you mean").

    ``profile`` applies one of the recipe's ``profiles`` (named overrides, e.g. ``paper`` adds the
    generation steps of Wu et al. 2022 to the SNLI recipe) on top of its top-level settings.
    """
    if isinstance(path_or_dict, Mapping):
        raw, where = dict(path_or_dict), "<recipe>"
    else:
        p = Path(path_or_dict)
        # a regular file (no FIFO, no device), bounded: at most 1 MB, and what its aliases expand to (utils.safe_yaml)
        raw, where = read_yaml_input(p, "recipe") or {}, str(p)
        if not isinstance(raw, Mapping):
            raise ConfigError(f"recipe {p} must be a YAML mapping (key: value lines), not a {type(raw).__name__}")
    if profile is not None:
        profiles = raw.get("profiles") or {}
        if not isinstance(profiles, Mapping) or not all(isinstance(v, Mapping) for v in profiles.values()):
            raise ConfigError(f"{where}: `profiles` must map profile names to mappings of recipe keys")
        if profile not in profiles:
            raise ConfigError(f"{where}: no profile {excerpt(profile)}.{did_you_mean(profile, list(profiles))} "
                              f"Profiles: {sorted(profiles) or 'none'}")
        raw = _merge(raw, profiles[profile])
        raw["profile"] = profile
    profile_used = raw.pop("profile", None)
    recipe = copy.deepcopy(DEFAULTS)
    for key, value in raw.items():
        if key not in DEFAULTS:
            raise ConfigError(f"{where}: unknown recipe key {excerpt(key)}.{did_you_mean(key, list(DEFAULTS))} "
                              f"Known keys: {sorted(DEFAULTS)}")
        if isinstance(DEFAULTS[key], dict) and key != "profiles":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: `{key}` must be a mapping")
            for sub in value:
                if sub not in DEFAULTS[key]:
                    name = sub if isinstance(sub, str) and len(sub) <= 100 else excerpt(sub)
                    raise ConfigError(f"{where}: unknown key {key}.{name}.{did_you_mean(sub, list(DEFAULTS[key]))} "
                                      f"Known: {sorted(DEFAULTS[key])}")
            recipe[key].update(value)
        else:
            recipe[key] = value
    recipe["profile"] = profile_used
    if not recipe["task"]:
        raise ConfigError(f"{where}: a recipe needs `task`")
    check_recipe_types(recipe, where)
    from .generated_filters import check as check_generated_filters
    check_generated_filters(recipe, where)
    _check_names(recipe, where)
    get_task(recipe["task"])
    recipe["name"] = recipe["name"] or f"debiased-{recipe['task']}"
    recipe["pretty_name"] = recipe["pretty_name"] or recipe["name"]
    for kind, key in (("source", "new_rows"), ("filter", "filters")):
        for i, step in enumerate(recipe[key] or []):
            if not isinstance(step, Mapping) or not isinstance(step.get("step"), str):
                raise ConfigError(f"{where}: {key}[{i}] must be a mapping with a `step` name, got {excerpt(step)}")
            # the step's values against its declaration: an unknown key or a wrong type fails here, before any work
            get_step(kind, step["step"]).check_params(_given(step, kind), f"{where}: {key}[{i}] ({step['step']})")
    if recipe["configs"] != "auto":
        known = list(Z_CONFIGS) + [s.get("config", s["step"]) for s in recipe["filters"]] + ["original"]
        for c in recipe["configs"]:
            if c not in known:
                raise ConfigError(f"{where}: unknown config {excerpt(c)}.{did_you_mean(c, known)} Known configs: {known}")
    return recipe


def _given(spec: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A step's parameters as the recipe gives them: its mapping without ``step`` (and a filter step's ``config``)."""
    return {k: v for k, v in spec.items() if k != "step" and not (kind == "filter" and k == "config")}


def step_params(step, spec: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """What the build hands a step: the recipe's values (:func:`_given`) and, for every step that takes one, the
    build's seed as ``seed`` where the recipe sets none. One route for every step, so two steps that share a run
    (``ibadr`` and ``ibadr_rows`` with one ``out``) see the same seed."""
    params = _given(spec, step.kind)
    if step.takes_seed():
        params.setdefault("seed", seed)
    return params


@dataclasses.dataclass
class BuildResult:
    out_dir: Path
    configs: dict[str, int]
    manifest: dict
    # every step's report by its stage's name (the filter steps' are also in the manifest's stages)
    reports: dict[str, Any] = dataclasses.field(default_factory=dict)
    set_aside_note: str | None = None   # one line about the rows set aside on loading (None: there were none)
    recipe_path: Path | None = None     # the recipe file (debiased_nli.build: a packaged recipe's path)
    pruned: tuple[int, int] | None = None  # (entries, bytes) of the feature cache deleted afterwards (debiased_nli.build)


@dataclasses.dataclass
class BuildSettings:
    """The settings of one :func:`build` besides the recipe and the folder (its keywords).

    ``data_files``: D0's files (and evaluation splits) instead of the recipe's source; ``new_rows_files``: files
    of new rows D_G; ``seed``, ``max_rows``: the recipe's, overridden; ``profile``: one of the recipe's
    profiles; ``overwrite``: replace a release of this tool. ``efficacy``: the efficacy table's JSON
    (``debiased-nli compare report``); the card then shows the measured rows of this release's configs.
    ``timings`` adds each stage's wall-clock ``seconds`` to the manifest's stages (then the release
    is no longer the same byte for byte from run to run). ``replay``: an earlier release folder whose
    recorded filter-step decisions are reused where the step, its parameters and its input rows are the same
    (:mod:`.decisions`), so the neural steps give that release's rows on any machine. ``quality``: reports of
    ``debiased-nli quality`` on this release's generated rows (:mod:`.quality_card`), shown in its card and
    recorded in its manifest."""

    data_files: Any = None
    new_rows_files: Any = None
    overwrite: bool = False
    seed: int | None = None
    progress: bool = True
    max_rows: int | None = None
    profile: str | None = None
    efficacy: Any = None
    timings: bool = False
    replay: "str | Path | None" = None
    quality: "Sequence[str] | None" = None


def build(recipe: "str | Path | Mapping[str, Any]", out_dir: "str | Path", *, settings: BuildSettings | None = None,
          **values) -> BuildResult:
    """Run a recipe end to end and write the release folder. ``settings`` (or its fields as keywords:
    ``data_files=..., new_rows_files=..., overwrite=True, ...``): :class:`BuildSettings`.

    The target is checked before any work (see :func:`debiased_nli.utils.outputs.check_target`: never the
    current or home folder, a parent of an input, a file, or a folder that is not a release of this
    tool) and locked for the whole build, so a second build into the same ``out_dir`` is refused.
    """
    from ..data.loading import parse_data_files
    from ..utils.outputs import check_target, clean_stale, is_release_folder, lock_target
    from ..utils.params import options_of

    s = options_of(BuildSettings, settings, values, "build()")
    max_rows = s.max_rows
    if max_rows is not None and (not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1):
        raise ConfigError(f"max_rows must be a positive integer, got {max_rows!r}")
    if s.efficacy is not None:  # a missing or wrong table fails before the work, not after
        from .efficacy import load_table

        load_table(s.efficacy)
    if s.replay is not None:  # likewise a --replay that is not a release
        from .decisions import Replay

        s = dataclasses.replace(s, replay=Replay(s.replay))
    if s.quality:  # and a quality report that is not one
        from .quality_card import load_reports

        s = dataclasses.replace(s, quality=load_reports(s.quality))
    if not is_main_rank():  # under `accelerate launch` / torchrun: rank 0 checks, locks and writes
        return _build(recipe, out_dir, s)
    rec = load_recipe(recipe, s.profile)
    inputs: list[Any] = [] if isinstance(recipe, Mapping) else [recipe]
    for spec in [s.data_files if s.data_files is not None else rec["data"]["data_files"], s.new_rows_files] + \
            [step.get("data_files") for step in rec["new_rows"] if step.get("data_files")]:
        for files in (parse_data_files(spec) or {}).values():
            inputs.extend(files)
    target = check_target(out_dir, overwrite=s.overwrite, is_ours=is_release_folder, what="release", inputs=inputs)
    unlock = lock_target(target)
    try:
        clean_stale(target, is_release_folder)
        check_target(target, overwrite=s.overwrite, is_ours=is_release_folder, what="release", inputs=inputs)
        return _build(recipe, target, s)
    finally:
        unlock()


def world_size() -> int:
    """How many processes run this build (``WORLD_SIZE``, set by ``accelerate launch`` and ``torchrun``)."""
    from ..utils.environment import setting

    return int(setting("WORLD_SIZE", 1))


def is_main_rank() -> bool:
    """Whether this process is the one that checks, locks and writes the release (rank 0)."""
    from ..utils.environment import setting

    return int(setting("RANK", 0)) == 0


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _build(recipe: "str | Path | Mapping[str, Any]", out_dir: "str | Path", s: BuildSettings) -> BuildResult:
    recipe = _effective_recipe(recipe, profile=s.profile, data_files=s.data_files, new_rows_files=s.new_rows_files,
                               seed=s.seed, max_rows=s.max_rows)
    run = _Run(recipe, get_task(recipe["task"]), int(recipe["seed"]), progress=s.progress, timings=s.timings,
               replay=s.replay)
    loaded, eval_splits = _load_inputs(run)
    dg = _run_source_steps(run, loaded.dataset)
    if world_size() > 1:
        # under `accelerate launch` / torchrun the new-row steps share their work over the ranks; the rest
        # (features, filtering, writing the release) runs once, on the main process, after every rank's share
        from accelerate import PartialState
        state = PartialState(cpu=not _cuda_available())  # on CPUs the ranks meet over gloo (cpu=True)
        state.wait_for_everyone()
        if not state.is_main_process:
            return BuildResult(Path(out_dir), {}, {"rank": state.process_index})
    from .generated_filters import run_generated_filters, self_audit_configs
    dg = run_generated_filters(run, loaded.dataset, dg)
    feats = _compute_features(run, loaded.dataset, dg)
    z_configs = self_audit_configs(run, _compose_z_configs(run, feats, eval_splits), feats)
    filter_configs = _run_filter_steps(run, feats.d0, eval_splits)
    configs, default = _assemble_configs(run, z_configs + filter_configs, feats, eval_splits)
    return _write(run, out_dir, configs, default, loaded, feats, efficacy=s.efficacy, overwrite=s.overwrite,
                  quality=s.quality)


# the z-filter's dropped rows, written like a filter step's: their reason is the biased features that rejected
# each (bias.zfilter.REJECTED_BY; not imported here, so that `--help` reads this module without numpy)
Z_REJECTS = Rejects(reason="rejected_by")


@dataclasses.dataclass
class _Run:
    """What the pieces of one build share: the effective recipe, its task and seed, the context a step may
    ask for (:data:`.steps.CONTEXT`), the manifest's stages and the steps' reports."""

    recipe: dict
    task: Any
    seed: int
    progress: bool = True
    timings: bool = False
    context: dict = dataclasses.field(init=False)  # every key of .steps.CONTEXT
    stages: list = dataclasses.field(default_factory=list)
    reports: dict = dataclasses.field(default_factory=dict)
    replay: Any = None  # release.decisions.Replay of `--replay OLD`, or None
    row_records: dict = dataclasses.field(default_factory=dict)  # source steps' records (release.decisions)
    loaded_rows: int = 0  # rows read from every input, for the terminal's set-aside line
    duplicates: dict = dataclasses.field(default_factory=dict)  # D0's repeated rows (data/duplicates.py)

    def __post_init__(self):
        self.context = {"recipe": self.recipe, "seed": self.seed, "sources": [], "set_aside": []}

    def stage(self, name: str, since: float, **fields) -> None:
        """Record a stage of the manifest (with its seconds since ``since`` when timings are asked for)."""
        seconds = {"seconds": round(time.perf_counter() - since, 3)} if self.timings else {}
        self.stages.append({"stage": name, **fields, **seconds})


def _effective_recipe(recipe, *, profile, data_files, new_rows_files, seed, max_rows) -> dict[str, Any]:
    """The recipe as this build runs it: the command line's data files, new rows, seed and row limit applied."""
    from ..bias.hypothesis_only import transformer_params

    recipe = load_recipe(recipe, profile)
    if isinstance(recipe["features"]["hypothesis_only"], Mapping):
        recipe["features"]["hypothesis_only"] = transformer_params(recipe["features"]["hypothesis_only"])
    if seed is not None:
        recipe["seed"] = seed
    if max_rows is not None:
        recipe["data"]["max_rows"] = max_rows
    if new_rows_files:
        recipe["new_rows"] = list(recipe["new_rows"]) + [{"step": "files", "data_files": list(new_rows_files)}]
    if data_files is not None:
        recipe["data"]["data_files"] = data_files  # the effective source, for later steps and the manifest
    return recipe


def _load_inputs(run: _Run):
    """D0 (the recipe's split, each column in one piece of memory) and every other split of the data files
    by name: the recipe's eval_splits and any other given split (copied unchanged into every config, with a
    warning that the recipe does not name it). Returns (D0's :class:`LoadedSplit`, the other splits)."""
    from ..data.duplicates import handle_duplicates
    from ..data.loading import contiguous, load_task, parse_data_files, require_two_labels

    task, d = run.task, run.recipe["data"]
    files = d["data_files"]
    clock = time.perf_counter()
    loaded = load_task(task, d["split"], data_files=files, on_invalid=d["on_invalid"], revision=d["revision"],
                       max_rows=d["max_rows"])
    run.context["sources"].append(loaded.source)
    run.loaded_rows += loaded.counts["loaded"]
    run.stage("load", clock, detail=f"{task.name} split {d['split']!r}", counts=loaded.counts)
    # each column in one piece of memory (D0 read from many files has many): see data.contiguous
    d0 = loaded.dataset = contiguous(loaded.dataset)
    d0, duplicates = handle_duplicates(d0, d["duplicates"])  # counted; set aside when the recipe says so
    if duplicates.set_aside is not None:
        loaded.dataset = d0
        run.context["set_aside"].append(("train", duplicates.set_aside))
    run.duplicates = duplicates.record()
    if len(d0) == 0:
        raise EmptyResultError(f"no usable rows in {task.name!r} split {d['split']!r} after loading "
                               f"({loaded.counts}); nothing was written")
    require_two_labels(d0, task, f"{task.name!r} split {d['split']!r}")
    given = list(parse_data_files(files) or {})
    ignored = [s for s in given if s != d["split"] and s not in d["eval_splits"]]
    for split in ignored:
        log.warning("split %r of the data files is not among the recipe's eval_splits %s: it is copied unchanged "
                    "into every config", split, list(d["eval_splits"]))
    eval_splits = {}
    for split in list(d["eval_splits"]) + ignored:
        clock = time.perf_counter()
        ev = load_task(task, split, data_files=files, on_invalid=d["on_invalid"], revision=d["revision"])
        run.context["sources"].append(ev.source)
        run.context["set_aside"].append((f"eval:{split}", ev.set_aside))
        run.loaded_rows += ev.counts["loaded"]
        eval_splits[split] = ev.dataset
        run.stage(f"load {split}", clock, detail="copied unchanged into every config", counts=ev.counts)
    return loaded, eval_splits


def _run_source_steps(run: _Run, d0):
    """D_G: the new rows of every source step of ``new_rows``, in order (None without any). The rows a step
    makes (not a ``files`` step, whose files are their own record) are recorded with the rows it dropped, and
    replayed from ``--replay``'s record when the step, its parameters and D0's rows are the same
    (:mod:`.decisions`)."""
    import datasets

    from .decisions import new_rows_key, rows_record

    sources, d0_hash = [], None
    for k, spec in enumerate(run.recipe["new_rows"]):
        clock = time.perf_counter()
        step = get_step("source", spec["step"])
        params = step_params(step, spec, run.seed)
        key, made = new_rows_key(k, spec["step"]), spec["step"] != "files"
        if made and d0_hash is None:
            from .decisions import input_sha256
            d0_hash = input_sha256(d0)
        replayed = (run.replay.lookup_rows(key, spec["step"], params, d0_hash)
                    if made and run.replay is not None else None)
        before = len(run.context["set_aside"])
        result = StepResult(*replayed) if replayed else step.run(run.task, params, context=run.context)
        loads = run.context["set_aside"][before:]
        if loads:  # a step that read files (and recorded what it set aside): its rows were loaded, not made
            run.loaded_rows += len(result.rows) + sum(len(rows) for _, rows in loads if rows is not None)
        if made:
            run.row_records[key] = rows_record(spec["step"], params, d0_hash, result.rows, result.rejected,
                                               result.report)
        sources.append(result.rows)
        run.reports[f"new rows: {spec['step']}"] = result.report
        replay = {"replay": run.replay.used[key]} if made and run.replay is not None else {}
        run.stage(f"new rows: {spec['step']}", clock, counts={"rows": len(result.rows)}, **replay)
    if not sources:
        return None
    return sources[0] if len(sources) == 1 else datasets.concatenate_datasets(sources)


@dataclasses.dataclass
class _Features:
    """D0 and D_G after the feature stage (with ``feat_*`` columns when ``storage: columns``), the hypothesis-only
    model's summary, and their feature matrices over one vocabulary (``storage: chunked``; else None)."""

    d0: Any
    dg: Any
    hypothesis_only: Any
    matrices: tuple | None
    labels0: Any = None  # D0's labels

    def parts(self, kept0=None, kept_g=None, all0: bool = False) -> list | None:
        """The rows of a config as (matrix, labels, rows) parts, for its z-statistics (chunked storage)."""
        from ..data.loading import labels_of

        if self.matrices is None:
            return None
        out = [(self.matrices[0], self.labels0, None if all0 else kept0)] if all0 or kept0 is not None else []
        if kept_g is not None:
            out.append((self.matrices[1], labels_of(self.dg), kept_g))
        return out


def _compute_features(run: _Run, d0, dg) -> _Features:
    """Features of D0 and D_G over one vocabulary, a chunk of rows at a time; the hypothesis-only model is
    fitted on D0 alone (out of fold) and predicts D_G, so Z(D0) depends on D0 alone."""
    from ..bias.task_features import FeatureWork, add_features_pair, featurize_build
    from ..data.loading import contiguous, labels_of
    from ..utils.processes import return_free_memory

    feat_cfg, task = run.recipe["features"], run.task
    if dg is not None and dg.features != d0.features:
        dg = dg.cast(d0.features)
    if dg is not None:
        dg = contiguous(dg)
    clock = time.perf_counter()
    counts = {"rows": len(d0) + (len(dg) if dg is not None else 0)}
    if feat_cfg["storage"] == "columns":
        # every row's feature strings as columns, in memory (the reference for the chunked path)
        d0, dg, hyp = add_features_pair(d0, dg, task, hypothesis_only=feat_cfg["hypothesis_only"],
                                        folds=feat_cfg["folds"], seed=run.seed, progress=run.progress)
        matrices, by_part = None, {}
    elif feat_cfg["storage"] == "chunked":
        work = FeatureWork(chunk_rows=int(feat_cfg["chunk_rows"]), num_proc=feat_cfg["num_proc"],
                           n_jobs=feat_cfg["n_jobs"])
        feats = featurize_build(d0, dg, task, hypothesis_only=feat_cfg["hypothesis_only"], folds=feat_cfg["folds"],
                                seed=run.seed, work=work, progress=run.progress)
        hyp, matrices, by_part = feats.hypothesis_only, (feats.d0, feats.dg), feats.seconds
    else:
        raise ConfigError(f"features.storage must be 'chunked' or 'columns', not {feat_cfg['storage']!r}")
    return_free_memory()  # the feature stage's temporaries, before the walks fork (see processes.py)
    if hyp:
        counts["hypothesis_only_accuracy"] = round(hyp.accuracy, 4)
    run.stage("features", clock, detail=", ".join(task.features), counts=counts,
              **({"seconds_by_part": by_part} if run.timings and by_part else {}))
    return _Features(d0, dg, hyp, matrices, labels_of(d0))


def _compose_z_configs(run: _Run, feats: _Features, eval_splits: dict) -> list:
    """The z-configs the recipe wants (all that its inputs allow with ``configs: auto``): ``z_filtered`` =
    Z(D0), ``z_aug`` = Z(D_G | D0), ``par_z`` = Z(D0) ∪ Z(D_G), ``seq_z`` = Z(D_G | Z(D0)), each with the rows
    z-filtering dropped (``rejected_by``: the biased features that rejected each)."""
    import datasets

    from ..bias.compose import compose
    from ..bias.zfilter import ZFilterParams
    from ..utils.processes import return_free_memory
    from .configs import ConfigData

    zc = run.recipe["z_filter"]
    wanted = None if run.recipe["configs"] == "auto" else [c for c in run.recipe["configs"] if c in Z_CONFIGS]
    z_seconds: dict[str, float] = {}
    zp = ZFilterParams(top_k=zc["top_k"], batch_size=zc["batch_size"], p0=zc["p0"], min_z=zc["min_z"])
    results = compose(feats.d0, feats.dg, run.task, params=zp, seed=run.seed, configs=wanted, progress=run.progress,
                      features=feats.matrices, seconds=z_seconds, num_proc=zc["num_proc"]) if wanted != [] else {}
    return_free_memory()

    def config(name: str, key: str, train, rejected, features, stage: str, **fields) -> ConfigData:
        seconds = {"seconds": round(z_seconds[key], 3)} if run.timings and key in z_seconds else {}
        run.stages.append({"stage": stage, **fields, **seconds})
        return ConfigData(name, {"train": train, **eval_splits}, Z_REJECTS.table(rejected, name), features=features)

    configs = []
    z0 = results.get("z_filtered")
    if z0 is not None and (wanted is None or "z_filtered" in wanted):
        configs.append(config("z_filtered", "z_filtered", z0.kept, z0.rejected, feats.parts(kept0=z0.outcome.kept),
                              "z_filtered = Z(D0)", detail=f"top_k={zc['top_k']}, batch_size={zc['batch_size']}",
                              counts=z0.counts))
    if "z_aug" in results:
        r = results["z_aug"]
        configs.append(config("z_aug", "z_aug", r.kept, r.rejected, feats.parts(all0=True, kept_g=r.outcome.kept),
                              "z_aug = Z(D_G | D0)", counts=r.counts))
    if "par_z_new" in results:
        r = results["par_z_new"]
        train = datasets.concatenate_datasets([z0.kept, r.kept])
        configs.append(config("par_z", "par_z_new", train, datasets.concatenate_datasets([z0.rejected, r.rejected]),
                              feats.parts(kept0=z0.outcome.kept, kept_g=r.outcome.kept), "par_z = Z(D0) ∪ Z(D_G)",
                              counts={"Z(D0)": len(z0.kept), "Z(D_G)": len(r.kept), "output": len(train)}))
    if "seq_z" in results:
        r = results["seq_z"]
        # its dropped rows: the original rows Z(D0) rejected, then the new rows rejected given Z(D0)
        configs.append(config("seq_z", "seq_z", r.kept, datasets.concatenate_datasets([z0.rejected, r.rejected]),
                              feats.parts(kept0=z0.outcome.kept, kept_g=r.outcome.kept), "seq_z = Z(D_G | Z(D0))",
                              counts=r.counts))
    return configs


def _run_filter_steps(run: _Run, d0, eval_splits: dict) -> list:
    """One config per filter step of ``filters`` (those ``configs`` names, unless it is ``auto``): the rows the
    step keeps of D0, the rows it drops (written as its :class:`~.steps.Rejects` says) and its card section."""
    from ..bias.features import FEATURE_PREFIX
    from ..bias.task_features import add_features
    from .configs import ConfigData
    from .decisions import record as decision_record

    configs, d0_filters = [], None
    for spec in run.recipe["filters"]:
        name = spec.get("config", spec["step"])
        if run.recipe["configs"] != "auto" and name not in run.recipe["configs"]:
            continue
        step = get_step("filter", spec["step"])
        params = step_params(step, spec, run.seed)
        clock = time.perf_counter()
        if d0_filters is None:
            # filter steps (AFLite, PDD, IBADR) get D0 with its feature columns and return their rows with
            # them, so that the card shows their z-statistics; the chunked path keeps none, so they are
            # computed here for D0 alone (cached; the same features and hypothesis-only model as above)
            d0_filters = d0
            if not any(c.startswith(FEATURE_PREFIX) for c in d0.column_names):
                feat_cfg = run.recipe["features"]
                d0_filters, _ = add_features(d0, run.task, hypothesis_only=feat_cfg["hypothesis_only"],
                                             hypo_only_folds=feat_cfg["folds"], seed=run.seed, progress=run.progress)
        replayed = run.replay.lookup(name, spec["step"], params, d0_filters) if run.replay is not None else None
        kept, dropped, report = replayed or step.run(d0_filters, run.task, params, context=run.context)
        rejected = step.rejects.table(dropped, step.name)
        # what the step decided and from which scores, so that `build --replay` reproduces it (release.decisions)
        record = decision_record(spec["step"], params, d0_filters, kept, rejected, step.rejects.extra,
                                 reason=step.rejects.reason)
        configs.append(ConfigData(name, {"train": kept, **eval_splits}, rejected,
                                  card_section=step.section(_as_recorded(report)), decisions=record))
        run.reports[f"{name}: {spec['step']}"] = report
        replay = {"replay": run.replay.used[name]} if run.replay is not None else {}
        run.stage(f"{name}: {spec['step']}", clock,
                  counts={"kept": len(kept), "removed": len(dropped) if dropped is not None else 0}, report=report,
                  **replay)
    return configs


def _as_recorded(report: Any) -> Any:
    """A step's report as the manifest records it (paths reduced to file names, keys sorted, JSON values), the
    form its card section is rendered from: a build that replays the step (from the recorded report) then
    writes the same card as the build it replays."""
    import json

    from ..utils.paths import public_paths

    return json.loads(json.dumps(public_paths(report), sort_keys=True, default=str))


def _assemble_configs(run: _Run, configs: list, feats: _Features, eval_splits: dict) -> tuple[list, str]:
    """The release's configs (``original`` first when ``configs`` names it) and its default config
    (``auto``: ``seq_z``, else ``z_filtered``, else the first)."""
    from .configs import ConfigData

    if run.recipe["configs"] != "auto" and "original" in run.recipe["configs"]:
        configs.insert(0, ConfigData("original", {"train": feats.d0, **eval_splits}, features=feats.parts(all0=True)))
    if not configs:
        raise ConfigError("the recipe produced no config; check `configs`")
    default = run.recipe["default_config"]
    if default == "auto":
        names = [c.name for c in configs]
        default = "seq_z" if "seq_z" in names else ("z_filtered" if "z_filtered" in names else names[0])
    return configs, default


def _recorded_recipe(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe as the manifest records it: the options past the paper (``generated_filters``, ``self_audit``)
    only when one is on, so a release built without them is the same byte for byte as before they existed."""
    out = dict(recipe)
    if not any(v not in (None, False) for v in recipe["generated_filters"].values()):
        out.pop("generated_filters")
    if not recipe["self_audit"]["configs"]:
        out.pop("self_audit")
    return out


def _write(run: _Run, out_dir, configs: list, default: str, loaded, feats: _Features, *, efficacy,
           overwrite: bool, quality=None) -> BuildResult:
    """The manifest and the card's metadata, then the release folder (see :func:`.layout.write_release`)."""
    from ..bias.features import describe_extractors
    from ..data.loading import combine_set_aside, set_aside_summary
    from .layout import ReleaseContents, write_release

    recipe, task = run.recipe, run.task
    # every row set aside on loading, from every input (D0, evaluation splits, new rows), is written
    set_aside, set_aside_counts = combine_set_aside([("train", loaded.set_aside)] + run.context["set_aside"])
    hyp = feats.hypothesis_only
    manifest = {
        "recipe": _recorded_recipe(recipe),
        "seed": run.seed,
        "versions": library_versions(),
        "inputs": run.context["sources"],
        "stages": run.stages,
        "features": {"extractors": dict(describe_extractors(task.features)),
                     "hypothesis_only": hyp.to_dict() if hyp else None},
        "set_aside": set_aside_counts,
        "duplicates": {"train": run.duplicates},
    }
    from .card import release_title

    meta = {"pretty_name": release_title(recipe["pretty_name"], [c.name for c in configs]),
            "repo_id": recipe["repo_id"] or f"<org>/{recipe['name']}",
            "summary": recipe["summary"], "release_version": recipe["release_version"], "license": task.license,
            "history": recipe["history"] or [{"version": recipe["release_version"], "notes": "first release"}],
            "extra_citations": recipe["extra_citations"]}
    if quality:
        from . import quality_card

        matched = quality_card.match_reports(quality, feats.d0, feats.dg, configs)
        manifest["quality"] = quality_card.manifest_entries(matched)
        meta["quality_md"] = quality_card.card_markdown(matched)
    if efficacy is not None:
        from .efficacy import card_markdown

        meta["efficacy_md"] = card_markdown(efficacy, [c.name for c in configs], source=Path(efficacy).name,
                                            sizes={c.name: len(c.splits["train"]) for c in configs},
                                            release=Path(out_dir).name)
    contents = ReleaseContents(configs, default, manifest, meta, original=feats.d0,
                               original_features=feats.parts(all0=True), set_aside=set_aside,
                               row_records=run.row_records)
    out = write_release(out_dir, task, contents, overwrite=overwrite, timings=run.timings,
                        num_proc=recipe["z_filter"]["num_proc"])
    return BuildResult(out, {c.name: len(c.splits["train"]) for c in configs}, manifest, run.reports,
                       set_aside_summary(set_aside, run.loaded_rows))
