"""The plan of a comparison: a YAML file of rows, a model, a training recipe, seeds, challenge sets, how the
epoch is selected, and the comparisons, primary ones named in advance.

::

    task: snli
    model: sentence-transformers/all-MiniLM-L6-v2     # a folder or a Hub id
    seeds: [0, 1, 2, 3, 4]
    runs_dir: runs/compare          # models and the releases the plan builds (relative paths: to the plan's folder,
                                    # or to `paths_relative_to:`, a folder relative to the plan's)
    results_dir: results/compare    # one result file and one predictions file per (row, seed); the report beside it
    reference: original             # every row is compared with it (secondary comparisons)
    device: any                     # any (a GPU when one is visible), cpu or cuda (refuses to run without one)
    train: {learning_rate: 5.0e-5, batch_size: 32, max_length: 128, epochs: 3, warmup_ratio: 0.1, threads: 2}
    select_on: {set: snli_dev, rows: 2000, seed: 0}   # the best epoch on 2,000 rows of snli_dev, which is then
                                                      # scored without them
    evaluate:
      sets: [snli_dev, snli_test_hard, hans]          # registered sets, spec files, or inline specs (a mapping)
      max_length: 128
      batch_size: 64
    rows:
      - {name: original, data: {files: [data/snli/train.parquet]}}
      - name: z_filtered
        data: {release_dir: out/snli, config: z_filtered}
        compare_with: [{row: random_control, why: "same size: debiased data or only less data?"}]
      - {name: random_control, data: {random_subset_of: original, size_of: z_filtered, seed: unit}}
      - {name: original_poe, data: {files: [data/snli/train.parquet]}, poe: {preset: snli, bias_model: joint}}
    primary:                        # named before the run; Holm's correction runs over these (comparison x set)
      - {row: z_filtered, against: random_control, sets: [snli_test_hard, hans]}
    correction: holm                # or bonferroni, or bh (Benjamini-Hochberg)
    statistics: {level: 0.95}       # the intervals' level (a seed-row t interval: closed form, no replicates)

Row data (``data:``): ``files`` (parquet/csv/jsonl of the task), ``split: train`` (the task's own source),
``release_dir`` + ``config`` (a release folder), ``release`` + ``config`` (a release of ``releases:`` that the
plan builds with ``debiased-nli build``), or ``random_subset_of`` + ``size_of`` + ``seed`` (an integer: one
subset; ``unit``: drawn anew for each seed). ``poe``: product of experts (``preset`` of Wu et al.'s Table 10, or
``beta`` and ``gamma``; ``bias_model``). ``hold: reason`` keeps a row pending. ``extends: other.yaml`` starts
from another plan (``train``, ``evaluate`` and ``releases`` merged key by key).

Legacy epoch selection (plans written before ``select_on``): ``train.dev_files`` + ``train.max_dev_rows``, a
seeded sample of the files; the report says when those rows are also scored.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from ...data.tasks import get_task
from ...utils.errors import ConfigError
from ...utils.paths import check_name

DEVICES = ("any", "cpu", "cuda")
CORRECTIONS = ("holm", "bonferroni", "bh")
_TOP_KEYS = {"task", "model", "model_name", "seeds", "runs_dir", "results_dir", "reference", "device", "train",
             "select_on", "evaluate", "releases", "rows", "primary", "correction", "statistics", "bootstrap", "extends",
             "replicates", "note", "commands", "lock_budget_minutes", "title", "intro", "paths_relative_to"}
_ROW_KEYS = {"name", "description", "data", "poe", "compare_with", "hold"}
MAX_EXTENDS = 16
SEED_LIMIT = 2 ** 32  # numpy's and torch's seeds: 0 .. 2**32 - 1


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON so that a reader never sees a partial file (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def report_outputs(stem: Path, intervals: Path):
    """The files ``compare report`` writes at ``stem`` (.md, .json, .png and the forest ``intervals``), as
    :class:`~debiased_nli.utils.outputs.OwnFiles`: a file there that this tool did not write (a ``results.md`` of
    the user's) is refused before the bootstrap runs, and each is written whole or not at all. A report written
    before the markers is recognised by its JSON (the report's schema), and replaced."""
    from ...utils.outputs import OwnFiles, json_of
    from ...release.efficacy import TABLE_SCHEMAS

    def legacy(path: Path) -> bool:
        table = json_of(stem.with_suffix(".json"))
        return isinstance(table, dict) and table.get("schema") in TABLE_SCHEMAS

    return OwnFiles([stem.with_suffix(".md"), stem.with_suffix(".json"), stem.with_suffix(".png"), intervals],
                    what=f"compare report {stem}", legacy=legacy)


def _expand(value: "str | os.PathLike", base: Path) -> Path:
    p = Path(os.path.expanduser(str(value)))
    return p if p.is_absolute() else (base / p).resolve()


def compare_with(row: dict) -> list[dict]:
    """A row's ``compare_with:`` as a list of ``{row, why}``: the rows it is compared with besides the reference
    (e.g. z_filtered with the random subset of its size: debiased data, or only less data?)."""
    raw = row.get("compare_with") or []
    items = raw if isinstance(raw, list) else [raw]
    return [{"row": c, "why": ""} if isinstance(c, str) else {"row": c["row"], "why": c.get("why", "")} for c in items]


@dataclasses.dataclass
class Plan:
    path: Path
    raw: dict
    base: Path                # relative paths of the plan are relative to this folder
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
    spec: Any = None          # the task's TaskSpec, resolved once when the plan is read (its `task` names it)

    # -- paths
    def path_of(self, value: "str | os.PathLike") -> Path:
        return _expand(value, self.base)

    def show(self, p: "str | os.PathLike") -> str:
        """A path as the reports write it: relative to the plan's base folder, ``../shared/...`` for the shared
        folder beside it, else as it is."""
        p = Path(p)
        for folder, prefix in ((self.base, ""), ((self.base.parent / "shared").resolve(), "../shared/")):
            try:
                return prefix + str(p.relative_to(folder))
            except ValueError:
                continue
        return str(p)

    def row(self, name: str) -> dict:
        for r in self.rows:
            if r["name"] == name:
                return r
        raise ConfigError(f"{self.path}: no row named {name!r}; rows: {', '.join(r['name'] for r in self.rows)}")

    def unit_file(self, row: str, seed: int) -> Path:
        return self.results_dir / f"{row}-s{seed}.json"

    def predictions_file(self, row: str, seed: int) -> Path:
        return self.results_dir / "predictions" / f"{row}-s{seed}.npz"

    def model_dir(self, row: str, seed: int) -> Path:
        return self.runs_dir / "models" / f"{row}-s{seed}"

    def release_dir(self, name: str) -> Path:
        return self.runs_dir / "releases" / name

    # -- settings
    @property
    def device(self) -> str:
        return str(self.raw.get("device", "any"))

    @property
    def select_on(self) -> dict | None:
        return self.raw.get("select_on")

    @property
    def correction(self) -> str:
        return str(self.raw.get("correction", "holm"))

    @property
    def statistics(self) -> dict:
        """``{"level"}`` of the intervals: ``statistics: {level: L}`` (default 0.95). A plan written for the bootstrap
        may give it as ``bootstrap: {level: L}``; its ``replicates`` and ``seed`` are no longer used (the interval is
        in closed form) and are returned as ``ignored`` for the report to say so."""
        from ..significance import DEFAULT_LEVEL

        given = dict(self.raw.get("statistics") or {})
        legacy = dict(self.raw.get("bootstrap") or {})
        unknown = set(given) - {"level"}
        if unknown:
            raise ConfigError(f"{self.path}: statistics has unknown key(s) {sorted(unknown)}; known: level")
        level = given.get("level", legacy.get("level", DEFAULT_LEVEL))
        if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
            raise ConfigError(f"{self.path}: statistics.level is {level!r}, not a number in (0, 1)")
        ignored = {k: v for k, v in legacy.items() if k != "level"}
        return {"level": float(level), **({"ignored": {"bootstrap": ignored}} if ignored else {})}

    @property
    def model_name(self) -> str:
        return str(self.raw.get("model_name") or Path(self.model).name)

    @property
    def data_root(self) -> str | None:
        return str(self.path_of(self.evaluate["data_root"])) if self.evaluate.get("data_root") else None

    def set_specs(self) -> list:
        """The challenge sets to score, in order (:class:`debiased_nli.models.challenge.ChallengeSet`): a
        registered name, a spec file, or an inline spec whose ``local`` file is relative to the plan's folder."""
        from ...models.challenge import ChallengeSet, get_set

        out = []
        for item in self.evaluate["sets"]:
            if isinstance(item, dict):
                raw = dict(item)
                if raw.get("local"):
                    raw["local"] = str(self.path_of(raw["local"]))
                out.append(ChallengeSet.from_dict(raw, source=f"{self.path} (evaluate.sets)"))
            elif str(item).endswith((".yaml", ".yml")):
                out.append(get_set(str(self.path_of(item))))
            else:
                out.append(get_set(str(item)))
        return out

    def selection_spec(self):
        """The challenge set ``select_on: {set: ...}`` holds out rows of (a scored set, or a registered one)."""
        from ...models.challenge import get_set

        name = (self.select_on or {}).get("set")
        if name is None:
            return None
        return next((s for s in self.set_specs() if s.name == name), None) or get_set(name)

    @property
    def set_names(self) -> list[str]:
        return [s.name for s in self.set_specs()]

    def comparisons(self) -> list[dict]:
        """Every declared comparison, in order: each row against the reference, then the rows' ``compare_with``,
        then primary ones not declared otherwise. ``{row, against, why, primary, sets}``; ``sets``: the sets of a
        primary comparison (None: all), whose (comparison, set) pairs form the family the correction runs over."""
        primary = {(p["row"], p["against"]): p for p in self.raw.get("primary") or []}
        out, seen = [], set()

        def add(a: str, b: str, why: str, kind: str) -> None:
            if (a, b) in seen:
                return
            seen.add((a, b))
            p = primary.get((a, b))
            out.append({"row": a, "against": b, "why": why or (p or {}).get("why", ""), "kind": kind,
                        "primary": p is not None, "sets": list(p["sets"]) if p and p.get("sets") else None})

        for r in self.rows:
            if r["name"] != self.reference:
                add(r["name"], self.reference, "", "reference")
        for r in self.rows:
            for c in compare_with(r):
                add(r["name"], c["row"], c["why"], "compare_with")
        for (a, b), p in primary.items():
            add(a, b, p.get("why", ""), "primary")
        return out


def read_plan(path: Path, base: Path | None = None, _seen: tuple = ()) -> dict:
    """The plan's YAML; ``extends: other.yaml`` (relative to this file) starts from that plan: a key given
    here replaces the other's, except the mappings ``train``, ``evaluate`` and ``releases``, which are
    updated key by key (so a GPU plan restates only what differs from the CPU one)."""
    from ...utils.safe_yaml import read_yaml_input

    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"{path}: `extends` loops: {' -> '.join(map(str, (*_seen, path)))}")
    if len(_seen) >= MAX_EXTENDS:
        raise ConfigError(f"{path}: `extends` goes {len(_seen)} plans deep; at most {MAX_EXTENDS}")
    if not path.exists() and not path.is_symlink():
        raise ConfigError(f"plan {path} does not exist")
    # the recipe reader's bounds: a regular file (no FIFO, no device), at most 1 MB, aliases expanded at most
    # 100,000 values, UTF-8
    raw = read_yaml_input(path, "plan") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a plan is a YAML mapping (task, model, seeds, train, evaluate, rows, ...)")
    parent = raw.pop("extends", None)
    if not parent:
        return raw
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: extends must be the path of another plan, got {parent!r:.80}")
    parent_path = _expand(parent, path.parent)
    if not parent_path.exists() and not parent_path.is_symlink():
        raise ConfigError(f"{path}: extends {parent!r}, which does not exist ({parent_path})")
    merged = read_plan(parent_path, base, (*_seen, path))
    for key, value in raw.items():
        if key in ("train", "evaluate", "releases") and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    shown = parent_path
    for folder in (base, path.parent):
        if folder is not None:
            try:
                shown = parent_path.relative_to(folder.resolve())
                break
            except ValueError:
                continue
    merged["extends"] = str(shown)
    return merged


def load_plan(path: "str | os.PathLike", *, base: "str | os.PathLike | None" = None, runs_dir: str | None = None,
              results_dir: str | None = None) -> Plan:
    """Read and check a plan. ``base``: the folder its relative paths are relative to (default: the plan's
    ``paths_relative_to``, relative to the plan's folder, else the plan's folder). ``runs_dir`` / ``results_dir``
    override the plan's."""
    path = Path(path)
    raw0 = read_plan(path)
    base_dir = (Path(base).resolve() if base is not None
                else _expand(raw0.get("paths_relative_to", "."), path.resolve().parent))
    raw = read_plan(path, base_dir)
    where = str(path)
    _check_keys(raw, where)
    names = _check_rows(raw, where)
    reference = raw.get("reference", names[0])
    if reference not in names:
        raise ConfigError(f"{where}: reference {reference!r} is not a row; rows: {', '.join(names)}")
    _check_primary(raw, names, where)
    sel = _check_select_on(raw, where)
    runs = runs_dir or raw.get("runs_dir", "runs/compare")
    model = str(raw["model"])
    model_path = _expand(model, base_dir)
    if model.startswith((".", "/", "~")) or model_path.exists():
        model = str(model_path)
    plan = Plan(path=path, raw=raw, base=base_dir, task=raw["task"], model=model, seeds=list(raw["seeds"]),
                runs_dir=_expand(runs, base_dir),
                results_dir=_expand(results_dir or raw.get("results_dir", "results/compare"), base_dir),
                reference=reference, train=dict(raw["train"]), evaluate=dict(raw["evaluate"]),
                releases=dict(raw.get("releases") or {}), rows=list(raw["rows"]), spec=get_task(raw["task"]))
    _check_sets(plan, raw, sel, where)
    plan.statistics  # noqa: B018 - checks the level before any work
    return plan


def _check_keys(raw: dict, where: str) -> None:
    """Known top-level keys, a known device, the required keys, the seeds, the sets and the rows list."""
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        from ...utils.errors import did_you_mean

        first = sorted(unknown)[0]
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}.{did_you_mean(first, sorted(_TOP_KEYS))}")
    if raw.get("device", "any") not in DEVICES:
        raise ConfigError(f"{where}: device {raw['device']!r} is not one of {', '.join(DEVICES)}")
    for key in ("task", "model", "seeds", "train", "evaluate", "rows"):
        if key not in raw:
            raise ConfigError(f"{where}: the plan needs {key!r}")
    from ...utils.errors import excerpt

    if not isinstance(raw["seeds"], list) or not raw["seeds"] or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < SEED_LIMIT for s in raw["seeds"]):
        raise ConfigError(f"{where}: seeds must be a list of integers from 0 to {SEED_LIMIT - 1} (what numpy and torch "
                          f"take), got {excerpt(raw['seeds'])}")
    if len(set(raw["seeds"])) != len(raw["seeds"]):
        raise ConfigError(f"{where}: seeds names a seed twice: {excerpt(raw['seeds'])}")
    for key in ("task", "model"):
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise ConfigError(f"{where}: {key} must be a string, got {excerpt(raw[key])}")
    if not isinstance(raw["train"], dict):
        raise ConfigError(f"{where}: train must be a mapping of training settings, got {excerpt(raw['train'])}")
    if not isinstance(raw["evaluate"], dict) or not raw["evaluate"].get("sets") \
            or not isinstance(raw["evaluate"]["sets"], list):
        raise ConfigError(f"{where}: evaluate needs `sets:` (a list of the challenge sets to score)")
    if not isinstance(raw["rows"], list) or not raw["rows"] or not all(isinstance(r, dict) for r in raw["rows"]):
        raise ConfigError(f"{where}: rows must be a non-empty list of mappings")
    for key in ("runs_dir", "results_dir", "paths_relative_to"):
        if key in raw and (not isinstance(raw[key], str) or not raw[key].strip()):
            raise ConfigError(f"{where}: {key} must be a non-empty path, got {excerpt(raw[key])}")
    releases = raw.get("releases") or {}
    if not isinstance(releases, dict):
        raise ConfigError(f"{where}: releases must map names to builds, got {excerpt(releases)}")
    for name in releases:
        check_name(name, f"{where}: release")
    _check_bootstrap(raw.get("bootstrap"), where)


