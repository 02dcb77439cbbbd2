"""Score fine-tuned classifiers on the challenge suite and report the results.

For each model (one folder per seed) and each challenge set: the model's label distribution over the
task's labels (its ``config.id2label`` is mapped onto the task's label names by
:func:`debiased_nli.models.labels.map_model_labels`; a model whose names do not match is refused),
the argmax over the model labels that the set keeps, mapped onto the set's labels (HANS: neutral and
contradiction -> non-entailment), then accuracy and breakdown accuracies with the ``challenge_accuracy``
``evaluate`` module. Several seeds give mean ± sample standard deviation (ddof=1).

Outputs: ``results.json`` (typed schema: per set accuracy, n, breakdowns, label map, source; models,
seeds, library versions, git hash), ``report.md`` (a table; ``--compare`` adds the columns of other
result files) and ``accuracy.png`` (a bar chart). :func:`debiased_nli.models.hub.push_results` records the scores
in a Hub model repo (its card's ``model-index`` and ``.eval_results/``).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ..data.loading import labels_of
from ..utils.errors import ConfigError
from ..utils.provenance import git_hash, library_versions
from ..models.challenge import ChallengeSet, challenge_source, hub_reference, load_challenge_set, load_metric
from ..models.classifier import LoadedClassifier, load_classifier, output_names, predict_probabilities, read_train_record

logger = logging.getLogger(__name__)

SCHEMA = "debiased-nli/evaluation-results/v1"


def set_predictions(spec: ChallengeSet, probs_model_order: np.ndarray, id2label: Mapping[int, str],
                    model_name: str = "model") -> tuple[np.ndarray, dict]:
    """The set-label prediction of each row and the label map used.

    ``probs_model_order`` columns follow the model's ``id2label``; they are reordered to the task's
    labels by name, the labels the set leaves out (``prediction_map: null``) are dropped, and the
    argmax is mapped onto the set's labels.
    """
    from ..models.labels import map_model_labels

    task_labels = spec.model_labels
    order = map_model_labels(dict(id2label), task_labels, model_name)  # task label i = model output order[i]
    kept, targets = spec.prediction_indices()
    probs = probs_model_order[:, [order[i] for i in kept]]
    pred = np.asarray(targets, dtype=np.int64)[probs.argmax(axis=1)] if len(probs) else np.zeros(0, np.int64)
    label_map = {"model_output_to_task_label": {int(order[i]): task_labels[i] for i in range(len(task_labels))},
                 "task_label_to_set_label": {l: spec.prediction_map[l] for l in task_labels},
                 "set_labels": list(spec.labels)}
    return pred, label_map


def gold_probabilities(spec: ChallengeSet, probs_model_order: np.ndarray, id2label: Mapping[int, str], gold,
                       model_name: str = "model") -> np.ndarray:
    """The probability the model gives each row's gold label, in the set's labels: the probabilities of the
    model labels the set keeps (:meth:`ChallengeSet.prediction_indices`), renormalised to sum to 1, summed
    over the model labels mapped onto each set label (HANS: P(non-entailment) = P(neutral) + P(contradiction))."""
    from ..models.labels import map_model_labels

    order = map_model_labels(dict(id2label), spec.model_labels, model_name)
    kept, targets = spec.prediction_indices()
    probs = np.asarray(probs_model_order, dtype=np.float64)[:, [order[i] for i in kept]]
    probs = probs / np.maximum(probs.sum(axis=1, keepdims=True), 1e-12)
    per_label = np.zeros((len(probs), len(spec.labels)))
    for column, target in enumerate(targets):
        per_label[:, target] += probs[:, column]
    return per_label[np.arange(len(probs)), np.asarray(gold, dtype=np.int64)]


def breakdown_keys(spec: ChallengeSet, ds) -> dict[str, list[str]]:
    """Breakdown name -> the group key of each row (columns joined by '/'; ``label`` as the gold label name)."""
    out = {}
    names = list(spec.labels)
    for b in spec.breakdowns:
        parts = [[names[v] for v in ds["label"]] if c == "label" else list(ds[c]) for c in b.columns]
        out[b.name] = ["/".join(vals) for vals in zip(*parts)]
    return out


def score_predictions(spec: ChallengeSet, ds, predictions: np.ndarray, metric=None) -> dict:
    """Accuracy, n and breakdowns (``challenge_accuracy`` metric) of set-label predictions on ``ds``."""
    metric = metric or load_metric()
    return metric.compute(predictions=np.asarray(predictions).tolist(), references=labels_of(ds).tolist(),
                          breakdowns=breakdown_keys(spec, ds) or None)


def sample_rows(ds, max_examples: int | None, seed: int):
    """A seeded random sample of at most ``max_examples`` rows (the same rows for every model)."""
    if max_examples is None or max_examples >= len(ds):
        return ds
    return ds.shuffle(seed=seed).select(range(max_examples))


# ------------------------------------------------------------------------------------ the runner

@dataclasses.dataclass
class EvalConfig:
    max_examples: int | None = None
    sample_seed: int = 0
    batch_size: int = 64
    max_length: int = 128
    max_tokens: int | None = None    # padded tokens per batch (rows x longest row); None: batch_size rows
    data_root: str | None = None
    device: str | None = None
    progress: bool = True
    label_order: list[str] | None = None  # names of the model outputs in order, for LABEL_i heads
    dtype: str = "float32"           # forward passes in float32, or bfloat16 autocast (debiased_nli.utils.precision)


def confusion(labels: Sequence[str], gold, pred) -> dict[str, dict[str, int]]:
    """``{gold label: {predicted label: rows}}`` over a set's own labels (HANS: 2-way)."""
    names = list(labels)
    g, p = np.asarray(gold, dtype=np.int64), np.asarray(pred, dtype=np.int64)
    return {names[i]: {names[j]: int(((g == i) & (p == j)).sum()) for j in range(len(names))}
            for i in range(len(names))}


