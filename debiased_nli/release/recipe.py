"""Builder recipes: one YAML per release, run end to end by ``debiased-nli build``.

A recipe names the task, where D0 comes from, how features are computed, the z-filtering
parameters, the steps that make new rows D_G (``new_rows``; each a *source step*) and the steps
that make extra configs from D0 (``filters``; each a *filter step*, e.g. AFLite). It publishes every
config its inputs allow: ``z_filtered`` from D0 alone; ``z_aug``, ``par_z`` and ``seq_z`` when new
rows are given; one config per filter step. Later stages plug in by registering a step::

    @register_source_step("my_generator")
    def my_generator(task, params, ctx) -> Dataset: ...          # canonical new rows

    @register_filter_step("my_filter")
    def my_filter(ds, task, params, ctx) -> (kept, removed, report): ...
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from ..data.tasks import get_task
from ..utils.errors import ConfigError, EmptyResultError, did_you_mean, excerpt
from ..utils.provenance import library_versions
from ..utils.safe_yaml import read_yaml_file

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
    "filters": [],
    "configs": "auto",
    "default_config": "auto",
    "history": [],
    "extra_citations": [],
    "profiles": {},
}
Z_CONFIGS = ("z_filtered", "z_aug", "par_z", "seq_z")
log = logging.getLogger(__name__)

SourceStep = Callable[..., Any]
FilterStep = Callable[..., Any]
_SOURCE_STEPS: dict[str, SourceStep] = {}
_FILTER_STEPS: dict[str, FilterStep] = {}
# steps defined in modules that are imported only when a recipe uses them (heavy dependencies)
_LAZY_STEPS = {
    "aflite": ("filter", "debiased_nli.methods.aflite.step", "aflite_step"),
    "pdd": ("filter", "debiased_nli.methods.pdd.step", "pdd_step"),
    "generator": ("source", "debiased_nli.methods.generation.steps", "generator_source"),
    "ibadr": ("filter", "debiased_nli.methods.ibadr.step", "ibadr_step"),
    "ibadr_rows": ("source", "debiased_nli.methods.ibadr.step", "ibadr_rows"),
}


def register_source_step(name: str):
    def wrap(fn):
        _SOURCE_STEPS[name] = fn
        return fn
    return wrap


def register_filter_step(name: str):
    def wrap(fn):
        _FILTER_STEPS[name] = fn
        return fn
    return wrap


def _step(kind: str, name: str) -> Callable:
    table = _SOURCE_STEPS if kind == "source" else _FILTER_STEPS
    if name not in table and name in _LAZY_STEPS and _LAZY_STEPS[name][0] == kind:
        _, module, attr = _LAZY_STEPS[name]
        table[name] = getattr(importlib.import_module(module), attr)
    if name not in table:
        known = sorted(set(table) | {n for n, v in _LAZY_STEPS.items() if v[0] == kind})
        raise ConfigError(f"unknown {kind} step {excerpt(name)}.{did_you_mean(name, known)} Known {kind} steps: {known}")
    return table[name]


def known_steps() -> dict[str, list[str]]:
    """The registered step names by kind (``source``: new rows, ``filter``: extra configs), lazy ones
    included, e.g. for ``--help``."""
    return {kind: sorted(set(table) | {n for n, v in _LAZY_STEPS.items() if v[0] == kind})
            for kind, table in (("source", _SOURCE_STEPS), ("filter", _FILTER_STEPS))}


@register_source_step("files")
def files_source(task, params: Mapping[str, Any], ctx: Mapping[str, Any]):
    """New rows (e.g. generated elsewhere) from local files in the task's schema or the canonical one."""
    from ..data.loading import content_uids, load_task

    files = params.get("data_files")
    if not files:
        raise ConfigError("the `files` step needs `data_files`")
    origin = params.get("origin", "generated")
    method = params.get("method", f"files:{Path(str(files if isinstance(files, str) else files[0])).name}")
    loaded = load_task(task, "train", data_files={"train": files}, on_invalid=params.get("on_invalid", "error"))
    ds = loaded.dataset
    # new rows are named by their content, as new_rows() names them (see the card's column table);
    # a chunk of rows at a time (in worker processes for large inputs), so no Python string outlives its chunk
    import datasets
    import pyarrow as pa
    from datasets.fingerprint import Hasher

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    if ds._indices is not None:
        table = ds.with_format("arrow")[:]
    uids = content_uids(table.select(["premise", "hypothesis", "label"]), task.labels, prefix=f"{method}:",
                        num_proc="auto")
    n = table.num_rows
    out = pa.table({"premise": table.column("premise"), "hypothesis": table.column("hypothesis"),
                    "label": table.column("label"), "uid": uids,
                    "origin": pa.repeat(pa.scalar(origin, pa.string()), n),
                    "method": pa.repeat(pa.scalar(method, pa.string()), n)})
    ds = datasets.Dataset(out.cast(ds.features.arrow_schema), info=ds.info.copy(),
                          fingerprint=Hasher.hash([ds._fingerprint, "files_source", origin, method]))
    ctx["sources"].append(loaded.source)
    ctx["set_aside"].append((f"new_rows:{method}", loaded.set_aside))
    return ds


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