def _check_bootstrap(b: Any, where: str) -> None:
    """``bootstrap: {replicates, seed, level}``: integers and a level the statistics can use."""
    if b is None:
        return
    if not isinstance(b, dict):
        raise ConfigError(f"{where}: bootstrap must be {{replicates, seed, level}}, got {b!r:.80}")
    checks = {"replicates": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1_000_000,
                             "an integer from 1 to 1,000,000"),
              "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < SEED_LIMIT,
                       f"an integer from 0 to {SEED_LIMIT - 1}"),
              "level": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1,
                        "a number strictly between 0 and 1")}
    for key, value in b.items():
        if key not in checks:
            raise ConfigError(f"{where}: bootstrap has an unknown key {key!r:.40}; known: {', '.join(checks)}")
        ok, says = checks[key]
        if not ok(value):
            raise ConfigError(f"{where}: bootstrap.{key} must be {says}, got {value!r:.60}")


def _check_rows(raw: dict, where: str) -> list[str]:
    """Each row named once (a name that is no path), with known keys, a ``data:`` mapping and comparisons with
    other rows of the plan. Returns the names."""
    names = [r.get("name") for r in raw["rows"]]
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{where}: every row needs a name, each once: {names}")
    for n in names:  # a row's name is the name of its result, predictions and model files
        check_name(n, f"{where}: row name")
    for r in raw["rows"]:
        extra = set(r) - _ROW_KEYS
        if extra:
            raise ConfigError(f"{where}: row {r['name']!r} has unknown key(s) {sorted(extra)}; known: {sorted(_ROW_KEYS)}")
        if not isinstance(r.get("data"), dict):
            raise ConfigError(f"{where}: row {r['name']!r} needs a `data:` mapping")
        for c in compare_with(r):
            if c["row"] not in names or c["row"] == r["name"]:
                raise ConfigError(f"{where}: row {r['name']!r} has compare_with {c['row']!r}, which is not another row "
                                  f"of the plan; rows: {', '.join(names)}")
    return names


