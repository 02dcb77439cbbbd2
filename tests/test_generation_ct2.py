"""generate --engine ctranslate2: the converted model is cached by fingerprint, shards/rejects/config/resume work
as for the other engines, and CTranslate2 samples the model's own distribution (not its greedy default) with
the same parse rate and lengths as the fast engine, on a tiny LLaMA built from a config."""
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("ctranslate2")

from test_generation_sample import PREMISES, llama_generator, sample  # noqa: E402

from debiased_nli.methods.generation.sample import SamplingOptions, load_generated  # noqa: E402
from debiased_nli.utils.errors import ConfigError  # noqa: E402

OPTS = SamplingOptions(num_shards=3, batch_size=4, max_new_tokens=8, seed=7, engine="ctranslate2", dtype="float32")


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny LLaMA with a trained model's peaked next-token distribution (and its end marker boosted)."""
    return llama_generator(tmp_path_factory.mktemp("peaked-llama"), logit_scale=30.0)


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "ctranslate2").glob("ct2-*"))


def test_ctranslate2_runs_like_the_other_engines_shards_rejects_config_resume_and_a_cached_model(peaked, tmp_path):
    cache = Path(os.environ["DEBIASED_NLI_CACHE"])
    rep = sample(peaked, tmp_path / "full", 13, OPTS)
    rows, rej = load_generated(str(tmp_path / "full")), load_generated(str(tmp_path / "full"), "rejects")
    assert rep["samples"] == 13 == len(rows) + len(rej)
    assert sorted(list(rows["sample_index"]) + list(rej["sample_index"])) == list(range(13))
    cfg = json.loads((tmp_path / "full" / "generate_config.json").read_text())
    assert cfg["engine"] == "ctranslate2" and cfg["dtype"] == "float32"
    run = rep["this_run"]
    assert run["engine"] == "ctranslate2" and run["dtype"] == "float32" and run["ctranslate2"]["compute_type"] == "float32"
    entries = _entries(cache)
    assert len(entries) == 1 and entries[0].name.endswith("-float32") and Path(run["ctranslate2"]["model"]) == entries[0]
    assert (entries[0].parent / f".{entries[0].name}.debiased-nli").exists()  # recorded as this tool's cache entry
    stamp = entries[0].stat().st_mtime_ns

    # a killed run (one shard done) resumes to the same shards as the uninterrupted run: shard i's samples
    # depend on its seed and prompts only
    part = tmp_path / "part"
    assert sample(peaked, part, 13, OPTS, stop_after_shards=1) == {"stopped_after_shards": 1}
    assert len(list(part.glob("shard-*"))) == 1
    sample(peaked, part, 13, OPTS)
    for kind in ("shard", "rejects"):
        for i in range(3):
            name = f"{kind}-{i:05d}-of-00003.parquet"
            assert pq.read_table(part / name).to_pylist() == pq.read_table(tmp_path / "full" / name).to_pylist()
    assert _entries(cache) == entries and entries[0].stat().st_mtime_ns == stamp  # converted once, reused

    # another compute type is another run: refused in the same folder, and it gets its own cached model
    with pytest.raises(ConfigError, match="dtype"):
        sample(peaked, tmp_path / "full", 13, replace(OPTS, dtype="int8"))
    rep8 = sample(peaked, tmp_path / "int8", 13, replace(OPTS, dtype="int8"))
    assert rep8["this_run"]["dtype"] == "int8" and len(_entries(cache)) == 2
    with pytest.raises(ConfigError, match="compute type"):
        sample(peaked, tmp_path / "bad", 13, replace(OPTS, dtype="int4"))
    with pytest.raises(ConfigError, match="ctranslate2"):
        sample(peaked, tmp_path / "bad", 13, replace(OPTS, engine="fast", dtype="int8"))


def test_a_changed_generator_gets_a_new_converted_model(peaked, tmp_path):
    from debiased_nli.methods.generation.ct2 import generator_fingerprint
    import shutil
    other = tmp_path / "other"
    shutil.copytree(peaked, other)
    assert generator_fingerprint(str(other)) == generator_fingerprint(peaked)
    (other / "config.json").write_text((other / "config.json").read_text().replace("256", "255"))
    assert generator_fingerprint(str(other)) != generator_fingerprint(peaked)


