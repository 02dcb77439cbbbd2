"""pyproject.toml's dependency floors are versions that have the APIs the code uses, and the installed
versions satisfy them (a floor lower than the code's needs installs a combination that fails at run time)."""
from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements() -> dict[str, Requirement]:
    project = _pyproject()["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in reqs}


def _floor(req: Requirement) -> Version:
    floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert floors, f"{req} has no floor"
    return max(floors)


# the versions that first provide what the code calls; checked by installing exactly these versions
# (transformers 5.2.0, datasets 4.2.0, accelerate 1.3.0, peft 0.18.0, huggingface_hub 1.8.0,
# evaluate 0.4.0) in a fresh venv and running the training, generator, release, publish and evaluation tests
NEEDED = {
    "transformers": "5.2.0",      # TrainingArguments(train_sampling_strategy=...), warmup_steps as a ratio
    "datasets": "4.2.0",          # datasets.List; numpy integer keys (4.0); an empty to_parquet (4.1 divides by 0)
    "pyarrow": "15.0.0",          # datasets 4.x's own floor
    "accelerate": "1.3.0",        # transformers 5.2's Trainer calls unwrap_model(keep_torch_compile=...), new in 1.3
    "huggingface-hub": "1.8.0",   # before 1.8, create_commit to a non-default endpoint cannot parse its commit URL
    "peft": "0.18.0",             # the first peft that supports transformers 5
}


@pytest.mark.parametrize("name,needed", sorted(NEEDED.items()))
def test_floors_are_at_least_what_the_code_needs(name, needed):
    req = _requirements()[name]
    assert _floor(req) >= Version(needed), f"pyproject allows {req}, but the code needs {name}>={needed}"


def test_installed_versions_satisfy_the_floors():
    missing, too_old = [], []
    for name, req in _requirements().items():
        if name in ("pytest", "gguf"):
            continue
        try:
            installed = Version(md.version(name))
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        if not req.specifier.contains(installed, prereleases=True):
            too_old.append(f"{name} {installed} (pyproject: {req})")
    assert not too_old, too_old
    assert not {"transformers", "datasets", "accelerate", "peft", "huggingface-hub"} & set(missing), missing


def test_the_apis_behind_the_floors_exist():
    import dataclasses

    import datasets
    from transformers import TrainingArguments

    fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    assert "train_sampling_strategy" in fields and "eval_strategy" in fields and "use_cpu" in fields
    assert hasattr(datasets, "List")
    from accelerate import Accelerator
    assert hasattr(Accelerator, "register_save_state_pre_hook") and hasattr(Accelerator, "accumulate")
