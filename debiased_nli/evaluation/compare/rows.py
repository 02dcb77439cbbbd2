"""A plan row's training data: a file, the task's own source, a release folder, a release the plan builds, or a
random control subset of another row of a named row's size (one draw, or a new draw per seed)."""
from __future__ import annotations

import dataclasses
import hashlib
import shlex
import time
from pathlib import Path
from typing import Any

from ...utils.errors import ConfigError
from .locking import heavy_lock, log
from .plan import Plan, write_json_atomic

BUILD_RECORD = "efficacy_build.json"


def build_record(folder: Path) -> Path:
    """Where the build record of the release ``folder`` is: beside it (``<name>.efficacy_build.json``), not in
    it, so that the release holds only its own files (``push`` uploads exactly those); a release built before
    has it inside."""
    beside = folder.with_name(f"{folder.name}.{BUILD_RECORD}")
    return folder / BUILD_RECORD if not beside.exists() and (folder / BUILD_RECORD).exists() else beside


class Pending(Exception):
    """A row whose training data does not exist yet; the message says why and what would make it."""


class NotBuilt(Pending):
    """A release of ``releases:`` whose inputs exist but which is not built yet (``run`` builds it)."""


@dataclasses.dataclass
class RowData:
    dataset: Any
    info: dict  # what the rows are and the command that made them


def split_file(item: str) -> tuple[str, str]:
    split, sep, path = item.partition("=")
    return (split, path) if sep else ("train", item)


def _git() -> str | None:
    from ...utils.provenance import git_hash

    return git_hash()


def release_inputs(plan: Plan, name: str) -> tuple[list[str], list[str]]:
    """(data_files, new_rows) of a release the plan builds; Pending when an input is not on disk."""
    import glob

    if name not in plan.releases:
        raise ConfigError(f"{plan.path}: unknown release {name!r}; releases: {', '.join(plan.releases) or 'none'}")
    spec = plan.releases[name]
    files = []
    for item in spec.get("data_files") or []:
        split, p = split_file(item)
        if not plan.path_of(p).exists():
            raise Pending(f"release {name!r}: input {plan.path_of(p)} does not exist")
        files.append(f"{split}={plan.path_of(p)}")
    new_rows = []
    for pattern in spec.get("new_rows") or []:
        found = sorted(glob.glob(str(plan.path_of(pattern))))
        if not found:
            raise Pending(f"release {name!r}: the new rows {plan.path_of(pattern)} are not on disk"
                          + (f" (make them: {spec['how_to_get']})" if spec.get("how_to_get") else ""))
        new_rows += found
    return files, new_rows


def build_command(plan: Plan, name: str) -> list[str]:
    files, new_rows = release_inputs(plan, name)
    files = [f"{s}={plan.show(p)}" for s, p in map(split_file, files)]
    cmd = ["debiased-nli", "build", plan.show(plan.path_of(plan.releases[name]["recipe"])), "--data-files", *files]
    if new_rows:
        cmd += ["--new-rows", *map(plan.show, new_rows)]
    return cmd + ["--out", plan.show(plan.release_dir(name))]