@pytest.mark.parametrize("top_p,temperature", [(1.0, 1.0), (0.9, 1.3)])
def test_ctranslate2_draws_from_the_models_distribution_not_greedily(peaked, top_p, temperature):
    """The first new token of 3,000 samples of one prompt against the model's exact (temperature, top-p)
    distribution: chi-square goodness of fit over the tokens expected 5 times or more (the rest pooled).
    CTranslate2's default sampling_topk=1 would give one token every time."""
    from scipy import stats
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    from debiased_nli.methods.generation.ct2 import converted_model, ct2_shards
    from debiased_nli.methods.generation.format import SequenceFormat
    from debiased_nli.methods.generation.models import load_generator
    from debiased_nli.methods.generation.sample import SamplingOptions
    model, tok = load_generator(peaked)
    model.eval()
    prompt = SequenceFormat.for_tokenizer(tok, ["entailment", "neutral", "contradiction"]).prompt(PREMISES[0], "neutral")
    with torch.no_grad():
        scores = model(torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])).logits[:, -1].float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    p = torch.softmax(scores[0].double(), -1).numpy()
    n = 3000
    opts = SamplingOptions(batch_size=500, top_p=top_p, temperature=temperature, max_new_tokens=1)
    [(_, _, samples)] = list(ct2_shards(converted_model(peaked, "float32"), tok, [(0, 11, range(n))],
                                        lambda idx: [prompt] * len(idx), opts, tick=lambda k: None,
                                        compute_type="float32"))
    # a sample is one token, known by its text: tokens of the same text (partial UTF-8 bytes decode to the
    # same replacement character) form one category, whose probability is theirs together
    texts = tok.batch_decode([[t] for t in range(len(p))], skip_special_tokens=False)
    prob: dict[str, float] = {}
    for text, q in zip(texts, p):
        prob[text] = prob.get(text, 0.0) + q
    first = [text for _, _, text in samples]
    assert len(set(first)) > 5
    assert min(prob.get(t, 0.0) for t in first) > 0  # no token outside the top-p set
    big = [t for t, q in prob.items() if q * n >= 5]
    counts = {t: 0 for t in big}
    for t in first:
        if t in counts:
            counts[t] += 1
    observed = np.array([counts[t] for t in big] + [n - sum(counts.values())])
    expected = np.array([prob[t] for t in big] + [max(1 - sum(prob[t] for t in big), 0.0)]) * n
    keep = expected > 0
    chi2, pval = stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum())
    assert pval > 1e-3, (chi2, pval)


def test_ctranslate2_and_the_fast_engine_give_the_same_parse_rate_and_lengths(peaked, tmp_path):
    """600 samples of each engine (float32) from the same prompts: the parse rate (chi-square) and the number
    of the parsed hypotheses' tokens (two-sample KS) agree; max_new_tokens counts new tokens for prompts of every
    length."""
    from scipy import stats

    from debiased_nli.methods.generation.models import load_tokenizer
    tok = load_tokenizer(peaked)
    n, max_new = 600, 6
    opts = replace(OPTS, num_shards=2, batch_size=64, max_new_tokens=max_new)
    out = {}
    for engine in ("fast", "ctranslate2"):
        rep = sample(peaked, tmp_path / engine, n, replace(opts, engine=engine))
        rows, rej = load_generated(str(tmp_path / engine)), load_generated(str(tmp_path / engine), "rejects")
        lengths = [len(tok(h, add_special_tokens=False)["input_ids"]) for h in rows["hypothesis"]]
        out[engine] = (rep["parsed"], rep["samples"] - rep["parsed"], lengths, rej)
    (pf, rf, lf, _), (pc, rc, lc, rejc) = out["fast"], out["ctranslate2"]
    assert 0.2 < pf / n < 0.98 and 0.2 < pc / n < 0.98  # both outcomes happen: the test can tell them apart
    assert stats.chi2_contingency([[pf, rf], [pc, rc]])[1] > 1e-3
    assert stats.ks_2samp(lf, lc).pvalue > 1e-3
    # some samples reach the limit; were it counting the prompt too (CTranslate2's include_prompt_in_result=True),
    # every prompt here is longer than 6 tokens and no sample could end: the parse rates above would differ
    assert "no end marker (length limit reached)" in set(rejc["reason"])
