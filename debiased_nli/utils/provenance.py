"""What produced an output: library versions and the project's git revision, for manifests and reports."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

PACKAGES = ("debiased-nli", "numpy", "scipy", "pyarrow", "datasets", "huggingface_hub", "scikit-learn", "evaluate",
            "transformers", "accelerate", "peft", "torch")


def file_sha256(path: "str | os.PathLike") -> str:
    """The sha256 of a file's bytes (read in blocks of 1 MiB)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    """Python and the installed versions of the libraries a result depends on (read from package
    metadata, so nothing heavy is imported)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def git_hash() -> str | None:
    """The checkout's commit (``-dirty`` if tracked files changed), or None outside a git checkout."""
    if os.environ.get("DEBIASED_NLI_GIT_COMMIT"):  # a copy of a checkout without .git (a lent GPU machine)
        return os.environ["DEBIASED_NLI_GIT_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists():  # an installed wheel: site-packages is not the project's checkout
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def project_url() -> str | None:
    """The project's home page from the installed package's metadata (none is invented)."""
    import importlib.metadata as md

    try:
        meta = md.metadata("debiased-nli")
    except md.PackageNotFoundError:
        return None
    for entry in meta.get_all("Project-URL") or []:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("homepage", "home", "source", "repository"):
            return url.strip()
    return meta.get("Home-page") or None
