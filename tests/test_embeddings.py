"""Pair embeddings Φ(x) for AFLite: the first token (or the masked mean) of the last layer, cached by
the rows' content; the warm-up protocol of Le Bras et al. (2020)."""
from pathlib import Path

import numpy as np
import pytest
import torch

from debiased_nli.data.tasks import get_task
from debiased_nli.methods import embeddings as E
from debiased_nli.methods.aflite.params import PARAMS
from debiased_nli.methods.aflite.step import aflite_step
from debiased_nli.data.loading import new_rows
from debiased_nli.utils.errors import ConfigError, InvalidInputError

GPT2_TOKENIZER = Path.home() / ".cache" / "debiased-nli" / "models" / "gpt2-tokenizer"
NAMES = ["entailment", "neutral", "contradiction"]


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory) -> str:
    """A 2-layer BERT with random weights and the real GPT-2 tokenizer, saved as a model folder."""
    from transformers import AutoTokenizer, BertConfig, BertModel
    folder = tmp_path_factory.mktemp("tiny-encoder")
    tok = AutoTokenizer.from_pretrained(str(GPT2_TOKENIZER))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=160)
    BertModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _rows(n=12, seed=0):
    rng = np.random.default_rng(seed)
    words = "a man woman dog plays runs sleeps outside inside the park street ball".split()
    prem = [" ".join(rng.choice(words, size=rng.integers(3, 12))) for _ in range(n)]
    hyp = [" ".join(rng.choice(words, size=rng.integers(2, 6))) for _ in range(n)]
    return new_rows("snli", prem, hyp, [NAMES[i % 3] for i in range(n)], origin="generated", method="test")


def _last_layer(model_dir, premise, hypothesis):
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(**tok(premise, hypothesis, return_tensors="pt")).last_hidden_state[0].numpy()


def test_embedding_is_the_first_token_of_the_last_layer_of_the_pair(tiny_encoder, tmp_path):
    ds = _rows()
    emb = E.compute_embeddings(ds, tiny_encoder, batch_size=4, cache_dir=tmp_path, progress=False)
    assert emb.shape == (len(ds), 32) and emb.dtype == np.float32
    np.testing.assert_allclose(emb[3], _last_layer(tiny_encoder, ds[3]["premise"], ds[3]["hypothesis"])[0], atol=1e-5)


def test_mean_pooling_is_the_masked_mean_of_the_last_layer(tiny_encoder, tmp_path):
    ds = _rows()
    emb = E.compute_embeddings(ds, tiny_encoder, batch_size=4, pooling="mean", cache_dir=tmp_path, progress=False)
    np.testing.assert_allclose(emb[3], _last_layer(tiny_encoder, ds[3]["premise"], ds[3]["hypothesis"]).mean(0),
                               atol=1e-5)


def test_padding_does_not_change_an_embedding(tiny_encoder, tmp_path):
    ds = _rows()
    for pooling in ("cls", "mean"):
        one = E.compute_embeddings(ds, tiny_encoder, batch_size=1, pooling=pooling, cache_dir=tmp_path / "a",
                                   progress=False)
        many = E.compute_embeddings(ds, tiny_encoder, batch_size=5, pooling=pooling, cache_dir=tmp_path / "b",
                                    progress=False)
        np.testing.assert_allclose(one, many, atol=1e-5)


def test_second_run_reads_the_cache(tiny_encoder, tmp_path, monkeypatch):
    ds = _rows()
    first = E.compute_embeddings(ds, tiny_encoder, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.glob("emb-*.npy"))) == 1

    def no_model(*a, **k):
        raise AssertionError("the encoder was loaded although the embeddings are cached")

    monkeypatch.setattr(E, "_load_encoder", no_model)
    again = E.compute_embeddings(ds, tiny_encoder, cache_dir=tmp_path, progress=False)
    np.testing.assert_array_equal(first, again)
    # the same rows with other columns beside them (e.g. a build's feature columns) are the same rows
    extra = ds.add_column("feat_x", [["a"]] * len(ds))
    np.testing.assert_array_equal(first, E.compute_embeddings(extra, tiny_encoder, cache_dir=tmp_path, progress=False))
    # other rows or other parameters are not served from the cache
    with pytest.raises(AssertionError, match="encoder was loaded"):
        E.compute_embeddings(ds.select(range(5)), tiny_encoder, cache_dir=tmp_path, progress=False)
    with pytest.raises(AssertionError, match="encoder was loaded"):
        E.compute_embeddings(ds, tiny_encoder, pooling="mean", cache_dir=tmp_path, progress=False)