def load_recipe(path_or_dict: "str | Path | Mapping[str, Any]", profile: str | None = None) -> dict[str, Any]:
    """Read and validate a recipe (unknown keys are errors, with "did you mean").

    ``profile`` applies one of the recipe's ``profiles`` (named overrides, e.g. ``paper`` adds the
    generation steps of Wu et al. 2022 to the SNLI recipe) on top of its top-level settings.
    """
    if isinstance(path_or_dict, Mapping):
        raw, where = dict(path_or_dict), "<recipe>"
    else:
        p = Path(path_or_dict)
        if not p.is_file():
            raise ConfigError(f"recipe {p} does not exist" if not p.exists() else
                              f"recipe {p} is not a regular file (a folder, a pipe or a device)")
        try:  # bounded: at most 1 MB, and what its aliases expand to (see utils.safe_yaml)
            raw, where = read_yaml_file(p, "recipe") or {}, str(p)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"recipe {p} is not valid YAML{at}: {problem}") from err
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"cannot read the recipe {p}: {err}") from err
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
    get_task(recipe["task"])
    recipe["name"] = recipe["name"] or f"debiased-{recipe['task']}"
    recipe["pretty_name"] = recipe["pretty_name"] or recipe["name"]
    for kind, key in (("source", "new_rows"), ("filter", "filters")):
        for i, step in enumerate(recipe[key] or []):
            if not isinstance(step, Mapping) or not isinstance(step.get("step"), str):
                raise ConfigError(f"{where}: {key}[{i}] must be a mapping with a `step` name, got {excerpt(step)}")
            _step(kind, step["step"])
    if recipe["configs"] != "auto":
        known = list(Z_CONFIGS) + [s.get("config", s["step"]) for s in recipe["filters"]] + ["original"]
        for c in recipe["configs"]:
            if c not in known:
                raise ConfigError(f"{where}: unknown config {excerpt(c)}.{did_you_mean(c, known)} Known configs: {known}")
    return recipe


@dataclasses.dataclass
class BuildResult:
    out_dir: Path
    configs: dict[str, int]
    manifest: dict


