"""benchmarks/bench_aflite.py's report: units timed in separate processes, compared with scikit-learn, and
said to have run one after the other or at the same time (what the md's speed-up means depends on it)."""
from __future__ import annotations

import json

import numpy as np

from benchmarks import bench_aflite


def test_overlapping_counts_units_running_at_one_moment():
    one_by_one = {"a": {"finished": "2026-11-26 09:00:10", "seconds": 10.0},
                  "b": {"finished": "2026-11-26 09:00:25", "seconds": 14.0}}
    assert bench_aflite.overlapping(one_by_one) == 1
    together = {"a": {"finished": "2026-11-26 09:00:10", "seconds": 10.0},
                "b": {"finished": "2026-11-26 09:00:12", "seconds": 11.0},
                "c": {"finished": "2026-11-26 09:00:11", "seconds": 9.0},
                "d": {"finished": "2026-11-26 09:01:00", "seconds": 5.0}}
    assert bench_aflite.overlapping(together) == 3


def test_a_small_round_reports_under_its_stem(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 8)).astype(np.float32)
    y = (X[:, 0] + 0.5 * rng.normal(size=600) > 0).astype(np.int64) + (X[:, 1] > 1).astype(np.int64)
    np.savez(tmp_path / "emb.npz", X=X, y=y)
    out = tmp_path / "out"
    bench_aflite.main(["--rows", "2000", "--train-size", "400", "--m", "4", "--per-unit", "2",
                       "--embeddings", str(tmp_path / "emb.npz"), "--work", str(tmp_path / "work"),
                       "--out", str(out), "--stem", "aflite_small"])
    assert not (out / "aflite_bench.md").exists()  # the CPU run's files are not overwritten
    res = json.loads((out / "aflite_small.json").read_text())
    s = res["summary"]
    assert s["ours"]["converged"] == 4 and s["sklearn"]["converged"] == 4
    assert abs(s["ours"]["heldout_accuracy"] - s["sklearn"]["heldout_accuracy"]) < 0.02
    assert res["command"].endswith(f"--embeddings {tmp_path / 'emb.npz'} --stem aflite_small")
    md = (out / "aflite_small.md").read_text()
    assert "ran back to back" in md  # main() runs its units one after the other
    assert "shared with other jobs" in md or " and one " in md
