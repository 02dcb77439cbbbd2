"""Score fine-tuned classifiers on the challenge suite and report the results.

For each model (one folder per seed) and each challenge set: the model's label distribution over the
task's labels (its ``config.id2label`` is mapped onto the task's label names by
:func:`debiased_nli.bias.hypothesis_only.map_model_labels`; a model whose names do not match is refused),
the argmax over the model labels that the set keeps, mapped onto the set's labels (HANS: neutral and
contradiction -> non-entailment), then accuracy and breakdown accuracies with the ``challenge_accuracy``
``evaluate`` module. Several seeds give mean ± sample standard deviation (ddof=1).

Outputs: ``results.json`` (typed schema: per set accuracy, n, breakdowns, label map, source; models,
seeds, library versions, git hash), ``report.md`` (a table; ``--compare`` adds the columns of other
result files) and ``accuracy.png`` (a bar chart). :func:`push_results` writes the scores into the
``model-index`` of a Hub model card.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..data.loading import labels_of
from ..utils.errors import ConfigError
from ..utils.provenance import git_hash, library_versions
from .challenge import ChallengeSet, challenge_source, load_challenge_set, load_metric

logger = logging.getLogger(__name__)

SCHEMA = "debiased-nli/evaluation-results/v1"


# ------------------------------------------------------------------------------------ prediction

@dataclasses.dataclass
class LoadedClassifier:
    path: str
    model: Any
    tokenizer: Any
    id2label: dict[int, str]
    train_record: dict | None


def load_classifier(path: str, device: str | None = None, label_order: Sequence[str] | None = None) -> LoadedClassifier:
    """A sequence classifier ready to score, refused when its classification head was never trained.

    ``from_pretrained`` initialises missing weights at random (an encoder without a head, or a folder
    saved without them) and only logs it: such a model scores at chance and must not be reported.
    A head whose outputs are named ``LABEL_0..K`` is taken in the task's order, with a warning, unless
    ``label_order`` names the outputs."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    folder = Path(path)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its load report is checked below, and said in one line
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model, info = AutoModelForSequenceClassification.from_pretrained(path, output_loading_info=True)
    except OSError as err:
        if folder.exists():
            raise ConfigError(f"{path} is not a model folder ({err}); give a folder written by "
                              f"`debiased-nli train`") from err
        raise ConfigError(f"model {path!r}: no such folder, and not a Hub model id that can be reached "
                          f"({type(err).__name__}). Give a folder written by `debiased-nli train` or a Hub id.") from err
    except Exception as err:  # a corrupt weights file, an unknown architecture
        from ..data.loading import root_cause
        raise ConfigError(f"model {path}: cannot load it ({root_cause(err)})") from err
    finally:
        transformers_logging.set_verbosity(verbosity)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ConfigError(f"model {path}: weights missing from the folder ({shown}), so they would be random and "
                          f"the scores meaningless; its classification head was never trained. Evaluate a model "
                          f"fine-tuned with `debiased-nli train`.")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    record_path = folder / "debiased_nli_train.json"
    try:
        record = json.loads(record_path.read_text()) if record_path.exists() else None
    except ValueError as err:
        raise ConfigError(f"{record_path} is not valid JSON ({err})") from err
    id2label = {int(i): str(l) for i, l in (model.config.id2label or {}).items()}
    if label_order is not None:
        if len(label_order) != len(id2label):
            raise ConfigError(f"--label-order names {len(label_order)} labels but {path} has {len(id2label)} outputs")
        id2label = dict(enumerate(label_order))
    elif id2label and all(l.upper().startswith("LABEL_") for l in id2label.values()):
        logger.warning("%s names its outputs %s; taking them to be the task's labels in the task's order. If "
                       "they are not, pass --label-order NAME,NAME,... (the label of each output, in order).",
                       path, ", ".join(id2label[i] for i in sorted(id2label)))
    return LoadedClassifier(path, model, tok, id2label, record)


