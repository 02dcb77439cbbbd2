"""IBADR's parts (Wang et al. 2023): bias degree, equal-size indicator groups, b-bar sampling, the
conditional format p(x | b, y) with the real GPT-2 and SmolLM2 tokenizers."""
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from debiased_nli.data.loading import new_rows
from debiased_nli.data.tasks import get_task
from debiased_nli.utils.errors import ConfigError
from debiased_nli.methods.generation.conditional import ConditionalFormat, encode_conditional
from debiased_nli.methods.generation.losses import target_log_probs
from debiased_nli.methods.generation.train import batch_loss, collate, encode_dataset
from debiased_nli.methods.ibadr.indicators import (assign_indicators, low_indicators, reference_assign_indicators,
                                                   sample_indicators, sample_labels)
from debiased_nli.methods.ibadr.shallow import bias_degree, gold_label_probabilities

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
LABELS = ("entailment", "neutral", "contradiction")
TOKENIZERS = ["gpt2-tokenizer", "smollm2-135m-instruct"]


# ---- step 1: bias degree and indicators ---------------------------------------------------------------

def test_beta_is_the_classifiers_probability_of_the_gold_label():
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast
    import tempfile
    rows = new_rows("snli", ["A dog runs.", "Two men play.", "A girl eats.", "A cat naps."],
                    ["An animal moves.", "Nobody plays.", "A child eats.", "The cat sleeps."],
                    ["entailment", "contradiction", "neutral", "entailment"], origin="original", method="t")
    with tempfile.TemporaryDirectory() as d:
        words = sorted({w for t in list(rows["premise"]) + list(rows["hypothesis"]) for w in t.lower().replace(".", " .").split()})
        (Path(d) / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words))
        tok = BertTokenizerFast(vocab_file=str(Path(d) / "vocab.txt"))
        # the head's outputs in another order than the task's: beta must follow the names
        cfg = BertConfig(vocab_size=5 + len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, id2label={0: "contradiction", 1: "entailment", 2: "neutral"},
                         label2id={"contradiction": 0, "entailment": 1, "neutral": 2})
        torch.manual_seed(0)
        model = BertForSequenceClassification(cfg).eval()
        with torch.no_grad():
            model.classifier.weight.mul_(50)
        beta = bias_degree(rows, model, get_task("snli"), tokenizer=tok, progress=False)
        expected = []
        with torch.no_grad():
            for p, h, y in zip(rows["premise"], rows["hypothesis"], rows["label"]):
                probs = torch.softmax(model(**tok(p, h, return_tensors="pt")).logits[0], -1)
                expected.append(float(probs[cfg.label2id[LABELS[y]]]))
    np.testing.assert_allclose(beta, expected, rtol=1e-5, atol=1e-6)
    assert gold_label_probabilities(np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]]), np.array([2, 0])).tolist() == [0.3, 0.6]


@pytest.mark.parametrize("n,n_bi", [(10, 5), (11, 5), (14, 5), (7, 3), (1000, 5), (999, 7)])
def test_groups_have_equal_sizes_and_b1_holds_the_lowest_beta(n, n_bi):
    rng = np.random.default_rng(n)
    beta = rng.random(n)
    uids = [f"u{i}" for i in rng.permutation(n)]
    ind = assign_indicators(beta, uids, n_bi)
    sizes = np.bincount(ind, minlength=n_bi + 1)[1:]
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == n and set(ind) == set(range(1, n_bi + 1))
    for g in range(1, n_bi):  # every row of b_g is less biased than every row of b_{g+1}
        assert beta[ind == g].max() <= beta[ind == g + 1].min()
    assert ind[np.argmin(beta)] == 1 and ind[np.argmax(beta)] == n_bi


