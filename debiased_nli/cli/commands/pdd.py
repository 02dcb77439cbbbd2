"""``debiased-nli pdd``: training-free perturbations that push every biased feature's z under tau (Guo et al. 2023)."""
from __future__ import annotations

import argparse
import json

from ._common import add_run_arguments, add_task_arguments, command_outputs, run_method, write_set_aside

DESCRIPTION = """\
PDD (Guo et al. 2023, Algorithm 1). For each biased feature x (|z*| > tau) of three families (pair
unigrams, the lexical-overlap feature, the hypothesis-only prediction; families in decreasing z), walk
the rows that contain x: where p_hat(l|x) > p0 replace the row by a perturbation without x, where
p_hat(l|x) < p0 add a perturbation that keeps x, updating x's counts after every operation, until
every |z*(l, x)| <= tau (or the feature is reported unreachable). A perturbation masks words by the
feature's rule (ratios 0.25 unigram, 0.4 overlap and hypothesis-only), fills the masks with a masked LM
prompted with the label ("P ? Yes/Maybe/No . H"), drops candidates that do not really keep/lose x,
and keeps the one the teacher gives the label the highest probability.

Writes to --out: debiased.parquet (kept input rows + perturbed rows with origin, method, source_uid,
teacher_confidence), removed.parquet (replaced rows with replaced_by), perturbations.parquet (every
operation: masked prompt, candidates, choice), pdd.json, pdd.md and pdd_z.png (z before/after).
The perturbations are checkpointed in --out/work: rerunning the same command continues.
"""

EXAMPLE = """\
examples:
  debiased-nli pdd mnli --mlm xlm-roberta-large --teacher runs/mnli/bert-base --tau 20 --out runs/pdd-mnli
  debiased-nli pdd fever --label-groups SUPPORTS "REFUTES,NOT ENOUGH INFO" --teacher runs/fever/T --out runs/pdd-fever
  debiased-nli pdd qqp --overlap-feature "lex-overlap<0.8" --families overlap,unigram --teacher runs/qqp/T --out ...
  debiased-nli pdd snli --data-files ../shared/data/snli/train_sample.parquet \\
      --mlm ~/.cache/debiased-nli/models/minilm-mlm-pdd-standin --teacher runs/pdd/teacher --tau 4.52 --out runs/pdd
"""


def _mapping(text: str | None, what: str, cast=str) -> dict | None:
    if not text:
        return None
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            from ...utils.errors import ConfigError
            raise ConfigError(f"{what} expects NAME=VALUE,..., got {item!r}")
        out[key.strip()] = cast(value.strip())
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("pdd", help="debias with training-free masked-LM perturbations (PDD, Guo et al. 2023)",
                              description=DESCRIPTION, epilog=EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--mlm", default="xlm-roberta-large",
                   help="any AutoModelForMaskedLM, Hub id or folder (default xlm-roberta-large, the paper's)")
    p.add_argument("--teacher", required=True,
                   help="NLI classifier choosing among candidates (folder or Hub id; e.g. `debiased-nli train` output)")
    p.add_argument("--tau", type=float, default=20.0, help="z threshold (default 20, the paper's; scale it as "
                                                          "tau*sqrt(N'/N) for a sample of N' of N rows)")
    p.add_argument("--families", default="auto",
                   help="feature families, e.g. hypo_only,overlap,unigram (default auto: all three)")
    p.add_argument("--order", choices=["z", "given"], default="z",
                   help="process the families in decreasing z (default, the paper's) or in the order given")
    p.add_argument("--overlap-feature", default="lex-overlap>0.8", help="the overlap feature (QQP: lex-overlap<0.8)")
    p.add_argument("--overlap-extractor", help="extractor that emits it (default: the task's overlap_vN, or "
                                               "low_overlap_v1 for <)")
    p.add_argument("--label-groups", nargs="+", metavar="LABEL,LABEL",
                   help="label groups for z (FEVER: SUPPORTS \"REFUTES,NOT ENOUGH INFO\")")
    p.add_argument("--mask-ratio", metavar="unigram=0.25,overlap=0.4,hypo_only=0.4",
                   help="masking ratios (default the paper's)")
    p.add_argument("--prompt-words", metavar="entailment=Yes,...", help="label -> prompt word (default the paper's)")
    p.add_argument("--candidates", type=int, default=8, help="fills per masked row (default 8)")
    p.add_argument("--max-passes", type=int, default=20, help="walks over a feature's rows before giving up (20)")
    p.add_argument("--max-sweeps", type=int, default=1, help="repeat the whole schedule while a feature is above tau")
    p.add_argument("--batch-size", type=int, default=32, help="perturbations per batch (MLM and teacher)")
    p.add_argument("--teacher-batch-size", type=int, default=64)
    p.add_argument("--teacher-max-length", type=int, default=128)
    p.add_argument("--engine", choices=["auto", "packed", "bucketed", "padded"], default="auto",
                   help="forward passes of the masked LM and the teacher: auto (default: packed, i.e. no padding "
                        "and the last layer only where it is read, for BERT models; padded for others), bucketed "
                        "(exact-length groups, any model) or padded (the straightforward reference); the same "
                        "results up to float rounding")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="arithmetic of the masked LM and the teacher: float32 (default, the models' own) or bfloat16 "
                        "(matrix products in bfloat16 under autocast: about twice as fast on CPUs with AVX512-BF16/AMX "
                        "and on GPUs, several times slower on CPUs without them; a near-tied choice or a sampled fill can differ from float32's)")
    add_run_arguments(p, seed_help="seed of the walk order, the masking and the fills' sampling (default 0)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ...methods.pdd.step import pdd_step, write_pdd_outputs

    params = {"mlm": args.mlm, "teacher": args.teacher, "tau": args.tau, "families": args.families, "order": args.order,
              "overlap_feature": args.overlap_feature, "overlap_extractor": args.overlap_extractor,
              "label_groups": [g.split(",") for g in args.label_groups] if args.label_groups else None,
              "ratios": _mapping(args.mask_ratio, "--mask-ratio", float),
              "prompt_words": _mapping(args.prompt_words, "--prompt-words"), "candidates": args.candidates,
              "max_passes": args.max_passes, "max_sweeps": args.max_sweeps, "batch_size": args.batch_size,
              "teacher_batch_size": args.teacher_batch_size, "teacher_max_length": args.teacher_max_length,
              "engine": args.engine, "dtype": args.dtype, "seed": args.seed, "work_dir": str(Path(args.out) / "work"),
              "progress": not args.no_progress}

    from ...methods.pdd.step import OUTPUT_FILES

    outputs = command_outputs(args.out, "pdd", OUTPUT_FILES, legacy=("pdd.json", "work/"))  # before any work

    def write(result, loaded, manifest) -> int:
        import pyarrow.parquet as pq

        kept, removed, report = result
        report["manifest"] = manifest
        log = pq.read_table(report["log_path"]).to_pylist()
        with outputs:
            paths = write_pdd_outputs(kept, removed, report, log, args.out, outputs=outputs)
            write_set_aside(loaded, paths["json"].parent, outputs)
        print(json.dumps({"rows": report["rows"], "operations": {k: report["operations"][k] for k in
                                                                 ("attempted", "keep", "lose", "failed", "acceptance")},
                          "features": report["feature_status"], "out": str(paths["json"].parent)}))
        return 0

    return run_method(args, lambda ds, task: pdd_step(ds, task, params), write)
