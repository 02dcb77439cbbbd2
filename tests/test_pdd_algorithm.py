"""PDD's Algorithm 1 (Guo et al. 2023, section 3.2) on the demo task with fillers that always produce candidates."""
import json

import numpy as np
import pytest

from debiased_nli.data.loading import load_task
from debiased_nli.data.tasks import get_task
from debiased_nli.utils.errors import ConfigError
from debiased_nli.bias.hypothesis_only import out_of_fold_tfidf
from debiased_nli.bias.features import build_feature_matrix
from debiased_nli.bias.task_features import add_features
from debiased_nli.methods.pdd.algorithm import (LOST_X, NO_SURVIVOR, SAME_AS_SOURCE, STILL_HAS_X, Algorithm1,
                                                PairFeaturizer, PDDConfig, PDDState, Perturber, PerturbRequest,
                                                ResultCache, reference_reduce_feature)
from debiased_nli.methods.pdd.hypothesis_folds import HypothesisOnlyFolds
from debiased_nli.methods.pdd.run import run_pdd
from debiased_nli.methods.pdd.step import build_outputs, log_dataset
from debiased_nli.methods.pdd.zvalue import z_star
from pdd_helpers import LABELS, HashTeacher, NonceFiller, WordFiller

TAU = 4.0


@pytest.fixture(scope="module")
def demo():
    return load_task("demo").dataset.shuffle(seed=1).select(range(900)).flatten_indices()


@pytest.fixture(scope="module")
def run(demo):
    return run_pdd(demo, get_task("demo"), filler=NonceFiller(), teacher=HashTeacher(), progress=False,
                   config=PDDConfig(tau=TAU, batch_size=16, seed=3))


def test_every_targeted_feature_ends_within_tau_or_is_reported(run):
    recs = run.report["features"]
    assert len(recs) >= 10
    for r in recs:
        if r["status"] in ("reached", "already below tau"):
            assert max(abs(z) for z in r["z_after"]) <= TAU, r
        else:
            assert r["status"] in ("unreachable", "max_passes") and r["reason"], r
    # the planted artifacts lose their label correlation (their p_hat > p0 side goes under tau)
    planted = {"nobody@pair": "contradiction", "outdoors@pair": "entailment", "competition@pair": "neutral"}
    for r in recs:
        if r["feature"] in planted:
            l = LABELS.index(planted[r["feature"]])
            assert r["z_before"][l] > TAU >= r["z_after"][l]


def test_accounting_rows_out_equal_rows_in_plus_additions(run, demo):
    rows, ops = run.report["rows"], run.report["operations"]
    assert rows["output"] == rows["input"] + ops["keep"] == len(demo) + ops["keep"]
    assert rows["removed"] == ops["lose"] == len(run.state.replaced_by)
    kept, removed = build_outputs(demo, get_task("demo"), run)
    assert len(kept) == rows["output"] and len(removed) == ops["lose"]
    uid_label = dict(zip(run.state.uid, run.state.label))
    new = kept.filter(lambda o: o == "perturbed", input_columns="origin")
    assert len(new) and all(uid_label[s] == l for s, l in zip(new["source_uid"], new["label"]))
    assert all(m.startswith("pdd:") and m.endswith((":keep", ":lose")) for m in new["method"])
    assert all(0.0 <= c <= 1.0 for c in new["teacher_confidence"])
    made = set(run.state.uid)
    assert set(removed["reason"]) == {"pdd: replaced"} and all(u in made for u in removed["replaced_by"])
    assert len(set(kept["uid"])) == len(kept) and not set(kept["uid"]) & set(removed["uid"])
    # every operation of the log is accounted for
    ok = [e for e in run.log if e["status"] == "ok"]
    assert len(ok) == ops["keep"] + ops["lose"] and len(run.log) == ops["attempted"]


def test_every_operation_moved_z_of_its_label_toward_zero(run):
    """Appendix C on a real walk: each successful operation lowered |z*(l, x)| of its row's label; a failed
    one left it unchanged; and the counts kept in O(1) are those of a full recount (the last feature's)."""
    ok = [e for e in run.log if e["status"] == "ok"]
    assert ok and all(abs(e["z_after"]) < abs(e["z_before"]) for e in ok)
    assert all(e["z_after"] == e["z_before"] for e in run.log if e["status"] != "ok")
    last = run.report["features"][-1]
    assert last["counts_after"] == run.state.counts(last["feature"], 3).tolist()


