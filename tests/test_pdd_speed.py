"""PDD's faster paths give the straightforward paths' results (tiny models from a config, the demo task).

- encoder.PackedBert (no padding, last layer only where it is read) against the model's padded forward;
- the teacher's and the filler's engines against ``padded`` (the straightforward reference);
- the walk with the fast engines against the walk with ``padded``: the same output rows;
- the walk's teacher scores only the perturbations it applies, and identical texts once.
"""
import numpy as np
import pytest
import torch

from debiased_nli.data.loading import load_task
from debiased_nli.data.tasks import get_task
from debiased_nli.utils.errors import ConfigError
from debiased_nli.methods.pdd.algorithm import (Algorithm1, PairFeaturizer, PDDConfig, PDDState, Perturber,
                                                PerturbRequest)
from debiased_nli.methods.pdd.encoder import PackedBert, length_groups, supports
from debiased_nli.methods.pdd.fill import FillRequest, MaskFiller
from debiased_nli.methods.pdd.hypothesis_folds import HypothesisOnlyFolds
from debiased_nli.methods.pdd.masking import MASK
from debiased_nli.methods.pdd.run import run_pdd
from debiased_nli.methods.pdd.step import build_outputs, log_dataset
from debiased_nli.methods.pdd.teacher import Teacher
from pdd_helpers import LABELS, HashTeacher, NonceFiller, tiny_classifier, tiny_mlm, tiny_tokenizer

WORDS = {"entailment": "Yes", "neutral": "Maybe", "contradiction": "No"}


@pytest.fixture(scope="module")
def demo():
    return load_task("demo").dataset.shuffle(seed=7).select(range(300)).flatten_indices()


@pytest.fixture(scope="module")
def tok(demo):
    return tiny_tokenizer(list(demo["premise"]) + list(demo["hypothesis"]))


def test_length_groups_cover_every_sequence_once_with_exact_lengths_and_bounded_chunks():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=300).tolist() + [500]
    chunks = length_groups(lengths, max_tokens=256)
    seen = [i for chunk in chunks for group in chunk for i in group]
    assert sorted(seen) == list(range(len(lengths)))
    for chunk in chunks:
        for group in chunk:
            assert len({lengths[i] for i in group}) == 1 and group == sorted(group)
        tokens = sum(lengths[i] for group in chunk for i in group)
        assert tokens <= 256 or (len(chunk) == 1 and len(chunk[0]) == 1)
    assert length_groups([], 10) == []
    assert length_groups([3, 3, 3], 4) == [[[0]], [[1]], [[2]]]


def test_packed_encoder_equals_the_padded_forward_at_the_positions_read(tok, demo):
    model = tiny_classifier(tok)
    assert supports(model)
    P, H = list(demo["premise"][:23]), list(demo["hypothesis"][:23])
    enc = tok(P, H)
    rng = np.random.default_rng(1)
    positions = [sorted(rng.choice(len(s), size=min(len(s), int(rng.integers(1, 4))), replace=False).tolist())
                 for s in enc["input_ids"]]
    positions[0] = [0]
    got = PackedBert(model, max_tokens=64).hidden_at(enc["input_ids"], enc.get("token_type_ids"), positions)
    with torch.no_grad():
        pad = tok(P, H, padding=True, return_tensors="pt")
        full = model.bert(**pad).last_hidden_state
    want = torch.cat([full[i, p] for i, p in enumerate(positions)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_packed_is_refused_for_a_model_it_does_not_support(tok):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    gpt = GPT2ForSequenceClassification(GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=len(tok), bos_token_id=0, eos_token_id=0, pad_token_id=0,
        num_labels=3, id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)}))
    assert not supports(gpt)
    with pytest.raises(ValueError, match="not a BERT encoder"):
        PackedBert(gpt)
    with pytest.raises(ConfigError, match="packed teacher engine"):
        Teacher(gpt, LABELS, tokenizer=tok, engine="packed")
    with pytest.raises(ConfigError, match="unknown teacher engine"):
        Teacher(tiny_classifier(tok), LABELS, tokenizer=tok, engine="fast")
    with pytest.raises(ConfigError, match="unknown fill engine"):
        MaskFiller(tiny_mlm(tok), tok, engine="fast")


