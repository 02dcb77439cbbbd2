"""Training G and G* with tiny models built from a config: checkpoints, resume, LoRA, merge."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from debiased_nli.data.loading import new_rows
from debiased_nli.data.tasks import get_task
from debiased_nli.methods.generation.models import LoraOptions, load_generator, merge_adapter
from debiased_nli.methods.generation.train import (REJECTED_COLUMN, GeneratorTraining, debias_training_set,
                                                   encode_dataset, epoch_order, perturbed_labels, train_generator)

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
SNLI = get_task("snli")
QUIET = dict(cpu=True, progress=False)  # how every training here runs


def rows(n=16):
    prem = ["A dog runs in the park.", "Two men play chess.", "A girl eats an apple.", "People wait for a bus."]
    hyp = ["An animal is outside.", "Nobody is playing.", "A child eats fruit.", "Someone is sleeping."]
    lab = ["entailment", "contradiction", "entailment", "neutral"]
    return new_rows("snli", [prem[i % 4] for i in range(n)], [hyp[i % 4] for i in range(n)],
                    [lab[i % 4] for i in range(n)], origin="perturbed", method="test")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=128, vocab_size=len(tok),
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_gpt2")
    GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(str(MODELS / "smollm2-135m-instruct"))
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_perturbed_label_is_never_the_gold_label():
    labels = np.arange(300) % 3
    pert = perturbed_labels(labels, 3, seed=1)
    assert (pert != labels).all() and set(pert) == {0, 1, 2}
    assert (pert == perturbed_labels(labels, 3, seed=1)).all()


def test_encoded_rows_carry_the_perturbed_label_sequence(tiny_gpt2):
    from debiased_nli.methods.generation.models import load_tokenizer
    tok = load_tokenizer(tiny_gpt2)
    enc = encode_dataset(rows(4), get_task("snli"), tok, seed=0, progress=False)
    for r, lab, pert in zip(enc, rows(4)["label"], perturbed_labels(np.array(rows(4)["label"]), 3, 0)):
        names = ("entailment", "neutral", "contradiction")
        assert f"label: {names[lab]}" in tok.decode(r["input_ids"])
        assert f"label: {names[pert]}" in tok.decode(r["p_input_ids"])
        # the same hypothesis tokens under both labels
        h = [t for t, m in zip(r["input_ids"], r["hypothesis"]) if m]
        hp = [t for t, m in zip(r["p_input_ids"], r["p_hypothesis"]) if m]
        assert h == hp and len(h) > 0


@pytest.mark.parametrize("which", ["tiny_gpt2", "tiny_llama"])
def test_g_runs_both_sequences_in_one_pass_with_the_logits_of_two(which, request):
    # one forward over the row and its perturbed-label copy (stacked, right-padded to the longer): the same logits
    # and loss as a pass for each (causal attention; padding after every real token)
    from debiased_nli.methods.generation.losses import generator_loss
    from debiased_nli.methods.generation.models import load_tokenizer
    from debiased_nli.methods.generation.train import joint_logits, batch_loss, collate
    folder = request.getfixturevalue(which)
    tok = load_tokenizer(folder)
    model, _ = load_generator(folder)
    model.eval()
    enc = encode_dataset(rows(8), SNLI, tok, seed=3, progress=False)
    batch = collate([enc[i] for i in range(8)], tok.pad_token_id)
    assert batch["input_ids"].shape[1] != batch["p_input_ids"].shape[1]  # the padding case is exercised
    with torch.no_grad():
        joint, p_joint, padded = joint_logits(model, batch)
        alone = model(input_ids=batch["input_ids"], attention_mask=batch["mask"]).logits
        p_alone = model(input_ids=batch["p_input_ids"], attention_mask=batch["p_mask"]).logits
        for got, want, m, key in ((joint, alone, batch["mask"], "mask"), (p_joint, p_alone, batch["p_mask"], "p_mask")):
            assert got.shape[0] == want.shape[0] and padded[key][:, m.shape[1]:].sum() == 0  # padding, masked out
            torch.testing.assert_close(got[:, :m.shape[1]][m.bool()], want[m.bool()], rtol=1e-5, atol=1e-5)
        loss, parts = batch_loss(model, batch, mode="generator", lam=0.5, alpha=1.0)
        want_loss, want_parts = generator_loss(alone, batch["input_ids"], batch["mask"], p_alone,
                                               batch["p_input_ids"], batch["p_hypothesis"], lam=0.5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert parts.keys() == want_parts.keys() and parts["label_consistency"] > 0


def weights(folder):
    model, _ = load_generator(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_training_lowers_the_loss_and_a_killed_run_resumes_to_the_same_weights(tiny_gpt2, tmp_path):
    opts = GeneratorTraining(max_steps=6, batch_size=4, lr=1e-2, checkpoint_every=2, seed=0, log_every=1)
    full = train_generator(rows(), SNLI, tiny_gpt2, str(tmp_path / "a"), opts, **QUIET)
    assert full["history"][-1]["loss"] < full["history"][0]["loss"]
    # 6 steps of 4 rows of 16: each row's sequence and its perturbed-label copy, no padding counted
    from debiased_nli.methods.generation.models import load_tokenizer
    enc = encode_dataset(rows(), get_task("snli"), load_tokenizer(tiny_gpt2), seed=0, progress=False)
    per_row = [len(r["input_ids"]) + len(r["p_input_ids"]) for r in enc]
    second_epoch = epoch_order([0] * 16, 1, 4, False)[:8]  # steps 5-6 read the first 8 rows of epoch 1's order
    assert full["tokens_this_run"] == sum(per_row) + sum(per_row[i] for i in second_epoch)
    assert full["tokens_per_s"] > 0
    assert full["history"][0]["label_consistency"] > 0
    # "kill" after 3 steps: the last checkpoint is step 2; the rerun resumes there
    assert train_generator(rows(), SNLI, tiny_gpt2, str(tmp_path / "b"), opts, stop_after=3, **QUIET) == {"stopped_at": 3}
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step-2"]
    resumed = train_generator(rows(), SNLI, tiny_gpt2, str(tmp_path / "b"), opts, **QUIET)
    assert resumed["resumed_from"] == "step-2" and resumed["steps_this_run"] == 4
    wa, wb = weights(str(tmp_path / "a")), weights(str(tmp_path / "b"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
    # only the last keep_checkpoints (2) checkpoints are kept
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step-2", "step-4"]


def test_epoch_order_without_grouping_is_the_datasets_shuffle():
    import datasets
    ds = datasets.Dataset.from_dict({"i": list(range(103))})
    assert epoch_order([5] * 103, 7, 4, False) == ds.shuffle(seed=7)["i"]


def test_grouped_epoch_order_is_a_permutation_of_length_homogeneous_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 60, size=1003).tolist()
    order = epoch_order(lengths, 3, 8, True)
    assert sorted(order) == list(range(1003))            # every row once
    assert order == epoch_order(lengths, 3, 8, True)      # seeded
    assert order != epoch_order(lengths, 4, 8, True)
    batches = [order[i:i + 8] for i in range(0, 1003, 8)]
    assert len(batches[-1]) == 1003 % 8                   # the shorter batch stays last
    padded = lambda order: sum(max(lengths[i] for i in order[j:j + 8]) * len(order[j:j + 8])
                               for j in range(0, len(order), 8))
    plain = epoch_order(lengths, 3, 8, False)
    # the padded tokens computed: grouped batches need far fewer than the plain shuffle's
    assert padded(order) < 0.8 * padded(plain)
    assert padded(order) - sum(lengths) < 0.2 * (padded(plain) - sum(lengths))
    # the batches' order is shuffled, not sorted by length
    firsts = [lengths[b[0]] for b in batches[:-1]]
    assert firsts != sorted(firsts) and firsts != sorted(firsts, reverse=True)


def test_grouped_training_resumes_to_the_same_weights(tiny_gpt2, tmp_path):
    opts = GeneratorTraining(max_steps=5, batch_size=3, lr=1e-2, checkpoint_every=2, seed=0, log_every=1,
                             group_by_length=True)
    full = train_generator(rows(24), SNLI, tiny_gpt2, str(tmp_path / "a"), opts, **QUIET)
    assert full["group_by_length"] is True
    assert train_generator(rows(24), SNLI, tiny_gpt2, str(tmp_path / "b"), opts, stop_after=3, **QUIET) == {"stopped_at": 3}
    train_generator(rows(24), SNLI, tiny_gpt2, str(tmp_path / "b"), opts, **QUIET)
    wa, wb = weights(str(tmp_path / "a")), weights(str(tmp_path / "b"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def test_llama_lora_adapter_is_saved_and_merges_to_the_same_model(tiny_llama, tmp_path):
    out = tmp_path / "lora"
    opts = GeneratorTraining(lora=LoraOptions(r=4, alpha=8, dropout=0.0), max_steps=2, batch_size=4, lr=1e-2)
    rep = train_generator(rows(8), SNLI, tiny_llama, str(out), opts, merge=True, **QUIET)
    assert rep["parameters"]["trainable"] < rep["parameters"]["total"]
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    adapted, tok = load_generator(str(out))
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(rep["merged"])
    ids = tok("premise: A dog.\nlabel: neutral\nhypothesis:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama)
        assert not torch.allclose(base(ids).logits, merged(ids).logits)
    again = merge_adapter(str(out), str(tmp_path / "merged2"))
    assert (Path(again) / "config.json").exists()
    # sampling from the adapter folder (merged on load) gives the samples of the merged model
    from debiased_nli.methods.generation.sample import SamplingOptions, generate_samples, load_generated
    sampling = SamplingOptions(num_shards=1, batch_size=2, max_new_tokens=5, seed=3)
    generate_samples(str(out), str(tmp_path / "s1"), SNLI, 2, sampling, **QUIET)
    generate_samples(rep["merged"], str(tmp_path / "s2"), SNLI, 2, sampling, **QUIET)
    for kind in ("shard", "rejects"):
        a, b = load_generated(str(tmp_path / "s1"), kind), load_generated(str(tmp_path / "s2"), kind)
        assert a.remove_columns(["generator", "checkpoint", "method", "uid"] if kind == "shard" else []).to_list() == \
            b.remove_columns(["generator", "checkpoint", "method", "uid"] if kind == "shard" else []).to_list()
    assert len(load_generated(str(tmp_path / "s1"))) + len(load_generated(str(tmp_path / "s1"), "rejects")) == 2


def test_lora_target_modules_option(tiny_llama):
    model, _ = load_generator(tiny_llama, lora=LoraOptions(r=2, target_modules="q_proj,v_proj"))
    names = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_A" in n}
    assert names == {"q_proj", "v_proj"}


def test_debias_fine_tune_applies_unlikelihood_to_the_rejected_rows(tiny_gpt2, tmp_path):
    import datasets
    kept = rows(8)
    rejected = rows(4).add_column("rejected_by", [["dog@hypothesis"], ["nobody@hypothesis"], ["hypo-len<5"], []],
                                  feature=datasets.Sequence(datasets.Value("string")))
    train = debias_training_set(kept, rejected)
    assert train[REJECTED_COLUMN] == [0] * 8 + [1] * 4
    rep = train_generator(train, SNLI, tiny_gpt2, str(tmp_path / "gstar"),
                          GeneratorTraining(mode="debias", max_steps=3, batch_size=12, lr=1e-2, log_every=1, alpha=1.0),
                          **QUIET)
    assert rep["mode"] == "debias" and all(h["unlikelihood"] > 0 for h in rep["history"])
    with pytest.raises(Exception, match="rejected_by"):
        debias_training_set(kept, rows(2))


def test_g_star_continues_a_lora_g_from_the_command_line(tiny_llama, tmp_path, shared_data):
    """`train-generator --mode debias --model <a LoRA G's folder>`: the adapter is continued (no --lora), G* is an
    adapter folder again and its card says so (the CPU pipeline's G* from its LoRA G)."""
    import json
    import subprocess
    import sys

    g = tmp_path / "G"
    train_generator(rows(8), SNLI, tiny_llama, str(g),
                    GeneratorTraining(lora=LoraOptions(r=4, alpha=8, dropout=0.0), max_steps=1, batch_size=4, lr=1e-2),
                    **QUIET)
    out = tmp_path / "Gstar"
    r = subprocess.run([sys.executable, "-m", "debiased_nli.cli", "train-generator", "snli", "--data-files",
                        str(shared_data / "snli" / "train_sample.parquet"), "--max-rows", "40", "--model", str(g),
                        "--out", str(out), "--mode", "debias", "--max-steps", "1", "--batch-size", "8", "--cpu",
                        "--quiet"], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and "LoRA adapter" in card and "full model" not in card
    rep = json.loads((out / "train_report.json").read_text())
    assert rep["mode"] == "debias" and rep["steps"] == 1 and rep["z_filter"]["input"] == 40
    assert "z-filtering: input 40" in card


def test_two_process_ddp_training_on_cpu(tiny_gpt2, tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
                          "-m", "debiased_nli.cli", "train-generator", "demo", "--max-rows", "32", "--model", tiny_gpt2,
                          "--out", str(tmp_path / "ddp"), "--max-steps", "3", "--batch-size", "4", "--cpu",
                          "--checkpoint-every", "2"], env=env, cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "ddp" / "train_report.json").read_text())
    assert report["processes"] == 2 and report["steps"] == 3
    cp = tmp_path / "ddp" / "checkpoints" / "step-2"
    assert (cp / "trainable.pt").exists() and (cp / "optimizer.bin").exists()
    # accelerator.save_state: every process's RNG states, not only the main one's
    assert (cp / "random_states_0.pkl").exists() and (cp / "random_states_1.pkl").exists()
    # only the main process prints the report and the values
    assert res.stdout.count('"mode": "generator"') == 1, res.stdout
    assert res.stderr.count("train-generator (generator) values:") == 1
    assert 'lr = 1e-05' in res.stderr and 'Table 7: "learning rate 1e-5"' in res.stderr


