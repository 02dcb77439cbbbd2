"""Sharded, resumable sampling: shards by rank, a 2-process run equals a 1-process run, a killed run
resumes to the same result, every sample parsed back or kept as a reject with its reason."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from debiased_nli.utils.errors import ConfigError
from debiased_nli.methods.generation.sample import generate_samples, load_generated, shard_sizes, shard_seed

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
ROOT = Path(__file__).resolve().parents[1]
PREMISES = ["A dog runs in the park.", "Two men play chess.", "A girl eats an apple.", "People wait for a bus.",
            "A woman rides a bike."]


def eos_generator(path) -> str:
    """A tiny GPT-2 (real GPT-2 tokenizer) that ends a text with probability ~0.4 at every step.

    Its final layer norm outputs a constant vector along the end marker's embedding (tied output
    weights), so samples are short: some end at once (empty hypothesis -> a reject), the others after
    a few random tokens (a parsed row).
    """
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=256, vocab_size=len(tok))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    eos = tok.eos_token_id
    with torch.no_grad():
        model.transformer.wte.weight[eos] *= 10  # the end marker's direction dominates every other token's
    emb = model.transformer.wte.weight.detach()
    lo, hi = 0.0, 1e4
    for _ in range(60):  # scale c so that softmax(c * E e_eos)[eos] = 0.4
        c = (lo + hi) / 2
        p = torch.softmax(c * emb @ emb[eos], -1)[eos].item()
        lo, hi = (c, hi) if p < 0.4 else (lo, c)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(c * emb[eos])
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    return eos_generator(tmp_path_factory.mktemp("gen"))


KW = dict(num_shards=4, batch_size=3, max_new_tokens=8, seed=7, top_p=1.0, condition="premise+label",
          premises=PREMISES, cpu=True, progress=False)


def table(folder, name):
    return pq.read_table(Path(folder) / name).to_pylist()


def test_shards_split_the_samples_and_have_their_own_seeds():
    assert shard_sizes(10, 4) == [3, 3, 2, 2] and sum(shard_sizes(5_000_000, 7)) == 5_000_000
    seeds = {shard_seed(0, i) for i in range(100)}
    assert len(seeds) == 100 and shard_seed(0, 3) == shard_seed(0, 3) != shard_seed(1, 3)


def test_every_sample_is_a_parsed_canonical_row_or_a_reject_with_its_reason(generator, tmp_path):
    rep = generate_samples(generator, str(tmp_path / "g"), "snli", 13, **KW)
    rows, rej = load_generated(str(tmp_path / "g")), load_generated(str(tmp_path / "g"), "rejects")
    assert rep["samples"] == 13 == len(rows) + len(rej) and rep["parsed"] == len(rows)
    assert len(rows) > 0 and len(rej) > 0
    assert sorted(list(rows["sample_index"]) + list(rej["sample_index"])) == list(range(13))
    assert set(rej["reason"]) <= {"empty hypothesis", "no end marker (length limit reached)"}
    assert rows.features["label"].names == ["entailment", "neutral", "contradiction"]
    for r in rows:
        assert r["origin"] == "generated" and r["method"] == f"generator:{Path(generator).name}"
        assert r["uid"].startswith("generator:") and r["hypothesis"].strip()
        assert r["premise"] in PREMISES
        assert r["label"] == r["sample_index"] % 3  # premise+label prompts cycle through the labels
        assert r["seed"] == shard_seed(7, r["shard"])
    assert rep["labels"] and 0 <= rep["distinct_2_hypothesis"] <= 1
    assert json.loads((tmp_path / "g" / "generate_report.json").read_text())["parsed"] == len(rows)


def test_an_interrupted_run_resumes_to_the_same_result(generator, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    generate_samples(generator, str(full), "snli", 13, **KW)
    assert generate_samples(generator, str(cut), "snli", 13, stop_after_shards=1, **KW) == {"stopped_after_shards": 1}
    assert sorted(p.name for p in cut.glob("shard-*")) == ["shard-00000-of-00004.parquet"]
    (cut / ".shard-00001-of-00004.parquet.tmp").write_bytes(b"half a shard, killed mid-write")
    generate_samples(generator, str(cut), "snli", 13, **KW)
    names = sorted(p.name for p in full.glob("*-of-*.parquet"))
    assert names == sorted(p.name for p in cut.glob("*-of-*.parquet")) and len(names) == 8
    for name in names:
        assert table(full, name) == table(cut, name)
    # a complete run is not redone
    before = (cut / names[0]).stat().st_mtime_ns
    generate_samples(generator, str(cut), "snli", 13, **KW)
    assert (cut / names[0]).stat().st_mtime_ns == before


def test_rerun_with_other_parameters_into_the_same_folder_is_refused(generator, tmp_path):
    generate_samples(generator, str(tmp_path / "g"), "snli", 4, **{**KW, "num_shards": 1})
    with pytest.raises(ConfigError, match="another run"):
        generate_samples(generator, str(tmp_path / "g"), "snli", 4, **{**KW, "num_shards": 1, "seed": 8})


def test_two_processes_write_disjoint_shards_whose_union_is_the_one_process_run(generator, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["generate", "snli", "--generator", generator, "--num-samples", "13", "--num-shards", "4",
            "--batch-size", "3", "--max-new-tokens", "8", "--seed", "7", "--top-p", "1.0",
            "--condition", "premise+label", "--cpu"]
    prem = tmp_path / "premises.jsonl"
    prem.write_text("".join(json.dumps({"premise": p}) + "\n" for p in PREMISES))
    args += ["--premises-from", str(prem)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    generate_samples(generator, str(one), "snli", 13, **KW)  # the 1-process run, in this process
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
                          "-m", "debiased_nli.cli", *args, "--out", str(two)], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 1" in res.stderr  # the second process really ran
    report = json.loads((two / "generate_report.json").read_text())
    assert report["this_run"]["processes"] == 2
    names = sorted(p.name for p in one.glob("*-of-*.parquet"))
    assert names == sorted(p.name for p in two.glob("*-of-*.parquet")) and len(names) == 8
    seen = []
    for name in names:
        assert table(one, name) == table(two, name)
        seen += [r["sample_index"] for r in table(two, name)]
    assert sorted(seen) == list(range(13))  # disjoint, and together every sample
