"""The docs stay true to the code: every ``debiased_nli.x.y`` they name resolves, the figures they show are
the benchmarks' current ones, and the README stays a front page (``mkdocs build --strict`` runs in CI)."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
DOTTED = re.compile(r"\bdebiased_nli(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _resolves(ref: str) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_path_a_page_names_exists(page):
    refs = sorted(set(DOTTED.findall(page.read_text())))
    assert [r for r in refs if not _resolves(r)] == []


def test_the_docs_figures_are_the_benchmarks_current_ones():
    for img in (ROOT / "docs" / "img").glob("*.png"):
        source = ROOT / "benchmarks" / "results" / img.name
        assert source.exists(), f"docs/img/{img.name} has no source in benchmarks/results/"
        assert img.read_bytes() == source.read_bytes(), (
            f"docs/img/{img.name} is stale: cp benchmarks/results/{img.name} docs/img/")


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to docs/"
    text = "\n".join(lines)
    for method in ("z-filtering", "AFLite", "PDD", "IBADR", "Seq-Z", "product of experts"):
        assert method.lower() in text.lower(), f"the README's method table lacks {method}"


def test_the_home_pages_demo_pictures_are_what_build_demo_makes_now(tmp_path):
    """docs/img/demo_zstats_*.png (from benchmarks/results/) are the images `debiased-nli build demo` writes with the
    current code (decoded and compared pixel by pixel, so a matplotlib patch release changing a PNG chunk does not
    matter; a change of the plot does)."""
    import os

    import numpy as np
    from matplotlib.image import imread

    from debiased_nli.release.recipe import build

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from debiased_nli.utils.resources import find_recipe
    build(find_recipe("demo"), tmp_path / "demo", progress=False)
    for name in ("original", "z_filtered"):
        made = imread(tmp_path / "demo" / "images" / f"zstats_{name}.png")
        committed = imread(ROOT / "benchmarks" / "results" / f"demo_zstats_{name}.png")
        assert made.shape == committed.shape, name
        assert np.abs(made - committed).mean() < 0.002, (
            f"benchmarks/results/demo_zstats_{name}.png is stale: debiased-nli build demo --out X, then copy "
            f"X/images/zstats_{name}.png to benchmarks/results/demo_zstats_{name}.png and docs/img/")
