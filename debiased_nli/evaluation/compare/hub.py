"""The evaluation report beside a release on the Hub: ``compare report --push-to ORG/NAME`` commits the report
(markdown, JSON, plot) into the release's dataset repo under ``evaluation/``, with a README whose ``model-index``
holds each row's model's results and, in each result's arguments, the dataset revision that model trained on.

Which revision a row trained on is found from the rows themselves: for a row read from a release config, the
content fingerprint its units recorded (:func:`debiased_nli.data.loading.content_fingerprint` of the training
rows) is compared with that config's rows at each tag of the repo (``--revision``: that one only) until one
matches; a row trained on local files, or on a build that is not on the Hub, says so instead of naming a
revision. Sets whose scored rows are not those of a Hub dataset (a local stand-in) are left out of the
model-index, as ``debiased-nli evaluate --push-to`` does; a set scored without the rows the epoch was selected on
says so in its dataset name and arguments.
"""
from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

from ...utils.errors import ConfigError
from .plan import Plan

log = logging.getLogger(__name__)
FOLDER = "evaluation"


def _hub_dataset(plan: Plan, spec, unit_sets: dict) -> dict | None:
    recorded = unit_sets.get(spec.name) or {}
    if "hub_dataset" in recorded:
        return recorded["hub_dataset"]
    from ...models.challenge import challenge_source

    return challenge_source(spec, plan.data_root)["hub_dataset"]


class _Revisions:
    """The Hub revision (tag, else ``main``) of ``repo_id`` whose config holds exactly the rows a unit trained on."""

    def __init__(self, api, repo_id: str, plan: Plan, revision: str | None, endpoint: str | None, token: str | None):
        self.api, self.repo_id, self.plan, self.endpoint, self.token = api, repo_id, plan, endpoint, token
        refs = api.list_repo_refs(repo_id, repo_type="dataset")
        tags = [(t.name, t.target_commit) for t in refs.tags][::-1]   # the newest tag first
        branches = [(b.name, b.target_commit) for b in refs.branches if b.name == "main"]
        self.candidates = [(revision, None)] if revision else tags + branches
        self.fingerprints: dict[tuple[str, str], str | None] = {}

    def _fingerprint(self, rev: str, config: str) -> str | None:
        if (rev, config) not in self.fingerprints:
            from huggingface_hub import snapshot_download

            from ...data.loading import content_fingerprint
            from ...models.training import load_training_split

            try:
                folder = snapshot_download(self.repo_id, repo_type="dataset", revision=rev, token=self.token,
                                           endpoint=self.endpoint, allow_patterns=["README.md", f"data/{config}/*"])
                ds = load_training_split(self.plan.spec, release=folder, config=config)
                self.fingerprints[rev, config] = content_fingerprint(ds)
            except Exception as err:  # noqa: BLE001 - a revision without that config, or unreadable: no match
                log.info("%s@%s has no readable config %s: %s", self.repo_id, rev, config, err)
                self.fingerprints[rev, config] = None
        return self.fingerprints[rev, config]

    def find(self, config: str, fingerprint: str | None) -> tuple[str | None, str | None]:
        if not fingerprint:
            return None, None
        for rev, commit in self.candidates:
            if self._fingerprint(rev, config) == fingerprint:
                return rev, commit
        return None, None