def test_binning_agrees_with_the_reference_and_is_deterministic_with_ties_broken_by_uid():
    rng = np.random.default_rng(0)
    for trial in range(30):
        n = int(rng.integers(5, 400))
        beta = np.round(rng.random(n), 1)  # many ties
        uids = [f"snli:train:{i}" for i in rng.permutation(n)]
        n_bi = int(rng.integers(1, 6))
        fast = assign_indicators(beta, uids, n_bi)
        assert fast.tolist() == reference_assign_indicators(beta, uids, n_bi)
        perm = rng.permutation(n)  # the same rows in another order get the same indicators
        again = assign_indicators(beta[perm], [uids[i] for i in perm], n_bi)
        assert again.tolist() == fast[perm].tolist()


def test_binning_refuses_bad_input():
    with pytest.raises(ConfigError, match="cannot fill"):
        assign_indicators([0.1, 0.2], ["a", "b"], 5)
    with pytest.raises(ConfigError, match="uid 'b'"):
        assign_indicators([0.1, float("nan"), 0.3, 0.4, 0.5], list("abcde"), 5)


def test_b_bar_is_drawn_from_the_lower_half_of_the_indicators():
    # section 2.3: b_r with 1 <= r <= N_bi/2; section 3.2: with N_bi = 3 "the bias indicator can only be b1"
    assert low_indicators(5) == [1, 2] and low_indicators(3) == [1] and low_indicators(9) == [1, 2, 3, 4]
    assert low_indicators(5, "lowest") == [1]
    draws = sample_indicators(3000, 5, np.random.default_rng(0))
    assert set(draws) == {1, 2} and abs((draws == 1).mean() - 0.5) < 0.05
    assert set(sample_indicators(500, 3, np.random.default_rng(1))) == {1}
    assert set(sample_indicators(500, 5, np.random.default_rng(1), "lowest")) == {1}


def test_y_bar_is_uniform_over_the_labels():
    from scipy.stats import chisquare
    y = sample_labels(3000, 3, np.random.default_rng(0))
    counts = np.bincount(y, minlength=3)
    assert chisquare(counts).pvalue > 0.01 and counts.min() > 900


# ---- step 2: the conditional format ------------------------------------------------------------------

@pytest.fixture(scope="module", params=TOKENIZERS)
def tok(request):
    from debiased_nli.methods.generation.models import load_tokenizer
    return load_tokenizer(str(MODELS / request.param))


ROWS = [("A man, sleeping in the park.", "neutral", "The man is tired", "b1"),
        ("Two dogs run\nthrough snow.", "entailment", "Dogs are outside.", "b5"),
        ("Nobody's here, 'tis late", "contradiction", "Everybody's here", "b3")]


@pytest.mark.parametrize("premise,label,hypothesis,b", ROWS)
def test_the_prompt_is_a_token_prefix_of_the_training_sequence(tok, premise, label, hypothesis, b):
    fmt = ConditionalFormat.for_tokenizer(tok, LABELS)
    prompt = fmt.prompt(label, {"bias": b})
    assert prompt == f"{tok.bos_token or ''}bias: {b}\nlabel: {label}\npremise:"
    ids = fmt.encode(tok, premise, label, hypothesis, {"bias": b})["input_ids"]
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[:len(p_ids)] == p_ids and len(ids) > len(p_ids)


@pytest.mark.parametrize("premise,label,hypothesis,b", ROWS)
def test_the_loss_mask_excludes_the_indicator_and_label_prefix(tok, premise, label, hypothesis, b):
    fmt = ConditionalFormat.for_tokenizer(tok, LABELS)
    enc = fmt.encode(tok, premise, label, hypothesis, {"bias": b})
    ids, mask = enc["input_ids"], enc["loss_mask"]
    n_prefix = mask.index(1)
    assert all(m == 0 for m in mask[:n_prefix]) and all(m == 1 for m in mask[n_prefix:])
    assert tok.decode(ids[:n_prefix]) == fmt.prefix(label, {"bias": b})
    x = tok.decode(ids[n_prefix:])
    assert x == f"premise: {' '.join(premise.split())}\nhypothesis: {hypothesis}{fmt.end}"
    row, why = fmt.parse(tok.decode(ids))
    assert why is None and row == {"bias": b, "label": label, "premise": " ".join(premise.split()),
                                   "hypothesis": hypothesis}


