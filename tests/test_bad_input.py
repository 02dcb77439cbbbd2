"""Bad input and faults, as a new user meets them: every case ends with exit code 2, one line
`error: ...` that names the problem, no traceback, and nothing touched outside the release.

The table drives the command line in-process (`debiased_nli.cli.main`); a subprocess is used only
where a real process is the point (kill -9 at random moments of a build, the console's stderr).
Every build that succeeds here is checked for conservation: for each config, the original rows kept,
rejected and set aside are exactly the input rows, by uid (new rows: by count).

Set DEBIASED_NLI_BAD_INPUT_TABLE=path to write the table of cases and what each prints.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from debiased_nli.cli import main
from debiased_nli.utils.outputs import TMP_MARKER, is_release_folder

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "builders" / "demo.yaml"
SNLI = ROOT / "builders" / "snli.yaml"
LABELS = ("entailment", "neutral", "contradiction")
MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
WORDS = "a man woman dog child plays runs sleeps outside inside the park street ball red blue".split()


# ------------------------------------------------------------------------------------------ inputs

def _rows(n: int, seed: int = 0, one_label: int | None = None) -> dict:
    rng = random.Random(seed)
    return {"premise": [" ".join(rng.choices(WORDS, k=rng.randint(4, 10))) + "." for _ in range(n)],
            "hypothesis": [" ".join(rng.choices(WORDS, k=rng.randint(2, 6))) + "." for _ in range(n)],
            "label": [one_label if one_label is not None else i % 3 for i in range(n)]}


def alias_bomb(levels: int = 9, width: int = 9, strings: bool = False, key: str = "extra_citations") -> str:
    """The "billion laughs" YAML nested under a valid key: ``width ** levels`` values from a few hundred
    bytes. ``strings``: every leaf a string, so the expanded value even has the right type."""
    lines = ["task: snli", f"{key}:"]
    if strings:  # a flat list of strings reached through nested aliases of one mapping's values
        lines = ["task: snli", "profiles:", "  p0: &l0 {summary: lol}"]
        for i in range(1, levels + 1):
            lines.append(f"  p{i}: &l{i} {{" + ", ".join(f"k{j}: *l{i - 1}" for j in range(width)) + "}")
        return "\n".join(lines) + "\n"
    lines.append("  - &l0 [" + ", ".join(["lol"] * width) + "]")
    for i in range(1, levels + 1):
        lines.append(f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


class World:
    """The case's folder (also the current folder and $HOME's parent): inputs are made on demand."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.home.mkdir()

    def path(self, name: str) -> Path:
        return self.root / name

    def parquet(self, name="good.parquet", n=60, **kw) -> Path:
        p = self.path(name)
        pq.write_table(pa.table(_rows(n, **kw)), p)
        return p

    def write(self, name: str, data: "str | bytes") -> Path:
        p = self.path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(data, bytes) else p.write_text)(data)
        return p

    def truncated_parquet(self) -> Path:
        good = self.parquet("whole.parquet", n=200).read_bytes()
        return self.write("truncated.parquet", good[: len(good) // 2])

    def recipe(self, **over) -> Path:
        import yaml
        base = {"task": "snli", "z_filter": {"top_k": 20, "batch_size": 100}}
        for k, v in over.items():
            base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        return self.write("recipe.yaml", yaml.safe_dump(base))

    def model_folder(self, name="model", config: "str | None" = "{}") -> Path:
        p = self.path(name)
        p.mkdir()
        if config is not None:
            (p / "config.json").write_text(config)
        return p

    def fake_release(self, name="rel") -> Path:
        p = self.path(name)
        (p / "data").mkdir(parents=True)
        from debiased_nli.release.card import HISTORY_END, HISTORY_START
        (p / "README.md").write_text(f"# not really\n\n{HISTORY_START}\n{HISTORY_END}\n")
        (p / "manifest.json").write_text('{"history": []}')
        return p

    def lookalike(self, name="other") -> Path:
        self.write(f"{name}/README.md", "# my notes")
        return self.write(f"{name}/manifest.json", '{"mine": true}').parent

    def broken_model(self, name="broken") -> Path:
        from transformers import BertConfig
        p = self.model_folder(name, config=BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=64).to_json_string())
        (p / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
        return p

    def broken_release(self, name="rel") -> Path:
        p = self.fake_release(name)
        (p / "README.md").write_text("---\nconfigs:\n- config_name: z_filtered\n  data_files:\n  - split: train\n"
                                     "    path: data/z_filtered/train-*\n---\n")
        self.write(f"{name}/data/z_filtered/train-00000-of-00001.parquet", b"PAR1 broken PAR1")
        return p

    def fifo(self, name="pipe.parquet") -> Path:
        p = self.path(name)
        os.mkfifo(p)
        return p

    def link(self, name: str, target: "str | Path") -> Path:
        p = self.path(name)
        p.symlink_to(target)
        return p

    def loop(self, name="loop.parquet") -> Path:
        """A symbolic link that leads to itself."""
        return self.link(name, name)

    def cycle(self, name="a.parquet", other="b.parquet") -> Path:
        """Two symbolic links that lead to each other."""
        self.link(other, name)
        return self.link(name, other)

    def tiny_generator(self, name="gen", n_positions=16) -> Path:
        """A random GPT-2 (the real GPT-2 tokenizer) whose context is ``n_positions`` tokens."""
        import torch
        from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
        tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=n_positions,
                                   vocab_size=len(tok))).save_pretrained(self.path(name))
        tok.save_pretrained(self.path(name))
        return self.path(name)

    def user_folder(self, name="mine") -> Path:
        p = self.path(name)
        p.mkdir()
        (p / "thesis.tex").write_text("months of work")
        return p


def snapshot(root: Path) -> dict:
    """Every file and folder under ``root`` with its size and mtime (libraries' caches under $HOME/.cache
    aside: the Hugging Face libraries keep their own there)."""
    return {str(p.relative_to(root)): (p.is_dir(), None if p.is_dir() else (p.lstat().st_size, p.lstat().st_mtime_ns))
            for p in root.rglob("*") if not str(p.relative_to(root)).startswith("home/.cache")}  # links: not followed


# ------------------------------------------------------------------------------------------ the table

@dataclasses.dataclass
class Case:
    id: str
    argv: Callable[[World], list]
    expect: tuple[str, ...]


def C(id, argv, *expect):
    return Case(id, argv, expect)


def _train(w, *extra):
    return ["train", "snli", "--data-files", w.parquet(), "--model", w.model_folder(), "--out", w.path("run"), *extra]


def _evaluate(w, *extra):
    return ["evaluate", "--model", w.model_folder(), "--sets", "snli_test_hard", "--out", w.path("eval"), *extra]


def _aflite(w, *extra):
    return ["aflite", "snli", "--data-files", w.parquet(), "--out", w.path("af"), *extra]


def _method(w, command, *extra):
    required = {"aflite": [], "pdd": ["--teacher"], "ibadr": ["--confidence-model"]}[command]
    return [command, "snli", "--data-files", w.parquet(), "--out", w.path(command),
            *(required + [w.model_folder()] if required else []), *extra]


def _audit(w, *extra, data=None):
    return ["audit", "snli", "--data-files", data or w.parquet(), "--out", w.path("audit"), *extra]


def _build(w, *extra, data=None, recipe=None):
    return ["build", recipe or SNLI, "--data-files", data or w.parquet(), "--out", w.path("release"), "--quiet", *extra]


def _generate(w, *extra, generator=None):
    return ["generate", "snli", "--generator", generator or w.model_folder("gen"), "--out", w.path("gen-out"),
            "--num-samples", "4", *extra]


