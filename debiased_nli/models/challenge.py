"""The challenge suite: one small YAML spec per challenge set, named suites, and loading.

Specs live in ``evaluation/sets/*.yaml`` and suites in ``evaluation/suites/*.yaml`` at the repository
root, shipped inside the wheel (``$DEBIASED_NLI_EVALUATION`` overrides the folder). A spec says where the set is on the Hub (for
users) and where it is under the local data root (``local:``, relative to ``--data-root`` /
``$DEBIASED_NLI_DATA_ROOT``, default ``../shared/data`` next to the repository), its columns, its own
gold labels (``labels`` + ``label_values``), the task whose label names the model must have
(``task``), how the model's labels map onto the set's (``prediction_map``; a model label mapped to
``null`` is left out of the argmax, e.g. NOT ENOUGH INFO on the 2-way FEVER-Symmetric), a row filter,
the breakdown columns, the expected number of rows, and ``cluster``: the column whose values group rows that
were not sampled independently (HANS: 30 subcases x 1,000 instances of a few templates each), over which a
comparison's statistics take the rows' variance (:func:`debiased_nli.evaluation.significance.seed_row_interval`).

``hub.local_copy: true`` says the local file holds exactly the rows of the Hub split, so that scores on
it may be published under the Hub id (``evaluate --push-to``); a stand-in (the regenerated HANS, the
quote-stripped MNLI dev-mismatched) has ``false``. ``derived_from: {path, name, split}`` names the Hub split a set's
rows were taken from when the set itself is not on the Hub (SNLI-hard: a subset of SNLI's test split); a score is
published under that id only as the set's own task, never as the split's (:func:`hub_reference`).

HANS (McCoy et al. 2019) is 2-way: a 3-way prediction is mapped entailment -> entailment, neutral and
contradiction -> non-entailment after the argmax, as the HANS authors do.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..data.tasks import get_task
from ..utils.errors import ConfigError, did_you_mean, excerpt

_SET_KEYS = {"name", "version", "description", "task", "labels", "label_values", "prediction_map", "columns",
             "local", "hub", "filter", "breakdowns", "expected_rows", "citation", "license", "how_to_get",
             "unlabeled_values", "cluster", "derived_from"}
# hub.local_copy: the local file holds exactly the rows of the Hub split (after dropping unlabeled rows);
# only then may scores on the local file be published under the Hub id (model-index)
_HUB_KEYS = {"path", "name", "split", "columns", "label_values", "local_copy"}
METRIC_NAME = "challenge_accuracy"


def evaluation_dir() -> Path:
    """``evaluation/`` (``$DEBIASED_NLI_EVALUATION``, the copy inside an installed wheel, or the
    repository root of a checkout: :func:`debiased_nli.utils.resources.data_folder`)."""
    from ..utils.resources import data_folder

    return data_folder("evaluation")


def default_data_root() -> Path:
    """``$DEBIASED_NLI_DATA_ROOT``, else ``../shared/data`` next to the repository."""
    from ..utils.environment import setting

    env = setting("DEBIASED_NLI_DATA_ROOT", None)  # set but empty: an error, not the current folder
    if env is not None:
        return env
    import debiased_nli

    return Path(debiased_nli.__file__).resolve().parents[2] / "shared" / "data"


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """A breakdown: its name and the column(s) whose values (joined by '/') form the group key."""

    name: str
    columns: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ChallengeSet:
    name: str
    task: str
    labels: tuple[str, ...]
    label_values: Mapping[Any, str]
    prediction_map: Mapping[str, str | None]
    columns: Mapping[str, str]
    local: str | None
    hub: Mapping[str, Any] | None
    filter: Mapping[str, Any]
    breakdowns: tuple[Breakdown, ...]
    expected_rows: int | None
    unlabeled_values: tuple[Any, ...] = ()
    cluster: str | None = None
    derived_from: Mapping[str, Any] | None = None  # the Hub split the rows were taken from (not the set itself)
    version: int = 1
    description: str = ""
    citation: str = ""
    license: str = "unknown"
    how_to_get: str = ""
    source_path: str = ""

    @property
    def model_labels(self) -> tuple[str, ...]:
        """The label names (in order) that a model scored on this set must output."""
        return get_task(self.task).labels

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "<dict>") -> "ChallengeSet":
        unknown = set(raw) - _SET_KEYS
        if unknown:
            raise ConfigError(f"{source}: unknown challenge-set key(s) {sorted(unknown)}; known: {sorted(_SET_KEYS)}")
        for key in ("name", "task", "labels"):
            if key not in raw:
                raise ConfigError(f"{source}: a challenge-set spec needs {key!r}")
        task = get_task(raw["task"])
        labels = tuple(str(x) for x in raw["labels"])
        pmap = dict(raw.get("prediction_map") or {l: l for l in task.labels})
        for model_label in task.labels:
            if model_label not in pmap:
                raise ConfigError(f"{source}: prediction_map has no entry for the model label {model_label!r}")
        for model_label, set_label in pmap.items():
            if set_label is not None and set_label not in labels:
                raise ConfigError(f"{source}: prediction_map sends {model_label!r} to {set_label!r}, which is not "
                                  f"one of the set's labels {list(labels)}")
        if raw.get("hub") and set(raw["hub"]) - _HUB_KEYS:
            raise ConfigError(f"{source}: unknown hub key(s) {sorted(set(raw['hub']) - _HUB_KEYS)}")
        derived = raw.get("derived_from")
        if derived is not None and (not isinstance(derived, Mapping) or not isinstance(derived.get("path"), str)
                                    or set(derived) - {"path", "name", "split"}):
            raise ConfigError(f"{source}: derived_from is {{path: ORG/NAME, name: CONFIG, split: SPLIT}} (the Hub "
                              f"split the set's rows were taken from), got {excerpt(derived)}")
        cluster = raw.get("cluster")
        if cluster is not None and (not isinstance(cluster, str) or not cluster):
            raise ConfigError(f"{source}: cluster is the name of a column (e.g. subcase), got {cluster!r}")
        breakdowns = []
        for b in raw.get("breakdowns") or []:
            if isinstance(b, str):
                breakdowns.append(Breakdown(b, (b,)))
            else:
                cols = tuple(b["columns"])
                breakdowns.append(Breakdown(str(b.get("name") or "/".join(cols)), cols))
        return cls(name=str(raw["name"]), task=task.name, labels=labels,
                   label_values=dict(raw.get("label_values") or {}), prediction_map=pmap,
                   columns=dict(raw.get("columns") or {"premise": "premise", "hypothesis": "hypothesis",
                                                       "label": "label"}),
                   local=raw.get("local"), hub=raw.get("hub"), filter=dict(raw.get("filter") or {}),
                   breakdowns=tuple(breakdowns), expected_rows=raw.get("expected_rows"),
                   unlabeled_values=tuple(raw.get("unlabeled_values") or ()), cluster=cluster,
                   derived_from=dict(derived) if derived else None,
                   version=int(raw.get("version", 1)), description=raw.get("description", ""),
                   citation=raw.get("citation", ""), license=raw.get("license", "unknown"),
                   how_to_get=raw.get("how_to_get", ""), source_path=source)

    def label_lookup(self) -> dict[Any, int]:
        lookup: dict[Any, int] = {}
        for i, name in enumerate(self.labels):
            lookup[i] = lookup[str(i)] = lookup[name] = i
        for value, name in self.label_values.items():
            lookup[value] = lookup[str(value)] = self.labels.index(name)
        return lookup

    def local_path(self, data_root: "str | Path | None" = None) -> Path | None:
        if not self.local:
            return None
        return Path(data_root if data_root is not None else default_data_root()) / self.local

    def prediction_indices(self) -> tuple[list[int], list[int]]:
        """(model label indices that take part in the argmax, the set label each of them maps to)."""
        model_labels = self.model_labels
        kept = [i for i, l in enumerate(model_labels) if self.prediction_map[l] is not None]
        return kept, [self.labels.index(self.prediction_map[model_labels[i]]) for i in kept]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["breakdowns"] = [{"name": b.name, "columns": list(b.columns)} for b in self.breakdowns]
        d["labels"] = list(self.labels)
        return d


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    description: str
    sets: tuple[str, ...]


_SETS: dict[str, ChallengeSet] = {}
_SUITES: dict[str, Suite] = {}


def _load_registry() -> None:
    if _SETS:
        return
    root = evaluation_dir()
    if not (root / "sets").is_dir():
        raise ConfigError(f"the challenge-set folder {root / 'sets'} does not exist; set DEBIASED_NLI_EVALUATION "
                          f"to the evaluation/ folder of a debiased-nli checkout")
    for path in sorted((root / "sets").glob("*.yaml")):
        spec = ChallengeSet.from_dict(yaml.safe_load(path.read_text()), source=str(path))
        if spec.name in _SETS:
            raise ConfigError(f"{path}: challenge set {spec.name!r} is defined twice")
        _SETS[spec.name] = spec
    for path in sorted((root / "suites").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        suite = Suite(str(raw["name"]), raw.get("description", ""), tuple(raw["sets"]))
        for s in suite.sets:
            if s not in _SETS:
                raise ConfigError(f"{path}: suite {suite.name!r} names unknown set {s!r}.{did_you_mean(s, list(_SETS))}")
        _SUITES[suite.name] = suite


def list_sets() -> list[str]:
    _load_registry()
    return sorted(_SETS)


def list_suites() -> list[str]:
    _load_registry()
    return sorted(_SUITES)


def get_set(name: "str | ChallengeSet") -> ChallengeSet:
    """A registered challenge set by name, or a spec YAML by path."""
    if isinstance(name, ChallengeSet):
        return name
    _load_registry()
    if name in _SETS:
        return _SETS[name]
    if str(name).endswith((".yaml", ".yml")) and Path(name).exists():
        from ..utils.safe_yaml import read_yaml_input

        # a regular file (a FIFO or a device would block the read), UTF-8 YAML, bounded
        return ChallengeSet.from_dict(read_yaml_input(name, "challenge-set file"), source=str(name))
    raise ConfigError(f"unknown challenge set {excerpt(name)}.{did_you_mean(str(name), list(_SETS))} "
                      f"Registered sets: {', '.join(sorted(_SETS))}")


def get_suite(name: str) -> Suite:
    _load_registry()
    if name in _SUITES:
        return _SUITES[name]
    raise ConfigError(f"unknown suite {name!r}.{did_you_mean(name, list(_SUITES))} "
                      f"Suites: {', '.join(sorted(_SUITES))}; or name sets with --sets "
                      f"({', '.join(sorted(_SETS))})")


def resolve_sets(suite: str | None = None, sets: Sequence[str] | None = None) -> list[ChallengeSet]:
    """The sets of a suite and/or named sets, in order, without repeats."""
    names: list[str] = list(get_suite(suite).sets) if suite else []
    names += [s for s in (sets or []) if s not in names]
    if not names:
        raise ConfigError(f"name a suite (--suite {'/'.join(list_suites())}) or sets (--sets NAME ...)")
    return [get_set(n) for n in names]


def load_metric():
    """The ``challenge_accuracy`` ``evaluate`` module, loaded from its folder (no Hub)."""
    folder = evaluation_dir() / "metrics" / METRIC_NAME
    if not (folder / f"{METRIC_NAME}.py").exists():
        raise ConfigError(f"metric module {folder / (METRIC_NAME + '.py')} is missing; set DEBIASED_NLI_EVALUATION")
    import evaluate  # slow to import (it pulls in transformers.pipelines): only once the folder is there
    return evaluate.load(str(folder))


def challenge_source(spec: "str | ChallengeSet", data_root: "str | Path | None" = None) -> dict[str, Any]:
    """Where :func:`load_challenge_set` reads the set from: ``{"kind": "local", "path": ...}`` when the
    local file exists, ``{"kind": "hub", "path", "name", "split"}`` when it loads from the Hub, else
    ``{"kind": "missing"}``; plus ``hub_dataset``: the Hub split whose rows are scored (the Hub source,
    or a local file marked ``local_copy``), None when the scored rows are not those of a Hub dataset."""
    spec = get_set(spec)
    path = spec.local_path(data_root)
    hub = dict(spec.hub or {})
    hub_id = ({"path": hub["path"], "name": hub.get("name"), "split": hub.get("split", "test")}
              if hub.get("path") else None)
    if path is not None and path.exists():
        return {"kind": "local", "path": str(path), "hub_dataset": hub_id if hub.get("local_copy") else None}
    if hub_id and not os.environ.get("HF_DATASETS_OFFLINE") and not os.environ.get("HF_HUB_OFFLINE"):
        return {"kind": "hub", **hub_id, "hub_dataset": hub_id}
    return {"kind": "missing", "hub_dataset": None}


def hub_reference(spec: "str | ChallengeSet", data_root: "str | Path | None" = None) -> dict[str, Any]:
    """How the rows a set is scored on relate to a Hub dataset, for a published result:
    ``{"relation": "exact", "path", "name", "split"}`` when they are the Hub split's rows (:func:`challenge_source`'s
    ``hub_dataset``); ``"stand-in"`` for a local file standing in for a Hub split (``hub`` without ``local_copy``:
    the regenerated HANS); ``"subset"`` for rows taken from a Hub split (``derived_from``: SNLI-hard); else
    ``{"relation": None}``. Beside it, for rows read from a local file: ``file`` (its path under the data root) and
    ``file_sha256``."""
    spec = get_set(spec)
    source = challenge_source(spec, data_root)
    out: dict[str, Any] = {"relation": None}
    if source["hub_dataset"]:
        out = {"relation": "exact", **source["hub_dataset"]}
    elif spec.hub and spec.hub.get("path"):
        out = {"relation": "stand-in", "path": spec.hub["path"], "name": spec.hub.get("name"),
               "split": spec.hub.get("split", "test")}
    elif spec.derived_from:
        out = {"relation": "subset", "path": spec.derived_from["path"], "name": spec.derived_from.get("name"),
               "split": spec.derived_from.get("split")}
    if source["kind"] == "local":
        from ..utils.provenance import file_sha256

        out.update(file=spec.local, file_sha256=file_sha256(source["path"]))
    return out


def load_challenge_set(spec: "str | ChallengeSet", data_root: "str | Path | None" = None):
    """The set's rows as a ``datasets.Dataset`` with ``premise, hypothesis, label`` (the set's label
    ids), the breakdown columns, and ``row`` (position in the source file, before the filter).

    Reads ``local`` under the data root when that file exists, else the Hub source (needs the Hub);
    when neither can be had, the error names the path and how to get the data.
    """
    import datasets
    import numpy as np

    spec = get_set(spec)
    path = spec.local_path(data_root)
    columns, label_values = dict(spec.columns), dict(spec.label_values)
    source = challenge_source(spec, data_root)
    if source["kind"] == "local":
        import pyarrow.parquet as pq

        raw = datasets.Dataset(pq.read_table(path))  # small files: read directly, no cache copy
        where = str(path)
    elif source["kind"] == "hub":
        hub = spec.hub
        raw = datasets.load_dataset(hub["path"], hub.get("name"), split=hub.get("split", "test"))
        columns.update(hub.get("columns") or {})
        label_values = dict(hub.get("label_values") or label_values)
        where = f"{hub['path']}[{hub.get('split', 'test')}]"
    else:
        hub_hint = (f" or, with internet, let it load from the Hub ({spec.hub['path']}; unset HF_HUB_OFFLINE)"
                    if spec.hub else "")
        raise ConfigError(
            f"challenge set {spec.name!r}: file {path} does not exist. Put the data there (see "
            f"{spec.how_to_get or 'the set spec ' + spec.source_path}), or point --data-root / "
            f"DEBIASED_NLI_DATA_ROOT at the folder that holds {spec.local}{hub_hint}.")
    need = [columns[c] for c in ("premise", "hypothesis", "label")] + [c for b in spec.breakdowns for c in b.columns
                                                                       if c != "label"] + list(spec.filter)
    if spec.cluster:
        need.append(spec.cluster)
    missing = sorted({c for c in need if c not in raw.column_names})
    if missing:
        raise ConfigError(f"challenge set {spec.name!r} ({where}): missing column(s) {missing}; "
                          f"the file has {raw.column_names}")
    # vectorised from here on (pandas): the Dasgupta suite has 95k rows
    df = raw.to_pandas()
    df["row"] = np.arange(len(df), dtype=np.int64)
    for col, value in spec.filter.items():
        allowed = list(value) if isinstance(value, (list, tuple)) else [value]
        df = df[df[col].isin(allowed)]
    gold = df[columns["label"]]
    if spec.unlabeled_values:  # rows without a gold label (SNLI's -1 on the Hub) are not scored
        df = df[~gold.astype(str).isin({str(v) for v in spec.unlabeled_values})]
        gold = df[columns["label"]]
    lookup = {str(k): v for k, v in spec.label_lookup().items()}
    lookup.update({str(k): spec.labels.index(n) for k, n in label_values.items()})
    codes = gold.astype(str).str.strip().map(lookup)
    if codes.isna().any():
        bad = int(np.argmax(codes.isna().to_numpy()))
        raise ConfigError(f"challenge set {spec.name!r} ({where}) row {int(df['row'].iloc[bad])}: label "
                          f"{gold.iloc[bad]!r} in column {columns['label']!r} is not one of {sorted(lookup)}; "
                          f"fix label_values in {spec.source_path}")
    keep = {"premise": df[columns["premise"]].astype(str).tolist(),
            "hypothesis": df[columns["hypothesis"]].astype(str).tolist(),
            "label": codes.astype(np.int64).tolist(), "row": df["row"].tolist()}
    for c in [c for b in spec.breakdowns for c in b.columns] + ([spec.cluster] if spec.cluster else []):
        if c != "label" and c not in keep:
            keep[c] = df[c].astype(str).tolist()
    features = datasets.Features({
        "premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
        "label": datasets.ClassLabel(names=list(spec.labels)), "row": datasets.Value("int64"),
        **{c: datasets.Value("string") for c in keep if c not in ("premise", "hypothesis", "label", "row")}})
    return datasets.Dataset.from_dict(keep, features=features)
