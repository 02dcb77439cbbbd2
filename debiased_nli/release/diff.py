"""What changed between two releases: ``debiased-nli diff OLD NEW`` (issue 32).

Two releases, each a folder written by ``debiased-nli build`` or a Hub dataset repo at a revision
(``ORG/NAME@REVISION``, fetched with ``huggingface_hub.snapshot_download``; ``ORG/NAME`` alone is its
main branch), are compared config by config and split by split:

* **rows**: matched by ``uid``; rows whose uids differ are matched by content (a hash of premise and
  hypothesis), so a row that was re-indexed counts as moved, not as removed and added. A matched row
  whose text changed counts as *edited*, one whose label changed as *relabelled*;
* **labels**: each label's count before and after;
* **biased features**: the top features per label by z (the release's z-statistics,
  :mod:`debiased_nli.bias.zstats`, over the task's lexical features, computed from the rows: the
  hypothesis-only feature is left out, its predictions are not stored in a release), with their z in
  each release;
* **build**: which recipe settings, inputs (file names and sha256), seed, library versions and
  hypothesis-only model (from each ``manifest.json``) differ.

The result renders as markdown a maintainer can paste into a release note (:meth:`ReleaseDiff.markdown`)
and as one line (:meth:`ReleaseDiff.summary`, what ``push --diff-against`` writes into the version
history). Two releases are *identical* when every config and split has the same rows (same uids, same
text, same labels), whatever their manifests say.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..utils.errors import ConfigError

_HUB_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[^\s@]+)?$")
# manifest keys of a build compared as "build" changes (history, files and counts are compared as rows)
_RECIPE_IGNORED = ("history",)


# ------------------------------------------------------------------------------------------ reading releases

@dataclasses.dataclass
class Release:
    """One side of a diff: a release folder (downloaded from the Hub for ``ORG/NAME@REV``) and its manifest."""

    spec: str
    path: Path
    manifest: dict
    hub: bool = False

    @property
    def label(self) -> str:
        """How the diff names it: ``ORG/NAME@REV`` as given, a folder by its name and version (no local path:
        the name goes into a public release note)."""
        if self.hub:
            return self.spec
        history = self.manifest.get("history") or []
        version = history[-1].get("version") if history and isinstance(history[-1], dict) else None
        name = Path(self.spec).resolve().name
        return f"{name} ({version})" if version else name

    def configs(self) -> dict[str, dict[str, list[str]]]:
        """config -> split -> data file paths (relative), in the manifest's order."""
        return {c: {s: [f["path"] for f in files] for s, files in splits.items()}
                for c, splits in self.manifest["files"].items()}


def open_release(spec: str) -> Release:
    """A release folder, or ``ORG/NAME[@REVISION]`` on the Hub. Bad input raises a one-line
    :class:`ConfigError` naming the file or repo."""
    path, hub = Path(spec), False
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{spec}: not a folder; give a release folder written by `debiased-nli build` "
                              f"or a Hub repo as ORG/NAME@REVISION")
    elif _HUB_RE.match(spec) and not spec.startswith((".", "/")):
        path, hub = _download(spec), True
    else:
        raise ConfigError(f"{spec}: no such release folder (nor a Hub repo written as ORG/NAME@REVISION)")
    from ..utils.paths import check_name, read_json, release_file

    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise ConfigError(f"{manifest_path}: missing; {spec} is not a release folder written by `debiased-nli build`")
    manifest = read_json(manifest_path, "manifest", kind=dict)
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(s, dict) and all(isinstance(fs, list) for fs in s.values())
                                              for s in files.values()):
        raise ConfigError(f"{manifest_path}: has no `files` table of configs and splits; not a release's manifest")
    for config, splits in files.items():
        check_name(config, f"{manifest_path}: config")
        for split, fs in splits.items():
            check_name(split, f"{manifest_path}: files.{config}: split")
            for f in fs:
                if not isinstance(f, dict) or "path" not in f:
                    raise ConfigError(f"{manifest_path}: files.{config}.{split} lists an entry without a path")
                # inside the release, a regular file, the bytes the manifest records
                release_file(path, f["path"], sha256=f.get("sha256") if "sha256" in f else None,
                             what=f"{manifest_path}: files.{config}.{split}:",
                             links_within=path.parent.parent if hub else None)  # a snapshot: links into blobs/
    return Release(spec, path, manifest, hub)


