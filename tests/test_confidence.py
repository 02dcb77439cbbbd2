"""Confidence filtering: keep a row when the NLI model M gives its label probability > tau."""
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from debiased_nli.methods.confidence import confidence_filter, confidence_report
from debiased_nli.data.loading import new_rows
from debiased_nli.data.tasks import get_task
from debiased_nli.utils.errors import ConfigError

SNLI = get_task("snli")

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
NAMES = ["entailment", "neutral", "contradiction"]


def make_model(path, id2label):
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification
    tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
    tok.pad_token = tok.eos_token
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=128, vocab_size=len(tok), num_labels=len(id2label),
                     id2label=id2label, label2id={v: k for k, v in id2label.items()}, pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    m = GPT2ForSequenceClassification(cfg)
    with torch.no_grad():
        m.score.weight.mul_(300)  # spread the probabilities so that some pass a high tau
    m.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rows():
    prem = ["A dog runs.", "Two men play chess outside.", "A girl eats.", "People wait for a bus.", "A cat sleeps."] * 4
    hyp = ["An animal moves.", "Nobody plays.", "A child eats fruit quickly.", "Someone sleeps.", "The cat naps."] * 4
    return new_rows("snli", prem, hyp, [NAMES[i % 3] for i in range(20)], origin="generated", method="generator:test")


def reference_probs(folder, ds):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    m, t = AutoModelForSequenceClassification.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    out = []
    with torch.no_grad():
        for p, h in zip(ds["premise"], ds["hypothesis"]):  # one at a time: no padding at all
            out.append(torch.softmax(m(**t(p, h, return_tensors="pt")).logits[0], -1).numpy())
    return np.array(out)


def test_keeps_rows_whose_label_probability_is_above_tau(rows, tmp_path):
    model = make_model(tmp_path / "m", {0: "entailment", 1: "neutral", 2: "contradiction"})
    probs = reference_probs(model, rows)
    conf = probs[np.arange(len(rows)), rows["label"]]
    tau = float(np.median(conf))
    kept, rejected = confidence_filter(rows, model, SNLI, tau=tau, batch_size=7, progress=False)
    assert len(kept) + len(rejected) == len(rows) and len(kept) > 0 and len(rejected) > 0
    assert all(c > tau for c in kept["confidence"]) and all(c <= tau for c in rejected["confidence"])
    by_uid = dict(zip(rows["uid"], conf))
    for d in (kept, rejected):
        for uid, c in zip(d["uid"], d["confidence"]):
            assert c == pytest.approx(by_uid[uid], abs=1e-5)  # batched with padding == one at a time
    assert set(rejected["rejected_by"]) == {f"confidence<={tau}"}
    assert kept.column_names[:6] == ["premise", "hypothesis", "label", "uid", "origin", "method"]
    rep = confidence_report(kept, rejected, get_task("snli"), tau)
    assert rep["acceptance_rate"] == pytest.approx(len(kept) / 20, abs=1e-4)
    assert sum(v["kept"] for v in rep["per_label"].values()) == len(kept)


def test_model_outputs_are_matched_to_the_task_labels_by_name(rows, tmp_path):
    plain = make_model(tmp_path / "a", {0: "entailment", 1: "neutral", 2: "contradiction"})
    # the same weights with the output rows permuted and named accordingly
    from transformers import AutoModelForSequenceClassification
    m = AutoModelForSequenceClassification.from_pretrained(plain)
    perm = [2, 0, 1]  # output i of the new model is output perm[i] of the old one
    with torch.no_grad():
        m.score.weight.copy_(m.score.weight[perm])
    m.config.id2label = {i: NAMES[perm[i]] for i in range(3)}
    m.config.label2id = {v: k for k, v in m.config.id2label.items()}
    m.save_pretrained(tmp_path / "b")
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(plain).save_pretrained(tmp_path / "b")
    k1, r1 = confidence_filter(rows, plain, SNLI, tau=0.5, progress=False)
    k2, r2 = confidence_filter(rows, str(tmp_path / "b"), SNLI, tau=0.5, progress=False)
    assert k1["uid"] == k2["uid"]
    np.testing.assert_allclose(list(k1["confidence"]) + list(r1["confidence"]), list(k2["confidence"]) + list(r2["confidence"]), atol=1e-5)


def test_a_model_whose_labels_are_not_the_tasks_is_refused(rows, tmp_path):
    wrong = make_model(tmp_path / "w", {0: "positive", 1: "negative", 2: "neutral"})
    with pytest.raises(ConfigError, match="no output named 'entailment'"):
        confidence_filter(rows, wrong, SNLI, progress=False)
    two = make_model(tmp_path / "t", {0: "entailment", 1: "not_entailment"})
    with pytest.raises(ConfigError, match="2 labels"):
        confidence_filter(rows, two, SNLI, progress=False)


def test_cli_writes_kept_rejected_and_report(rows, tmp_path):
    import json
    from debiased_nli.cli import main
    model = make_model(tmp_path / "m", {0: "entailment", 1: "neutral", 2: "contradiction"})
    rows.to_parquet(str(tmp_path / "gen.parquet"))
    assert main(["confidence-filter", "snli", "--data-files", str(tmp_path / "gen.parquet"), "--model", model,
                 "--tau", "0.6", "--out", str(tmp_path / "out")]) == 0
    rep = json.loads((tmp_path / "out" / "confidence_report.json").read_text())
    import datasets
    kept = datasets.Dataset.from_parquet(str(tmp_path / "out" / "kept.parquet"))
    assert rep["kept"] == len(kept) and rep["rows"] == 20 and "confidence" in kept.column_names