def build_release(plan: Plan, name: str, lock: str | None, progress: bool = True) -> Path:
    """Build one of the plan's releases (``debiased-nli build``) if it is not there; records the commit."""
    from ...release.recipe import build

    out = plan.release_dir(name)
    if build_record(out).exists():
        return out
    cmd = build_command(plan, name)
    files, new_rows = release_inputs(plan, name)
    with heavy_lock(lock, f"build release {name}"):
        if build_record(out).exists():
            return out
        log("+ " + shlex.join(cmd))
        t0, c0 = time.perf_counter(), time.process_time()
        res = build(plan.path_of(plan.releases[name]["recipe"]), out, data_files=files, new_rows_files=new_rows or None,
                    overwrite=True, progress=progress)
        write_json_atomic(build_record(out), {
            "command": shlex.join(cmd), "git": _git(), "configs": res.configs,
            "seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(time.process_time() - c0, 1)})
    return out


def _load_release(plan: Plan, folder: Path, config: str):
    from ...models.training import load_training_split

    return load_training_split(plan.spec, release=str(folder), config=config)


def per_unit_subset(row: dict) -> bool:
    """A random control drawn anew for each seed (``seed: unit``): its seeds vary the subset as well as
    the model, so its spread includes which rows a random subset happens to hold."""
    return "random_subset_of" in row["data"] and row["data"].get("seed") == "unit"


def _release_manifest(folder: Path) -> tuple[dict, str | None]:
    if not (folder / "manifest.json").exists():
        return {}, None
    from ...utils.paths import parse_json

    text = (folder / "manifest.json").read_bytes()
    try:
        manifest = parse_json(text.decode("utf-8"), str(folder / "manifest.json"))
    except UnicodeDecodeError:
        raise ConfigError(f"{folder / 'manifest.json'} is not UTF-8 text; not a release's manifest") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{folder / 'manifest.json'}: a JSON {type(manifest).__name__}, not a release's manifest")
    return manifest, hashlib.sha256(text).hexdigest()


def resolve_row(plan: Plan, row: dict, *, build: bool = False, lock: str | None = None,
                _cache: dict | None = None, unit_seed: int | None = None) -> RowData:
    """The row's training rows, or :class:`Pending`. With ``build``, releases of ``releases:`` are built.
    ``unit_seed``: the seed of the unit, which draws the subset of a ``seed: unit`` random control."""
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
        ds, info = _files_rows(plan, d)
    elif "split" in d:
        ds, info = _split_rows(plan, d)
    elif "release" in d:
        ds, info = _release_rows(plan, d, build, lock)
    elif "release_dir" in d:
        ds, info = _release_dir_rows(plan, d)
    elif "random_subset_of" in d:
        if not per_unit and not isinstance(d.get("seed", 0), int):
            raise ConfigError(f"{plan.path}: row {row['name']!r}: random subset seed {d['seed']!r} is neither an "
                              f"integer nor 'unit' (the unit's seed)")
        base = resolve_row(plan, plan.row(d["random_subset_of"]), build=build, lock=lock, _cache=cache,
                           unit_seed=unit_seed)
        size = resolve_row(plan, plan.row(d["size_of"]), build=build, lock=lock, _cache=cache, unit_seed=unit_seed)
        ds, info = _random_subset_rows(d, base, size, int(unit_seed) if per_unit else int(d.get("seed", 0)), per_unit)
    else:
        raise ConfigError(f"{plan.path}: row {row['name']!r}: data needs files, split, release, release_dir or "
                          f"random_subset_of")
    info["rows"] = len(ds)
    info["fingerprint"] = ds._fingerprint
    cache[key] = RowData(ds, info)
    return cache[key]


def _files_rows(plan: Plan, d: dict) -> tuple[Any, dict]:
    """A row of local files (``data: {files: [...]}``), as they are."""
    from ...models.training import load_training_split

    paths = [plan.path_of(p) for p in d["files"]]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise Pending(f"training file(s) not on disk: {missing}")
    ds = load_training_split(plan.spec, data_files={"train": [str(p) for p in paths]})
    return ds, {"kind": "files", "files": [plan.show(p) for p in paths], "command": "the file(s) as they are: "
                + " ".join(plan.show(p) for p in paths)}


def _split_rows(plan: Plan, d: dict) -> tuple[Any, dict]:
    """A split of the task from its own source (``data: {split: train}``)."""
    from ...models.training import load_training_split

    task = plan.spec
    ds = load_training_split(task, split=str(d["split"]))
    return ds, {"kind": "task", "split": str(d["split"]),
                "command": f"the {d['split']!r} split of the task {task.name!r} from its own source"}


def _release_rows(plan: Plan, d: dict, build: bool, lock: str | None) -> tuple[Any, dict]:
    """A config of one of the plan's releases (``data: {release: NAME, config: ...}``), built with ``build``."""
    from ...utils.paths import read_json

    name = d["release"]
    folder = plan.release_dir(name)
    if not build_record(folder).exists():
        cmd = build_command(plan, name)  # Pending when an input is missing
        if not build:
            raise NotBuilt(f"release {name!r} is not built yet; `run` builds it: {shlex.join(cmd)}")
        build_release(plan, name, lock)
    rec = read_json(build_record(folder), "build record", kind=dict)
    if d["config"] not in rec["configs"]:
        raise Pending(f"release {name!r} has no config {d['config']!r} (it has {sorted(rec['configs'])})")
    ds = _load_release(plan, folder, d["config"])
    manifest, digest = _release_manifest(folder)
    return ds, {"kind": "release", "release": plan.show(folder), "config": d["config"], "command": rec["command"],
                "built_at_commit": rec["git"], "release_manifest_sha256": digest,
                "release_version": (manifest.get("meta") or {}).get("release_version")}


def _release_dir_rows(plan: Plan, d: dict) -> tuple[Any, dict]:
    """A config of a release folder made elsewhere (``data: {release_dir: PATH, config: ...}``)."""
    folder = plan.path_of(d["release_dir"])
    owner = f" ({d['owner']})" if d.get("owner") else ""
    if not folder.exists():
        raise Pending(f"release {folder} does not exist yet{owner}")
    configs = sorted(p.name for p in (folder / "data").iterdir() if p.is_dir()) if (folder / "data").is_dir() else []
    if d["config"] not in configs:
        raise Pending(f"release {folder} has no config {d['config']!r} (it has {configs}){owner}")
    manifest, digest = _release_manifest(folder)
    ds = _load_release(plan, folder, d["config"])
    return ds, {"kind": "release_dir", "release": plan.show(folder), "config": d["config"],
                "command": d.get("command") or manifest.get("command")
                or f"the release folder {plan.show(folder)} (its manifest.json records the recipe and every stage)",
                "release_manifest_sha256": digest, "release_git": manifest.get("git"),
                "release_stages": [{"stage": st.get("stage"), "counts": st.get("counts")}
                                   for st in manifest.get("stages", [])],
                "release_versions": manifest.get("versions")}


def _random_subset_rows(d: dict, base: RowData, size: RowData, seed: int, per_unit: bool) -> tuple[Any, dict]:
    """A seeded random subset of the row ``base`` as large as the row ``size`` (``data: {random_subset_of: ...,
    size_of: ...}``)."""
    n = len(size.dataset)
    ds = base.dataset.shuffle(seed=seed).select(range(min(n, len(base.dataset))))
    return ds, {"kind": "random_subset", "of": d["random_subset_of"], "size_of": d["size_of"], "seed": seed,
                "subset_seed_is_unit_seed": per_unit,
                "base": {k: v for k, v in base.info.items() if k in ("files", "release", "config", "split")},
                "command": f"{d['random_subset_of']}.shuffle(seed={seed}).select(range(len({d['size_of']}) = {n})); "
                           f"{d['random_subset_of']}: {base.info['command']}; {d['size_of']}: {size.info['command']}"}


def poe_settings(row: dict) -> dict | None:
    """``{beta, gamma, bias_model}`` of a PoE row: explicit values, or a preset of Wu et al.'s Table 10
    (:func:`debiased_nli.models.training.poe_preset`, with the table's words as its source)."""
    poe = row.get("poe")
    if not poe:
        return None
    out = {"bias_model": str(poe.get("bias_model", "tfidf"))}
    if "preset" in poe:
        from ...models.training import poe_preset

        beta, gamma, source = poe_preset(poe["preset"])
        return out | {"beta": float(beta), "gamma": float(gamma), "preset": poe["preset"], "source": source}
    return out | {"beta": float(poe["beta"]), "gamma": float(poe["gamma"])}
