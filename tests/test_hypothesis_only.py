"""The hypothesis-only model: out-of-fold by default, or a fine-tuned classifier run on the hypothesis."""
import numpy as np
import pytest
import torch

from debiased_nli.utils.errors import ConfigError
from debiased_nli.data.tasks import get_task
from debiased_nli.models.labels import map_model_labels
from debiased_nli.bias.hypothesis_only import transformer_predictions
from test_embeddings import GPT2_TOKENIZER


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory):
    """A tiny BERT classifier whose outputs are in another order than the task's labels."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("tiny-clf")
    tok = AutoTokenizer.from_pretrained(str(GPT2_TOKENIZER))
    tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, num_labels=3, pad_token_id=tok.pad_token_id,
                     id2label={0: "contradiction", 1: "entailment", 2: "neutral"},
                     label2id={"contradiction": 0, "entailment": 1, "neutral": 2})
    BertForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_model_outputs_are_mapped_onto_the_task_labels(tiny_classifier):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hyps = ["Nobody is sleeping.", "A man is outside.", "The dog plays with a ball in the park."]
    res = transformer_predictions(tiny_classifier, hyps, np.array([2, 0, 1]),
                                  ["entailment", "neutral", "contradiction"], batch_size=2, progress=False)
    tok = AutoTokenizer.from_pretrained(tiny_classifier)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier).eval()
    with torch.no_grad():
        raw = torch.softmax(model(**tok(hyps[2:], return_tensors="pt")).logits, -1)[0].numpy()
    # task order (entailment, neutral, contradiction) = model outputs (1, 2, 0)
    np.testing.assert_allclose(res.probabilities[2], raw[[1, 2, 0]], atol=1e-5)
    assert res.predictions.tolist() == res.probabilities.argmax(1).tolist()
    assert res.method == "transformers"


def test_label_order_mismatch_is_refused_clearly():
    assert map_model_labels({0: "LABEL_0", 1: "LABEL_1"}, ["no", "yes"]) == [0, 1]
    with pytest.raises(ConfigError, match="has 2 labels"):
        map_model_labels({0: "a", 1: "b"}, ["entailment", "neutral", "contradiction"])
    with pytest.raises(ConfigError, match="no output named 'neutral'"):
        map_model_labels({0: "entailment", 1: "maybe", 2: "contradiction"}, ["entailment", "neutral", "contradiction"])


def test_the_tfidf_models_logistic_regressions_converge(shared_data):
    # Newton-CG runs to a gradient far below the decision margin (1e-10) in a few Newton steps, well
    # before its step cap; the out-of-fold accuracy is that of the 20k sample's model
    from debiased_nli.data.loading import labels_of, load_task
    from debiased_nli.bias.task_features import featurize_build
    from debiased_nli.bias.hypothesis_only import LOGREG_SOLVER, out_of_fold_tfidf

    d0 = load_task("snli", data_files=str(shared_data / "snli/train_sample.parquet"), max_rows=6000).dataset
    fm = featurize_build(d0, None, get_task("snli"), hypothesis_only=None, progress=False).d0
    result, full = out_of_fold_tfidf(fm, labels_of(d0), 3, seed=0, full_model=True, progress=False)
    assert result.params["solver"] == LOGREG_SOLVER["solver"] and result.params["converged"]
    assert full.clf.info_["converged"] and full.clf.info_["max_abs_gradient"] <= LOGREG_SOLVER["tol"] == 1e-10
    assert max(result.params["newton_steps"]) <= 10 < LOGREG_SOLVER["max_iter"]
    assert 0.5 < result.accuracy < 0.7
    # the full model's predictions are its logits' argmax (no ties here), the same as predict_proba's
    np.testing.assert_array_equal(full.predict(fm), full.predict_proba(fm).argmax(1))