def trained_on(plan: Plan, table: dict, revisions: _Revisions | None) -> dict[str, dict]:
    """Per finished row: what its models trained on (``dataset``, ``config``, ``revision``, ``commit`` where the rows
    are a Hub release's; else the files or the build), and a sentence saying so."""
    out: dict[str, dict] = {}
    for name, entry in table["rows"].items():
        if not entry.get("sets"):
            continue
        d = entry.get("data_revision") or {}
        fps = {f for f in (entry.get("data_fingerprints") or {}).values() if f}
        info: dict[str, Any] = {"content_fingerprint": d.get("content_fingerprint")}
        if d.get("kind") == "random_subset":
            base = out.get(d.get("of"), {})
            info |= {"subset": f"a random subset of `{d.get('of')}` of the size of `{entry['data'].get('size_of')}`"
                               + (", drawn anew per seed" if d.get("subset_seed_is_unit_seed") else f", seed {d.get('seed')}"),
                     **{k: base[k] for k in ("dataset", "config", "revision", "commit") if base.get(k)}}
            info["text"] = info["subset"] + (f" of {base['text']}" if base.get("text") else "")
        elif d.get("config"):
            rev, commit = (revisions.find(d["config"], d.get("content_fingerprint")) if revisions and len(fps) <= 1
                           else (None, None))
            info |= {"config": d["config"], "local_release": d.get("release"),
                     "release_manifest_sha256": d.get("release_manifest_sha256")}
            if rev:
                info |= {"dataset": revisions.repo_id, "revision": rev, "commit": commit}
                info["text"] = f"`{revisions.repo_id}` config `{d['config']}` at revision `{rev}`"
            elif len(fps) > 1:
                info["text"] = (f"config `{d['config']}` of local builds whose rows differ between seeds "
                                f"({len(fps)} fingerprints): no single Hub revision")
            else:
                info["text"] = (f"config `{d['config']}` of the local release `{d.get('release')}`, whose rows are not "
                                f"those of any revision of `{revisions.repo_id if revisions else 'the repo'}` checked")
        elif d.get("files"):
            info |= {"files": d["files"]}
            info["text"] = "the local file(s) " + ", ".join(f"`{f}`" for f in d["files"])
        else:
            info["text"] = f"the task's own `{d.get('split', 'train')}` split"
        out[name] = info
    return out


def model_index(plan: Plan, table: dict, trained: dict[str, dict]) -> tuple[list[dict], list[str]]:
    """The ``model-index`` entries (one per finished row: its model, trained with the plan's recipe on the row's data)
    and the sets left out (their rows are not a Hub dataset's)."""
    from huggingface_hub.repocard_data import eval_results_to_model_index

    from ...models.hub import accuracy_results
    from .units import load_units

    units = load_units(plan)
    specs = {s.name: s for s in plan.set_specs()}
    entries, left_out = [], set()
    for name, entry in table["rows"].items():
        if not entry.get("sets"):
            continue
        unit_sets = (units.get(name) or [{}])[0].get("sets") or {}
        results = []
        for s, cell in entry["sets"].items():
            hub = _hub_dataset(plan, specs[s], unit_sets) if s in specs else None
            if not hub:
                left_out.add(s)
                continue
            dataset_args, ds_name = None, s
            excluded, n = cell.get("excluded_rows") or 0, cell["n"]
            if excluded or cell.get("subsampled"):
                dataset_args = {"rows_scored": n}
                parts = []
                if excluded:
                    dataset_args["rows_left_out"] = excluded
                    dataset_args["why_left_out"] = "held out for epoch selection (the plan's select_on)"
                    parts.append(f"without the {excluded:,} rows the epoch was selected on")
                if cell.get("subsampled"):
                    dataset_args["sample"] = "seeded random sample"
                    parts.append("a seeded random sample")
                ds_name = f"{s} ({', '.join(parts)}; {n:,} rows)"
            seeds = entry["seeds_done"]
            args = {"seeds": seeds, "trained_on": {k: v for k, v in trained[name].items() if k != "text"}}
            common = dict(task_type="text-classification", task_name="Natural Language Inference",
                          dataset_type=hub["path"], dataset_name=ds_name, dataset_config=hub.get("name"),
                          dataset_split=hub.get("split"), dataset_args=dataset_args, verified=False)
            results += accuracy_results(common, cell["mean"], cell["std"], cell["n_seeds"], args)
        if results:
            entries += eval_results_to_model_index(f"{plan.model_name} trained on {name}", results)
    return entries, sorted(left_out)


