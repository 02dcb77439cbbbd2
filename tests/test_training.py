"""Fine-tuning and the product-of-experts loss (Wu et al. 2022, appendix A.2), with a tiny BERT from a config."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from debiased_nli.data.loading import load_task
from debiased_nli.utils.errors import ConfigError
from debiased_nli.data.tasks import get_task
from debiased_nli.bias.poe import bias_log_probabilities, bias_model_for
from debiased_nli.models.training import (BIAS_COLUMN, PairCollator, TrainConfig,
                                          load_model_for_task, poe_loss, tokenize_pairs, train_classifier)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def make_tiny_bert(folder: Path, texts, *, id2label: dict[int, str] | None = None, head: bool = False) -> Path:
    """A 2-layer BERT (hidden 32) from a config and a WordPiece tokenizer built from a vocab file of ``texts``."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = sorted({w for t in texts for w in re.findall(r"\w+|[^\w\s]", t.lower())})
    (folder / "vocab.txt").write_text("\n".join(SPECIALS + words) + "\n")
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(folder)
    cfg = BertConfig(vocab_size=len(SPECIALS) + len(words), hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    if head:
        cfg.id2label = dict(id2label)
        cfg.label2id = {v: k for k, v in id2label.items()}
        cfg.num_labels = len(id2label)
        BertForSequenceClassification(cfg).save_pretrained(folder)
    else:  # an encoder without a classification head, like all-MiniLM-L6-v2
        BertModel(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def snli_small(shared_data):
    train = load_task("snli", data_files=str(shared_data / "snli" / "train_sample.parquet"), max_rows=300).dataset
    dev = load_task("snli", "validation", data_files=[f"validation={shared_data / 'snli' / 'dev.parquet'}"],
                    max_rows=100).dataset
    return train, dev


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory, snli_small, shared_data):
    import pandas as pd

    texts = list(snli_small[0]["premise"]) + list(snli_small[0]["hypothesis"]) + list(snli_small[1]["premise"]) \
        + list(snli_small[1]["hypothesis"])
    for f in ["hans/evaluation_regenerated.parquet", "snli/dev.parquet"]:
        df = pd.read_parquet(shared_data / f).head(2000)
        texts += list(df.premise) + list(df.hypothesis)
    return make_tiny_bert(tmp_path_factory.mktemp("tiny") / "encoder", texts)


def test_poe_loss_equals_the_hand_computation():
    # one row, K = 3: p = softmax(f), b given; L = -log softmax(log p + beta log b)_y + gamma * (-log b_y)
    logits = torch.tensor([[2.0, 0.5, -1.0]])
    b = torch.tensor([[0.7, 0.2, 0.1]])
    y = torch.tensor([1])
    beta, gamma = 0.8, 0.3
    p = [math.exp(v) for v in (2.0, 0.5, -1.0)]
    p = [v / sum(p) for v in p]
    scores = [math.log(pi) + beta * math.log(bi) for pi, bi in zip(p, (0.7, 0.2, 0.1))]
    ensemble = -(scores[1] - math.log(sum(math.exp(s) for s in scores)))
    expected = ensemble + gamma * -math.log(0.2)
    loss, ens, bias_ce = poe_loss(logits, b.log(), y, beta, gamma, return_parts=True)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert ens.item() == pytest.approx(ensemble, rel=1e-6)
    assert bias_ce.item() == pytest.approx(-math.log(0.2), rel=1e-6)


def test_poe_with_beta_zero_and_gamma_zero_is_cross_entropy():
    torch.manual_seed(0)
    logits, y = torch.randn(8, 3), torch.randint(0, 3, (8,))
    b = torch.softmax(torch.randn(8, 3), -1).log()
    assert poe_loss(logits, b, y, 0.0, 0.0).item() == pytest.approx(
        torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-6)


def test_poe_gradient_is_smaller_where_the_bias_model_is_already_right():
    # the point of PoE: a row the bias model gets confidently right pushes the main model less
    logits = torch.zeros(2, 3, requires_grad=True)
    y = torch.tensor([0, 0])
    b = torch.tensor([[0.98, 0.01, 0.01], [1 / 3, 1 / 3, 1 / 3]]).log()
    poe_loss(logits, b, y, 1.0, 0.0).backward()
    g = logits.grad.norm(dim=1)
    assert g[0] < 0.1 * g[1]


def test_bias_model_is_out_of_fold_tfidf_log_probabilities(snli_small):
    train, _ = snli_small
    logb, info = bias_log_probabilities(train, get_task("snli"), "tfidf", progress=False)
    assert logb.shape == (len(train), 3)
    np.testing.assert_allclose(np.exp(logb).sum(axis=1), 1.0, atol=1e-5)
    assert info["method"] == "tfidf-logreg-oof"


def test_collator_pads_dynamically_and_keeps_the_bias_column(tiny_encoder, snli_small):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_encoder)
    train = snli_small[0].select(range(8))
    bias = np.log(np.full((8, 3), 1 / 3, dtype=np.float32))
    enc = tokenize_pairs(train, tok, 16, bias=bias)
    batch = PairCollator(tok)([dict(enc[i]) for i in range(8)])
    assert batch["input_ids"].shape[1] == max(enc["length"]) <= 16
    assert batch[BIAS_COLUMN].shape == (8, 3)
    assert batch["labels"].tolist() == train["label"]