def evaluate_models(model_paths: Sequence[str], sets: Sequence[ChallengeSet], cfg: EvalConfig | None = None, *,
                    chunk_rows: int | None = None, cache_dirs: Mapping[str, "str | Path"] | None = None,
                    before_chunk: Callable[[], None] | None = None,
                    exclude_rows: Mapping[str, Sequence[int]] | None = None, keep_predictions: bool = False) -> dict:
    """Score every model on every set; returns the ``results.json`` object (see :data:`SCHEMA`).

    Each run (a model on a set) records, beside its scores, its confusion matrix and the seconds, CPU
    seconds and commits its probabilities took (``predict_*``). ``chunk_rows`` predicts each set in chunks
    of at most that many rows; with ``cache_dirs`` (model path -> folder) every chunk's probabilities are
    saved there with their time and commit, so an interrupted evaluation continues where it stopped (a
    model whose chunks are all saved is not loaded at all). ``before_chunk`` is called before each chunk
    that is computed (e.g. to take turns at a lock).

    ``exclude_rows`` (set name -> values of the set's ``row`` column): rows left out of that set before
    anything is scored (e.g. the rows a model's epoch was selected on); the set's entry records how many
    (``excluded_rows``). ``keep_predictions``: each run also holds ``predictions`` (numpy arrays, not JSON:
    the caller stores them) -- ``predicted`` and ``gold`` (set label ids, int8) and ``gold_probability``
    (float16: :func:`gold_probabilities`) of every scored row in order, and ``cluster`` (int32 codes of the set's
    ``cluster`` column, where it declares one) -- and each set's entry the content
    fingerprint of the rows scored (``rows_fingerprint``, :func:`debiased_nli.data.loading.content_fingerprint`)."""
    import time

    cfg = cfg or EvalConfig()
    metric = load_metric()
    models = []
    per_set: dict[str, dict] = {}
    loaded = _load_sets(sets, cfg, exclude_rows)  # every set first: a missing file fails before any prediction
    for path in model_paths:
        cache = (cache_dirs or {}).get(str(path))
        model = _LazyClassifier(str(path), cfg)
        if cache is None:
            model.get()  # loaded (and checked) before any set; a cached evaluation loads it only if it must
        record = model.train_record()
        seed = (record or {}).get("config", {}).get("seed")
        seconds = {}
        for spec in sets:
            full, ds, reference, n_excluded = loaded[spec.name]
            start = time.perf_counter()
            probs, timing = _set_probabilities(model, spec.name, ds, cfg, chunk_rows=chunk_rows,
                                               cache=Path(cache) if cache else None, before_chunk=before_chunk)
            pred, label_map = set_predictions(spec, probs, model.id2label(), str(path))
            scores = score_predictions(spec, ds, pred, metric)
            seconds[spec.name] = round(time.perf_counter() - start, 2)
            entry = per_set.get(spec.name) or per_set.setdefault(
                spec.name, _set_entry(spec, full, ds, cfg, label_map, reference))
            if n_excluded is not None:
                entry["excluded_rows"] = n_excluded
            run = {"model": str(path), "seed": seed, **scores, "confusion": confusion(spec.labels, ds["label"], pred),
                   **timing}
            if keep_predictions:
                if "rows_fingerprint" not in entry:
                    from ..data.loading import content_fingerprint

                    entry["rows_fingerprint"] = content_fingerprint(ds)
                run["predictions"] = _run_predictions(spec, ds, pred, probs, model.id2label(), str(path))
            entry["runs"].append(run)
        models.append({"path": str(path), "seed": seed, "id2label": {str(k): v for k, v in model.id2label().items()},
                       "train": (record or {}).get("result"), "train_config": (record or {}).get("config"),
                       "task": (record or {}).get("task"), "eval_seconds": seconds})
        del model
    for name, entry in per_set.items():
        accs = np.array([r["accuracy"] for r in entry["runs"]])
        entry["accuracy"] = float(accs.mean())
        entry["accuracy_std"] = float(accs.std(ddof=1)) if len(accs) > 1 else 0.0
        entry["breakdowns"] = _mean_breakdowns(entry["runs"])
    return {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "models": models, "seeds": [m["seed"] for m in models], "num_models": len(models),
            "config": dataclasses.asdict(cfg), "sets": per_set, "versions": library_versions(),
            "git": git_hash()}


