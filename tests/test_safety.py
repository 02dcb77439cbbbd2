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
    C("train --release: its manifest names a data file out of the release",
      lambda w: ["train", "snli", "--release", release(w, manifest={"files": {"z_filtered": {"train": [
          {"path": "../secret.parquet"}]}}}), "--config", "z_filtered", "--model", w.model_folder(), "--out",
          w.path("run")], "../secret.parquet"),
    C("train --release: a data file whose bytes are not the manifest's",
      lambda w: ["train", "snli", "--release", release(w, manifest={"files": {"z_filtered": {"train": [
          {"path": "data/z_filtered/train-00000-of-00001.parquet", "sha256": "0" * 64}]}}}), "--config", "z_filtered",
          "--model", w.model_folder(), "--out", w.path("run")], "sha256"),
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
    C("evaluate --compare <JSON nested 100,000 deep>",
      lambda w: ["evaluate", "--model", w.model_folder(), "--sets", "snli_test_hard", "--out", w.path("eval"),
                 "--compare", w.write("res.json", nested(100_000))], "res.json", "nests"),
    C("evaluate --compare <not UTF-8>",
      lambda w: ["evaluate", "--model", w.model_folder(), "--sets", "snli_test_hard", "--out", w.path("eval"),
                 "--compare", w.write("res.json", b'{"schema": "caf\xe9"}')], "res.json", "UTF-8"),
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


# ------------------------------------------------------------------------------------------ real releases

AFLITE = {"task": "snli", "features": {"hypothesis_only": "none"},
          "filters": [{"step": "aflite", "m": 8, "train_size": 20, "k": 10, "target_n": 150, "warmup_epochs": 1,
                       "audit": False, "random_control": False}]}


@pytest.fixture(scope="module")
def aflite_release(tmp_path_factory, shared_data):
    """A release with AFLite's decisions: 300 real SNLI rows, a tiny BERT from a config as the encoder."""
    import pandas as pd

    from test_training import make_tiny_bert

    tmp = tmp_path_factory.mktemp("aflite")
    rows = pd.read_parquet(shared_data / "snli" / "train_sample.parquet").head(300)
    rows.to_parquet(tmp / "train.parquet")
    encoder = make_tiny_bert(tmp / "encoder", list(rows.premise) + list(rows.hypothesis))
    recipe = json.loads(json.dumps(AFLITE))
    recipe["filters"][0]["encoder"] = str(encoder)
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEBIASED_NLI_CACHE", str(tmp / "cache"))
        assert main(["build", str(tmp / "recipe.yaml"), "--data-files", str(tmp / "train.parquet"), "--out",
                     str(tmp / "rel"), "--quiet"]) == 0
    assert (tmp / "rel" / "decisions" / "aflite" / "added.parquet").is_file()
    assert pq.read_metadata(tmp / "rel" / "decisions" / "aflite" / "added.parquet").num_rows == 0  # AFLite adds none
    return tmp


def _build_argv(src: Path, out: Path, *extra) -> list[str]:
    return ["build", str(src / "recipe.yaml"), "--data-files", str(src / "train.parquet"), "--out", str(out),
            "--quiet", *extra]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_rebuilds_a_release_with_decisions_in_place(aflite_release, tmp_path, capsys):
    """`build --overwrite` of a release with decisions/ (AFLite, PDD, IBADR) replaces it: its decision records are
    its own files. A file of the user's beside them is still refused, by name."""
    rel = tmp_path / "rel"
    shutil.copytree(aflite_release / "rel", rel)
    before = _files(rel)
    assert main(_build_argv(aflite_release, rel, "--overwrite")) == 0, capsys.readouterr().err[-2000:]
    after = _files(rel)
    assert set(after) == set(before)  # the same recipe and rows: the same files, rebuilt in place
    for name in after:  # the z-path is deterministic; AFLite's kernels need not be (hence --replay)
        if not name.startswith(("data/aflite", "rejected/aflite", "decisions/", "images/zstats_aflite")) \
                and name not in ("README.md", "manifest.json"):
            assert after[name] == before[name], name
    (rel / "decisions" / "aflite" / "NOTES.md").write_text("mine")
    capsys.readouterr()
    assert main(_build_argv(aflite_release, rel, "--overwrite")) == 2
    assert "decisions/aflite/NOTES.md" in _one_error_line(capsys.readouterr().err)
    assert (rel / "decisions" / "aflite" / "NOTES.md").read_text() == "mine"