def _state_rows(state):
    return [{"uid": u, "premise": p, "hypothesis": h, "label": l, "fold": f, "features": set(fs), "alive": a}
            for u, p, h, l, f, fs, a in zip(state.uid, state.premise, state.hypothesis, state.label, state.fold,
                                            state.features, state.alive)]


@pytest.mark.parametrize("feature,family", [("nobody@pair", "unigram"), ("lex-overlap>0.8", "overlap"),
                                            ("hypo-only-pred=neutral", "hypo_only")])
def test_fast_walk_agrees_with_the_slow_reference_operation_for_operation(demo, feature, family):
    """The batched walk with O(1) count updates vs. one operation at a time recounting x over all of D."""
    small = demo.select(range(400))
    cols = small.to_dict()
    hy = HypothesisOnlyFolds(LABELS, seed=0)
    pred = hy.fit(cols["premise"], cols["hypothesis"], cols["label"])
    feat = PairFeaturizer(LABELS, ["unigram", "overlap", "hypo_only"], "lex-overlap>0.8", "overlap_v1", hy)
    feats = feat.features(cols["premise"], cols["hypothesis"], hypo_pred=pred)
    group_of = np.arange(3)
    perturber = Perturber(LABELS, feat, NonceFiller(), HashTeacher(), {"entailment": "Yes", "neutral": "Maybe",
                                                                       "contradiction": "No"})
    cfg = PDDConfig(tau=2.0, batch_size=7, seed=5)
    state = PDDState(cols["premise"], cols["hypothesis"], cols["label"], cols["uid"], hy.fold_of, feats, group_of)
    ref_rows = _state_rows(state)
    algo = Algorithm1(state, perturber, cfg, LABELS, 3)
    rec = algo.reduce_feature(feature, family)
    assert rec.keep_ops + rec.lose_ops > 0

    def perturb_one(row, case, pass_, sweep):
        from debiased_nli.methods.pdd.algorithm import derive_seed, op_key
        key = op_key(sweep, feature, row["uid"], case, pass_)
        req = PerturbRequest(key, feature, family, case, row["premise"], row["hypothesis"], row["label"],
                             row["fold"], derive_seed(cfg.seed, key))
        return perturber.perturb([req])[0]

    rows, ops = reference_reduce_feature(ref_rows, feature, perturb_one, K=3, group_of=group_of, labels=LABELS,
                                         tau=cfg.tau, seed=cfg.seed, max_passes=cfg.max_passes)
    assert [(e["source_uid"], e["case"], e["new_uid"]) for e in algo.log] == ops
    assert [r["uid"] for r in rows] == state.uid
    assert [r["alive"] for r in rows] == state.alive
    assert [r["premise"] for r in rows] == state.premise and [r["hypothesis"] for r in rows] == state.hypothesis


def test_batch_size_does_not_change_the_output(demo):
    small = demo.select(range(300))
    outs = [run_pdd(small, get_task("demo"), filler=NonceFiller(), teacher=HashTeacher(), progress=False,
                    config=PDDConfig(tau=3.0, batch_size=b, seed=1, families=["unigram", "hypo_only"]))
            for b in (1, 13)]
    assert outs[0].state.uid == outs[1].state.uid and outs[0].state.alive == outs[1].state.alive
    assert outs[0].report["operations"]["attempted"] == outs[1].report["operations"]["attempted"]


def test_same_seed_gives_byte_identical_output(demo, tmp_path):
    small = demo.select(range(300))
    paths = []
    for i in range(2):
        out = run_pdd(small, get_task("demo"), filler=NonceFiller(), teacher=HashTeacher(), progress=False,
                      config=PDDConfig(tau=3.0, seed=2, families=["overlap", "unigram"]))
        kept, removed = build_outputs(small, get_task("demo"), out)
        for name, d in (("kept", kept), ("removed", removed), ("log", log_dataset(out.log))):
            d.to_parquet(str(tmp_path / f"{name}{i}.parquet"))
        paths.append(tmp_path)
    for name in ("kept", "removed", "log"):
        assert (tmp_path / f"{name}0.parquet").read_bytes() == (tmp_path / f"{name}1.parquet").read_bytes()


