"""The docs site in a real browser (issue 49): the site is built strictly (mkdocs, with the API reference from the
docstrings), then headless Chromium opens pages at a laptop's width, takes a screenshot, and measures the layout
after the theme's scripts ran: the page is no wider than the window, no element of the text scrolls sideways (a
table or a command block), and every picture loads.

Chromium is Debian's ``chromium`` package (.ci/run installs it, and sets DEBIASED_NLI_REQUIRE_BROWSER=1 there so
that its absence fails instead of skipping); mkdocs and mkdocstrings are the ``docs`` extra."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1280, 900
# the pages checked: the home page (its method table and picture), a method page (AFLite: its steps and commands),
# and the two pages of the Python API
PAGES = ("index.html", "methods/aflite/index.html", "python-api/index.html", "reference/index.html")

# every page in an iframe of the window's size, measured 500 ms after the load event (the theme wraps tables in a
# scrolling box from a script)
PROBE = """<!doctype html><html><body>
%(frames)s
<script>
window.addEventListener('load', function () { setTimeout(function () {
  var out = {};
  Array.prototype.slice.call(document.querySelectorAll('iframe')).forEach(function (frame) {
    var d = frame.contentDocument, root = d.documentElement, text = d.querySelector('.rst-content');
    var scrolls = Array.prototype.slice.call(d.querySelectorAll('.rst-content *'))
      .filter(function (e) { return e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1; })
      .map(function (e) { return e.tagName + ' ' + e.scrollWidth + '>' + e.clientWidth + ': ' +
                                 (e.textContent || '').trim().slice(0, 70); });
    var images = Array.prototype.slice.call(d.images).map(function (i) {
      return [i.getAttribute('src'), i.complete && i.naturalWidth > 0, i.getBoundingClientRect().right]; });
    out[frame.getAttribute('src')] = {scrollWidth: root.scrollWidth, clientWidth: root.clientWidth,
                                      textRight: text.getBoundingClientRect().right, scrolls: scrolls, images: images};
  });
  var pre = document.createElement('pre');
  pre.id = 'layout-report';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 500); });
</script></body></html>"""


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _require(what: str, available: bool) -> None:
    if not available:
        if os.environ.get("DEBIASED_NLI_REQUIRE_BROWSER"):
            pytest.fail(f"{what} is missing (DEBIASED_NLI_REQUIRE_BROWSER is set: CI installs it)")
        pytest.skip(f"{what} is not installed here (CI installs it)")


def _chromium_run(args: list[str], width: int = WIDTH) -> subprocess.CompletedProcess:
    return subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--allow-file-access-from-files", f"--window-size={width},{HEIGHT}",
                           "--virtual-time-budget=1500", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, dict]:
    """The site built strictly, and what the browser measured on each of PAGES."""
    import importlib.util

    _require("mkdocs with mkdocstrings (pip install -e '.[docs]')",
             all(importlib.util.find_spec(m) for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")))
    _require("chromium", _chromium() is not None)
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = out / "layout-probe.html"
    probe.write_text(PROBE % {"frames": "\n".join(f'<iframe src="{p}" width="{WIDTH}" height="{HEIGHT}"></iframe>'
                                                  for p in PAGES)})
    run = _chromium_run(["--dump-dom", probe.as_uri()], width=WIDTH + 40)
    found = re.search(r'<pre id="layout-report">([^<]*)</pre>', run.stdout)
    assert found, run.stderr[-2000:]
    return out, json.loads(found.group(1).replace("&gt;", ">").replace("&lt;", "<").replace("&amp;", "&"))


def test_a_screenshot_of_the_home_page(site, tmp_path):
    folder, _ = site
    shot = tmp_path / "home.png"
    _chromium_run([f"--screenshot={shot}", (folder / "index.html").as_uri()])
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000  # the page was drawn


@pytest.mark.parametrize("page", PAGES)
def test_the_page_fits_the_window_with_no_sideways_scrolling(site, page):
    got = site[1][page]
    assert got["scrollWidth"] <= got["clientWidth"], got
    assert got["scrolls"] == [], f"{page}: elements wider than the text at {WIDTH} px: {got['scrolls']}"
    for src, loaded, right in got["images"]:
        assert loaded and right <= got["textRight"] + 1, (page, src, loaded, right)


def test_the_home_page_shows_a_picture_and_its_table_has_every_command(site):
    folder, measured = site
    # what the library does (the demo's z-statistics before and after) and whether it helps (the intervals)
    assert [src for src, _, _ in measured["index.html"]["images"]] == [
        "img/demo_zstats_original.png", "img/demo_zstats_z_filtered.png", "img/efficacy_headline_intervals.png"]
    text = (folder / "index.html").read_text()
    for command in ("train-generator", "generate", "confidence-filter", "aflite", "pdd", "ibadr", "evaluate"):
        assert f"<code>{command}</code>" in text
