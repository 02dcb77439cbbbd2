"""The build's feature stage: chunks of text in, integer ids out; the hypothesis-only model fitted on
D0 alone (Wu et al. 2022, Table 11: "We train a hypothesis-only model on the original dataset")."""
import json
import os
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml

from debiased_nli.data.loading import labels_of, load_task, materialize
from debiased_nli.data.tasks import get_task
from debiased_nli.bias.features import build_feature_matrices
from debiased_nli.bias.task_features import FeatureWork, add_features, add_features_pair, featurize_build
from debiased_nli.bias.hypothesis_only import fit_tfidf, out_of_fold_transformer
from debiased_nli.bias.zfilter import ZFilterParams
from debiased_nli.release.recipe import build, load_recipe
from test_training import make_tiny_bert

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def d0_dg(shared_data):
    d0 = load_task("snli", data_files=str(shared_data / "snli/train_sample.parquet"), max_rows=2000).dataset
    dg = load_task("snli", data_files=str(shared_data / "snli/dev.parquet"), max_rows=1500).dataset
    return d0, dg


def _rows(fm):
    return [fm.row(i) for i in range(fm.n_rows)]


def test_chunked_features_are_the_in_memory_columns_row_for_row(d0_dg):
    d0, dg = d0_dg
    feats = featurize_build(d0, dg, get_task("snli"), work=FeatureWork(chunk_rows=600), progress=False)  # several chunks of each input
    d0_f, dg_f, hyp = add_features_pair(d0, dg, get_task("snli"), progress=False)
    fm0, fmg = build_feature_matrices([d0_f, dg_f])
    # the same features, in the same order inside each row, and ids in the strings' order
    assert _rows(feats.d0) == _rows(fm0) and _rows(feats.dg) == _rows(fmg)
    assert list(feats.d0.vocab) == sorted(feats.d0.vocab)
    np.testing.assert_array_equal(feats.hypothesis_only.predictions, hyp.predictions)
    # worker processes and another chunk size change nothing
    again = featurize_build(d0, dg, get_task("snli"), work=FeatureWork(chunk_rows=1000, num_proc=2), progress=False)
    for a, b in ((feats.d0, again.d0), (feats.dg, again.dg)):
        np.testing.assert_array_equal(a.indptr, b.indptr)
        np.testing.assert_array_equal(a.indices, b.indices)


def test_the_hypothesis_only_model_is_fitted_on_d0_alone(d0_dg):
    d0, dg = d0_dg
    alone = featurize_build(d0, None, get_task("snli"), seed=3, progress=False)
    with_new = featurize_build(d0, dg, get_task("snli"), seed=3, progress=False)
    fewer_new = featurize_build(d0, dg.select(range(500)), get_task("snli"), seed=3, progress=False)
    # D0's out-of-fold predictions do not depend on the new rows, and are those of add_features on D0
    np.testing.assert_array_equal(alone.hypothesis_only.predictions, with_new.hypothesis_only.predictions)
    _, hyp = add_features(d0, "snli", seed=3, progress=False)
    np.testing.assert_array_equal(alone.hypothesis_only.predictions, hyp.predictions)
    assert _rows(alone.d0) == _rows(with_new.d0)
    # the new rows are predicted by one model fitted on all of D0: a row's prediction is its own
    # (the hypothesis-only feature is the last of each row)
    full = fit_tfidf(build_feature_matrices([add_features(d0, "snli", hypothesis_only=None, progress=False)[0]])[0],
                     labels_of(d0), 3, seed=3)
    assert full.clf.classes_.tolist() == [0, 1, 2]
    pred = [r[-1] for r in _rows(with_new.dg)]
    assert all(p.startswith("hypo-only-pred=") for p in pred)
    assert pred[:500] == [r[-1] for r in _rows(fewer_new.dg)]
    assert with_new.new_rows_hypothesis_only["fitted_on"] == "D0"
    assert sum(with_new.new_rows_hypothesis_only["predicted"].values()) == len(dg)


