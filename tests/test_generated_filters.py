"""Filters past the paper in a build (release.generated_filters): near-duplicate and fluency filters on the new
rows, the self-audit fixed point of a composed config; each decision kept with its reason, recorded, replayed,
and a release built without them the same as before they existed."""
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from debiased_nli.bias.audit import audit_dataset
from debiased_nli.data.loading import load_task, new_rows
from debiased_nli.release.generated_filters import fluency_filter, near_duplicates_filter
from debiased_nli.release.recipe import build, load_recipe
from debiased_nli.utils.errors import ConfigError

NAMES = ["entailment", "neutral", "contradiction"]


@pytest.fixture(scope="module")
def d0_file(shared_data, tmp_path_factory):
    d0 = load_task("snli", data_files=str(shared_data / "snli" / "train_sample.parquet"), max_rows=1200).dataset
    path = tmp_path_factory.mktemp("d0") / "d0.parquet"
    d0.select_columns(["premise", "hypothesis", "label"]).to_parquet(str(path))
    return path


@pytest.fixture(scope="module")
def d0(d0_file):
    return load_task("snli", data_files=str(d0_file)).dataset


@pytest.fixture(scope="module")
def new_file(shared_data, tmp_path_factory):
    """300 new rows: 20 copies of D0 rows (case and spaces changed), 10 repeated twice among the new
    rows, and 270 that carry an artifact D0 has not ("zorbly" in a contradiction) every third row."""
    extra = load_task("snli", data_files=str(shared_data / "snli" / "dev.parquet"), max_rows=270).dataset
    d0 = load_task("snli", data_files=str(shared_data / "snli" / "train_sample.parquet"), max_rows=20).dataset
    prem, hyp, lab = [], [], []
    for p, h, l in zip(d0["premise"], d0["hypothesis"], d0["label"]):
        prem.append(p.upper() + "  "), hyp.append(h), lab.append(NAMES[l])
    for i, (p, h, l) in enumerate(zip(extra["premise"], extra["hypothesis"], extra["label"])):
        prem.append(p), hyp.append(h.rstrip(".") + " zorbly." if i % 3 == 0 else h)
        lab.append("contradiction" if i % 3 == 0 else NAMES[l])
    for i in range(10):  # repeats of new rows, later in the set
        prem.append(prem[20 + i] + " "), hyp.append(hyp[20 + i]), lab.append(lab[20 + i])
    rows = new_rows("snli", prem, hyp, lab, origin="generated", method="generator:test")
    path = tmp_path_factory.mktemp("new") / "new.parquet"
    rows.select_columns(["premise", "hypothesis", "label"]).to_parquet(str(path))
    return path


def test_near_duplicates_drop_copies_of_d0_and_later_repeats_with_their_reason(d0, new_file):
    dg = load_task("snli", data_files=str(new_file)).dataset
    kept, dropped, report = near_duplicates_filter(dg, d0, {"threshold": 0.8, "within": True}, seed=0)
    assert report["of_d0"] >= 20 and report["within_new_rows"] >= 10
    assert len(kept) + len(dropped) == len(dg) and set(kept["uid"]).isdisjoint(dropped["uid"])
    copies = set(dg.select(range(20))["uid"])
    repeats = set(dg.select(range(290, 300))["uid"])
    firsts = set(dg.select(range(20, 30))["uid"])
    assert copies | repeats <= set(dropped["uid"])
    assert firsts <= set(kept["uid"])  # the first of each group stays
    why = dict(zip(dropped["uid"], dropped["reason"]))
    assert all(why[u].startswith("near_duplicate of D0 ") for u in copies)
    assert all(why[u].startswith("near_duplicate of new row ") for u in repeats)
    # without `within` the repeats stay
    kept2, _, r2 = near_duplicates_filter(dg, d0, {"threshold": 0.8, "within": False}, seed=0)
    assert r2["within_new_rows"] == 0 and repeats <= set(kept2["uid"])