def build(recipe: "str | Path | Mapping[str, Any]", out_dir: "str | Path", *, data_files=None,
          new_rows_files=None, overwrite: bool = False, seed: int | None = None, progress: bool = True,
          max_rows: int | None = None, profile: str | None = None, efficacy=None,
          timings: bool = False) -> BuildResult:
    """Run a recipe end to end and write the release folder. ``efficacy``: the efficacy table's JSON
    (``benchmarks/efficacy.py report``); the card then shows the measured rows of this release's configs.
    ``timings`` adds each stage's wall-clock ``seconds`` to the manifest's stages (then the release
    is no longer the same byte for byte from run to run).

    The target is checked before any work (see :func:`debiased_nli.utils.outputs.check_target`: never the
    current or home folder, a parent of an input, a file, or a folder that is not a release of this
    tool) and locked for the whole build, so a second build into the same ``out_dir`` is refused.
    """
    from ..data.loading import parse_data_files
    from ..utils.outputs import check_target, clean_stale, is_release_folder, lock_target

    if max_rows is not None and (not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1):
        raise ConfigError(f"max_rows must be a positive integer, got {max_rows!r}")
    if efficacy is not None:  # a missing or wrong table fails before the work, not after
        from .efficacy import load_table

        load_table(efficacy)
    if int(os.environ.get("RANK", "0")) != 0:  # under `accelerate launch`: rank 0 checks, locks and writes
        return _build(recipe, out_dir, data_files=data_files, new_rows_files=new_rows_files, overwrite=overwrite,
                      seed=seed, progress=progress, max_rows=max_rows, profile=profile,
                      efficacy=efficacy, timings=timings)
    rec = load_recipe(recipe, profile)
    inputs: list[Any] = [] if isinstance(recipe, Mapping) else [recipe]
    for spec in [data_files if data_files is not None else rec["data"]["data_files"], new_rows_files] + \
            [step.get("data_files") for step in rec["new_rows"] if step.get("data_files")]:
        for files in (parse_data_files(spec) or {}).values():
            inputs.extend(files)
    target = check_target(out_dir, overwrite=overwrite, is_ours=is_release_folder, what="release", inputs=inputs)
    unlock = lock_target(target)
    try:
        clean_stale(target, is_release_folder)
        check_target(target, overwrite=overwrite, is_ours=is_release_folder, what="release", inputs=inputs)
        return _build(recipe, target, data_files=data_files, new_rows_files=new_rows_files, overwrite=overwrite,
                      seed=seed, progress=progress, max_rows=max_rows, profile=profile,
                      efficacy=efficacy, timings=timings)
    finally:
        unlock()