@pytest.mark.parametrize("engine", ["packed", "bucketed"])
def test_teacher_engines_equal_the_padded_reference(tok, demo, engine):
    model = tiny_classifier(tok, labels=("contradiction", "entailment", "neutral"), seed=3)
    P, H = list(demo["premise"][:50]), list(demo["hypothesis"][:50])
    ref = Teacher(model, LABELS, tokenizer=tok, batch_size=8, engine="padded").label_probs(P, H)
    fast = Teacher(model, LABELS, tokenizer=tok, batch_size=8, engine=engine)
    assert fast.engine == engine
    got = fast.label_probs(P, H)
    np.testing.assert_allclose(got, ref, atol=1e-6)
    assert (got.argmax(1) == ref.argmax(1)).all()
    assert fast.label_probs([], []).shape == (0, 3)
    assert Teacher(model, LABELS, tokenizer=tok).engine == "packed"  # auto


@pytest.mark.parametrize("engine", ["packed", "bucketed", "padded"])
def test_bfloat16_teacher_and_fill_stay_close_to_float32_and_say_so(tok, demo, engine):
    """--dtype bfloat16: the forward passes under autocast; probabilities within bfloat16's rounding of
    float32's, the fill still gives valid candidates, and the run's identity records the dtype."""
    model = tiny_classifier(tok, labels=("contradiction", "entailment", "neutral"), seed=3)
    P, H = list(demo["premise"][:50]), list(demo["hypothesis"][:50])
    ref = Teacher(model, LABELS, tokenizer=tok, batch_size=8, engine="padded").label_probs(P, H)
    half = Teacher(model, LABELS, tokenizer=tok, batch_size=8, engine=engine, dtype="bfloat16")
    got = half.label_probs(P, H)
    assert got.dtype == np.float64 and np.allclose(got.sum(1), 1.0)
    np.testing.assert_allclose(got, ref, atol=3e-2)
    assert np.abs(got - ref).max() > 0     # it did run in bfloat16
    assert half.describe()["dtype"] == "bfloat16" and "dtype" not in Teacher(model, LABELS, tokenizer=tok).describe()
    mlm = tiny_mlm(tok, seed=2)
    reqs = _fill_requests(demo)
    filled = MaskFiller(mlm, tok, candidates=6, batch_size=4, max_length=40, engine=engine, dtype="bfloat16").fill(reqs)
    assert sum(r is not None for r in filled) >= 20
    for req, cands in zip(reqs, filled):
        if cands is not None:
            assert cands and all(len(c) == req.n_masks for c in cands)
    with pytest.raises(ConfigError, match="dtype"):
        Teacher(model, LABELS, tokenizer=tok, dtype="float16")


def _fill_requests(demo, n=30):
    reqs = []
    for i in range(n):
        p, h = demo["premise"][i].split(), demo["hypothesis"][i].split()
        p[i % len(p)] = MASK
        if i % 3 == 0:
            h[0] = MASK
        reqs.append(FillRequest(" ".join(p), " ".join(h), (i % 3 == 0) + 1, ["Yes", "Maybe", "No"][i % 3], seed=i,
                                banned=("a",) if i % 4 == 0 else ()))
    return reqs


@pytest.mark.parametrize("engine", ["packed", "bucketed"])
def test_fill_engines_give_the_padded_references_candidates(tok, demo, engine):
    model = tiny_mlm(tok, seed=2)
    reqs = _fill_requests(demo)
    long = " ".join(demo["premise"][:3])
    reqs.append(FillRequest(long + " " + MASK, MASK, 2, "Yes", seed=0))  # the masks fall past max_length
    ref = MaskFiller(model, tok, candidates=6, batch_size=4, max_length=40, engine="padded").fill(reqs)
    fast = MaskFiller(model, tok, candidates=6, batch_size=4, max_length=40, engine=engine)
    assert fast.fill(reqs) == ref
    assert ref[-1] is None and sum(r is not None for r in ref) >= 20
    assert MaskFiller(model, tok).engine == "packed"  # auto