class FailingAfter:
    """Stops the run after ``n`` perturbation batches (an interruption)."""

    def __init__(self, inner, n):
        self.inner, self.n = inner, n

    def describe(self):
        return type(self.inner).__name__  # the same filler as far as the checkpoint is concerned

    def fill(self, requests):
        if self.n <= 0:
            raise KeyboardInterrupt
        self.n -= 1
        return self.inner.fill(requests)


def test_an_interrupted_run_continues_from_its_checkpoint(demo, tmp_path):
    small = demo.select(range(300))
    cfg = PDDConfig(tau=3.0, seed=4, batch_size=8, checkpoint_every=5, families=["unigram"])
    full = run_pdd(small, get_task("demo"), filler=NonceFiller(), teacher=HashTeacher(), progress=False, config=cfg)
    with pytest.raises(KeyboardInterrupt):
        run_pdd(small, get_task("demo"), filler=FailingAfter(NonceFiller(), 6), teacher=HashTeacher(), progress=False,
                config=cfg, work_dir=tmp_path / "w")
    resumed = run_pdd(small, get_task("demo"), filler=NonceFiller(), teacher=HashTeacher(), progress=False, config=cfg,
                      work_dir=tmp_path / "w")
    ops = resumed.report["operations"]
    assert ops["from_checkpoint"] > 0 and ops["computed"] < full.report["operations"]["computed"]
    assert resumed.state.uid == full.state.uid and resumed.state.alive == full.state.alive
    with pytest.raises(ConfigError, match="other settings"):
        run_pdd(small, get_task("demo"), filler=NonceFiller(), teacher=HashTeacher(), progress=False,
                config=PDDConfig(tau=2.5, seed=4, families=["unigram"]), work_dir=tmp_path / "w")


def test_a_feature_that_cannot_reach_tau_stops_with_the_reason(demo):
    """A filler that always puts x back can never make a lose candidate: every pass fails, the feature is
    reported unreachable instead of looping."""
    out = run_pdd(demo.select(range(400)), get_task("demo"), filler=WordFiller("nobody"), teacher=HashTeacher(),
                  progress=False, config=PDDConfig(tau=TAU, families=["unigram"], max_passes=50))
    rec = next(r for r in out.report["features"] if r["feature"] == "nobody@pair")
    # keep operations (for labels under p0) can still succeed in the first pass; no lose operation ever does
    assert rec["status"] == "unreachable" and rec["passes"] <= 2 and rec["lose_ops"] == 0
    assert "no successful operation" in rec["reason"] and rec["failures"][NO_SURVIVOR] > 0
    assert all(c["rejected_by"] in (STILL_HAS_X, SAME_AS_SOURCE) for e in out.log
               if e["feature"] == "nobody@pair" and e["case"] == "lose"
               for c in e["candidates"])


def test_max_passes_bounds_the_walk(demo):
    out = run_pdd(demo.select(range(400)), get_task("demo"), filler=NonceFiller(), teacher=HashTeacher(), progress=False,
                  config=PDDConfig(tau=0.5, families=["hypo_only"], max_passes=1))
    assert all(r["passes"] <= 1 for r in out.report["features"])
    assert any(r["status"] == "max_passes" for r in out.report["features"])