# --- tau_rule min_kept: the tau chosen from M's acceptance curve (was benchmarks/seqz_cpu.py's choose_tau)

def test_acceptance_curve_counts_rows_strictly_above_tau():
    from debiased_nli.methods.confidence import acceptance_curve
    curve = acceptance_curve([0.5, 0.7, 0.96, 0.99, 0.999], taus=(0.5, 0.95, 0.99))
    assert curve == [{"tau": 0.5, "kept": 4, "rate": 0.8}, {"tau": 0.95, "kept": 3, "rate": 0.6},
                     {"tau": 0.99, "kept": 1, "rate": 0.2}]


def test_the_given_tau_unless_it_keeps_too_few_rows():
    from debiased_nli.methods.confidence import DEFAULT_TAUS, choose_tau

    def curve(kept):
        return [{"tau": t, "kept": k, "rate": None} for t, k in zip(DEFAULT_TAUS, kept)]
    assert choose_tau(curve([9000, 8000, 7000, 6000, 5000, 100])) == (0.95, None)
    tau, note = choose_tau(curve([9000, 8000, 6000, 4000, 3000, 100]))
    assert tau == 0.8 and "largest" in note and "3,000 rows at tau 0.95" in note
    tau, note = choose_tau(curve([900, 800, 700, 600, 500, 100]))
    assert tau == 0.5 and "no tau" in note
    with pytest.raises(ConfigError, match="acceptance curve"):
        choose_tau([])


def test_a_tau_that_keeps_no_row_of_one_label_is_passed_over():
    """The 60k CPU run: M is never 0.95-sure of a neutral sample (7,500 kept, none neutral)."""
    from debiased_nli.methods.confidence import acceptance_curve, choose_tau
    conf = [0.96, 0.96, 0.91, 0.93, 0.93, 0.81, 0.85, 0.6]
    lab = [0, 2, 0, 1, 2, 1, 1, 1]
    curve = acceptance_curve(conf, taus=(0.5, 0.8, 0.9, 0.95), labels=lab, label_names=NAMES)
    assert curve[3] == {"tau": 0.95, "kept": 2, "rate": 0.25,
                        "kept_by_label": {"entailment": 1, "neutral": 0, "contradiction": 1}}
    assert curve[1]["kept_by_label"] == {"entailment": 2, "neutral": 3, "contradiction": 2}
    tau, note = choose_tau(curve, min_kept=3)    # every label needs >= 1 row
    assert tau == 0.9 and "neutral 0" in note and ">= 1 of every label" in note
    tau, note = choose_tau(curve, min_kept=6)    # >= 2 of every label: only 0.8 and 0.5; the largest
    assert tau == 0.8 and "(7 rows" in note
    assert choose_tau(curve, tau=0.9, min_kept=2) == (0.9, None)


def test_split_at_tau_is_the_filter_s_own_cut(rows, tmp_path):
    """Scoring once and cutting at two taus gives what two filter runs give, reasons included."""
    from debiased_nli.methods.confidence import score_confidence, split_at_tau
    model = make_model(tmp_path / "m", {0: "entailment", 1: "neutral", 2: "contradiction"})
    scored = score_confidence(rows, model, SNLI, progress=False)
    conf = np.asarray(scored["confidence"])
    for tau in (float(np.median(conf)), float(np.quantile(conf, 0.25))):
        kept, rejected = split_at_tau(scored, tau)
        k2, r2 = confidence_filter(rows, model, SNLI, tau=tau, progress=False)
        assert kept.to_dict() == k2.to_dict() and rejected.to_dict() == r2.to_dict()
        assert set(rejected["rejected_by"]) == {f"confidence<={tau}"}
        again = split_at_tau(rejected, 0.0)  # a rejected set cut again: its old reason is replaced
        assert set(again[1]["rejected_by"]) <= {"confidence<=0.0"}
    with pytest.raises(ConfigError, match="'confidence'"):
        split_at_tau(rows, 0.5)


def test_the_step_chooses_tau_by_the_min_kept_rule_and_says_why(rows, tmp_path):
    from debiased_nli.methods.generation.step import confidence_filter_step
    model = make_model(tmp_path / "m", {0: "entailment", 1: "neutral", 2: "contradiction"})
    fixed = confidence_filter_step(rows, get_task("snli"), {"model": model, "tau": 0.95, "progress": False})
    assert fixed[2]["tau"] == 0.95 and "acceptance_curve" not in fixed[2]
    kept, rejected, report = confidence_filter_step(rows, get_task("snli"), {
        "model": model, "tau": 0.99, "tau_rule": "min_kept", "taus": [0.0, 0.3], "min_kept": 3, "progress": False})
    curve = {c["tau"]: c for c in report["acceptance_curve"]}
    assert sorted(curve) == [0.0, 0.3, 0.99] and report["tau_given"] == 0.99
    ok = [t for t, c in curve.items() if c["kept"] >= 3 and min(c["kept_by_label"].values()) >= 1]
    assert report["tau"] == max(ok) and len(kept) == curve[report["tau"]]["kept"]
    assert (report["tau_note"] is None) == (report["tau"] == 0.99)
    assert len(kept) + len(rejected) == len(rows)
    with pytest.raises(ConfigError, match="taus"):
        confidence_filter_step(rows, get_task("snli"), {"model": model, "tau_rule": "min_kept", "taus": [1.5]})
    with pytest.raises(ConfigError, match="tau_rule"):
        confidence_filter_step(rows, get_task("snli"), {"model": model, "tau_rule": "largest"})
    with pytest.raises(ConfigError, match="Did you mean .min_kept."):
        confidence_filter_step(rows, get_task("snli"), {"model": model, "min_keep": 3})
