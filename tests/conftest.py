import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DEBIASED_NLI_SHARED", ROOT.parent / "shared"))
SHARED_DATA = SHARED / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.fail(f"the shared data folder {SHARED_DATA} is missing (set DEBIASED_NLI_SHARED)")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # feature/prediction caches of the tests go to a per-session temp dir, not ~/.cache
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