def _download(spec: str) -> Path:
    repo_id, _, revision = spec.partition("@")
    from huggingface_hub import snapshot_download

    from ..utils.hub import hub_call

    def work():
        return Path(snapshot_download(repo_id, repo_type="dataset", revision=revision or None,
                                      allow_patterns=["manifest.json", "README.md", "data/**"]))

    try:  # inside the Hub deadline: a server that trickles ends it in bounded time
        return hub_call(work, what=f"the download of {spec}")
    except ConfigError as err:
        if spec in str(err):
            raise
        raise ConfigError(f"{spec}: cannot download this release from the Hub ({err})") from None
    except Exception as err:  # unknown repo or revision, refused: one line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{spec}: cannot download this release from the Hub ({type(err).__name__}: {first})") from err


def _read_rows(release: Release, files: Sequence[str]):
    """The rows of one config split as one Arrow table (premise, hypothesis, label and uid when present)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for rel in files:
        p = release.path / rel
        try:
            t = pq.read_table(p)
        except Exception as err:
            raise ConfigError(f"{p}: cannot read it as Parquet ({type(err).__name__}: {err})") from err
        missing = [c for c in ("premise", "hypothesis", "label") if c not in t.column_names]
        if missing:
            raise ConfigError(f"{p}: lacks the column(s) {missing} of a release's data file")
        tables.append(t.select([c for c in ("premise", "hypothesis", "label", "uid") if c in t.column_names]))
    if not tables:
        return pa.table({"premise": pa.array([], pa.string()), "hypothesis": pa.array([], pa.string()),
                         "label": pa.array([], pa.int64())})
    try:
        return pa.concat_tables(tables, promote_options="default")
    except Exception as err:
        raise ConfigError(f"{release.path / files[0]}: its shards do not share one schema ({err})") from err


def _label_names(release: Release, files: Sequence[str], task) -> list[str] | None:
    """The label names a release's data files declare (their `datasets` metadata), else the task's."""
    import pyarrow.parquet as pq

    for rel in files[:1]:
        try:  # an unreadable file is reported by _read_rows, naming it
            meta = pq.read_schema(release.path / rel).metadata or {}
        except Exception:
            break
        try:
            feats = json.loads(meta[b"huggingface"])["info"]["features"]
            names = feats["label"].get("names")
            if names:
                return [str(n) for n in names]
        except (KeyError, ValueError, TypeError, AttributeError):
            pass
    return list(task.labels) if task is not None else None


def _task_of(release: Release):
    from ..data.tasks import get_task

    name = None
    inputs = release.manifest.get("inputs") or []
    if inputs and isinstance(inputs[0], dict):
        name = inputs[0].get("task")
    name = name or (release.manifest.get("recipe") or {}).get("task")
    if not isinstance(name, str):
        return None
    try:
        return get_task(name)
    except Exception:
        return None


# ------------------------------------------------------------------------------------------ comparing rows

def _content_keys(table) -> np.ndarray:
    """A content hash of each row's premise and hypothesis (the label is compared separately)."""
    prem = table.column("premise").to_pylist()
    hyp = table.column("hypothesis").to_pylist()
    return np.array([hashlib.blake2b(f"{p}\x1f{h}".encode(), digest_size=12).hexdigest() for p, h in zip(prem, hyp)],
                    dtype=object)


@dataclasses.dataclass
class SplitDiff:
    config: str
    split: str
    old_rows: int | None      # None: the config/split is not in that release
    new_rows: int | None
    kept: int = 0             # matched rows (same uid, or same content where the uids differ)
    moved: int = 0            # ... of which matched by content only (their uid changed)
    added: int = 0
    removed: int = 0
    edited: int = 0           # same uid, other premise/hypothesis
    relabelled: int = 0       # matched, other label
    labels_old: dict = dataclasses.field(default_factory=dict)
    labels_new: dict = dataclasses.field(default_factory=dict)
    features: list = dataclasses.field(default_factory=list)   # [{label, feature, z_old, n_old, z_new, n_new, top}]
    max_abs_z: tuple = (None, None)

    @property
    def identical(self) -> bool:
        return (self.old_rows is not None and self.new_rows is not None and self.old_rows == self.new_rows
                and self.added == self.removed == self.edited == self.relabelled == self.moved == 0)


