"""`debiased-nli evaluate`: score fine-tuned classifiers on a challenge suite and write the report."""
from __future__ import annotations

import argparse
from pathlib import Path

from ._common import NON_NEGATIVE_INT, POSITIVE_INT, check_model_reference

_EPILOG = """examples:
  debiased-nli evaluate --model runs/base --suite nli --out eval/base
  debiased-nli evaluate --model runs/zf-s1 runs/zf-s2 runs/zf-s3 --suite nli --out eval/zf \\
      --compare baseline=eval/base/results.json --max-examples 1000
  debiased-nli evaluate --model runs/zf-s1 --sets hans snli_test_hard --out eval/quick
  debiased-nli evaluate --list                       # the registered suites and sets
  debiased-nli evaluate --model runs/zf --suite nli --out eval/zf --push-to org/minilm-snli-zf

Several --model folders (one per seed) give mean ± std. Sets are read from --data-root
(default $DEBIASED_NLI_DATA_ROOT or ../shared/data next to the repository), else from the Hub."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="score models on a challenge suite (results.json, report.md, chart)",
                       description="Score one or more fine-tuned classifiers (one per seed) on the challenge sets "
                                   "of a suite and write OUT/results.json, OUT/report.md and OUT/accuracy.png.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", help="model folder(s) or Hub id(s); several = seeds of one recipe")
    p.add_argument("--suite", help="a named suite: nli, fever, qqp (see --list)")
    p.add_argument("--sets", nargs="+", help="challenge sets by name (added to --suite's)")
    p.add_argument("--out", help="output folder")
    p.add_argument("--name", help="column name of these models in the report (default: the --out folder name)")
    p.add_argument("--compare", nargs="+", metavar="[NAME=]RESULTS", default=[],
                   help="other results.json files (or folders) to add as report columns")
    p.add_argument("--max-examples", type=POSITIVE_INT, help="score a seeded random sample of at most N rows per set")
    p.add_argument("--sample-seed", type=NON_NEGATIVE_INT, default=0, help="seed of the --max-examples sample (default 0)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=64, help="most rows per batch (rows are batched by length)")
    p.add_argument("--max-tokens", type=POSITIVE_INT,
                   help="most padded tokens per batch (rows x longest row): short rows get larger batches")
    p.add_argument("--max-length", type=POSITIVE_INT, default=128, help="maximum tokens of premise+hypothesis")
    p.add_argument("--data-root", help="folder holding the challenge-set files (the specs' local: paths)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="arithmetic of the forward passes: float32, or bfloat16 autocast (about 2x faster on GPUs "
                        "and on CPUs with AVX512-BF16/AMX, several times slower on CPUs without them; can flip the argmax "
                        "of near-tied rows; the report says so)")
    p.add_argument("--notes", help="a paragraph appended to report.md (e.g. how the models were trained)")
    p.add_argument("--push-to", metavar="MODEL_REPO",
                   help="write the results into this Hub model card's model-index: sets read from a Hub dataset only, "
                        "under its id; a --max-examples sample is recorded as such (rows scored, seed), several "
                        "--model seeds as mean and std")
    p.add_argument("--token", help="Hub token for --push-to (default: the logged-in token)")
    p.add_argument("--label-order", metavar="NAME,NAME,...",
                   help="the task label of each model output, in output order (for heads named LABEL_0, "
                        "LABEL_1, ...; default: their config.id2label, or the task's order with a warning)")
    p.add_argument("--list", action="store_true", help="list the suites and challenge sets, then exit")
    p.set_defaults(func=run)


def _compare_args(items):
    from ...models.evaluation import load_results

    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).parent.name if Path(item).suffix == ".json" else Path(item).name, item
        out[name] = load_results(path)
    return out


def run(args: argparse.Namespace) -> int:
    from ...models.challenge import get_set, get_suite, list_sets, list_suites, resolve_sets
    from ...models.evaluation import EvalConfig, evaluate_models, evaluation_outputs, push_results, write_outputs
    from ...utils.errors import ConfigError

    if args.list:
        for s in list_suites():
            suite = get_suite(s)
            print(f"suite {s}: {suite.description}\n    {', '.join(suite.sets)}")
        for s in list_sets():
            spec = get_set(s)
            print(f"{s:28s} {spec.expected_rows or '?':>7} rows  {spec.description}")
        return 0
    if not args.model or not args.out:
        raise ConfigError("evaluate needs --model DIR [DIR ...] and --out DIR (or --list)")
    if args.push_to:
        from ...utils.hub import check_repo_id

        check_repo_id(args.push_to, "--push-to")
    for model in args.model:
        check_model_reference(model, "--model")
    label_order = [x.strip() for x in args.label_order.split(",")] if args.label_order else None
    if label_order is not None and (not all(label_order) or len(set(label_order)) != len(label_order)):
        raise ConfigError(f"--label-order {args.label_order!r}: give each label name once, comma-separated")
    sets = resolve_sets(args.suite, args.sets)
    compare = _compare_args(args.compare)
    outputs = evaluation_outputs(args.out)  # before any model is scored: never over a file of the user's
    cfg = EvalConfig(max_examples=args.max_examples, sample_seed=args.sample_seed, batch_size=args.batch_size,
                     max_length=args.max_length, max_tokens=args.max_tokens, data_root=args.data_root,
                     device=args.device, label_order=label_order, dtype=args.dtype)
    results = evaluate_models(args.model, sets, cfg)
    results["suite"] = args.suite
    name = args.name or Path(args.out).name
    paths = write_outputs(results, args.out, outputs=outputs, name=name, compare=compare, notes=args.notes or "",
                          title=f"Evaluation report: {name}")
    for s, e in results["sets"].items():
        std = f" ± {100 * e['accuracy_std']:.1f}" if len(e["runs"]) > 1 else ""
        print(f"{s:28s} n={e['n']:>6}  accuracy {100 * e['accuracy']:.1f}{std}")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if args.push_to:
        info, left_out = push_results(args.push_to, results, token=args.token)
        print(f"pushed the model-index to {args.push_to}: {getattr(info, 'commit_url', info)}")
        if left_out:
            print(f"not in the model-index (no Hub dataset with these rows): {', '.join(left_out)}")
    return 0