def test_bad_inputs_are_named(tiny_encoder, tmp_path):
    ds = _rows().remove_columns("hypothesis")
    with pytest.raises(InvalidInputError, match="column 'hypothesis'"):
        E.compute_embeddings(ds, tiny_encoder, cache_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="pooling"):
        E.compute_embeddings(_rows(), tiny_encoder, pooling="max", cache_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="cannot load encoder"):
        E.compute_embeddings(_rows(), str(tmp_path / "no-such-model"), cache_dir=tmp_path, progress=False)


def test_warm_up_slice_is_seeded_and_sized():
    a = E.warm_up_indices(1000, 0.1, seed=3)
    assert len(a) == 100 and len(set(a)) == 100
    np.testing.assert_array_equal(a, E.warm_up_indices(1000, 0.1, seed=3))
    assert not np.array_equal(a, E.warm_up_indices(1000, 0.1, seed=4))
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        E.warm_up_indices(1000, 1.0)


WARM = {"warmup_epochs": 1.0, "warmup_batch_size": 8, "warmup_lr": 1e-3, "m": 8, "k": 5, "progress": False}


def test_warm_up_rows_are_removed_with_their_reason_and_never_kept(tiny_encoder, tmp_path, monkeypatch):
    """The paper's protocol: the warm-up model is trained on a share of the rows, which are then not
    reused: they leave the data with reason "warm-up" and are counted in the report."""
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(tmp_path))
    ds = _rows(n=60, seed=1)
    kept, removed, report = aflite_step(ds, get_task("snli"), {"encoder": tiny_encoder, "warmup_share": 0.2, **WARM})
    warm = removed.filter(lambda r: r["reason"] == "warm-up")
    assert len(warm) == 12 == report["removed_by_reason"]["warm-up"] == report["warm_up"]["rows"]
    np.testing.assert_array_equal(sorted(warm["uid"]), sorted(ds.select(E.warm_up_indices(60, 0.2, 0))["uid"]))
    assert set(warm["uid"]).isdisjoint(kept["uid"])
    assert all(r == -1 for r in warm["aflite_round"])
    assert set(removed["reason"]) == {"warm-up", "aflite"}
    assert sorted(list(kept["uid"]) + list(removed["uid"])) == sorted(ds["uid"])
    assert report["n_kept"] + report["n_removed"] == 60
    assert Path(report["warm_up"]["model_dir"]).joinpath("config.json").exists()
    # the rounds see only the rows left after the warm-up
    assert report["history"][0]["size_before"] == 48
    audit = report["audit"]
    assert audit["before"]["n_rows"] == 60
    assert audit["after"]["n_rows"] == audit["random_same_size"]["n_rows"] == len(kept)


def test_train_size_is_the_warm_up_size_and_the_target_a_third_of_the_input(tiny_encoder, tmp_path, monkeypatch):
    """t = the warm-up size ("this fraction corresponds to the training size for AFLite") and
    n = |D|/3 of the whole input (SNLI: 182k of 550k); m, k and tau are reported as the project's."""
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(tmp_path))
    ds = _rows(n=90, seed=2)
    kept, removed, report = aflite_step(ds, get_task("snli"), {"encoder": tiny_encoder, "warmup_share": 0.1, "audit": False,
                                                     **WARM})
    assert report["warm_up"]["rows"] == 9
    assert report["params"]["train_size"] == 9
    assert report["params"]["target_n"] == 30
    assert len(kept) >= 30
    proto = report["protocol"]
    assert proto["train_size"]["value"] == 9 and proto["train_size"]["source"].startswith("paper")
    assert proto["target_n"]["source"].startswith("paper")
    for key in ("tau",):
        assert proto[key]["source"].startswith("project's choice")
    for key in ("m", "k", "warmup_lr"):  # set for this run
        assert proto[key]["source"] == "set for this run"
    assert "project's choice" in E.__doc__ and "project's choice" in PARAMS["m"].origin()


def test_embeddings_come_from_the_fine_tuned_encoders_first_token(tiny_encoder, tmp_path, monkeypatch):
    """Φ is "extracted from the final layer before the output layer" of the warm-up model: the
    first token of the fine-tuned encoder's last layer, not of the encoder it started from."""
    import debiased_nli.methods.aflite.step as A
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(tmp_path))
    seen = {}
    real = A.aflite_filter

    def spy(work, emb, **kw):
        seen["work"], seen["emb"] = work, emb
        return real(work, emb, **kw)

    monkeypatch.setattr(A, "aflite_filter", spy)
    ds = _rows(n=60, seed=3)
    _, _, report = aflite_step(ds, get_task("snli"), {"encoder": tiny_encoder, "warmup_share": 0.2, "audit": False, **WARM})
    tuned = report["warm_up"]["model_dir"]
    assert report["embedded_with"] == tuned
    row = seen["work"][4]
    first = _last_layer(tuned, row["premise"], row["hypothesis"])[0]
    np.testing.assert_allclose(seen["emb"][4], first, atol=1e-5)
    base = _last_layer(tiny_encoder, row["premise"], row["hypothesis"])[0]
    assert np.abs(seen["emb"][4] - base).max() > 1e-3   # the warm-up changed the encoder


