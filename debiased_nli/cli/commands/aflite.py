"""``debiased-nli aflite``: adversarial filtering with ensembles of linear models (Le Bras et al. 2020)."""
from __future__ import annotations

import argparse
import json

from ...methods.aflite.params import PARAMS
from ._common import (
    add_param_options,
    add_run_arguments,
    add_task_arguments,
    command_outputs,
    params_from_args,
    run_method,
    task_from_args,
    write_set_aside,
)
from ...utils.paths import check_model_reference

DESCRIPTION = """\
AFLite (Le Bras et al. 2020, Algorithm 1) with the paper's protocol. A warm-up model (the encoder
fine-tuned as a pair classifier) is trained on a random share of the rows, which are then set aside
(reason "warm-up"); the other rows are embedded once with the fine-tuned encoder's first token
([CLS], cached). Then, each round, m multinomial logistic regressions are fitted on m random train
parts of size t = the warm-up size; a row's predictability score is the share of the classifiers that
held it out and predicted its label. Up to k rows with score >= tau are removed per round, highest
first; it stops when fewer than k rows pass tau or n = |D|/3 rows remain (the paper's SNLI result:
182k of 550k). m, k and tau are the project's choices (the paper gives no values).

Writes to --out: kept.parquet, removed.parquet (with aflite_score, aflite_round and reason:
"aflite" or "warm-up"), aflite.json (parameters with their source, sizes per round, the bias audit of
the input, of the kept rows and of a random subset of the same size), aflite.md and aflite.png.
"""

EXAMPLE = """\
example (the paper's warm-up: 3 epochs, lr 1e-5, batch 92 on 10% of the rows):
  debiased-nli aflite snli --data-files ../shared/data/snli/train_sample.parquet \\
      --encoder ~/.cache/debiased-nli/models/all-minilm-l6-v2 --out runs/aflite-snli
sized for a CPU (one epoch, shorter pairs):
  debiased-nli aflite snli --data-files ... --warmup-epochs 1 --warmup-batch-size 16 --warmup-lr 5e-5 \\
      --max-length 64 --out runs/aflite-snli
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("aflite", help="filter a dataset with AFLite (ensembles of linear models on embeddings)",
                              description=DESCRIPTION, epilog=EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--out", required=True, help="output folder")
    # the options come from the step's declaration (methods/aflite/params.py): one name, type, default and source
    g = p.add_argument_group("warm-up and embeddings (defaults: the paper's protocol, Appendix A.4)")
    add_param_options(g, PARAMS, ("encoder", "warmup_share", "warmup_epochs", "warmup_lr", "warmup_eps",
                                  "warmup_batch_size", "batch_size", "max_length", "pooling"))
    a = p.add_argument_group("algorithm (t and n from the paper; m, k, tau: project's choices)")
    add_param_options(a, PARAMS, ("m", "train_size", "k", "tau", "target_n", "selection", "C", "tol", "max_iter",
                                  "max_rounds", "device", "seed"))
    add_run_arguments(a, seed=False)
    add_param_options(p, PARAMS, ("audit", "top_k", "random_control"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ...data.loading import require_two_labels
    from ...methods.aflite.report import write_aflite_outputs
    from ...methods.aflite.step import aflite_step

    task = task_from_args(args)
    if args.encoder:
        check_model_reference(args.encoder, "--encoder")
    # only what the user set is passed on, so the report can tell the paper's defaults from the user's values
    params = params_from_args(args, PARAMS)

    from ...methods.aflite.report import OUTPUT_FILES

    outputs = command_outputs(args.out, "aflite", OUTPUT_FILES, legacy=("aflite.json",))  # before any work

    def step(ds, task):
        require_two_labels(ds, task, f"{task.name} split {args.split!r}")
        return aflite_step(ds, task, params)

    def write(result, loaded, manifest) -> int:
        kept, removed, report = result
        report["manifest"] = {**manifest, "input_fingerprint": loaded.dataset._fingerprint}
        with outputs:
            paths = write_aflite_outputs(kept, removed, report, args.out, outputs=outputs)
            write_set_aside(loaded, paths["json"].parent, outputs)
        print(json.dumps({"kept": report["n_kept"], "removed": report["removed_by_reason"], "rounds": report["rounds"],
                          "stop_reason": report["stop_reason"], "out": str(paths["json"].parent)}))
        return 0

    return run_method(args, step, write, task=task)
