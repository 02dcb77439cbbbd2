"""The peers of the generator's sampling engines (issue 50), each run by its own interpreter, because each
lives in its own virtual environment (they pin their own numpy/onnx versions):

    llama.cpp (llama-cpp-python, GGUF weights):
        python benchmarks/engine_peers.py llamacpp --model gstar-f32.gguf --prompt-ids 1,1702,93,769,42 \
            --eos 2 --samples 1000 --batch 128 --seed 0 --threads 2 --out texts.json
    ONNX Runtime GenAI (a folder from ``python -m onnxruntime_genai.models.builder``):
        python benchmarks/engine_peers.py ortgenai --model gstar-onnx-fp32 ...

Both sample every token from softmax(logits / temperature) cut to ``top_p`` (here 1.0 and 1.0: the plain
distribution), at most ``--max-new-tokens`` new tokens, ending at ``--eos``, and write the new token ids of
each sample with the seconds the sampling took (model loading excluded, as in ``generate_report.json``).
``benchmarks/bench_engines.py`` runs them and parses the samples with the library's format.

llama.cpp keeps ``--batch`` sequences in flight, each its own sequence id with its own KV stream; a finished
sequence is cleared and replaced at once by the next sample (continuous batching, as the project's ``fast``
engine does), whose prompt goes into the same step; one ``llama_decode`` per step runs one token of every
sequence in flight (and the prompts of those starting). Each sequence has its own sampler chain (top-p, temperature, then a seeded draw). ONNX Runtime
GenAI generates fixed batches of ``--batch`` samples (a finished row pads until its batch ends, as
``model.generate`` does); its ``top_k`` is set to 0 (its default, 50 in the model folder's config, would cut
the distribution).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import time


def llamacpp(args) -> tuple[list[list[int]], float]:
    import llama_cpp as L
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp cannot load {args.model}")
    prompt, B, eos = args.prompt_ids, args.batch, args.eos
    if B > 256:
        raise SystemExit("llama.cpp holds at most 256 sequences (LLAMA_MAX_SEQ): --batch <= 256")
    L_ = len(prompt)
    cp = L.llama_context_default_params()
    cp.n_ctx = B * (L_ + args.max_new_tokens + 8)
    cp.n_batch = cp.n_ubatch = max(B * L_, B)  # every sequence starting at once: its whole prompt
    cp.n_seq_max = B
    cp.n_outputs_max = cp.n_batch
    # one KV stream per sequence (kv_unified false): a token attends over its own sequence's cells only; with
    # a unified cache it would scan every sequence's cells, and sampling slowed as the batch grew
    cp.kv_unified = False
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(cp.n_batch, 0, 1)

    def put(i, token, pos, seq, logits):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
        batch.seq_id[i][0] = seq

    samplers = []
    for s in range(B):
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if args.top_p < 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(args.top_p, 1))
        if args.temperature != 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(args.temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist((args.seed * 1000 + s) % 2**32))
        samplers.append(chain)
    t0 = time.perf_counter()
    out: list[list[int]] = []
    slots: dict[int, list[int]] = {seq: [] for seq in range(min(B, args.samples))}  # sequence id -> new tokens
    started = len(slots)
    while slots:
        # one pass per step: a token of every sequence in flight, and the prompts of those starting (decoding the
        # prompts in a pass of their own, as the fast engine does, made llama.cpp 3x slower here)
        n, index = 0, {}
        for seq, toks in slots.items():
            if not toks:  # a new sample: its prompt, the logits of its last token
                for j, t in enumerate(prompt):
                    put(n, t, j, seq, int(j == L_ - 1))
                    n += 1
            else:
                put(n, toks[-1], L_ + len(toks) - 1, seq, 1)
                n += 1
            index[seq] = n - 1
        batch.n_tokens = n
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed (KV cache full?)")
        for seq, i in index.items():
            tok = int(L.llama_sampler_sample(samplers[seq], ctx, i))
            toks = slots[seq]
            toks.append(tok)
            if tok == eos or len(toks) >= args.max_new_tokens:
                out.append(toks)
                L.llama_memory_seq_rm(mem, seq, -1, -1)
                if started < args.samples:
                    slots[seq] = []
                    started += 1
                else:
                    del slots[seq]
    seconds = time.perf_counter() - t0
    L.llama_batch_free(batch)
    return out, seconds


def ortgenai(args) -> tuple[list[list[int]], float]:
    import numpy as np
    import onnxruntime_genai as og
    config = og.Config(args.model)
    config.clear_providers()  # the CPU
    model = og.Model(config)
    out: list[list[int]] = []
    t0 = time.perf_counter()
    done, b = 0, 0
    while done < args.samples:
        n = min(args.batch, args.samples - done)
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=True, top_k=0, top_p=args.top_p, temperature=args.temperature,
                                  max_length=len(args.prompt_ids) + args.max_new_tokens, batch_size=n,
                                  random_seed=args.seed * 1000 + b)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array([args.prompt_ids] * n, dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        for i in range(n):
            new = [int(t) for t in gen.get_sequence(i)[len(args.prompt_ids):]]
            if args.eos in new:
                new = new[:new.index(args.eos) + 1]
            out.append(new)
        done, b = done + n, b + 1
        del gen
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=["llamacpp", "ortgenai"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True, type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--eos", type=int, required=True)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    samples, seconds = (llamacpp if args.engine == "llamacpp" else ortgenai)(args)
    with open(args.out, "w") as fh:
        json.dump({"engine": args.engine, "model": args.model, "seconds": round(seconds, 3), "samples": samples}, fh)
    print(f"{args.engine}: {len(samples)} samples in {seconds:.1f} s ({len(samples) / seconds:.2f}/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