def length_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """Row indices in order of length, cut into batches of at most ``batch_size`` rows and (when
    ``max_tokens`` is given) at most ``max_tokens`` padded tokens (rows x the longest row of the batch).

    Sorting by length keeps the padding small; the token budget lets batches of short rows (the
    Dasgupta sets, HANS) be large while batches of long rows (MNLI) stay within a fixed amount of work.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        stop = min(start + batch_size, len(order))
        if max_tokens:  # sorted ascending: the batch's longest row is its last one
            while stop - start > 1 and (stop - start) * lengths[order[stop - 1]] > max_tokens:
                stop = start + max(1, min(stop - start - 1, max_tokens // max(1, int(lengths[order[stop - 1]]))))
        batches.append(order[start:stop])
        start = stop
    return batches


def predict_probabilities(clf: LoadedClassifier, premises: Sequence[str], hypotheses: Sequence[str], *,
                          batch_size: int = 64, max_length: int = 128, max_tokens: int | None = None,
                          desc: str = "predict", progress: bool = True, dtype: str = "float32") -> np.ndarray:
    """softmax(f(premise, hypothesis)) for every row, rows x (model outputs), in the model's order.

    Every row is tokenized once (no padding); rows are then batched in order of token length
    (:func:`length_batches`) and each batch is padded to its own longest row (dynamic padding), so
    little compute goes to padding. Rows are returned in input order. ``dtype="bfloat16"`` runs the
    forward passes under bfloat16 autocast (:mod:`debiased_nli.utils.precision`; the probabilities stay float32).
    """
    import torch
    from tqdm.auto import tqdm

    from ..utils.precision import check_dtype, compute_context

    check_dtype(dtype, "evaluation dtype")

    n = len(premises)
    out = np.zeros((n, len(clf.id2label)), dtype=np.float32)
    if n == 0:
        return out
    tok = clf.tokenizer
    enc = tok(list(premises), list(hypotheses), truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    lengths = [len(x) for x in enc["input_ids"]]
    pad_values = {"input_ids": tok.pad_token_id if tok.pad_token_id is not None else 0, "attention_mask": 0,
                  "token_type_ids": getattr(tok, "pad_token_type_id", 0)}
    left = getattr(tok, "padding_side", "right") == "left"
    device = next(clf.model.parameters()).device
    batches = length_batches(lengths, batch_size, max_tokens)
    with torch.inference_mode(), compute_context(device, dtype), \
            tqdm(total=n, desc=desc, disable=not progress, unit="ex") as bar:
        for idx in batches:
            width = max(lengths[i] for i in idx)
            arrays = {}
            for k in keys:
                a = np.full((len(idx), width), pad_values[k], dtype=np.int64)
                for r, i in enumerate(idx):
                    row = enc[k][i]
                    if left:
                        a[r, width - len(row):] = row
                    else:
                        a[r, :len(row)] = row
                arrays[k] = torch.from_numpy(a).to(device)
            out[idx] = torch.softmax(clf.model(**arrays).logits.float(), dim=-1).cpu().numpy()
            bar.update(len(idx))
    return out


def set_predictions(spec: ChallengeSet, probs_model_order: np.ndarray, id2label: Mapping[int, str],
                    model_name: str = "model") -> tuple[np.ndarray, dict]:
    """The set-label prediction of each row and the label map used.

    ``probs_model_order`` columns follow the model's ``id2label``; they are reordered to the task's
    labels by name, the labels the set leaves out (``prediction_map: null``) are dropped, and the
    argmax is mapped onto the set's labels.
    """
    from .labels import map_model_labels

    task_labels = spec.model_labels
    order = map_model_labels(dict(id2label), task_labels, model_name)  # task label i = model output order[i]
    kept, targets = spec.prediction_indices()
    probs = probs_model_order[:, [order[i] for i in kept]]
    pred = np.asarray(targets, dtype=np.int64)[probs.argmax(axis=1)] if len(probs) else np.zeros(0, np.int64)
    label_map = {"model_output_to_task_label": {int(order[i]): task_labels[i] for i in range(len(task_labels))},
                 "task_label_to_set_label": {l: spec.prediction_map[l] for l in task_labels},
                 "set_labels": list(spec.labels)}
    return pred, label_map


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


def evaluate_models(model_paths: Sequence[str], sets: Sequence[ChallengeSet], cfg: EvalConfig | None = None) -> dict:
    """Score every model on every set; returns the ``results.json`` object (see :data:`SCHEMA`)."""
    import time

    cfg = cfg or EvalConfig()
    metric = load_metric()
    models = []
    per_set: dict[str, dict] = {}
    datasets_cache = {}
    for spec in sets:  # load (and check) every set first: a missing file fails before any prediction
        ds = load_challenge_set(spec, cfg.data_root)
        datasets_cache[spec.name] = (ds, sample_rows(ds, cfg.max_examples, cfg.sample_seed))
    for path in model_paths:
        clf = load_classifier(path, cfg.device, label_order=cfg.label_order)
        seed = (clf.train_record or {}).get("config", {}).get("seed")
        info = {"path": str(path), "seed": seed, "id2label": {str(k): v for k, v in clf.id2label.items()},
                "train": (clf.train_record or {}).get("result"), "train_config": (clf.train_record or {}).get("config"),
                "task": (clf.train_record or {}).get("task")}
        seconds = {}
        for spec in sets:
            full, ds = datasets_cache[spec.name]
            start = time.perf_counter()
            probs = predict_probabilities(clf, ds["premise"], ds["hypothesis"], batch_size=cfg.batch_size,
                                          max_length=cfg.max_length, max_tokens=cfg.max_tokens, desc=f"{Path(path).name} / {spec.name}",
                                          progress=cfg.progress, dtype=cfg.dtype)
            pred, label_map = set_predictions(spec, probs, clf.id2label, str(path))
            scores = score_predictions(spec, ds, pred, metric)
            seconds[spec.name] = round(time.perf_counter() - start, 2)
            source = challenge_source(spec, cfg.data_root)
            entry = per_set.setdefault(spec.name, {
                "n": len(ds), "n_total": len(full), "subsampled": len(ds) < len(full),
                "sample_seed": cfg.sample_seed if len(ds) < len(full) else None,
                "labels": list(spec.labels), "label_map": label_map, "task": spec.task,
                "source": source["path"] if source["kind"] == "local" else f"{source['path']}[{source['split']}]",
                "source_kind": source["kind"], "hub_dataset": source["hub_dataset"],
                "spec_version": spec.version, "runs": []})
            entry["runs"].append({"model": str(path), "seed": seed, **scores})
        info["eval_seconds"] = seconds
        models.append(info)
        del clf
    for name, entry in per_set.items():
        accs = np.array([r["accuracy"] for r in entry["runs"]])
        entry["accuracy"] = float(accs.mean())
        entry["accuracy_std"] = float(accs.std(ddof=1)) if len(accs) > 1 else 0.0
        entry["breakdowns"] = _mean_breakdowns(entry["runs"])
    return {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "models": models, "seeds": [m["seed"] for m in models], "num_models": len(models),
            "config": dataclasses.asdict(cfg), "sets": per_set, "versions": library_versions(),
            "git": git_hash()}


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
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{p} is not a JSON results file ({err}); give a results.json written by "
                          f"`debiased-nli evaluate`") from err
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
    text = env.get_template(template.name).render(
        title=title, columns=columns, rows=rows, breakdowns=breakdowns, results=results, notes=notes,
        models=results["models"], subsampled=any(e.get("subsampled") for e in results["sets"].values()))
    out = Path(out_dir) / "report.md"
    out.write_text(text)
    return out


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


def write_outputs(results: dict, out_dir: "str | Path", *, name: str = "this model",
                  compare: Mapping[str, dict] | None = None, title: str = "Evaluation report",
                  notes: str = "") -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return {"results": out / "results.json",
            "report": write_report(results, out, title=title, name=name, compare=compare, notes=notes),
            "chart": plot_results(results, out / "accuracy.png", name=name, compare=compare)}


# ------------------------------------------------------------------------------------ Hub push

def eval_results_for_card(results: dict, model_name: str) -> tuple[list, list[str]]:
    """``huggingface_hub.EvalResult`` entries for a card's ``model-index``, and the sets left out.

    Only a set whose scored rows are those of a Hub dataset (read from the Hub, or a local file its
    spec marks ``local_copy``) gets an entry, under that Hub id: a set without one is left out rather
    than published under an invented id. A score on a seeded sample says so in the dataset's name and
    ``args`` (rows scored, rows in the split, seed), so it is never read as a full-split score. Several
    models (seeds) give the mean as ``accuracy`` and the sample standard deviation (ddof=1) as a second
    metric, ``accuracy_std``; the seeds are in the metric's ``args``.
    """
    from huggingface_hub import EvalResult

    out, left_out = [], []
    for s, entry in results["sets"].items():
        hub = entry.get("hub_dataset")
        if not hub:
            left_out.append(s)
            continue
        n, n_total = int(entry["n"]), int(entry.get("n_total", entry["n"]))
        runs = entry.get("runs") or []
        dataset_args, name = None, s
        if entry.get("subsampled") or n < n_total:
            seed = entry.get("sample_seed", results.get("config", {}).get("sample_seed"))
            dataset_args = {"rows_scored": n, "rows_in_split": n_total, "sample": "seeded random sample",
                            "sample_seed": seed}
            name = f"{s} (random sample of {n:,} of {n_total:,} rows, seed {seed})"
        seeds = [r.get("seed") for r in runs]
        common = dict(task_type="text-classification",
                      task_name="Natural Language Inference" if entry.get("task") in ("snli", "mnli")
                      else "Text Classification",
                      dataset_type=hub["path"], dataset_name=name, dataset_config=hub.get("name"),
                      dataset_split=hub.get("split"), dataset_args=dataset_args, verified=False)
        several = len(runs) > 1
        out.append(EvalResult(**common, metric_type="accuracy", metric_value=round(entry["accuracy"], 6),
                              metric_name=f"Accuracy (mean over {len(runs)} seeds)" if several else "Accuracy",
                              metric_args={"num_models": len(runs), "seeds": seeds} if several else None))
        if several:
            out.append(EvalResult(**common, metric_type="accuracy_std", metric_value=round(entry["accuracy_std"], 6),
                                  metric_name=f"Accuracy std over {len(runs)} seeds (ddof=1)",
                                  metric_args={"num_models": len(runs), "seeds": seeds}))
    return out, left_out


def push_results(repo_id: str, results: dict, *, model_name: str | None = None, token: str | None = None,
                 revision: str | None = None, commit_message: str | None = None, create_pr: bool = False):
    """Write the results into the ``model-index`` of ``repo_id``'s model card (``huggingface_hub.ModelCard``).

    The card is read from the Hub (a new one is made if the repo has none); its eval results for the
    same sets are replaced, others are kept; the card body is left as it is. Sets whose rows are not a
    Hub dataset's are left out (see :func:`eval_results_for_card`). Returns (commit info, sets left out).
    """
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

    model_name = model_name or repo_id.split("/")[-1]
    try:
        card = ModelCard.load(repo_id, token=token)
    except (EntryNotFoundError, RepositoryNotFoundError):
        card = ModelCard.from_template(ModelCardData(model_name=model_name), model_id=model_name)
    new, left_out = eval_results_for_card(results, model_name)
    if not new:
        raise ConfigError(f"none of the scored sets ({', '.join(results['sets'])}) was read from a Hub dataset "
                          f"(or a local file marked as an exact copy of one), so there is nothing to put in the "
                          f"model-index under a real Hub id; results.json and report.md have the scores")
    for s in left_out:
        logger.warning("%s is not in the model-index: its rows are not those of a Hub dataset (see its spec's "
                       "hub.local_copy); its score is in report.md", s)
    replaced = {(r.dataset_name, r.metric_type) for r in new}
    kept = [r for r in (card.data.eval_results or []) if (r.dataset_name, r.metric_type) not in replaced]
    card.data.eval_results = kept + new
    card.data.model_name = card.data.model_name or model_name
    message = commit_message or f"Add debiased-nli evaluation results ({len({r.dataset_name for r in new})} sets)"
    info = card.push_to_hub(repo_id, token=token, revision=revision, commit_message=message, create_pr=create_pr)
    return info, left_out
