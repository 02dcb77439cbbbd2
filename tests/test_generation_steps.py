"""The builder steps of the generation pipeline on the demo task: train G*, sample, confidence-filter."""
import os
import re
from pathlib import Path

import pytest
import torch

from debiased_nli.data.loading import load_task
from debiased_nli.data.tasks import get_task
from debiased_nli.methods.generation import PAPER_DEFAULTS
from debiased_nli.methods.generation.step import confidence_filter_step, generate_step, train_generator_step

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
DEMO = get_task("demo")


def test_paper_defaults():
    assert PAPER_DEFAULTS["lambda"] == 0.5 and PAPER_DEFAULTS["alpha"] == 1.0 and PAPER_DEFAULTS["tau"] == 0.95
    assert PAPER_DEFAULTS["generator"] == "gpt2-large" and PAPER_DEFAULTS["confidence_model"] == "roberta-large"
    assert PAPER_DEFAULTS["num_samples"] == {"snli": 5_000_000, "mnli": 4_000_000}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel
    tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
    base = tmp_path_factory.mktemp("steps")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=128, vocab_size=len(tok))).save_pretrained(base / "lm")
    tok.save_pretrained(base / "lm")
    names = {0: "entailment", 1: "neutral", 2: "contradiction"}
    tok.pad_token = tok.eos_token
    GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=128, vocab_size=len(tok),
                                             num_labels=3, id2label=names, label2id={v: k for k, v in names.items()},
                                             pad_token_id=tok.eos_token_id)).save_pretrained(base / "clf")
    tok.save_pretrained(base / "clf")
    return base


def test_debias_step_z_filters_the_input_and_trains_g_star(tiny, tmp_path):
    ds = load_task("demo", max_rows=600).dataset
    out, dropped, rep = train_generator_step(ds, DEMO, {"model": str(tiny / "lm"), "out": str(tmp_path / "gstar"),
                                                         "mode": "debias", "max_steps": 2, "batch_size": 4,
                                                         "cpu": True, "z_batch_size": 100})
    assert out is ds and dropped is None
    z = rep["z_filter"]
    assert z["kept"] + z["rejected"] == 600 and z["rejected"] > 0
    assert rep["rows"] == 600 and rep["steps"] == 2 and (tmp_path / "gstar" / "model.safetensors").exists()


def test_g_star_learns_from_the_z_d0_of_the_recipes_z_filter_settings(tiny, tmp_path, monkeypatch):
    """debias_params hands G* the recipe's z_filter values (min_z too: it was dropped before issue 47) and the
    train step passes each one to Z(D0)."""
    from debiased_nli.bias import compose
    from debiased_nli.methods.generation.step import debias_params

    recipe = {"z_filter": {"top_k": 7, "batch_size": 300, "p0": "prior", "min_z": 1.5}, "features": {"folds": 3}}
    p = debias_params({"model": "m", "out": "o"}, recipe, seed=11)
    assert {k: p[k] for k in ("top_k", "z_batch_size", "p0", "min_z", "folds", "z_seed")} == {
        "top_k": 7, "z_batch_size": 300, "p0": "prior", "min_z": 1.5, "folds": 3, "z_seed": 11}
    seen = {}
    real = compose.z_filtered_original

    def spy(d0, task, **kw):
        seen.update(kw)
        return real(d0, task, **kw)

    monkeypatch.setattr(compose, "z_filtered_original", spy)
    ds = load_task("demo", max_rows=300).dataset
    train_generator_step(ds, DEMO, {**p, "model": str(tiny / "lm"), "out": str(tmp_path / "gstar"), "mode": "debias",
                                    "max_steps": 1, "batch_size": 4, "cpu": True, "progress": False})
    assert (seen["top_k"], seen["batch_size"], seen["p0"], seen["min_z"], seen["folds"], seen["seed"]) == (
        7, 300, "prior", 1.5, 3, 11)