def test_without_warm_up_every_row_is_filtered(tiny_encoder, tmp_path, monkeypatch):
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(tmp_path))
    ds = _rows(n=60, seed=4)
    kept, removed, report = aflite_step(ds, get_task("snli"), {"encoder": tiny_encoder, "warmup_share": 0, "audit": False,
                                                     **WARM})
    assert "warm_up" not in report and report["removed_by_reason"]["warm-up"] == 0
    assert report["history"][0]["size_before"] == 60
    assert report["params"]["train_size"] == 6 and report["params"]["target_n"] == 20


def test_an_interrupted_embedding_run_resumes_at_the_first_missing_shard(tiny_encoder, tmp_path, monkeypatch):
    ds = _rows(n=10)
    full = E.compute_embeddings(ds, tiny_encoder, cache_dir=tmp_path / "ref", progress=False)
    calls = []
    real = E.encode_pairs

    def fail_on_third(premises, *a, **k):
        calls.append(len(premises))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(premises, *a, **k)

    monkeypatch.setattr(E, "encode_pairs", fail_on_third)
    with pytest.raises(KeyboardInterrupt):
        E.compute_embeddings(ds, tiny_encoder, cache_dir=tmp_path / "c", progress=False, shard_rows=4)
    assert len(list((tmp_path / "c").glob("emb-*.parts-4/*.npy"))) == 2
    calls.clear()
    monkeypatch.setattr(E, "encode_pairs", real)
    again = E.compute_embeddings(ds, tiny_encoder, cache_dir=tmp_path / "c", progress=False, shard_rows=4)
    np.testing.assert_allclose(again, full, atol=1e-5)
    assert not list((tmp_path / "c").glob("emb-*.parts-*"))


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_an_unreadable_embedding_cache_entry_is_recomputed(tiny_encoder, tmp_path, caplog, damage):
    """The cached embeddings, a shard of an interrupted run and a warm-up encoder's record, cut short:
    each is a miss (recomputed and replaced, with a warning), never an error."""
    def spoil(path):
        path.write_bytes(b"" if damage == "empty" else path.read_bytes()[: path.stat().st_size // 2])

    ds = _rows(n=10)
    full = E.compute_embeddings(ds, tiny_encoder, cache_dir=tmp_path, progress=False)
    (entry,) = tmp_path.glob("emb-*.npy")
    spoil(entry)
    with caplog.at_level("WARNING"):
        again = E.compute_embeddings(ds, tiny_encoder, cache_dir=tmp_path, progress=False)
    np.testing.assert_allclose(again, full, atol=1e-5)
    assert any(entry.name in r.getMessage() and "recomput" in r.getMessage() for r in caplog.records)
    assert np.load(entry).shape == full.shape
    # a shard left by an interrupted run
    parts = tmp_path / "p"
    E.compute_embeddings(ds, tiny_encoder, cache_dir=parts, progress=False, shard_rows=4)
    (done,) = parts.glob("emb-*.npy")
    shards = done.with_name(done.name[:-4] + ".parts-4")
    shards.mkdir()
    for i, (a, b) in enumerate([(0, 4), (4, 8)]):
        np.save(shards / f"{i:05d}.npy", full[a:b])
    spoil(shards / "00001.npy")
    done.unlink()
    caplog.clear()
    with caplog.at_level("WARNING"):
        resumed = E.compute_embeddings(ds, tiny_encoder, cache_dir=parts, progress=False, shard_rows=4)
    np.testing.assert_allclose(resumed, full, atol=1e-5)
    assert any("00001.npy" in r.getMessage() for r in caplog.records)
    # the warm-up encoder's record
    warm = E.WarmUpParams(share=0.3, epochs=1.0, batch_size=8, lr=1e-3)
    wu = E.warm_up_encoder(_rows(n=30), tiny_encoder, num_labels=3, params=warm, cache_dir=tmp_path / "w",
                           progress=False)
    spoil(Path(wu.model_dir) / "warmup.json")
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = E.warm_up_encoder(_rows(n=30), tiny_encoder, num_labels=3, params=warm, cache_dir=tmp_path / "w",
                                  progress=False)
    assert again.model_dir == wu.model_dir and again.train_loss == pytest.approx(wu.train_loss)
    assert any("warmup" in r.getMessage() and "recomput" in r.getMessage() for r in caplog.records)
    assert not [p for p in (tmp_path / "w").iterdir() if ".tmp" in p.name]
