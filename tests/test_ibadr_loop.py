"""The IBADR loop (Wang et al. 2023, section 2.2) with tiny models built from a config: the pool grows by
exactly the kept pseudo samples, theta_g trains 3 epochs then 1, theta_s is re-trained on the pool (USM),
rejects keep their reason, a killed run resumes to the same pool, the ablations, and the recipe steps."""
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from debiased_nli.data.loading import load_task
from debiased_nli.data.tasks import get_task
from debiased_nli.methods.generation.sample import load_generated
from debiased_nli.methods.ibadr.loop import IbadrConfig, run_ibadr

NAMES = ("entailment", "neutral", "contradiction")


def pool_rows():
    """24 short pairs over a small vocabulary (a tiny generator can learn their shape in seconds)."""
    subj, verb = ["dog", "cat", "man", "girl", "boy", "woman"], ["runs", "sleeps", "eats", "sings"]
    out = []
    for i, (s, v) in enumerate(itertools.product(subj, verb)):
        hyp = (f"The {s} {v}.", f"The {s} is happy.", f"Nobody {v}.")[i % 3]
        out.append({"premise": f"A {s} {v} outside.", "hypothesis": hyp, "label": i % 3})
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """D0 on disk, a tiny byte-level GPT-2 that writes the conditional format, a tiny BERT encoder for
    theta_s and a tiny BERT classifier M."""
    import datasets
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast, GPT2Config,
                              GPT2LMHeadModel, PreTrainedTokenizerFast)

    from debiased_nli.methods.generation.train import GeneratorTraining, train_generator

    root = tmp_path_factory.mktemp("ibadr_world")
    rows = pool_rows()
    datasets.Dataset.from_list(rows).to_parquet(str(root / "d0.parquet"))
    texts = [f"bias: b{i % 5 + 1}\nlabel: {NAMES[r['label']]}\npremise: {r['premise']}\nhypothesis: {r['hypothesis']}"
             for i, r in enumerate(rows)] + ["bias: b1 b2 b3 b4 b5 label: entailment neutral contradiction"]

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    g0 = root / "g0"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=96, vocab_size=len(tok),
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)).save_pretrained(g0)
    tok.save_pretrained(g0)
    # a generator that already writes the format: 15 epochs of the conditional objective on D0
    d0 = load_task("snli", data_files=str(root / "d0.parquet")).dataset
    warm = d0.add_column("control_bias", [f"b{i % 5 + 1}" for i in range(len(d0))])
    train_generator(warm, get_task("snli"), str(g0), str(root / "g"),
                    GeneratorTraining(mode="conditional", epochs=15, batch_size=8, lr=2e-2, checkpoint_every=0),
                    cpu=True, progress=False)

    words = sorted({w for r in rows for t in (r["premise"], r["hypothesis"]) for w in t.lower().replace(".", " .").split()})
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    bert = dict(vocab_size=len(specials) + len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32, max_position_embeddings=64)
    for name in ("shallow", "M"):
        (root / name).mkdir()
        (root / name / "vocab.txt").write_text("\n".join(specials + words) + "\n")
        BertTokenizerFast(vocab_file=str(root / name / "vocab.txt")).save_pretrained(root / name)
    torch.manual_seed(1)
    BertModel(BertConfig(**bert)).save_pretrained(root / "shallow")  # no head, like all-MiniLM-L6-v2
    m = BertForSequenceClassification(BertConfig(**bert, id2label=dict(enumerate(NAMES)),
                                                 label2id={n: i for i, n in enumerate(NAMES)}))
    with torch.no_grad():
        m.classifier.weight.mul_(40)  # spread the probabilities: some samples pass epsilon, some do not
    m.save_pretrained(root / "M")
    return {"root": root, "d0": d0, "generator": str(root / "g"), "shallow": str(root / "shallow"), "M": str(root / "M")}


