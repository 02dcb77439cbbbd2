"""``debiased-nli quality``: how good a set of generated rows is, beside real rows."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ._common import POSITIVE_INT, SEED, add_task_arguments, number, task_from_args
from ...utils.paths import check_model_reference

DESCRIPTION = """\
Measure a set of generated rows (e.g. a generator's samples, what the confidence filter kept, or the
generated rows of a release config) against real rows of the task (debiased_nli.methods.quality):

  copies            pairs, hypotheses and premises that are D0's (normalised text)         always
  near-duplicates   character 5-gram Jaccard >= 0.8 with a D0 row (MinHash LSH), and       always
                    within the set
  fluency           mean token log-probability under --lm (a base LM not trained on D0),   with --lm
                    and the share under real held-out rows' 5th percentile
  agreement         the rows' labels against a cross-fitted ensemble of --k classifiers     with --classifier
                    (fine-tuned from --classifier on D0 without one fold each); D0's own
                    cross-fitted agreement beside it
  train-on-generated  a classifier trained on --n generated rows vs one on --n real D0      with --classifier
                    rows, both scored on --heldout real rows (a validation split, never a
                    challenge set)

Writes OUT/quality.json (every figure), OUT/quality.md (tables and examples: up to 20 rows of the set
and, with --rejected, 20 rows a filter dropped) and OUT/scores.parquet (per row: uid, the file's own uid as
source_uid where it has one, near-duplicate Jaccard, fluency, ensemble label). The trained classifiers are kept
under OUT/models (a rerun reuses them). The thresholds are the project's choice (the papers give none); every
draw takes --seed.
"""


def register(sub) -> None:
    p = sub.add_parser("quality", help="measure generated rows against real ones: copies, near-duplicates, "
                                       "fluency, label agreement, train-on-generated",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--reference", required=True, metavar="FILE", help="D0: the real training rows (parquet/json/csv)")
    p.add_argument("--heldout", metavar="FILE", help="real held-out rows (e.g. the validation split): the fluency bound "
                                                     "and train-on-generated's test rows")
    p.add_argument("--rejected", nargs="*", default=[], metavar="FILE", help="rows a filter dropped (examples only)")
    p.add_argument("--lm", help="causal LM for fluency (folder or Hub id; e.g. the generator's base model)")
    p.add_argument("--classifier", help="classifier to fine-tune for agreement and train-on-generated (folder or Hub id)")
    p.add_argument("--fluency-rows", type=POSITIVE_INT, default=2000, help="rows scored for fluency (a seeded sample)")
    p.add_argument("--k", type=number(int, low=2), default=3, help="folds of the cross-fitted ensemble")
    p.add_argument("--n", type=POSITIVE_INT, default=2000, help="rows per classifier in train-on-generated")
    p.add_argument("--seeds", type=SEED, nargs="+", default=[0], help="seeds of train-on-generated")
    p.add_argument("--epochs", type=number(float, low=0, low_open=True), default=1.0, help="classifier epochs")
    p.add_argument("--tog-epochs", type=number(float, low=0, low_open=True), metavar="EPOCHS",
                   help="epochs of train-on-generated's classifiers (default: --epochs); a few thousand rows need "
                        "more than the ensemble's 20k-row epoch to learn past the majority class")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--threads", type=POSITIVE_INT, help="torch CPU threads")
    p.add_argument("--models", metavar="DIR", help="where the trained classifiers go (default OUT/models) and the real "
                   "rows' fluency is kept; give one folder to several runs against the same D0 to train the ensemble "
                   "and score the real rows once")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=run)


def _load(task, files, on_invalid, max_rows=None):
    from ...data.loading import load_task
    return load_task(task, "train", data_files={"train": list(files)}, on_invalid=on_invalid, max_rows=max_rows).dataset


def _own_uids(rows, files) -> "list | None":
    """Each measured row's own ``uid`` in its file (a generator's sample uid, ...), so that the scores join the rows'
    other files (e.g. M's stored probabilities); None unless every file is Parquet with a ``uid`` column. The loader
    numbers rows by position (``<task>:train:<i>``: row i of the files in order), set-aside rows included."""
    import pyarrow.parquet as pq

    if not all(str(f).endswith(".parquet") and "uid" in pq.read_schema(f).names for f in files):
        return None
    own = [u for f in files for u in pq.read_table(f, columns=["uid"]).column("uid").to_pylist()]
    return [own[int(str(u).rsplit(":", 1)[1])] for u in rows["uid"]]


def run(args) -> int:
    from ...methods import quality as Q
    from ...utils.errors import ConfigError
    from ...utils.outputs import TOOL, WRITTEN_BY_KEY, check_target, lock_target

    task = task_from_args(args)
    for ref, opt in ((args.lm, "--lm"), (args.classifier, "--classifier")):
        if ref:
            check_model_reference(ref, opt)
    if args.classifier and not args.heldout:
        raise ConfigError("--classifier (train-on-generated) needs --heldout real rows to test on")

    def ours(folder: Path) -> bool:
        try:
            return json.loads((folder / "quality.json").read_text()).get(WRITTEN_BY_KEY) == TOOL
        except (OSError, ValueError, AttributeError):
            return False

    from ...data.loading import parse_data_files
    files = [f for fs in (parse_data_files(args.data_files) or {}).values() for f in fs]
    if not files:
        raise ConfigError("--data-files: give the generated rows to measure")
    out = check_target(args.out, overwrite=True, must_be_new=False, is_ours=ours, what="quality report",
                       inputs=[*files, args.reference, *([args.heldout] if args.heldout else []), *args.rejected])
    out.mkdir(parents=True, exist_ok=True)
    unlock = lock_target(out)  # one run per folder at a time
    try:
        rows = _load(task, files, args.on_invalid, args.max_rows)  # --max-rows: the first N rows measured
        d0 = _load(task, [args.reference], args.on_invalid)
        heldout = _load(task, [args.heldout], args.on_invalid) if args.heldout else None
        rejected = _load(task, args.rejected, args.on_invalid) if args.rejected else None
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)

        report: dict = {"task": task.name, "rows_files": files, "reference": args.reference, "heldout": args.heldout,
                        "rows": len(rows), "reference_rows": len(d0), "labels": _label_shares(rows, task),
                        "rows_fingerprint": Q.set_fingerprint(rows), "reference_fingerprint": Q.set_fingerprint(d0)}
        scores: dict = {"uid": list(rows["uid"]) if "uid" in rows.column_names else list(range(len(rows)))}
        own = _own_uids(rows, files)
        if own is not None:
            scores["source_uid"] = own
        _copies(args, rows, d0, report, scores)
        if args.lm:
            _fluency(args, rows, heldout if heldout is not None else d0, heldout is not None, report, scores)
        if args.classifier:
            _classifier(args, rows, d0, heldout, task, out, report, scores)
        report["examples"] = _examples(rows, task, args.seed)
        if rejected is not None:
            report["rejected_rows"] = len(rejected)
            report["rejected_examples"] = _examples(rejected, task, args.seed)
        _write(out, report, scores)
    finally:
        unlock()
    print(Q.render_report(report).split("\n## Examples")[0])
    return 0


def _copies(args, rows, d0, report: dict, scores: dict) -> None:
    """Copies of the reference rows and near-duplicates (of the reference's pairs, and within the rows)."""
    from ...methods import quality as Q

    cp = Q.copies(rows, d0)
    scores["pair_copy"] = cp.pop("pair_copy_mask").tolist()
    report["copies"] = cp
    nd = Q.pair_near_duplicates(rows["premise"], rows["hypothesis"], d0["premise"], d0["hypothesis"],
                                seed=args.seed)
    scores["near_duplicate_jaccard"] = nd.pop("max_jaccard").round(4).tolist()
    nd.pop("match"), nd.pop("mask")
    within = Q.pair_near_duplicates(rows["premise"], rows["hypothesis"], seed=args.seed)
    nd["within_set_share"] = within["near_duplicate_share"]
    report["near_duplicates"] = nd


def _real_fluency(args, real, lm, tok, cache: "Path | None"):
    """The fluency of ``--fluency-rows`` real rows, drawn with ``--seed`` alone (the same real rows and so the same
    bound for every set measured against them); kept under ``--models``/fluency so that the next set's run reuses it."""
    import hashlib
    import json

    import numpy as np

    from ...methods import quality as Q
    from ...methods.embeddings import model_identity
    from ...utils.cache import load_npy, save_npy

    rpick = np.sort(np.random.default_rng([args.seed, 1]).permutation(len(real))[:args.fluency_rows])
    key = json.dumps([model_identity(args.lm), Q.set_fingerprint(real), args.fluency_rows, args.seed], default=str)
    path = None if cache is None else cache / f"real-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npy"
    rf = None if path is None else load_npy(path, rows=len(rpick))
    if rf is None:
        texts = Q.pair_texts(real)  # once: indexing a fresh list per row made this quadratic
        rf = Q.fluency_scores([texts[i] for i in rpick], lm, tokenizer=tok)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_npy(path, rf)
    return rf, len(rpick)


def _fluency(args, rows, real, real_is_heldout: bool, report: dict, scores: dict) -> None:
    """``--lm``: the fluency of a seeded sample of the rows beside that of as many ``real`` rows."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...methods import quality as Q

    tok, lm = AutoTokenizer.from_pretrained(args.lm), AutoModelForCausalLM.from_pretrained(args.lm)
    pick = np.sort(np.random.default_rng(args.seed).permutation(len(rows))[:args.fluency_rows])
    texts = Q.pair_texts(rows)  # once: indexing a fresh list per row made this quadratic
    fl = Q.fluency_scores([texts[i] for i in pick], lm, tokenizer=tok)
    cache = Path(args.models).expanduser() / "fluency" if args.models else None
    rf, n_real = _real_fluency(args, real, lm, tok, cache)
    report["fluency"] = {**Q.fluency_summary(fl, rf), "lm": args.lm, "scored_rows": len(pick),
                         "real_rows": n_real, "real": "heldout" if real_is_heldout else "reference"}
    col = np.full(len(rows), np.nan)
    col[pick] = fl
    scores["fluency"] = col.tolist()


def _classifier(args, rows, d0, heldout, task, out: Path, report: dict, scores: dict) -> None:
    """``--classifier``: the cross-fitted ensemble's agreement with the rows' labels, and train-on-generated."""
    import dataclasses

    from ...methods import quality as Q

    # resumable: a rerun (or another run with the same --models) reuses the trained classifiers
    work = Path(args.models).expanduser() if args.models else out / "models"
    fit = Q.Classifiers(args.classifier, epochs=args.epochs, threads=args.threads)
    ag = Q.cross_fitted_agreement(rows, d0, task, fit, str(work / "ensemble"), k=args.k, seed=args.seed)
    scores["ensemble_label"] = [task.labels[i] for i in ag.pop("ensemble_label")]
    scores["ensemble_confidence"] = ag.pop("ensemble_confidence").round(4).tolist()
    report["agreement"] = ag
    n = min(args.n, len(rows), len(d0))
    tog = dataclasses.replace(fit, epochs=args.tog_epochs) if args.tog_epochs else fit
    report["train_on_generated"] = Q.train_on_generated(rows, d0, heldout, task, tog, str(work / "tog"), n=n,
                                                        seeds=args.seeds)


def _write(out: Path, report: dict, scores: dict) -> None:
    """``quality.json``, ``quality.md`` and ``scores.parquet``, each whole or absent (written beside, then renamed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ...methods import quality as Q
    from ...utils.outputs import TOOL, WRITTEN_BY_KEY

    files_out = {"quality.json": json.dumps({**report, WRITTEN_BY_KEY: TOOL}, indent=2, default=float) + "\n",
                 "quality.md": Q.render_report(report)}
    for name, text in files_out.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    tmp = out / ".scores.parquet.tmp"
    pq.write_table(pa.table(scores), tmp)
    os.replace(tmp, out / "scores.parquet")


def _label_shares(ds, task) -> dict:
    import numpy as np

    from ...data.loading import labels_of
    counts = np.bincount(labels_of(ds), minlength=task.num_labels) if len(ds) else np.zeros(task.num_labels)
    return {name: int(c) for name, c in zip(task.labels, counts)}


def _examples(ds, task, seed: int, n: int = 20) -> list[dict]:
    import numpy as np

    pick = np.sort(np.random.default_rng(seed).permutation(len(ds))[:n])
    out = []
    for i in pick:
        r = ds[int(i)]
        lab = r["label"]
        out.append({"premise": r["premise"], "hypothesis": r["hypothesis"],
                    "label": task.labels[lab] if isinstance(lab, int) and 0 <= lab < task.num_labels else lab,
                    **({"confidence": round(float(r["confidence"]), 4)} if r.get("confidence") is not None else {})})
    return out
