"""Temperature scaling of the confidence model M (Guo et al. 2017) and the calibrated confidence filter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from debiased_nli.methods.calibration import (Calibrator, calibration_report, choose_calibrator,
                                               expected_calibration_error, fit_isotonic, fit_temperature,
                                               isotonic_scale, reliability, temperature_scale)
from debiased_nli.utils.errors import ConfigError
from debiased_nli.data.tasks import get_task

SNLI = get_task("snli")

SHARED = Path(os.environ.get("DEBIASED_NLI_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def overconfident(n=4000, k=3, true_t=2.5, seed=0):
    """Rows whose labels are drawn from softmax(z / true_t) while the model reports softmax(z): a model
    over-confident by exactly true_t."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 3, size=(n, k))
    truth = np.exp(z / true_t)
    truth /= truth.sum(1, keepdims=True)
    labels = np.array([rng.choice(k, p=p) for p in truth])
    reported = np.exp(z)
    reported /= reported.sum(1, keepdims=True)
    return reported, labels


def test_the_fitted_temperature_recovers_a_known_overconfidence_and_lowers_the_ece():
    probs, labels = overconfident()
    t = fit_temperature(probs, labels)
    assert 2.2 < t < 2.8  # the generating temperature is 2.5
    # the NLL at the fitted T is the minimum over a fine grid (an independent check of the search)
    grid = np.exp(np.linspace(np.log(0.5), np.log(8), 400))
    nll = [-np.mean(np.log(temperature_scale(probs, g)[np.arange(len(labels)), labels])) for g in grid]
    assert abs(grid[int(np.argmin(nll))] - t) / t < 0.02
    rep = calibration_report(probs, labels, t, label_names=["e", "n", "c"])
    assert rep["ece_after"] < 0.5 * rep["ece_before"] and rep["nll_after"] < rep["nll_before"]
    assert rep["accuracy"] == pytest.approx(float((probs.argmax(1) == labels).mean()))
    # temperature scaling keeps the argmax
    assert (temperature_scale(probs, t).argmax(1) == probs.argmax(1)).all()