def config(world, **kw):
    base = dict(generator=world["generator"], confidence_model=world["M"], shallow_model=world["shallow"], n_bi=5,
                n_iter=2, samples_per_iter=16, epsilon=0.4, shallow_rows=12, shallow_epochs=1, usm_rows=10,
                shallow_max_length=32, gen_lr=1e-3, gen_batch_size=8, gen_max_length=64, top_p=0.3,
                max_new_tokens=24, sample_batch_size=8, shard_size=8, confidence_batch_size=16, cpu=True, seed=0)
    return IbadrConfig(**{**base, **kw})


def canonical(ds):
    return [(r["premise"], r["hypothesis"], r["label"], r["uid"], r["origin"], r["method"]) for r in ds]


@pytest.fixture(scope="module")
def full_run(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("ibadr_full")
    return out, run_ibadr(world["d0"], get_task("snli"), config(world), out, progress=False)


def test_the_pool_grows_by_exactly_the_kept_rows(world, full_run):
    out, res = full_run
    assert res.complete and res.report["iterations_complete"] == 2
    before = len(world["d0"])
    kept_total = 0
    for k, rep in enumerate(res.report["iterations"], start=1):
        kept = json.loads((out / f"iter-{k}" / "report.json").read_text())["kept"]
        assert rep["pool_before"] == before and rep["pool_after"] == before + kept
        before += kept
        kept_total += kept
    assert kept_total > 0, "the tiny generator should produce some accepted rows"
    assert len(res.pool) == len(world["d0"]) + kept_total == before
    assert canonical(res.pool.select(range(len(world["d0"])))) == canonical(world["d0"])
    gen = res.generated
    assert len(gen) == kept_total and set(gen["origin"]) == {"generated"}
    assert all(u.startswith(f"ibadr:iter-{k}:") for u, k in zip(gen["uid"], gen["ibadr_iteration"]))
    assert len(set(res.pool["uid"])) == len(res.pool)
    assert min(gen["confidence"]) > 0.4 and set(gen["indicator"]) <= {1, 2}
    # each generated row carries the label it was prompted with
    for k in (1, 2):
        prompts = load_parquet(out / f"iter-{k}" / "prompts.parquet")
        kept = gen.filter(lambda r: r["ibadr_iteration"] == k)
        for r in kept:
            assert prompts[r["sample_index"]]["label"] == r["label"]
            assert prompts[r["sample_index"]]["indicator"] == r["indicator"]


def load_parquet(path):
    import datasets
    return datasets.Dataset.from_parquet(str(path))


def test_rejected_samples_are_recorded_with_their_reason(full_run):
    out, res = full_run
    rej = res.rejected
    assert len(rej) > 0
    for r in rej:
        assert r["stage"] == f"ibadr:iter-{r['ibadr_iteration']}"
        if r["reason"].startswith("confidence"):
            assert r["confidence"] <= 0.4 and r["reason"] == f"confidence {r['confidence']:.4f} <= epsilon 0.4"
        else:
            assert r["reason"].startswith("repeat of an earlier sample")
    for k in (1, 2):
        rep = json.loads((out / f"iter-{k}" / "report.json").read_text())
        s = rep["samples"]
        assert s["samples"] == 16 and s["parsed"] + s["unparseable"] == 16
        assert rep["filter"]["kept"] + rep["filter"]["rejected"] + rep["filter"]["repeats_within_iteration"] == s["parsed"]
        assert rep["kept"] == rep["filter"]["kept"]
        unparseable = load_generated(str(out / f"iter-{k}" / "samples"), "rejects")
        assert len(unparseable) == s["unparseable"] and all(unparseable["reason"])




def test_generator_trains_3_epochs_then_1_continuing_the_same_weights_and_usm_refits(world, full_run):
    out, res = full_run
    r1 = json.loads((out / "iter-1" / "generator" / "train_report.json").read_text())
    r2 = json.loads((out / "iter-2" / "generator" / "train_report.json").read_text())
    pool2 = res.report["iterations"][1]["pool_before"]
    assert r1["epochs"] == 3 and r1["steps"] == 3 * math.ceil(len(world["d0"]) / 8) and r1["rows"] == len(world["d0"])
    assert r2["epochs"] == 1 and r2["steps"] == math.ceil(pool2 / 8) and r2["rows"] == pool2
    assert r1["started_from"] == world["generator"] and r2["started_from"] == str(out / "iter-1" / "generator")
    s1 = json.loads((out / "iter-1" / "shallow.json").read_text())
    s2 = json.loads((out / "iter-2" / "shallow.json").read_text())
    assert s1["train_rows"] == 12 and s1["pool_rows"] == len(world["d0"])
    assert s2["train_rows"] == 10 and s2["pool_rows"] == pool2 and s2["model"] != s1["model"]
    assert s2["started_from"] == world["shallow"] and s1["sample_seed"] != s2["sample_seed"]
    # iteration 2 scores (and bins) the grown pool
    scores2 = load_parquet(out / "iter-2" / "scores.parquet")
    assert list(scores2["uid"]) == list(res.pool.select(range(pool2))["uid"])
    sizes = np.bincount(scores2["indicator"], minlength=6)[1:]
    assert sizes.max() - sizes.min() <= 1


def test_a_killed_run_resumes_to_the_identical_pool(world, full_run, tmp_path):
    _, res = full_run
    out = tmp_path / "resumed"
    for stop in ("iter-1:shallow", "iter-1:generator", "iter-2:scores", "iter-2:samples"):
        part = run_ibadr(world["d0"], get_task("snli"), config(world), out, progress=False, stop_after=stop)
        assert not part.complete
    again = run_ibadr(world["d0"], get_task("snli"), config(world), out, progress=False)
    assert again.complete and canonical(again.pool) == canonical(res.pool)
    # a rerun of a finished run reads it and changes nothing
    assert canonical(run_ibadr(world["d0"], get_task("snli"), config(world), out, progress=False).pool) == canonical(res.pool)
    with pytest.raises(Exception, match="other settings"):
        run_ibadr(world["d0"], get_task("snli"), config(world, epsilon=0.5), out, progress=False)


def test_ablations_change_what_they_name(world, tmp_path):
    # w/o bias indicator and w/o iterative generation: one iteration of n_iter x M samples from p(x | y)
    res = run_ibadr(world["d0"], get_task("snli"), config(world, indicator="none", iterate=False), tmp_path / "a",
                    progress=False)
    it = tmp_path / "a" / "iter-1"
    assert res.complete and res.report["iterations_complete"] == 1 and not (tmp_path / "a" / "iter-2").exists()
    assert json.loads((it / "samples" / "generate_report.json").read_text())["samples"] == 32
    assert not (it / "shallow.json").exists() and not (it / "scores.parquet").exists()
    assert set(load_parquet(it / "prompts.parquet")["indicator"]) == {0}
    # b_r => b_1 and w/o USM: every b-bar is b1; iteration 2 scores with the first theta_s
    out = tmp_path / "b"
    run_ibadr(world["d0"], get_task("snli"), config(world, indicator="lowest", update_shallow=False), out, progress=False,
              stop_after="iter-2:scores")
    assert set(load_parquet(out / "iter-1" / "prompts.parquet")["indicator"]) == {1}
    s2 = json.loads((out / "iter-2" / "shallow.json").read_text())
    assert s2["reused_from"] == "iter-1" and s2["model"] == str(out / "iter-1" / "shallow")
    assert not (out / "iter-2" / "shallow").exists()


def test_the_recipe_publishes_an_ibadr_config_and_composes_its_rows(world, full_run, tmp_path):
    from debiased_nli.release.recipe import build, load_recipe

    out, _ = full_run
    params = {"out": str(out), **{k: v for k, v in json.loads((out / "config.json").read_text()).items()
                                  if k not in ("task", "d0_rows", "d0_sha256", "seed")}, "progress": False}
    # no seed of their own: both steps get the build's (0 here, the run's), by one route
    recipe = {"task": "snli", "name": "ibadr-test", "z_filter": {"top_k": 5, "batch_size": 8},
              "features": {"hypothesis_only": "tfidf", "folds": 2}, "configs": ["ibadr", "z_aug", "seq_z"],
              "filters": [{"step": "ibadr", "config": "ibadr", **params}],
              "new_rows": [{"step": "ibadr_rows", **params}]}
    res = build(recipe, tmp_path / "release", data_files=str(world["root"] / "d0.parquet"), progress=False)
    import datasets
    ibadr = datasets.load_dataset(str(tmp_path / "release"), "ibadr", split="train")
    assert res.configs["ibadr"] == len(ibadr) == len(full_run[1].pool)
    assert sorted(ibadr["uid"]) == sorted(full_run[1].pool["uid"])
    assert set(res.configs) == {"ibadr", "z_aug", "seq_z"}
    # z_aug = Z(D_G | D0) composes IBADR's new rows with D0: every new row it keeps is one of IBADR's
    z_aug = datasets.load_dataset(str(tmp_path / "release"), "z_aug", split="train")
    new = {u for u, o in zip(z_aug["uid"], z_aug["origin"]) if o == "generated"}
    assert new <= set(full_run[1].generated["uid"]) and len(z_aug) >= len(world["d0"])
    card = (tmp_path / "release" / "README.md").read_text()
    assert "IBADR (Wang et al. 2023)" in card
    for name in ("snli", "mnli", "fever"):  # the builders' ibadr profiles are valid recipes
        r = load_recipe(Path(__file__).resolve().parents[1] / "builders" / f"{name}.yaml", profile="ibadr")
        assert r["filters"][0]["step"] == "ibadr" and r["new_rows"][0]["step"] == "ibadr_rows"


def test_pool_scoring_resumes_by_shard_and_matches_one_call(world, full_run, tmp_path, monkeypatch):
    """beta of a large pool is saved shard by shard: a paused scoring keeps its finished shards, and the
    resumed result is bit for bit what one call of ``bias_degree`` over the whole pool gives."""
    from debiased_nli.methods.ibadr import loop
    from debiased_nli.methods.ibadr.shallow import bias_degree

    out, _ = full_run
    shallow = str(out / "iter-1" / "shallow")
    cfg = config(world)  # confidence_batch_size 16
    pool = world["d0"].select_columns(loop.CANONICAL)
    monkeypatch.setattr(loop, "SCORE_SHARD_ROWS", 5)  # rounded up to one batch: shards of 16, then 8 rows
    calls = []

    def pause_on_second(deadline):
        calls.append(deadline)
        if len(calls) == 2:
            raise loop._Paused()
    monkeypatch.setattr(loop, "_check_deadline", pause_on_second)
    parts = tmp_path / "parts"
    with pytest.raises(loop._Paused):
        loop._pool_bias_degree(pool, shallow, get_task("snli"), cfg, parts, None, False)
    first = sorted(parts.glob("beta-*.npy"))
    assert [p.name for p in first] == ["beta-0000000000-0000000016.npy"]
    stamp = first[0].stat().st_mtime_ns
    beta = loop._pool_bias_degree(pool, shallow, get_task("snli"), cfg, parts, None, False)
    assert first[0].stat().st_mtime_ns == stamp  # the finished shard was read, not scored again
    assert len(calls) == 3 and len(sorted(parts.glob("beta-*.npy"))) == 2
    whole = bias_degree(pool, shallow, get_task("snli"), batch_size=16, max_length=cfg.shallow_max_length, progress=False)
    np.testing.assert_array_equal(beta, whole)
    # the run itself left no shard folder behind once scores.parquet was written
    assert not (out / "iter-1" / loop.SCORE_PARTS).exists() and (out / "iter-1" / "scores.parquet").exists()