def _perturbers(tok, demo, engines=("padded", "auto")):
    cols = demo.to_dict()
    hy = HypothesisOnlyFolds(LABELS, seed=0)
    pred = hy.fit(cols["premise"], cols["hypothesis"], cols["label"])
    feat = PairFeaturizer(LABELS, ["unigram", "overlap", "hypo_only"], "lex-overlap>0.8", "overlap_v1", hy)
    mlm, clf = tiny_mlm(tok, seed=4), tiny_classifier(tok, seed=5)
    out = [Perturber(LABELS, feat, MaskFiller(mlm, tok, candidates=5, batch_size=8, engine=e),
                     Teacher(clf, LABELS, tokenizer=tok, batch_size=16, engine=e), WORDS) for e in engines]
    return out, cols, hy, feat, pred


def test_perturbations_with_the_fast_engines_equal_the_reference(tok, demo):
    (ref, fast), cols, hy, _, _ = _perturbers(tok, demo)
    reqs = [PerturbRequest(f"k{i}", f, fam, case, cols["premise"][i], cols["hypothesis"][i], cols["label"][i],
                           int(hy.fold_of[i]), seed=i)
            for i, (f, fam, case) in enumerate([("nobody@pair", "unigram", "keep"), ("a@pair", "unigram", "lose"),
                                                ("lex-overlap>0.8", "overlap", "lose"),
                                                ("hypo-only-pred=neutral", "hypo_only", "keep")] * 10)]
    a, b = ref.perturb(reqs), fast.perturb(reqs)
    for x, y in zip(a, b):
        assert [(c["premise"], c["hypothesis"], c["rejected_by"], c.get("teacher_pred")) for c in x["candidates"]] == \
               [(c["premise"], c["hypothesis"], c["rejected_by"], c.get("teacher_pred")) for c in y["candidates"]]
        assert (x["status"], x["reason"]) == (y["status"], y["reason"])
        for c, d in zip(x["candidates"], y["candidates"]):
            assert (c["confidence"] is None) == (d["confidence"] is None)
            if c["confidence"] is not None:
                assert abs(c["confidence"] - d["confidence"]) <= 2e-6
    assert sum(r["status"] == "ok" for r in a) >= 10


def test_the_walk_with_the_fast_engines_gives_the_same_rows_and_is_byte_identical_per_seed(tok, demo, tmp_path):
    (ref, fast), *_ = _perturbers(tok, demo)
    cfg = PDDConfig(tau=3.0, seed=6, batch_size=8, families=["hypo_only", "unigram"])
    outs = {}
    for name, p in (("padded", ref), ("fast", fast), ("fast2", fast)):
        outs[name] = run_pdd(demo, get_task("demo"), filler=p.filler, teacher=p.teacher, progress=False, config=cfg)
    a, b = outs["padded"], outs["fast"]
    assert a.report["operations"]["succeeded"] >= 10
    assert a.state.uid == b.state.uid and a.state.alive == b.state.alive
    assert a.state.premise == b.state.premise and a.state.hypothesis == b.state.hypothesis
    assert [e["chosen"] for e in a.log] == [e["chosen"] for e in b.log]
    np.testing.assert_allclose(np.array(a.state.confidence[a.state.n_input:], dtype=float),
                               np.array(b.state.confidence[b.state.n_input:], dtype=float), atol=2e-6)
    assert b.report["scoring"]["engine"] == "packed" and b.report["scoring"]["fill_engine"] == "packed"
    # the same engine and seed twice: byte-identical datasets and log
    for i, name in enumerate(("fast", "fast2")):
        kept, removed = build_outputs(demo, get_task("demo"), outs[name])
        for part, d in (("kept", kept), ("removed", removed), ("log", log_dataset(outs[name].log))):
            d.to_parquet(str(tmp_path / f"{part}{i}.parquet"))
    for part in ("kept", "removed", "log"):
        assert (tmp_path / f"{part}0.parquet").read_bytes() == (tmp_path / f"{part}1.parquet").read_bytes()