def _load_sets(sets: Sequence[ChallengeSet], cfg: EvalConfig,
               exclude_rows: Mapping[str, Sequence[int]] | None) -> dict[str, tuple]:
    """Each set by name: (its rows less ``exclude_rows``, the rows scored (a seeded sample when
    ``cfg.max_examples``), its Hub reference, how many rows were excluded (None: none asked))."""
    out = {}
    for spec in sets:
        ds = load_challenge_set(spec, cfg.data_root)
        reference = hub_reference(spec, cfg.data_root)
        n_excluded = None
        if exclude_rows and spec.name in exclude_rows:
            keep = ~np.isin(np.asarray(ds["row"], dtype=np.int64), np.asarray(list(exclude_rows[spec.name]), np.int64))
            n_excluded = int(len(ds) - keep.sum())
            ds = ds.select(np.flatnonzero(keep))
        out[spec.name] = (ds, sample_rows(ds, cfg.max_examples, cfg.sample_seed), reference, n_excluded)
    return out


def _set_entry(spec: ChallengeSet, full, ds, cfg: EvalConfig, label_map, reference) -> dict:
    """A set's entry of ``results.json`` before its runs: its rows, sample, labels and source."""
    source = challenge_source(spec, cfg.data_root)
    return {"n": len(ds), "n_total": len(full), "subsampled": len(ds) < len(full),
            "sample_seed": cfg.sample_seed if len(ds) < len(full) else None,
            "labels": list(spec.labels), "label_map": label_map, "task": spec.task,
            "source": source["path"] if source["kind"] == "local" else f"{source['path']}[{source['split']}]",
            "source_kind": source["kind"], "hub_dataset": source["hub_dataset"],
            "hub_reference": reference, "spec_version": spec.version, "runs": []}


def _run_predictions(spec: ChallengeSet, ds, pred: np.ndarray, probs: np.ndarray, id2label, model: str) -> dict:
    """A run's ``predictions`` (see :func:`evaluate_models`' ``keep_predictions``)."""
    gold = np.asarray(ds["label"], dtype=np.int64)
    out = {"predicted": pred.astype(np.int8), "gold": gold.astype(np.int8),
           "gold_probability": gold_probabilities(spec, probs, id2label, gold, model).astype(np.float16)}
    if spec.cluster:  # which cluster each row is in (codes of the sorted values of the column)
        column = ds.with_format("arrow")[spec.cluster].to_numpy(zero_copy_only=False)
        out["cluster"] = np.unique(column, return_inverse=True)[1].astype(np.int32)
    return out


class _LazyClassifier:
    """A model of :func:`evaluate_models`, loaded the first time a chunk of probabilities is computed;
    its output names and training record are read from the folder without loading the weights."""

    def __init__(self, path: str, cfg: EvalConfig):
        self.path, self.cfg, self.loaded = path, cfg, None

    def get(self) -> LoadedClassifier:
        if self.loaded is None:
            self.loaded = load_classifier(self.path, self.cfg.device, label_order=self.cfg.label_order)
        return self.loaded

    def id2label(self) -> dict[int, str]:
        if self.loaded is not None:
            return self.loaded.id2label
        from transformers import AutoConfig

        return output_names(AutoConfig.from_pretrained(self.path).id2label, self.cfg.label_order, self.path)

    def train_record(self) -> dict | None:
        return self.loaded.train_record if self.loaded is not None else read_train_record(self.path)


