"""The GPU generator kit (benchmarks/gpu_generator.py, issue 31): the GGUF shipped in two parts (call 2
refuses a missing or wrong part 1 with one line and exit code 2; a good pair joins to the original),
forced-length throughput sampling (every sample has exactly its forced length), a stage stopped at its
deadline, the rows' export under the transfer's per-file limit, the pipeline projection, and (opt-in,
about 80 s on 2 cores) the whole chain on the CPU with tiny models."""
import copy
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_generator as gg  # noqa: E402
from benchmarks import gpu_throughput as gt  # noqa: E402

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
SCRIPT = ROOT / "benchmarks" / "gpu_generator.py"


def fake_kit(tmp_path: Path, size: int = 300_000, first: int = 123_457) -> tuple[Path, bytes]:
    """A kit whose 'GGUF' is random bytes, split as ``make`` splits it (call1/part1.bin, call2/part2.bin)."""
    payload = os.urandom(size)
    src = tmp_path / "model.gguf"
    src.write_bytes(payload)
    kit = tmp_path / "kit"
    parts = gg.split_file(src, kit / "parts", first)
    (kit / "call1").mkdir(parents=True)
    (kit / "call2").mkdir(parents=True)
    os.replace(kit / "parts" / "part1.bin", kit / "call1" / "part1.bin")
    os.replace(kit / "parts" / "part2.bin", kit / "call2" / "part2.bin")
    manifest = {"git": "test", "plan": copy.deepcopy(gg.PLAN_DRY), "parts": parts,
                "gguf": {"name": "model.gguf", "bytes": size, "sha256": hashlib.sha256(payload).hexdigest()},
                "data": {"train": "data/snli/train.parquet", "dev": "data/snli/dev.parquet", "train_rows": 24, "dev_rows": 24}}
    for d in ("call1", "call2"):
        (kit / d / "kit.json").write_text(json.dumps(manifest))
    return kit, payload


def run_cli(args, node: Path, out: Path | None = None):
    env = dict(os.environ, GPU_GENERATOR_NODE=str(node), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args, *(["--out", str(out)] if out else [])],
                          env=env, capture_output=True, text=True, timeout=120)


def one_line(r) -> str:
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_split_parts_join_back_to_the_original(tmp_path):
    kit, payload = fake_kit(tmp_path)
    manifest = json.loads((kit / "call2" / "kit.json").read_text())
    assert [p["bytes"] for p in manifest["parts"]] == [123_457, len(payload) - 123_457]
    node = tmp_path / "node"
    gg.store_part1(kit / "call1", node)
    joined = gg.join_parts(manifest, kit / "call2", node)
    assert joined.read_bytes() == payload
    assert gg.sha256(joined) == manifest["gguf"]["sha256"]


def test_call_2_refuses_a_missing_part_1_at_once_with_one_line_and_exit_code_2(tmp_path):
    kit, _ = fake_kit(tmp_path)
    node = tmp_path / "fresh-machine"
    t = time.monotonic()
    r = run_cli(["run", "--kit", str(kit / "call2"), "--stages", "setup,gpt2,train", "--deadline", "300"], node,
                tmp_path / "out")
    assert r.returncode == gg.EXIT_KIT == 2
    line = one_line(r)
    assert "part 1" in line and "missing" in line and "call 1" in line
    assert time.monotonic() - t < 20  # nothing was started: no wheels, no model, no GPU
    assert not (node / "base").exists() and not (node / "site").exists()


def test_call_2_refuses_a_wrong_part_1(tmp_path):
    kit, _ = fake_kit(tmp_path)
    node = tmp_path / "node"
    assert one_line(run_cli(["store-part1", "--kit", str(kit / "call1")], node)).startswith("part 1 stored")
    with open(node / "part1.bin", "r+b") as f:  # another kit's part, or a torn copy
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    r = run_cli(["run", "--kit", str(kit / "call2"), "--stages", "setup", "--deadline", "300"], node, tmp_path / "out")
    assert r.returncode == 2
    assert "not this kit's" in one_line(r)


