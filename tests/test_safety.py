"""Reliability round 3 (issue 48): nothing outside a release is read, written or uploaded; every command keeps a
user's files; replay and overwrite work on real releases.

The table drives the command line in-process, as round 2's does (tests/test_bad_input.py, whose world,
snapshot and alarm it reuses): every case ends with exit code 2, one line ``error: ...`` naming the value or
path, and the case's folder exactly as it was (no output, no lock, no temporary file, inputs unchanged). Its
families: names that would leave their folder, text with the card's markers, environment values, the plan
reader's bounds, manifests and records of the wrong shape, encoding, depth or length, links and files a release
does not list, outputs over a user's files. The tests after it build real releases (SNLI rows from the shared
data, a tiny BERT from a config): AFLite's decisions are overwritten in place and replayed byte for byte.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from debiased_nli.cli import main
from debiased_nli.release.card import HISTORY_END, HISTORY_START
from test_bad_input import (  # noqa: F401  (fixtures: the case's world, the alarm, the libraries' log streams)
    SNLI,
    World,
    _library_logs_to_this_tests_stderr,
    _one_error_line,
    _record,
    _rows,
    alarm,
    alias_bomb,
    snapshot,
    world,
)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "builders" / "demo.yaml"
HEADLINE = ROOT / "benchmarks" / "efficacy_headline.yaml"
UNITS = ROOT / "benchmarks" / "results" / "efficacy_headline"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ inputs

def release(w: World, name: str = "rel", *, manifest=None, readme: "str | bytes | None" = None,
            extra: dict | None = None) -> Path:
    """A small release as `build` lays it out (README with the history markers, a data file the manifest lists
    with its sha256), made by hand so that each case can spoil one part of it."""
    root = w.path(name)
    data = root / "data" / "z_filtered" / "train-00000-of-00001.parquet"
    data.parent.mkdir(parents=True)
    pq.write_table(pa.table(_rows(30)), data)
    if manifest is None:
        manifest = {"written_by": "debiased-nli", "history": [], "recipe": {"task": "snli"},
                    "files": {"z_filtered": {"train": [{"path": "data/z_filtered/train-00000-of-00001.parquet",
                                                        "rows": 30, "sha256": sha(data)}]}}}
    text = manifest if isinstance(manifest, (str, bytes)) else json.dumps(manifest)
    (root / "manifest.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    card = readme if readme is not None else f"---\nlicense: cc\n---\n# rel\n\n{HISTORY_START}\n{HISTORY_END}\n"
    (root / "README.md").write_bytes(card if isinstance(card, bytes) else card.encode())
    for rel, content in (extra or {}).items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            p.symlink_to(content)
        else:
            p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep_manifest(w: World, name: str = "rel") -> Path:
    root = release(w, name)
    (root / "manifest.json").write_text('{"files": ' + nested(100_000) + "}")
    return root


def plan(w: World, name: str = "plan.yaml", text: "str | None" = None, **over) -> Path:
    """A plan with one row (no unit run yet): enough for `compare status` and `compare report`."""
    if text is not None:
        return w.write(name, text)
    w.parquet("train.parquet")
    raw = {"task": "snli", "model": "m", "seeds": [0], "train": {}, "results_dir": "results",
           "evaluate": {"sets": ["snli_test_hard"]}, "rows": [{"name": "original", "data": {"files": ["train.parquet"]}}]}
    raw.update(over)
    return w.write(name, yaml.safe_dump(raw))


def user_file(w: World, name: str, content: str = "the user's own") -> Path:
    return w.write(name, content)


def headline_units(w: World, *, truncate: str) -> list:
    """The repository's headline plan with two of its unit files (and predictions) copied into the case's folder,
    one of them cut in half: `compare report` reads the plan from the repository, everything else from here."""
    res = w.path("res")
    (res / "predictions").mkdir(parents=True)
    for row in ("original", "aflite"):
        shutil.copy(UNITS / f"{row}-s0.json", res / f"{row}-s0.json")
        shutil.copy(UNITS / "predictions" / f"{row}-s0.npz", res / "predictions" / f"{row}-s0.npz")
    victim = res / truncate
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return ["compare", "report", HEADLINE, "--results-dir", res, "--out", w.path("rep")]


def lock_link(w: World, lock: str) -> Path:
    """A symbolic link at a lock's path, to a file of the user's (the lock must not write its pid there)."""
    user_file(w, "precious.txt", "do not overwrite")
    return w.link(lock, w.path("precious.txt"))


# ------------------------------------------------------------------------------------------ the table

@dataclasses.dataclass
class Case:
    id: str
    argv: Callable[[World], list]
    expect: tuple[str, ...]
    env: dict


def C(id, argv, *expect, env=None):
    return Case(id, argv, expect, env or {})


def _build(w, recipe=None, *extra, data=None):
    return ["build", recipe or SNLI, "--data-files", data or w.parquet(), "--out", w.path("out"), "--quiet", *extra]


def _recipe(w, **over):
    base = {"task": "snli", "z_filter": {"top_k": 20, "batch_size": 100}, **over}
    return w.write("recipe.yaml", yaml.safe_dump(base))


MARK = HISTORY_START
CASES = [
    # ---- names that become paths must stay inside their folder
    C("recipe: a filter step's config is an absolute path",
      lambda w: _build(w, _recipe(w, filters=[{"step": "aflite", "config": str(w.path("outside"))}])),
      "filters[0].config", "not a name"),
    C("recipe: a filter step's config climbs out with ../",
      lambda w: _build(w, _recipe(w, filters=[{"step": "aflite", "config": "../../../evil"}])), "filters[0].config"),
    C("build --data-files ../../../x=FILE (a split name that climbs out)",
      lambda w: ["build", SNLI, "--data-files", f"train={w.parquet()}", f"../../../x={w.parquet('x.parquet')}",
                 "--out", w.path("out")], "split name", "../../../x"),
    C("recipe: an eval split named ../dev", lambda w: _build(w, _recipe(w, data={"eval_splits": ["../dev"]})),
      "data.eval_splits[0]"),
    C("recipe: data.split is an absolute path", lambda w: _build(w, _recipe(w, data={"split": "/etc/train"})),
      "data.split"),
    C("push --repo-id me/..", lambda w: ["push", release(w), "--repo-id", "me/.."], "--repo-id", "ORG/NAME"),
    C("push --repo-id ../x", lambda w: ["push", release(w), "--repo-id", "../x"], "--repo-id"),
    C("evaluate --push-to me/..", lambda w: ["evaluate", "--model", w.model_folder(), "--sets", "snli_test_hard", "--out",
                                             w.path("eval"), "--push-to", "me/.."], "--push-to"),
    C("compare report --push-to org/../x", lambda w: ["compare", "report", plan(w), "--push-to", "org/../x"],
      "--push-to"),
    C("plan: a row named ../x", lambda w: ["compare", "status", plan(w, rows=[{"name": "../x", "data": {"files": ["t"]}}])],
      "row name"),
    C("plan: a release named ../r", lambda w: ["compare", "status", plan(w, releases={"../r": {"recipe": "x"}})],
      "release"),
    # ---- text that goes into the card cannot hold the card's markers
    C("recipe summary holds the history marker", lambda w: _build(w, _recipe(w, summary=f"hello {MARK} world")),
      "marker"),
    C("recipe history note holds the end marker",
      lambda w: _build(w, _recipe(w, history=[{"version": "1.0", "notes": HISTORY_END}])), "history", "marker"),
    C("push --note holds the marker", lambda w: ["push", release(w), "--repo-id", "org/x", "--note", MARK], "--note"),
    C("push: a card whose text repeats the history markers",
      lambda w: ["push", release(w, readme=f"# x\n{MARK}\n{MARK}\n{HISTORY_END}\n"), "--repo-id", "org/x"],
      "markers"),
    # ---- environment values: finite numbers in range, paths not empty
    C("DEBIASED_NLI_HUB_DEADLINE=inf", lambda w: ["push", release(w), "--repo-id", "org/x"],
      "DEBIASED_NLI_HUB_DEADLINE", "finite", env={"DEBIASED_NLI_HUB_DEADLINE": "inf"}),
    C("DEBIASED_NLI_HUB_DEADLINE=1e12", lambda w: ["push", release(w), "--repo-id", "org/x"],
      "DEBIASED_NLI_HUB_DEADLINE", "at most", env={"DEBIASED_NLI_HUB_DEADLINE": "1e12"}),
    C("DEBIASED_NLI_HUB_DEADLINE=-5", lambda w: ["push", release(w), "--repo-id", "org/x"],
      "DEBIASED_NLI_HUB_DEADLINE", env={"DEBIASED_NLI_HUB_DEADLINE": "-5"}),
    C("DEBIASED_NLI_HUB_TIMEOUT=nan", lambda w: ["diff", release(w, "a"), release(w, "b")],
      "DEBIASED_NLI_HUB_TIMEOUT", env={"DEBIASED_NLI_HUB_TIMEOUT": "nan"}),
    C("DEBIASED_NLI_CACHE_MAX_MB=lots (cache info)", lambda w: ["cache", "info"], "DEBIASED_NLI_CACHE_MAX_MB", "lots",
      env={"DEBIASED_NLI_CACHE_MAX_MB": "lots"}),
    C("DEBIASED_NLI_CACHE_MAX_MB=-5 (build: refused before the build, not at the prune after it)",
      lambda w: _build(w), "DEBIASED_NLI_CACHE_MAX_MB", env={"DEBIASED_NLI_CACHE_MAX_MB": "-5"}),
    C("DEBIASED_NLI_CACHE= (empty: not the current folder)", lambda w: ["audit", "snli", "--data-files", w.parquet(),
                                                                        "--out", w.path("a")],
      "DEBIASED_NLI_CACHE", "empty", env={"DEBIASED_NLI_CACHE": ""}),
    C("DEBIASED_NLI_DATA_ROOT= (empty)", lambda w: ["cache", "clear"], "DEBIASED_NLI_DATA_ROOT",
      env={"DEBIASED_NLI_DATA_ROOT": " "}),
    C("WORLD_SIZE=two", lambda w: _build(w), "WORLD_SIZE", env={"WORLD_SIZE": "two"}),
    # ---- the plan reader has the recipe reader's bounds
    C("plan is a FIFO", lambda w: ["compare", "status", w.fifo("plan.yaml")], "plan.yaml", "not a regular file"),
    C("plan extends /dev/zero", lambda w: ["compare", "status", plan(w, text="extends: /dev/zero\n")], "/dev/zero",
      "not a regular file"),
    C("plan extends a FIFO", lambda w: ["compare", "status", plan(w, text=f"extends: {w.fifo('base.yaml')}\n")],
      "base.yaml", "not a regular file"),
    C("plan: an alias bomb in seeds", lambda w: ["compare", "status", plan(w, text=alias_bomb(key="seeds"))], "aliases"),
    C("plan: 2 MB", lambda w: ["compare", "status", plan(w, text="task: snli\n" + "# pad\n" * 400_000)], "too large"),
    C("plan: not UTF-8", lambda w: ["compare", "status", w.write("plan.yaml", b"task: caf\xe9\n")], "UTF-8"),
    C("plan: not YAML", lambda w: ["compare", "status", plan(w, text="task: [snli\n")], "not valid YAML"),
    C("plan: seed 2**32 (refused by status, before run would train)",
      lambda w: ["compare", "status", plan(w, seeds=[2**32])], "seeds", "4294967295"),
    C("plan: seed -1", lambda w: ["compare", "status", plan(w, seeds=[-1])], "seeds"),
    C("plan: seed true", lambda w: ["compare", "status", plan(w, seeds=[True])], "seeds"),
    C("plan: bootstrap replicates lots", lambda w: ["compare", "status", plan(w, bootstrap={"replicates": "lots"})],
      "bootstrap.replicates"),
    C("plan: bootstrap level 1.5", lambda w: ["compare", "status", plan(w, bootstrap={"level": 1.5})],
      "bootstrap.level"),
    C("plan: extends is a list", lambda w: ["compare", "status", plan(w, text="extends: [a, b]\n")], "extends"),
    # ---- manifests and records: shapes, encodings, depth, truncation
    C("push: manifest is a JSON list", lambda w: ["push", release(w, manifest="[1, 2]"), "--repo-id", "org/x"],
      "manifest", "list"),
    C("push: manifest cut short", lambda w: ["push", release(w, manifest='{"files": {"z'), "--repo-id", "org/x"],
      "manifest", "not valid JSON"),
    C("push: manifest nested 100,000 deep", lambda w: ["push", deep_manifest(w), "--repo-id", "org/x"], "nests"),
    C("push: README not UTF-8", lambda w: ["push", release(w, readme=b"# caf\xe9\n"), "--repo-id", "org/x"], "UTF-8"),
    C("diff: manifest is a JSON list", lambda w: ["diff", release(w, "a", manifest="[]"), release(w, "b")], "list"),
    C("diff: manifest nested 100,000 deep", lambda w: ["diff", deep_manifest(w, "a"), release(w, "b")], "nests"),
    C("diff: manifest not UTF-8", lambda w: ["diff", release(w, "a", manifest=b'{"a": "\xff"}'),
                                             release(w, "b")], "UTF-8"),
    C("diff: a data file named by absolute path", lambda w: ["diff", release(w, "a", manifest={"files": {"z_filtered": {
        "train": [{"path": str(w.parquet("secret.parquet"))}]}}}), release(w, "b")], "not a relative path"),
    C("diff: a data file out of the release with ../", lambda w: ["diff", release(w, "a", manifest={"files": {
        "z_filtered": {"train": [{"path": "../secret.parquet"}]}}}), release(w, "b")], "../secret.parquet"),
    C("diff: a data file whose bytes are not the manifest's", lambda w: ["diff", release(w, "a", manifest={"files": {
        "z_filtered": {"train": [{"path": "data/z_filtered/train-00000-of-00001.parquet", "sha256": "0" * 64}]}}}),
        release(w, "b")], "sha256"),
    C("diff: a data file that is a link out of the release", lambda w: ["diff", release(w, "a", manifest={"files": {
        "z_filtered": {"train": [{"path": "data/z_filtered/link.parquet"}]}}},
        extra={"data/z_filtered/link.parquet": w.parquet("secret.parquet")}), release(w, "b")], "outside"),
    C("build --replay: manifest is a JSON list", lambda w: ["build", DEMO, "--out", w.path("out"), "--replay",
                                                           release(w, manifest="[1]")], "--replay", "list"),
    C("build --replay: decision records of the wrong shape",
      lambda w: ["build", DEMO, "--out", w.path("out"), "--replay", release(w, manifest={"decisions": {"aflite": 5}})],
      "--replay", "decisions"),
    C("build --replay: a record named ../x",
      lambda w: ["build", DEMO, "--out", w.path("out"), "--replay", release(w, manifest={"decisions": {"../x": {}}})],
      "--replay", "../x"),
    C("build --efficacy nested 100,000 deep", lambda w: _build(w, None, "--efficacy",
                                                               w.write("eff.json", nested(100_000))), "nests"),
    C("build --efficacy nested 200 deep", lambda w: _build(w, None, "--efficacy", w.write("eff.json", nested(200))),
      "nests"),
    C("compare report: a unit result file cut short", lambda w: headline_units(w, truncate="original-s0.json"),
      "original-s0.json", "not valid JSON"),
    C("compare report: a predictions file cut short", lambda w: headline_units(w, truncate="predictions/original-s0.npz"),
      "original-s0.npz", "cannot be read"),
    # ---- links and files a release does not list are never uploaded
    C("push: a symbolic link in the release (to a key elsewhere)",
      lambda w: ["push", release(w, extra={"data/z_filtered/id_rsa": user_file(w, "id_rsa", "KEY")}), "--repo-id",
                 "org/x"], "symbolic link", "data/z_filtered/id_rsa"),
    C("push: a hidden data/.env", lambda w: ["push", release(w, extra={"data/.env": "HF_TOKEN=hf_x"}), "--repo-id",
                                             "org/x"], "data/.env", "does not list"),
    C("push: a file the manifest does not list", lambda w: ["push", release(w, extra={"NOTES.md": "mine"}), "--repo-id",
                                                            "org/x"], "NOTES.md"),
    C("push: a listed data file whose bytes changed", lambda w: ["push", release(w, manifest={"written_by": "x", "files": {
        "z_filtered": {"train": [{"path": "data/z_filtered/train-00000-of-00001.parquet", "sha256": "f" * 64}]}}}),
        "--repo-id", "org/x"], "sha256"),
    # ---- outputs never replace a user's files
    C("evaluate --out DIR holding the user's report.md",
      lambda w: ["evaluate", "--model", w.model_folder(), "--sets", "snli_test_hard", "--out",
                 user_file(w, "eval/report.md").parent], "report.md", "refusing"),
    C("train --out DIR holding the user's config.json and model.safetensors",
      lambda w: ["train", "snli", "--data-files", w.parquet(), "--model", w.model_folder(), "--out",
                 user_file(w, "run/config.json", "{}").parent, "--quiet"] if user_file(w, "run/model.safetensors")
      else [], "config.json", "model.safetensors"),
    C("compare report over the user's results.md", lambda w: ["compare", "report", plan(w)] if user_file(w, "results.md")
      else [], "results.md", "did not write"),
    C("diff --out over the user's notes", lambda w: ["diff", release(w, "a"), release(w, "b"), "--out",
                                                     user_file(w, "notes.md")], "notes.md", "did not write"),
    C("aflite --out a folder of the user's", lambda w: ["aflite", "snli", "--data-files", w.parquet(), "--out",
                                                       w.user_folder()], "thesis.tex"),
    C("confidence-filter --out a folder of the user's",
      lambda w: ["confidence-filter", "snli", "--data-files", w.parquet(), "--model", w.model_folder(), "--out",
                 w.user_folder()], "thesis.tex"),
    C("generate --out a folder of the user's", lambda w: ["generate", "snli", "--generator", w.model_folder("gen"),
                                                         "--out", w.user_folder(), "--num-samples", "4"], "thesis.tex"),
    # ---- locks do not follow links
    C("build: a symbolic link at the release's lock", lambda w: _build(w) if lock_link(w, ".out.lock") else [],
      ".out.lock", "symbolic link"),
    C("audit: a symbolic link at the audit's lock",
      lambda w: ["audit", "snli", "--data-files", w.parquet(), "--out", w.path("a")] if lock_link(w, ".a.lock") else [],
      ".a.lock", "symbolic link"),
    # ---- numbers of the method commands
    C("ibadr --time-budget nan", lambda w: ["ibadr", "snli", "--data-files", w.parquet(), "--out", w.path("i"),
                                            "--confidence-model", w.model_folder(), "--time-budget", "nan"],
      "--time-budget", "finite"),
    C("ibadr --shard-size 0", lambda w: ["ibadr", "snli", "--data-files", w.parquet(), "--out", w.path("i"),
                                         "--confidence-model", w.model_folder(), "--shard-size", "0"], "--shard-size"),
]


def test_the_table_covers_the_families():
    assert len(CASES) >= 40
    words = " ".join(c.id for c in CASES)
    for family in ("../", "marker", "DEBIASED_NLI_", "plan", "manifest", "cut short", "nested", "not UTF-8",
                   "symbolic link", "user's", "lock"):
        assert family in words, family


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(case, world, capsys, monkeypatch, alarm):
    argv = [str(a) for a in case.argv(world)]
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    before = snapshot(world.root)
    rc = main(argv)
    line = _one_error_line(capsys.readouterr().err)
    _record(case.id, line)
    assert rc == 2, (rc, line)
    assert len(line) < 1500, line[:300]
    for fragment in case.expect:
        assert fragment.lower() in line.lower(), (fragment, line)
    assert snapshot(world.root) == before  # nothing written, nothing replaced, no lock or temporary file left
