"""The package's layout by stage (issue 33): every import, at module level or inside a function, goes from a
later stage to an earlier one or stays inside its own stage; no module imports itself back through others (no
cycle); no private name (``_x``) is imported from another package."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "debiased_nli"
# the stages in pipeline order: each may import only from itself and the ones before it
STAGES = ("utils", "data", "models", "bias", "methods", "release", "evaluation", "api", "pipeline", "cli")


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, str, int]]:
    """(importer, imported module, imported name or "", line) for every import of a debiased_nli module."""
    out = []
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(name, a.name, "", node.lineno) for a in node.names if a.name.startswith("debiased_nli")]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if not mod.startswith("debiased_nli"):
                    continue
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    out.append((name, sub, "", node.lineno) if sub in modules else (name, mod, a.name, node.lineno))
    return out


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_every_module_lives_in_a_stage():
    loose = sorted(m for m in _modules() if m != "debiased_nli" and _stage(m) is None and not m.startswith(
        "debiased_nli._"))
    assert loose == [], f"modules outside the stage packages {STAGES}: {loose}"


def test_no_import_from_a_later_stage():
    wrong = []
    for importer, mod, _, line in _imports(_modules()):
        a, b = _stage(importer), _stage(mod)
        if a and b and STAGES.index(b) > STAGES.index(a):
            wrong.append(f"{importer}:{line} imports {mod} ({b} comes after {a})")
    assert wrong == [], "\n".join(wrong)


def test_no_import_cycle():
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for importer, mod, _, _ in _imports(modules):
        if mod in modules and mod != importer:
            graph[importer].add(mod)
    # a package's __init__ importing its own submodules is how a package exposes them, not a cycle
    for m in modules:
        graph[m] = {d for d in graph[m] if not (modules[m].name == "__init__.py" and d.startswith(m + "."))}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"


def test_no_private_name_is_imported_from_another_package():
    wrong = []
    for importer, mod, name, line in _imports(_modules()):
        importer_pkg = importer.rsplit(".", 1)[0] if not (PACKAGE.parent / Path(*importer.split("."))).is_dir() \
            else importer
        target = mod if not name else mod
        target_pkg = target.rsplit(".", 1)[0] if not (PACKAGE.parent / Path(*target.split("."))).is_dir() else target
        private = (name or target.rsplit(".", 1)[-1]).startswith("_") and not (name or "").startswith("__")
        if private and target_pkg != importer_pkg and not target.rsplit(".", 1)[-1].startswith("__"):
            wrong.append(f"{importer}:{line} imports private {name or target} from {target_pkg}")
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_imports_on_its_own(stage):
    """Importing a stage package alone works (no hidden dependence on import order)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"import debiased_nli.{stage}"], capture_output=True, text=True,
                          cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr


def test_evaluation_is_a_stage_of_its_own_and_release_only_builds_diffs_and_publishes():
    """Scoring models, their statistics and the comparisons live in ``evaluation`` (after ``release``): no module
    of ``release`` or ``models`` scores classifiers on the challenge suite or compares trained rows."""
    modules = _modules()
    assert {"debiased_nli.evaluation.scores", "debiased_nli.evaluation.significance",
            "debiased_nli.evaluation.compare"} <= set(modules)
    wrong = [m for m in modules if _stage(m) in ("release", "models")
             and m.rsplit(".", 1)[-1] in ("compare", "evaluation", "significance", "scores")]
    assert wrong == []


# where a task's name becomes its TaskSpec (data.tasks.get_task): the edges, each with why; everything past an
# edge takes the TaskSpec it was handed
TASK_EDGES = {
    "debiased_nli.cli.commands._common": "the command line (task_from_args)",
    "debiased_nli.cli.commands.generate": "the command line",
    "debiased_nli.api.classifiers": "the public API (train)",
    "debiased_nli.api.releases": "the public API (audit)",
    "debiased_nli.release.recipe": "a recipe names its task",
    "debiased_nli.pipeline.run": "a recipe names its task (the pipeline of its generator step)",
    "debiased_nli.evaluation.compare.plan": "a comparison plan names its task",
    "debiased_nli.release.diff": "a release's manifest names its task",
    "debiased_nli.models.challenge": "a challenge set's spec names its task",
    "debiased_nli.models.card": "a training record names its task",
    "debiased_nli.data.loading": "the public API (load_task, new_rows)",
    "debiased_nli.bias.task_features": "the public API (add_features)",
    "debiased_nli.bias.zfilter": "the public API (z_filter)",
    "debiased_nli.bias.audit": "the public API (audit_dataset)",
    "debiased_nli.models.training": "the public API (train_classifier)",
}


def test_a_task_is_resolved_only_at_the_edges():
    """``get_task(`` is called where a name comes in (the command line, a recipe, a plan, a file that names its
    task, the public API) and nowhere past it: the steps, the methods' runs and the comparison's rows and units
    take the TaskSpec they are handed."""
    import re

    calls = {m for m, path in _modules().items() if m != "debiased_nli.data.tasks"
             and re.search(r"\bget_task\(", path.read_text())}
    assert sorted(calls - set(TASK_EDGES)) == [], "resolve the task at the edge and hand its TaskSpec on"
    assert sorted(set(TASK_EDGES) - calls) == [], "no longer an edge: remove it from TASK_EDGES"


MAX_FUNCTION_LINES = 80  # issue 47: the project's limits (a reviewer's "no function over 80 lines or 10 parameters")
MAX_PARAMETERS = 10


def test_no_function_is_over_80_lines_or_10_parameters():
    """Every function of the library fits on a screen and takes at most 10 parameters (``self``/``cls`` not
    counted; ``*args`` and ``**kwargs`` count one each): options that travel together are a config object."""
    over = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            n = len(params) + (a.vararg is not None) + (a.kwarg is not None)
            n -= bool(params) and params[0].arg in ("self", "cls")
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES or n > MAX_PARAMETERS:
                over.append(f"{name}.{node.name} (line {node.lineno}): {lines} lines, {n} parameters")
    assert over == []


def test_benchmarks_hold_measurements_only():
    """benchmarks/ is under 3,500 lines of code (issue 47): the pipelines are the library's; what stays are the
    measurement scripts someone reruns. The scripts committed beside results (a release's rebuild.sh) count too."""
    root = PACKAGE.parent / "benchmarks"
    files = [p for p in root.rglob("*") if p.suffix in (".py", ".sh") and p.is_file()]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert lines < 3500, f"benchmarks/ has {lines} lines of code"
