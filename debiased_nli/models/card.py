"""The model card of a trained classifier: ``README.md`` beside the weights, as the Hub reads it.

``train`` writes it from the run's record (``debiased_nli_train.json``): the Hub metadata (``base_model`` where the
model was a Hub id, ``datasets`` where the rows are a Hub dataset's, ``library_name``, ``pipeline_tag``, tags), then
what the model was trained on (the release's repo id and version or revision, its config and split, or the files
with their sha256, with the content fingerprint of the rows), every hyper-parameter with its source, and the dev
accuracy. ``train --push-to`` uploads it with the weights (:func:`debiased_nli.models.hub.push_model`), the repo id
put into its usage snippet; ``evaluate --push-to`` adds the ``model-index``, ``.eval_results/`` and a results table
between the card's result markers (:func:`with_results_section`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

CARD_FILE = "README.md"
RESULTS_START = "<!-- debiased-nli:results:start -->"
RESULTS_END = "<!-- debiased-nli:results:end -->"
NLI_TASKS = ("snli", "mnli", "demo")
_HIDDEN = ("model", "output_dir", "progress", "num_threads", "use_cpu", "resume")  # not hyper-parameters


def placeholder_repo_id(folder: "str | Path") -> str:
    """What the usage snippet of an unpushed card names (``<org>/<folder name>``); a push replaces it."""
    return f"<org>/{Path(folder).resolve().name}"


def is_hub_model_id(ref: str) -> bool:
    """Whether ``ref`` names a Hub model (``NAME`` or ``ORG/NAME``), not a local folder: only then is it the card's
    ``base_model`` (the Hub checks that ``base_model`` is a model on the Hub)."""
    from ..utils.paths import NAME_RE

    if Path(ref).expanduser().exists() or ref.startswith((".", "/", "~")):
        return False
    parts = ref.split("/")
    return 1 <= len(parts) <= 2 and all(NAME_RE.fullmatch(p) for p in parts)


def data_text(src: Mapping[str, Any] | None) -> str:
    """One line saying what a split's rows were (:func:`debiased_nli.models.training.training_source`)."""
    if not src:
        return "rows whose source was not recorded"
    kind = src.get("type")
    if kind == "release":  # a local folder: what it was built as, never a Hub revision it may not match
        built = f", built for `{src['repo_id']}`" if src.get("repo_id") else ""
        version = f", release version `{src['version']}`" if src.get("version") else ""
        sha = f" (manifest.json sha256 `{str(src['manifest_sha256'])[:12]}`)" if src.get("manifest_sha256") else ""
        return f"config `{src.get('config')}` of the local release `{src.get('release')}`{built}{version}, " \
               f"split `{src.get('split')}`{sha}"
    if kind == "hub_release":
        rev = f" at revision `{src['revision']}`" if src.get("revision") else " (main branch)"
        return f"config `{src.get('config')}` of the Hub dataset `{src.get('repo_id')}`{rev}, split `{src.get('split')}`"
    if kind == "hub":
        name = f"/{src['name']}" if src.get("name") else ""
        rev = f" at revision `{src['revision']}`" if src.get("revision") else ""
        return f"the Hub dataset `{src.get('path')}{name}`{rev}, split `{src.get('split')}`"
    files = src.get("files") or []
    return "the local file(s) " + ", ".join(f"`{f.get('file')}` (sha256 `{str(f.get('sha256'))[:12]}`)"
                                            for f in files) if files else "local files"


def hub_datasets(record: Mapping[str, Any]) -> list[str]:
    """The Hub datasets a model's training rows were read from (the card's ``datasets:``): a Hub release or the
    task's Hub dataset; not the repo a local release folder was built for (its rows may not be that repo's)."""
    out = []
    for src in (record.get("data") or {}).values():
        if not isinstance(src, Mapping):
            continue
        repo = src.get("repo_id") if src.get("type") == "hub_release" else \
            src.get("path") if src.get("type") == "hub" else None
        if repo and repo not in out:
            out.append(repo)
    return out