def test_fits_started_on_d0s_own_vocabulary_are_the_fits_on_the_final_one(d0_dg):
    """The build starts the TF-IDF fits as soon as D0's chunks are in, on D0's own vocabulary, and runs
    them in processes while D_G is extracted: the same model as one fitted on the final vocabulary."""
    from debiased_nli.bias.features import ChunkedFeatures, feature_columns
    from debiased_nli.bias.hypothesis_only import out_of_fold_tfidf

    d0, dg = d0_dg
    d0_f = add_features(d0, "snli", hypothesis_only=None, progress=False)[0]
    dg_f = add_features(dg, "snli", hypothesis_only=None, progress=False)[0]
    fm0, fmg = build_feature_matrices([d0_f, dg_f])
    # local_matrix: D0's chunks over D0's own strings, row for row the final matrix's rows
    cols = feature_columns(d0_f)
    cf = ChunkedFeatures(cols)
    for ds in (d0_f, dg_f):
        for start in range(0, len(ds), 700):
            cf.add(ds.select_columns(cols).with_format("arrow")[start:start + 700])
    n0 = -(-len(d0_f) // 700)
    local = cf.local_matrix(range(n0))
    assert local.n_features < len(set(fm0.vocab) | set(fmg.vocab))   # D_G's strings are not in it
    assert list(local.vocab) == sorted(local.vocab)
    assert _rows(local) == _rows(fm0)
    # the build (fits in 2 processes, started before D_G's chunks) against fits on the final vocabulary
    ref, model = out_of_fold_tfidf(fm0, labels_of(d0), 3, seed=3, full_model=True, progress=False)
    built = featurize_build(d0, dg, get_task("snli"), seed=3, work=FeatureWork(chunk_rows=600, num_proc=2, n_jobs=2),
                            progress=False)
    assert "hypothesis-only model: start" in built.seconds
    np.testing.assert_array_equal(built.hypothesis_only.probabilities, ref.probabilities)
    pred_g = model.predict_proba(fmg).argmax(axis=1)
    assert [r[-1] for r in _rows(built.dg)] == [f"hypo-only-pred={['entailment', 'neutral', 'contradiction'][p]}"
                                                 for p in pred_g]
    # and the same as the sequential build
    again = featurize_build(d0, dg, get_task("snli"), seed=3, work=FeatureWork(chunk_rows=600), progress=False)
    assert _rows(again.dg) == _rows(built.dg)


def test_z_filtered_is_byte_identical_with_and_without_new_rows(tmp_path, shared_data):
    files = [f"train={shared_data}/snli/train_sample.parquet"]
    a = build(ROOT / "builders/snli.yaml", tmp_path / "a", data_files=files, max_rows=3000, progress=False)
    b = build(ROOT / "builders/snli.yaml", tmp_path / "b", data_files=files, max_rows=3000, progress=False,
              new_rows_files=[str(shared_data / "snli/dev.parquet")])
    assert set(b.configs) == {"z_filtered", "z_aug", "par_z", "seq_z"}
    for sub in ("data/z_filtered", "rejected/z_filtered"):
        fa = sorted((tmp_path / "a" / sub).glob("*.parquet"))
        fb = sorted((tmp_path / "b" / sub).glob("*.parquet"))
        assert [f.name for f in fa] == [f.name for f in fb] and fa
        for x, y in zip(fa, fb):
            assert x.read_bytes() == y.read_bytes(), x.name


def test_the_chunked_release_is_the_in_memory_release_file_for_file(tmp_path, shared_data):
    recipe = yaml.safe_load((ROOT / "builders/snli.yaml").read_text())
    kw = dict(data_files=[f"train={shared_data}/snli/train_sample.parquet"], max_rows=1500, progress=False,
              new_rows_files=[str(shared_data / "snli/dev.parquet")])
    build({**recipe, "features": {"chunk_rows": 400}}, tmp_path / "chunked", **kw)
    build({**recipe, "features": {"storage": "columns"}}, tmp_path / "columns", **kw)
    a, c = tmp_path / "chunked", tmp_path / "columns"
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.parts[len(a.parts)] in
                   ("data", "rejected", "images"))
    assert len(files) == 13  # 4 configs x (data, rejected) + 5 pictures
    assert files == sorted(p.relative_to(c) for p in c.rglob("*") if p.is_file() and p.parts[len(c.parts)] in
                           ("data", "rejected", "images"))
    for f in files:
        assert (a / f).read_bytes() == (c / f).read_bytes(), f
    # the card's z-statistics tables are the same numbers
    ma, mc = (json.loads((x / "manifest.json").read_text()) for x in (a, c))
    assert [s["counts"] for s in ma["stages"]] == [s["counts"] for s in mc["stages"]]


