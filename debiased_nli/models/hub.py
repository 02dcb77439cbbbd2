"""Trained models on the Hub: the weights with their card (``train --push-to``), and their scores on the challenge
sets in the two forms the Hub reads (``evaluate --push-to``).

:func:`push_model` creates the model repo (if needed) and uploads, in **one commit**, the files ``train`` wrote for
the final model (each still the bytes it wrote: its marker says so), the card rendered for that repo id and the
training record with local paths reduced to file names; ``training_args.bin`` (a pickle) and the resume record stay
home. Evaluation results of earlier weights (``.eval_results/``, ``evaluation/``) are deleted in the same commit, and
``--push-revision`` tags it (tags are immutable, as a release's).

:func:`push_results` records **every** scored set, in one commit, following the Hub's two formats
(https://huggingface.co/docs/hub/model-cards, https://huggingface.co/docs/hub/eval-results):

* the card's ``model-index``: a set whose scored rows are a Hub split's under that dataset id, config and split; a
  local stand-in of a Hub split (the regenerated HANS) or a subset of one (SNLI-hard) under that dataset's id with
  no split, its name saying what was scored; any other set under its own name; each with ``source`` (a name that
  gives the file and its sha256, and the URL of the pushed ``evaluation/results.json``);
* ``.eval_results/<set>.yaml``: one file per set that has a Hub dataset to name (``dataset.id`` is required and
  must be a Hub dataset): the exact ones under a task id made of the split (``test``; ``mnli_validation_matched``),
  stand-ins and subsets under the set's own name as task id, with ``notes`` saying which rows; a set with no Hub
  dataset at all is in the model-index and the card's table only;
* ``evaluation/results.json`` and ``evaluation/report.md``, and a table of the sets in the card between its result
  markers (:func:`debiased_nli.models.card.with_results_section`).

A sample (``--max-examples``), rows left out, several seeds (mean, and std as a second metric) are said in the
dataset's name and arguments and in the notes. Every request runs inside
:func:`debiased_nli.utils.hub.hub_call` (a timeout per request, a deadline for the whole push).
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..utils.errors import ConfigError
from .card import CARD_FILE, render_model_card, results_table, with_results_section

log = logging.getLogger(__name__)

EVAL_FOLDER = "evaluation"          # results.json and report.md of the latest evaluate --push-to
EVAL_RESULTS_FOLDER = ".eval_results"
NOT_UPLOADED = ("training_args.bin",)  # a pickle of TrainingArguments (local paths); the card lists every value
DATA_SUFFIXES = (".parquet", ".npz", ".jsonl", ".csv")  # rows kept beside a model (compare's selection rows): not it
_VERSION_RE = re.compile(r"^v?\d+(\.\d+){0,2}([.-][0-9A-Za-z.]+)?$")
_OUR_EVAL_FILE = re.compile(rf"^(?:{re.escape(EVAL_RESULTS_FOLDER)}/[\w.-]+\.yaml|{EVAL_FOLDER}/(?:results\.json|report\.md))$")


# ------------------------------------------------------------------------------------ the model

def check_version_tag(revision: str | None, option: str) -> None:
    """A version tag (``v1.0``, ``1.2.0``) or None; a one-line error otherwise."""
    if revision is not None and not _VERSION_RE.match(str(revision)):
        raise ConfigError(f"{option} {revision!r} is not a version tag (e.g. v1.0 or 1.2.0)")


def model_files(folder: "str | Path") -> list[str]:
    """The files of a training folder to upload: the top-level files ``train`` wrote (:func:`~debiased_nli.utils.
    outputs.written_by_us`), less the resume record, :data:`NOT_UPLOADED` and rows (:data:`DATA_SUFFIXES`). A
    symbolic link, or a file of the tool's that was changed since it was written, stops the push naming it; a file
    the tool did not write (a note of the user's) is not uploaded. A folder without a trained model
    (``config.json``, its weights, the training record and the card) is refused."""
    from ..utils.outputs import marker_of, written_by_us
    from .training import RUN_FILE, TRAIN_CONFIG_FILE, is_run_folder

    folder = Path(folder)
    if not folder.is_dir() or not is_run_folder(folder):
        raise ConfigError(f"{folder} is not a training folder of debiased-nli (train one with `debiased-nli train "
                          f"... --out {folder}`)")
    files, changed, links = [], [], []
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".") or p.name in (RUN_FILE, *NOT_UPLOADED) or p.suffix in DATA_SUFFIXES:
            continue
        if p.is_symlink():
            links.append(p.name)
        elif p.is_file() and written_by_us(p):
            files.append(p.name)
        elif p.is_file() and marker_of(p).exists():
            changed.append(p.name)
    if links or changed:
        raise ConfigError(f"{folder} holds " + " and ".join(
            ([f"symbolic link(s) {', '.join(links)}"] if links else [])
            + ([f"file(s) changed since debiased-nli wrote them: {', '.join(changed)}"] if changed else []))
            + "; the push uploads exactly what `train` wrote (nothing was uploaded)")
    weights = [f for f in files if f.endswith((".safetensors", ".bin"))]
    missing = [f for f in ("config.json", TRAIN_CONFIG_FILE, CARD_FILE) if f not in files] + ([] if weights else
                                                                                             ["the weights"])
    if missing:
        raise ConfigError(f"{folder} has no trained model to push (missing: {', '.join(missing)}); rerun `debiased-nli "
                          f"train` into it until it finishes")
    return files


def push_model(folder: "str | Path", repo_id: str, *, revision: str | None = None, private: bool = False,
               token: str | None = None, endpoint: str | None = None, commit_message: str | None = None,
               api: Any = None) -> dict[str, Any]:
    """Upload a trained model (a ``train --out`` folder) to the model repo ``repo_id`` in one commit: its weights,
    config and tokenizer, the card (``README.md``, rendered for ``repo_id``) and ``debiased_nli_train.json`` (local
    paths reduced to file names); evaluation results of the repo's earlier weights are deleted in the same commit.
    ``revision`` tags the commit (a version such as ``v1.0``; an existing tag is refused). Returns ``{repo_id,
    commit, commit_url, tag, files, deleted}``."""
    from huggingface_hub import HfApi

    from ..utils.hub import check_repo_id, hub_call
    from ..utils.paths import public_paths, read_json
    from .training import TRAIN_CONFIG_FILE

    check_repo_id(repo_id, "--push-to")
    check_version_tag(revision, "--push-revision")
    folder = Path(folder)
    files = model_files(folder)
    record = read_json(folder / TRAIN_CONFIG_FILE, "the training record", kind=dict)
    card = render_model_card(record, folder, repo_id)
    record_bytes = (json.dumps(public_paths(record), indent=2) + "\n").encode()
    api = api or HfApi(token=token, endpoint=endpoint)

    def work():
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if revision is not None and any(t.name == revision for t in api.list_repo_refs(repo_id).tags):
            raise ConfigError(f"{repo_id} already has the tag {revision!r}; versions are immutable, choose a new "
                              f"--push-revision")
        ops = [CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=card.encode()),
               CommitOperationAdd(path_in_repo=TRAIN_CONFIG_FILE, path_or_fileobj=record_bytes)]
        ops += [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(folder / f))
                for f in files if f not in (CARD_FILE, TRAIN_CONFIG_FILE)]
        deleted = [p for p in _repo_files(api, repo_id) if _OUR_EVAL_FILE.match(p)]
        ops += [CommitOperationDelete(path_in_repo=p) for p in deleted]
        info = api.create_commit(repo_id, ops, commit_message=commit_message or f"debiased-nli model {revision or ''}"
                                 .strip(), repo_type="model")
        if revision is not None:
            api.create_tag(repo_id, tag=revision, revision=info.oid, tag_message=f"debiased-nli model {revision}")
        return info, deleted

    info, deleted = hub_call(work, what="the model push", endpoint=api.endpoint)
    if deleted:
        log.warning("deleted the evaluation results of %s's earlier weights (%s); `debiased-nli evaluate --push-to %s` "
                    "adds those of these weights", repo_id, ", ".join(deleted), repo_id)
    return {"repo_id": repo_id, "commit": info.oid, "commit_url": str(info.commit_url), "tag": revision,
            "files": sorted({CARD_FILE, TRAIN_CONFIG_FILE, *files}), "deleted": deleted}


def _repo_files(api, repo_id: str) -> list[str]:
    from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

    try:
        return list(api.list_repo_files(repo_id, repo_type="model"))
    except (RevisionNotFoundError, EntryNotFoundError):  # a repo without commits
        return []


# ------------------------------------------------------------------------------------ the results

def _hub_name(ref: Mapping[str, Any]) -> str:
    return f"{ref['path']}{'/' + ref['name'] if ref.get('name') else ''}" + (f"[{ref['split']}]" if ref.get("split")
                                                                              else "")


def result_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per scored set of ``results`` (``results.json``): ``set``, ``reference`` (:func:`~debiased_nli.models.
    challenge.hub_reference`; from ``hub_dataset`` for a results file written before it), ``data`` (markdown: which
    rows were scored), ``source`` (the same in a line: file and sha256, or Hub id), ``notes`` (sample, rows left
    out, seeds), ``n``, ``accuracy``, ``accuracy_std``, ``seeds``."""
    rows = []
    for s, entry in results["sets"].items():
        ref = dict(entry.get("hub_reference") or ({"relation": "exact", **entry["hub_dataset"]}
                                                  if entry.get("hub_dataset") else {"relation": None}))
        n, n_total = int(entry["n"]), int(entry.get("n_total", entry["n"]))
        runs = entry.get("runs") or []
        file = f"local file `{ref['file']}` (sha256 `{ref['file_sha256'][:12]}`)" if ref.get("file_sha256") else None
        relation = ref.get("relation")
        if relation == "exact":
            data = f"`{_hub_name(ref)}`" + (f", read from the {file}, an exact copy" if file else "")
            source = f"{_hub_name(ref)}" + (f" (local copy {ref['file']}, sha256 {ref['file_sha256'][:12]})"
                                             if file else "")
        else:
            data = file or f"the set `{s}` (`{entry.get('source', '?')}`)"
            if relation == "stand-in":
                data += f", standing in for `{_hub_name(ref)}` (not its rows)"
            elif relation == "subset":
                data += f", rows taken from `{_hub_name(ref)}`"
            source = f"{s}: " + (f"local file {ref['file']} (sha256 {ref['file_sha256'][:12]})" if file
                                 else str(entry.get("source", "?")))
        notes = []
        if relation == "stand-in":
            notes.append(f"scored on a local stand-in for {_hub_name(ref)}, not its rows")
        elif relation == "subset":
            notes.append(f"a subset of {_hub_name(ref)}")
        if relation not in ("exact", None) and ref.get("file_sha256"):
            notes.append(f"file {ref['file']}, sha256 {ref['file_sha256']}")
        if entry.get("excluded_rows"):
            notes.append(f"without the {entry['excluded_rows']:,} rows the epoch was selected on")
        if entry.get("subsampled") or n < n_total:
            notes.append(f"a seeded random sample of {n:,} of {n_total:,} rows (seed "
                         f"{entry.get('sample_seed', (results.get('config') or {}).get('sample_seed'))})")
        if len(runs) > 1:
            notes.append(f"mean over {len(runs)} seeds ({', '.join(str(r.get('seed')) for r in runs)}), std "
                         f"{entry.get('accuracy_std', 0.0):.4f}")
        rows.append({"set": s, "reference": ref, "data": data, "source": source, "notes": notes, "n": n,
                     "n_total": n_total, "accuracy": float(entry["accuracy"]),
                     "accuracy_std": float(entry.get("accuracy_std", 0.0)), "seeds": max(len(runs), 1),
                     "seed_values": [r.get("seed") for r in runs], "task": entry.get("task"),
                     "excluded_rows": entry.get("excluded_rows") or 0,
                     "sample_seed": entry.get("sample_seed", (results.get("config") or {}).get("sample_seed"))})
    return rows


def model_index_results(rows: Sequence[Mapping[str, Any]], source_url: str) -> list:
    """``huggingface_hub.EvalResult`` entries of the card's ``model-index`` for :func:`result_rows` (see the module
    docstring: which dataset id, config and split each set is published under)."""
    out = []
    for r in rows:
        ref, s, n = r["reference"], r["set"], r["n"]
        exact = ref.get("relation") == "exact"
        args: dict[str, Any] = {}
        parts = []
        if not exact:
            args.update({k: ref[k] for k in ("file", "file_sha256") if ref.get(k)})
            if ref.get("relation"):
                args["relation"] = f"{ref['relation']} of {_hub_name(ref)}"
            what = {"stand-in": "local stand-in for ", "subset": "subset of "}.get(ref.get("relation"))
            parts.append((what + _hub_name(ref) if what and ref.get("path") else "local file")
                         + (f", sha256 {ref['file_sha256'][:12]}" if ref.get("file_sha256") else ""))
        if r["excluded_rows"]:
            args.update(rows_left_out=r["excluded_rows"], why_left_out="held out for epoch selection")
            parts.append(f"without the {r['excluded_rows']:,} rows the epoch was selected on")
        if n < r["n_total"]:
            args.update(rows_scored=n, rows_in_split=r["n_total"], sample="seeded random sample",
                        sample_seed=r["sample_seed"])
            parts.append(f"random sample of {n:,} of {r['n_total']:,} rows, seed {r['sample_seed']}")
        name = f"{s} ({'; '.join(parts)})" if parts else s
        common = dict(task_type="text-classification",
                      task_name="Natural Language Inference" if r.get("task") in ("snli", "mnli")
                      else "Text Classification",
                      dataset_type=ref["path"] if ref.get("path") else s, dataset_name=name,
                      dataset_config=ref.get("name") if ref.get("path") else None,
                      dataset_split=ref.get("split") if exact else None, dataset_args=args or None, verified=False,
                      source_name=f"debiased-nli evaluate: {r['source']}", source_url=source_url)
        args = {"num_models": r["seeds"], "seeds": r["seed_values"]} if r["seeds"] > 1 else None
        out += accuracy_results(common, r["accuracy"], r["accuracy_std"], r["seeds"], args)
    return out


def accuracy_results(common: Mapping[str, Any], accuracy: float, std: float, seeds: int,
                     metric_args: Mapping[str, Any] | None) -> list:
    """The ``EvalResult`` s of one set (``common``: its task, dataset and source): the accuracy (the mean over the seeds
    when there are several) and, for several seeds, their sample standard deviation (ddof=1) as ``accuracy_std``."""
    from huggingface_hub import EvalResult

    several = seeds > 1
    out = [EvalResult(**common, metric_type="accuracy", metric_value=round(accuracy, 6),
                      metric_name=f"Accuracy (mean over {seeds} seeds)" if several else "Accuracy",
                      metric_args=dict(metric_args) if metric_args else None)]
    if several:
        out.append(EvalResult(**common, metric_type="accuracy_std", metric_value=round(std, 6),
                              metric_name=f"Accuracy std over {seeds} seeds (ddof=1)",
                              metric_args=dict(metric_args) if metric_args else None))
    return out


def eval_results_files(rows: Sequence[Mapping[str, Any]], source_url: str, date: str | None = None
                       ) -> tuple[dict[str, str], list[str]]:
    """``({".eval_results/<set>.yaml": YAML text}, sets left out)``: the Hub's newer format, one file per set that has
    a Hub dataset to name (huggingface_hub's ``EvalResultEntry`` and ``eval_result_entries_to_yaml`` write it)."""
    import yaml
    from huggingface_hub import EvalResultEntry, eval_result_entries_to_yaml

    files, left_out = {}, []
    for r in rows:
        ref = r["reference"]
        if not ref.get("path"):
            left_out.append(r["set"])
            continue
        exact = ref.get("relation") == "exact"
        task_id = (f"{ref['name']}_{ref['split']}" if ref.get("name") else ref["split"]) if exact else r["set"]
        entry = EvalResultEntry(dataset_id=ref["path"], task_id=task_id, value=round(r["accuracy"], 6), date=date,
                                source_url=source_url, source_name=f"debiased-nli evaluate: {r['source']}"[:200],
                                notes="; ".join(r["notes"]) or None)
        files[f"{EVAL_RESULTS_FOLDER}/{r['set']}.yaml"] = yaml.safe_dump(eval_result_entries_to_yaml([entry]),
                                                                          sort_keys=False, allow_unicode=True)
    return files, left_out


def _new_card(repo_id: str) -> str:
    name = repo_id.split("/")[-1]
    return (f"---\nlibrary_name: transformers\npipeline_tag: text-classification\ntags:\n- debiased-nli\n---\n\n# {name}"
            f"\n\nScores of this model on challenge sets, written by debiased-nli.\n")


def push_results(repo_id: str, results: Mapping[str, Any], *, report_md: str | None = None,
                 model_name: str | None = None, token: str | None = None, endpoint: str | None = None,
                 private: bool = False, commit_message: str | None = None, api: Any = None) -> dict[str, Any]:
    """Record an evaluation (``results.json``, :func:`debiased_nli.evaluation.scores.evaluate_models`) in the model
    repo ``repo_id``, creating it if needed, in one commit: the card's ``model-index`` (results of the same sets
    replaced, others kept; the card's text kept, its result table replaced), ``.eval_results/<set>.yaml``,
    ``evaluation/results.json`` (local paths reduced to file names) and ``evaluation/report.md`` (``report_md``).
    Returns ``{repo_id, commit, commit_url, files, sets, not_in_eval_results}``."""
    from huggingface_hub import HfApi, ModelCard

    from ..utils.hub import check_repo_id, hub_call
    from ..utils.paths import public_paths

    check_repo_id(repo_id, "--push-to")
    if not results.get("sets"):
        raise ConfigError("the evaluation scored no set; nothing to push")
    api = api or HfApi(token=token, endpoint=endpoint)
    source_url = f"{api.endpoint.rstrip('/')}/{repo_id}/blob/main/{EVAL_FOLDER}/results.json"
    rows = result_rows(results)
    new = model_index_results(rows, source_url)
    eval_files, left_out = eval_results_files(rows, source_url, results.get("created"))
    results_bytes = (json.dumps(public_paths(dict(results)), indent=2) + "\n").encode()

    def work():
        from huggingface_hub import CommitOperationAdd

        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        text = _remote_card(api, repo_id)
        card = ModelCard(text if text is not None else _new_card(repo_id))
        sets = {r["set"] for r in rows}
        kept = [e for e in (card.data.eval_results or []) if (e.dataset_name or "").split(" (")[0] not in sets]
        card.data.eval_results = kept + new
        card.data.model_name = card.data.model_name or model_name or repo_id.split("/")[-1]
        card.text = with_results_section(card.text, results_table(rows))
        ops = [CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=str(card).encode()),
               CommitOperationAdd(path_in_repo=f"{EVAL_FOLDER}/results.json", path_or_fileobj=results_bytes)]
        if report_md is not None:
            ops.append(CommitOperationAdd(path_in_repo=f"{EVAL_FOLDER}/report.md", path_or_fileobj=report_md.encode()))
        ops += [CommitOperationAdd(path_in_repo=p, path_or_fileobj=t.encode()) for p, t in eval_files.items()]
        message = commit_message or f"debiased-nli evaluation results ({len(rows)} sets)"
        return api.create_commit(repo_id, ops, commit_message=message, repo_type="model"), ops

    info, ops = hub_call(work, what="the evaluation push", endpoint=api.endpoint)
    return {"repo_id": repo_id, "commit": info.oid, "commit_url": str(info.commit_url),
            "files": [op.path_in_repo for op in ops], "sets": [r["set"] for r in rows], "not_in_eval_results": left_out}


def _remote_card(api, repo_id: str) -> str | None:
    """The repo's ``README.md`` on its main branch (None: no such file, or a repo without commits)."""
    import tempfile

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from ..utils.hub import TIMEOUT_ENV, env_seconds
    from ..utils.paths import read_text

    with tempfile.TemporaryDirectory() as cache:  # never a stale copy of another server's card
        try:
            path = hf_hub_download(repo_id, CARD_FILE, repo_type="model", endpoint=api.endpoint, token=api.token,
                                   cache_dir=cache, etag_timeout=env_seconds(TIMEOUT_ENV, 60))
        except LocalEntryNotFoundError as err:  # the Hub could not be reached: not "no card" (it would be replaced)
            raise ConfigError(f"could not read {CARD_FILE} of {repo_id} from {api.endpoint}: {err}") from err
        except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
            return None
        return read_text(path, f"{CARD_FILE} of {repo_id} on the Hub")