def test_replay_of_an_aflite_release_is_byte_identical(aflite_release, tmp_path, capsys):
    """`build --replay OLD` of an AFLite release gives OLD byte for byte (its card included); only the manifest's
    stage says the step was replayed."""
    new = tmp_path / "new"
    assert main(_build_argv(aflite_release, new, "--replay", str(aflite_release / "rel"))) == 0, \
        capsys.readouterr().err[-2000:]
    old_files, new_files = _files(aflite_release / "rel"), _files(new)
    assert set(old_files) == set(new_files)
    for rel in old_files:
        if rel != "manifest.json":
            assert new_files[rel] == old_files[rel], rel
    old_m, new_m = (json.loads(f["manifest.json"]) for f in (old_files, new_files))
    stage = next(s for s in new_m["stages"] if s["stage"] == "aflite: aflite")
    assert stage.pop("replay") == "replayed"
    assert new_m == old_m


def _tampered(src: Path, dst: Path, change: Callable[[dict], dict]) -> Path:
    """A copy of the release whose decisions.parquet is changed by ``change`` (a dict of columns), with the
    manifest's sha256 updated, so that only the record's content is wrong."""
    shutil.copytree(src, dst)
    path = dst / "decisions" / "aflite" / "decisions.parquet"
    table = pq.read_table(path)
    cols = change(table.to_pydict())
    pq.write_table(pa.table(cols, schema=table.schema), path)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["decisions"]["aflite"]["files"]["decisions/aflite/decisions.parquet"] = sha(path)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _drop_one(cols: dict) -> dict:
    i = cols["position"].index(-1)
    return {k: v[:i] + v[i + 1:] for k, v in cols.items()}


def _dropped_as_kept_too(cols: dict) -> dict:
    i, j = cols["position"].index(-1), cols["position"].index(0)
    cols["uid"][i] = cols["uid"][j]
    return cols


def _stranger(cols: dict) -> dict:
    cols["uid"][cols["position"].index(-1)] = "snli:train:999999"
    return cols


@pytest.mark.parametrize("change, says", [(_drop_one, "in neither"), (_dropped_as_kept_too, "more than once"),
                                           (_stranger, "not an input row")])
def test_replay_refuses_a_record_whose_rows_are_not_a_partition_of_the_input(aflite_release, tmp_path, capsys,
                                                                             change, says):
    """A record whose kept and dropped rows are not the input rows each exactly once (a row in neither, in both,
    or one that is no input row) would lose or repeat rows: one line, exit 2, nothing written."""
    old = _tampered(aflite_release / "rel", tmp_path / "old", change)
    assert main(_build_argv(aflite_release, tmp_path / "new", "--replay", str(old))) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "decisions.parquet" in line and says in line, line
    assert not (tmp_path / "new").exists()