def test_fluency_drops_rows_under_the_real_rows_quantile(d0, tmp_path):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from debiased_nli.methods.quality import fluency_scores, pair_texts

    tok = AutoTokenizer.from_pretrained(str(_gpt2_tokenizer()))
    torch_lm = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=128, vocab_size=len(tok)))
    torch_lm.save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    dg = d0.select(range(60))
    params = {"lm": str(tmp_path / "lm"), "quantile": 0.25, "reference_rows": 200, "batch_size": 16, "max_length": 64}
    kept, dropped, report = fluency_filter(dg, d0, params, seed=0, progress=False)
    # the bound recomputed independently: the 0.25 quantile of the same seeded 200 D0 rows
    ref = d0.select(np.sort(np.random.default_rng(0).choice(len(d0), size=200, replace=False)))
    lm = GPT2LMHeadModel.from_pretrained(tmp_path / "lm")
    kw = dict(tokenizer=tok, device="cpu", progress=False, batch_size=16, max_length=64)  # as the filter scores
    bound = float(np.quantile(fluency_scores(pair_texts(ref), lm, **kw), 0.25))
    scores = fluency_scores(pair_texts(dg), lm, **kw)
    assert report["bound"] == pytest.approx(bound, abs=1e-5)
    assert sorted(dropped["uid"]) == sorted(np.asarray(dg["uid"])[scores < bound].tolist())
    assert all(r.startswith("fluency ") and "< bound" in r for r in dropped["reason"])
    assert len(kept) + len(dropped) == len(dg)


def _gpt2_tokenizer():
    import os
    from pathlib import Path

    path = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models")) / "gpt2-tokenizer"
    if not path.exists():
        pytest.skip("the GPT-2 tokenizer is not prepared (../shared/models/prepare_offline_models.py)")
    return path


def _recipe(**over):
    return {"task": "snli", "seed": 0, "data": {"on_invalid": "set_aside"}, "configs": ["z_filtered", "seq_z", "par_z"],
            **over}


def test_a_build_with_the_filters_and_the_self_audit_records_every_decision(d0_file, new_file, tmp_path):
    rec = _recipe(generated_filters={"near_duplicates": True}, self_audit={"configs": ["seq_z"]})
    out = tmp_path / "rel"
    res = build(rec, out, data_files={"train": str(d0_file)}, new_rows_files=[str(new_file)], progress=False)
    m = json.loads((out / "manifest.json").read_text())
    stages = {s["stage"]: s for s in m["stages"]}
    nd = stages["new rows filter: near_duplicates"]
    assert nd["counts"]["dropped"] >= 30 and nd["counts"]["kept"] == nd["counts"]["rows"] - nd["counts"]["dropped"]
    sa = stages["seq_z: self-audit"]
    assert sa["report"]["converged"] and sa["counts"]["dropped"] > 0
    assert m["recipe"]["self_audit"]["configs"] == ["seq_z"]
    # the near-duplicates' decisions: the new rows kept and dropped, each dropped with its reason
    folder = out / "decisions" / "new_rows" / "filter-near_duplicates"
    dropped = pq.read_table(folder / "dropped.parquet").to_pydict()
    assert len(dropped["uid"]) == nd["counts"]["dropped"] and all(r.startswith("near_duplicate") for r in dropped["reason"])
    # seq_z's own audit is under the threshold; par_z, not self-audited, is not
    from datasets import load_dataset
    seq = load_dataset(str(out), "seq_z", split="train")
    own = audit_dataset(seq, "snli", progress=False)
    assert own["max_abs_z"] <= own["z_threshold"]
    assert res.configs["seq_z"] == len(seq)
    # it had work to do: the composed seq_z's own audit was over the threshold (the planted "zorbly" rows)
    first = sa["report"]["rounds"][0]["before"]
    assert first["max_abs_z"] > first["z_threshold"]
    # the self-audit's dropped rows are in rejected/seq_z with the round, and no row is lost or kept twice
    rej = pq.read_table(next((out / "rejected" / "seq_z").glob("*.parquet"))).to_pydict()
    audited = [r for r in rej["rejected_by"] if r[0].startswith("self-audit round ")]
    assert all(len(r) >= 2 for r in audited)  # the round, then the biased features that rejected the row
    assert len(audited) == sa["counts"]["dropped"]
    assert set(seq["uid"]).isdisjoint(rej["uid"])
    # the release's label counts are those of the rows seq_z has after the self-audit
    counts = m["label_distribution"]["seq_z"]["train"]
    assert sum(counts.values()) == len(seq) == sa["counts"]["kept"]
    # a replay reuses the recorded near-duplicate decisions and gives the same release
    out2 = tmp_path / "rel2"
    build(rec, out2, data_files={"train": str(d0_file)}, new_rows_files=[str(new_file)], progress=False, replay=out)
    m2 = json.loads((out2 / "manifest.json").read_text())
    assert {s["stage"]: s for s in m2["stages"]}["new rows filter: near_duplicates"]["replay"]
    assert [f["sha256"] for f in m2["files"]["seq_z"]["train"]] == [f["sha256"] for f in m["files"]["seq_z"]["train"]]