def test_without_an_indicator_the_prefix_is_the_label_alone(tok):
    fmt = ConditionalFormat.for_tokenizer(tok, LABELS, controls=())
    assert fmt.prompt("neutral") == f"{tok.bos_token or ''}label: neutral\npremise:"
    with pytest.raises(ConfigError, match="controls"):
        fmt.prompt("neutral", {"bias": "b1"})


@pytest.mark.parametrize("continuation,reason", [
    (" A dog.\nhypothesis: A cat.", "no end marker (length limit reached)"),
    (" A dog. A cat.<END>", "no hypothesis marker"),
    ("\nhypothesis: A cat.<END>", "empty premise"),
    (" A dog.\nhypothesis: <END>", "empty hypothesis"),
])
def test_unparseable_samples_give_their_reason(continuation, reason):
    fmt = ConditionalFormat(LABELS, ("bias",), start="", end="<END>")
    row, why = fmt.parse(fmt.prompt("neutral", {"bias": "b2"}) + continuation)
    assert row is None and why == reason
    assert fmt.parse("bias: b2\nlabel: happy\npremise: A.\nhypothesis: B.<END>") == (None, "unknown label")


def test_the_conditional_loss_is_the_nll_of_x_given_the_prefix():
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
    tok.pad_token = tok.eos_token
    rows = new_rows("snli", ["A dog runs.", "Two men play chess in a park."], ["An animal moves.", "Nobody plays."],
                    ["entailment", "contradiction"], origin="original", method="t")
    rows = rows.add_column("control_bias", ["b1", "b4"])
    enc = encode_dataset(rows, get_task("snli"), tok, mode="conditional", progress=False)
    assert enc[0]["input_ids"] == encode_conditional(rows, get_task("snli"), tok, progress=False)[0]["input_ids"]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=64, vocab_size=len(tok))).eval()
    batch = collate([enc[0], enc[1]], tok.pad_token_id)
    with torch.no_grad():
        loss, parts = batch_loss(model, batch, mode="conditional", lam=0.5, alpha=1.0)
        total, count = 0.0, 0
        for r in (enc[0], enc[1]):  # by hand, one row at a time, no padding
            ids = torch.tensor([r["input_ids"]])
            lp = target_log_probs(model(input_ids=ids).logits, ids)[0]
            for t in range(1, len(r["input_ids"])):
                if r["loss_mask"][t]:
                    total -= float(lp[t])
                    count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    assert parts["mle"] == pytest.approx(loss.item())


# ---- the command: the method commands' shared load -> step -> write flow ------------------------------

def test_the_command_loads_the_rows_runs_the_loop_and_writes_its_report(tmp_path, monkeypatch, shared_data):
    import json
    from types import SimpleNamespace

    from debiased_nli.cli import main
    from debiased_nli.methods.ibadr import loop

    seen = {}

    def fake_run(d0, task, cfg, out, deadline=None, gen_chunk_steps=None):
        seen.update(rows=len(d0), task=task.name, seed=cfg.seed, threads=torch.get_num_threads(),
                    deadline=deadline is not None, chunk=gen_chunk_steps)
        Path(out).mkdir(parents=True)
        return SimpleNamespace(report={"iterations_complete": 1}, complete=False, pool=d0, generated=None, rejected=None)

    monkeypatch.setattr(loop, "run_ibadr", fake_run)
    threads = torch.get_num_threads()
    try:
        rc = main(["ibadr", "snli", "--data-files", str(shared_data / "snli" / "train_sample.parquet"), "--max-rows",
                   "40", "--out", str(tmp_path / "run"), "--confidence-model", "M", "--seed", "7", "--threads", "1",
                   "--time-budget", "60", "--gen-chunk-steps", "5", "--quiet"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 3  # paused: rerun to continue
    assert seen == {"rows": 40, "task": "snli", "seed": 7, "threads": 1, "deadline": True, "chunk": 5}
    assert json.loads((tmp_path / "run" / "ibadr.json").read_text()) == {"iterations_complete": 1}
    assert not (tmp_path / "run" / "pool.parquet").exists()
