"""The global logging options: --quiet / --log-level on every command silence our bars and the
libraries' (datasets, huggingface_hub, transformers); --help names only what this installation has."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from debiased_nli.cli import build_parser, log_level, quiet_libraries

ROOT = Path(__file__).resolve().parents[1]


def test_every_command_takes_the_logging_options_before_or_after_it():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, sub_parser in sub.choices.items():
        options = {s for a in sub_parser._actions for s in a.option_strings}
        assert {"--quiet", "-q", "--log-level", "-v"} <= options, name
    build = ["build", "demo", "--out", "x"]
    after = parser.parse_args(build + ["--quiet", "--log-level", "info"])
    before = parser.parse_args(["--quiet", "--log-level", "info"] + build)
    assert after.quiet and before.quiet and after.log_level == before.log_level == "info"
    plain = parser.parse_args(build)  # the sub-command's parser does not reset what was given before it
    assert plain.quiet is False and plain.log_level is None and plain.verbose is False
    assert log_level(parser.parse_args(["--quiet"] + build)) == logging.ERROR
    assert log_level(parser.parse_args(build + ["-v"])) == logging.INFO
    assert log_level(parser.parse_args(build + ["--quiet", "--log-level", "debug"])) == logging.DEBUG
    evaluate = parser.parse_args(["evaluate", "--list", "-q"])
    assert evaluate.quiet and log_level(evaluate) == logging.ERROR


def test_quiet_silences_every_bar_and_restores_them(capfd):
    import datasets
    from tqdm.auto import tqdm

    def work():
        datasets.Dataset.from_dict({"x": list(range(50))}).map(lambda r: {"y": r["x"]}, desc="a datasets bar")
        for _ in tqdm(range(3), desc="our bar", disable=False):  # as our stages pass it: explicitly enabled
            pass

    with quiet_libraries(logging.ERROR, progress=False):
        assert not datasets.is_progress_bar_enabled()
        assert logging.getLogger("datasets").level == logging.ERROR
        work()
    assert capfd.readouterr().err == ""
    assert datasets.is_progress_bar_enabled() and "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ
    work()
    err = capfd.readouterr().err
    assert "a datasets bar" in err and "our bar" in err


def test_quiet_build_from_the_console_prints_no_bar(tmp_path):
    env = dict(os.environ, DEBIASED_NLI_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, "-m", "debiased_nli.cli", "build", "demo", "--max-rows", "300", "--out",
                           str(tmp_path / "r"), "--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "%|" not in proc.stderr and "it/s" not in proc.stderr and "examples/s" not in proc.stderr
    assert "wrote" in proc.stderr  # the result is still reported


def test_help_names_only_the_methods_this_installation_has():
    from debiased_nli.release.recipe import known_steps

    text = build_parser().format_help()
    steps = {s for names in known_steps().values() for s in names}
    for method, step in (("PDD", "pdd"), ("IBADR", "ibadr"), ("AFLite", "aflite")):
        if step not in steps:
            assert method.lower() not in text.lower(), method
    for step in steps:
        assert step in text
    import importlib.metadata as md
    description = md.metadata("debiased-nli")["Summary"]
    for method in ("PDD", "IBADR", "AFLite"):  # the package description stays true as methods land
        assert method not in description


def _bad_jsonl(shared_data, path: Path, n: int = 400) -> Path:
    import json

    import pyarrow.parquet as pq

    rows = pq.read_table(shared_data / "snli/train_sample.parquet").slice(0, n).select(
        ["premise", "hypothesis", "label"]).to_pylist()
    rows[8]["hypothesis"] = ["a", "list"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_set_aside_rows_are_one_line_and_warnings_are_log_lines(shared_data, tmp_path):
    # 400 rows, one set aside; the 399 others are fewer than 20 batches of 1,000: z-filtering warns
    data = _bad_jsonl(shared_data, tmp_path / "bad.jsonl")
    env = dict(os.environ, DEBIASED_NLI_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "debiased_nli.cli", "build", "snli", "--data-files", f"train={data}"]
    proc = subprocess.run(cmd + ["--out", str(tmp_path / "r")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert "1 of 400 rows set aside (row 8: hypothesis is a list) -> rejected/set_aside_on_load.parquet" in lines
    assert (tmp_path / "r/rejected/set_aside_on_load.parquet").exists()
    warned = [l for l in lines if "batch_size 1000 shrunk" in l]
    assert len(warned) == 1 and warned[0].startswith("WARNING debiased_nli.release.recipe: z-filtering 'snli': batch_size")
    # not Python's default format: no file:line, no category, no source line under it
    assert "UserWarning" not in proc.stderr and "recipe.py:" not in proc.stderr and "compose(" not in proc.stderr
    quiet = subprocess.run(cmd + ["--out", str(tmp_path / "q"), "--quiet"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "shrunk" not in quiet.stderr  # --quiet: errors only in the log
    assert "1 of 400 rows set aside (row 8: hypothesis is a list)" in quiet.stderr  # a result, like `wrote`


def test_the_set_aside_line_counts_every_reason():
    import datasets

    from debiased_nli.data.loading import set_aside_summary

    rows = datasets.Dataset.from_dict({
        "file": ["a.jsonl", "a.jsonl", "b.jsonl"], "row": [3, 5, 0], "column": ["premise", "label", "hypothesis"],
        "value": ["{'x': 1}", "7", None], "reason": ["text is not a string", "label out of range", "empty or null text"]})
    assert set_aside_summary(rows, 1000) == (
        "3 of 1,000 rows set aside (row 3 of a.jsonl: premise is a mapping, and 2 more; 1 empty or null text, "
        "1 label out of range, 1 text is not a string) -> rejected/set_aside_on_load.parquet")
    assert set_aside_summary(rows.select([1]), 10).startswith("1 of 10 rows set aside (row 5: label '7': label out")
    assert set_aside_summary(None, 10) is None and set_aside_summary(rows.select([]), 10) is None
    # a reason about the whole row names no column (no "?: ..." in the line)
    dup = datasets.Dataset.from_dict({"file": ["t.parquet"], "row": [16411], "column": [None], "value": [None],
                                      "reason": ["duplicate of row 2704"]})
    assert set_aside_summary(dup, 20_000) == (
        "1 of 20,000 rows set aside (row 16411: duplicate of row 2704) -> rejected/set_aside_on_load.parquet")


def test_a_warning_in_a_command_goes_through_the_log(caplog):
    import warnings

    from debiased_nli.cli import warnings_as_log_lines

    before = warnings.showwarning
    with caplog.at_level(logging.WARNING), warnings_as_log_lines():
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("something to know", UserWarning)
            warnings.warn("going away", FutureWarning)
    assert warnings.showwarning is before
    got = [(r.name, r.getMessage()) for r in caplog.records]
    assert (__name__, "something to know") in got and (__name__, "FutureWarning: going away") in got


def test_a_quiet_command_run_from_python_leaves_the_librarys_warnings_on(caplog):
    """main() sets the library's log level for its own run only: after `evaluate --list --quiet` (an ERROR level),
    a warning of the library still reaches the log, as it did before the call (a notebook, a test in the same
    process). It used to stay at ERROR, which hid every later warning."""
    from debiased_nli.cli import main

    own = logging.getLogger("debiased_nli")
    before = own.level
    assert main(["evaluate", "--list", "--quiet"]) == 0
    assert own.level == before
    with caplog.at_level(logging.WARNING):
        logging.getLogger("debiased_nli.utils.cache").warning("cache entry x cannot be used; recomputing it")
    assert [r.getMessage() for r in caplog.records] == ["cache entry x cannot be used; recomputing it"]


def test_no_help_names_a_path_an_installed_wheel_lacks():
    """The help of every command (and sub-command) names no ``benchmarks/`` path: a wheel has none (issue 47)."""
    import argparse

    def helps(parser, name="debiased-nli"):
        yield name, parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    yield from helps(p, f"{name} {sub}")

    found = list(helps(build_parser()))
    assert len(found) > 20  # every command was rendered
    assert [name for name, text in found if "benchmarks/" in text] == []
    import re
    twice = [name for name, text in found if re.search(r"\(default[^)]*\)\s+\(default: ", text)]
    assert twice == []  # an option's default said once