def test_generate_and_confidence_steps_account_for_every_row(tiny, tmp_path):
    ds = load_task("demo", max_rows=20).dataset
    rows, rejects, rep = generate_step(ds, DEMO, {"generator": str(tiny / "lm"), "out": str(tmp_path / "g"),
                                                    "num_samples": 6, "num_shards": 2, "batch_size": 3,
                                                    "max_new_tokens": 6, "condition": "premise", "cpu": True,
                                                    "progress": False})
    assert len(rows) + len(rejects) == 6 == rep["samples"]
    kept, rejected, crep = confidence_filter_step(ds, DEMO, {"model": str(tiny / "clf"), "tau": 0.34,
                                                               "progress": False})
    assert len(kept) + len(rejected) == 20 == crep["rows"]


@pytest.mark.parametrize("recipe,samples", [("snli", 5_000_000), ("mnli", 4_000_000)])
def test_the_paper_profile_uses_tables_7_and_8_and_sampling_covers_the_training_length(recipe, samples):
    from debiased_nli.methods.generation import GENERATOR_TRAINING
    from debiased_nli.methods.generation.step import generator_training_values, sampling_values
    from debiased_nli.release.recipe import load_recipe

    root = Path(__file__).resolve().parents[1]
    step = load_recipe(root / f"builders/{recipe}.yaml", profile="paper")["new_rows"][0]
    for part in ("train", "debias"):
        values, sources = generator_training_values(step[part])
        for name in ("lr", "batch_size", "epochs", "eps", "betas", "scheduler", "max_length", "lam", "alpha"):
            assert values[name] == GENERATOR_TRAINING[name][0], (part, name)
            assert sources[name].startswith("Wu et al. 2022, Table 7"), (part, name, sources[name])
    assert (values["lr"], values["batch_size"], values["epochs"], values["eps"]) == (1e-5, 24, 5, 1e-6)
    assert values["scheduler"] == "constant" and tuple(values["betas"]) == (0.9, 0.999)
    gen, gen_sources = sampling_values(step["generate"], recipe)
    assert gen["top_p"] == 1.0 and "randomly sample" in gen_sources["top_p"]   # no nucleus mass in the paper
    assert gen["max_new_tokens"] >= step["train"]["max_length"] - 2 and gen["num_samples"] == samples
    # a value that differs from the table is reported as given, with the table's value beside it
    _, src = generator_training_values({"lr": 5e-5})
    assert src["lr"].startswith("given") and "1e-05" in src["lr"]


def test_generator_source_step_trains_samples_and_filters(tiny, tmp_path, capsys):
    from debiased_nli.methods.generation.step import generator_source
    from test_generation_sample import eos_generator
    lm = eos_generator(tmp_path / "eos_lm")  # samples that parse about half of the time
    ctx = {"recipe": {"data": {"split": "train", "data_files": None, "max_rows": 40}}}
    rows, dropped, reports = generator_source(DEMO, {
        "train": {"model": lm, "out": str(tmp_path / "G"), "max_steps": 1, "batch_size": 4, "cpu": True, "lr": 1e-9},
        "generate": {"out": str(tmp_path / "samples"), "num_samples": 8, "num_shards": 1, "batch_size": 4,
                     "max_new_tokens": 6, "condition": "premise+label", "cpu": True, "progress": False},
        "confidence": {"model": str(tiny / "clf"), "tau": 0.0, "progress": False},
    }, ctx)
    # the confidence filter's drops come back with M's confidence and the reason (tau 0: none here)
    assert len(dropped) == reports["confidence"]["rejected"] == 0
    assert {"confidence", "rejected_by"} <= set(dropped.column_names)
    assert set(reports) == {"train", "generate", "confidence"} and reports["train"]["steps"] == 1
    assert len(rows) == reports["generate"]["parsed"] == reports["confidence"]["kept"] > 0
    assert rows.column_names == ["premise", "hypothesis", "label", "uid", "origin", "method"]
    # the build prints every value the generation uses, with its source
    err = capsys.readouterr().err
    assert "train-generator (generator) values:" in err and "generate values:" in err
    assert re.search(r'eps = 1e-06 +Wu et al. 2022, Table 7: "Adam ϵ 1e-6"', err)
    assert re.search(r"lr = 1e-09 +given \(the default is 1e-05", err)
    assert re.search(r"top_p = 1.0 +Wu et al. 2022, Sec. 2.1", err)
