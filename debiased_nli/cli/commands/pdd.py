"""``debiased-nli pdd``: training-free perturbations that push every biased feature's z under tau (Guo et al. 2023)."""
from __future__ import annotations

import argparse
import json

from ...methods.pdd.params import PARAMS
from ._common import (
    add_param_options,
    add_run_arguments,
    add_task_arguments,
    command_outputs,
    params_from_args,
    run_method,
    write_set_aside,
)

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


def register(subparsers) -> None:
    p = subparsers.add_parser("pdd", help="debias with training-free masked-LM perturbations (PDD, Guo et al. 2023)",
                              description=DESCRIPTION, epilog=EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--out", required=True, help="output folder")
    # the options come from the step's declaration (methods/pdd/params.py)
    add_param_options(p, PARAMS, skip=("teacher",))
    p.add_argument("--teacher", required=True, help=PARAMS["teacher"].help)
    add_run_arguments(p, seed=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ...methods.pdd.step import pdd_step, write_pdd_outputs

    params = {**params_from_args(args, PARAMS), "work_dir": str(Path(args.out) / "work")}

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
