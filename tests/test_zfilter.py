"""z-filtering as Algorithm 1 of Wu et al. (2022), on the real SNLI sample."""
import numpy as np
import pytest

from debiased_nli.data.loading import load_task
from debiased_nli.data.tasks import get_task
from debiased_nli.utils.errors import ConfigError, EmptyResultError
from debiased_nli.bias.features import build_feature_matrices, build_feature_matrix
from debiased_nli.bias.task_features import add_features
from debiased_nli.bias.zfilter import ZFilterParams, reference_z_filter, z_filter, z_filter_matrix
from debiased_nli.bias.zstats import compute_zstats, z_from_counts

LABELS = ["entailment", "neutral", "contradiction"]


@pytest.fixture(scope="module")
def snli(shared_data):
    ds = load_task("snli", data_files=str(shared_data / "snli/train_sample.parquet")).dataset
    out, _ = add_features(ds, "snli", progress=False)
    return out


@pytest.mark.parametrize("n,batch,k", [(400, 1, 20), (400, 1, 3), (2000, 37, 20), (2000, 250, 5)])
def test_agrees_row_for_row_with_a_plain_reference(snli, n, batch, k):
    sub = snli.select(range(n))
    fm = build_feature_matrix(sub)
    labels = np.asarray(sub["label"])
    out = z_filter_matrix(fm, labels, 3, top_k=k, batch_size=batch, seed=None, progress=False, cache=16)
    kept, rejected = reference_z_filter([(fm.row(i), int(labels[i])) for i in range(n)], 3, k, batch)
    assert out.kept.tolist() == kept
    assert out.rejected.tolist() == rejected


def test_conditional_agrees_with_the_reference(snli):
    seed_ds, new = snli.select(range(1000)), snli.select(range(1000, 1600))
    fm, sfm = build_feature_matrices([new, seed_ds])
    labels, slabels = np.asarray(new["label"]), np.asarray(seed_ds["label"])
    out = z_filter_matrix(fm, labels, 3, top_k=20, batch_size=50, seed=None, seed_fm=sfm, seed_labels=slabels,
                          progress=False)
    kept, _ = reference_z_filter([(fm.row(i), int(labels[i])) for i in range(len(labels))], 3, 20, 50,
                                 seed_rows=[(sfm.row(i), int(slabels[i])) for i in range(len(slabels))])
    assert out.kept.tolist() == kept


def _biased_sets(counts, k):
    n, p_hat, z = z_from_counts(counts, np.full(3, 1 / 3))
    out = []
    for l in range(3):
        zz = np.where((n > 0) & (z[:, l] > 0), z[:, l], -np.inf)
        order = np.lexsort((np.arange(len(zz)), -zz))[:k]
        out.append(set(order[np.isfinite(zz[order])].tolist()))
    return out


def test_no_kept_row_carries_a_feature_biased_for_its_label_when_its_batch_was_filtered(snli):
    res = z_filter(snli, "snli", top_k=20, batch_size=1000, seed=3, progress=False)
    o = res.outcome
    fm = build_feature_matrix(snli)
    labels = np.asarray(snli["label"])
    counts = np.zeros((fm.n_features, 3), np.int64)
    kept_by_batch = {}
    for i in o.kept:
        kept_by_batch.setdefault(int(o.batch_of[i]), []).append(int(i))
    checked = 0
    for b in range(o.n_batches):
        biased = _biased_sets(counts, 20)
        for i in kept_by_batch.get(b, []):
            feats = set(fm.indices[fm.indptr[i]:fm.indptr[i + 1]].tolist())
            assert not feats & biased[labels[i]], f"row {i} kept in batch {b} carries a biased feature"
            checked += 1
        for i in kept_by_batch.get(b, []):
            np.add.at(counts, (fm.indices[fm.indptr[i]:fm.indptr[i + 1]], labels[i]), 1)
    assert checked == len(o.kept) > 5000
    # every rejected row names the biased features that rejected it, and they are its own features
    for row in res.rejected.select(range(200)):
        feats = {f for c in snli.column_names if c.startswith("feat_") for f in row[c]}
        assert row["rejected_by"] and set(row["rejected_by"]) <= feats


def test_the_largest_z_left_is_far_below_the_original(snli):
    res = z_filter(snli, "snli", progress=False)
    fm_all, fm_kept = build_feature_matrices([snli, res.kept])
    before = compute_zstats(fm_all, np.asarray(snli["label"]), LABELS).max_abs_z(exclude=("<null>",))
    after = compute_zstats(fm_kept, np.asarray(res.kept["label"]), LABELS).max_abs_z(exclude=("<null>",))
    assert before > 40 and after < before / 4
    assert res.counts["kept"] + res.counts["rejected"] == len(snli)
    assert len(set(res.kept["uid"]) | set(res.rejected["uid"])) == len(snli)  # nothing lost


def test_seq_z_never_keeps_a_new_row_with_a_biased_feature_of_z_d0(snli):
    d0, dg = snli.select(range(8000)), snli.select(range(8000, 12000))
    z0 = z_filter(d0, "snli", progress=False)
    # one batch: every new row is judged against Z(D0)'s biased features exactly
    seq = z_filter(dg, "snli", seed_dataset=z0.kept, batch_size=len(dg), progress=False)
    fm_new, fm_z0 = build_feature_matrices([dg, z0.kept])
    counts = np.zeros((fm_z0.n_features, 3), np.int64)
    np.add.at(counts, (fm_z0.indices, np.repeat(np.asarray(z0.kept["label"]), np.diff(fm_z0.indptr))), 1)
    biased = _biased_sets(counts, 20)
    labels = np.asarray(dg["label"])
    for i in seq.outcome.kept:
        assert not set(fm_new.indices[fm_new.indptr[i]:fm_new.indptr[i + 1]].tolist()) & biased[labels[i]]
    assert 0 < len(seq.outcome.kept) < len(dg)
    assert len(seq.kept) == len(z0.kept) + len(seq.outcome.kept)  # the seed rows come first
    assert seq.kept["uid"][: len(z0.kept)] == z0.kept["uid"]


