"""Sharded, resumable sampling: shards by rank, a 2-process run equals a 1-process run, a killed run
resumes to the same result, every sample parsed back or kept as a reject with its reason."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from debiased_nli.utils.errors import ConfigError
from debiased_nli.data.tasks import get_task
from debiased_nli.methods.generation.sample import (Prompting, SamplingOptions, generate_samples, load_generated,
                                                    shard_sizes, shard_seed)

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


SNLI = get_task("snli")
OPTS = SamplingOptions(num_shards=4, batch_size=3, max_new_tokens=8, seed=7, top_p=1.0)
PROMPTS = Prompting("premise+label", premises=PREMISES)


def sample(generator, out, n: int, opts: SamplingOptions = OPTS, **run):
    """``generate_samples`` from PREMISES with a label each, on the CPU, without progress bars."""
    return generate_samples(generator, str(out), SNLI, n, opts, PROMPTS, **{"cpu": True, "progress": False, **run})


def table(folder, name):
    return pq.read_table(Path(folder) / name).to_pylist()


def test_shards_split_the_samples_and_have_their_own_seeds():
    assert shard_sizes(10, 4) == [3, 3, 2, 2] and sum(shard_sizes(5_000_000, 7)) == 5_000_000
    seeds = {shard_seed(0, i) for i in range(100)}
    assert len(seeds) == 100 and shard_seed(0, 3) == shard_seed(0, 3) != shard_seed(1, 3)


def test_every_sample_is_a_parsed_canonical_row_or_a_reject_with_its_reason(generator, tmp_path):
    rep = sample(generator, tmp_path / "g", 13)
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
    sample(generator, full, 13)
    assert sample(generator, cut, 13, stop_after_shards=1) == {"stopped_after_shards": 1}
    assert sorted(p.name for p in cut.glob("shard-*")) == ["shard-00000-of-00004.parquet"]
    (cut / ".shard-00001-of-00004.parquet.tmp").write_bytes(b"half a shard, killed mid-write")
    sample(generator, cut, 13)
    names = sorted(p.name for p in full.glob("*-of-*.parquet"))
    assert names == sorted(p.name for p in cut.glob("*-of-*.parquet")) and len(names) == 8
    for name in names:
        assert table(full, name) == table(cut, name)
    # a complete run is not redone
    before = (cut / names[0]).stat().st_mtime_ns
    sample(generator, cut, 13)
    assert (cut / names[0]).stat().st_mtime_ns == before


def test_rerun_with_other_parameters_into_the_same_folder_is_refused(generator, tmp_path):
    sample(generator, tmp_path / "g", 4, replace(OPTS, num_shards=1))
    with pytest.raises(ConfigError, match="another run"):
        sample(generator, tmp_path / "g", 4, replace(OPTS, num_shards=1, seed=8))


def test_extend_grows_a_run_into_the_run_a_fresh_command_makes(generator, tmp_path):
    opts = replace(OPTS, num_shards=None, shard_size=3)
    grown, fresh = tmp_path / "grown", tmp_path / "fresh"
    sample(generator, grown, 6, opts)                # 2 shards of 3
    sample(generator, fresh, 12, opts)               # 4 shards of 3, from scratch
    with pytest.raises(ConfigError, match="--extend grows that run"):
        sample(generator, grown, 12, opts)
    before = (grown / "shard-00000-of-00002.parquet").read_bytes()
    rep = sample(generator, grown, 12, opts, extend=True)
    names = sorted(p.name for p in fresh.glob("*-of-*.parquet"))
    assert names == sorted(p.name for p in grown.glob("*-of-*.parquet")) and len(names) == 8
    for name in names:
        assert table(fresh, name) == table(grown, name), name
    assert (grown / "shard-00000-of-00004.parquet").read_bytes() == before   # kept (renamed), not sampled again
    cfg = json.loads((grown / "generate_config.json").read_text())
    assert cfg["num_samples"] == 12 and cfg["extended_from"] == [{"num_samples": 6, "num_shards": 2}]
    assert rep["samples"] == 12 and rep["config"]["extended_from"] == cfg["extended_from"]
    # the same command again, with or without --extend, resumes (nothing to do) rather than refusing
    sample(generator, grown, 12, opts, extend=True)
    sample(generator, grown, 12, opts)
    assert json.loads((grown / "generate_config.json").read_text()) == cfg


def test_extend_refuses_what_would_not_be_the_fresh_run(generator, tmp_path):
    opts = replace(OPTS, num_shards=None, shard_size=3)
    sample(generator, tmp_path / "g", 7, opts)       # shards of 3, 2 and 2 samples
    with pytest.raises(ConfigError, match="not the first shards of 12 samples"):
        sample(generator, tmp_path / "g", 12, opts, extend=True)
    with pytest.raises(ConfigError, match="only --num-samples may change"):
        sample(generator, tmp_path / "g", 12, replace(opts, seed=8), extend=True)
    with pytest.raises(ConfigError, match="does not grow it"):
        sample(generator, tmp_path / "g", 5, opts, extend=True)
    assert sorted(p.name for p in (tmp_path / "g").glob("shard-*")) == [f"shard-0000{i}-of-00003.parquet"
                                                                        for i in range(3)]


def test_two_processes_write_disjoint_shards_whose_union_is_the_one_process_run(generator, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["generate", "snli", "--generator", generator, "--num-samples", "13", "--num-shards", "4",
            "--batch-size", "3", "--max-new-tokens", "8", "--seed", "7", "--top-p", "1.0",
            "--condition", "premise+label", "--cpu"]
    prem = tmp_path / "premises.jsonl"
    prem.write_text("".join(json.dumps({"premise": p}) + "\n" for p in PREMISES))
    args += ["--premises-from", str(prem)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    sample(generator, one, 13)  # the 1-process run, in this process
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


# ---- the fast engine (SlotSampler) -------------------------------------------------------------------

def llama_generator(path, logit_scale: float = 1.0) -> str:
    """A tiny LLaMA (grouped-query attention: 4 query heads on 2 key/value heads, rotary positions) with
    the GPT-2 tokenizer; its end marker's output row is scaled up, so some samples end early.
    ``logit_scale`` scales every output row first: above 1 the next-token distribution is peaked, as a trained
    model's is, instead of nearly flat over 50k tokens."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight *= logit_scale
        model.lm_head.weight[tok.eos_token_id] *= 150 / logit_scale
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_generator(tmp_path_factory.mktemp("llama"))