def _build(recipe: "str | Path | Mapping[str, Any]", out_dir: "str | Path", *, data_files=None,
           new_rows_files=None, overwrite: bool = False, seed: int | None = None, progress: bool = True,
           max_rows: int | None = None, profile: str | None = None, efficacy=None,
           timings: bool = False) -> BuildResult:
    import datasets

    from ..bias.compose import compose
    from ..bias.features import FEATURE_PREFIX, describe_extractors
    from ..bias.featurize import add_features, add_features_pair, featurize_build
    from ..bias.hypothesis_only import transformer_params
    from ..data.duplicates import handle_duplicates
    from ..data.loading import combine_set_aside, contiguous, labels_of, load_task, parse_data_files, require_two_labels
    from ..utils.processes import return_free_memory
    from .configs import ConfigData
    from .layout import write_release

    recipe = load_recipe(recipe, profile)
    if isinstance(recipe["features"]["hypothesis_only"], Mapping):
        recipe["features"]["hypothesis_only"] = transformer_params(recipe["features"]["hypothesis_only"])
    if seed is not None:
        recipe["seed"] = seed
    if max_rows is not None:
        recipe["data"]["max_rows"] = max_rows
    if new_rows_files:
        recipe["new_rows"] = list(recipe["new_rows"]) + [{"step": "files", "data_files": list(new_rows_files)}]
    task = get_task(recipe["task"])
    seed_ = int(recipe["seed"])
    d = recipe["data"]
    files = data_files if data_files is not None else d["data_files"]
    d["data_files"] = files  # the effective source, for later steps and the manifest
    ctx: dict[str, Any] = {"sources": [], "set_aside": [], "seed": seed_, "recipe": recipe}
    stages: list[dict] = []

    def stage(name: str, since: float, **fields) -> None:
        stages.append({"stage": name, **fields, **({"seconds": round(time.perf_counter() - since, 3)} if timings else {})})

    clock = time.perf_counter()
    loaded = load_task(task, d["split"], data_files=files, on_invalid=d["on_invalid"], revision=d["revision"],
                       max_rows=d["max_rows"])
    ctx["sources"].append(loaded.source)
    stage("load", clock, detail=f"{task.name} split {d['split']!r}", counts=loaded.counts)
    # each column in one piece of memory (D0 read from many files has many): see data.contiguous
    d0 = loaded.dataset = contiguous(loaded.dataset)
    d0, duplicates = handle_duplicates(d0, d["duplicates"])  # counted; set aside when the recipe says so
    if duplicates.set_aside is not None:
        loaded.dataset = d0
        ctx["set_aside"].append(("train", duplicates.set_aside))
    if len(d0) == 0:
        raise EmptyResultError(f"no usable rows in {task.name!r} split {d['split']!r} after loading "
                               f"({loaded.counts}); nothing was written")
    require_two_labels(d0, task, f"{task.name!r} split {d['split']!r}")
    # every split of the data files is released: the recipe's eval_splits, and any other given split
    # (copied unchanged like them, with a warning that the recipe does not name it)
    given = list(parse_data_files(files) or {})
    ignored = [s for s in given if s != d["split"] and s not in d["eval_splits"]]
    for split in ignored:
        log.warning("split %r of the data files is not among the recipe's eval_splits %s: it is copied unchanged "
                    "into every config", split, list(d["eval_splits"]))
    eval_splits = {}
    for split in list(d["eval_splits"]) + ignored:
        clock = time.perf_counter()
        ev = load_task(task, split, data_files=files, on_invalid=d["on_invalid"], revision=d["revision"])
        ctx["sources"].append(ev.source)
        ctx["set_aside"].append((f"eval:{split}", ev.set_aside))
        eval_splits[split] = ev.dataset
        stage(f"load {split}", clock, detail="copied unchanged into every config", counts=ev.counts)

    dg = None
    sources = []
    for step in recipe["new_rows"]:
        clock = time.perf_counter()
        params = {k: v for k, v in step.items() if k != "step"}
        sources.append(_step("source", step["step"])(task, params, ctx))  # source steps: (task, params, ctx)
        stage(f"new rows: {step['step']}", clock, counts={"rows": len(sources[-1])})
    if sources:
        dg = sources[0] if len(sources) == 1 else datasets.concatenate_datasets(sources)
    del sources  # D_G is made contiguous below: its pieces are not kept beside it
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # under `accelerate launch` the new-row steps shard their work over the ranks; the rest
        # (features, filtering, writing the release) runs once, on the main process
        from accelerate import PartialState
        state = PartialState()
        state.wait_for_everyone()
        if not state.is_main_process:
            return BuildResult(Path(out_dir), {}, {"rank": state.process_index})

    # features of D0 and D_G over one vocabulary, a chunk of rows at a time; the hypothesis-only
    # model is fitted on D0 alone (out of fold) and predicts D_G, so Z(D0) depends on D0 alone
    feat_cfg = recipe["features"]
    if dg is not None and dg.features != d0.features:
        dg = dg.cast(d0.features)
    if dg is not None:
        dg = contiguous(dg)
    clock = time.perf_counter()
    counts = {"rows": len(d0) + (len(dg) if dg is not None else 0)}
    if feat_cfg["storage"] == "columns":
        # every row's feature strings as columns, in memory (the reference for the chunked path)
        d0, dg, hyp = add_features_pair(d0, dg, task, hypothesis_only=feat_cfg["hypothesis_only"],
                                        folds=feat_cfg["folds"], seed=seed_, progress=progress)
        matrices, by_part = None, {}
    elif feat_cfg["storage"] == "chunked":
        feats = featurize_build(d0, dg, task, hypothesis_only=feat_cfg["hypothesis_only"], folds=feat_cfg["folds"],
                                seed=seed_, chunk_rows=int(feat_cfg["chunk_rows"]), num_proc=feat_cfg["num_proc"],
                                n_jobs=feat_cfg["n_jobs"], progress=progress)
        hyp, matrices, by_part = feats.hypothesis_only, (feats.d0, feats.dg), feats.seconds
    else:
        raise ConfigError(f"features.storage must be 'chunked' or 'columns', not {feat_cfg['storage']!r}")
    return_free_memory()  # the feature stage's temporaries, before the walks fork (see processes.py)
    if hyp:
        counts["hypothesis_only_accuracy"] = round(hyp.accuracy, 4)
    stage("features", clock, detail=", ".join(task.features), counts=counts,
          **({"seconds_by_part": by_part} if timings and by_part else {}))
    labels0 = labels_of(d0)

    def parts(kept0=None, kept_g=None, all0=False):
        """The rows of a config as (matrix, labels, rows) parts, for its z-statistics (chunked storage)."""
        if matrices is None:
            return None
        out = [(matrices[0], labels0, None if all0 else kept0)] if all0 or kept0 is not None else []
        if kept_g is not None:
            out.append((matrices[1], labels_of(dg), kept_g))
        return out

    zc = recipe["z_filter"]
    wanted = None if recipe["configs"] == "auto" else [c for c in recipe["configs"] if c in Z_CONFIGS]
    z_seconds: dict[str, float] = {}
    results = compose(d0, dg, task, top_k=zc["top_k"], batch_size=zc["batch_size"], seed=seed_,
                      p0=zc["p0"], configs=wanted, progress=progress, features=matrices,
                      seconds=z_seconds, num_proc=zc["num_proc"]) if wanted != [] else {}
    return_free_memory()
    configs: list[ConfigData] = []
    if "z_filtered" in results and (wanted is None or "z_filtered" in wanted):
        r = results["z_filtered"]
        configs.append(ConfigData("z_filtered", {"train": r.kept, **eval_splits}, r.rejected,
                                  features=parts(kept0=r.outcome.kept)))
        stages.append({"stage": "z_filtered = Z(D0)", "detail": f"top_k={zc['top_k']}, batch_size={zc['batch_size']}",
                       "counts": r.counts})
    if "z_aug" in results:
        r = results["z_aug"]
        configs.append(ConfigData("z_aug", {"train": r.kept, **eval_splits}, r.rejected,
                                  features=parts(all0=True, kept_g=r.outcome.kept)))
        stages.append({"stage": "z_aug = Z(D_G | D0)", "counts": r.counts})
    if "par_z_new" in results:
        r, z0 = results["par_z_new"], results["z_filtered"]
        train = datasets.concatenate_datasets([z0.kept, r.kept])
        rejected = datasets.concatenate_datasets([z0.rejected, r.rejected])
        configs.append(ConfigData("par_z", {"train": train, **eval_splits}, rejected,
                                  features=parts(kept0=z0.outcome.kept, kept_g=r.outcome.kept)))
        stages.append({"stage": "par_z = Z(D0) ∪ Z(D_G)", "counts": {"Z(D0)": len(z0.kept), "Z(D_G)": len(r.kept),
                                                                     "output": len(train)}})
    if "seq_z" in results:
        r, z0 = results["seq_z"], results["z_filtered"]
        # its dropped rows: the original rows Z(D0) rejected, then the new rows rejected given Z(D0)
        rejected = datasets.concatenate_datasets([z0.rejected, r.rejected])
        configs.append(ConfigData("seq_z", {"train": r.kept, **eval_splits}, rejected,
                                  features=parts(kept0=z0.outcome.kept, kept_g=r.outcome.kept)))
        stages.append({"stage": "seq_z = Z(D_G | Z(D0))", "counts": r.counts})
    if timings:
        by_config = {"z_filtered": "z_filtered", "z_aug": "z_aug", "par_z_new": "par_z", "seq_z": "seq_z"}
        for st in stages:
            for key, label in by_config.items():
                if st["stage"].startswith(label + " ") and key in z_seconds:
                    st["seconds"] = round(z_seconds[key], 3)
    d0_filters = None
    for step in recipe["filters"]:
        name = step.get("config", step["step"])
        if wanted is not None and recipe["configs"] != "auto" and name not in recipe["configs"]:
            continue
        params = {k: v for k, v in step.items() if k not in ("step", "config")}
        params.setdefault("seed", seed_)
        fn = _step("filter", step["step"])
        clock = time.perf_counter()
        if d0_filters is None:
            # filter steps (AFLite, PDD, IBADR) get D0 with its feature columns and return their rows with
            # them, so that the card shows their z-statistics; the chunked path keeps none, so they are
            # computed here for D0 alone (cached; the same features and hypothesis-only model as above)
            d0_filters = d0
            if not any(c.startswith(FEATURE_PREFIX) for c in d0.column_names):
                d0_filters, _ = add_features(d0, task, hypothesis_only=feat_cfg["hypothesis_only"],
                                             hypo_only_folds=feat_cfg["folds"], seed=seed_, progress=progress)
        accepts_ctx = len(inspect.signature(fn).parameters) >= 4
        kept, removed, report = fn(d0_filters, task, params, ctx) if accepts_ctx else fn(d0_filters, task, params)
        section = getattr(sys.modules[fn.__module__], f"render_{step['step']}_md", None)
        configs.append(ConfigData(name, {"train": kept, **eval_splits}, removed,
                                  card_section=section(report) if section else None))
        stage(f"{name}: {step['step']}", clock, counts={"kept": len(kept), "removed": len(removed)}, report=report)
    if recipe["configs"] != "auto" and "original" in recipe["configs"]:
        configs.insert(0, ConfigData("original", {"train": d0, **eval_splits}, features=parts(all0=True)))
    if not configs:
        raise ConfigError("the recipe produced no config; check `configs`")
    default = recipe["default_config"]
    if default == "auto":
        names = [c.name for c in configs]
        default = "seq_z" if "seq_z" in names else ("z_filtered" if "z_filtered" in names else names[0])
    # every row set aside on loading, from every input (D0, evaluation splits, new rows), is written
    set_aside, set_aside_counts = combine_set_aside([("train", loaded.set_aside)] + ctx["set_aside"])
    manifest = {
        "recipe": recipe,
        "seed": seed_,
        "versions": library_versions(),
        "inputs": ctx["sources"],
        "stages": stages,
        "features": {"extractors": dict(describe_extractors(task.features)),
                     "hypothesis_only": hyp.to_dict() if hyp else None},
        "set_aside": set_aside_counts,
        "duplicates": {"train": duplicates.record()},
    }
    meta = {"pretty_name": recipe["pretty_name"], "repo_id": recipe["repo_id"] or f"<org>/{recipe['name']}",
            "summary": recipe["summary"], "release_version": recipe["release_version"], "license": task.license,
            "history": recipe["history"] or [{"version": recipe["release_version"], "notes": "first release"}],
            "extra_citations": recipe["extra_citations"]}
    if efficacy is not None:
        from .efficacy import card_markdown

        meta["efficacy_md"] = card_markdown(efficacy, [c.name for c in configs], source=Path(efficacy).name,
                                            sizes={c.name: len(c.splits["train"]) for c in configs})
    out = write_release(out_dir, task, configs, default=default, manifest=manifest, meta=meta, original=d0,
                        overwrite=overwrite, set_aside=set_aside, original_features=parts(all0=True), timings=timings,
                        num_proc=zc["num_proc"])
    return BuildResult(out, {c.name: len(c.splits["train"]) for c in configs}, manifest)
