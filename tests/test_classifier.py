"""The one classifier loader and prediction loop (debiased_nli/models/classifier.py, issue 33's twins).

Confidence filtering, IBADR's bias degree, PDD's teacher (padded engine) and the hypothesis-only classifier
each had a softmax-over-batches loop of their own; they now call :func:`predict_probabilities`. The loops
they had are copied here as they were, and the one loop must give the same probabilities to the last bit
where the batches are the same (which rows share a batch is each caller's, kept as it was).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from debiased_nli.data.loading import new_rows
from debiased_nli.data.tasks import get_task
from debiased_nli.models.classifier import LoadedClassifier, load_classifier, predict_probabilities
from debiased_nli.utils.errors import ConfigError
from test_training import make_tiny_bert

SNLI = get_task("snli")

LABELS = ("entailment", "neutral", "contradiction")
MODEL_ORDER = {0: "contradiction", 1: "entailment", 2: "neutral"}  # not the task's: columns are matched by name
PREMISES = ["A dog runs.", "Two men play chess outside in the park on a sunny day.", "A girl eats.",
            "People wait for a bus that is late again this morning.", "A cat sleeps.", "Someone sings loudly.",
            "An old woman reads a very long book by the window.", "Kids."] * 3
HYPOTHESES = ["An animal moves.", "Nobody plays.", "A child eats fruit quickly while walking home.", "Someone sleeps.",
              "The cat naps on the warm sofa next to the dog.", "A person sings.", "A man swims.", "Children play."] * 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = make_tiny_bert(tmp_path_factory.mktemp("clf") / "m", PREMISES + HYPOTHESES, head=True, id2label=MODEL_ORDER)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        model.classifier.weight.mul_(40)  # spread the probabilities
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rows():
    labels = [LABELS[i % 3] for i in range(len(PREMISES))]
    return new_rows("snli", PREMISES, HYPOTHESES, labels, origin="generated", method="generator:test")


def _loaded(folder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    return AutoModelForSequenceClassification.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def _task_order(model):
    names = {int(i): l for i, l in model.config.id2label.items()}
    return [next(i for i, l in names.items() if l == name) for name in LABELS]


# ---- the loops as they were before the fold -----------------------------------------------------------

def old_confidence_loop(premises, hypotheses, model, tokenizer, batch_size, max_length):
    """methods/confidence.py's label_probabilities: batches in input order, padded by the tokenizer."""
    order = _task_order(model)
    out = []
    with torch.no_grad():
        for start in range(0, len(premises), batch_size):
            enc = tokenizer(list(premises[start:start + batch_size]), list(hypotheses[start:start + batch_size]),
                            truncation=True, max_length=max_length, padding=True, return_tensors="pt")
            out.append(torch.softmax(model(**enc).logits.float(), -1)[:, order].cpu().numpy())
    return np.concatenate(out)


def old_teacher_loop(premises, hypotheses, model, tokenizer, batch_size, max_length):
    """methods/pdd/teacher.py's padded engine: batches in order of character length."""
    order = _task_order(model)
    n = len(premises)
    out = np.zeros((n, len(order)), dtype=np.float64)
    rows = sorted(range(n), key=lambda i: len(premises[i]) + len(hypotheses[i]))
    with torch.no_grad():
        for s in range(0, n, batch_size):
            idx = rows[s:s + batch_size]
            enc = tokenizer([premises[i] for i in idx], [hypotheses[i] for i in idx], truncation=True,
                            max_length=max_length, padding=True, return_tensors="pt")
            out[idx] = torch.softmax(model(**enc).logits.float(), -1)[:, order].cpu().numpy()
    return out


def old_hypothesis_only_loop(hypotheses, model, tokenizer, batch_size, max_length):
    """bias/hypothesis_only.py's transformer_predictions: the hypothesis alone, batches in input order."""
    order = _task_order(model)
    out = []
    with torch.no_grad():
        for start in range(0, len(hypotheses), batch_size):
            enc = tokenizer(list(hypotheses[start:start + batch_size]), truncation=True, max_length=max_length,
                            padding=True, return_tensors="pt")
            out.append(torch.softmax(model(**enc).logits.float(), -1)[:, order].cpu().numpy())
    return np.concatenate(out)


# ---- the one loop gives what they gave ------------------------------------------------------------------

