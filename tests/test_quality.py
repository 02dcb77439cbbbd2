"""Quality measures of generated rows (debiased_nli.methods.quality, `debiased-nli quality`), each against an
independent computation: copies by hand, near-duplicates against brute-force Jaccard, fluency against
unbatched log-probabilities, the ensemble and train-on-generated on a tiny encoder, the command end to end."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from debiased_nli.data.loading import load_task, new_rows
from debiased_nli.data.tasks import get_task
from debiased_nli.methods import quality as Q
from debiased_nli.utils.errors import ConfigError

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))


@pytest.fixture(scope="module")
def d0(shared_data):
    return load_task("snli", data_files=str(shared_data / "snli" / "train_sample.parquet"), max_rows=400).dataset


def generated_like(d0, n=60, seed=0):
    """Rows that copy, nearly copy, or are new: a known mix."""
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(d0))[:n]
    prem, hyp, lab = [], [], []
    for j, i in enumerate(idx):
        p, h, l = d0[int(i)]["premise"], d0[int(i)]["hypothesis"], ["entailment", "neutral", "contradiction"][d0[int(i)]["label"]]
        if j % 3 == 0:      # an exact copy, up to case and the final period
            prem.append(p.upper().rstrip(".")), hyp.append(h + " "), lab.append(l)
        elif j % 3 == 1:    # the hypothesis with one word changed: a near-duplicate pair
            w = h.split()
            w[-1] = "today"
            prem.append(p), hyp.append(" ".join(w)), lab.append(l)
        else:               # new text
            prem.append(f"Robot number {j} assembles a violin in orbit."), hyp.append("A machine builds."), lab.append(l)
    return new_rows("snli", prem, hyp, lab, origin="generated", method="generator:test")


def test_copies_count_normalised_pairs_hypotheses_and_premises(d0):
    rows = generated_like(d0)
    c = Q.copies(rows, d0)
    assert c["pair_copies"] == 20 and c["pair_copy_share"] == pytest.approx(20 / 60)
    assert c["premise_copy_share"] == pytest.approx(40 / 60)  # copies and the near-duplicates keep D0's premise
    assert c["pair_copy_mask"][::3].all() and not c["pair_copy_mask"][1::3].any()
    assert Q.normalize("  A  Dog runs!! ") == Q.normalize("a dog runs")


def brute_jaccard(a, b):
    sa, sb = Q._shingles(a), Q._shingles(b)
    return len(sa & sb) / len(sa | sb)


def test_near_duplicates_match_brute_force_jaccard_above_the_threshold(d0):
    rows = generated_like(d0)
    texts, ref = Q.pair_texts(rows), Q.pair_texts(d0)
    r = Q.near_duplicates(texts, ref, seed=3)
    exact = np.array([max(brute_jaccard(t, u) for u in ref) for t in texts])
    hit = exact >= Q.NEAR_DUP_JACCARD
    assert (r["mask"] == hit).all()  # LSH finds every pair at >= 0.8 (P(miss) < 1e-4 each) and no false one
    np.testing.assert_allclose(r["max_jaccard"][hit], exact[hit])
    assert hit[::3].all() and r["near_duplicates"] >= 20
    within = Q.near_duplicates(texts + texts[:5], seed=3)  # five rows twice
    assert within["mask"][:5].all() and within["mask"][-5:].all()


def test_fluency_is_the_unbatched_mean_token_log_probability():
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=64, vocab_size=len(tok))).eval()
    texts = ["A dog runs in the park.", "Two men.", "A woman in a red hat sells fruit at a market stall today."]
    got = Q.fluency_scores(texts, lm, tokenizer=tok, batch_size=2, device="cpu", progress=False)
    for t, g in zip(texts, got):
        ids = torch.tensor([[tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(lm(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert g == pytest.approx(lp.mean().item(), abs=1e-4)
    s = Q.fluency_summary(np.array([-1.0, -9.0]), np.linspace(-5, -1, 101))
    assert s["bound"] == pytest.approx(-4.8) and s["under_bound_share"] == 0.5
    with pytest.raises(ConfigError, match="real rows"):
        Q.fluency_summary(np.array([1.0]), np.array([]))


def test_the_ensemble_and_train_on_generated_on_a_tiny_encoder(d0, tmp_path, shared_data):
    from test_training import make_tiny_bert

    rows = generated_like(d0, n=30)
    heldout = load_task("snli", "validation", data_files=[f"validation={shared_data / 'snli' / 'dev.parquet'}"],
                        max_rows=40).dataset
    enc = make_tiny_bert(tmp_path / "enc", list(d0["premise"]) + list(d0["hypothesis"]) + list(rows["premise"])
                         + list(rows["hypothesis"]) + list(heldout["premise"]) + list(heldout["hypothesis"]))
    snli, fit = get_task("snli"), Q.Classifiers(str(enc), epochs=1)
    ag = Q.cross_fitted_agreement(rows, d0, snli, fit, str(tmp_path / "ens"), k=2, progress=False)
    assert ag["rows"] == 30 and 0 <= ag["agreement"] <= 1 and 0 <= ag["d0_agreement_cross_fitted"] <= 1
    assert len(ag["ensemble_label"]) == 30
    (folder,) = (tmp_path / "ens").iterdir()  # named after what the ensemble depends on, D0's rows among them
    assert folder.name.endswith(Q.rows_fingerprint(d0)) and sorted(p.name for p in folder.iterdir()) == ["fold-0", "fold-1"]
    tg = Q.train_on_generated(rows, d0, heldout, snli, fit, str(tmp_path / "tog"), n=30, seeds=(0,), progress=False)
    assert tg["n"] == 30 and tg["ratio"] == pytest.approx(tg["generated_accuracy"] / tg["real_accuracy"], rel=1e-5)
    with pytest.raises(ConfigError, match="between 1"):
        Q.train_on_generated(rows, d0, heldout, snli, fit, str(tmp_path / "x"), n=31)


def test_the_quality_command_writes_its_report_and_refuses_a_users_folder(d0, tmp_path):
    rows = generated_like(d0)
    rows.to_parquet(str(tmp_path / "gen.parquet"))
    d0.to_parquet(str(tmp_path / "d0.parquet"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "debiased_nli.cli", "quality", "snli", "--data-files", str(tmp_path / "gen.parquet"),
           "--reference", str(tmp_path / "d0.parquet"), "--quiet"]
    r = subprocess.run([*cmd, "--out", str(tmp_path / "q")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "q" / "quality.json").read_text())
    assert rep["copies"]["pair_copies"] == 20 and rep["near_duplicates"]["near_duplicates"] >= 20
    assert len(rep["examples"]) == 20 and "| premise | hypothesis | label |" in (tmp_path / "q" / "quality.md").read_text()
    scores = pq.read_table(tmp_path / "q" / "scores.parquet")
    assert scores.num_rows == 60
    assert scores.column("source_uid").to_pylist() == rows["uid"]  # the rows' own uids, in their order
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    r = subprocess.run([*cmd, "--out", str(mine)], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "not a quality report written by" in r.stderr and (mine / "notes.txt").read_text() == "mine"


def test_pair_near_duplicates_match_brute_force_on_both_fields(d0, shared_data):
    rows = generated_like(d0)
    r = Q.pair_near_duplicates(rows["premise"], rows["hypothesis"], d0["premise"], d0["hypothesis"], seed=3)
    for i, (p, h) in enumerate(zip(rows["premise"], rows["hypothesis"])):  # brute force over every D0 row
        best = max(min(brute_jaccard(h, rh), brute_jaccard(p, rp)) for rp, rh in zip(d0["premise"], d0["hypothesis"]))
        assert r["mask"][i] == (best >= 0.8), (i, p, h, best)
        if best >= 0.8:
            assert r["max_jaccard"][i] == pytest.approx(best)
    assert r["mask"][::3].all()  # the copies
    # SNLI's own rows under one premise with different hypotheses are not near-duplicates of each other,
    # though their joined texts are (dev rows 4 and 5: 0.83)
    dev = load_task("snli", data_files=str(shared_data / "snli" / "dev.parquet"), max_rows=6).dataset
    joined = Q.near_duplicates(Q.pair_texts(dev), seed=0)
    assert joined["mask"][3] or joined["mask"][4]
    pair = Q.pair_near_duplicates(dev["premise"], dev["hypothesis"], seed=0)
    assert not pair["mask"].any()
    # earlier_only keeps the first of a repeated row
    within = Q.pair_near_duplicates(list(rows["premise"]) * 2, list(rows["hypothesis"]) * 2, seed=0, earlier_only=True)
    n = len(rows)
    assert within["mask"][n:].all() and (within["match"][n:] < n).all()
    assert not within["mask"][:n][1::3].any()  # the near-duplicates of D0 rows are new among themselves


def test_every_set_is_measured_against_the_same_real_rows_and_their_fluency_is_kept(d0, tmp_path):
    """The real rows whose fluency sets the bound are drawn with --seed alone, whatever the size of the set
    measured, and their scores are kept under --models: two sets give one bound, the second run reuses the file."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=128, vocab_size=len(tok))).save_pretrained(
        tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    d0.to_parquet(str(tmp_path / "d0.parquet"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    bounds, cached = [], []
    for n in (60, 30):
        generated_like(d0, n=n).to_parquet(str(tmp_path / f"gen{n}.parquet"))
        r = subprocess.run([sys.executable, "-m", "debiased_nli.cli", "quality", "snli", "--data-files",
                            str(tmp_path / f"gen{n}.parquet"), "--reference", str(tmp_path / "d0.parquet"),
                            "--lm", str(tmp_path / "lm"), "--fluency-rows", "50", "--models", str(tmp_path / "m"),
                            "--out", str(tmp_path / f"q{n}"), "--quiet"], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        fl = json.loads((tmp_path / f"q{n}" / "quality.json").read_text())["fluency"]
        assert fl["real_rows"] == 50 and fl["scored_rows"] == min(n, 50)
        bounds.append(fl["bound"])
        cached.append({f.name: f.stat().st_mtime_ns for f in (tmp_path / "m" / "fluency").glob("real-*.npy")})
    assert bounds[0] == bounds[1]
    assert len(cached[0]) == 1 and cached[1] == cached[0]  # the second run read the first's scores


def test_the_command_trains_train_on_generated_for_its_own_epochs(d0, tmp_path, shared_data):
    """--tog-epochs: train-on-generated's classifiers for their own epochs (a few thousand rows), the cross-fitted
    ensemble for --epochs; each figure records its epochs, the report says them."""
    from test_training import make_tiny_bert

    rows = generated_like(d0, n=30)
    heldout = load_task("snli", "validation", data_files=[f"validation={shared_data / 'snli' / 'dev.parquet'}"],
                        max_rows=40).dataset
    enc = make_tiny_bert(tmp_path / "enc", list(d0["premise"]) + list(d0["hypothesis"]) + list(rows["premise"])
                         + list(rows["hypothesis"]) + list(heldout["premise"]) + list(heldout["hypothesis"]))
    for name, ds in (("gen", rows), ("d0", d0), ("dev", heldout)):
        ds.to_parquet(str(tmp_path / f"{name}.parquet"))
    r = subprocess.run([sys.executable, "-m", "debiased_nli.cli", "quality", "snli", "--data-files",
                        str(tmp_path / "gen.parquet"), "--reference", str(tmp_path / "d0.parquet"), "--heldout",
                        str(tmp_path / "dev.parquet"), "--classifier", str(enc), "--k", "2", "--n", "30", "--epochs",
                        "1", "--tog-epochs", "2", "--models", str(tmp_path / "m"), "--out", str(tmp_path / "q"),
                        "--quiet"], capture_output=True, text=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "q" / "quality.json").read_text())
    assert rep["agreement"]["epochs"] == 1 and rep["train_on_generated"]["epochs"] == 2
    assert sorted(p.name.split("-e")[1][:2] for p in (tmp_path / "m" / "tog").iterdir()) == ["2-", "2-"]
    assert [p.name[:5] for p in (tmp_path / "m" / "ensemble").iterdir()] == ["k2-e1"]
    assert "trained on 30 of these rows / of D0's (2 epochs)" in (tmp_path / "q" / "quality.md").read_text()


def test_pair_texts_reads_a_dataset_in_one_batch_and_respects_its_selection(d0):
    """A ``datasets.Dataset`` (also one behind an indices mapping, after ``select``) gives the texts of its own
    rows in order, the same as the row-by-row reading that the batch read replaced."""
    picked = d0.select([7, 3, 250, 3])
    by_row = [f"{picked[i]['premise']} {picked[i]['hypothesis']}" for i in range(len(picked))]
    assert Q.pair_texts(picked) == by_row
    assert Q.pair_texts({"premise": ["a", "b"], "hypothesis": ["c", "d"]}) == ["a c", "b d"]