def compare_rows(old, new, names: Sequence[str] | None) -> dict[str, Any]:
    """Row-level comparison of two Arrow tables (see :class:`SplitDiff`'s fields)."""
    from collections import defaultdict

    def label_counts(t):
        counts = np.bincount(np.asarray(t.column("label").to_numpy(zero_copy_only=False), np.int64),
                             minlength=len(names or ())) if t.num_rows else np.zeros(len(names or ()), np.int64)
        return {(names[i] if names and i < len(names) else str(i)): int(c) for i, c in enumerate(counts)}

    out = {"old_rows": old.num_rows, "new_rows": new.num_rows, "labels_old": label_counts(old),
           "labels_new": label_counts(new)}
    old_c, new_c = _content_keys(old), _content_keys(new)
    old_l = np.asarray(old.column("label").to_numpy(zero_copy_only=False))
    new_l = np.asarray(new.column("label").to_numpy(zero_copy_only=False))
    has_uid = "uid" in old.column_names and "uid" in new.column_names
    old_u = old.column("uid").to_pylist() if has_uid else [None] * old.num_rows
    new_u = new.column("uid").to_pylist() if has_uid else [None] * new.num_rows
    by_uid = defaultdict(list)
    for i, u in enumerate(new_u):
        if u is not None:
            by_uid[u].append(i)
    old_left, new_used = [], np.zeros(new.num_rows, bool)
    kept = edited = relabelled = 0
    for i, u in enumerate(old_u):
        js = by_uid.get(u) if u is not None else None
        if js:
            j = js.pop()
            new_used[j] = True
            kept += 1
            edited += old_c[i] != new_c[j]
            relabelled += old_l[i] != new_l[j]
        else:
            old_left.append(i)
    # rows whose uids did not match: by content
    by_content = defaultdict(list)
    for j in np.nonzero(~new_used)[0]:
        by_content[new_c[j]].append(j)
    moved = 0
    for i in old_left:
        js = by_content.get(old_c[i])
        if js:
            j = js.pop()
            new_used[j] = True
            moved += 1
            relabelled += old_l[i] != new_l[j]
    out.update(kept=kept + moved, moved=moved, removed=len(old_left) - moved, added=int((~new_used).sum()),
               edited=int(edited), relabelled=int(relabelled))
    return out


def _features(tables: Sequence, task, names: Sequence[str], top_k: int) -> tuple[list, tuple]:
    """The top-``top_k`` features per label by z in each table (union), with their z and n in both."""
    import datasets

    from ..bias.features import HYPO_ONLY_COLUMN, build_feature_matrices, extract_table, get_extractor
    from ..bias.zstats import compute_zstats

    lexical = [n for n in task.features if HYPO_ONLY_COLUMN not in get_extractor(n).requires]
    feats = [datasets.Dataset(extract_table(t.select(["premise", "hypothesis"]), lexical, names)) for t in tables]
    mats = build_feature_matrices(feats)
    stats = [compute_zstats(fm, np.asarray(t.column("label").to_numpy(zero_copy_only=False), np.int64), names)
             for fm, t in zip(mats, tables)]
    rows = []
    for l, name in enumerate(names):
        tops = [s.top_k(top_k)[l] for s in stats]
        ids = []
        for top in tops:
            ids += [int(i) for i in top if i >= 0 and int(i) not in ids]
        for i in ids:
            rows.append({"label": name, "feature": str(stats[0].vocab[i]),
                         "z_old": round(float(stats[0].z[i, l]), 2) if stats[0].n[i] else None, "n_old": int(stats[0].n[i]),
                         "z_new": round(float(stats[1].z[i, l]), 2) if stats[1].n[i] else None, "n_new": int(stats[1].n[i]),
                         "top": [bool(i in set(top.tolist())) for top in tops]})
    maxz = tuple(round(s.max_abs_z(exclude=("<null>",)), 2) if s.n_rows else None for s in stats)
    return rows, maxz


# ------------------------------------------------------------------------------------------ comparing builds