@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("batch_size,max_length", [(5, 128), (7, 12)])  # 12 tokens: truncation
def test_the_one_loop_gives_each_old_loops_probabilities_bit_for_bit(folder, padding_side, batch_size, max_length):
    model, tok = _loaded(folder)
    tok.padding_side = padding_side
    clf = load_classifier(model, "cpu", tokenizer=tok)
    n = len(PREMISES)
    new = predict_probabilities(clf, PREMISES, HYPOTHESES, batch_size=batch_size, max_length=max_length,
                                order=range(n), labels=LABELS, progress=False)
    np.testing.assert_array_equal(new, old_confidence_loop(PREMISES, HYPOTHESES, model, tok, batch_size, max_length))
    by_chars = sorted(range(n), key=lambda i: len(PREMISES[i]) + len(HYPOTHESES[i]))
    new = predict_probabilities(clf, PREMISES, HYPOTHESES, batch_size=batch_size, max_length=max_length,
                                order=by_chars, labels=LABELS, progress=False)
    np.testing.assert_array_equal(new, old_teacher_loop(PREMISES, HYPOTHESES, model, tok, batch_size, max_length))
    new = predict_probabilities(clf, None, HYPOTHESES, batch_size=batch_size, max_length=max_length,
                                order=range(n), labels=LABELS, progress=False)
    np.testing.assert_array_equal(new, old_hypothesis_only_loop(HYPOTHESES, model, tok, batch_size, max_length))


def test_each_caller_gives_its_old_loops_probabilities_bit_for_bit(folder, rows):
    from debiased_nli.bias.hypothesis_only import transformer_predictions
    from debiased_nli.methods.confidence import confidence_filter
    from debiased_nli.methods.ibadr.shallow import bias_degree
    from debiased_nli.methods.pdd.teacher import Teacher

    model, tok = _loaded(folder)
    ref = old_confidence_loop(rows["premise"], rows["hypothesis"], model, tok, 7, 128)
    gold = ref[np.arange(len(rows)), rows["label"]]
    kept, rejected = confidence_filter(rows, folder, SNLI, tau=0.5, batch_size=7, device="cpu", progress=False)
    by_uid = dict(zip(rows["uid"], gold.astype(np.float64).tolist()))
    assert {u: c for d in (kept, rejected) for u, c in zip(d["uid"], d["confidence"])} == by_uid
    assert len(kept) and len(rejected)
    np.testing.assert_array_equal(bias_degree(rows, folder, get_task("snli"), batch_size=7, progress=False), gold)
    teacher = Teacher(folder, LABELS, batch_size=4, device="cpu", engine="padded")
    np.testing.assert_array_equal(teacher.label_probs(PREMISES, HYPOTHESES),
                                  old_teacher_loop(PREMISES, HYPOTHESES, model, tok, 4, 128))
    res = transformer_predictions(folder, HYPOTHESES, np.zeros(len(HYPOTHESES), int), LABELS, batch_size=6,
                                  device="cpu", progress=False)
    np.testing.assert_array_equal(res.probabilities, old_hypothesis_only_loop(HYPOTHESES, model, tok, 6, 64))


def test_batches_by_length_move_the_probabilities_only_in_the_last_bits(folder):
    clf = load_classifier(folder, "cpu")
    n = len(PREMISES)
    by_length = predict_probabilities(clf, PREMISES, HYPOTHESES, batch_size=5, max_tokens=90, progress=False)
    in_order = predict_probabilities(clf, PREMISES, HYPOTHESES, batch_size=5, order=range(n), progress=False)
    np.testing.assert_allclose(by_length, in_order, atol=1e-5)
    with pytest.raises(ConfigError, match="max_tokens"):
        predict_probabilities(clf, PREMISES, HYPOTHESES, max_tokens=90, order=range(n), progress=False)


def test_one_loader_for_folders_loaded_models_and_loaded_classifiers(folder, tmp_path):
    clf = load_classifier(folder, "cpu")
    assert isinstance(clf, LoadedClassifier) and clf.id2label == MODEL_ORDER and clf.path == folder
    assert not clf.model.training and clf.device.type == "cpu"
    assert load_classifier(clf) is clf
    model, tok = _loaded(folder)
    given = load_classifier(model, "cpu", tokenizer=tok)
    assert given.model is model and given.tokenizer is tok and given.path == type(model).__name__
    with pytest.raises(ConfigError, match="tokenizer"):
        load_classifier(model)
    encoder = make_tiny_bert(tmp_path / "encoder", PREMISES)  # no classification head: refused, not random
    with pytest.raises(ConfigError, match="never trained"):
        load_classifier(str(encoder), "cpu")
    with pytest.raises(ConfigError, match="no such folder"):
        load_classifier(str(tmp_path / "missing"), "cpu")
