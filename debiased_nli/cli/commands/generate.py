"""``debiased-nli generate``: sample new rows from a trained generator, sharded and resumable."""
from __future__ import annotations

import argparse
import json

from ...utils.errors import ConfigError
from ._common import POSITIVE_FLOAT, POSITIVE_INT, SEED, number, run_folder
from ...utils.paths import check_model_reference

DESCRIPTION = """\
Sample rows from a generator trained by `debiased-nli train-generator` (a folder with a full model or a
LoRA adapter, or a Hub id).

The samples are split into shards (--num-shards, or one per --shard-size samples); under
`accelerate launch` or `torchrun` each process takes every world_size-th shard. Shard i has its own
seed (from --seed and i), so the result does not depend on the number of processes. Each shard is one
Parquet file, written under a temporary name and renamed when complete; rerunning the same command
skips complete shards (a killed run resumes), and --extend grows a run to more samples, keeping its
shards. Unparseable samples go to rejects-*.parquet with their text and reason; generate_report.json
has the parse rate, label counts and distinct-2.

By default it samples plainly (top-p 1.0, temperature 1.0): Wu et al. (2022, Sec. 2.1) "randomly sample
from the trained generator" and give no nucleus mass; --top-p 0.9 gives nucleus sampling. Up to
--max-new-tokens 128 new tokens, so a row as long as the training sequences (Table 7: "max sequence
length 128") is not cut and rejected. The values used and their sources are printed first.

The default engine keeps --batch-size sequences in flight: a sample that reaches its end marker frees
its slot for the next prompt at once, and each sample draws its tokens with its own random numbers
(from --seed, its shard and its index), so the samples do not depend on the batch size or the number
of processes. On a CPU, --dtype auto (bfloat16 where the CPU has AMX or AVX512-BF16) and a batch of a
few hundred give the most samples per second (measured: --batch-size 256; the Generator page of the docs).

--engine ctranslate2 (the extra `pip install 'debiased-nli[ctranslate2]'`) samples with CTranslate2: the
generator, its LoRA adapter merged, is converted once into a model folder cached under
$DEBIASED_NLI_CACHE/ctranslate2/ (keyed by a hash of the generator's and its base model's files), and
sampled in float32 by default (--dtype: its compute type; int8 is faster but moves the label shares:
on G*, +7.5 points of entailment). Its samples depend on
--batch-size (like --engine generate's); shards, resume, rejects and the run's config work as for the
other engines, and the config records the engine and compute type. The speed and output-distribution
comparison of the engines: the documentation's generator page (docs/methods/generator.md, "Sampling engines").

On GPUs: `accelerate launch -m debiased_nli.cli generate ...` (see `accelerate config`).
On CPU with 2 processes: `torchrun --nproc_per_node 2 -m debiased_nli.cli generate ... --cpu`
(`accelerate launch --cpu --num_processes 2` starts only one process).
"""


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample rows from a trained generator (sharded, resumable)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", help="the task whose labels the generator uses (snli, mnli, ..., or a task YAML)")
    p.add_argument("--generator", required=True, help="generator folder (model or LoRA adapter) or Hub id")
    p.add_argument("--out", required=True, help="output folder for shards, rejects and the report")
    p.add_argument("--num-samples", type=POSITIVE_INT, required=True)
    p.add_argument("--num-shards", type=POSITIVE_INT, help="default: num-samples / shard-size (at least one per process)")
    p.add_argument("--shard-size", type=POSITIVE_INT, default=1000)
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=16,
                   help="sequences in flight (engine fast) or prompts per generate call (engine generate)")
    p.add_argument("--top-p", type=number(float, low=0, high=1, low_open=True), default=1.0,
                   help="nucleus sampling mass (default 1.0: plain sampling, as the paper's 'randomly sample')")
    p.add_argument("--temperature", type=POSITIVE_FLOAT, default=1.0)
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=128,
                   help="default 128: covers the generator's training length (Table 7: max sequence length 128)")
    p.add_argument("--condition", choices=["none", "premise", "premise+label"], default="none",
                   help="none: sample whole rows (the paper); premise(+label): prompt with premises from --premises-from")
    p.add_argument("--premises-from", nargs="+", metavar="PATH", help="files with a premise column (for --condition)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "int8", "int8_float32",
                                       "int8_float16", "int8_bfloat16"],
                   help="engines fast and generate: default the checkpoint's; auto: bfloat16 where the CPU (AMX, "
                        "AVX512-BF16) or GPU computes it natively, else the checkpoint's. Engine ctranslate2: its "
                        "compute type, default (and auto) float32 on a CPU, float16 on a GPU (int8 is faster but shifts the "
                        "label shares: docs/methods/generator.md, 'Sampling engines')")
    p.add_argument("--engine", choices=["fast", "generate", "ctranslate2"], default="fast",
                   help="fast (default): every slot of the batch refilled as soon as its sample ends, each sample "
                        "drawn with its own random numbers (the same samples at any batch size or process count); "
                        "generate: transformers' model.generate on fixed batches of prompts (other samples than fast's "
                        "for the same seed); ctranslate2: CTranslate2 (optional extra) on the generator converted and "
                        "cached, float32 by default")
    p.add_argument("--extend", action="store_true",
                   help="grow the run in --out (same parameters, fewer samples) to --num-samples: its shards are kept "
                        "and only the new ones sampled, giving the shards a fresh run of --num-samples gives (both "
                        "counts multiples of --shard-size)")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo between processes)")
    p.add_argument("--threads", type=POSITIVE_INT, help="torch CPU threads per process")
    p.set_defaults(func=run)


def run(args) -> int:
    from ...methods.generation.sample import CONFIG_FILE, REPORT_FILE, Prompting, SamplingOptions, generate_samples

    check_model_reference(args.generator, "--generator", files=("config.json", "adapter_config.json"))
    run_folder(args.out, "generate", (CONFIG_FILE, REPORT_FILE))  # never a folder of the user's
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    premises = None
    if args.condition != "none":
        if not args.premises_from:
            raise ConfigError(f"--condition {args.condition} needs --premises-from PATH")
        from ...data.loading import file_fingerprint, parse_data_files, read_data_file
        premises = []
        for path in parse_data_files(args.premises_from)["train"]:
            ds = read_data_file(path, file_fingerprint(path)["sha256"])  # a bad file: one line naming it
            if "premise" not in ds.column_names:
                raise ConfigError(f"{path} has no 'premise' column (it has {ds.column_names})")
            premises += [p for p in ds["premise"] if isinstance(p, str) and p.strip()]
    from accelerate import PartialState

    from ...data.tasks import get_task
    from ...methods.generation.step import sampling_values
    from ...utils.outputs import print_values

    task = get_task(args.task)
    if PartialState(cpu=args.cpu).is_main_process:
        print_values("generate values", *sampling_values(
            {k: getattr(args, k) for k in ("top_p", "temperature", "max_new_tokens", "num_samples", "batch_size",
                                           "shard_size", "seed")}, task))
    sampling = SamplingOptions(num_shards=args.num_shards, shard_size=args.shard_size, seed=args.seed,
                               batch_size=args.batch_size, top_p=args.top_p, temperature=args.temperature,
                               max_new_tokens=args.max_new_tokens, engine=args.engine, dtype=args.dtype)
    report = generate_samples(args.generator, args.out, task, args.num_samples, sampling,
                              Prompting(args.condition, premises=premises), cpu=args.cpu, extend=args.extend)
    if report and PartialState(cpu=args.cpu).is_main_process:  # one report, not one per process
        print(json.dumps(report, indent=2))
    return 0