def _check_primary(raw: dict, names: list[str], where: str) -> None:
    """The primary comparisons name two different rows; the correction is a known one."""
    for p in raw.get("primary") or []:
        if not isinstance(p, dict) or "row" not in p or "against" not in p:
            raise ConfigError(f"{where}: each primary comparison is {{row, against[, sets, why]}}, got {p!r}")
        for key in ("row", "against"):
            if p[key] not in names:
                raise ConfigError(f"{where}: primary comparison names {p[key]!r}, which is not a row; rows: "
                                  f"{', '.join(names)}")
        if p["row"] == p["against"]:
            raise ConfigError(f"{where}: primary comparison of {p['row']!r} with itself")
    if raw.get("correction", "holm") not in CORRECTIONS:
        raise ConfigError(f"{where}: correction {raw['correction']!r} is not one of {', '.join(CORRECTIONS)}")


def _check_select_on(raw: dict, where: str) -> dict | None:
    """``select_on``: a held-out part of a set, or a separate file; not with ``train.dev_files``."""
    sel = raw.get("select_on")
    if sel is not None:
        if not isinstance(sel, dict) or not isinstance(sel.get("rows"), int) or sel["rows"] < 1 \
                or ("set" in sel) == ("files" in sel):
            raise ConfigError(f"{where}: select_on is {{set: NAME, rows: N, seed: S}} (a held-out part of a set, which "
                              f"is then scored without those rows) or {{files: [...], rows: N, seed: S}} (a separate "
                              f"file), got {sel!r}")
        if raw["train"].get("dev_files") or raw["train"].get("max_dev_rows"):
            raise ConfigError(f"{where}: give select_on or train.dev_files / max_dev_rows, not both")
    return sel


def _check_sets(plan: "Plan", raw: dict, sel: dict | None, where: str) -> None:
    """No set scored twice; the primary comparisons' sets are scored; a selection set has the task's labels."""
    scored = plan.set_names
    if len(set(scored)) != len(scored):
        raise ConfigError(f"{where}: evaluate.sets names a set twice: {scored}")
    for p in raw.get("primary") or []:
        for s in p.get("sets") or []:
            if s not in scored:
                raise ConfigError(f"{where}: primary comparison {p['row']} vs {p['against']} names set {s!r}, which "
                                  f"is not scored (evaluate.sets: {', '.join(scored)})")
    if sel is not None and "set" in sel:
        spec = plan.selection_spec()  # a scored set, or a registered one (unknown: an error naming the sets)

        if tuple(spec.labels) != tuple(plan.spec.labels):
            raise ConfigError(f"{where}: select_on set {spec.name!r} has the labels {list(spec.labels)}, not the "
                              f"task's {list(plan.spec.labels)}: the epoch is selected on the task's labels")