def test_same_seed_same_result_other_seed_other_walk(snli):
    sub = snli.select(range(3000))
    a = z_filter(sub, "snli", seed=5, progress=False).outcome
    b = z_filter(sub, "snli", seed=5, progress=False).outcome
    c = z_filter(sub, "snli", seed=6, progress=False).outcome
    assert a.kept.tolist() == b.kept.tolist() and a.kept.tolist() != c.kept.tolist()


def test_empty_result_and_seed_set_of_another_task(snli, shared_data):
    tiny = snli.select(range(3))
    with pytest.raises(EmptyResultError, match="rejected every one"):
        # a seed set in which all three rows' features are biased leaves nothing
        z_filter(tiny, "snli", seed_dataset=snli.select(range(3)), top_k=100_000, batch_size=10, progress=False)
    qqp = load_task("qqp", data_files=str(shared_data / "qqp/bimpm_dev.parquet"), max_rows=50).dataset
    qqp, _ = add_features(qqp, "qqp", hypothesis_only=None)
    with pytest.raises(ConfigError, match="same task"):
        z_filter(snli.select(range(50)), "snli", seed_dataset=qqp, progress=False)


def test_an_input_of_one_batch_is_walked_in_smaller_batches_not_kept_whole(snli):
    # Algorithm 1 checks the first batch against an empty Z: with n <= b every row would be kept
    sub = snli.select(range(1000))
    unshrunk = z_filter(sub, "snli", batch_size=1000, min_batches=0, progress=False)
    assert unshrunk.counts["kept"] == 1000  # the problem: nothing filtered
    with pytest.warns(UserWarning, match=r"batch_size 1000 shrunk to 50 = ceil\(1000 rows / 20\)"):
        res = z_filter(sub, "snli", batch_size=1000, progress=False)
    assert res.params["batch_size"] == 1000 and res.params["batch_size_used"] == 50
    assert res.counts["batch_size_used"] == 50 and "first batch" in res.counts["batch_size_note"]
    assert res.outcome.n_batches == 20 and 0 < res.counts["kept"] < 1000
    # a large enough input keeps the requested batch size; so does a conditional walk (seed set non-empty)
    big = z_filter(snli.select(range(4000)), "snli", batch_size=200, progress=False)
    assert big.params["batch_size_used"] == 200 and "batch_size_note" not in big.counts
    cond = z_filter(sub, "snli", seed_dataset=snli.select(range(1000, 3000)), batch_size=1000, progress=False)
    assert cond.params["batch_size_used"] == 1000 and cond.outcome.n_batches == 1


def test_a_tiny_build_filters_and_says_so_in_the_manifest(tmp_path, shared_data, caplog):
    import logging
    from pathlib import Path

    from debiased_nli.cli import main

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "x"
    # the command shows its warnings as log lines (cli.warnings_as_log_lines), so the warning is read from the log
    with caplog.at_level(logging.WARNING):
        rc = main(["build", str(root / "builders/snli.yaml"), "--data-files",
                   f"train={shared_data / 'snli/train_sample.parquet'}", "--max-rows", "1000", "--out", str(out)])
    assert rc == 0
    assert any(r.levelno == logging.WARNING and "shrunk to 50" in r.getMessage() for r in caplog.records)
    import json
    manifest = json.loads((out / "manifest.json").read_text())
    stage = next(s for s in manifest["stages"] if s["stage"].startswith("z_filtered"))
    assert stage["counts"]["input"] == 1000 and stage["counts"]["kept"] < 1000
    assert stage["counts"]["batch_size_used"] == 50 and "shrunk" in stage["counts"]["batch_size_note"]


def test_compose_and_z_filter_resolve_the_small_input_rule_alike(snli):
    """One place resolves it (zfilter.walk_batch_size, issue 33): the same batch, note and warning (pointing at
    the caller) from z_filter and from compose's walks; a conditional walk keeps the batch size."""
    import warnings

    from debiased_nli.bias.compose import compose

    d0, dg = snli.select(range(600)), snli.select(range(600, 900))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alone = z_filter(d0, "snli", batch_size=1000, progress=False)
        new_alone = z_filter(dg, "snli", batch_size=1000, progress=False)
        composed = compose(d0, dg, get_task("snli"), params=ZFilterParams(batch_size=1000), progress=False)
    assert alone.params["batch_size_used"] == composed["z_filtered"].params["batch_size_used"] == 30
    assert alone.params["batch_size_note"] == composed["z_filtered"].params["batch_size_note"]
    assert new_alone.params["batch_size_note"] == composed["par_z_new"].params["batch_size_note"]
    for name in ("z_aug", "seq_z"):  # seeded with D0 / Z(D0): conditional
        assert composed[name].params["batch_size_used"] == 1000 and "batch_size_note" not in composed[name].params
    shrunk = [w for w in caught if "shrunk" in str(w.message)]
    assert len(shrunk) == 4 and {w.filename for w in shrunk} == {__file__}
    assert [str(w.message) for w in shrunk] == [f"z-filtering 'snli': {n}" for n in (
        alone.params["batch_size_note"], new_alone.params["batch_size_note"],
        composed["z_filtered"].params["batch_size_note"], composed["par_z_new"].params["batch_size_note"])]