def test_ece_by_hand():
    probs = np.array([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
    labels = np.array([0, 1, 0, 1])
    # bins of 0.1 (10): 0.9 -> bin (0.8, 0.9]: two rows, accuracy 0.5, confidence 0.9; 0.6: one row, right;
    # 0.7: one row, right
    want = 2 / 4 * abs(0.5 - 0.9) + 1 / 4 * abs(1 - 0.6) + 1 / 4 * abs(1 - 0.7)
    assert expected_calibration_error(probs, labels, bins=10) == pytest.approx(want)
    table = reliability(probs, labels, bins=10)
    assert sum(b["rows"] for b in table) == 4 and table[8]["rows"] == 2 and table[8]["accuracy"] == 0.5


@pytest.mark.parametrize("probs,labels,match", [
    (np.zeros((0, 3)), np.zeros(0, int), "at least one"),
    (np.full((2, 3), 1 / 3), np.array([0, 3]), "row 1: label 3"),
    (np.array([[np.nan, 0.5, 0.5]]), np.array([0]), "row 0: the probabilities are not finite"),
])
def test_bad_calibration_rows_are_refused_with_the_row(probs, labels, match):
    with pytest.raises(ConfigError, match=match):
        fit_temperature(probs, labels)


def test_a_temperature_must_be_positive():
    with pytest.raises(ConfigError, match="finite number > 0"):
        temperature_scale(np.full((1, 3), 1 / 3), 0.0)


def test_the_cli_calibrates_m_on_held_out_rows_and_applies_tau_to_calibrated_probabilities(tmp_path):
    from test_confidence import make_model

    model = make_model(tmp_path / "m", {0: "entailment", 1: "neutral", 2: "contradiction"})
    dev = pq.read_table(SHARED / "data" / "snli" / "dev.parquet").slice(0, 60)
    pq.write_table(dev, tmp_path / "heldout.parquet")
    gen = pq.read_table(SHARED / "data" / "snli" / "train_sample.parquet").slice(0, 40)
    pq.write_table(gen, tmp_path / "gen.parquet")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "debiased_nli.cli", "confidence-filter", "snli", "--data-files",
                        str(tmp_path / "gen.parquet"), "--model", model, "--tau", "0.5", "--calibration-data",
                        str(tmp_path / "heldout.parquet"), "--calibration-method", "temperature", "--probabilities",
                        "--out", str(out), "--quiet"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    cal = json.loads((out / "calibration.json").read_text())
    rep = json.loads((out / "confidence_report.json").read_text())
    assert cal["rows"] == 60 and cal["temperature"] > 0 and (out / "reliability.png").stat().st_size > 1000
    assert rep["calibration"]["temperature"] == cal["temperature"]
    assert cal["nll_after"] <= cal["nll_before"] + 1e-9  # T = 1 is inside the search interval
    kept, rej = pq.read_table(out / "kept.parquet").to_pandas(), pq.read_table(out / "rejected.parquet").to_pandas()
    import pandas as pd
    both = pd.concat([kept, rej], ignore_index=True)
    assert len(both) == 40
    # the calibrated confidence is the temperature-scaled M probability of the row's label
    raw = both[["m_prob_entailment", "m_prob_neutral", "m_prob_contradiction"]].to_numpy()
    want = temperature_scale(raw, cal["temperature"])[np.arange(len(both)), both["label"].to_numpy()]
    assert np.allclose(both["confidence"].to_numpy(), want, atol=1e-6)
    assert np.allclose(both["confidence_uncalibrated"].to_numpy(), raw[np.arange(len(both)), both["label"].to_numpy()])
    assert (kept["confidence"] > 0.5).all() and (rej["confidence"] <= 0.5).all()


def test_a_calibrated_filter_is_rebuilt_without_m_from_stored_probabilities_and_its_calibrator(tmp_path):
    """--calibrator (an earlier run's calibration.json) with --probabilities-from: the same kept and rejected rows as
    the run that fitted the calibration, with no M (a model path that does not exist) and no held-out rows."""
    from test_confidence import make_model

    model = make_model(tmp_path / "m", {0: "entailment", 1: "neutral", 2: "contradiction"})
    dev = pq.read_table(SHARED / "data" / "snli" / "dev.parquet").slice(0, 80)
    pq.write_table(dev, tmp_path / "heldout.parquet")
    gen = pq.read_table(SHARED / "data" / "snli" / "train_sample.parquet").slice(0, 50)
    gen = gen.append_column("uid", [[f"generator:test:{i:04d}" for i in range(50)]])  # generated rows carry a uid
    pq.write_table(gen, tmp_path / "gen.parquet")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cli = [sys.executable, "-m", "debiased_nli.cli", "confidence-filter", "snli", "--data-files",
           str(tmp_path / "gen.parquet"), "--tau", "0.4", "--quiet"]
    first = tmp_path / "first"
    r = subprocess.run([*cli, "--model", model, "--calibration-data", str(tmp_path / "heldout.parquet"),
                        "--calibration-method", "isotonic", "--probabilities", "--out", str(first)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    kept = pq.read_table(first / "kept.parquet")
    import pyarrow as pa
    probs = pa.concat_tables([kept, pq.read_table(first / "rejected.parquet").drop(["rejected_by"])]).select(
        ["uid", "m_prob_entailment", "m_prob_neutral", "m_prob_contradiction"])
    pq.write_table(probs, tmp_path / "m_scores.parquet")
    again = tmp_path / "again"
    r = subprocess.run([*cli, "--model", str(tmp_path / "no-such-model"), "--probabilities-from",
                        str(tmp_path / "m_scores.parquet"), "--calibrator", str(first / "calibration.json"),
                        "--out", str(again)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("kept.parquet", "rejected.parquet"):
        a, b = pq.read_table(first / name).to_pandas(), pq.read_table(again / name).to_pandas()
        assert a["uid"].tolist() == b["uid"].tolist()
        assert np.allclose(a["confidence"].to_numpy(), b["confidence"].to_numpy(), atol=1e-6)
    rep = json.loads((again / "confidence_report.json").read_text())
    assert rep["model"] is None and rep["calibration"]["from"]["file"] == "calibration.json"
    assert rep["calibration"]["calibrator"]["method"] == "isotonic"
    # both at once is refused before any work, and a file that is not a calibration is refused with its name
    r = subprocess.run([*cli, "--model", model, "--calibration-data", str(tmp_path / "heldout.parquet"),
                        "--calibrator", str(first / "calibration.json"), "--out", str(tmp_path / "both")],
                       capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "give one of them" in r.stderr and not (tmp_path / "both").exists()
    r = subprocess.run([*cli, "--probabilities-from", str(tmp_path / "m_scores.parquet"), "--calibrator",
                        str(first / "confidence_report.json"), "--out", str(tmp_path / "foreign")],
                       capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "confidence_report.json: not the calibration.json" in r.stderr


def miscalibrated_at_the_top(n=6000, seed=1):
    """A 3-label model over-confident in the middle of its range and under-confident at the top (rows it gives
    0.9-0.95 are right 99% of the time): what one temperature cannot fix and a monotone map can."""
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.34, 0.95, n)
    truth = np.where(conf > 0.9, 0.99, np.clip(conf - 0.12, 0.34, 1))  # P(label right | conf)
    labels = rng.integers(0, 3, n)
    right = rng.random(n) < truth
    pred = np.where(right, labels, (labels + rng.integers(1, 3, n)) % 3)
    probs = np.full((n, 3), 0.0)
    probs[np.arange(n), pred] = conf
    for i in range(n):
        others = [c for c in range(3) if c != pred[i]]
        probs[i, others] = (1 - conf[i]) / 2
    return probs, labels


def test_isotonic_calibration_fixes_what_a_temperature_cannot_and_auto_chooses_it_on_held_out_rows():
    probs, labels = miscalibrated_at_the_top()
    knots = fit_isotonic(probs, labels)
    after = isotonic_scale(probs, knots)
    assert np.allclose(after.sum(1), 1) and (after > 0).all()
    top = probs.max(1) > 0.9
    # the top rows: right 99% of the time, given <= 0.95 before; after the map their label's probability is > 0.95
    assert after.max(1)[top].mean() > 0.95 > probs.max(1)[top].mean()
    assert expected_calibration_error(after, labels) < expected_calibration_error(probs, labels) / 2
    t = fit_temperature(probs, labels)
    assert temperature_scale(probs, t).max(1)[top].mean() < 0.95  # one temperature cannot lift the top alone
    cal, sel = choose_calibrator(probs, labels, "auto")
    assert cal.method == "isotonic" and sel["chosen"] == "isotonic"
    assert sel["cross_fitted"]["isotonic"]["nll"] < sel["cross_fitted"]["temperature"]["nll"]
    rep = calibration_report(probs, labels, cal, selection=sel)
    assert rep["method"].startswith("per-label isotonic") and rep["temperature"] is None
    # the calibrator goes to JSON and back to the same map
    again = Calibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
    np.testing.assert_allclose(again.apply(probs), cal.apply(probs))
    # on a model whose only fault is a temperature, auto keeps temperature scaling
    p2, l2 = overconfident()
    assert choose_calibrator(p2, l2, "auto")[0].method == "temperature"


def test_a_second_filter_reuses_the_stored_probabilities_without_running_m(tmp_path):
    """--reuse-probabilities: the rows of an earlier --probabilities run, thresholded again (another tau, another
    calibration) from their m_prob_* columns; M scores only the calibration rows. A damaged M folder for the rows
    would fail; a row whose stored probabilities are no distribution is refused with its number."""
    import datasets
    from test_confidence import make_model

    from debiased_nli.data.loading import new_rows
    from debiased_nli.methods.confidence import confidence_filter

    model = make_model(tmp_path / "m", {0: "entailment", 1: "neutral", 2: "contradiction"})
    names = ["entailment", "neutral", "contradiction"]
    rows = new_rows("snli", ["A dog runs.", "Two men play.", "A girl eats."] * 5, ["An animal moves.", "Nobody plays.",
                    "A child eats."] * 5, [names[i % 3] for i in range(15)], origin="generated", method="generator:test")
    k1, r1 = confidence_filter(rows, model, SNLI, 0.5, probabilities=True, progress=False)
    first = datasets.concatenate_datasets([k1, r1])
    cal = Calibrator("temperature", temperature=2.0)
    k2, r2 = confidence_filter(first, str(tmp_path / "absent-model"), SNLI, 0.4, calibrator=cal,
                               reuse_probabilities=True, progress=False)
    direct_k, _ = confidence_filter(rows, model, SNLI, 0.4, calibrator=cal, progress=False)
    # a calibrated run's output (with confidence_uncalibrated) thresholded again, calibrated again
    k3, r3 = confidence_filter(datasets.concatenate_datasets([k2, r2]), model, SNLI, 0.4, calibrator=cal,
                               reuse_probabilities=True, progress=False)
    assert sorted(k3["uid"]) == sorted(direct_k["uid"])
    assert sorted(k2["uid"]) == sorted(direct_k["uid"]) and len(k2) + len(r2) == 15
    assert set(r2["rejected_by"]) <= {"confidence<=0.4"}
    broken = first.remove_columns(["m_prob_neutral"]).add_column("m_prob_neutral", [0.9] * 15)
    with pytest.raises(ConfigError, match="row 0: the stored probabilities"):
        confidence_filter(broken, model, SNLI, 0.4, reuse_probabilities=True, progress=False)


def test_stored_probabilities_threshold_the_rows_again_without_m(tmp_path):
    """--probabilities-from: M's stored scores (uid, m_prob_*) joined onto the rows by uid; the same rows kept as a
    run of M itself at that tau, with no model at all; a row without stored scores is named."""
    import pandas as pd
    from test_confidence import make_model

    from debiased_nli.data.loading import new_rows

    model = make_model(tmp_path / "m", {0: "entailment", 1: "neutral", 2: "contradiction"})
    raw = pq.read_table(SHARED / "data" / "snli" / "train_sample.parquet").slice(0, 40).to_pydict()
    names = ["entailment", "neutral", "contradiction"]
    new_rows("snli", raw["premise"], raw["hypothesis"], [names[x] for x in raw["label"]], origin="generated",
             method="generator:test").to_parquet(str(tmp_path / "gen.parquet"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    base = [sys.executable, "-m", "debiased_nli.cli", "confidence-filter", "snli", "--data-files",
            str(tmp_path / "gen.parquet"), "--quiet"]
    r = subprocess.run([*base, "--model", model, "--tau", "0.4", "--probabilities", "--out", str(tmp_path / "a")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-1500:]
    both = pd.concat([pd.read_parquet(tmp_path / "a" / f"{n}.parquet") for n in ("kept", "rejected")])
    both[["uid", "m_prob_entailment", "m_prob_neutral", "m_prob_contradiction"]].to_parquet(tmp_path / "scores.parquet")
    r = subprocess.run([*base, "--model", str(tmp_path / "no-such-model"), "--tau", "0.4", "--probabilities-from",
                        str(tmp_path / "scores.parquet"), "--out", str(tmp_path / "b")], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr[-1500:]
    a, b = pd.read_parquet(tmp_path / "a" / "kept.parquet"), pd.read_parquet(tmp_path / "b" / "kept.parquet")
    assert sorted(a.uid) == sorted(b.uid) and len(a) > 0
    # the report names the stored scores it used, not a model that never ran
    rep = json.loads((tmp_path / "b" / "confidence_report.json").read_text())
    assert rep["model"] is None and rep["probabilities_from"]["file"] == "scores.parquet"
    assert len(rep["probabilities_from"]["sha256"]) == 64
    # an earlier run's kept and rejected files as the input (their columns differ by the reason): the same rows kept
    r = subprocess.run([sys.executable, "-m", "debiased_nli.cli", "confidence-filter", "snli", "--data-files",
                        str(tmp_path / "a" / "kept.parquet"), str(tmp_path / "a" / "rejected.parquet"), "--quiet",
                        "--model", model, "--tau", "0.4", "--reuse-probabilities", "--out", str(tmp_path / "d")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-1500:]
    assert sorted(pd.read_parquet(tmp_path / "d" / "kept.parquet").uid) == sorted(a.uid)
    both.iloc[1:][["uid", "m_prob_entailment", "m_prob_neutral", "m_prob_contradiction"]].to_parquet(tmp_path / "s2.parquet")
    r = subprocess.run([*base, "--tau", "0.4", "--probabilities-from", str(tmp_path / "s2.parquet"), "--out",
                        str(tmp_path / "c")], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "has no stored probabilities" in r.stderr
