"""The CUDA code paths of the generator pipeline: the fast sampling engine in bfloat16, bf16 mixed-precision
training of G with a resume, and the (calibrated) confidence filter. Skipped without a CUDA GPU (CI has
none); benchmarks/gpu_kit.py runs this file on a lent GPU (its ``cuda_tests`` step) and keeps the
output in its logs."""
import numpy as np
import pytest
import torch

from debiased_nli.data.tasks import get_task

SNLI = get_task("snli")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from test_generation_sample import llama_generator
    return llama_generator(tmp_path_factory.mktemp("llama"), logit_scale=30.0)


def test_the_fast_engine_on_cuda_draws_each_token_at_its_uniform_in_bfloat16(llama):
    """As the CPU test of the slot sampler, on the GPU in bfloat16: every drawn token is the one the
    sample's uniform picks from the model's distribution after a full forward pass without cache (the same
    weights and dtype; the cached and uncached bf16 logits differ by rounding, hence the tolerance)."""
    from test_generation_sample import slot_jobs

    from debiased_nli.methods.generation.models import load_generator
    from debiased_nli.methods.generation.sample import SlotSampler

    model, tok = load_generator(llama)
    model = model.to("cuda", torch.bfloat16).eval()
    jobs = slot_jobs(tok, 9, 10)
    out = {j.key: t for j, t in SlotSampler(model, tok, slots=4, max_new_tokens=10).run(jobs)}
    assert len(out) == len(jobs)
    checked = off = 0
    for job in jobs:
        tokens = out[job.key]
        with torch.no_grad():
            logits = model(torch.tensor([job.ids + tokens], device="cuda")).logits[0, len(job.ids) - 1:-1].float()
        for t, token in enumerate(tokens):
            cdf = torch.softmax(logits[t].double(), -1).cumsum(0).cpu()
            x = job.uniforms[t] * cdf[-1].item()
            below = cdf[token - 1].item() if token else 0.0
            checked += 1
            off += not (below - 2e-2 <= x <= cdf[token].item() + 2e-2)
    assert checked > 20 and off == 0


@pytest.mark.parametrize("engine", ["fast", "generate"])
def test_generate_samples_on_cuda_in_bfloat16(llama, tmp_path, engine):
    from debiased_nli.data.tasks import get_task
    from debiased_nli.methods.generation.sample import SamplingOptions, generate_samples

    opts = SamplingOptions(shard_size=32, seed=0, batch_size=16, max_new_tokens=24, dtype="bfloat16", engine=engine)
    rep = generate_samples(llama, str(tmp_path / engine), get_task("snli"), 64, opts, progress=False)
    assert rep["samples"] == 64 and rep["complete_shards"] == 2
    assert rep["this_run"]["engine"] == engine and rep["this_run"]["dtype"] == "bfloat16"


def test_train_generator_in_bf16_on_cuda_learns_and_resumes(tmp_path):
    from test_generation_train import rows
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from debiased_nli.methods.generation.models import load_generator
    from debiased_nli.methods.generation.train import GeneratorTraining, train_generator
    from test_generation_sample import MODELS, SNLI

    tok = AutoTokenizer.from_pretrained(str(MODELS / "gpt2-tokenizer"))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=128, vocab_size=len(tok), resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    opts = GeneratorTraining(max_steps=6, batch_size=4, lr=1e-2, checkpoint_every=2, seed=0, mixed_precision="bf16",
                             log_every=1)
    full = train_generator(rows(), SNLI, str(tmp_path / "base"), str(tmp_path / "a"), opts, progress=False)
    assert full["mixed_precision"] == "bf16"
    losses = [h["loss"] for h in full["history"]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert train_generator(rows(), SNLI, str(tmp_path / "base"), str(tmp_path / "b"), opts, progress=False,
                           stop_after=3) == {"stopped_at": 3}
    resumed = train_generator(rows(), SNLI, str(tmp_path / "base"), str(tmp_path / "b"), opts, progress=False)
    assert resumed["resumed_from"] == "step-2"
    wa, wb = load_generator(str(tmp_path / "a"))[0].state_dict(), load_generator(str(tmp_path / "b"))[0].state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k].float(), wb[k].float(), rtol=0, atol=1e-4)


def test_g_loss_on_cuda_runs_one_pass_with_the_loss_of_two(llama):
    """On CUDA ``batch_loss`` runs G's row and its perturbed-label copy in one forward pass (joint_logits): the
    same loss and gradients as the two passes it runs on a CPU (float32, so only rounding differs)."""
    from debiased_nli.methods.generation.losses import generator_loss
    from debiased_nli.methods.generation.models import load_generator
    from debiased_nli.methods.generation.train import batch_loss, collate, encode_dataset
    from test_generation_train import rows

    model, tok = load_generator(llama)
    model = model.to("cuda").eval()
    enc = encode_dataset(rows(8), SNLI, tok, seed=3, progress=False)
    batch = {k: v.to("cuda") for k, v in collate([enc[i] for i in range(8)], tok.pad_token_id).items()}
    loss, _ = batch_loss(model, batch, mode="generator", lam=0.5, alpha=1.0)
    one = torch.autograd.grad(loss, [p for p in model.parameters()])
    two_loss, _ = generator_loss(model(input_ids=batch["input_ids"], attention_mask=batch["mask"]).logits,
                                 batch["input_ids"], batch["mask"],
                                 model(input_ids=batch["p_input_ids"], attention_mask=batch["p_mask"]).logits,
                                 batch["p_input_ids"], batch["p_hypothesis"], lam=0.5)
    two = torch.autograd.grad(two_loss, [p for p in model.parameters()])
    torch.testing.assert_close(loss, two_loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_the_calibrated_confidence_filter_on_cuda_matches_the_cpu(tmp_path):
    from test_confidence import make_model
    from debiased_nli.data.loading import new_rows
    from debiased_nli.methods.confidence import calibrate, confidence_filter

    model = make_model(tmp_path / "m", {0: "entailment", 1: "neutral", 2: "contradiction"})
    names = ["entailment", "neutral", "contradiction"]
    prem = ["A dog runs.", "Two men play chess outside.", "A girl eats.", "People wait for a bus."] * 6
    hyp = ["An animal moves.", "Nobody plays.", "A child eats fruit.", "Someone sleeps."] * 6
    ds = new_rows("snli", prem, hyp, [names[i % 3] for i in range(24)], origin="generated", method="generator:test")
    held = new_rows("snli", prem[::-1], hyp, [names[(i + 1) % 3] for i in range(24)], origin="generated", method="x")
    got = {}
    for device in ("cpu", "cuda"):
        clf, calibrator, cal = calibrate(held, model, SNLI, method="temperature", device=device, progress=False)
        kept, rej = confidence_filter(ds, clf, SNLI, 0.5, calibrator=calibrator, probabilities=True,
                                      device=device, progress=False)
        conf = dict(zip(list(kept["uid"]) + list(rej["uid"]), list(kept["confidence"]) + list(rej["confidence"])))
        got[device] = (cal["temperature"], np.array([conf[u] for u in ds["uid"]]))
    assert got["cuda"][0] == pytest.approx(got["cpu"][0], rel=1e-3)
    np.testing.assert_allclose(got["cuda"][1], got["cpu"][1], atol=1e-4)
