"""Pair embeddings Φ(x) for AFLite: masked mean of the last layer, cached by dataset fingerprint."""
from pathlib import Path

import numpy as np
import pytest
import torch

from debiased_nli import embeddings as E
from debiased_nli.aflite import aflite_step
from debiased_nli.data import new_rows
from debiased_nli.errors import ConfigError, InvalidInputError

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


def test_embedding_is_the_masked_mean_of_the_last_layer_of_the_pair(tiny_encoder, tmp_path):
    from transformers import AutoModel, AutoTokenizer
    ds = _rows()
    emb = E.compute_embeddings(ds, tiny_encoder, batch_size=4, cache_dir=tmp_path, progress=False)
    assert emb.shape == (len(ds), 32) and emb.dtype == np.float32
    tok = AutoTokenizer.from_pretrained(tiny_encoder)
    model = AutoModel.from_pretrained(tiny_encoder).eval()
    with torch.no_grad():
        enc = tok(ds[3]["premise"], ds[3]["hypothesis"], return_tensors="pt")
        expected = model(**enc).last_hidden_state[0].mean(0).numpy()
    np.testing.assert_allclose(emb[3], expected, atol=1e-5)


def test_padding_does_not_change_an_embedding(tiny_encoder, tmp_path):
    ds = _rows()
    one = E.compute_embeddings(ds, tiny_encoder, batch_size=1, cache_dir=tmp_path / "a", progress=False)
    many = E.compute_embeddings(ds, tiny_encoder, batch_size=5, cache_dir=tmp_path / "b", progress=False)
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
    # other rows (another fingerprint) or other parameters are not served from the cache
    with pytest.raises(AssertionError, match="encoder was loaded"):
        E.compute_embeddings(ds.select(range(5)), tiny_encoder, cache_dir=tmp_path, progress=False)
    with pytest.raises(AssertionError, match="encoder was loaded"):
        E.compute_embeddings(ds, tiny_encoder, pooling="cls", cache_dir=tmp_path, progress=False)


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


def test_warm_up_rows_are_reported_removed_and_never_kept(tiny_encoder, tmp_path, monkeypatch):
    monkeypatch.setenv("DEBIASED_NLI_CACHE", str(tmp_path))
    ds = _rows(n=60, seed=1)
    kept, removed, report = aflite_step(ds, "snli", {
        "encoder": tiny_encoder, "warmup_share": 0.2, "warmup_epochs": 1.0, "m": 8, "train_size": 10,
        "k": 5, "target_n": 20, "audit": True, "progress": False})
    warm = removed.filter(lambda r: r["reason"] == "warm-up")
    assert len(warm) == 12 == report["removed_by_reason"]["warm-up"]
    assert set(warm["uid"]).isdisjoint(kept["uid"])
    assert all(r == -1 for r in warm["aflite_round"])
    assert sorted(list(kept["uid"]) + list(removed["uid"])) == sorted(ds["uid"])
    assert Path(report["warm_up"]["model_dir"]).joinpath("config.json").exists()
    audit = report["audit"]
    assert audit["before"]["n_rows"] == 60
    assert audit["after"]["n_rows"] == audit["random_same_size"]["n_rows"] == len(kept)
