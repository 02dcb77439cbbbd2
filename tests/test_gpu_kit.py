"""The GPU kit (benchmarks/gpu_kit.py, issues 31 and 47): the GGUF shipped in two parts (a call on a machine
without part 1, or with another kit's, is refused with one line and exit code 2; a good pair joins to the
original), a step stopped at its deadline, the run folder sent back in parts without the models' weights, the
transfers' sizes from the committed tree, the slim worktree, GPT-2 large's forced-length benchmark,
and (opt-in, minutes on 2 cores) the whole chain of calls on the CPU with a tiny model."""
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_kit as gk  # noqa: E402
from benchmarks import gpu_throughput as gt  # noqa: E402

MODELS = Path(os.environ.get("DEBIASED_NLI_MODELS", Path.home() / ".cache" / "debiased-nli" / "models"))
SCRIPT = ROOT / "benchmarks" / "gpu_kit.py"


def fake_kit(tmp_path: Path, size: int = 300_000, first: int = 123_457) -> tuple[Path, bytes]:
    """A kit whose 'GGUF' is random bytes, split as ``pipeline-make`` splits it (call1/part1.bin, call2/part2.bin)."""
    payload = os.urandom(size)
    (tmp_path / "model.gguf").write_bytes(payload)
    kit = tmp_path / "kit"
    parts = gk.split_file(tmp_path / "model.gguf", kit / "parts", first)
    for i, d in ((1, "call1"), (2, "call2")):
        (kit / d).mkdir(parents=True)
        os.replace(kit / "parts" / f"part{i}.bin", kit / d / f"part{i}.bin")
    manifest = {"git": "test", "parts": parts, "recipe": ["recipe.yaml", None],
                "gguf": {"name": "model.gguf", "bytes": size, "sha256": hashlib.sha256(payload).hexdigest()}}
    for d in ("call1", "call2"):
        (kit / d / "kit.json").write_text(json.dumps(manifest))
    return kit, payload


def run_cli(args, node: Path, out: Path | None = None):
    env = dict(os.environ, GPU_KIT_NODE=str(node), PYTHONPATH=str(ROOT))
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
    gk.store_part1(kit / "call1", node)
    joined = gk.join_parts(manifest, kit / "call2", node)
    assert joined.read_bytes() == payload and gk.sha256(joined) == manifest["gguf"]["sha256"]
    # a file smaller than the first part's share (a tiny GGUF) is all part 1, not an endless read
    parts = gk.split_file(tmp_path / "model.gguf", tmp_path / "over", len(payload) + 10)
    assert [p["bytes"] for p in parts] == [len(payload), 0]


def test_call_2_refuses_a_missing_part_1_at_once_with_one_line_and_exit_code_2(tmp_path):
    kit, _ = fake_kit(tmp_path)
    node = tmp_path / "fresh-machine"
    t = time.monotonic()
    r = run_cli(["pipeline-run", "--kit", str(kit / "call2"), "--deadline", "300"], node, tmp_path / "out")
    assert r.returncode == gk.EXIT_KIT == 2
    line = one_line(r)
    assert "part 1" in line and "missing" in line and "call 1" in line
    assert time.monotonic() - t < 30  # nothing was started: no wheels, no model, no GPU
    assert not (node / "site").exists() and not (tmp_path / "out").exists()


def test_call_2_refuses_a_wrong_part_1(tmp_path):
    kit, _ = fake_kit(tmp_path)
    node = tmp_path / "node"
    assert one_line(run_cli(["store-part1", "--kit", str(kit / "call1")], node)).startswith("part 1 stored")
    with open(node / "part1.bin", "r+b") as f:  # another kit's part, or a torn copy
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    r = run_cli(["pipeline-run", "--kit", str(kit / "call2"), "--deadline", "300"], node, tmp_path / "out")
    assert r.returncode == 2 and "not this kit's" in one_line(r)


