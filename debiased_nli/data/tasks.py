"""Task specs: where a task's data lives and how its columns map onto `premise, hypothesis, label`.

One small YAML per task lives in ``debiased_nli/data/task_specs/`` (as lm-evaluation-harness does). A spec says
which Hub dataset a user with internet loads, how its columns map onto the canonical columns, the
label names (K = len(labels)), which source label values mean "no gold label", and which feature
extractors apply. Any other sentence-pair classification set works through ``TaskSpec.custom`` or a
YAML file of the same shape passed by path.
"""
from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..utils.errors import ConfigError, did_you_mean, excerpt

CANONICAL_COLUMNS = ("premise", "hypothesis", "label")
_KNOWN_KEYS = {
    "name", "version", "description", "labels", "columns", "label_values", "unlabeled_values",
    "id_column", "hub", "features", "citation", "license", "default_data_files",
}
_HUB_KEYS = {"path", "name", "splits", "columns", "label_values"}


@dataclasses.dataclass(frozen=True)
class HubSource:
    path: str
    name: str | None = None
    splits: Mapping[str, str] = dataclasses.field(default_factory=lambda: {"train": "train"})
    # Hub-specific overrides of the task's column map and label values (None: use the task's).
    columns: Mapping[str, str] | None = None
    label_values: Mapping[Any, str] | None = None


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A sentence-pair classification task.

    ``columns`` maps canonical names (premise, hypothesis, label) to source column names.
    ``label_values`` maps source label values to label names; the integers 0..K-1 and the label
    names themselves are always accepted. ``unlabeled_values`` are source labels that mean "no gold
    label" (SNLI's -1 / '-').
    """

    name: str
    labels: tuple[str, ...]
    columns: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: {c: c for c in CANONICAL_COLUMNS})
    label_values: Mapping[Any, str] = dataclasses.field(default_factory=dict)
    unlabeled_values: tuple[Any, ...] = ()
    id_column: str | None = None
    hub: HubSource | None = None
    features: tuple[str, ...] = ("unigram_v1", "bigram_v1", "hypo_len_v1", "len_ratio_v1",
                                 "overlap_v2", "hypo_only_v1", "null_v1")
    version: int = 1
    description: str = ""
    citation: str = ""
    license: str = "unknown"
    default_data_files: Mapping[str, str] | None = None
    source_path: str | None = None  # the YAML it came from

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def label_lookup(self, label_values: Mapping[Any, str] | None = None) -> dict[Any, int]:
        """Every accepted source value -> label index (ints, their string forms, names)."""
        lookup: dict[Any, int] = {}
        for i, name in enumerate(self.labels):
            lookup[i] = i
            lookup[str(i)] = i
            lookup[name] = i
        for value, name in (label_values if label_values is not None else self.label_values).items():
            if name not in self.labels:
                raise ConfigError(
                    f"task {self.name!r}: label_values maps {value!r} to {name!r}, which is not one of "
                    f"the task's labels {list(self.labels)}")
            lookup[value] = self.labels.index(name)
            lookup[str(value)] = self.labels.index(name)
        return lookup

    @classmethod
    def custom(cls, name: str, labels: Sequence[str], premise: str = "premise",
               hypothesis: str = "hypothesis", label: str = "label", **kwargs: Any) -> "TaskSpec":
        """Any sentence-pair classification set, e.g. ``TaskSpec.custom("rte", ["entailment",
        "not_entailment"], premise="sentence1", hypothesis="sentence2")``."""
        return cls(name=name, labels=tuple(labels),
                   columns={"premise": premise, "hypothesis": hypothesis, "label": label}, **kwargs)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "<dict>") -> "TaskSpec":
        unknown = set(raw) - _KNOWN_KEYS
        if unknown:
            raise ConfigError(
                f"{source}: unknown task key(s) {sorted(unknown)}; known keys: {sorted(_KNOWN_KEYS)}")
        for key in ("name", "labels"):
            if key not in raw:
                raise ConfigError(f"{source}: a task spec needs {key!r}")
        columns = dict(raw.get("columns") or {c: c for c in CANONICAL_COLUMNS})
        missing = [c for c in CANONICAL_COLUMNS if c not in columns]
        if missing:
            raise ConfigError(f"{source}: `columns` must map {missing} to source columns")
        hub = None
        if raw.get("hub"):
            h = dict(raw["hub"])
            unknown = set(h) - _HUB_KEYS
            if unknown:
                raise ConfigError(f"{source}: unknown hub key(s) {sorted(unknown)}; known: {sorted(_HUB_KEYS)}")
            hub = HubSource(path=h["path"], name=h.get("name"), splits=h.get("splits") or {"train": "train"},
                            columns=h.get("columns"), label_values=h.get("label_values"))
        kwargs = {k: raw[k] for k in ("version", "description", "citation", "license", "id_column",
                                      "default_data_files") if k in raw}
        if "features" in raw:
            kwargs["features"] = tuple(raw["features"])
        spec = cls(name=str(raw["name"]), labels=tuple(str(x) for x in raw["labels"]), columns=columns,
                   label_values=dict(raw.get("label_values") or {}),
                   unlabeled_values=tuple(raw.get("unlabeled_values") or ()), hub=hub,
                   source_path=source, **kwargs)
        spec.label_lookup()  # validates label_values
        if hub and hub.label_values:
            spec.label_lookup(hub.label_values)
        return spec

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source_path")
        d["labels"] = list(self.labels)
        d["features"] = list(self.features)
        d["unlabeled_values"] = list(self.unlabeled_values)
        return d


_REGISTRY: dict[str, TaskSpec] = {}


def _builtin_specs() -> dict[str, TaskSpec]:
    if not _REGISTRY:
        for entry in sorted((resources.files("debiased_nli.data") / "task_specs").iterdir(), key=lambda p: p.name):
            if entry.name.endswith(".yaml"):
                spec = TaskSpec.from_dict(yaml.safe_load(entry.read_text()), source=f"task_specs/{entry.name}")
                _REGISTRY[spec.name] = spec
    return _REGISTRY


def register_task(spec: TaskSpec, overwrite: bool = False) -> TaskSpec:
    specs = _builtin_specs()
    if spec.name in specs and not overwrite:
        raise ConfigError(f"task {spec.name!r} is already registered; pass overwrite=True to replace it")
    specs[spec.name] = spec
    return spec


def list_tasks() -> list[str]:
    return sorted(_builtin_specs())


def get_task(name_or_path: "str | TaskSpec") -> TaskSpec:
    """A registered task by name, or a task YAML by path."""
    if isinstance(name_or_path, TaskSpec):
        return name_or_path
    specs = _builtin_specs()
    if name_or_path in specs:
        return specs[name_or_path]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        from ..utils.safe_yaml import read_yaml_input

        # a regular file (a FIFO or a device would block the read), UTF-8 YAML, bounded
        return TaskSpec.from_dict(read_yaml_input(path, "task file"), source=str(path))
    raise ConfigError(
        f"unknown task {excerpt(name_or_path)}.{did_you_mean(name_or_path, list(specs))} "
        f"Registered tasks: {', '.join(sorted(specs))}; or pass a task YAML file "
        f"(see debiased_nli/data/task_specs/snli.yaml) or --columns/--labels for any sentence-pair set.")