def test_replay_reads_no_file_outside_the_release(aflite_release, tmp_path, capsys):
    """Every file replay reads is one its record lists in its own folder, a regular file inside the release with
    the manifest's sha256: a record naming a file outside, or a link to one with the same bytes, is refused."""
    outside = tmp_path / "outside.parquet"
    shutil.copy(aflite_release / "rel" / "decisions" / "aflite" / "decisions.parquet", outside)
    old = tmp_path / "old"
    shutil.copytree(aflite_release / "rel", old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["decisions"]["aflite"]["files"]["../outside.parquet"] = sha(outside)
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert main(_build_argv(aflite_release, tmp_path / "new", "--replay", str(old))) == 2
    assert "../outside.parquet" in _one_error_line(capsys.readouterr().err)
    shutil.rmtree(old)
    shutil.copytree(aflite_release / "rel", old)
    (old / "decisions" / "aflite" / "decisions.parquet").unlink()
    (old / "decisions" / "aflite" / "decisions.parquet").symlink_to(outside)  # the same bytes, through a link
    assert main(_build_argv(aflite_release, tmp_path / "new", "--replay", str(old))) == 2
    assert "decisions.parquet" in (line := _one_error_line(capsys.readouterr().err)) and "outside" in line, line
    (old / "decisions" / "aflite" / "decisions.parquet").unlink()  # a link that stays inside: still a link
    shutil.copy(outside, old / "decisions" / "aflite" / "copy.parquet")
    (old / "decisions" / "aflite" / "decisions.parquet").symlink_to("copy.parquet")
    assert main(_build_argv(aflite_release, tmp_path / "new", "--replay", str(old))) == 2
    assert "symbolic link" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "new").exists()


@pytest.fixture
def online(monkeypatch):
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)


def test_push_uploads_exactly_the_files_the_manifest_lists(aflite_release, tmp_path, online, capsys):
    from debiased_nli.utils.outputs import release_files
    from fake_hub import FakeHub

    rel = tmp_path / "rel"
    shutil.copytree(aflite_release / "rel", rel)
    with FakeHub() as hub:
        from debiased_nli.release.publish import push_release

        push_release(rel, "org/x", revision="v1.0", token="hf_x", endpoint=hub.url)
        commit = next(r for r in hub.requests if "/commit/" in r["path"])
        sent = {json.loads(x)["value"]["path"] for x in commit["body"].decode().splitlines()
                if json.loads(x)["key"] == "file"}
        assert sent == set(_files(rel)) and sent <= release_files(rel)  # decisions/ included, nothing else
        assert {"decisions/aflite/decisions.parquet", "decisions/aflite/added.parquet"} <= sent
    # a link to a private key and a hidden file: refused by name before any request
    (tmp_path / "id_rsa").write_text("PRIVATE KEY")
    (rel / "data" / "aflite" / "key.parquet").symlink_to(tmp_path / "id_rsa")
    (rel / "data" / ".env").write_text("HF_TOKEN=hf_secret")
    with FakeHub() as hub:
        from debiased_nli.utils.errors import ConfigError

        with pytest.raises(ConfigError) as err:
            push_release(rel, "org/x", revision="v1.1", token="hf_x", endpoint=hub.url)
        assert hub.requests == []
    assert "data/aflite/key.parquet" in str(err.value) and "data/.env" in str(err.value)


# ------------------------------------------------------------------------------------------ replay, cache, card