def test_a_head_with_other_label_names_is_refused(tmp_path, snli_small):
    texts = list(snli_small[0]["premise"][:20])
    folder = make_tiny_bert(tmp_path / "yesno", texts, head=True, id2label={0: "yes", 1: "maybe", 2: "no"})
    with pytest.raises(ConfigError, match="no output named 'entailment'"):
        load_model_for_task(str(folder), get_task("snli"))


def test_a_head_in_another_label_order_trains_with_remapped_labels(tmp_path, snli_small):
    from debiased_nli.models.training import model_label_order

    texts = list(snli_small[0]["premise"][:20])
    folder = make_tiny_bert(tmp_path / "perm", texts, head=True,
                            id2label={0: "contradiction", 1: "entailment", 2: "neutral"})
    tok, model = load_model_for_task(str(folder), get_task("snli"))
    order = model_label_order(model, get_task("snli"), "perm")
    assert order == [1, 2, 0]  # entailment is output 1, neutral 2, contradiction 0
    enc = tokenize_pairs(snli_small[0].select(range(6)), tok, 32, label_order=order)
    assert enc["labels"] == [order[l] for l in snli_small[0]["label"][:6]]


def _rotated_copy(task_ordered: Path, folder: Path, id2label: dict[int, str]) -> Path:
    """The same network as ``task_ordered`` with its head rows moved to the outputs ``id2label`` names."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(task_ordered)
    names = [model.config.id2label[i] for i in range(model.config.num_labels)]
    new_index = {name: i for i, name in id2label.items()}
    perm = [new_index[n] for n in names]  # old output i -> new output perm[i]
    with torch.no_grad():
        w, b = model.classifier.weight.clone(), model.classifier.bias.clone()
        model.classifier.weight[perm] = w
        model.classifier.bias[perm] = b
    model.config.id2label = dict(id2label)
    model.config.label2id = {v: k for k, v in id2label.items()}
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(task_ordered).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("id2label", [{0: "contradiction", 1: "entailment", 2: "neutral"},   # a rotation
                                      {0: "neutral", 1: "contradiction", 2: "entailment"},   # the other one
                                      {0: "entailment", 1: "contradiction", 2: "neutral"}])  # a swap
def test_poe_loss_with_a_reordered_head_equals_the_loss_with_the_task_ordered_head(tmp_path, snli_small, id2label):
    # the same model with its head rows permuted must see the same PoE loss: labels and the bias
    # model's probabilities both follow the head's order (bias column t -> head output order[t])
    from debiased_nli.models.training import model_label_order

    train = snli_small[0].select(range(12))
    texts = list(train["premise"]) + list(train["hypothesis"])
    base = make_tiny_bert(tmp_path / "task", texts, head=True,
                          id2label={0: "entailment", 1: "neutral", 2: "contradiction"})
    rotated = _rotated_copy(base, tmp_path / "rotated", id2label)
    rng = np.random.default_rng(0)
    bias = np.log(rng.dirichlet(np.ones(3) * 0.5, size=len(train))).astype(np.float32)  # task order
    losses = []
    for folder in (base, rotated):
        tok, model = load_model_for_task(str(folder), get_task("snli"))
        model.eval()
        order = model_label_order(model, get_task("snli"), str(folder))
        enc = tokenize_pairs(train, tok, 48, label_order=order, bias=bias)
        batch = PairCollator(tok)([dict(enc[i]) for i in range(len(enc))])
        logb, labels = batch.pop(BIAS_COLUMN), batch.pop("labels")
        with torch.no_grad():
            losses.append(poe_loss(model(**batch).logits, logb, labels, beta=2.0, gamma=0.4).item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_bias_columns_go_to_the_heads_outputs_by_name():
    from debiased_nli.models.training import to_head_order

    # head {0: contradiction, 1: entailment, 2: neutral}: task label t (e, n, c) is output order[t]
    order = [1, 2, 0]
    task_cols = np.array([[0.7, 0.2, 0.1]])          # p(entailment), p(neutral), p(contradiction)
    np.testing.assert_array_equal(to_head_order(task_cols, order), [[0.1, 0.7, 0.2]])  # c, e, n


def test_one_epoch_trains_saves_label_names_and_resumes(tiny_encoder, snli_small, tmp_path):
    train, dev = snli_small
    cfg = TrainConfig(model=str(tiny_encoder), output_dir=str(tmp_path / "run"), learning_rate=1e-3,
                      batch_size=32, max_length=48, epochs=1, seed=3, progress=False, use_cpu=True)
    result = train_classifier(cfg, "snli", train, dev)
    assert result.train_rows == 300 and result.dev_rows == 100
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["id2label"] == {"0": "entailment", "1": "neutral", "2": "contradiction"}
    record = json.loads((tmp_path / "run" / "debiased_nli_train.json").read_text())
    assert record["config"]["seed"] == 3 and record["result"]["dev_accuracy"] == result.dev_accuracy
    assert list((tmp_path / "run").glob("checkpoint-*"))
    # a rerun with more epochs resumes from the last checkpoint instead of starting over
    cfg2 = TrainConfig(**{**cfg.to_dict(), "epochs": 2})
    again = train_classifier(cfg2, "snli", train, dev)
    assert again.resumed_from is not None and again.resumed_from.endswith("checkpoint-10")


def test_a_run_resumes_on_the_same_rows_read_from_a_copied_file(tiny_encoder, shared_data, tmp_path):
    # the efficacy table's random_control-s2 could not resume after ../shared was remounted: datasets'
    # fingerprint of a file hashes its modification time; the run record now hashes the rows
    import os
    import shutil

    import pandas as pd

    rows = pd.read_parquet(shared_data / "snli" / "train_sample.parquet").head(200)
    first = tmp_path / "a" / "train.parquet"
    first.parent.mkdir()
    rows.to_parquet(first)
    cfg = TrainConfig(model=str(tiny_encoder), output_dir=str(tmp_path / "run"), learning_rate=1e-3,
                      batch_size=32, max_length=32, epochs=1, seed=0, progress=False, use_cpu=True)
    train_classifier(cfg, "snli", load_task("snli", data_files=str(first)).dataset)
    copy = tmp_path / "b" / "train.parquet"
    copy.parent.mkdir()
    shutil.copy(first, copy)
    os.utime(copy, (1_000_000_000, 1_000_000_000))  # another path, another modification time, the same bytes
    again = load_task("snli", data_files=str(copy)).dataset
    more = TrainConfig(**{**cfg.to_dict(), "epochs": 2})
    assert train_classifier(more, "snli", again).resumed_from.endswith("checkpoint-7")
    # other rows are still another run: one label changed is refused, naming the fingerprint
    rows.loc[5, "label"] = (rows.loc[5, "label"] + 1) % 3
    changed = tmp_path / "c.parquet"
    rows.to_parquet(changed)
    with pytest.raises(ConfigError, match="train_fingerprint"):
        train_classifier(TrainConfig(**{**cfg.to_dict(), "epochs": 3}), "snli",
                         load_task("snli", data_files=str(changed)).dataset)


def test_content_fingerprint_depends_on_the_rows_not_on_how_they_are_held(snli_small):
    import datasets

    from debiased_nli.data.loading import content_fingerprint

    train, _ = snli_small
    picked = train.select(range(10, 60))                               # an indices mapping over the table
    held = datasets.Dataset(picked.with_format("arrow")[:], info=picked.info.copy())   # the same rows, copied
    rechunked = datasets.concatenate_datasets([train.select(range(10, 30)).flatten_indices(),
                                               train.select(range(30, 60)).flatten_indices()])
    assert content_fingerprint(picked) == content_fingerprint(held) == content_fingerprint(rechunked)
    assert content_fingerprint(picked) != content_fingerprint(train.select(range(11, 61)))
    assert content_fingerprint(picked) != content_fingerprint(train.select(list(range(11, 60)) + [10]))  # order


def test_training_is_seeded(tiny_encoder, snli_small, tmp_path):
    train, _ = snli_small
    weights = []
    for run in ("a", "b"):
        cfg = TrainConfig(model=str(tiny_encoder), output_dir=str(tmp_path / run), learning_rate=1e-3,
                          batch_size=64, max_length=32, epochs=1, seed=7, progress=False, use_cpu=True,
                          max_train_rows=128)
        train_classifier(cfg, "snli", train)
        from safetensors.torch import load_file
        weights.append(load_file(str(tmp_path / run / "model.safetensors"))["classifier.weight"])
    assert torch.equal(weights[0], weights[1])


def test_poe_training_runs_with_the_tfidf_bias_model(tiny_encoder, snli_small, tmp_path):
    train, dev = snli_small
    cfg = TrainConfig(model=str(tiny_encoder), output_dir=str(tmp_path / "poe"), learning_rate=1e-3,
                      batch_size=32, max_length=48, epochs=1, seed=1, progress=False, use_cpu=True,
                      poe=True, poe_beta=1.0, poe_gamma=1.0)
    result = train_classifier(cfg, "snli", train, dev, bias_model=bias_model_for(cfg, get_task("snli")))
    assert result.bias_model["method"] == "tfidf-logreg-oof" and result.bias_model["beta"] == 1.0
    assert (tmp_path / "poe" / "model.safetensors").exists()


def test_cli_train_from_a_release_config(tiny_encoder, snli_small, tmp_path):
    """`--release DIR --config NAME` reads load_dataset(DIR, NAME) (a Hub-layout folder)."""
    from debiased_nli.cli import main

    release = tmp_path / "release"
    (release / "data" / "z_filtered").mkdir(parents=True)
    snli_small[0].to_parquet(str(release / "data" / "z_filtered" / "train-00000-of-00001.parquet"))
    (release / "README.md").write_text("---\nconfigs:\n- config_name: z_filtered\n  data_files:\n"
                                       "  - split: train\n    path: data/z_filtered/train-*.parquet\n---\n")
    out = tmp_path / "zf"
    rc = main(["train", "snli", "--release", str(release), "--config", "z_filtered", "--model", str(tiny_encoder),
               "--out", str(out), "--epochs", "1", "--max-train-rows", "64", "--max-length", "32", "--lr", "1e-3",
               "--cpu"])
    assert rc == 0
    assert json.loads((out / "debiased_nli_train.json").read_text())["result"]["train_rows"] == 64


def test_the_bias_model_can_be_a_trained_hypothesis_only_classifier(tmp_path, snli_small):
    train = snli_small[0].select(range(40))
    folder = make_tiny_bert(tmp_path / "hyp", list(train["hypothesis"]), head=True,
                            id2label={0: "neutral", 1: "contradiction", 2: "entailment"})
    logb, info = bias_log_probabilities(train, get_task("snli"), str(folder), progress=False)
    assert info["method"] == "transformers" and logb.shape == (40, 3)
    np.testing.assert_allclose(np.exp(logb).sum(axis=1), 1.0, atol=1e-5)


# ------------------------------------------------------------------ the paper's values (Tables 9 and 10)

def test_poe_presets_are_table_10():
    from debiased_nli.models.training import POE_PRESETS, poe_preset

    assert poe_preset("snli")[:2] == (2.0, 0.4) and poe_preset("seq-z-snli")[:2] == (2.0, 0.4)
    assert [POE_PRESETS[k][:2] for k in ("mnli-m-hard", "mnli-mm-hard", "mnli-hans")] == [(0.8, 1.0), (2.0, 0.4),
                                                                                       (2.0, 0.8)]
    assert [POE_PRESETS[k][:2] for k in ("z-aug-mnli-m-hard", "z-aug-mnli-mm-hard", "z-aug-mnli-hans")] == [
        (2.0, 0.4), (2.0, 0.8), (2.0, 1.0)]
    assert "Table 10" in poe_preset("snli")[2] and "SNLI-hard" in poe_preset("snli")[2]
    with pytest.raises(ConfigError, match="Did you mean 'snli'"):
        poe_preset("snil")


def _parse_train(argv):
    from debiased_nli.cli import build_parser
    from debiased_nli.cli.commands.train import config_from_args

    return config_from_args(build_parser().parse_args(["train", "snli", "--model", "m", "--out", "o", *argv]))


def test_train_preset_paper_is_table_9_and_says_so():
    cfg, sources = _parse_train(["--preset", "paper", "--epochs", "2"])
    assert (cfg.learning_rate, cfg.batch_size, cfg.adam_epsilon, cfg.adam_betas) == (1e-5, 32, 1e-6, (0.9, 0.999))
    assert (cfg.lr_scheduler, cfg.warmup_steps, cfg.max_length, cfg.weight_decay) == ("constant_with_warmup", 2000,
                                                                                      128, 0.0)
    assert cfg.early_stopping_patience == 3 and cfg.eval_steps is None  # patience in epochs
    assert 'Table 9: "warm up steps 2000"' in sources["warmup_steps"]
    assert cfg.epochs == 2 and sources["epochs"].startswith("given")  # an explicit option wins
    plain, plain_sources = _parse_train([])
    assert (plain.epochs, plain.lr_scheduler, plain.warmup_ratio) == (3.0, "linear", 0.1)
    assert "project's choice" in plain_sources["epochs"] and "Table 9" in plain_sources["learning_rate"]
    poe, poe_sources = _parse_train(["--poe-preset", "snli"])
    assert poe.poe and (poe.poe_beta, poe.poe_gamma, poe.bias_model) == (2.0, 0.4, "joint")
    assert "Table 10" in poe_sources["poe_gamma"]
    fixed, _ = _parse_train(["--poe-preset", "snli", "--bias-model", "tfidf"])
    assert fixed.bias_model == "tfidf" and fixed.poe_gamma == 0.4


def test_joint_bias_head_learns_from_gamma_and_sends_no_gradient_into_the_encoder(tmp_path, snli_small):
    # Karimi Mahabadi et al. (2020): the bias-only head reads the encoder's hypothesis encoding through
    # grad_mul_const(., 0.0); gamma * CE(b, y) trains the head and nothing else
    from debiased_nli.models.training import _joint_poe_class

    train = snli_small[0].select(range(8))
    folder = make_tiny_bert(tmp_path / "enc", list(train["premise"]) + list(train["hypothesis"]))
    tok, model = load_model_for_task(str(folder), get_task("snli"))
    joint = _joint_poe_class()(model, 3)
    joint.eval()  # no dropout: the two passes below see the same network
    enc = tokenize_pairs(train, tok, 32, hypothesis_only=True)
    batch = PairCollator(tok)([dict(enc[i]) for i in range(len(enc))])
    labels = batch.pop("labels")

    def grads(beta, gamma):
        joint.zero_grad()
        out = joint(**batch)
        poe_loss(out.logits, torch.log_softmax(out["bias_logits"], -1), labels, beta, gamma).backward()
        return ({n: p.grad.clone() for n, p in joint.model.named_parameters() if p.grad is not None},
                joint.bias_head.weight.grad)

    enc_ce, head_none = grads(0.0, 0.0)     # beta = gamma = 0: plain CE of the main model
    enc_gamma, head_gamma = grads(0.0, 0.4)  # + gamma * CE(b, y)
    assert head_none is None or head_none.abs().sum() == 0
    assert head_gamma.abs().sum() > 0         # gamma now has a gradient: it trains the head
    assert enc_ce.keys() == enc_gamma.keys()
    for n in enc_ce:                          # ...and only the head
        torch.testing.assert_close(enc_ce[n], enc_gamma[n])
    _, head_beta = grads(2.0, 0.0)           # the ensemble term trains the head too (it is not detached)
    assert head_beta.abs().sum() > 0


def test_poe_training_with_the_joint_bias_head_saves_the_main_model_alone(tiny_encoder, snli_small, tmp_path):
    from transformers import AutoModelForSequenceClassification

    train, dev = snli_small
    cfg = TrainConfig(model=str(tiny_encoder), output_dir=str(tmp_path / "joint"), learning_rate=1e-3,
                      batch_size=32, max_length=48, epochs=1, seed=1, progress=False, use_cpu=True,
                      poe=True, poe_beta=2.0, poe_gamma=0.4, bias_model="joint")
    result = train_classifier(cfg, "snli", train, dev)
    assert result.bias_model["method"] == "joint-hypothesis-only-head" and result.bias_model["gamma"] == 0.4
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "joint" / "model.safetensors")).keys()
    assert "classifier.weight" in keys and not any("bias_head" in k for k in keys)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "joint")
    assert model.config.id2label == {0: "entailment", 1: "neutral", 2: "contradiction"}


def test_a_rotated_hypothesis_only_bias_model_gives_the_same_task_ordered_probabilities(tmp_path, snli_small):
    # hypothesis_only.transformer_predictions gathers the head's outputs into the task's order by name
    train = snli_small[0].select(range(30))
    base = make_tiny_bert(tmp_path / "hyp", list(train["hypothesis"]), head=True,
                          id2label={0: "entailment", 1: "neutral", 2: "contradiction"})
    rotated = _rotated_copy(base, tmp_path / "hyp_rot", {0: "contradiction", 1: "entailment", 2: "neutral"})
    a, _ = bias_log_probabilities(train, get_task("snli"), str(base), progress=False)
    b, _ = bias_log_probabilities(train, get_task("snli"), str(rotated), progress=False)
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert not np.allclose(a[:, [1, 2, 0]], a, atol=1e-3)  # the rotation would show if it were mishandled