class CountingTeacher(HashTeacher):
    """HashTeacher that records every text it scores."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def label_probs(self, premises, hypotheses):
        self.seen.extend(zip(premises, hypotheses))
        return super().label_probs(premises, hypotheses)


def test_speculative_perturbations_reach_the_teacher_only_when_planned(demo):
    """Speculative requests are prepared with the plan's but scored only once a plan includes them; the
    output is that of the previous walk, which scored everything it computed."""
    cols = demo.to_dict()
    hy = HypothesisOnlyFolds(LABELS, seed=0)
    pred = hy.fit(cols["premise"], cols["hypothesis"], cols["label"])
    feat = PairFeaturizer(LABELS, ["unigram", "overlap", "hypo_only"], "lex-overlap>0.8", "overlap_v1", hy)
    feats = feat.features(cols["premise"], cols["hypothesis"], hypo_pred=pred)

    class Sometimes(NonceFiller):  # every third request gets no candidate: failures cut plans short
        def fill(self, requests):
            return [c if r.seed % 3 else [] for r, c in zip(requests, super().fill(requests))]

    def walk(score_all):
        teacher = CountingTeacher()
        state = PDDState(cols["premise"], cols["hypothesis"], cols["label"], cols["uid"], hy.fold_of, feats,
                         np.arange(3))
        perturber = Perturber(LABELS, feat, Sometimes(), teacher, WORDS)
        algo = Algorithm1(state, perturber, PDDConfig(tau=2.0, batch_size=9, seed=5), LABELS, 3)
        if score_all:  # the previous behaviour: everything computed is scored at once
            def ensure(plan, spec=()):
                todo = [r for r in list(plan) + list(spec) if r.key not in algo.cache]
                for r, res in zip(todo, perturber.perturb([algo._seeded(r) for r in todo])):
                    algo.cache.put(r.key, res)
                algo.computed += len(todo)
            algo._ensure = ensure
        rec = algo.reduce_feature("hypo-only-pred=neutral", "hypo_only")
        return algo, rec, teacher, state

    new, rec, teacher, state = walk(False)
    old, _, old_teacher, old_state = walk(True)
    assert rec.keep_ops + rec.lose_ops >= 5 and rec.failed_ops >= 2
    assert state.uid == old_state.uid and state.alive == old_state.alive
    assert [e["chosen"] for e in new.log] == [e["chosen"] for e in old.log]
    applied_texts = {(c["premise"], c["hypothesis"]) for e in new.log for c in e["candidates"]
                     if c["confidence"] is not None}
    assert applied_texts <= set(teacher.seen)
    assert len(new.log) <= new.computed < old.computed and len(teacher.seen) < len(old_teacher.seen)
    assert new.never_scored > 0 and not new._prepared


def test_identical_candidate_texts_are_scored_once(demo):
    cols = demo.to_dict()
    hy = HypothesisOnlyFolds(LABELS, seed=0)
    hy.fit(cols["premise"], cols["hypothesis"], cols["label"])
    feat = PairFeaturizer(LABELS, ["unigram"], "lex-overlap>0.8", "overlap_v1", hy)

    class Same:  # the same word everywhere: the two requests of one row make the same candidate
        def fill(self, requests):
            return [[["zebra"] * r.n_masks] for r in requests]

    teacher = CountingTeacher()
    p = Perturber(LABELS, feat, Same(), teacher, WORDS, ratios={"unigram": 1.0})
    reqs = [PerturbRequest(f"k{i}", "zz@pair", "unigram", "lose", cols["premise"][0], cols["hypothesis"][0],
                           cols["label"][0], 0, seed=i) for i in range(3)]
    res = p.perturb(reqs)
    assert all(r["status"] == "ok" for r in res)
    assert len(teacher.seen) == 1 and p.deduplicated == 2 and p.scored == 1
    assert len({r["candidates"][0]["confidence"] for r in res}) == 1