def test_the_generator_debias_step_learns_from_the_builds_z_d0(tmp_path, shared_data, monkeypatch):
    from debiased_nli.methods.generation import step as steps, train

    files = [f"train={shared_data}/snli/train_sample.parquet"]
    res = build(ROOT / "builders/snli.yaml", tmp_path / "rel", data_files=files, max_rows=2000, progress=False)
    z0 = datasets.load_dataset(str(tmp_path / "rel"), "z_filtered", split="train")
    seen = {}

    def fake_train(ds, task, model, out, training, **kw):  # the G* training set is what this test looks at
        seen["train"] = ds
        return {"rows": len(ds)}

    monkeypatch.setattr(train, "train_generator", fake_train)
    from debiased_nli.methods.generation import models
    monkeypatch.setattr(models, "write_generator_card", lambda *a, **k: None)  # the fake trains no adapter
    monkeypatch.setattr(steps, "generate_step", lambda ds, task, params, **kw: (ds.select(range(0)), None, {}))
    recipe = load_recipe(ROOT / "builders/snli.yaml")
    recipe["data"].update(data_files=files, max_rows=2000)
    from debiased_nli.release.recipe import step_params
    from debiased_nli.release.step_registry import get_step
    # the build's route: the generator step is handed the build's seed in its params, like every step with a seed
    params = step_params(get_step("source", "generator"), {"step": "generator", "generator": "G", "debias": {
        "out": str(tmp_path / "gstar")}, "generate": {"out": str(tmp_path / "s")}}, 42)
    assert params["seed"] == 42
    steps.generator_source(get_task("snli"), params, {"recipe": recipe})
    g = seen["train"]
    kept = g.filter(lambda r: r == 0, input_columns="in_rejected")
    assert res.configs["z_filtered"] == len(kept) < len(g) == 2000
    assert kept["hypothesis"] == z0["hypothesis"] and kept["label"] == z0["label"]


def test_transformer_hypothesis_only_is_out_of_fold_and_resumable(tmp_path, shared_data, monkeypatch):
    from debiased_nli.bias import hypothesis_only as H
    from debiased_nli.data.tasks import get_task

    d0 = load_task("snli", data_files=str(shared_data / "snli/train_sample.parquet"), max_rows=90).dataset
    model = make_tiny_bert(tmp_path / "tiny", list(d0["premise"]) + list(d0["hypothesis"]))
    params = {"model": str(model), "folds": 3, "epochs": 1, "max_length": 24, "batch_size": 16}
    task, labels = get_task("snli"), labels_of(d0)
    trained_on = []
    real = H._train_and_predict

    def spy(params, task, train_hyps, train_labels, predict_hyps, model_dir, seed, progress):
        trained_on.append((set(train_hyps), set(predict_hyps)))
        rows = H._hypothesis_only_rows(train_hyps, train_labels, task)
        assert set(rows["premise"]) == {""}  # the model sees the hypothesis alone
        return real(params, task, train_hyps, train_labels, predict_hyps, model_dir, seed, progress)

    monkeypatch.setattr(H, "_train_and_predict", spy)
    work = tmp_path / "work"
    assert out_of_fold_transformer(d0["hypothesis"], labels, task, params, work_dir=work, only_folds=[0],
                                   progress=False) == (None, None)
    assert (work / "fold-0.npz").exists() and not (work / "fold-0-model").exists()
    res, new = out_of_fold_transformer(d0["hypothesis"], labels, task, params, work_dir=work,
                                       new_hypotheses=["A man sleeps.", "Nobody is outside."], progress=False)
    assert len(trained_on) == 4  # fold 0 once (then read back), folds 1 and 2, the full-D0 model
    for train_h, held_h in trained_on[:3]:
        assert not (train_h & held_h)  # no row is predicted by a model that saw it
    assert trained_on[3][0] == set(d0["hypothesis"])
    assert res.probabilities.shape == (90, 3) and np.allclose(res.probabilities.sum(1), 1, atol=1e-5)
    assert res.method == "transformer-oof" and 0 <= res.accuracy <= 1 and new.shape == (2, 3)
    # a rerun reads every fold and the new rows' predictions back: nothing is trained
    monkeypatch.setattr(H, "_train_and_predict", lambda *a, **k: pytest.fail("retrained"))
    res2, new2 = out_of_fold_transformer(d0["hypothesis"], labels, task, params, work_dir=work,
                                         new_hypotheses=["A man sleeps.", "Nobody is outside."], progress=False)
    np.testing.assert_array_equal(res.probabilities, res2.probabilities)
    np.testing.assert_array_equal(new, new2)