def slot_jobs(tok, n: int, max_new: int):
    from debiased_nli.methods.generation.format import SequenceFormat
    from debiased_nli.methods.generation.sample import SlotJob, sample_uniforms
    fmt = SequenceFormat.for_tokenizer(tok, ["entailment", "neutral", "contradiction"])
    long = "A man in a blue shirt and a woman in a red hat walk their three dogs along the beach at sunset."
    prompts = [fmt.prompt((PREMISES + [long])[j % 6], "neutral" if j % 2 else None) for j in range(n)]
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    # the longest prompts come last: the slots' capacity has to grow in the middle of the run
    return [SlotJob(key=j, prompt=prompts[j], ids=ids[j], uniforms=sample_uniforms(5, j, max_new))
            for j in sorted(range(n), key=lambda k: len(ids[k]))]


@pytest.mark.parametrize("which", ["gpt2", "llama"])
@pytest.mark.parametrize("top_p,temperature", [(1.0, 1.0), (0.95, 1.3)])
def test_the_fast_engine_draws_every_token_from_the_models_distribution_at_the_samples_own_uniform(
        generator, llama, which, top_p, temperature):
    """The slot machinery (in-place keys/values, refills in freed slots, prompts of other lengths,
    capacity growth, the batch shrinking at the end) against the plain definition: a full forward
    pass over prompt + the tokens so far, without any cache, with the model's own attention, then the
    inverse CDF of the (temperature, top-p) distribution at the sample's uniform number."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    from debiased_nli.methods.generation.models import load_generator
    from debiased_nli.methods.generation.sample import SlotSampler
    model, tok = load_generator(generator if which == "gpt2" else llama)
    model.eval()
    max_new, eos = 12, tok.eos_token_id
    jobs = slot_jobs(tok, 11, max_new)
    before = model.config._attn_implementation
    out = {job.key: tokens for job, tokens in SlotSampler(model, tok, slots=3, max_new_tokens=max_new, top_p=top_p,
                                                          temperature=temperature).run(jobs)}
    assert model.config._attn_implementation == before  # the model's attention is given back
    assert len(out) == len(jobs)
    lengths = []
    for job in jobs:
        tokens = out[job.key]
        lengths.append(len(tokens))
        assert 1 <= len(tokens) <= max_new and eos not in tokens[:-1]
        assert tokens[-1] == eos or len(tokens) == max_new
        with torch.no_grad():
            logits = model(torch.tensor([job.ids + tokens])).logits[0, len(job.ids) - 1:-1].float()
        for t, token in enumerate(tokens):
            scores = logits[t:t + 1]
            if temperature != 1.0:
                scores = TemperatureLogitsWarper(temperature)(None, scores)
            if top_p < 1.0:
                scores = TopPLogitsWarper(top_p)(None, scores)
            cdf = torch.softmax(scores[0].double(), -1).cumsum(0)
            x = job.uniforms[t] * cdf[-1].item()
            below = cdf[token - 1].item() if token else 0.0
            assert below - 1e-5 <= x <= cdf[token].item() + 1e-5, (job.key, t, token)
    assert len(set(lengths)) > 2  # samples of several lengths: slots were refilled at different steps


OPTS_FAST = replace(OPTS, num_shards=3)


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_the_fast_engine_is_deterministic_and_its_samples_do_not_depend_on_the_batch(generator, which,
                                                                                      tmp_path):
    """Each sample has its own random numbers: the same seed gives the same shards at any batch size
    (samples are refilled, reordered and grouped differently), and another seed other samples. (In
    float32 the batch changes the logits only in their last bits; a sample would change only if its
    uniform fell within that distance of a CDF boundary. A random-weight model's distribution is nearly flat
    over 50k tokens, so its CDF boundaries are ~2e-5 apart and such a flip turns up in a few hundred draws
    on some CPUs (the tiny LLaMA's batch-1 and batch-3 logits differ in their last bits on an AVX2-only AMD
    EPYC): the LLaMA here is given a trained model's peaked distribution.)"""
    generator = generator if which == "gpt2" else llama_generator(tmp_path / "peaked-llama", logit_scale=30.0)
    runs = {}
    for name, batch in (("b1", 1), ("b3", 3), ("b3_again", 3), ("b8", 8)):
        sample(generator, tmp_path / name, 13, replace(OPTS_FAST, batch_size=batch))
        runs[name] = {n: table(tmp_path / name, n) for n in ("shard-00000-of-00003.parquet",
                                                              "rejects-00000-of-00003.parquet",
                                                              "shard-00002-of-00003.parquet")}
    assert runs["b1"] == runs["b3"] == runs["b3_again"] == runs["b8"]
    sample(generator, tmp_path / "seed8", 13, replace(OPTS_FAST, seed=8))
    assert table(tmp_path / "seed8", "shard-00000-of-00003.parquet") != runs["b3"]["shard-00000-of-00003.parquet"]


def test_the_generate_engine_still_samples_and_resumes_a_run_from_before_the_engines(generator, tmp_path):
    out = tmp_path / "g"
    rep = sample(generator, out, 13, replace(OPTS, engine="generate"))
    assert rep["samples"] == 13 and rep["parsed"] > 0 and rep["this_run"]["engine"] == "generate"
    # a folder written before engines were recorded: its shards are model.generate's
    cfg = json.loads((out / "generate_config.json").read_text())
    del cfg["engine"], cfg["dtype"]
    (out / "generate_config.json").write_text(json.dumps(cfg))
    (out / "shard-00003-of-00004.parquet").unlink()
    sample(generator, out, 13, replace(OPTS, engine="generate"))  # resumes
    assert (out / "shard-00003-of-00004.parquet").exists()
    with pytest.raises(ConfigError, match="engine"):
        sample(generator, out, 13)


def test_the_fast_engine_gives_way_to_generate_for_what_only_generate_applies(generator, tmp_path):
    from debiased_nli.methods.generation.models import load_generator
    from debiased_nli.methods.generation.sample import fast_engine_unsupported, sampling_dtype
    model, _ = load_generator(generator)
    assert fast_engine_unsupported(model) is None
    model.generation_config.repetition_penalty = 1.3
    assert "repetition_penalty" in fast_engine_unsupported(model)
    assert sampling_dtype(None, torch.device("cpu")) is None and sampling_dtype("float32", "cpu") == "float32"
    assert sampling_dtype("auto", torch.device("cpu")) in (None, "bfloat16")