def test_gradient_accumulation_resumes_to_the_same_weights_and_saves_accelerate_state(tiny_gpt2, tmp_path):
    # 16 rows, micro-batch 3, 2 micro-batches per step: 6 micro-batches an epoch, 3 steps an epoch;
    # 7 steps cross two epoch ends. Kill after 4 steps (checkpoint at step 3, mid-way through the run).
    opts = GeneratorTraining(max_steps=7, batch_size=3, grad_accum=2, lr=1e-2, eps=1e-6, checkpoint_every=3, seed=1,
                             log_every=1, scheduler="linear", warmup_steps=2)
    full = train_generator(rows(), SNLI, tiny_gpt2, str(tmp_path / "a"), opts, **QUIET)
    assert full["steps"] == 7 and full["grad_accum"] == 2 and full["scheduler"] == "linear"
    assert train_generator(rows(), SNLI, tiny_gpt2, str(tmp_path / "b"), opts, stop_after=4, **QUIET) == {"stopped_at": 4}
    cp = tmp_path / "b" / "checkpoints" / "step-3"
    assert {"trainable.pt", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "state.json"} <= \
        {p.name for p in cp.iterdir()}
    assert not (cp / "model.safetensors").exists()  # only the trainable weights, through the hook
    resumed = train_generator(rows(), SNLI, tiny_gpt2, str(tmp_path / "b"), opts, **QUIET)
    assert resumed["resumed_from"] == "step-3" and resumed["steps_this_run"] == 4
    # the learning rate continues the schedule where it stopped
    assert [h["lr"] for h in resumed["history"]] == [h["lr"] for h in full["history"]][3:]
    wa, wb = weights(str(tmp_path / "a")), weights(str(tmp_path / "b"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def test_an_epoch_of_accumulated_micro_batches_is_ceil_of_half_the_batches(tiny_gpt2, tmp_path):
    # 16 rows in micro-batches of 3: 6 micro-batches; 4 per step: one full window and a short last one
    rep = train_generator(rows(), SNLI, tiny_gpt2, str(tmp_path / "e"),
                          GeneratorTraining(epochs=2, batch_size=3, grad_accum=4, lr=1e-3, log_every=1), **QUIET)
    assert rep["steps"] == 4 and [h["step"] for h in rep["history"]] == [1, 2, 3, 4]


def test_mixed_precision_is_left_to_accelerate_unless_given(tiny_gpt2, tmp_path, monkeypatch):
    from accelerate.state import AcceleratorState

    # what `accelerate launch --mixed_precision bf16` / `accelerate config` set for the process
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        rep = train_generator(rows(4), SNLI, tiny_gpt2, str(tmp_path / "env"),
                              GeneratorTraining(max_steps=1, batch_size=4), **QUIET)
        assert rep["mixed_precision"] == "bf16"
        AcceleratorState._reset_state(reset_partial_state=True)
        rep = train_generator(rows(4), SNLI, tiny_gpt2, str(tmp_path / "flag"),
                              GeneratorTraining(max_steps=1, batch_size=4, mixed_precision="no"), **QUIET)
        assert rep["mixed_precision"] == "no"  # the flag overrides it
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_the_defaults_are_table_7_of_the_paper():
    from debiased_nli.methods.generation import GENERATOR_TRAINING
    defaults = GeneratorTraining()
    table7 = {"lr": 1e-5, "batch_size": 24, "epochs": 5, "eps": 1e-6, "betas": (0.9, 0.999),
              "scheduler": "constant", "max_length": 128, "lam": 0.5, "alpha": 1.0}
    for name, value in table7.items():
        assert getattr(defaults, name) == value, name
        assert GENERATOR_TRAINING[name][0] == value and "Table 7" in GENERATOR_TRAINING[name][1]
    with pytest.raises(Exception, match="constant schedule has no warm-up"):
        train_generator(rows(4), SNLI, "unused", "unused", GeneratorTraining(warmup_steps=10))


def test_a_checkpoint_never_replaces_a_folder_it_did_not_write(tmp_path):
    from accelerate import Accelerator

    from debiased_nli.utils.errors import ConfigError
    from debiased_nli.methods.generation.train import checkpoints, save_checkpoint

    acc = Accelerator(cpu=True)
    save_checkpoint(acc, tmp_path, 1, keep=1)
    save_checkpoint(acc, tmp_path, 1, keep=1)  # its own step-1 is replaced
    assert [p.name for p in checkpoints(tmp_path)] == ["step-1"]
    mine = tmp_path / "checkpoints" / "step-2"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError, match="not a checkpoint of debiased-nli"):
        save_checkpoint(acc, tmp_path, 2, keep=1)
    assert (mine / "notes.txt").read_text() == "the user's"
    save_checkpoint(acc, tmp_path, 3, keep=1)  # pruning keeps the user's folder too (no state.json)
    assert (mine / "notes.txt").read_text() == "the user's"
    assert [p.name for p in checkpoints(tmp_path)] == ["step-3"]
