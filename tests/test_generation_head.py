"""The sampler's output layer gets a contiguous input (issue 50): PyTorch's CPU ``linear`` turns a strided 3-D
input into a batched product against the weight expanded to the batch and copied (pytorch/pytorch#151934),
which was the fast engine's 7 GB peak at batch 256 and half its bfloat16 time. The fix must not change a
sample."""
import pyarrow.parquet as pq
import pytest
import torch

from test_generation_sample import PREMISES, llama_generator, sample

from debiased_nli.methods.generation import sample as S


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_generator(tmp_path_factory.mktemp("llama-head"), logit_scale=30.0)


def test_the_head_sees_contiguous_inputs_in_every_pass(llama):
    model, tok = S._load_for_sampling(llama, None, torch.device("cpu"))
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0].is_contiguous()))
    jobs = [S.SlotJob(key=j, prompt=p, ids=tok(p, add_special_tokens=False)["input_ids"],
                      uniforms=S.sample_uniforms(0, j, 8)) for j, p in enumerate(PREMISES * 2)]
    list(S.SlotSampler(model, tok, slots=4, max_new_tokens=8).run(jobs))
    assert seen and all(seen)
    S.contiguous_head_input(model)  # a second call adds no second hook
    assert len(model.get_output_embeddings()._forward_pre_hooks) == 2  # ours and this test's


@pytest.mark.parametrize("engine", ["fast", "generate"])
def test_the_fix_changes_no_sample(llama, tmp_path, monkeypatch, engine):
    opts = S.SamplingOptions(num_shards=2, batch_size=4, max_new_tokens=8, seed=3, engine=engine)
    sample(llama, tmp_path / "fixed", 10, opts)
    monkeypatch.setattr(S, "contiguous_head_input", lambda model: None)
    sample(llama, tmp_path / "plain", 10, opts)
    for name in sorted(p.name for p in (tmp_path / "fixed").glob("*.parquet")):
        assert pq.read_table(tmp_path / "fixed" / name).to_pylist() == pq.read_table(tmp_path / "plain" / name).to_pylist()