def hyper_parameters(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``[{name, value, source}]`` for every hyper-parameter of the run (the PoE ones only with PoE)."""
    cfg, sources = record.get("config") or {}, record.get("sources") or {}
    rows = []
    for name, value in cfg.items():
        if name in _HIDDEN or (name in ("poe_beta", "poe_gamma", "bias_model") and not cfg.get("poe")):
            continue
        source = sources.get(name) or ("given" if name in sources else "project's default")
        rows.append({"name": name, "value": value if not isinstance(value, list) else tuple(value),
                     "source": " ".join(str(source).split()).replace("|", "\\|")})
    return rows


def card_metadata(record: Mapping[str, Any]):
    """The card's Hub metadata (``huggingface_hub.ModelCardData``)."""
    from huggingface_hub import ModelCardData

    model = str((record.get("config") or {}).get("model", ""))
    task = record.get("task")
    return ModelCardData(
        base_model=model if is_hub_model_id(model) else None, datasets=hub_datasets(record) or None,
        library_name="transformers", pipeline_tag="text-classification", language=["en"],
        tags=["debiased-nli", "text-classification"] + (["natural-language-inference"] if task in NLI_TASKS else []))


def render_model_card(record: Mapping[str, Any], folder: "str | Path", repo_id: str | None = None) -> str:
    """The text of ``README.md`` for the run recorded in ``record`` (``debiased_nli_train.json``)."""
    import jinja2

    from .. import __version__
    from ..data.tasks import get_task
    from ..utils.provenance import project_url
    from ..utils.resources import templates_dir

    cfg = record.get("config") or {}
    model = str(cfg.get("model", ""))
    try:
        description = get_task(record["task"]).description
    except Exception:  # noqa: BLE001 - a task given by --columns/--labels: its name
        description = str(record.get("task"))
    data = record.get("data") or {}
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    body = env.get_template("model_card.md.j2").render(
        name=(repo_id or placeholder_repo_id(folder)).split("/")[-1], repo_id=repo_id or placeholder_repo_id(folder),
        task_line=f"{record.get('task')} ({str(description).rstrip('.')})", labels=list(record.get("labels") or []),
        base_text=f"[`{model}`](https://huggingface.co/{model})" if is_hub_model_id(model)
        else f"the local model folder `{Path(model).name}`",
        version=__version__, project_url=project_url(), train_text=data_text(data.get("train")),
        dev_text=data_text(data.get("dev")) if data.get("dev") else None, result=_Attrs(record.get("result") or {}),
        train_fingerprint=record.get("train_fingerprint"), dev_fingerprint=record.get("dev_fingerprint"),
        hyper=hyper_parameters(record), world_size=record.get("world_size", 1),
        versions=_Attrs(record.get("versions") or {}), poe=bool(cfg.get("poe")),
        results_start=RESULTS_START, results_end=RESULTS_END)
    return f"---\n{card_metadata(record).to_yaml().rstrip()}\n---\n\n{body}"


class _Attrs(dict):
    """A mapping whose keys the template reads as attributes (``result.dev_accuracy``), None where absent."""

    def __getattr__(self, name):
        return self.get(name)


def write_model_card(folder: Path, record: Mapping[str, Any]) -> Path:
    """``README.md`` in a training folder, written whole with its marker, never over a file this tool did not write
    (:class:`~debiased_nli.utils.outputs.OwnFiles`)."""
    from ..utils.outputs import OwnFiles

    path = Path(folder) / CARD_FILE
    with OwnFiles([path], what=f"--out {folder}") as own:
        own.write_text(path, render_model_card(record, folder))
    return path


def with_results_section(card_text: str, table: str) -> str:
    """``card_text`` (a model card's body or whole text) with ``table`` between its result markers, or appended as a
    section ``## Evaluation results`` where it has none (a card this tool did not write)."""
    block = f"{RESULTS_START}\n{table.rstrip()}\n{RESULTS_END}"
    if card_text.count(RESULTS_START) == 1 and card_text.count(RESULTS_END) == 1 and \
            card_text.index(RESULTS_START) < card_text.index(RESULTS_END):
        head, rest = card_text.split(RESULTS_START, 1)
        return head + block + rest.split(RESULTS_END, 1)[1]
    return card_text.rstrip("\n") + "\n\n## Evaluation results\n\n" + block + "\n"


def results_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table of an evaluation's sets (:func:`debiased_nli.models.hub.result_rows`)."""
    lines = ["| set | data scored | rows | accuracy |", "|---|---|---:|---:|"]
    for r in rows:
        acc = f"{100 * r['accuracy']:.1f}" + (f" ± {100 * r['accuracy_std']:.1f}" if r.get("seeds", 1) > 1 else "")
        lines.append(f"| `{r['set']}` | {r['data']} | {r['n']:,} | {acc} |")
    return "\n".join(lines) + "\n\nAccuracy in percent" + (" (mean ± std over seeds)" if any(
        r.get("seeds", 1) > 1 for r in rows) else "") + "; the full results, with breakdowns, are in " \
        "[`evaluation/results.json`](evaluation/results.json) and [`evaluation/report.md`](evaluation/report.md)."
