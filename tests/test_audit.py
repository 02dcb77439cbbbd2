import json

from debiased_nli.cli import main


def test_audit_of_the_real_snli_sample_ranks_known_artifacts(shared_data, tmp_path, capsys):
    out = tmp_path / "audit"
    code = main(["audit", "snli", "--data-files", str(shared_data / "snli/train_sample.parquet"), "--out", str(out)])
    assert code == 0
    report = json.loads((out / "audit.json").read_text())
    assert report["n_rows"] == 20_000
    assert report["labels"] == {"entailment": 6667, "neutral": 6562, "contradiction": 6771}
    assert 0.5 < report["hypothesis_only_accuracy"] < 0.75
    top = {label: [r["feature"] for r in report["features"] if r["label"] == label] for label in report["labels"]}
    assert all(len(v) == 20 for v in top.values())
    for label in report["labels"]:  # the hypothesis-only prediction heads every label
        assert top[label][0] == f"hypo-only-pred={label}"
    assert {"nobody@hypothesis", "sleeping@hypothesis"} <= set(top["contradiction"][:10])
    assert "outside@hypothesis" in top["entailment"][:10]
    for r in report["features"]:
        assert set(r) == {"feature", "label", "n", "p_hat", "z"}
    md = (out / "audit.md").read_text()
    assert "### contradiction" in md and "`nobody@hypothesis`" in md
    assert (out / "zstats.png").stat().st_size > 20_000


def test_audit_of_the_demo_finds_the_planted_artifacts(tmp_path):
    out = tmp_path / "demo"
    assert main(["audit", "demo", "--out", str(out), "--top-k", "10"]) == 0
    report = json.loads((out / "audit.json").read_text())
    top = {label: [r["feature"] for r in report["features"] if r["label"] == label] for label in report["labels"]}
    assert "nobody@hypothesis" in top["contradiction"]
    assert "outdoors@hypothesis" in top["entailment"]
    assert "competition@hypothesis" in top["neutral"]


def test_audit_bad_input_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"premise": "A.", "hypothesis": "B.", "label": 0}\n{"premise": "A.", "hypothesis": "B.", "label": -1}\n')
    assert main(["audit", "snli", "--data-files", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "row 1" in err and "'label'" in err and "-1" in err and "no gold label" in err
    assert main(["audit", "snlii", "--out", str(tmp_path / "o")]) == 2
    assert "Did you mean 'snli'" in capsys.readouterr().err


def test_the_picture_draws_each_distinct_point_once_with_the_opacity_of_its_copies():
    import numpy as np

    from debiased_nli.bias.audit import _stacked

    n = np.array([1, 1, 1, 5, 1, 5])
    counts = np.array([1, 1, 0, 1, 1, 1])  # p_hat = counts / n
    xs, ys, alpha = _stacked(n, counts, 0.25)
    got = {(int(x), float(y)): round(float(a), 6) for x, y, a in zip(xs, ys, alpha)}
    # three copies of (1, 1.0) drawn at alpha 0.25 leave (1 - 0.25)^3 of the background: one draw at 1 - 0.75^3
    assert got == {(1, 1.0): round(1 - 0.75 ** 3, 6), (1, 0.0): 0.25, (5, 0.2): round(1 - 0.75 ** 2, 6)}


def test_the_threshold_curves_are_drawn_over_sorted_n(tmp_path, monkeypatch):
    """The |z| = threshold curves p0 +- t sqrt(p0 (1 - p0) / n) are one smooth line each: drawn over a sorted grid
    of n (they were drawn over the scatter's unsorted x values and zig-zagged across the panel)."""
    import matplotlib
    matplotlib.use("Agg")
    import numpy as np
    from matplotlib.axes import Axes

    from debiased_nli.bias.audit import plot_zstats
    from debiased_nli.bias.zstats import compute_zstats
    from debiased_nli.bias.features import build_feature_matrix
    from debiased_nli.data.loading import load_task

    ds = load_task("demo", max_rows=600).dataset
    from debiased_nli.bias.task_features import add_features
    ds, _ = add_features(ds, "demo", hypothesis_only=None, progress=False)
    zs = compute_zstats(build_feature_matrix(ds), np.asarray(ds["label"]), ["entailment", "neutral", "contradiction"])
    lines = []
    real_plot = Axes.plot

    def spy(self, x, y, *args, **kw):
        lines.append((np.asarray(x), np.asarray(y)))
        return real_plot(self, x, y, *args, **kw)

    monkeypatch.setattr(Axes, "plot", spy)
    plot_zstats(zs, 3.0, tmp_path / "z.png")
    assert len(lines) == 6 and (tmp_path / "z.png").stat().st_size > 10_000
    for x, y in lines:
        assert (np.diff(x) > 0).all()  # sorted n
        assert len(x) == 200
