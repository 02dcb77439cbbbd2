"""The dataset card of a release: the Hub metadata (YAML), the card body rendered from
``model_cards/dataset_card.md.j2``, the version history and the citations of the methods used."""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np

from .. import __version__
from ..data.loading import labels_of
from ..data.tasks import TaskSpec

from ..utils.provenance import project_url
from ..utils.resources import templates_dir
from .configs import CONFIG_DESCRIPTIONS, ConfigData, canonical_only, data_extra_columns

# who made the labels of each task's source data (Hub card vocabulary); generated rows add machine-generated
ANNOTATIONS_CREATORS = {"snli": ["crowdsourced"], "mnli": ["crowdsourced"], "fever": ["crowdsourced"],
                        "qqp": ["other"], "demo": ["machine-generated"]}


def dataset_card_yaml(task: TaskSpec, configs: Sequence[ConfigData], written: Mapping[str, Mapping[str, list]],
                       default: str, meta: Mapping[str, Any], new_origins: Sequence[str] = ()) -> str:
    """The README YAML: ``configs`` (data_files, default), ``dataset_info`` (features, sizes) and the
    Hub's card metadata (licence, task, language, sources, annotation creators, size)."""
    import datasets
    from datasets.info import DatasetInfosDict
    from huggingface_hub import DatasetCardData

    annotations = list(ANNOTATIONS_CREATORS.get(task.name, ["other"]))
    if new_origins and "machine-generated" not in annotations:
        annotations.append("machine-generated")
    config_entries = []
    for c in configs:  # the Hub lists the default config first
        entry = {"config_name": c.name,
                 "data_files": [{"split": s, "path": f"data/{c.name}/{s}-*"} for s in written[c.name]]}
        if c.name == default:
            entry["default"] = True
        config_entries.append(entry)
    config_entries.sort(key=lambda e: not e.get("default", False))
    # the rows each config's stage dropped, with the reason: a config of their own (never the default), so that the
    # Hub's viewer shows why rows went and load_dataset(repo, "rejected_<config>") reads them
    config_entries += [{"config_name": rejected_config(c.name),
                        "data_files": [{"split": "train", "path": f"rejected/{c.name}/train-*"}]}
                       for c in configs if c.rejected is not None and len(c.rejected)]
    card = DatasetCardData(
        license=meta.get("license"), pretty_name=meta.get("pretty_name"), task_categories=["text-classification"],
        task_ids=["natural-language-inference"] if task.num_labels == 3 else ["semantic-similarity-classification"],
        language=["en"], multilinguality=["monolingual"], annotations_creators=annotations,
        source_datasets=[f"extended|{task.hub.path}"] if task.hub else ["original"],
        tags=["debiasing", "z-filtering", "spurious-correlations", "debiased-nli"],
        size_categories=[_size_category(max(sum(f["rows"] for f in written[c.name]["train"]) for c in configs))],
        configs=config_entries)
    infos = {}
    for c in configs:
        feats = canonical_only(c.splits.get("train", next(iter(c.splits.values()))), data_extra_columns(c)).features
        splits = datasets.SplitDict()
        for split, files in written[c.name].items():
            splits.add(datasets.SplitInfo(name=split, num_bytes=sum(f["arrow_bytes"] for f in files),
                                          num_examples=sum(f["rows"] for f in files)))
        infos[c.name] = datasets.DatasetInfo(
            features=feats, splits=splits, config_name=c.name,
            download_size=sum(f["bytes"] for fs in written[c.name].values() for f in fs),
            dataset_size=sum(f["arrow_bytes"] for fs in written[c.name].values() for f in fs))
    # dataset_info in the Hub's YAML form, as Dataset.push_to_hub writes it
    DatasetInfosDict(infos).to_dataset_card_data(card)
    return card.to_yaml().rstrip("\n") + "\n"


# the method of each config, as a release's title names it (original: the input, no method)
CONFIG_METHODS = {"z_filtered": "z-filtering", "z_aug": "Z-Aug", "par_z": "Par-Z", "seq_z": "Seq-Z",
                  "aflite": "AFLite", "pdd": "PDD", "ibadr": "IBADR"}
_METHOD_WORDS = {m.lower() for m in CONFIG_METHODS.values()} | {"z-filtered", "z filtering"}


def release_title(pretty_name: str, configs: Sequence[str]) -> str:
    """The card's title: the recipe's ``pretty_name`` followed by the methods of the configs the release has
    (``Debiased SNLI (z-filtering)`` for a ``z_filtered``-only release, never the methods it lacks). A list of
    methods the name already ends with (``Debiased SNLI (z-filtering, Z-Aug, Par-Z, Seq-Z)``, as recipes were
    written) is replaced, not repeated; a config of another name (a step registered by the user) is named as is."""
    base = pretty_name.strip()
    m = re.search(r"\s*\(([^()]*)\)$", base)
    if m and all(part.strip().lower() in _METHOD_WORDS for part in m.group(1).split(",")):
        base = base[:m.start()].rstrip()
    methods = [CONFIG_METHODS.get(c, c) for c in configs if c != "original"]
    return f"{base} ({', '.join(dict.fromkeys(methods))})" if methods else base


REJECTED_PREFIX = "rejected_"


