"""`debiased-nli evaluate`: score fine-tuned classifiers on a challenge suite and write the report."""
from __future__ import annotations

import argparse
from ._common import NON_NEGATIVE_INT, POSITIVE_INT

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
                   help="record every scored set in this Hub model repo (created if needed), in one commit: the "
                        "card's model-index and a results table, .eval_results/<set>.yaml (the sets that have a Hub "
                        "dataset to name), evaluation/results.json and report.md. Rows that are a Hub split's go under "
                        "its id and split; a local stand-in or subset of one under that id, saying so; the others by "
                        "their name, each with its file's sha256 as the source. A --max-examples sample is recorded "
                        "as such (rows scored, seed), several --model seeds as mean and std")
    p.add_argument("--private", action="store_true", help="--push-to: create the repo as private")
    p.add_argument("--token", help="Hub token for --push-to (default: the logged-in token)")
    p.add_argument("--label-order", metavar="NAME,NAME,...",
                   help="the task label of each model output, in output order (for heads named LABEL_0, "
                        "LABEL_1, ...; default: their config.id2label, or the task's order with a warning)")
    p.add_argument("--list", action="store_true", help="list the suites and challenge sets, then exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ...api import evaluate
    from ...models.challenge import get_set, get_suite, list_sets, list_suites
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
    label_order = [x.strip() for x in args.label_order.split(",")] if args.label_order else None
    out = evaluate(args.model, suite=args.suite, sets=args.sets, out=args.out, name=args.name, compare=args.compare,
                   max_examples=args.max_examples, sample_seed=args.sample_seed, batch_size=args.batch_size,
                   max_tokens=args.max_tokens, max_length=args.max_length, data_root=args.data_root,
                   device=args.device, dtype=args.dtype, label_order=label_order, notes=args.notes,
                   push_to=args.push_to, private=args.private, token=args.token, progress=not args.quiet)
    for s, e in out.results["sets"].items():
        std = f" ± {100 * e['accuracy_std']:.1f}" if len(e["runs"]) > 1 else ""
        print(f"{s:28s} n={e['n']:>6}  accuracy {100 * e['accuracy']:.1f}{std}")
    print("wrote " + ", ".join(str(p) for p in out.paths.values()))
    if out.pushed:
        print(f"pushed the results of {len(out.pushed['sets'])} sets to {out.pushed['repo_id']}: "
              f"{out.pushed['commit_url']}")
        if out.pushed["not_in_eval_results"]:
            print("in the model-index but not in .eval_results/ (no Hub dataset to name): "
                  + ", ".join(out.pushed["not_in_eval_results"]))
    return 0
