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