def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out = {}
        for k in sorted(value, key=str):
            out.update(_flatten(value[k], f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    return {prefix: value}


def _inputs(manifest: Mapping) -> dict[str, str]:
    """input role -> what it was (file names with their sha256, or a Hub dataset at a revision)."""
    out = {}
    for i, entry in enumerate(manifest.get("inputs") or []):
        if not isinstance(entry, Mapping):
            continue
        role = f"input {i + 1} ({entry.get('task', '?')} {entry.get('split', '?')})" if i else \
            f"D0 ({entry.get('task', '?')} {entry.get('split', '?')})"
        parts = []
        for f in entry.get("inputs") or []:
            if isinstance(f, Mapping):
                name = f.get("path") or f.get("repo") or f.get("name") or "?"
                ident = f.get("sha256") or f.get("revision") or f.get("fingerprint") or ""
                parts.append(f"{name} {str(ident)[:12]}".strip())
        out[role] = ", ".join(parts) or json.dumps({k: v for k, v in entry.items() if k != "inputs"}, sort_keys=True)
    return out


def build_changes(old: Mapping, new: Mapping) -> list[tuple[str, Any, Any]]:
    """(what, old value, new value) for every recipe setting, input, seed, library version and
    hypothesis-only record that differs between two manifests."""
    changes = []
    sections = [("recipe", lambda m: _flatten({k: v for k, v in (m.get("recipe") or {}).items()
                                                if k not in _RECIPE_IGNORED})),
                ("", lambda m: {"seed": m.get("seed")}),
                ("", _inputs),
                ("hypothesis-only", lambda m: _flatten((m.get("features") or {}).get("hypothesis_only") or {})),
                ("version", lambda m: _flatten(m.get("versions") or {}))]
    for prefix, get in sections:
        a, b = get(old), get(new)
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key) != b.get(key):
                changes.append((f"{prefix} {key}".strip(), a.get(key), b.get(key)))
    return changes


# ------------------------------------------------------------------------------------------ the diff

@dataclasses.dataclass
class ReleaseDiff:
    old: str
    new: str
    splits: list[SplitDiff]
    build: list[tuple[str, Any, Any]]
    label_names: list[str]
    top_k: int

    @property
    def identical(self) -> bool:
        return all(s.identical for s in self.splits)

    def summary(self) -> str:
        """One line: what changed in the rows, and the build's changes by name."""
        if self.identical:
            text = "same rows as " + self.old
        else:
            parts = []
            for s in self.splits:
                if s.identical:
                    continue
                where = s.config if s.split == "train" else f"{s.config}/{s.split}"
                if s.old_rows is None:
                    parts.append(f"{where}: new config ({s.new_rows:,} rows)")
                elif s.new_rows is None:
                    parts.append(f"{where}: removed ({s.old_rows:,} rows)")
                else:
                    extra = "".join(f", {n} {w}" for n, w in ((s.moved, "moved"), (s.edited, "edited"),
                                                             (s.relabelled, "relabelled")) if n)
                    parts.append(f"{where} {s.old_rows:,} -> {s.new_rows:,} rows (+{s.added:,} / -{s.removed:,}{extra})")
            text = f"vs {self.old}: " + "; ".join(parts)
        recipe = [w for w, _, _ in self.build if not w.startswith("version ")]
        if recipe:
            text += "; changed: " + ", ".join(recipe[:6]) + (f" and {len(recipe) - 6} more" if len(recipe) > 6 else "")
        return text

    def markdown(self) -> str:
        def num(v):
            return "—" if v is None else f"{v:,}"

        def cell(v):
            text = "—" if v is None else (json.dumps(v) if isinstance(v, (dict, list)) else str(v))
            return " ".join(text.split()).replace("|", "\\|")

        lines = [f"### Changes from `{self.old}` to `{self.new}`", ""]
        lines.append("The data is **identical** (every config and split has the same rows)." if self.identical else
                     "Rows are matched by uid, and by content (premise and hypothesis) where the uids differ.")
        lines += ["", "| config | split | rows before | rows after | added | removed | moved | edited | relabelled | "
                  + " | ".join(self.label_names) + " |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(self.label_names)]
        for s in self.splits:
            labels = []
            for name in self.label_names:
                a = s.labels_old.get(name) if s.old_rows is not None else None
                b = s.labels_new.get(name) if s.new_rows is not None else None
                if a is None or b is None:
                    labels.append(num(a if b is None else b))
                else:
                    labels.append(f"{a:,} -> {b:,} ({b - a:+,})" if a != b else f"{a:,}")
            if s.old_rows is None or s.new_rows is None:
                counts = ["new config" if s.old_rows is None else "removed config", "", "", "", ""]
            else:
                counts = [f"+{s.added:,}", f"-{s.removed:,}", num(s.moved), num(s.edited), num(s.relabelled)]
            lines.append(f"| `{s.config}` | {s.split} | {num(s.old_rows)} | {num(s.new_rows)} | "
                         + " | ".join(counts) + " | " + " | ".join(labels) + " |")
        feats = [s for s in self.splits if s.features and not s.identical]  # same rows: same z
        if feats:
            lines += ["", f"Biased features: the top {self.top_k} per label by z in either release (the task's "
                          "lexical features; * marks a feature in that release's top), z (rows with the feature); "
                          "configs with the same rows in both are left out:",
                      "", "| config | split | label | feature | z before | z after |", "|---|---|---|---|---:|---:|"]
            for s in feats:
                for r in s.features:
                    before = "—" if r["z_old"] is None else f"{r['z_old']:.2f} ({r['n_old']:,}){'*' if r['top'][0] else ''}"
                    after = "—" if r["z_new"] is None else f"{r['z_new']:.2f} ({r['n_new']:,}){'*' if r['top'][1] else ''}"
                    lines.append(f"| `{s.config}` | {s.split} | {r['label']} | `{cell(r['feature'])}` | {before} | {after} |")
            lines += ["", "| config | split | max \\|z\\| before | max \\|z\\| after |", "|---|---|---:|---:|"]
            for s in feats:
                lines.append(f"| `{s.config}` | {s.split} | {num(s.max_abs_z[0])} | {num(s.max_abs_z[1])} |")
        lines += [""]
        if self.build:
            lines += ["Build changes (manifest.json):", "", "| what | before | after |", "|---|---|---|"]
            lines += [f"| {cell(w)} | {cell(a)} | {cell(b)} |" for w, a, b in self.build]
        else:
            lines += ["Both were built with the same recipe, inputs, seed and library versions."]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict:
        return {"old": self.old, "new": self.new, "identical": self.identical,
                "splits": [dataclasses.asdict(s) for s in self.splits],
                "build": [{"what": w, "before": a, "after": b} for w, a, b in self.build]}


def diff_releases(old: "str | Path", new: "str | Path", *, top_k: int = 5, progress: bool = False) -> ReleaseDiff:
    """Compare two releases (folders or ``ORG/NAME@REVISION``) config by config and split by split."""
    a, b = open_release(str(old)), open_release(str(new))
    task = _task_of(b) or _task_of(a)
    ca, cb = a.configs(), b.configs()
    order = list(ca) + [c for c in cb if c not in ca]
    splits, names = [], None
    for config in order:
        sa, sb = ca.get(config, {}), cb.get(config, {})
        for split in list(sa) + [s for s in sb if s not in sa]:
            files_a, files_b = sa.get(split), sb.get(split)
            split_names = _label_names(b, files_b, task) if files_b else _label_names(a, files_a, task)
            names = names or split_names
            ta = _read_rows(a, files_a) if files_a is not None else None
            tb = _read_rows(b, files_b) if files_b is not None else None
            empty = (ta if ta is not None else tb).slice(0, 0)
            rows = compare_rows(ta if ta is not None else empty, tb if tb is not None else empty, split_names)
            d = SplitDiff(config, split, **rows)
            if ta is None:
                d.old_rows = None
            if tb is None:
                d.new_rows = None
            if top_k > 0 and task is not None and split_names and not d.identical:
                d.features, d.max_abs_z = _features([ta if ta is not None else empty, tb if tb is not None else empty],
                                                    task, split_names, top_k)
            splits.append(d)
    return ReleaseDiff(a.label, b.label, splits, build_changes(a.manifest, b.manifest), list(names or []), top_k)