def test_a_cache_entry_whose_bytes_changed_is_a_miss(world, monkeypatch, caplog):
    """The marker of a cache entry holds the sha256 of what was stored: an entry that still parses but holds other
    numbers (the hypothesis-only predictions swapped for the gold labels) is recomputed, not used."""
    import numpy as np

    w = world
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(w.path("cache")))
    data = w.parquet("train.parquet", n=300)
    build = ["build", str(SNLI), "--data-files", str(data), "--out"]
    assert main(build + [str(w.path("r1"))]) == 0
    (entry,) = w.path("cache").glob("hypo-only-*.npz")
    with np.load(entry) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["pred"] = np.asarray(pq.read_table(data).column("label").to_pylist(), dtype=arrays["pred"].dtype)
    tmp = entry.with_name("swap.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, entry)  # a valid entry, its marker untouched: only the sha256 tells
    with caplog.at_level("WARNING"):
        assert main(build + [str(w.path("r2"))]) == 0
    assert any(entry.name in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)
    for sub in ("data", "rejected"):
        for f in sorted((w.path("r1") / sub).rglob("*.parquet")):
            assert f.read_bytes() == (w.path("r2") / f.relative_to(w.path("r1"))).read_bytes(), f
    # a file without a record (an older version's entry, or a user's) is neither used nor replaced
    from debiased_nli.utils.outputs import marker_of

    marker_of(entry).unlink()
    os.replace(tmp if tmp.exists() else entry, entry)
    kept = entry.read_bytes()
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert main(build + [str(w.path("r3"))]) == 0
    assert any(entry.name in r.getMessage() and "no record" in r.getMessage() for r in caplog.records)
    assert entry.read_bytes() == kept and not marker_of(entry).exists()
    assert (w.path("r3") / "data").exists()


def test_a_recipe_card_text_with_the_markers_never_reaches_the_hub(world, capsys):
    """The history table is found between the card's markers: a recipe whose summary holds one is refused while
    it is read, so no card can lose its sections at push."""
    recipe = world.write("r.yaml", yaml.safe_dump({"task": "demo", "summary": f"see {HISTORY_START} here"}))
    assert main(["build", str(recipe), "--out", str(world.path("rel"))]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "summary" in line and "marker" in line and not world.path("rel").exists()


# ------------------------------------------------------------------------------------------ outputs

def test_each_writer_replaces_its_own_files_and_refuses_the_users(tmp_path):
    """An output of this tool (marked with its sha256) is replaced by the next run; the same file edited by the
    user since, or one the user put there, is refused by name."""
    from debiased_nli.evaluation.scores import SCHEMA, write_outputs
    from debiased_nli.utils.errors import ConfigError

    results = {"schema": SCHEMA, "models": [{"path": "m", "seed": 0}], "num_models": 1, "config": {},
               "versions": {}, "suite": None,
               "sets": {"hans": {"n": 10, "n_total": 10, "accuracy": 0.5, "accuracy_std": 0.0, "runs": [{}]}}}
    out = tmp_path / "eval"
    write_outputs(results, out, name="m")
    first = (out / "report.md").read_text()
    write_outputs(results, out, name="m")  # its own files: replaced
    assert (out / "report.md").read_text() == first
    (out / "report.md").write_text(first + "\nmy notes\n")  # edited by the user since
    with pytest.raises(ConfigError, match="report.md"):
        write_outputs(results, out, name="m")
    assert (out / "report.md").read_text().endswith("my notes\n")
    assert sorted(p.name for p in out.iterdir()) == [".accuracy.png.debiased-nli", ".report.md.debiased-nli",
                                                     ".results.json.debiased-nli", "accuracy.png", "report.md",
                                                     "results.json"]


def test_diff_out_on_a_full_disk_leaves_no_file(aflite_release, tmp_path, monkeypatch, capsys):
    """`diff --out FILE` writes FILE under a temporary name and renames it whole: a full disk leaves neither a
    0-byte FILE nor the temporary one, and an earlier FILE of this tool stays as it was."""
    rel = aflite_release / "rel"
    notes = tmp_path / "notes.md"
    assert main(["diff", str(rel), str(rel), "--out", str(notes)]) == 0
    written = notes.read_bytes()
    assert main(["diff", str(rel), str(rel), "--out", str(notes)]) == 0  # its own file: replaced
    real = Path.write_text

    def full(self, text, *a, **k):
        if self.name.startswith(".notes") or self.name.startswith(".new"):
            real(self, text[:10], *a, **k)
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    capsys.readouterr()
    for target in (notes, tmp_path / "new.md"):
        assert main(["diff", str(rel), str(rel), "--out", str(target)]) == 2
        assert "no space left" in _one_error_line(capsys.readouterr().err)
    assert notes.read_bytes() == written and not (tmp_path / "new.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.md.debiased-nli", "notes.md"]


def test_a_lock_file_is_never_opened_through_a_link_or_a_hard_link(tmp_path):
    from debiased_nli.utils.errors import ConfigError
    from debiased_nli.utils.outputs import lock_target

    mine = tmp_path / "mine.txt"
    mine.write_text("keep")
    (tmp_path / ".rel.lock").symlink_to(mine)
    with pytest.raises(ConfigError, match="symbolic link"):
        lock_target(tmp_path / "rel")
    (tmp_path / ".rel.lock").unlink()
    os.link(mine, tmp_path / ".rel.lock")
    with pytest.raises(ConfigError, match="hard link"):
        lock_target(tmp_path / "rel")
    assert mine.read_text() == "keep"
    (tmp_path / ".rel.lock").unlink()
    release = lock_target(tmp_path / "rel")  # a lock of its own: taken, and removed when released
    release()
    assert not (tmp_path / ".rel.lock").exists()


# ------------------------------------------------------------------------------------------ the Hub deadline

def _trickle(monkeypatch, hub_url: str) -> None:
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_ENDPOINT", hub_url)
    monkeypatch.setattr(c, "ENDPOINT", hub_url)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setenv("DEBIASED_NLI_HUB_TIMEOUT", "2")
    monkeypatch.setenv("DEBIASED_NLI_HUB_DEADLINE", "3")


def _a_trained_folder(folder: Path) -> Path:
    """The files `train` leaves in a folder (its record, config, weights, card), each with its marker."""
    from debiased_nli.utils.outputs import OwnFiles

    files = {"debiased_nli_train.json": json.dumps({"config": {"model": "m"}, "task": "snli"}),
             "config.json": "{}", "model.safetensors": "weights", "README.md": "# m\n"}
    with OwnFiles([folder / n for n in files], what="a test") as own:
        for name, text in files.items():
            own.write_text(folder / name, text)
    return folder


@pytest.mark.parametrize("call", ["diff ORG/NAME@REV", "push --diff-against", "train --push-to", "evaluate --push-to",
                                  "compare report --push-to"])
def test_every_hub_call_ends_at_the_deadline(aflite_release, tmp_path, monkeypatch, capsys, call):
    """`diff ORG/NAME@REV`, `push --diff-against ORG/NAME@REV`, `train --push-to`, `evaluate --push-to` and `compare
    report --push-to` against a Hub that answers a byte a second: each ends at its deadline (3 s here) with one
    line."""
    from test_bad_input import TricklingServer

    from debiased_nli.models.hub import push_model, push_results
    from debiased_nli.evaluation.compare.hub import push_report
    from debiased_nli.utils.errors import ConfigError

    rel = aflite_release / "rel"
    results = {"sets": {"snli_test_hard": {"n": 10, "accuracy": 0.5, "runs": [{"seed": 0}],
                                           "hub_dataset": {"path": "stanfordnlp/snli", "split": "test"}}}}
    calls = {"diff ORG/NAME@REV": lambda: main(["diff", "org/x@v1.0", str(rel)]),
             "push --diff-against": lambda: main(["push", str(rel), "--repo-id", "org/x", "--diff-against",
                                                  "org/x@v1.0"]),
             "train --push-to": lambda: push_model(_a_trained_folder(tmp_path / "run"), "org/model"),
             "evaluate --push-to": lambda: push_results("org/model", results),
             "compare report --push-to": lambda: push_report(None, {"rows": {}}, tmp_path / "report", "org/x")}
    with TricklingServer("body") as hub:
        _trickle(monkeypatch, hub.url)
        start = time.monotonic()
        try:
            rc, message = calls[call](), _one_error_line(capsys.readouterr().err)
        except ConfigError as err:
            rc, message = 2, f"error: {err}"
        took = time.monotonic() - start
    _record(f"{call} against a Hub that trickles (deadline 3 s)", message)
    assert rc == 2 and "deadline of 3 s" in message and took < 3 + 5, (rc, message, took)
