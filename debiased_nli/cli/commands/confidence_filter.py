"""``debiased-nli confidence-filter``: keep the rows an NLI model is confident of."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._common import POSITIVE_INT, add_task_arguments, command_outputs, number, task_from_args
from ...utils.errors import ConfigError
from ...utils.paths import check_model_reference

DESCRIPTION = """\
Confidence filtering (Wu et al. 2022): an NLI model M (any AutoModelForSequenceClassification, Hub id or
folder, e.g. one trained by `debiased-nli train`) scores every (premise, hypothesis) pair; a row is
kept when M's probability of its label is above --tau (0.95, Table 8 of the paper). M's labels are
matched to the task's by name. Writes kept.parquet and rejected.parquet (both with a `confidence`
column) and confidence_report.json (acceptance rate, per label, confidence quantiles) into --out.

--calibration-data FILE calibrates M first (--calibration-method: temperature scaling, Guo et al. 2017;
per-label isotonic regression, Zadrozny & Elkan 2002; auto, the default: the one with the lower
cross-fitted NLL) on held-out real rows
with gold labels that M did not train on (e.g. the task's validation split; never a challenge set), and
applies --tau to the calibrated probabilities: an over-confident or under-confident M otherwise keeps a
different share at the same tau. It also writes calibration.json (T, NLL and expected calibration error
before and after, the reliability tables) and reliability.png (the reliability diagram); each row then
keeps M's own probability in `confidence_uncalibrated`. --probabilities adds M's probability of every
label (`m_prob_<label>`), so another tau or temperature can be applied later without M.
--calibrator FILE applies the calibration of an earlier run (its calibration.json) as fitted there: with
--probabilities-from, a calibrated filter is rebuilt without M and without the held-out rows.

--tau-rule min_kept chooses tau from M's acceptance curve: --tau when it keeps at least --min-kept rows with
every label among them (--min-kept / #labels each), else the largest of --taus that does, else the smallest
(methods/confidence.py, choose_tau); confidence_report.json records the curve, the tau used and why.
"""


def register(sub) -> None:
    p = sub.add_parser("confidence-filter", help="keep generated rows whose label an NLI model is confident of",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--model", default="roberta-large", help="NLI classifier M: Hub id or folder")
    p.add_argument("--tau", type=number(float, low=0, high=1, high_open=True), default=0.95, help="keep rows with p_M(label) > tau")
    p.add_argument("--tau-rule", choices=["fixed", "min_kept"], default="fixed",
                   help="fixed: --tau as given; min_kept: --tau if it keeps --min-kept rows of every label, else the "
                        "largest of --taus that does")
    p.add_argument("--taus", type=number(float, low=0, high=1, high_open=True), nargs="+",
                   default=[0.5, 0.7, 0.8, 0.9, 0.95, 0.99], help="the taus --tau-rule min_kept tries")
    p.add_argument("--min-kept", type=POSITIVE_INT, default=5000, help="rows --tau-rule min_kept needs")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=64)
    p.add_argument("--max-length", type=POSITIVE_INT, default=128)
    p.add_argument("--calibration-data", metavar="FILE",
                   help="held-out real rows with gold labels (parquet/json/csv) to calibrate M on before --tau")
    p.add_argument("--calibration-method", choices=["auto", "temperature", "isotonic"], default="auto",
                   help="temperature scaling, per-label isotonic regression, or auto: the lower cross-fitted NLL on the "
                        "calibration rows")
    p.add_argument("--calibrator", metavar="FILE",
                   help="calibration.json of an earlier run: apply its fitted calibration (instead of "
                        "--calibration-data); with --probabilities-from, M is not needed")
    p.add_argument("--reuse-probabilities", action="store_true",
                   help="rows that carry every m_prob_<label> (an earlier --probabilities run's output) are thresholded on "
                        "those, without running M over them (M still scores --calibration-data)")
    p.add_argument("--probabilities-from", metavar="FILE",
                   help="M's stored probabilities (a parquet of uid and m_prob_<label>, e.g. written by "
                        "`--probabilities` and kept with a release): joined onto the rows by uid and used as "
                        "--reuse-probabilities does; without --calibration-data, M is not needed at all")
    p.add_argument("--probabilities", action="store_true", help="add M's probability of every label (m_prob_<label>)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--threads", type=POSITIVE_INT, help="torch CPU threads")
    p.set_defaults(func=run)


def run(args) -> int:
    import datasets

    from ...data.loading import parse_data_files
    from ...methods.generation.step import confidence_filter_step

    task = task_from_args(args)
    if args.calibrator and args.calibration_data:
        raise ConfigError("--calibrator applies an earlier run's calibration and --calibration-data fits a new one: "
                          "give one of them")
    if not (args.probabilities_from and not args.calibration_data):  # else M is never loaded
        check_model_reference(args.model, "--model")
    outputs = command_outputs(args.out, "confidence-filter", ("kept.parquet", "rejected.parquet",
                                                              "confidence_report.json", "calibration.json",
                                                              "reliability.png"),
                              legacy=("confidence_report.json",))  # before any work
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    files = parse_data_files(args.data_files) if args.data_files else None
    if files and all(f.endswith(".parquet") for f in files.get(args.split, [])):
        # keep every column of generated shards (provenance), not just the canonical ones
        import pyarrow as pa
        import pyarrow.parquet as pq
        # the columns of every file (a filter's kept and rejected rows differ by its reason column)
        ds = datasets.Dataset(pa.concat_tables([pq.read_table(f) for f in files[args.split]], promote_options="default"))
        if args.max_rows:
            ds = ds.select(range(min(args.max_rows, len(ds))))
    else:
        from ...data.loading import load_task
        ds = load_task(task, args.split, data_files=args.data_files, on_invalid=args.on_invalid,
                       revision=args.revision, max_rows=args.max_rows).dataset
    if args.probabilities_from:
        from ...methods.confidence import join_probabilities
        ds = join_probabilities(ds, args.probabilities_from, task)
        args.reuse_probabilities = True
    calibration = None
    if args.calibration_data:
        from ...data.loading import load_task
        calibration = load_task(task, "train", data_files={"train": [args.calibration_data]},
                                on_invalid=args.on_invalid).dataset
    kept, rejected, report = confidence_filter_step(ds, task, {"model": args.model, "tau": args.tau,
                                                               "batch_size": args.batch_size,
                                                               "max_length": args.max_length,
                                                               "calibration": calibration,
                                                               "calibration_method": args.calibration_method,
                                                               "calibrator": args.calibrator,
                                                               "reuse_probabilities": args.reuse_probabilities,
                                                               "probabilities": args.probabilities,
                                                               "tau_rule": args.tau_rule, "taus": args.taus,
                                                               "min_kept": args.min_kept})
    if args.probabilities_from and not args.calibration_data:  # M was not run: its stored scores were
        from ...utils.provenance import file_sha256
        report["model"] = None
        report["probabilities_from"] = {"file": Path(args.probabilities_from).name,
                                        "sha256": file_sha256(args.probabilities_from)}
    else:
        report["model"] = args.model
    if "calibration" in report and args.calibration_data:
        report["calibration"]["data"] = args.calibration_data
    with outputs:
        out = outputs.paths[0].parent
        kept.to_parquet(str(outputs.temp(out / "kept.parquet")))
        rejected.to_parquet(str(outputs.temp(out / "rejected.parquet")))
        outputs.write_text(out / "confidence_report.json", json.dumps(report, indent=2))
        if "calibration" in report:
            from ...methods.calibration import plot_reliability
            outputs.write_text(out / "calibration.json", json.dumps(report["calibration"], indent=2))
            plot_reliability(report["calibration"], outputs.temp(out / "reliability.png"))
    print(json.dumps({k: v for k, v in report.items() if k != "calibration"}, indent=2))
    if "calibration" in report:
        c = report["calibration"]
        how = f"T = {c['temperature']:.3f}" if c.get("temperature") is not None else c["method"]
        print(f"calibration on {c['rows']:,} held-out rows ({c['selection']['rule']}): {how}, ECE {c['ece_before']:.4f} -> "
              f"{c['ece_after']:.4f}, NLL {c['nll_before']:.4f} -> {c['nll_after']:.4f}")
    return 0