def rejected_config(config: str) -> str:
    """The name of the config that holds the rows ``config``'s stage dropped (``rejected_z_filtered``)."""
    return f"{REJECTED_PREFIX}{config}"


def _size_category(n: int) -> str:
    for bound, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
                        (1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M")):
        if n < bound:
            return name
    return "10M<n<100M"


HISTORY_START = "<!-- debiased-nli:history:start -->"


HISTORY_END = "<!-- debiased-nli:history:end -->"
CARD_MARKER_PREFIX = "<!-- debiased-nli:"  # what every marker of the card starts with


def check_card_text(value: Any, where: str) -> None:
    """Text that goes into the card (a recipe's summary, names, history notes, citations; a push's note) must
    not contain the card's markers: the history table is found between them, so one in the text would make a
    push replace the card from there on. A :class:`ConfigError` names the place; lists and mappings are
    walked without recursion."""
    from ..utils.errors import ConfigError

    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            if CARD_MARKER_PREFIX in v or "debiased-nli:history" in v:
                raise ConfigError(f"{at} contains the dataset card's marker {CARD_MARKER_PREFIX!r}...; the card's "
                                  f"sections are found by these markers: remove it from the text")
        elif isinstance(v, dict):
            stack.extend((x, f"{at}.{k}") for k, x in v.items())
            stack.extend((k, f"{at} (a key)") for k in v if isinstance(k, str))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))


def render_history_table(history: Sequence[Mapping[str, Any]]) -> str:
    """The card's version-history table, between markers, from the machine-readable history
    (``manifest.json`` ``history``: a list of ``{version, notes}``)."""
    def cell(text: Any) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    rows = "".join(f"| {cell(h['version'])} | {cell(h.get('notes', ''))} |\n" for h in history)
    return f"{HISTORY_START}\n| version | notes |\n|---|---|\n{rows}{HISTORY_END}"


def label_distribution(ds, labels: Sequence[str]) -> dict[str, int]:
    counts = np.bincount(labels_of(ds), minlength=len(labels)) if len(ds) else np.zeros(len(labels), int)
    return {name: int(n) for name, n in zip(labels, counts)}


def citations_for(steps: Sequence[str]) -> list[dict]:
    """The BibTeX entries (``model_cards/citations.yaml``) of the methods a release used: z-statistics
    and z-filtering always, plus the papers of its recipe steps (``aflite``, ``generator``, ...)."""
    import yaml

    entries = yaml.safe_load((templates_dir() / "citations.yaml").read_text())
    used = {"z-statistics", "z-filtering"} | {str(s).lower() for s in steps}
    return [dict(e, key=k) for k, e in entries.items() if used & set(e.get("used_by", []))]


def render_card(task: TaskSpec, configs: Sequence[ConfigData], written, summaries, manifest, meta, default,
                generated: Mapping[str, Any] | None = None) -> str:
    """The card body (``model_cards/dataset_card.md.j2``). The build manifest is linked, not inlined."""
    import jinja2
    import yaml

    from ..bias.features import list_extractors

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    sizes = []
    split_names = sorted({s for sp in written.values() for s in sp}, key=lambda s: (s != "train", s))
    for c in configs:
        rejected = len(c.rejected) if c.rejected is not None else 0
        train = sum(f["rows"] for f in written[c.name].get("train", []))
        sizes.append({"config": c.name, "description": c.description or CONFIG_DESCRIPTIONS.get(c.name, ""),
                      "default": c.name == default,
                      "rows": {s: sum(f["rows"] for f in written[c.name].get(s, [])) if s in written[c.name] else None
                               for s in split_names},
                      "rejected": rejected, "considered": train + rejected if rejected else 0})
    # a step's markdown keeps its own structure, three levels below the card's config headings
    sections = [(c.name, "\n".join("###" + line if line.startswith("#") else line
                                    for line in c.card_section.splitlines()))
                for c in configs if c.card_section]
    recipe = manifest.get("recipe") or {}
    steps = [c.name for c in configs] + [st.get("step", "") for key in ("new_rows", "filters")
                                         for st in (recipe.get(key) or []) if isinstance(st, Mapping)]
    used = set(manifest.get("features", {}).get("extractors", {}))
    unused = [e for e in list_extractors() if e not in used]
    label_rows = []
    for config, splits in (manifest.get("label_distribution") or {}).items():
        for split, counts in splits.items():
            total = max(sum(counts.values()), 1)
            label_rows.append({"config": config, "split": split,
                               "cells": [f"{counts[l]:,} ({100 * counts[l] / total:.1f}%)" for l in task.labels]})
    return env.get_template("dataset_card.md.j2").render(
        task=task, sections=sections, meta=meta, sizes=sizes, split_names=split_names, summaries=summaries,
        manifest=manifest, default=default, version=__version__, project_url=project_url(),
        repo_id=meta.get("repo_id") or f"<org>/{meta.get('pretty_name', 'release')}",
        label_rows=label_rows, generated=generated,
        debiased_families=", ".join(f"`{e}`" for e in sorted(used - {"null_v1"})) or "none",
        unused_families="; nor the registered extractors this task did not use: "
                        + ", ".join(f"`{e}`" for e in unused) if unused else "",
        measurements=yaml.safe_load((templates_dir() / "measurements.yaml").read_text()) or {},
        citations=citations_for(steps), history_table=render_history_table(meta.get("history") or []))