def test_store_part1_refuses_a_kit_whose_part_is_damaged(tmp_path):
    kit, _ = fake_kit(tmp_path)
    (kit / "call1" / "part1.bin").write_bytes(b"short")
    r = run_cli(["store-part1", "--kit", str(kit / "call1")], tmp_path / "node")
    assert r.returncode == 2 and "part 1" in one_line(r)


def test_a_later_call_on_a_fresh_machine_is_refused_with_one_line(tmp_path):
    r = run_cli(["pipeline-run", "--deadline", "300"], tmp_path / "fresh", tmp_path / "out")
    assert r.returncode == 2 and "fresh machine" in one_line(r)


def test_a_process_is_stopped_at_its_deadline(tmp_path):
    sleeper = gk.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], tmp_path / "s.log")
    t = time.monotonic()
    assert gk.wait({"sleeper": sleeper}, time.monotonic() + 1.5) == {"sleeper": None}
    assert time.monotonic() - t < 15 and sleeper.poll() is not None
    quick = gk.start([sys.executable, "-c", "print('ok')"], tmp_path / "q.log")
    assert gk.wait({"quick": quick}, time.monotonic() + 30) == {"quick": 0} and "ok" in gk.tail(tmp_path / "q.log")


def test_the_run_folder_travels_back_in_parts_without_the_models_weights(tmp_path):
    run = tmp_path / "run"
    for rel, data in (("pipeline.json", b"{}"), ("stages/train_g.json", b"{}"), ("G/train_report.json", b"{}"),
                      ("G/model.safetensors", b"w" * 5000), ("G/checkpoints/step-8/state.json", b"{}"),
                      ("M/checkpoint-4/trainer_state.json", b"{}"), ("G/tokenizer.json", b"t" * (2**20 + 1)),
                      ("samples/shard-00000-of-00001.parquet", os.urandom(300_000))):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    parts = gk.pack_run(run, out, part_bytes=100_000)
    assert len(parts) == 4 and all(p.stat().st_size <= 100_000 for p in parts)
    whole = b"".join(p.read_bytes() for p in parts)
    (tmp_path / "whole.tar.gz").write_bytes(whole)
    with tarfile.open(tmp_path / "whole.tar.gz") as tar:
        names = sorted(tar.getnames())
    assert names == ["G/train_report.json", "pipeline.json", "samples/shard-00000-of-00001.parquet",
                     "stages/train_g.json"]


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
        assert not (out[:, len(prompt):][:, :-1] == eos).any()  # no end marker before the forced length


def test_sampling_benchmark_times_every_bucket_on_a_tiny_model():
    model, eos = eos_heavy_gpt2()
    r = gt.bench_sampling(model, {3: 5, 9: 10, 17: 5}, [eos, 31605, 786, 25], eos_id=eos, pad_id=eos, device="cpu",
                          batches=[2, 4])
    assert [b["length"] for b in r["buckets"]] == [8, 16, 24] and [b["share"] for b in r["buckets"]] == [0.25, 0.5, 0.25]
    assert r["mean_length"] == pytest.approx(16.0)
    assert r["samples_per_s"] > 0 and r["roofline_fraction"] is None  # no peak bandwidth known for a CPU
    r = gt.bench_sampling(model, {9: 10}, [eos, 31605], eos_id=eos, pad_id=eos, device="cpu", batches=[2], peak=1e9)
    assert r["peak_bandwidth_tb_s"] == pytest.approx(1e-3) and r["roofline_fraction"] > 0  # against the given ceiling


def test_the_tiny_gpt2_run_measures_sampling_training_and_the_classifier(tmp_path):
    lengths = {"eos_id_gpt2": 50256, "prompt_ids_gpt2": [31605, 25], "row_lengths_gpt2": {"6": 2, "9": 1},
               "hypothesis_lengths_gpt2": {"4": 1}, "pair_lengths_gpt2": {"10": 1, "14": 1}}
    r = gt.run_gpt2(lengths, tmp_path / "gpt2.json", tiny=True)
    assert r["sampling"]["samples_per_s"] > 0 and r["training"]["seconds_per_step"] > 0 and r["training"]["batch"] == 24
    assert r["classifier"]["rows_per_s"] > 0 and json.loads((tmp_path / "gpt2.json").read_text())["seconds"] > 0