def readme(plan: Plan, table: dict, report_md: str, repo_id: str, trained: dict[str, dict], index: list[dict],
           left_out: list[str]) -> str:
    import yaml

    meta = {"tags": ["debiased-nli", "evaluation"], "datasets": [repo_id], "model-index": index}
    lines = [f"# Evaluation: does training on `{repo_id}` help?", "",
             f"Written by `debiased-nli compare report --push-to {repo_id}` from the plan `{plan.path.name}`. One model "
             f"per row and seed ({plan.model_name}, the same recipe for every row), scored on the challenge sets below. "
             f"The `model-index` above holds each row's mean accuracy (and std over seeds) on the sets whose rows are a "
             f"Hub dataset's; each result's arguments name the data its models trained on.", "",
             "| row | trained on | seeds |", "|---|---|---|"]
    for name, info in trained.items():
        lines.append(f"| `{name}` | {info['text']} | {', '.join(map(str, table['rows'][name]['seeds_done']))} |")
    if left_out:
        lines += ["", "Not in the model-index (their scored rows are not a Hub dataset's): "
                  + ", ".join(f"`{s}`" for s in left_out) + "; their scores are in the report below."]
    body = report_md.split("\n", 1)[1] if report_md.startswith("# ") else report_md
    return ("---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n\n" + "\n".join(lines)
            + "\n\n## The report\n" + body)


def push_report(plan: Plan, table: dict, stem: Path, repo_id: str, *, revision: str | None = None,
                token: str | None = None, endpoint: str | None = None, api: Any = None) -> dict:
    """Commit ``evaluation/README.md`` (model-index + the report), ``evaluation/<stem>.md``, ``.json``, ``.png`` and
    ``<stem>_intervals.png`` into the dataset repo ``repo_id`` (which must exist: the release). Returns ``{commit, commit_url, files, notes}``."""
    from huggingface_hub import CommitOperationAdd, HfApi

    from ...release.publish import check_repo_id, hub_call
    from .report import intervals_path

    check_repo_id(repo_id, "--push-to")
    api = api or HfApi(token=token, endpoint=endpoint)

    def work():
        if not api.repo_exists(repo_id, repo_type="dataset"):
            raise ConfigError(f"{repo_id} is not a dataset repo on the Hub: push the release first "
                              f"(`debiased-nli push FOLDER --repo-id {repo_id}`), then its evaluation")
        revisions = _Revisions(api, repo_id, plan, revision, endpoint or api.endpoint, token)
        trained = trained_on(plan, table, revisions)
        index, left_out = model_index(plan, table, trained)
        md = stem.with_suffix(".md").read_text()
        ops = [CommitOperationAdd(path_in_repo=f"{FOLDER}/README.md",
                                  path_or_fileobj=readme(plan, table, md, repo_id, trained, index, left_out).encode())]
        for f in (*(stem.with_suffix(x) for x in (".md", ".json", ".png")), intervals_path(stem)):
            if f.exists():
                ops.append(CommitOperationAdd(path_in_repo=f"{FOLDER}/{f.name}", path_or_fileobj=str(f)))
        info = api.create_commit(repo_id, ops, repo_type="dataset",
                                 commit_message=f"debiased-nli evaluation report ({len(trained)} rows)")
        return info, ops, trained, index, left_out

    # every request of the push, the revisions' downloads included, inside the Hub deadline
    info, ops, trained, index, left_out = hub_call(work, what="the evaluation report",
                                                   endpoint=getattr(api, "endpoint", None) or endpoint)
    notes = [f"{name}: trained on {t['text']}" for name, t in trained.items()]
    if left_out:
        notes.append("not in the model-index (no Hub dataset with these rows): " + ", ".join(left_out))
    return {"commit": info.oid, "commit_url": str(info.commit_url), "files": [op.path_in_repo for op in ops],
            "notes": notes, "trained_on": trained, "model_index": index}


def read_model_index(text: str) -> list[dict]:
    """The ``model-index`` of a pushed ``evaluation/README.md`` (for tests and users)."""
    import yaml

    return yaml.safe_load(io.StringIO(text.split("---", 2)[1])).get("model-index") or []