CASES = [
    # ---- build: arguments and targets
    C("build --max-rows 0", lambda w: _build(w, "--max-rows", "0"), "--max-rows", ">= 1"),
    C("build --max-rows -5", lambda w: _build(w, "--max-rows", "-5"), "--max-rows", ">= 1"),
    C("build --max-rows abc", lambda w: _build(w, "--max-rows", "abc"), "--max-rows", "integer"),
    C("build --seed -1", lambda w: _build(w, "--seed", "-1"), "--seed"),
    C("build --out . --overwrite", lambda w: ["build", DEMO, "--out", ".", "--overwrite"], "current folder"),
    C("build --out $HOME --overwrite", lambda w: ["build", DEMO, "--out", w.home, "--overwrite"], "home folder"),
    C("build --out / --overwrite", lambda w: ["build", DEMO, "--out", "/", "--overwrite"], "root"),
    C("build --out <parent of an input> --overwrite",
      lambda w: ["build", SNLI, "--data-files", w.write("inputs/train.parquet", w.parquet().read_bytes()),
                 "--out", w.path("inputs"), "--overwrite"], "holds the input"),
    C("build --out <the recipe's folder> --overwrite",
      lambda w: ["build", w.write("recipes/r.yaml", DEMO.read_text()), "--out", w.path("recipes"), "--overwrite"],
      "holds the input"),
    C("build --out <a file> --overwrite", lambda w: ["build", DEMO, "--out", w.write("notes.txt", "x"), "--overwrite"],
      "is a file"),
    C("build --out <a file>", lambda w: ["build", DEMO, "--out", w.write("notes.txt", "x")], "is a file"),
    C("build --out <user folder> --overwrite", lambda w: ["build", DEMO, "--out", w.user_folder(), "--overwrite"],
      "not a release written by debiased-nli"),
    C("build --out <existing folder>", lambda w: ["build", DEMO, "--out", w.user_folder()], "already exists"),
    C("build --out <README.md + manifest.json not ours> --overwrite",
      lambda w: ["build", DEMO, "--out", w.lookalike(), "--overwrite"], "not a release written by debiased-nli"),
    # ---- build: recipes
    C("recipe missing", lambda w: ["build", w.path("nope.yaml"), "--out", w.path("r")], "does not exist"),
    C("recipe invalid YAML", lambda w: ["build", w.write("r.yaml", "task: snli\nz_filter: {top_k: 20\n"), "--out",
                                        w.path("r")], "not valid YAML", "line"),
    C("recipe is a list", lambda w: ["build", w.write("r.yaml", "- task\n- snli\n"), "--out", w.path("r")],
      "must be a YAML mapping"),
    C("recipe top_k: twenty", lambda w: _build(w, recipe=w.recipe(z_filter={"top_k": "twenty"})),
      "z_filter.top_k", "'twenty'"),
    C("recipe top_k: 0", lambda w: _build(w, recipe=w.recipe(z_filter={"top_k": 0})), "z_filter.top_k"),
    C("recipe seed: abc", lambda w: _build(w, recipe=w.recipe(seed="abc")), "`seed`", "'abc'"),
    C("recipe p0: 2", lambda w: _build(w, recipe=w.recipe(z_filter={"p0": 2})), "z_filter.p0"),
    C("recipe p0: lots", lambda w: _build(w, recipe=w.recipe(z_filter={"p0": "lots"})), "z_filter.p0"),
    C("recipe configs: a string", lambda w: _build(w, recipe=w.recipe(configs="z_filtered")), "`configs`", "list"),
    C("recipe on_invalid: skip", lambda w: _build(w, recipe=w.recipe(data={"on_invalid": "skip"})), "data.on_invalid"),
    C("recipe max_rows: 0", lambda w: _build(w, recipe=w.recipe(data={"max_rows": 0})), "data.max_rows"),
    C("recipe duplicates: drop", lambda w: _build(w, recipe=w.recipe(data={"duplicates": "drop"})), "data.duplicates",
      "keep", "set_aside"),
    C("recipe folds: 1", lambda w: _build(w, recipe=w.recipe(features={"folds": 1})), "features.folds"),
    C("recipe history version 1.1 (a float)",
      lambda w: _build(w, recipe=w.recipe(history=[{"version": 1.1, "notes": "x"}])), "`history`"),
    C("recipe new_rows step without a name", lambda w: _build(w, recipe=w.recipe(new_rows=[{"data_files": "x"}])),
      "new_rows[0]"),
    C("recipe: billion laughs under extra_citations", lambda w: _build(w, recipe=w.write("r.yaml", alias_bomb())),
      "aliases", "expand"),
    C("recipe: billion laughs of strings in a valid list",
      lambda w: _build(w, recipe=w.write("r.yaml", alias_bomb(strings=True))), "aliases", "expand"),
    C("recipe: an alias of itself", lambda w: _build(w, recipe=w.write("r.yaml", "task: snli\nextra_citations: &a [*a]\n")),
      "refers to itself"),
    C("recipe: 2 MB", lambda w: _build(w, recipe=w.write("r.yaml", "task: snli\n" + "# padding\n" * 200_000)),
      "too large", "MB"),
    C("recipe: a long list where strings belong", lambda w: _build(w, recipe=w.recipe(extra_citations=[list(range(3000))])),
      "extra_citations", "list"),
    C("recipe: a 100 kB task name", lambda w: _build(w, recipe=w.recipe(task="x" * 100_000)), "unknown task"),
    C("recipe: a 1000-character unknown key", lambda w: _build(w, recipe=w.write("r.yaml", "task: snli\n" + "k" * 1000 + ": 1\n")),
      "unknown recipe key"),
    C("recipe: a seed of 5000 digits", lambda w: _build(w, recipe=w.write("r.yaml", "task: snli\nseed: " + "9" * 5000 + "\n")),
      "number at line 2", "5,000 characters"),
    C("recipe: a wrong step that is a long list", lambda w: _build(w, recipe=w.recipe(filters=[list(range(3000))])),
      "filters[0]"),
    C("task YAML: billion laughs", lambda w: ["audit", w.write("t.yaml", "name: t\n" + alias_bomb(key="labels")[len("task: snli\n"):]),
                                              "--data-files", w.parquet(), "--out", w.path("a")], "aliases"),
    # ---- build: data files
    C("build: data file missing", lambda w: _build(w, data=w.path("missing.parquet")), "does not exist"),
    C("build: empty parquet (0 bytes)", lambda w: _build(w, data=w.write("empty.parquet", b"")), "empty.parquet",
      "empty"),
    C("build: truncated parquet", lambda w: _build(w, data=w.truncated_parquet()), "truncated.parquet", "Parquet"),
    C("build: corrupt parquet", lambda w: _build(w, data=w.write("bad.parquet", b"PAR1" + os.urandom(300) + b"PAR1")),
      "bad.parquet", "Parquet"),
    C("build: parquet named .parquet but JSON inside",
      lambda w: _build(w, data=w.write("j.parquet", '{"premise": "a"}\n')), "j.parquet", "Parquet"),
    C("build: CSV with ; delimiter",
      lambda w: _build(w, data=w.write("semi.csv", "premise;hypothesis;label\nA man.;A dog.;0\nB.;C.;1\n")),
      "semi.csv", "delimiter"),
    C("build: CSV in latin-1", lambda w: _build(w, data=w.write(
        "latin.csv", "premise,hypothesis,label\nCaf\xe9 noir.,A drink.,0\nB.,C.,1\n".encode("latin-1"))),
      "latin.csv", "UTF-8"),
    C("build: JSONL with a list in hypothesis", lambda w: _build(w, data=w.write("mixed.jsonl",
      '{"premise": "A man.", "hypothesis": "A woman.", "label": 0}\n'
      '{"premise": "A dog.", "hypothesis": ["x", "y"], "label": 1}\n'), recipe=w.recipe()), "mixed.jsonl", "row 1", "hypothesis",
      "not a string"),
    C("build: JSONL with a number in premise", lambda w: _build(w, data=w.write("num.jsonl",
      '{"premise": "A man.", "hypothesis": "A woman.", "label": 0}\n{"premise": 7, "hypothesis": "B.", "label": 1}\n'), recipe=w.recipe()),
      "row 1", "premise", "not a string"),
    C("build: JSONL not JSON", lambda w: _build(w, data=w.write("broken.jsonl", '{"premise": "A", \n')),
      "broken.jsonl", "cannot read"),
    C("build: unsupported .txt", lambda w: _build(w, data=w.write("d.txt", "x")), "unsupported file type"),
    C("build: every row one label", lambda w: _build(w, data=w.parquet("one.parquet", one_label=2)),
      "contradiction", "two labels"),
    C("build: missing label column", lambda w: _build(w, data=w.write("nolabel.jsonl",
      '{"premise": "A.", "hypothesis": "B."}\n')), "missing column", "label"),
    C("build --new-rows corrupt", lambda w: _build(w, "--new-rows", w.write("new.parquet", b"garbage")),
      "new.parquet", "Parquet"),
    # ---- build: inputs that are not regular files (a loop, a pipe, a device) are refused before any read
    C("build: data file is a symlink loop", lambda w: _build(w, data=w.loop()), "loop.parquet", "symbolic link"),
    C("build: data file is a cycle of two symlinks", lambda w: _build(w, data=w.cycle()), "a.parquet", "symbolic link"),
    C("build: data file is a broken symlink", lambda w: _build(w, data=w.link("gone.parquet", "nowhere.parquet")),
      "gone.parquet", "nowhere.parquet", "does not exist"),
    C("build: data file is a FIFO", lambda w: _build(w, data=w.fifo()), "pipe.parquet", "not a regular file"),
    C("build: data file links to /dev/zero", lambda w: _build(w, data=w.link("zero.parquet", "/dev/zero")),
      "zero.parquet", "not a regular file"),
    C("build: data file is a folder", lambda w: _build(w, data=w.user_folder("dir.parquet")), "dir.parquet", "folder"),
    C("build: an eval split is a FIFO", lambda w: ["build", SNLI, "--data-files", f"train={w.parquet()}",
                                                   f"validation={w.fifo('dev.jsonl')}", "--out", w.path("r")],
      "dev.jsonl", "not a regular file"),
    C("build --new-rows <symlink loop>", lambda w: _build(w, "--new-rows", w.loop("new.parquet")), "new.parquet",
      "symbolic link"),
    C("build --new-rows <FIFO>", lambda w: _build(w, "--new-rows", w.fifo("new.parquet")), "not a regular file"),
    C("recipe is a symlink loop", lambda w: ["build", w.loop("r.yaml"), "--out", w.path("r")], "r.yaml", "symbolic link"),
    C("recipe is a FIFO", lambda w: ["build", w.fifo("r.yaml"), "--out", w.path("r")], "r.yaml", "not a regular file"),
    C("build --out <symlink loop>", lambda w: ["build", DEMO, "--out", w.loop("rel")], "rel", "symbolic link"),
    # ---- seeds beyond what numpy and torch take (0 .. 2**32 - 1)
    C("build --seed 99999999999999999999", lambda w: _build(w, "--seed", "99999999999999999999"), "--seed", "4294967295"),
    C("build --seed 4294967296", lambda w: _build(w, "--seed", str(2**32)), "--seed", "4294967295"),
    C("recipe seed: 99999999999999999999", lambda w: _build(w, recipe=w.recipe(seed=99999999999999999999)), "`seed`"),
    C("audit --seed 99999999999999999999", lambda w: _audit(w, "--seed", "99999999999999999999"), "--seed"),
    C("train --seed 2**40", lambda w: _train(w, "--seed", str(2**40)), "--seed"),
    C("generate --seed 2**40", lambda w: _generate(w, "--seed", str(2**40)), "--seed"),
    # ---- build --efficacy
    C("build --efficacy <not JSON>", lambda w: _build(w, "--efficacy", w.write("eff.json", "{not json")), "eff.json",
      "not valid JSON"),
    C("build --efficacy <a JSON list>", lambda w: _build(w, "--efficacy", w.write("eff.json", "[1, 2]")), "eff.json",
      "not an efficacy table"),
    C("build --efficacy <a JSON number>", lambda w: _build(w, "--efficacy", w.write("eff.json", "3")), "eff.json",
      "not an efficacy table"),
    C("build --efficacy <empty>", lambda w: _build(w, "--efficacy", w.write("eff.json", "")), "eff.json", "JSON"),
    C("build --efficacy <latin-1 bytes>", lambda w: _build(w, "--efficacy", w.write("eff.json", b'{"a": "caf\xe9"}')),
      "eff.json", "UTF-8"),
    C("build --efficacy <a folder>", lambda w: _build(w, "--efficacy", w.user_folder("eff")), "eff", "folder"),
    C("build --efficacy <FIFO>", lambda w: _build(w, "--efficacy", w.fifo("eff.json")), "eff.json", "not a regular file"),
    C("build --efficacy <symlink loop>", lambda w: _build(w, "--efficacy", w.loop("eff.json")), "eff.json",
      "symbolic link"),
    # ---- audit
    C("audit --top-k 0", lambda w: _audit(w, "--top-k", "0"), "--top-k", ">= 1"),
    C("audit --alpha 2", lambda w: _audit(w, "--alpha", "2"), "--alpha"),
    C("audit --p0 abc", lambda w: _audit(w, "--p0", "abc"), "--p0"),
    C("audit --p0 1.5", lambda w: _audit(w, "--p0", "1.5"), "--p0", "< 1"),
    C("audit --z-threshold -1", lambda w: _audit(w, "--z-threshold", "-1"), "--z-threshold"),
    C("audit --max-rows -1", lambda w: _audit(w, "--max-rows", "-1"), "--max-rows"),
    C("audit --out .", lambda w: ["audit", "snli", "--data-files", w.parquet(), "--out", "."], "current folder"),
    C("audit --out <user folder>", lambda w: ["audit", "snli", "--data-files", w.parquet(), "--out", w.user_folder()],
      "not an audit written by debiased-nli"),
    C("audit --hypothesis-only <missing folder>", lambda w: _audit(w, "--hypothesis-only", "./no/such/model"),
      "--hypothesis-only", "no such folder"),
    C("audit: every row one label", lambda w: _audit(w, data=w.parquet("one.parquet", one_label=0)), "two labels"),
    C("audit: corrupt parquet", lambda w: _audit(w, data=w.write("bad.parquet", b"nope")), "bad.parquet"),
    C("audit: data file is a symlink loop", lambda w: _audit(w, data=w.loop()), "symbolic link"),
    C("audit: data file is a FIFO", lambda w: _audit(w, data=w.fifo()), "not a regular file"),
    C("audit: data file links to /dev/zero", lambda w: _audit(w, data=w.link("zero.jsonl", "/dev/zero")),
      "not a regular file"),
    C("audit: unknown task", lambda w: ["audit", "snlii", "--data-files", w.parquet(), "--out", w.path("a")],
      "snlii"),
    # ---- train
    C("train --batch-size 0", lambda w: _train(w, "--batch-size", "0"), "--batch-size", ">= 1"),
    C("train --lr -1", lambda w: _train(w, "--lr", "-1"), "--lr", "> 0"),
    C("train --epochs 0", lambda w: _train(w, "--epochs", "0"), "--epochs"),
    C("train --warmup-ratio 1", lambda w: _train(w, "--warmup-ratio", "1"), "--warmup-ratio"),
    C("train --model <missing folder>", lambda w: ["train", "snli", "--data-files", w.parquet(), "--model",
                                                   "./models/none", "--out", w.path("run")], "--model", "no such folder"),
    C("train --model <folder without config.json>", lambda w: ["train", "snli", "--data-files", w.parquet(), "--model",
                                                                w.model_folder(config=None), "--out", w.path("run")],
      "--model", "config.json"),
    C("train --model <corrupt config.json>", lambda w: ["train", "snli", "--data-files", w.parquet(), "--model",
                                                         w.model_folder(config="{not json"), "--out", w.path("run")],
      "--model", "not valid JSON"),
    C("train --model <uncached Hub id, offline>", lambda w: ["train", "snli", "--data-files", w.parquet(), "--model",
                                                              "nobody/no-such-model", "--out", w.path("run")],
      "--model", "offline"),
    C("train --model <corrupt weights>", lambda w: ["train", "snli", "--data-files", w.parquet(), "--model",
                                                     w.broken_model(), "--out", w.path("run")],
      "--model", "cannot load"),
    C("train --release <corrupt parquet inside>", lambda w: ["train", "snli", "--release", w.broken_release(),
                                                             "--config", "z_filtered", "--model", w.model_folder(),
                                                             "--out", w.path("run")], "cannot load", "z_filtered"),
    C("train --poe --bias-model <missing>", lambda w: _train(w, "--poe", "--bias-model", "./bias/none"),
      "--bias-model", "no such folder"),
    C("train --release <missing>", lambda w: ["train", "snli", "--release", "./out/none", "--config", "z_filtered",
                                              "--model", w.model_folder(), "--out", w.path("run")], "--release"),
    C("train --release <not a release>", lambda w: ["train", "snli", "--release", w.user_folder(), "--config",
                                                    "z_filtered", "--model", w.model_folder(), "--out", w.path("run")],
      "not a release folder"),
    # ---- evaluate
    C("evaluate --max-examples 0", lambda w: _evaluate(w, "--max-examples", "0"), "--max-examples", ">= 1"),
    C("evaluate --batch-size 0", lambda w: _evaluate(w, "--batch-size", "0"), "--batch-size"),
    C("evaluate --compare <not JSON>", lambda w: _evaluate(w, "--compare", w.write("res.json", "<html>")),
      "res.json", "not a JSON results file"),
    C("evaluate --compare <other JSON>", lambda w: _evaluate(w, "--compare", w.write("res.json", "[1, 2]")),
      "res.json", "not a debiased-nli results file"),
    C("evaluate --compare <missing>", lambda w: _evaluate(w, "--compare", w.path("none.json")), "does not exist"),
    C("evaluate --model <missing>", lambda w: ["evaluate", "--model", "./runs/none", "--sets", "hans", "--out",
                                               w.path("e")], "--model", "no such folder"),
    C("evaluate --label-order with a repeat", lambda w: _evaluate(w, "--label-order", "entailment,entailment,neutral"),
      "--label-order"),
    C("evaluate: unknown set", lambda w: _evaluate(w, "--sets", "hanz"), "hanz"),
    # ---- generate
    C("generate --num-samples 0", lambda w: _generate(w, "--num-samples", "0"), "--num-samples"),
    C("generate --top-p 0", lambda w: _generate(w, "--top-p", "0"), "--top-p"),
    C("generate --temperature 0", lambda w: _generate(w, "--temperature", "0"), "--temperature"),
    C("generate --generator <missing>", lambda w: ["generate", "snli", "--generator", "./gens/none", "--out",
                                                   w.path("g"), "--num-samples", "4"], "--generator", "no such folder"),
    C("generate --generator <folder without config>", lambda w: ["generate", "snli", "--generator",
                                                                 w.model_folder(config=None), "--out", w.path("g"),
                                                                 "--num-samples", "4"], "--generator", "config.json"),
    C("generate --premises-from <corrupt>", lambda w: _generate(w, "--condition", "premise", "--premises-from",
                                                                w.write("prem.parquet", b"PAR1 nope")),
      "prem.parquet", "Parquet"),
    C("generate --condition premise without --premises-from", lambda w: _generate(w, "--condition", "premise"),
      "--premises-from"),
    C("generate --premises-from <FIFO>", lambda w: _generate(w, "--condition", "premise", "--premises-from", w.fifo()),
      "not a regular file"),
    C("generate: a 16-token generator, --max-new-tokens 64",
      lambda w: _generate(w, "--max-new-tokens", "64", "--cpu", generator=w.tiny_generator()), "--max-new-tokens", "16"),
    C("generate: a 16-token generator, --max-new-tokens 16",
      lambda w: _generate(w, "--max-new-tokens", "16", "--cpu", generator=w.tiny_generator()), "--max-new-tokens", "16"),
    C("generate: a 16-token generator, a premise prompt longer than 16 - 12 tokens",
      lambda w: _generate(w, "--max-new-tokens", "12", "--cpu", "--condition", "premise", "--premises-from",
                          w.parquet("prem.parquet", n=8), generator=w.tiny_generator()), "--max-new-tokens", "prompt"),
    C("train: data file is a FIFO", lambda w: ["train", "snli", "--data-files", w.fifo(), "--model", w.model_folder(),
                                               "--out", w.path("run")], "not a regular file"),
    # ---- aflite
    C("aflite --m 0", lambda w: _aflite(w, "--m", "0"), "--m"),
    C("aflite --tau 1.5", lambda w: _aflite(w, "--tau", "1.5"), "--tau"),
    C("aflite --k 0", lambda w: _aflite(w, "--k", "0"), "--k"),
    C("aflite --warmup-share 1", lambda w: _aflite(w, "--warmup-share", "1"), "--warmup-share"),
    C("aflite --encoder <missing>", lambda w: _aflite(w, "--encoder", "./enc/none"), "--encoder", "no such folder"),
    C("aflite: every row one label", lambda w: ["aflite", "snli", "--data-files", w.parquet("one.parquet", one_label=1),
                                                "--out", w.path("af")], "two labels"),
    C("aflite: corrupt parquet", lambda w: ["aflite", "snli", "--data-files", w.write("bad.parquet", b"x" * 50),
                                            "--out", w.path("af")], "bad.parquet"),
    # ---- the method commands' shared flags (one --seed and one --threads, issue 33)
    *[C(f"{cmd} --seed 99999999999999999999", lambda w, cmd=cmd: _method(w, cmd, "--seed", "99999999999999999999"),
        "--seed", "below 2**32") for cmd in ("aflite", "pdd", "ibadr")],
    *[C(f"{cmd} --seed -1", lambda w, cmd=cmd: _method(w, cmd, "--seed", "-1"), "--seed", ">= 0")
      for cmd in ("aflite", "pdd", "ibadr")],
    *[C(f"{cmd} --threads 0", lambda w, cmd=cmd: _method(w, cmd, "--threads", "0"), "--threads", ">= 1")
      for cmd in ("aflite", "pdd", "ibadr")],
    # ---- push
    C("push <not a release>", lambda w: ["push", w.user_folder(), "--repo-id", "org/x"], "not a release folder"),
    C("push --repo-id noslash", lambda w: ["push", w.fake_release(), "--repo-id", "noslash"], "ORG/NAME"),
    C("push --revision 'latest version'", lambda w: ["push", w.fake_release(), "--repo-id", "org/x", "--revision",
                                                     "latest version"], "not a version tag"),
    C("push in offline mode", lambda w: ["push", w.fake_release(), "--repo-id", "org/x"], "offline mode"),
    # ---- cache
    C("cache clear --older-than -1", lambda w: ["cache", "clear", "--older-than", "-1"], "--older-than"),
    C("cache (no action)", lambda w: ["cache"], "required"),
]