def test_without_the_options_the_manifest_does_not_name_them(d0_file, tmp_path):
    out = tmp_path / "rel"
    build(_recipe(configs=["z_filtered"]), out, data_files={"train": str(d0_file)}, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert "generated_filters" not in m["recipe"] and "self_audit" not in m["recipe"]
    assert not any("self-audit" in s["stage"] or "filter:" in s["stage"] for s in m["stages"])


@pytest.mark.parametrize("over, match", [
    ({"generated_filters": {"near_duplicates": {"threshold": 1.5}}}, r"near_duplicates.threshold. must be"),
    ({"generated_filters": {"near_duplicates": {"treshold": 0.8}}}, r"unknown key near_duplicates.treshold"),
    ({"generated_filters": {"fluency": {"quantile": 0.05}}}, r"fluency.lm. must be"),
    ({"generated_filters": {"fluency": "gpt2"}}, r"fluency. must be"),
    ({"self_audit": {"configs": ["seqz"]}}, r"self_audit.configs. must be"),
    ({"self_audit": {"configs": ["seq_z"], "alpha": 2}}, r"self_audit.alpha. must be"),
    ({"generated_filter": {}}, r"unknown recipe key"),
])
def test_wrong_settings_are_named(over, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe(_recipe(**over))


def _quality(rows_file, d0_file, out, env_extra=None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "debiased_nli.cli", "quality", "snli", "--data-files", f"train={rows_file}",
                        "--reference", str(d0_file), "--out", str(out), "-q"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return out / "quality.json"


def test_quality_reports_go_into_the_card_and_manifest_of_the_release_they_measured(d0_file, new_file, tmp_path):
    report = _quality(new_file, d0_file, tmp_path / "q_new")
    out = tmp_path / "rel"
    build(_recipe(), out, data_files={"train": str(d0_file)}, new_rows_files=[str(new_file)], progress=False,
          quality=[str(report)])
    m = json.loads((out / "manifest.json").read_text())
    q = json.loads(report.read_text())
    [entry] = m["quality"]
    assert entry["set"].startswith("new rows") and entry["rows"] == 300 == q["rows"]
    assert entry["pair_copy_share"] == q["copies"]["pair_copy_share"] > 0  # the 20 copies of D0 rows
    card = (out / "README.md").read_text()
    section = card.split("## Quality of the generated rows (measured)")[1].split("\n## ")[0]
    assert "### new rows (D_G, as composed)" in section and "copied from D0" in section
    assert "#### Examples of the rows" in section  # 20 of the rows, under the set's heading
    # the limitations' paragraph on generated rows points at the measured quality, whose anchor exists
    assert "(their\n  measured quality: [below](#quality-of-the-generated-rows-measured))" in card
    # seq_z's own generated rows: a report on them (taken from the release) matches that config
    from datasets import load_dataset
    seq = load_dataset(str(out), "seq_z", split="train")
    gen = seq.filter(lambda r: r["origin"] == "generated")
    gen.select_columns(["premise", "hypothesis", "label"]).to_parquet(str(tmp_path / "seq_gen.parquet"))
    rep2 = _quality(tmp_path / "seq_gen.parquet", d0_file, tmp_path / "q_seq")
    out2 = tmp_path / "rel2"
    build(_recipe(), out2, data_files={"train": str(d0_file)}, new_rows_files=[str(new_file)], progress=False,
          quality=[str(report), str(rep2.parent)])
    sets = [e["set"] for e in json.loads((out2 / "manifest.json").read_text())["quality"]]
    assert sets == ["new rows (D_G, as composed)", "seq_z: its generated rows"]
    # a report of other rows, or against another D0, is refused before anything is written
    with pytest.raises(ConfigError, match="are none of this release's sets"):
        build(_recipe(), tmp_path / "rel3", data_files={"train": str(d0_file)}, new_rows_files=[str(tmp_path / "seq_gen.parquet")],
              progress=False, quality=[str(report)])
    assert not (tmp_path / "rel3").exists()
    with pytest.raises(ConfigError, match="not a report of `debiased-nli quality`"):
        (tmp_path / "fake.json").write_text("{}")
        build(_recipe(), tmp_path / "rel4", data_files={"train": str(d0_file)}, progress=False,
              quality=[str(tmp_path / "fake.json")])