def test_store_part1_refuses_a_kit_whose_part_is_damaged(tmp_path):
    kit, _ = fake_kit(tmp_path)
    (kit / "call1" / "part1.bin").write_bytes(b"short")
    r = run_cli(["store-part1", "--kit", str(kit / "call1")], tmp_path / "node")
    assert r.returncode == 2 and "part 1" in one_line(r)


def test_a_later_call_on_a_fresh_machine_is_refused_with_one_line(tmp_path):
    r = run_cli(["run", "--stages", "sample,filter", "--deadline", "300"], tmp_path / "fresh", tmp_path / "out")
    assert r.returncode == 2
    assert "fresh machine" in one_line(r)


def test_a_stage_process_is_stopped_at_its_deadline(tmp_path):
    kit, _ = fake_kit(tmp_path)
    chain = gg.Chain(tmp_path / "node", kit / "call2", tmp_path / "out", 60, ["setup"], "t")
    h = chain.start("sleeper", [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    t = time.monotonic()
    codes = chain.wait([h], time.monotonic() + 1.5)
    assert codes == {"sleeper": None} and time.monotonic() - t < 15
    assert h[1].poll() is not None
    fast = chain.start("quick", [sys.executable, "-c", "print('ok')"])
    assert chain.wait([fast], time.monotonic() + 30) == {"quick": 0}


def eos_heavy_gpt2():
    """A tiny GPT-2 that puts ~90% of its probability on the end marker at every step."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=128, vocab_size=50257)).eval()
    eos = 50256
    with torch.no_grad():
        model.transformer.wte.weight[eos] *= 10
        emb = model.transformer.wte.weight.detach()
        lo, hi = 0.0, 1e4
        for _ in range(60):
            c = (lo + hi) / 2
            p = torch.softmax(c * emb @ emb[eos], -1)[eos].item()
            lo, hi = (c, hi) if p < 0.9 else (lo, c)
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(c * emb[eos])
    return model, eos


def test_forced_length_sampling_gives_every_sample_exactly_its_length():
    import torch

    model, eos = eos_heavy_gpt2()
    prompt = [eos, 31605, 786, 25]  # "<|endoftext|>premise:"
    free = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)[eos].item()
    assert free > 0.8  # left alone, almost every sample would end at once
    for length in (1, 5, 17):
        out = gt.forced_length_generate(model, 6, length, prompt, eos_id=eos, pad_id=eos)
        assert out.shape == (6, len(prompt) + length)
        new = out[:, len(prompt):]
        assert not (new[:, :-1] == eos).any()  # no end marker before the forced length (so no padding either)


def test_sampling_benchmark_times_every_bucket_on_a_tiny_model():
    model, eos = eos_heavy_gpt2()
    hist = {3: 5, 9: 10, 17: 5}
    r = gt.bench_sampling(model, hist, [eos, 31605, 786, 25], eos_id=eos, pad_id=eos, device="cpu", batches=[2, 4])
    assert [b["length"] for b in r["buckets"]] == [8, 16, 24]
    assert [b["share"] for b in r["buckets"]] == [0.25, 0.5, 0.25]
    assert r["mean_length"] == pytest.approx(16.0)
    assert r["samples_per_s"] > 0 and r["roofline_fraction"] is None  # no peak bandwidth known for a CPU


def test_a_run_cut_short_after_sampling_keeps_it_and_times_only_the_rest(tmp_path):
    out = tmp_path / "gpt2.partial.json"
    lengths = {"eos_id_gpt2": 50256, "prompt_ids_gpt2": [31605, 25], "row_lengths_gpt2": {"6": 2, "9": 1},
               "hypothesis_lengths_gpt2": {"4": 1}, "pair_lengths_gpt2": {"10": 1, "14": 1}}
    sampling = {"batch_sweep": [{"batch": 2}, {"batch": 4}], "samples_per_s": 3.5, "best_batch": 4}
    prior = {"model": "gpt2-tiny (CPU dry run)", "device_kind": "cpu (tiny dry run)", "dtype": "float32",
             "parameters": 123, "sampling": sampling, "sampling_measured_at": "2026-11-27T13:50:00Z"}
    out.write_text(json.dumps(prior))
    r = gt.run_gpt2(lengths, out, tiny=True, resume=True, train_steps=1)
    assert r["sampling_resumed"] is True and r["sampling"] == sampling and r["parameters"] == 123
    assert r["training"]["seconds_per_step"] > 0 and r["classifier"]["rows_per_s"] > 0
    assert json.loads(out.read_text())["sampling"] == sampling  # what the file holds now is the whole result
    assert r["training"]["micro_batch"] == 24  # the GPU's and the tiny run's step is one batch of 24
    # another batch sweep is another measurement: the kept one is not reused for it
    out.write_text(json.dumps(prior))
    r = gt.run_gpt2(lengths, out, tiny=True, resume=True, train_steps=1, batches=[2])
    assert "sampling_resumed" not in r and [b["batch"] for b in r["sampling"]["batch_sweep"]] == [2]


def test_a_training_step_in_accumulated_chunks_takes_one_optimizer_step_of_the_whole_batch():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    before = [p.detach().clone() for p in model.parameters()]
    r = gt.bench_training(model, {"6": 1, "9": 1}, device="cpu", batch=6, steps=1, warmup=0, micro_batch=4)
    assert r["batch"] == 6 and r["micro_batch"] == 4 and r["seconds_per_step"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_length_buckets_round_up_and_decode_bytes_count_weights_and_kv():
    assert gt.length_buckets({1: 1, 8: 1, 9: 2}) == [(8, 0.5), (16, 0.5)]
    # 3 steps, batch 2, prompt 4: weights 3 times, KV of 4, 5 and 6 tokens per sequence
    assert gt.decode_bytes(100, 10, 2, 4, 3) == 3 * 100 + 2 * (4 + 5 + 6) * 10
    assert gt.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gt.peak_bandwidth("NVIDIA H200") == 4.8e12


def test_rows_over_the_per_file_limit_are_sampled_and_say_so(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    node, out = tmp_path / "node", tmp_path / "out"
    (node / "filtered").mkdir(parents=True)
    (node / "samples").mkdir(parents=True)
    out.mkdir()
    n = 20_000
    t = pa.table({"premise": [os.urandom(20).hex() for _ in range(n)], "hypothesis": ["h"] * n, "label": [0] * n,
                  "confidence": [0.5] * n, "extra": [1] * n})
    pq.write_table(t, node / "filtered" / "kept.parquet")
    gg.export_rows(node, out, max_bytes=200_000)
    f = pq.ParquetFile(out / "kept.parquet")
    md = f.schema_arrow.metadata
    assert (out / "kept.parquet").stat().st_size <= 200_000
    assert int(md[b"debiased_nli_rows_total"]) == n > int(md[b"debiased_nli_rows_here"]) == f.metadata.num_rows > 0
    assert "extra" not in f.schema_arrow.names and "confidence" in f.schema_arrow.names


def test_a_cpu_roofline_uses_the_given_ceiling_and_the_copy_bandwidth_is_measured():
    model, eos = eos_heavy_gpt2()
    hist = {9: 10}
    r = gt.bench_sampling(model, hist, [eos, 31605], eos_id=eos, pad_id=eos, device="cpu", batches=[2], peak=1e9)
    assert r["peak_bandwidth_tb_s"] == pytest.approx(1e-3)
    assert r["roofline_fraction"] > 0  # bytes read per second over the ceiling given (a GPU's comes from its name)
    bw = gt.copy_bandwidth(gib=1 / 64, repeats=2)
    assert 1e8 < bw < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s on any machine this runs on


def test_the_cpu_fallback_projects_from_the_seqz_cpu_run():
    from benchmarks import paper_models_cpu as pmc

    seqz = {"generator": {"rows": 20_000, "seconds": 1000.0, "tokens": {"sequence_tokens": 800_000}},
            "generation": {"this_run": {"samples_per_s_rank0": 20.0}}}
    s = pmc.this_run_inputs(seqz, {"rows_per_s": 100.0})
    assert s["G"]["tokens_per_s"] == 800.0 and s["kit"]["data"]["train_rows"] == 20_000
    z = {"featurise_rows_per_s": 1e9, "seq_z_seconds": 0.0, "seq_z_rows": 1, "cpus": 2}
    p = gg.project({**s, "gpt2": {}}, rows=20_000, epochs=1, samples=72_000, gpus=(1,), z=z)["this_run_models"]["1_gpu"]
    assert p["train_g_h"] == pytest.approx(1000 / 3600, abs=1e-3)  # one epoch of the same rows: the run's own time
    assert p["sample_h"] == pytest.approx(1.0) and p["confidence_filter_h"] == pytest.approx(0.2)


def test_m_rate_falls_back_to_ms_architecture_when_the_trained_m_is_elsewhere(tmp_path, monkeypatch):
    from transformers import BertConfig, BertModel

    from benchmarks import paper_models_cpu as pmc

    monkeypatch.setattr(pmc.gg, "MODELS", tmp_path / "models")
    hist = {"12": 3, "20": 1}
    assert pmc.m_rows_per_s(tmp_path / "no-M", hist, batch=2, batches=1) is None  # neither M nor its base encoder
    base = tmp_path / "models" / "all-minilm-l6-v2"
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(base)
    r = pmc.m_rows_per_s(tmp_path / "no-M", hist, batch=2, batches=1)
    assert r["stand_in"] is True and r["model"] == str(base) and r["rows_per_s"] > 0 and r["batch"] == 2


def test_projection_scales_the_measured_rates():
    summary = {"gpt2": {"sampling": {"samples_per_s": 1000.0, "device": "H100"},
                        "training": {"batch": 24, "seconds_per_step": 0.1},
                        "classifier": {"rows_per_s": 5000.0}},
               "G": {"tokens_per_s": 50_000.0, "tokens": {"row_tokens": 40_000}},
               "sampling": {"samples_per_s": 2000.0}, "filter": {"rows_per_s_wall": 10_000.0},
               "kit": {"data": {"train_rows": 1000}}}
    z = {"featurise_rows_per_s": 1e9, "seq_z_seconds": 0.0, "seq_z_rows": 1, "cpus": 2}
    p = gg.project(summary, rows=2400, epochs=5, samples=3_600_000, z=z)
    one, eight = p["paper_models"]["1_gpu"], p["paper_models"]["8_gpu"]
    assert one["sample_h"] == pytest.approx(1.0) and eight["sample_h"] == pytest.approx(0.125)
    assert one["train_g_h"] == pytest.approx(100 * 5 * 0.1 / 3600, abs=1e-3)  # 100 steps of 24 x 5 epochs
    assert eight["train_g_h"] == pytest.approx(one["train_g_h"] / 8 / 0.9, abs=1e-3)
    assert one["confidence_filter_h"] == pytest.approx(0.2)
    assert one["x_paper"] == pytest.approx(59 / one["total_h"], rel=0.05)
    mine = p["this_run_models"]["1_gpu"]  # 40 tokens a row: 2400 x 5 x 40 / 50k tokens/s
    assert mine["train_g_h"] == pytest.approx(2400 * 5 * 40 / 50_000 / 3600, abs=1e-3)
    assert mine["sample_h"] == pytest.approx(0.5)


@pytest.mark.skipif(not os.environ.get("DEBIASED_NLI_GPU_KIT_DRY_RUN"),
                    reason="the whole chain on the CPU takes about 80 s on 2 cores: set DEBIASED_NLI_GPU_KIT_DRY_RUN=1")
def test_dry_run_runs_the_whole_chain_on_the_cpu(tmp_path):
    s = gg.dry_run(tmp_path / "dry", keep=True)
    assert s["refusal_line"].startswith("gpu_generator: part 1")
    assert all(s["done"].get(k) for k in ("setup", "gpt2", "train", "debias", "sample", "filter", "compare_g",
                                          "cuda_tests")), s["done"]
    assert s["sampling"]["samples"] == gg.PLAN_DRY["samples"] and s["sampling"]["generator"] == "Gstar"
    assert s["Gstar"]["train_report"]["steps"] == gg.PLAN_DRY["gstar"]["epochs"] * s["Gstar"]["train_report"]["steps"] // gg.PLAN_DRY["gstar"]["epochs"]
    assert {r["engine"] for r in s["race"]["rows"]} == {"fast", "generate"} and s["race"]["best"]
    assert s["filter"]["calibration"]["temperature"] > 0
    assert s["compare_g"]["samples"] == gg.PLAN_DRY["g_samples"] and "filter" in s["compare_g"]
    assert s["filter"]["report"]["rows"] == s["sampling"]["parsed"] > 0
    assert s["M"]["dev_accuracy"] is not None and s["G"]["final"]["epochs_trained"] == gg.PLAN_DRY["g"]["epochs"]
    assert (tmp_path / "dry" / "results" / "gpu_generator_dry.md").is_file()


def test_dequantize_never_replaces_a_folder_it_did_not_write(tmp_path):
    """`dequantize --out` replaces only a model folder it wrote (its .complete record): a user's folder given
    by mistake, or a link, is refused before any work, and left as it was."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "keep.txt").write_text("not made by the kit")
    link = tmp_path / "link"
    link.symlink_to(mine)
    for out in (mine, link):
        with pytest.raises(SystemExit, match="not a model folder this kit wrote"):
            gg.dequantize(tmp_path / "absent.gguf", out)
    assert (mine / "keep.txt").read_text() == "not made by the kit" and link.is_symlink()


def test_the_kit_transfers_fit_the_limit_from_the_committed_tree():
    """What the device calls send: the slim committed tree (no benchmarks/results) plus each call's carried
    folder (half of the SmolLM2 GGUF; call 2 also the data, tokenizers, lengths and wheels). Computed from the
    committed files at HEAD, the GGUF's recorded size and the shared data, so that a tree that grows, or a
    kit that carries more, fails here and not on the device."""
    from benchmarks import gpu_kit

    tree = gpu_kit.committed_tree_bytes(ROOT, "HEAD", slim=True)
    data = sum((Path(ROOT.parent / "shared" / "data" / "snli" / f)).stat().st_size for f in ("train_sample.parquet", "dev.parquet"))
    tokenizers = 0
    for name, files, recorded in (("smollm2-135m-instruct", ("tokenizer.json", "tokenizer_config.json"), 3_700_000),
                                  ("gpt2-tokenizer", None, 2_200_000)):
        folder = MODELS / name
        if folder.is_dir():
            tokenizers += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()
                              and (files is None or f.name in files))
        else:
            tokenizers += recorded
    extras2 = data + tokenizers + gg.WHEELS_BUDGET + 64 * 1024  # + lengths.json and kit.json
    per_call = (gg.GGUF_BYTES + extras2) // 2 + 8192
    limit = gg.LIMIT_MIB * 2**20
    assert tree < 8 * 2**20, f"the slim committed tree is {tree / 2**20:.1f} MiB"
    assert tree + per_call < limit - 2**20, (tree / 2**20, per_call / 2**20)
    # the full tree does not fit: the calls need the slim one
    assert gpu_kit.committed_tree_bytes(ROOT, "HEAD", slim=False) + per_call > limit


def test_slim_takes_the_results_out_of_the_worktree_and_unslim_brings_them_back(tmp_path):
    from benchmarks import gpu_kit

    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results" / "plan").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "big.json").write_text("x" * 5000)
    (repo / "benchmarks" / "results" / "plan" / "unit.json").write_text("{}")
    (repo / "benchmarks" / "run.py").write_text("print(1)\n")
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, text=True).stdout
    git("init", "-q")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    gpu_kit.slim_tree(keep=("benchmarks/results/plan",), cwd=repo)
    assert not (repo / "benchmarks" / "results" / "big.json").exists()
    assert (repo / "benchmarks" / "results" / "plan" / "unit.json").is_file() and (repo / "benchmarks" / "run.py").is_file()
    assert git("status", "--porcelain") == ""  # nothing deleted as far as git is concerned
    assert gpu_kit.committed_tree_bytes(repo, slim=True) == len("print(1)\n")
    gpu_kit.unslim_tree(cwd=repo)
    assert (repo / "benchmarks" / "results" / "big.json").read_text() == "x" * 5000
    # a results file with uncommitted changes would travel: refused, nothing changed
    (repo / "benchmarks" / "results" / "big.json").write_text("changed")
    with pytest.raises(SystemExit, match="uncommitted change"):
        gpu_kit.slim_tree(cwd=repo)
    assert (repo / "benchmarks" / "results" / "big.json").read_text() == "changed"