def _set_probabilities(model: _LazyClassifier, set_name: str, ds, cfg: EvalConfig, *, chunk_rows: int | None,
                       cache: Path | None, before_chunk: Callable[[], None] | None) -> tuple[np.ndarray, dict]:
    """The model's probabilities of every row of ``ds`` (model order), chunk by chunk (see
    :func:`evaluate_models`), and the seconds, CPU seconds and commits they took."""
    import time

    prem, hyp = ds["premise"], ds["hypothesis"]
    step = chunk_rows or max(1, len(ds))
    parts, seconds, cpu, commits = [], 0.0, 0.0, set()
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
    for k, start in enumerate(range(0, len(ds), step)):
        f = None if cache is None else \
            cache / f"{set_name}-{len(ds)}-{k:03d}{'' if cfg.dtype == 'float32' else '-' + cfg.dtype}.npz"
        if f is not None and f.exists():
            with np.load(f) as z:
                parts.append(z["probs"])
                seconds += float(z["seconds"])
                cpu += float(z["cpu"])
                commits.add(str(z["git"]))
            continue
        if before_chunk is not None:
            before_chunk()
        clf = model.get()
        stop = min(start + step, len(ds))
        t0, c0 = time.perf_counter(), time.process_time()
        probs = predict_probabilities(clf, prem[start:stop], hyp[start:stop], batch_size=cfg.batch_size,
                                      max_length=cfg.max_length, max_tokens=cfg.max_tokens,
                                      progress=cfg.progress and (f"{Path(model.path).name} / {set_name}"
                                                                 + (f" [{k}]" if chunk_rows else "")),
                                      dtype=cfg.dtype)
        took, took_cpu, commit = time.perf_counter() - t0, time.process_time() - c0, str(git_hash())
        if f is not None:
            tmp = f.with_name(f".{f.name}.tmp.npz")
            np.savez(tmp, probs=probs, seconds=took, cpu=took_cpu, git=commit)
            os.replace(tmp, f)
        parts.append(probs)
        seconds, cpu = seconds + took, cpu + took_cpu
        commits.add(commit)
    probs = np.concatenate(parts) if parts else np.zeros((0, len(model.id2label())), np.float32)
    return probs, {"predict_seconds": round(seconds, 2), "predict_cpu_seconds": round(cpu, 2),
                   "predict_git": sorted(commits)}


def _mean_breakdowns(runs: Sequence[dict]) -> dict:
    out: dict[str, dict] = {}
    for name in (runs[0].get("breakdowns") or {}):
        out[name] = {}
        for group in runs[0]["breakdowns"][name]:
            accs = np.array([r["breakdowns"][name][group]["accuracy"] for r in runs])
            out[name][group] = {"accuracy": float(accs.mean()),
                                "accuracy_std": float(accs.std(ddof=1)) if len(accs) > 1 else 0.0,
                                "n": runs[0]["breakdowns"][name][group]["n"]}
    return out


# ------------------------------------------------------------------------------------ reports

def load_results(path: "str | Path") -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.exists():
        raise ConfigError(f"results file {p} does not exist (give a results.json written by `debiased-nli evaluate`)")
    from ..utils.paths import read_json

    try:  # a regular UTF-8 file, JSON, not nested without end
        data = read_json(p, "results file")
    except ConfigError as err:
        reason = str(err).split(str(p), 1)[-1].strip(" :")  # what read_json says of the file, after its name
        raise ConfigError(f"{p} is not a JSON results file ({reason}); give a results.json written by "
                          f"`debiased-nli evaluate`") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{p} is not a debiased-nli results file (schema {found!r}, expected {SCHEMA!r})")
    return data


def _fmt(entry: dict | None, num_models: int) -> str:
    """``mean ± std`` (percent) over several models, the accuracy alone for one."""
    if not entry:
        return "–"
    acc = 100 * entry["accuracy"]
    return f"{acc:.1f} ± {100 * entry.get('accuracy_std', 0.0):.1f}" if num_models > 1 else f"{acc:.1f}"


def write_report(results: dict, out_dir: "str | Path", *, title: str = "Evaluation report",
                 name: str = "this model", compare: Mapping[str, dict] | None = None, notes: str = "") -> Path:
    """``report.md`` from ``model_cards/evaluation_report.md.j2`` (a table; one column per compared file)."""
    out = Path(out_dir) / "report.md"
    out.write_text(render_report(results, title=title, name=name, compare=compare, notes=notes))
    return out