def test_length_buckets_round_up_and_decode_bytes_count_weights_and_kv():
    assert gt.length_buckets({1: 1, 8: 1, 9: 2}) == [(8, 0.5), (16, 0.5)]
    # 3 steps, batch 2, prompt 4: weights 3 times, KV of 4, 5 and 6 tokens per sequence
    assert gt.decode_bytes(100, 10, 2, 4, 3) == 3 * 100 + 2 * (4 + 5 + 6) * 10
    assert gt.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12 and gt.peak_bandwidth("NVIDIA H200") == 4.8e12


def test_dequantize_never_replaces_a_folder_it_did_not_write(tmp_path):
    """`dequantize --out` replaces only a model folder it wrote (its .complete record): a user's folder given by
    mistake, or a link, is refused before any work, and left as it was."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "keep.txt").write_text("not made by the kit")
    link = tmp_path / "link"
    link.symlink_to(mine)
    for out in (mine, link):
        with pytest.raises(SystemExit, match="not a model folder this kit wrote"):
            gk.dequantize(tmp_path / "absent.gguf", out)
    assert (mine / "keep.txt").read_text() == "not made by the kit" and link.is_symlink()


def test_the_kit_transfers_fit_the_limit_from_the_committed_tree():
    """What the device calls send: the slim committed tree (no benchmarks/results) plus each call's carried folder
    (half of the SmolLM2 GGUF; call 2 also the data, tokenizers, lengths and wheels). Computed from the committed
    files at HEAD, the GGUF's recorded size and the shared data, so that a tree that grows, or a kit that carries
    more, fails here and not on the device."""
    tree = gk.committed_tree_bytes(ROOT, "HEAD", slim=True)
    data = sum((ROOT.parent / "shared" / "data" / rel).stat().st_size for rel in gk.DATA)
    tokenizers = 0
    for name, files, recorded in (("smollm2-135m-instruct", ("tokenizer.json", "tokenizer_config.json"), 3_700_000),
                                  ("gpt2-tokenizer", None, 2_200_000)):
        folder = MODELS / name
        tokenizers += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and (files is None or f.name in files)) \
            if folder.is_dir() else recorded
    per_call = (gk.GGUF_BYTES + data + tokenizers + gk.WHEELS_BUDGET + 64 * 1024) // 2 + 8192  # + lengths, kit.json
    limit = gk.LIMIT_MIB * 2**20
    assert tree < 8 * 2**20, f"the slim committed tree is {tree / 2**20:.1f} MiB"
    assert tree + per_call < limit - 2**20, (tree / 2**20, per_call / 2**20)
    assert gk.committed_tree_bytes(ROOT, "HEAD", slim=False) + per_call > limit  # the calls need the slim tree


def test_slim_takes_the_results_out_of_the_worktree_and_unslim_brings_them_back(tmp_path):
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results" / "plan").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "big.json").write_text("x" * 5000)
    (repo / "benchmarks" / "results" / "plan" / "unit.json").write_text("{}")
    (repo / "benchmarks" / "run.py").write_text("print(1)\n")
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, text=True).stdout  # noqa: E731
    git("init", "-q")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    gk.slim_tree(keep=("benchmarks/results/plan",), cwd=repo)
    assert not (repo / "benchmarks" / "results" / "big.json").exists()
    assert (repo / "benchmarks" / "results" / "plan" / "unit.json").is_file() and (repo / "benchmarks" / "run.py").is_file()
    assert git("status", "--porcelain") == ""  # nothing deleted as far as git is concerned
    assert gk.committed_tree_bytes(repo, slim=True) == len("print(1)\n")
    gk.unslim_tree(cwd=repo)
    assert (repo / "benchmarks" / "results" / "big.json").read_text() == "x" * 5000
    # a results file with uncommitted changes would travel: refused, nothing changed
    (repo / "benchmarks" / "results" / "big.json").write_text("changed")
    with pytest.raises(SystemExit, match="uncommitted change"):
        gk.slim_tree(cwd=repo)
    assert (repo / "benchmarks" / "results" / "big.json").read_text() == "changed"


def test_the_kit_runs_the_profile_it_was_made_for(tmp_path, shared_data):
    # `pipeline-make --profile gpu-lease`: the machine runs `pipeline run seqz --profile gpu-lease` (1 epoch each)
    import pyarrow.parquet as pq
    from debiased_nli.release.recipe import load_recipe
    data = tmp_path / "data"
    data.mkdir()
    for rel in gk.DATA:
        pq.write_table(pq.read_table(shared_data / rel).slice(0, 12), data / Path(rel).name)
    gk.pipeline_make(tmp_path / "kit", gguf=gk.tiny_gguf(tmp_path / "tiny.gguf"), train=data / "train_sample.parquet",
                     dev=data / "dev.parquet", recipe="gpu-lease", wheels=False, limit_mib=None, quiet=True)
    for call in ("call1", "call2"):
        assert json.loads((tmp_path / "kit" / call / "kit.json").read_text())["recipe"] == ["seqz", "gpu-lease"]
    lease, gpu = (load_recipe(ROOT / "builders" / "seqz.yaml", p)["new_rows"][0] for p in ("gpu-lease", "gpu"))
    assert [lease[k]["epochs"] for k in ("train", "debias", "train_m")] == [1, 1, 1]
    assert {k: v for k, v in lease["generate"].items() if k != "out"} == {k: v for k, v in gpu["generate"].items() if k != "out"}
    assert lease["confidence"] == gpu["confidence"] and lease["confidence"]["tau"] == 0.95


def test_the_dry_run_recipe_is_the_gpu_profile_made_small():
    from debiased_nli.release.recipe import load_recipe

    gpu, dry = load_recipe(ROOT / "builders" / "seqz.yaml", "gpu")["new_rows"][0], gk.dry_recipe(False)["new_rows"][0]
    assert set(gpu) == set(dry) and {k: set(v) <= set(dry[k]) for k, v in gpu.items() if isinstance(v, dict)}
    # the models under the machine's HOME (the kit's), not this one's
    assert dry["train"]["model"] == gpu["train"]["model"] == "~/.cache/debiased-nli/models/smollm2-135m-instruct"
    assert dry["confidence"]["calibration"] == gpu["confidence"]["calibration"] and dry["confidence"]["probabilities"]


@pytest.mark.skipif(not os.environ.get("DEBIASED_NLI_GPU_KIT_DRY_RUN"),
                    reason="the calls on the CPU take minutes on 2 cores: set DEBIASED_NLI_GPU_KIT_DRY_RUN=1")
def test_dry_run_runs_the_calls_on_the_cpu_and_the_build_here(tmp_path):
    s = gk.dry_run(tmp_path / "dry", keep=True)
    assert s["refusal_line"].startswith("gpu_kit: part 1")
    assert all(s["done"].get(k) for k in ("setup", "pipeline", "gpt2", "cuda_tests")), s["done"]
    # one step at a time, the CUDA tests before the pipeline (never two on the GPU: G beside GPT-2 ran out of memory)
    steps = [t for t in s["timeline"] if not t["status"].startswith("skipped")]
    assert [t["step"] for t in steps if t["call"] == "call2"][:3] == ["setup", "cuda_tests", "pipeline"]
    assert all(a["end"] <= b["start"] for a, b in zip(steps, steps[1:]))
    assert s["stages"] == {"train_g": "done", "train_g_star": "done", "train_m": "done", "sample": "done",
                           "filter": "done", "build": "pending", "audit": "pending"}
    assert s["reports"]["sample"]["samples"] == 48 and s["reports"]["filter"]["rows"] > 0
    assert s["reports"]["filter"]["calibration"]["rows"] == 24 and s["gpt2"]["sampling"]["samples_per_s"] > 0
    assert any(line.split()[:2] == ["audit", "done"] for line in s["here"]), s["here"]
    assert (tmp_path / "dry" / "results" / "gpu_generator_dry.md").is_file()
