"""The "Adding a method" checklist of docs/development.md: the built-in methods have every file it names, and a
toy method added by it alone (in a copy of the package) builds the demo as a recipe step, writes its card
section and its dropped rows, and has a command whose options come from its declared parameters."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = ("aflite", "pdd", "ibadr")


def checklist() -> list[str]:
    """The files of the numbered checklist under "## Adding a method", in order."""
    text = (ROOT / "docs" / "development.md").read_text()
    section = text.split("\n## Adding a method\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, re.M)


def test_the_checklist_names_the_files_of_a_method():
    assert checklist() == [
        "debiased_nli/methods/<name>/__init__.py", "debiased_nli/methods/<name>/params.py",
        "debiased_nli/methods/<name>/step.py", "debiased_nli/release/step_registry.py",
        "debiased_nli/cli/commands/<name>.py", "pyproject.toml", "tests/test_<name>*.py", "docs/methods/<name>.md"]


@pytest.mark.parametrize("name", BUILT_IN)
def test_the_built_in_methods_have_every_file_of_the_checklist(name):
    from debiased_nli.release.step_registry import _STEPS

    for item in checklist():
        path = item.replace("<name>", name)
        if path == "debiased_nli/release/step_registry.py":  # the method's step is declared there, with its params
            steps = [s for s in _STEPS.values() if isinstance(s.function, str)
                     and s.function.startswith(f"debiased_nli.methods.{name}.step:")]
            assert steps and all(s.params == f"debiased_nli.methods.{name}.params:PARAMS" for s in steps), name
        elif path == "pyproject.toml":
            assert f'"debiased_nli.methods.{name}",' in (ROOT / path).read_text()
        elif "*" in path:
            assert list(ROOT.glob(path)), path
        else:
            assert (ROOT / path).is_file(), path
    assert f"methods/{name}.md" in (ROOT / "mkdocs.yml").read_text()


# the toy method, file by file as the checklist says (drop hypotheses of at most `max_words` words)
TOY = {
    "debiased_nli/methods/toy/__init__.py": '''
        """Toy: drop every row whose hypothesis has at most ``max_words`` words.

            for each row: drop it if len(hypothesis.split()) <= max_words
        """
        ''',
    "debiased_nli/methods/toy/params.py": '''
        from ...utils.params import Param, Params

        PARAMS = Params("Toy", [
            Param("max_words", "int", 3, "drop hypotheses of at most this many words", low=1,
                  paper=3, quote='section 1 ("three words or fewer")'),
            Param("seed", "seed", 0, "the build's seed"),
        ])
        ''',
    "debiased_nli/methods/toy/step.py": '''
        from ...data.tasks import TaskSpec
        from .params import PARAMS


        def toy_step(ds, task: TaskSpec, params, ctx=None):
            p = PARAMS.merge(params)
            words = [len(h.split()) for h in ds["hypothesis"]]
            short = [i for i, w in enumerate(words) if w <= p["max_words"]]
            dropped = ds.select(short).add_column("words", [words[i] for i in short])
            dropped = dropped.add_column("reason", ["toy: short hypothesis"] * len(short))
            kept = ds.select([i for i, w in enumerate(words) if w > p["max_words"]])
            return kept, dropped, {"dropped": len(short), "max_words": p["max_words"], "seed": p["seed"],
                                   "task": task.name}


        def render_toy_md(report):
            return f"# Toy\\n\\n{report['dropped']} rows dropped (max_words {report['max_words']}).\\n"
        ''',
    "debiased_nli/cli/commands/toy.py": '''
        import json

        from ...methods.toy.params import PARAMS
        from ._common import add_param_options, add_run_arguments, add_task_arguments, params_from_args, run_method


        def register(subparsers):
            p = subparsers.add_parser("toy", help="drop short hypotheses (the toy method)")
            add_task_arguments(p)
            p.add_argument("--out", required=True)
            add_param_options(p, PARAMS)
            add_run_arguments(p, seed=False)
            p.set_defaults(func=run)


        def run(args):
            from pathlib import Path

            from ...methods.toy.step import toy_step

            def write(result, loaded, manifest):
                kept, dropped, report = result
                Path(args.out).mkdir(parents=True, exist_ok=True)
                kept.to_parquet(str(Path(args.out) / "kept.parquet"))
                print(json.dumps(report))
                return 0

            return run_method(args, lambda ds, task: toy_step(ds, task, params_from_args(args, PARAMS)), write)
        ''',
}
STEP = ('    Step("toy", "filter", f"{_METHODS}.toy.step:toy_step", card_section=f"{_METHODS}.toy.step:render_toy_md",\n'
        '         rejects=Rejects(extra=("words",)), params=f"{_METHODS}.toy.params:PARAMS"),\n')


def test_a_toy_method_added_by_the_checklist_builds_and_has_its_command(tmp_path):
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "debiased_nli", copy / "debiased_nli", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("builders", "evaluation", "model_cards"):  # found beside the package, as in a checkout
        (copy / folder).symlink_to(ROOT / folder)
    for rel, text in TOY.items():  # items 1, 2, 3 and 5
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_text(textwrap.dedent(text).lstrip())
    registry = copy / "debiased_nli" / "release" / "step_registry.py"  # item 4: one Step among the built-in ones
    text = registry.read_text()
    assert text.count("):\n    declare(_step)") == 1
    registry.write_text(text.replace("):\n    declare(_step)", STEP + "):\n    declare(_step)"))
    env = {**os.environ, "PYTHONPATH": str(copy), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def python(code: str) -> str:
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    out = python(textwrap.dedent(f"""
        import json, debiased_nli
        from debiased_nli.release.recipe import build
        assert debiased_nli.__file__.startswith({str(copy)!r})
        res = build({{"task": "demo", "seed": 7, "configs": ["toy"], "filters": [{{"step": "toy", "max_words": 4}}]}},
                    {str(tmp_path / "release")!r}, progress=False)
        print(json.dumps({{"configs": res.configs, "report": res.reports["toy: toy"]}}))
    """))
    built = json.loads(out.strip().splitlines()[-1])
    assert built["configs"]["toy"] > 0
    assert built["report"]["max_words"] == 4 and built["report"]["seed"] == 7  # the build's seed, by its route
    assert "# Toy" in (tmp_path / "release" / "README.md").read_text()
    assert list((tmp_path / "release" / "rejected" / "toy").glob("train-*.parquet"))
    with pytest.raises(AssertionError, match=r"unknown Toy parameter\(s\) \['max_word'\].*Did you mean 'max_words'"):
        python("from debiased_nli.release.recipe import load_recipe\n"
               "load_recipe({'task': 'demo', 'filters': [{'step': 'toy', 'max_word': 4}]})")
    helped = python("from debiased_nli.cli import main\nimport sys\nsys.argv = ['debiased-nli', 'toy', '--help']\n"
                    "main(['toy', '--help'])")
    assert "--max-words" in helped and 'paper section 1 ("three words or fewer")' in " ".join(helped.split())
    ran = python(f"from debiased_nli.cli import main\nraise SystemExit(main(['toy', 'demo', '--max-rows', '200', "
                 f"'--out', {str(tmp_path / 'toy_out')!r}, '--max-words', '5']))")
    assert json.loads(ran.strip().splitlines()[-1])["max_words"] == 5
    assert (tmp_path / "toy_out" / "kept.parquet").is_file()