def test_containment_and_the_teachers_choice(demo):
    cols = demo.select(range(100)).to_dict()
    hy = HypothesisOnlyFolds(LABELS, seed=0)
    hy.fit(cols["premise"], cols["hypothesis"], cols["label"])
    feat = PairFeaturizer(LABELS, ["unigram", "overlap", "hypo_only"], "lex-overlap>0.8", "overlap_v1", hy)
    words = {"entailment": "Yes", "neutral": "Maybe", "contradiction": "No"}
    i = next(j for j, h in enumerate(cols["hypothesis"]) if "nobody" in h.lower())
    base = dict(premise=cols["premise"][i], hypothesis=cols["hypothesis"][i], label=cols["label"][i], fold=0, seed=9)
    # keep x: a candidate that lost x is dropped; lose x: a candidate that kept x is dropped
    keep_other = Perturber(LABELS, feat, WordFiller("nobody"), HashTeacher(), words).perturb(
        [PerturbRequest("k", "outdoors@pair", "unigram", "lose", **base)])[0]
    assert keep_other["status"] in ("ok", "failed")
    lose = Perturber(LABELS, feat, WordFiller("nobody"), HashTeacher(), words).perturb(
        [PerturbRequest("k", "nobody@pair", "unigram", "lose", **base)])[0]
    assert lose["status"] == "failed" and [c["rejected_by"] for c in lose["candidates"]] == [STILL_HAS_X]
    # the identity fill is not a perturbation
    same = Perturber(LABELS, feat, WordFiller("a"), HashTeacher(), words).perturb(
        [PerturbRequest("k", "hypo-only-pred=entailment", "hypo_only", "keep", premise="a a a", hypothesis="x y",
                        label=0, fold=0, seed=1)])[0]
    assert same["candidates"][0]["rejected_by"] == SAME_AS_SOURCE
    # hypothesis-only lose: the new hypothesis must change the prediction
    x = f"hypo-only-pred={LABELS[int(hy.predict([base['premise']], [base['hypothesis']], [0])[0])]}"
    res = Perturber(LABELS, feat, NonceFiller(candidates=8), HashTeacher(), words).perturb(
        [PerturbRequest("k", x, "hypo_only", "lose", **base)])[0]
    for c in res["candidates"]:
        if c["rejected_by"] is None:
            assert x not in c["features"]
        else:
            assert c["rejected_by"] in (STILL_HAS_X, SAME_AS_SOURCE)
    # the teacher's choice is the surviving candidate with the highest p(label)
    keep = Perturber(LABELS, feat, NonceFiller(candidates=6), HashTeacher(), words).perturb(
        [PerturbRequest("k", "nobody@pair", "unigram", "keep", **base)])[0]
    from debiased_nli.methods.pdd.algorithm import choose
    idx, _ = choose(keep, set(), LABELS[base["label"]], "pdd:nobody@pair:keep")
    conf = [c["confidence"] for c in keep["candidates"]]
    assert idx == int(np.argmax([-1 if c is None else c for c in conf]))
    assert all(c["rejected_by"] != LOST_X for c in keep["candidates"])


def test_fold_models_reproduce_the_librarys_out_of_fold_predictions(demo):
    ds, hyp = add_features(demo, "demo", seed=0, progress=False)
    cols = demo.to_dict()
    mine = HypothesisOnlyFolds(LABELS, seed=0).fit(cols["premise"], cols["hypothesis"], cols["label"])
    assert (mine == hyp.predictions).mean() == 1.0


def test_fever_label_groups_walk_two_classes():
    from debiased_nli.data.loading import new_rows
    rng = np.random.default_rng(0)
    labels = ["SUPPORTS", "REFUTES", "NOT ENOUGH INFO"]
    words = "the film was made in france by a director who won an award".split()
    claims = [" ".join(rng.choice(words, 6)) + (" never" if i % 3 == 0 else "") for i in range(300)]
    lab = [labels[0] if i % 3 == 0 else labels[1 + (i % 2)] for i in range(300)]
    ds = new_rows("fever", [" ".join(rng.choice(words, 9)) for _ in range(300)], claims, lab, origin="original",
                  method="test")
    out = run_pdd(ds, get_task("fever"), filler=NonceFiller(), teacher=HashTeacher(), progress=False,
                  config=PDDConfig(tau=3.0, families=["unigram"],
                                   label_groups=[["SUPPORTS"], ["REFUTES", "NOT ENOUGH INFO"]]))
    assert out.report["label_groups"] == ["SUPPORTS", "REFUTES+NOT ENOUGH INFO"] and out.report["p0"] == 0.5
    rec = next(r for r in out.report["features"] if r["feature"] == "never@pair")
    assert len(rec["z_before"]) == 2 and rec["z_before"][0] > 3.0 and max(map(abs, rec["z_after"])) <= 3.0