def test_a_recipe_can_name_a_transformer_hypothesis_only_model(tmp_path, shared_data):
    d0 = load_task("snli", data_files=str(shared_data / "snli/train_sample.parquet"), max_rows=60).dataset
    model = make_tiny_bert(tmp_path / "tiny", list(d0["premise"]) + list(d0["hypothesis"]))
    recipe = {"task": "snli", "seed": 1, "z_filter": {"batch_size": 20},
              "features": {"hypothesis_only": {"model": str(model), "folds": 2, "epochs": 1, "max_length": 16}}}
    res = build(recipe, tmp_path / "rel", data_files=[f"train={shared_data}/snli/train_sample.parquet"],
                max_rows=60, progress=False)
    hyp = res.manifest["features"]["hypothesis_only"]
    assert hyp["method"] == "transformer-oof" and hyp["folds"] == 2 and hyp["model"] == str(model)
    with pytest.raises(Exception, match="unknown key"):
        build({**recipe, "features": {"hypothesis_only": {"model": str(model), "fold": 2}}}, tmp_path / "x",
              data_files=[f"train={shared_data}/snli/train_sample.parquet"], max_rows=60, progress=False)


def test_materialize_gathers_the_selected_rows(d0_dg):
    d0, _ = d0_dg
    rows = np.array([5, 3, 1999, 0, 3])
    sel = d0.select(rows)
    assert materialize(sel).to_dict() == sel.flatten_indices().to_dict()
    assert materialize(d0, rows[:2]).to_dict() == d0.select(rows[:2]).to_dict()
    assert materialize(sel)._indices is None and materialize(sel).features == d0.features


def test_the_walks_over_the_new_rows_give_the_same_configs_in_processes_or_one_after_another(d0_dg):
    from debiased_nli.bias.compose import compose

    d0, dg = d0_dg
    feats = featurize_build(d0, dg, get_task("snli"), progress=False)
    kw = dict(features=(feats.d0, feats.dg), params=ZFilterParams(batch_size=100), seed=4, progress=False)
    seconds = {}
    alone = compose(d0, dg, get_task("snli"), num_proc=1, **kw)
    together = compose(d0, dg, get_task("snli"), num_proc=3, seconds=seconds, **kw)  # three forked walks at once
    assert set(alone) == set(together) == {"z_filtered", "z_aug", "par_z_new", "seq_z"} == set(seconds)
    for name in alone:
        a, b = alone[name], together[name]
        for field in ("kept", "rejected", "rejected_by_ids", "rejected_by_indptr", "batch_of"):
            np.testing.assert_array_equal(getattr(a.outcome, field), getattr(b.outcome, field))
        assert a.outcome.counts is None and b.outcome.counts is None  # the build keeps no final counts
        assert a.params == b.params
        assert materialize(a.kept).data.table.equals(materialize(b.kept).data.table)
        assert materialize(a.rejected).data.table.equals(materialize(b.rejected).data.table)


_TEST_PROCESS = os.getpid()


def _dies_in_a_forked_process(name):
    from debiased_nli.bias.compose import _WALKS
    from debiased_nli.bias.zfilter import z_filter_matrix

    if os.getpid() != _TEST_PROCESS:
        os._exit(3)
    args, kwargs = _WALKS[name]  # the build's own process walks its input as usual
    return name, z_filter_matrix(*args, **kwargs, progress=False), 0.0


def test_a_walk_process_that_dies_stops_the_build_with_an_error(d0_dg, monkeypatch):
    from debiased_nli.bias import compose as release

    d0, dg = d0_dg
    feats = featurize_build(d0, dg, get_task("snli"), progress=False)
    monkeypatch.setattr(release, "_walk", _dies_in_a_forked_process)  # the forked processes inherit it
    with pytest.raises(RuntimeError, match="z-filtering process ended without its result"):
        release.compose(d0, dg, get_task("snli"), features=(feats.d0, feats.dg), params=ZFilterParams(batch_size=100),
                        progress=False, num_proc=2)