def render_report(results: dict, *, title: str = "Evaluation report", name: str = "this model",
                  compare: Mapping[str, dict] | None = None, notes: str = "") -> str:
    """The text of ``report.md`` (see :func:`write_report`)."""
    import jinja2

    compare = dict(compare or {})
    columns = [name] + list(compare)
    all_results = [results] + list(compare.values())
    set_names = list(results["sets"]) + [s for r in compare.values() for s in r["sets"] if s not in results["sets"]]
    rows = []
    for s in set_names:
        entry = results["sets"].get(s) or next(r["sets"][s] for r in compare.values() if s in r["sets"])
        rows.append({"set": s, "n": entry["n"], "n_total": entry.get("n_total", entry["n"]),
                     "cells": [_fmt(r["sets"].get(s), r["num_models"]) for r in all_results]})
    breakdowns = []
    for s in results["sets"]:
        for bname, groups in (results["sets"][s].get("breakdowns") or {}).items():
            brows = [{"group": g, "n": v["n"],
                      "cells": [_fmt((r["sets"].get(s, {}).get("breakdowns") or {}).get(bname, {}).get(g),
                                     r["num_models"]) for r in all_results]} for g, v in groups.items()]
            breakdowns.append({"set": s, "name": bname, "rows": brows})
    from ..utils.resources import templates_dir

    template = templates_dir() / "evaluation_report.md.j2"
    if not template.exists():
        raise ConfigError(f"report template {template} is missing")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template.parent)), autoescape=False,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    return env.get_template(template.name).render(
        title=title, columns=columns, rows=rows, breakdowns=breakdowns, results=results, notes=notes,
        models=results["models"], subsampled=any(e.get("subsampled") for e in results["sets"].values()))


def plot_results(results: dict, path: "str | Path", *, name: str = "this model",
                 compare: Mapping[str, dict] | None = None) -> Path:
    """A grouped bar chart of mean accuracy per set (error bars: std over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compare = dict(compare or {})
    series = [(name, results)] + list(compare.items())
    sets = list(results["sets"])
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(sets) + 2), 4))
    x = np.arange(len(sets))
    for i, (label, r) in enumerate(series):
        acc = [100 * r["sets"][s]["accuracy"] if s in r["sets"] else np.nan for s in sets]
        err = [100 * r["sets"][s].get("accuracy_std", 0.0) if s in r["sets"] else 0.0 for s in sets]
        ax.bar(x + (i - (len(series) - 1) / 2) * width, acc, width, yerr=err, capsize=3, label=label)
    ax.set_xticks(x, sets, rotation=30, ha="right")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


OUTPUT_FILES = ("results.json", "report.md", "accuracy.png")


def evaluation_outputs(out_dir: "str | Path"):
    """The files ``evaluate --out DIR`` writes, checked before any model is scored: DIR is new, empty or an
    evaluation folder of this tool (:func:`~debiased_nli.utils.outputs.check_output_folder`), and none of
    ``results.json``, ``report.md``, ``accuracy.png`` there is a file this tool did not write (a user's
    ``report.md`` is refused, not replaced). An evaluation written before the markers is recognised by its
    ``results.json`` (this tool's schema). Returns the :class:`~debiased_nli.utils.outputs.OwnFiles`."""
    from ..utils.outputs import OwnFiles, check_output_folder, holds_own_file, json_of

    def legacy(folder: Path) -> bool:
        data = json_of(folder / "results.json")
        return isinstance(data, dict) and data.get("schema") == SCHEMA

    folder = check_output_folder(out_dir, what="evaluation",
                                 is_ours=lambda f: holds_own_file(f, OUTPUT_FILES) or legacy(f))
    return OwnFiles([folder / n for n in OUTPUT_FILES], what=f"--out {out_dir}", legacy=lambda p: legacy(p.parent))


def write_outputs(results: dict, out_dir: "str | Path", *, name: str = "this model",
                  compare: Mapping[str, dict] | None = None, title: str = "Evaluation report",
                  notes: str = "", outputs=None) -> dict[str, Path]:
    """``results.json``, ``report.md`` and ``accuracy.png`` in ``out_dir``, each written whole or not at all and
    never over a file this tool did not write (``outputs``: :func:`evaluation_outputs`, checked earlier)."""
    outputs = outputs or evaluation_outputs(out_dir)
    paths = dict(zip(("results", "report", "chart"), outputs.paths))
    with outputs:
        outputs.write_text(paths["results"], json.dumps(results, indent=2))
        outputs.write_text(paths["report"], render_report(results, title=title, name=name, compare=compare,
                                                          notes=notes))
        plot_results(results, outputs.temp(paths["chart"]), name=name, compare=compare)
    return paths