def _record(case_id: str, message: str) -> None:
    table = os.environ.get("DEBIASED_NLI_BAD_INPUT_TABLE")
    if table:
        with open(table, "a") as f:
            f.write(json.dumps({"case": case_id, "prints": message}) + "\n")


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-2000:]
    return errors[0]


@pytest.fixture(autouse=True)
def _library_logs_to_this_tests_stderr():
    # `datasets` binds its log handler to the sys.stderr of the moment it was set up (an earlier
    # test's captured stream); point it at this test's, as a fresh process would have it
    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as transformers_logging
    for library in (datasets_logging, transformers_logging):
        handler = getattr(library, "_default_handler", None)
        if handler is not None:
            handler.setStream(sys.stderr)


@pytest.fixture
def world(tmp_path, monkeypatch):
    w = World(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(w.home))
    return w


def test_the_table_has_enough_cases_across_the_commands():
    commands = {c.id.split()[0].rstrip(":") for c in CASES}
    assert len(CASES) >= 50
    assert {"build", "recipe", "audit", "train", "evaluate", "generate", "aflite", "push"} <= commands


@pytest.fixture
def alarm():
    """A case that blocks (a FIFO opened for reading, /dev/zero read to the end) ends in an error after
    two minutes instead of hanging the suite."""
    def ring(signum, frame):
        raise TimeoutError("the case blocked for 120 s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(case, world, capsys, alarm):
    argv = [str(a) for a in case.argv(world)]
    before = snapshot(world.root)
    rc = main(argv)
    out, err = capsys.readouterr()
    line = _one_error_line(err)
    _record(case.id, line)
    assert rc == 2, (rc, line)
    assert len(line) < 1500, line[:300]  # an excerpt of a value, never the whole of it
    for fragment in case.expect:
        assert fragment.lower() in line.lower(), (fragment, line)
    assert snapshot(world.root) == before  # no output, no lock, no temporary folder, inputs unchanged


def test_the_method_commands_share_one_seed_and_one_threads_flag():
    from debiased_nli.cli import build_parser
    from debiased_nli.cli.commands._common import POSITIVE_INT, SEED

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("aflite", "pdd", "ibadr"):
        flags = {a.dest: a for a in sub[command]._actions}
        assert flags["seed"].type is SEED and flags["threads"].type is POSITIVE_INT, command
    assert SEED(str(2 ** 32 - 1)) == 2 ** 32 - 1


def test_a_recipe_alias_bomb_fails_fast_in_one_short_line(world, capsys):
    """What a recipe may expand to is bounded while it is read: the bomb is refused in well under a
    second, without building the value, and no error message carries a whole value."""
    import tracemalloc

    for text in (alias_bomb(), alias_bomb(strings=True), alias_bomb(levels=12, width=2)):
        recipe = world.write("bomb.yaml", text)
        tracemalloc.start()
        start = time.monotonic()
        rc = main(["build", str(recipe), "--out", str(world.path("rel"))])
        took = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        line = _one_error_line(capsys.readouterr().err)
        assert rc == 2 and took < 1.0 and peak < 50 * 2**20 and len(line) < 400, (took, peak, line)
    from debiased_nli.release.recipe import load_recipe
    from debiased_nli.utils.errors import ConfigError

    shared = ["lol"] * 10
    for _ in range(8):  # the same bomb built in Python: a recipe mapping is checked without a whole repr
        shared = [shared] * 10
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_recipe({"task": "snli", "extra_citations": shared})
    assert time.monotonic() - start < 1.0 and len(str(err.value)) < 400 and "extra_citations" in str(err.value)


def test_recipe_errors_quote_a_short_excerpt_of_the_value(world, capsys):
    for over in ({"extra_citations": [list(range(3000))]}, {"task": "x" * 100_000}, {"seed": "9" * 50_000},
                 {"z_filter": {"top_k": "y" * 50_000}}, {"new_rows": [{"step": "z" * 50_000}]}):
        assert main(_build(world, recipe=world.recipe(**over))[:1] + [str(world.path("recipe.yaml")), "--out",
                                                                          str(world.path("rel"))]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert len(line) < 500, (over.keys(), len(line), line[:300])


# ------------------------------------------------------------------------------------------ conservation

def _uids(path: Path, origin: str | None = "original") -> list[str]:
    if not path.exists():
        return []
    files = [path] if path.is_file() else sorted(path.glob("*.parquet"))
    out = []
    for f in files:
        t = pq.read_table(f)
        if origin is not None and "origin" in t.column_names:
            keep = [o == origin for o in t.column("origin").to_pylist()]
            out += [u for u, k in zip(t.column("uid").to_pylist(), keep) if k]
        else:
            out += t.column("uid").to_pylist()
    return out


def assert_conserved(release: Path, task: str, n_input: int, n_new: int = 0) -> None:
    """For every config: the original rows kept + rejected + set aside (on loading) are the input rows
    `<task>:train:0..n-1`, each exactly once; the new rows, by count. The manifest counts what is written."""
    manifest = json.loads((release / "manifest.json").read_text())
    aside_path = release / "rejected" / "set_aside_on_load.parquet"
    aside = pq.read_table(aside_path).to_pydict() if aside_path.exists() else {"uid": [], "input": []}
    aside_train = [u for u, i in zip(aside["uid"], aside.get("input", ["train"] * len(aside["uid"]))) if i == "train"]
    aside_new = sum(1 for i in aside.get("input", []) if i.startswith("new_rows"))
    counts = {}
    for i in aside.get("input", []):
        counts[i] = counts.get(i, 0) + 1
    assert manifest["set_aside"] == counts
    expected = {f"{task}:train:{i}" for i in range(n_input)}
    for config in manifest["files"]:
        kept = [u for f in sorted((release / "data" / config).glob("train-*.parquet")) for u in _uids(f)]
        rejected = _uids(release / "rejected" / config)
        everything = kept + rejected + aside_train
        assert len(everything) == len(set(everything)) and set(everything) == expected, config
        if n_new and config != "z_filtered":
            new_kept = [u for f in sorted((release / "data" / config).glob("train-*.parquet"))
                        for u in _uids(f, "generated")]
            new_rejected = _uids(release / "rejected" / config, "generated")
            assert len(set(new_kept)) + len(set(new_rejected)) + aside_new == n_new, config


def test_every_set_aside_row_of_every_input_is_written_and_counted(world, capsys):
    """D0, an evaluation split and new rows each have bad rows: all of them are in the release."""
    w = world
    rows = _rows(300)
    rows["hypothesis"][5] = ""                   # empty text
    rows["label"][7] = -1                        # no gold label
    pq.write_table(pa.table(rows), w.path("train.parquet"))
    dev = _rows(40, seed=1)
    dev["premise"][3] = None
    pq.write_table(pa.table(dev), w.path("dev.parquet"))
    new = _rows(50, seed=2)
    new["label"][0] = 9                          # out of range
    new["hypothesis"][1] = "   "
    pq.write_table(pa.table(new), w.path("new.parquet"))
    recipe = w.recipe(data={"on_invalid": "set_aside", "eval_splits": ["validation"]},
                      new_rows=[{"step": "files", "data_files": str(w.path("new.parquet")), "on_invalid": "set_aside"}],
                      features={"hypothesis_only": "none"})  # YAML's `none`: no hypothesis-only model
    rc = main(["build", str(recipe), "--data-files", f"train={w.path('train.parquet')}",
               f"validation={w.path('dev.parquet')}", "--out", str(w.path("rel")), "--quiet"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    rel = w.path("rel")
    aside = pq.read_table(rel / "rejected" / "set_aside_on_load.parquet").to_pydict()
    assert sorted(zip(aside["input"], aside["reason"])) == sorted([
        ("train", "empty or null text"), ("train", "no gold label"), ("eval:validation", "empty or null text"),
        ("new_rows:files:new.parquet", "label out of range"), ("new_rows:files:new.parquet", "empty or null text")])
    assert_conserved(rel, "snli", 300, n_new=50)
    manifest = json.loads((rel / "manifest.json").read_text())
    assert manifest["recipe"]["features"]["hypothesis_only"] is None
    assert sorted(p.name for p in w.root.iterdir()) == sorted(["home", "train.parquet", "dev.parquet", "new.parquet",
                                                               "recipe.yaml", "rel"])


def _with_duplicates(w) -> tuple[Path, dict]:
    """90 rows, then copies of rows 3, 5 and 5 (rows 90-92), and row 7's pair with another label (row 93)."""
    rows = _rows(90)
    rows["hypothesis"] = [f"{h} {i}" for i, h in enumerate(rows["hypothesis"])]  # no accidental repeats
    for i in (3, 5, 5):
        for k in rows:
            rows[k].append(rows[k][i])
    rows["premise"].append(rows["premise"][7])
    rows["hypothesis"].append(rows["hypothesis"][7])
    rows["label"].append((rows["label"][7] + 1) % 3)
    path = w.path("train.parquet")
    pq.write_table(pa.table(rows), path)
    return path, rows


def test_duplicate_rows_are_counted_and_kept_by_default(world, capsys):
    w = world
    data, _ = _with_duplicates(w)
    assert main(["build", str(SNLI), "--data-files", str(data), "--out", str(w.path("rel")), "--quiet"]) == 0
    err = capsys.readouterr().err
    said = [ln for ln in err.splitlines() if "duplicates:" in ln]
    assert len(said) == 1 and "3 rows" in said[0] and "kept" in said[0] and "data.duplicates" in said[0], err
    manifest = json.loads((w.path("rel") / "manifest.json").read_text())
    assert manifest["duplicates"] == {"train": {"rows": 3, "groups": 2, "policy": "keep"}}
    assert manifest["recipe"]["data"]["duplicates"] == "keep"
    assert_conserved(w.path("rel"), "snli", 94)  # every row, the copies included, is in the release


def test_duplicate_rows_set_aside_go_to_the_rejected_rows_with_the_row_they_repeat(world, capsys):
    w = world
    data, rows = _with_duplicates(w)
    recipe = w.recipe(data={"duplicates": "set_aside"})
    assert main(["build", str(recipe), "--data-files", str(data), "--out", str(w.path("rel")), "--quiet"]) == 0
    said = [ln for ln in capsys.readouterr().err.splitlines() if "duplicates:" in ln]
    assert len(said) == 1 and "3 rows" in said[0] and "set aside" in said[0], said
    aside = pq.read_table(w.path("rel") / "rejected" / "set_aside_on_load.parquet").to_pydict()
    assert sorted(zip(aside["uid"], aside["reason"], aside["input"])) == [
        ("snli:train:90", "duplicate of row 3", "train"), ("snli:train:91", "duplicate of row 5", "train"),
        ("snli:train:92", "duplicate of row 5", "train")]
    assert [aside["premise"][aside["uid"].index(f"snli:train:{i}")] for i in (90, 91)] == [rows["premise"][3],
                                                                                         rows["premise"][5]]
    manifest = json.loads((w.path("rel") / "manifest.json").read_text())
    assert manifest["duplicates"] == {"train": {"rows": 3, "groups": 2, "policy": "set_aside"}}
    assert manifest["set_aside"] == {"train": 3}
    assert_conserved(w.path("rel"), "snli", 94)  # kept + rejected + set aside: every input row once
    kept = [u for f in sorted(w.path("rel").glob("data/*/*.parquet")) for u in _uids(f)]
    assert not {"snli:train:90", "snli:train:91", "snli:train:92"} & set(kept) and "snli:train:93" in \
        set(kept) | set(_uids(w.path("rel") / "rejected" / "z_filtered"))


def test_find_duplicates_is_exact():
    import datasets
    from debiased_nli.data.duplicates import find_duplicates

    ds = datasets.Dataset.from_dict({"premise": ["a", "a", "a\x1fb", "a", "a"], "hypothesis": ["b\x1fc", "b\x1fc", "c", "b\x1fc", "b"],
                                     "label": [0, 0, 0, 1, 0], "uid": [f"t:train:{i}" for i in range(5)]})
    first = find_duplicates(ds)
    assert first.tolist() == [-1, 0, -1, -1, -1]  # only row 1 repeats (row 0); joined texts that collide do not


# ------------------------------------------------------------------------------------------ data loss

def _demo_release(out: Path, *extra) -> None:
    assert main(["build", str(DEMO), "--out", str(out), "--max-rows", "600", "--quiet", *extra]) == 0
    assert_conserved(out, "demo", 600)


def test_overwrite_replaces_only_a_release_of_this_tool(world, capsys):
    w = world
    _demo_release(w.path("rel"))
    _demo_release(w.path("rel"), "--overwrite", "--seed", "3")  # a release of ours, nothing else in it: replaced
    assert is_release_folder(w.path("rel"))
    assert json.loads((w.path("rel") / "manifest.json").read_text())["written_by"] == "debiased-nli"
    # a folder with the same files but no mark is someone else's
    manifest = json.loads((w.path("rel") / "manifest.json").read_text())
    del manifest["written_by"], manifest["versions"]["debiased-nli"]
    (w.path("rel") / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(w.root)
    assert main(["build", str(DEMO), "--out", str(w.path("rel")), "--overwrite", "--quiet"]) == 2
    assert "not a release written by debiased-nli" in _one_error_line(capsys.readouterr().err)
    assert snapshot(w.root) == before


def _refused_naming(capsys, *names) -> str:
    line = _one_error_line(capsys.readouterr().err)
    for name in names:
        assert name in line, (name, line)
    return line


def test_overwrite_never_deletes_a_users_files_inside_the_release(world, capsys):
    """--overwrite replaces a release, not what the user put beside its files: such a target is refused,
    the refusal names the foreign files, and nothing changes (also through a symlink to the release)."""
    w = world
    rel = w.path("rel")
    _demo_release(rel)
    w.path("link").symlink_to(rel)
    for extra in ("NOTES.md", "data/z_filtered/my-sample.csv", "images/logo.png", "rejected/train-00000-of-00001.parquet"):
        (rel / extra).write_text("the user's own")
        before = snapshot(w.root)
        for out in (rel, w.path("link")):
            assert main(["build", str(DEMO), "--out", str(out), "--max-rows", "600", "--overwrite", "--quiet"]) == 2
            line = _refused_naming(capsys, extra)
            _record(f"build --overwrite over a release holding {extra}", line)
            assert "not part of" in line and "--overwrite" in line
            assert snapshot(w.root) == before
        (rel / extra).unlink()
    _demo_release(w.path("link"), "--overwrite", "--seed", "3")  # nothing foreign left: replaced through the link
    assert w.path("link").is_symlink() and is_release_folder(rel)


def test_a_second_audit_never_deletes_a_users_files(world, capsys):
    w = world
    data = w.parquet("train.parquet", n=90)
    common = ["audit", "snli", "--data-files", str(data), "--hypothesis-only", "none", "--out"]
    assert main(common + [str(w.path("audit"))]) == 0
    w.path("audit-link").symlink_to(w.path("audit"))
    (w.path("audit") / "NOTES.md").write_text("what I make of it")
    (w.path("audit") / "plots").mkdir()
    (w.path("audit") / "plots" / "mine.png").write_bytes(b"png")
    capsys.readouterr()
    before = snapshot(w.root)
    for out in ("audit", "audit-link"):
        assert main(common + [str(w.path(out))]) == 2
        _record("a second audit into a folder holding NOTES.md", _refused_naming(capsys, "NOTES.md", "plots/mine.png"))
        assert snapshot(w.root) == before
    (w.path("audit") / "NOTES.md").unlink()
    import shutil
    shutil.rmtree(w.path("audit") / "plots")
    assert main(common + [str(w.path("audit-link"))]) == 0


def test_a_foreign_file_added_during_the_build_is_never_deleted(world, monkeypatch):
    """The check before the work is repeated at the swap itself: a file written into the target while
    the release was being built stops the swap, and the old release stays with it."""
    import debiased_nli.utils.outputs as outputs
    from debiased_nli.utils.errors import ConfigError

    w = world
    rel = w.path("rel")
    _demo_release(rel)
    real = outputs.replace_folder

    def late_note(tmp, target):
        (target / "NOTES.md").write_text("written while the build ran")
        return real(tmp, target)

    import debiased_nli.release.layout as layout
    monkeypatch.setattr(layout, "replace_folder", late_note)
    manifest = (rel / "manifest.json").read_bytes()
    with pytest.raises(ConfigError, match="NOTES.md"):
        from debiased_nli.release.recipe import build
        build(str(DEMO), rel, overwrite=True, max_rows=600, seed=3, progress=False)
    assert (rel / "NOTES.md").read_text() == "written while the build ran"
    assert (rel / "manifest.json").read_bytes() == manifest
    assert sorted(p.name for p in w.root.iterdir() if p.name.startswith(".rel")) == []


def test_a_second_build_into_a_locked_target_is_refused(world, capsys):
    w = world
    lock = w.path(".rel.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a running build holds
    os.write(fd, b"4242")
    try:
        assert main(["build", str(DEMO), "--out", str(w.path("rel")), "--quiet"]) == 2
        assert "another debiased-nli process (pid 4242) is writing" in _one_error_line(capsys.readouterr().err)
        assert not w.path("rel").exists()
    finally:
        os.close(fd)
    lock.unlink()
    _demo_release(w.path("rel"))  # once the other run is gone, the build goes through
    assert not lock.exists()


def test_a_full_or_read_only_disk_leaves_no_half_release(world, capsys, monkeypatch):
    import debiased_nli.utils.outputs as outputs
    import debiased_nli.release.layout as release

    w = world
    real = release._write_parquet
    calls = []

    def full_disk(ds, folder, split, **kw):
        calls.append(folder)
        if len(calls) == 2:  # the first file is written, the second finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / f"{split}-00000.parquet"))
        return real(ds, folder, split, **kw)

    monkeypatch.setattr(release, "_write_parquet", full_disk)
    before = snapshot(w.root)
    assert main(["build", str(DEMO), "--out", str(w.path("rel")), "--max-rows", "600", "--quiet"]) == 2
    assert "no space left on the device" in _one_error_line(capsys.readouterr().err)
    assert snapshot(w.root) == before  # no temporary folder, no 0-byte file, no lock
    monkeypatch.setattr(release, "_write_parquet", real)

    def read_only(target):
        raise OSError(errno.EROFS, "Read-only file system", str(target.parent / f".{target.name}.tmp-1"))

    monkeypatch.setattr(outputs, "temp_folder", read_only)
    monkeypatch.setattr(release, "temp_folder", read_only)
    assert main(["build", str(DEMO), "--out", str(w.path("rel")), "--max-rows", "600", "--quiet"]) == 2
    assert "read-only" in _one_error_line(capsys.readouterr().err)
    assert snapshot(w.root) == before


def test_stale_temporary_folders_are_cleaned_and_an_interrupted_swap_put_back(world, capsys):
    w = world
    dead = 2**22 + 12345  # above pid_max on this machine's default: no such process
    ours = w.path(f".rel.tmp-{dead}")
    ours.mkdir()
    (ours / TMP_MARKER).write_text(str(dead))
    (ours / "manifest.json").write_text("{}")
    not_ours = w.path(f".rel.tmp-{dead + 1}")
    not_ours.mkdir()
    (not_ours / "keep.txt").write_text("not made by debiased-nli")
    alive = w.path(".rel.tmp-1")  # pid 1 is alive: a running build's
    alive.mkdir()
    (alive / TMP_MARKER).write_text("1")
    _demo_release(w.path("rel"))
    assert not ours.exists() and (not_ours / "keep.txt").exists() and alive.exists()
    # killed between the two renames of a replacement: the old release is beside the target
    w.path("rel").rename(w.path(f".rel.old-{dead}"))
    assert main(["build", str(DEMO), "--out", str(w.path("rel")), "--max-rows", "600", "--quiet"]) == 2
    assert "already exists" in _one_error_line(capsys.readouterr().err)  # put back, then protected
    assert is_release_folder(w.path("rel")) and not w.path(f".rel.old-{dead}").exists()


def test_a_file_rewritten_with_its_old_mtime_is_read_again(world, capsys):
    """`cp -p`/`rsync -a` keep the mtime: the content hash in the cache key sees the new rows."""
    w = world
    data = w.parquet("train.parquet", n=90)
    assert main(["build", str(SNLI), "--data-files", str(data), "--out", str(w.path("a")), "--quiet"]) == 0
    st = data.stat()
    rows = _rows(90)
    rows["hypothesis"] = [f"Changed hypothesis number {i}." for i in range(90)]
    pq.write_table(pa.table(rows), data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert main(["build", str(SNLI), "--data-files", str(data), "--out", str(w.path("b")), "--quiet"]) == 0
    manifest = json.loads((w.path("b") / "manifest.json").read_text())
    hypotheses = [h for f in sorted(w.path("b").glob("*/z_filtered/*.parquet"))
                  for h in pq.read_table(f).column("hypothesis").to_pylist()]
    assert len(hypotheses) == 90 and all(h.startswith("Changed") for h in hypotheses)
    import hashlib
    assert manifest["inputs"][0]["inputs"][0]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    for rel in ("a", "b"):
        assert_conserved(w.path(rel), "snli", 90)


# ------------------------------------------------------------------------------------------ kill -9

def _env(tmp: Path) -> dict:
    return dict(os.environ, DEBIASED_NLI_CACHE=str(tmp / "cache"), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _build_cmd(out: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "debiased_nli.cli", "build", str(DEMO), "--out", str(out), "--max-rows", "600",
            "--quiet", *extra]


def _complete(release: Path) -> bool:
    if not is_release_folder(release):
        return False
    manifest = json.loads((release / "manifest.json").read_text())
    return all((release / f["path"]).is_file() and pq.read_metadata(release / f["path"]).num_rows == f["rows"]
               for splits in manifest["files"].values() for files in splits.values() for f in files)


def test_kill_9_at_random_moments_leaves_the_target_absent_or_complete(tmp_path):
    rng = random.Random(1234)
    env = _env(tmp_path)
    target = tmp_path / "rel"
    start = time.monotonic()
    done = subprocess.run(_build_cmd(tmp_path / "reference"), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_conserved(tmp_path / "reference", "demo", 600)
    duration = time.monotonic() - start
    outcomes = []
    for attempt in range(3):
        overwrite = ["--overwrite"] if target.exists() else []
        proc = subprocess.Popen(_build_cmd(target, *overwrite), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if attempt == 0:  # somewhere in the whole run
            time.sleep(rng.uniform(0.2, 0.9) * duration)
        else:  # while it writes the release: after the temporary folder appears
            deadline = time.monotonic() + 2 * duration
            while not list(tmp_path.glob(".rel.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = "complete" if target.exists() else "absent"
        assert not target.exists() or _complete(target), f"attempt {attempt}: a half release"
        outcomes.append(state)
    # the next build cleans what the killed ones left and completes
    final = subprocess.run(_build_cmd(target, "--overwrite") if target.exists() else _build_cmd(target), env=env,
                           capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]
    assert _complete(target)
    assert_conserved(target, "demo", 600)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".rel.")]
    assert leftovers == [], leftovers


def test_the_console_prints_no_traceback_and_v_shows_it(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really PAR1")
    cmd = [sys.executable, "-m", "debiased_nli.cli", "audit", "snli", "--data-files", str(bad), "--out",
           str(tmp_path / "a")]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "bad.parquet" in line and "Parquet" in line
    verbose = subprocess.run(cmd[:3] + ["-v"] + cmd[3:], env=_env(tmp_path), capture_output=True, text=True,
                             timeout=300)
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr


# ------------------------------------------------------------------------------------------ network

class SilentServer:
    """Accepts TCP connections and never answers (a Hub behind a broken proxy)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def online(monkeypatch):
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)


def test_push_to_a_hub_that_never_answers_ends_in_bounded_time(world, capsys, monkeypatch, online):
    w = world
    _demo_release(w.path("rel"))
    monkeypatch.setenv("DEBIASED_NLI_HUB_TIMEOUT", "1")
    with SilentServer() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        import huggingface_hub.constants as c
        monkeypatch.setattr(c, "ENDPOINT", hub.url)
        start = time.monotonic()
        rc = main(["push", str(w.path("rel")), "--repo-id", "org/x", "--revision", "v1.0"])
        took = time.monotonic() - start
    line = _one_error_line(capsys.readouterr().err)
    _record("push to a Hub that never answers (timeout 1 s)", line)
    assert rc == 2 and "did not answer within 1 s" in line and took < 30, (line, took)


class TricklingServer:
    """Answers every request one byte per second: the status line and headers (``part="headers"``), or
    complete headers and then a body that never ends (``part="body"``). Each read of the client gets a
    byte well within its timeout, so only a deadline on the whole push ends it."""

    def __init__(self, part: str):
        self.part = part
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []

    def _serve(self, conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
        try:
            conn.recv(65536)
            if self.part == "body":
                conn.sendall(head)
            for byte in (head if self.part == "headers" else b"{" + b" " * 999_999):
                if self.stop.wait(1.0):
                    return
                conn.sendall(bytes([byte]))
        except OSError:
            return

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def __enter__(self):
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.sock.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


@pytest.mark.parametrize("part", ["headers", "body"])
def test_push_to_a_hub_that_trickles_ends_at_its_deadline(world, capsys, monkeypatch, online, part):
    """A Hub that answers one byte per second never trips a read timeout; the deadline still ends the
    push: one line, exit 2, within the deadline and a small margin."""
    w = world
    _demo_release(w.path("rel"))
    capsys.readouterr()
    monkeypatch.setenv("DEBIASED_NLI_HUB_TIMEOUT", "2")
    monkeypatch.setenv("DEBIASED_NLI_HUB_DEADLINE", "3")
    with TricklingServer(part) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        import huggingface_hub.constants as c
        monkeypatch.setattr(c, "ENDPOINT", hub.url)
        start = time.monotonic()
        rc = main(["push", str(w.path("rel")), "--repo-id", "org/x", "--revision", "v1.0"])
        took = time.monotonic() - start
    line = _one_error_line(capsys.readouterr().err)
    _record(f"push to a Hub that trickles its {part} (timeout 2 s, deadline 3 s)", line)
    assert rc == 2 and "deadline of 3 s" in line and took < 3 + 2, (rc, line, took)


def test_the_push_command_exits_at_its_deadline_against_a_trickling_hub(world):
    """The same as a process: the worker left reading the trickle does not keep it alive."""
    w = world
    _demo_release(w.path("rel"))
    with TricklingServer("body") as hub:
        env = dict(_env(w.root), HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, HF_TOKEN="hf_x",
                   DEBIASED_NLI_HUB_TIMEOUT="2", DEBIASED_NLI_HUB_DEADLINE="3")
        cmd = [sys.executable, "-c", "import time, sys; from debiased_nli.cli import main; "
               "import debiased_nli.release.publish, huggingface_hub; t = time.monotonic(); "
               "rc = main(sys.argv[1:]); print(f'took {time.monotonic() - t:.2f}', file=sys.stderr); sys.exit(rc)",
               "push", str(w.path("rel")), "--repo-id", "org/x"]
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        wall = time.monotonic() - start
    took = float(proc.stderr.strip().splitlines()[-1].split()[1])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "deadline of 3 s" in errors[0], proc.stderr[-2000:]
    # 3 s of deadline plus slack for a loaded machine (the trickle alone would hold it past the 60 s timeout)
    assert took < 3 + 5 and wall - took < 30, (took, wall)  # and the process ends with it (no join on exit)


def test_push_to_a_closed_port_is_one_line(world, capsys, online):
    w = world
    _demo_release(w.path("rel"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import debiased_nli.release.publish as publish
    with pytest.raises(Exception) as err:
        publish.push_release(w.path("rel"), "org/x", endpoint=f"http://127.0.0.1:{port}", token="hf_x")
    assert type(err.value).__name__ == "ConfigError" and "cannot reach the Hub" in str(err.value)
    _record("push to a closed port", f"error: {err.value}")


def test_push_deadline_stops_new_requests(world, monkeypatch, online):
    import debiased_nli.release.publish as publish
    from debiased_nli.utils.errors import ConfigError

    w = world
    _demo_release(w.path("rel"))
    monkeypatch.setenv("DEBIASED_NLI_HUB_DEADLINE", "0.001")
    with SilentServer() as hub:
        with pytest.raises(ConfigError, match="deadline"):
            publish.push_release(w.path("rel"), "org/x", endpoint=hub.url, token="hf_x")


def test_a_pipe_in_a_history_note_survives_the_push():
    from debiased_nli.release.publish import legacy_history, merge_history, with_history
    from debiased_nli.release.card import render_history_table

    # an old card whose table has an unescaped pipe in a note: the note is everything after the version
    old = "# x\n\n## Version history\n\n| version | notes |\n|---|---|\n| 1.0.0 | fixed a | b split |\n"
    assert legacy_history(old) == [{"version": "1.0.0", "notes": "fixed a | b split"}]
    merged = merge_history(legacy_history(old), [], "v1.1", "kept rows | dropped rows")
    table = render_history_table(merged)
    assert "| 1.0.0 | fixed a \\| b split |" in table and "| v1.1 | kept rows \\| dropped rows |" in table
    card = with_history(f"# x\n\n## Version history\n\n{render_history_table([])}\n", merged)
    assert legacy_history(card) == merged  # read back whole
    assert merge_history(merged, merged, None) == merged  # stable on re-merge


# ------------------------------------------------------------------------------------------ models

@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny BERT encoder without a head, and one with a LABEL_0..2 head (every weight saved)."""
    from test_training import make_tiny_bert

    texts = [" ".join(WORDS), "a man plays outside .", "nobody sleeps inside the park ."]
    root = tmp_path_factory.mktemp("models")
    return {"encoder": make_tiny_bert(root / "encoder", texts),
            "generic": make_tiny_bert(root / "generic", texts, head=True,
                                      id2label={0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"})}


def test_evaluate_refuses_a_head_that_was_never_trained(tiny_models, world, capsys):
    before = snapshot(world.root)
    rc = main(["evaluate", "--model", str(tiny_models["encoder"]), "--sets", "snli_test_hard", "--max-examples", "8",
               "--out", str(world.path("eval"))])
    line = _one_error_line(capsys.readouterr().err)
    _record("evaluate a model whose head was never trained", line)
    assert rc == 2 and "never trained" in line and "classifier.weight" in line
    assert snapshot(world.root) == before


def test_evaluate_warns_on_label_i_heads_and_takes_label_order(tiny_models, caplog):
    from debiased_nli.models.classifier import load_classifier

    with caplog.at_level("WARNING"):
        clf = load_classifier(str(tiny_models["generic"]), "cpu")
    assert clf.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    assert "LABEL_0, LABEL_1, LABEL_2" in caplog.text and "--label-order" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        clf = load_classifier(str(tiny_models["generic"]), "cpu", label_order=["contradiction", "entailment", "neutral"])
    assert clf.id2label == {0: "contradiction", 1: "entailment", 2: "neutral"} and "LABEL_0" not in caplog.text
    from debiased_nli.models.challenge import get_set
    from debiased_nli.evaluation.scores import set_predictions
    import numpy as np
    # output 0 now means contradiction: a row the model gives to output 0 is predicted contradiction
    pred, label_map = set_predictions(get_set("snli_test_hard"), np.array([[0.9, 0.05, 0.05]]), clf.id2label)
    assert label_map["model_output_to_task_label"][0] == "contradiction"
    from debiased_nli.utils.errors import ConfigError
    with pytest.raises(ConfigError, match="names 2 labels"):
        load_classifier(str(tiny_models["generic"]), "cpu", label_order=["a", "b"])


def test_train_refuses_to_resume_another_runs_checkpoint(tiny_models, world, capsys):
    w = world
    data = w.parquet("train.parquet", n=48)
    common = ["train", "snli", "--data-files", str(data), "--model", str(tiny_models["encoder"]), "--out",
              str(w.path("run")), "--batch-size", "16", "--epochs", "1", "--max-length", "32", "--cpu"]
    assert main(common) == 0
    assert list(w.path("run").glob("checkpoint-*")) and (w.path("run") / "debiased_nli_run.json").exists()
    capsys.readouterr()
    before = snapshot(w.root)
    assert main(common[:-1] + ["--lr", "3e-5", "--cpu"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    _record("train into a folder holding another run's checkpoint", line)
    assert "holds checkpoints of another run" in line and "learning_rate" in line
    assert snapshot(w.root) == before
    # a checkpoint this tool did not record is not resumed either
    (w.path("run") / "debiased_nli_run.json").unlink()
    assert main(common) == 2
    assert "did not record" in _one_error_line(capsys.readouterr().err)
    assert main(common + ["--no-resume"]) == 0  # starting over there is the user's explicit choice


def test_a_failed_generate_does_not_poison_its_folder(world):
    from debiased_nli.utils.errors import ConfigError
    from debiased_nli.data.tasks import get_task
    from debiased_nli.methods.generation.sample import CONFIG_FILE, SamplingOptions, generate_samples

    w = world
    broken = w.model_folder("broken", config='{"model_type": "gpt2"}')  # no weights, no tokenizer
    with pytest.raises(ConfigError, match="cannot load it"):
        generate_samples(str(broken), str(w.path("gen")), get_task("snli"), 4, cpu=True, progress=False)
    assert not w.path("gen").exists()  # the generator is loaded before anything is written
    # a config left by an older version's failed run (no shard beside it) does not block a new run
    w.write(f"gen/{CONFIG_FILE}", json.dumps({"generator": "old"}))
    other = w.model_folder("other", config='{"model_type": "gpt2"}')
    with pytest.raises(ConfigError, match="cannot load it"):
        generate_samples(str(other), str(w.path("gen")), get_task("snli"), 8, SamplingOptions(seed=3), cpu=True,
                         progress=False)
    assert json.loads((w.path("gen") / CONFIG_FILE).read_text()) == {"generator": "old"}  # untouched


# ------------------------------------------------------------------------------------------ audit, cache

def test_audit_replaces_its_folder_whole(world, capsys):
    w = world
    rows = _rows(120)
    rows["label"][3] = -1
    pq.write_table(pa.table(rows), w.path("train.parquet"))
    common = ["audit", "snli", "--data-files", str(w.path("train.parquet")), "--out", str(w.path("audit")),
              "--hypothesis-only", "none"]
    assert main(common + ["--on-invalid", "set_aside"]) == 0
    assert (w.path("audit") / "set_aside.parquet").exists()
    assert main(common) == 2  # the bad row is now an error: the earlier audit stays as it was
    capsys.readouterr()
    assert (w.path("audit") / "set_aside.parquet").exists()
    rows["label"][3] = 0
    pq.write_table(pa.table(rows), w.path("train.parquet"))
    assert main(common) == 0
    # the new audit has no set-aside rows, and no file of the earlier run is left beside it
    assert sorted(p.name for p in w.path("audit").iterdir()) == ["audit.json", "audit.md", "zstats.png"]
    assert json.loads((w.path("audit") / "audit.json").read_text())["n_rows"] == 120
    assert sorted(p.name for p in w.root.iterdir()) == ["audit", "home", "train.parquet"]


def test_cache_info_and_clear_touch_only_this_tools_files(tmp_path, monkeypatch, capsys):
    from debiased_nli.utils.cache import prune_cache, record_entry

    cache = tmp_path / "cache"
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(cache))
    (cache / "models" / "all-minilm-l6-v2").mkdir(parents=True)
    (cache / "models" / "all-minilm-l6-v2" / "model.safetensors").write_bytes(b"w" * 100)
    (cache / "embeddings" / "warmup-abc").mkdir(parents=True)
    (cache / "embeddings" / "warmup-abc" / "model.safetensors").write_bytes(b"x" * 300)
    record_entry(cache / "embeddings" / "warmup-abc")
    (cache / "embeddings" / "emb-1.npy").write_bytes(b"e" * 200)
    record_entry(cache / "embeddings" / "emb-1.npy")
    (cache / "notes.txt").write_text("mine")
    old = time.time() - 10 * 86400
    for i, name in enumerate(["features-a.arrow", "features-b.arrow", "hypo-only-a.npz"]):
        (cache / name).write_bytes(b"f" * 1000)
        record_entry(cache / name)
        os.utime(cache / name, (old + i, old + i))
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "features" in out and "2 entries" in out and "total" in out and "5 entries" in out
    assert main(["cache", "clear", "--older-than", "5"]) == 0  # the three old files only
    assert sorted(p.name for p in cache.iterdir()) == ["embeddings", "models", "notes.txt"]
    assert prune_cache(max_bytes=250) == (1, 300)  # the oldest own entry first, until under the cap
    assert main(["cache", "clear"]) == 0
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    assert left == ["embeddings", "models", "models/all-minilm-l6-v2", "models/all-minilm-l6-v2/model.safetensors",
                    "notes.txt"]


def test_cache_clear_and_prune_never_delete_a_users_files_named_like_entries(world, monkeypatch, capsys):
    """Only entries this tool recorded writing are counted and deleted; files that merely match the
    cache's names (the user's, or an older version's) are left alone and reported by `cache info`."""
    from debiased_nli.utils.cache import cache_entries, prune_cache

    w = world
    cache = w.path("cache")
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(cache))
    mine = {"cache-mine.arrow": b"a" * 500, "hypo-only-mine.npz": b"n" * 500, "features-mine.arrow": b"f" * 500,
            "embeddings/emb-mine.npy": b"e" * 500, "embeddings/warmup-mine/model.safetensors": b"w" * 500}
    old = time.time() - 30 * 86400
    for name, content in mine.items():
        w.write(f"cache/{name}", content)
        os.utime(cache / name, (old, old))
    os.utime(cache / "embeddings" / "warmup-mine", (old, old))
    data = w.parquet("train.parquet", n=90)
    for seed, out in enumerate(("a", "b")):  # this tool's entries: feature columns, hypothesis-only predictions
        assert main(["audit", "snli", "--data-files", str(data), "--out", str(w.path(out)), "--seed", str(seed)]) == 0
    ours = cache_entries(cache)
    assert ours and not {str(e["path"].relative_to(cache)) for e in ours} & set(mine)
    capsys.readouterr()
    assert main(["cache", "info"]) == 0
    info = capsys.readouterr().out
    assert "5 files" in info and "not recorded" in info, info
    assert prune_cache(max_bytes=0)[0] == len(ours)  # every recorded entry goes, no file of the user's
    for name, content in mine.items():
        assert (cache / name).read_bytes() == content, name
    assert main(["audit", "snli", "--data-files", str(data), "--out", str(w.path("c"))]) == 0
    assert cache_entries(cache)
    dead = 2**22 + 12345  # above pid_max: no such process
    w.write(f"cache/.hypo-only-x.npz.tmp-{dead}", b"half an entry of a killed run")
    w.write(f"cache/.hypo-only-y.npz.tmp-{os.getpid()}", b"being written")
    assert main(["cache", "clear"]) == 0
    assert cache_entries(cache) == []
    assert not (cache / f".hypo-only-x.npz.tmp-{dead}").exists()
    (cache / f".hypo-only-y.npz.tmp-{os.getpid()}").unlink()
    for name, content in mine.items():
        assert (cache / name).read_bytes() == content, name
    assert not [p for p in cache.rglob(".*")], "markers of removed entries are removed with them"


def _cache_files(cache: Path) -> dict[str, list[Path]]:
    return {kind: sorted(p for p in cache.glob(pattern) if p.is_file())
            for kind, pattern in (("npz", "hypo-only-*.npz"), ("arrow", "*.arrow"))}


def _replace_bytes(path: Path, data: bytes) -> None:
    """New content under the same name (a new file: a memory map of the old one, held by an earlier run
    in this process, stays valid)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _short_arrow(path: Path) -> bytes:
    """An Arrow stream file with half the rows of ``path``: well formed, but not the entry."""
    table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all()
    half = table.slice(0, table.num_rows // 2)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, half.schema) as writer:
        writer.write_table(half)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "short"])
def test_an_unreadable_cache_entry_is_a_miss_recomputed_with_a_warning(world, monkeypatch, capsys, caplog, damage):
    """A cache entry cut short (disk full, a copy interrupted), overwritten or emptied is read as a miss:
    recomputed, replaced, with a warning; never `unexpected BadZipFile`. Covers the hypothesis-only
    predictions (npz) of the audit and the build, and the feature columns (Arrow) of the audit."""
    w = world
    cache = w.path("cache")
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(cache))
    data = w.parquet("train.parquet", n=120)
    audit = ["audit", "snli", "--data-files", str(data), "--out"]
    build = ["build", str(SNLI), "--data-files", str(data), "--out"]  # not --quiet: it hides warnings
    assert main(audit + [str(w.path("a1"))]) == 0 and main(build + [str(w.path("r1"))]) == 0
    files = _cache_files(cache)
    assert len(files["npz"]) == 2 and files["arrow"], files
    for path in files["npz"] + files["arrow"]:
        if damage == "truncated":
            _replace_bytes(path, path.read_bytes()[: path.stat().st_size // 2])
        elif damage == "garbage":
            _replace_bytes(path, b"PK\x03\x04" + b"not a cache entry" * 10)
        elif damage == "empty":
            _replace_bytes(path, b"")
        elif path.suffix == ".arrow":
            _replace_bytes(path, _short_arrow(path))
    capsys.readouterr()
    with caplog.at_level("WARNING"):
        assert main(audit + [str(w.path("a2"))]) == 0, capsys.readouterr().err[-2000:]
        assert main(build + [str(w.path("r2"))]) == 0, capsys.readouterr().err[-2000:]
    warned = [r.getMessage() for r in caplog.records if "cache entry" in r.getMessage()]
    for path in files["arrow"] + (files["npz"] if damage != "short" else []):  # "short": the Arrow files only
        assert any(path.name in m and "recomput" in m for m in warned), (path.name, warned)
    a1, a2 = (json.loads((w.path(a) / "audit.json").read_text()) for a in ("a1", "a2"))
    assert a1 == a2
    for sub in ("data", "rejected"):
        for f in sorted((w.path("r1") / sub).rglob("*.parquet")):
            assert f.read_bytes() == (w.path("r2") / f.relative_to(w.path("r1"))).read_bytes(), f
    import numpy as np
    for path in _cache_files(cache)["npz"]:
        with np.load(path) as z:  # replaced by a whole entry
            assert z.files
    assert not [p for p in cache.iterdir() if ".tmp" in p.name]


def test_a_cache_write_that_fails_leaves_no_entry_behind(world, monkeypatch, caplog):
    """A full disk while a cache entry is written: no half-written entry stays (it would be read back by
    every later run); the build goes on without caching, and the next one computes the entry."""
    import numpy as np

    w = world
    cache = w.path("cache")
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(cache))
    data = w.parquet("train.parquet", n=120)
    real = np.savez

    def full_disk(file, *args, **kwds):
        import io
        buf = io.BytesIO()
        real(buf, *args, **kwds)
        if hasattr(file, "write"):
            file.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        else:
            Path(str(file) if str(file).endswith(".npz") else f"{file}.npz").write_bytes(buf.getvalue()[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    build = ["build", str(SNLI), "--data-files", str(data), "--out"]
    with caplog.at_level("WARNING"):
        assert main(build + [str(w.path("r1"))]) == 0
    assert any("could not write the cache entry" in r.getMessage() and "no space" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert not list(cache.glob("hypo-only-*")) and not [p for p in cache.iterdir() if ".tmp" in p.name]
    monkeypatch.setattr(np, "savez", real)
    assert main(build + [str(w.path("r2"))]) == 0
    assert len(list(cache.glob("hypo-only-*.npz"))) == 1
