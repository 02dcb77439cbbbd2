"""PDD's perturbation path, old engines against new, on real requests of the tau' = 4.52 run (issue 10).

    python benchmarks/bench_pdd.py [--blocks 4] [--block-size 40] [--rounds 2] [--threads 2]

The requests are those of the committed real run (benchmarks/pdd_run.py at commit aba3db6, tau' = 4.52 on the 20k SNLI
sample): ``--blocks`` blocks of ``--block-size`` consecutive entries of its checkpoint
(``<run>/work/perturbations.cache.jsonl``, in the order the run computed them), spread evenly over the
file, whose source row is an input row (rows made by PDD itself are skipped: their text is not in the
input). Each request is rebuilt exactly as the run built it (same key, seed, fold, hypothesis-only
model, masking ratios, prompt words) and perturbed in batches of one block (the walk's batch of 32 plus
speculation) by two perturbers sharing the real stand-in models (MiniLM masked LM, MiniLM teacher):

- old: ``engine="padded"``, the straightforward forward passes (batches sorted by character length and
  padded to their longest), as the committed run used them;
- new: ``engine="auto"`` (packed: no padding, last layer only where it is read; encoder.py).

Old and new alternate per block (ABBA), so drift in the load of the shared machine hits both. The
speed-up is a ratio of times measured in the same run. Equality: the candidates (fill + containment)
must be identical; the teacher's choice of every request is compared, confidences to the 6 decimals
the log keeps; both against each other and against the committed run's results. Then the whole walk
is replayed with the new ``Algorithm1`` from the committed checkpoint (:func:`replay_walk`): the same
operations and output rows, and how much fill and teacher work the new walk does (speculative
requests reach the teacher only when planned). And the near-tie count: operations of the whole run whose two best candidates are closer than the
largest confidence difference seen here (the only ones whose choice rounding could flip).
Writes benchmarks/results/pdd_bench.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, SHARED_DATA, machine  # noqa: E402

RUN = Path(os.environ.get("PDD_BENCH_RUN", Path.home() / "runs" / "pdd" / "tau4.52"))
TEACHER = Path(os.environ.get("PDD_TEACHER", Path.home() / "runs" / "pdd" / "teacher"))
MLM = Path(os.environ.get("PDD_MLM", Path.home() / ".cache" / "debiased-nli" / "models" / "minilm-mlm-pdd-standin"))
SNLI = SHARED_DATA / "snli" / "train_sample.parquet"
RELEASE = Path(os.environ.get("PDD_BENCH_RELEASE", "/work/releases/pdd-snli"))


def _read_cache(path: Path) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def _chosen(res: dict, label_name: str, method: str):
    from debiased_nli.methods.pdd.algorithm import choose

    if res["status"] != "ok":
        return None
    return choose(res, set(), label_name, method)[0]


def setup(meta: dict):
    """The input rows, the featurizer and prompt words exactly as the committed run built them."""
    from debiased_nli.data.loading import labels_of, load_task
    from debiased_nli.methods.pdd.algorithm import PairFeaturizer
    from debiased_nli.methods.pdd.hypothesis_folds import HypothesisOnlyFolds
    from debiased_nli.methods.pdd.step import _fingerprint
    from debiased_nli.data.tasks import get_task

    task = get_task("snli")
    ds = load_task(task, data_files=str(SNLI)).dataset
    fp = _fingerprint(ds)
    if fp != meta["input"]["input"]:
        raise SystemExit(f"the input rows differ from the committed run's ({fp} != {meta['input']['input']})")
    params = meta["params"]
    cols = ds.select_columns(["premise", "hypothesis", "uid"]).to_dict()
    labels = labels_of(ds)
    hy = HypothesisOnlyFolds(task.labels, folds=params["hypo_only_folds"], seed=params["seed"])
    hy.fit(cols["premise"], cols["hypothesis"], labels)
    feat = PairFeaturizer(task.labels, params["families"], params["overlap_feature"], params["overlap_extractor"], hy)
    rows = {u: (p, h, int(l), int(f)) for u, p, h, l, f in zip(cols["uid"], cols["premise"], cols["hypothesis"],
                                                               labels, hy.fold_of)}
    return task, feat, rows, params


def build_requests(entries, rows, params):
    from debiased_nli.methods.pdd.algorithm import PerturbRequest, derive_seed, family_of

    out = []
    for e in entries:
        sweep, feature, uid, case, pass_ = e["key"].split("|")
        if uid not in rows:
            continue  # a row PDD made: its text is not in the input
        p, h, label, fold = rows[uid]
        out.append((PerturbRequest(e["key"], feature, family_of(feature, params["overlap_feature"]), case, p, h,
                                   label, fold, derive_seed(params["seed"], e["key"])), e["result"]))
    return out


def compare(a: dict, b: dict, label_name: str, method: str) -> dict:
    ca = [(c["premise"], c["hypothesis"], c["rejected_by"]) for c in a["candidates"]]
    cb = [(c["premise"], c["hypothesis"], c["rejected_by"]) for c in b["candidates"]]
    conf = [(x["confidence"], y["confidence"]) for x, y in zip(a["candidates"], b["candidates"])
            if x["confidence"] is not None and y["confidence"] is not None]
    return {"candidates_equal": ca == cb and a["masked_prompt"] == b["masked_prompt"] and a["status"] == b["status"],
            "chosen_equal": _chosen(a, label_name, method) == _chosen(b, label_name, method),
            "confidences": len(conf), "confidences_equal": sum(x == y for x, y in conf),
            "max_abs_diff": max((abs(x - y) for x, y in conf), default=0.0)}


def replay_walk(meta: dict, cache: list[dict], fallback) -> dict:
    """The whole tau' = 4.52 walk again with the new Algorithm1 (``run_pdd`` on the 20k sample, the
    committed run's settings), every perturbation served from the committed checkpoint instead of the
    models: ``prepare`` returns the checkpointed result with the teacher's part removed, ``score`` puts it
    back. Counts what the new walk prepares and what its teacher scores, and compares its operations
    and output rows with the committed run's. A request the committed run never computed is computed
    with ``fallback`` (the real models)."""
    import copy

    from debiased_nli.data.tasks import get_task

    import pyarrow.parquet as pq

    from debiased_nli.data.loading import load_task
    from debiased_nli.methods.pdd import run as run_mod
    from debiased_nli.methods.pdd.algorithm import PDDConfig, Perturber, Prepared

    cached = {e["key"]: e["result"] for e in cache}
    stats = {"prepared": 0, "scored_requests": 0, "scored_texts": 0, "not_in_checkpoint": 0}

    class Replay(Perturber):
        def prepare(self, requests):
            out = []
            for r in requests:
                stats["prepared"] += 1
                if r.key not in cached:
                    stats["not_in_checkpoint"] += 1
                    out.append(fallback.prepare([r])[0])
                    continue
                res = copy.deepcopy(cached[r.key])
                surv = [i for i, c in enumerate(res["candidates"]) if c["confidence"] is not None]
                for c in res["candidates"]:
                    c["confidence"] = None
                    c.pop("teacher_pred", None)
                res["status"] = "failed"
                out.append(Prepared(r, res, surv))
            return out

        def score(self, prepared):
            texts = set()
            for p in prepared:
                stats["scored_requests"] += 1
                if p.request.key not in cached:
                    fallback.score([p])
                    continue
                ref = cached[p.request.key]
                for c in p.survivors:
                    cand, rc = p.result["candidates"][c], ref["candidates"][c]
                    cand["confidence"], cand["teacher_pred"] = rc["confidence"], rc["teacher_pred"]
                    texts.add((cand["premise"], cand["hypothesis"]))
                if p.survivors:
                    p.result["status"] = "ok"
            stats["scored_texts"] += len(texts)

    params = meta["params"]
    cfg = PDDConfig(tau=params["tau"], families=params["families"], order=params["order"],
                    overlap_feature=params["overlap_feature"], label_groups=params["label_groups"],
                    max_passes=params["max_passes"], max_sweeps=params["max_sweeps"], batch_size=params["batch_size"],
                    seed=params["seed"], checkpoint_every=params["checkpoint_every"])
    ds = load_task("snli", data_files=str(SNLI)).dataset
    t0 = time.perf_counter()
    original = run_mod.Perturber
    run_mod.Perturber = Replay
    try:
        out = run_mod.run_pdd(ds, get_task("snli"), filler=None, teacher=None, config=cfg, progress=False,
                              perturbation=run_mod.Perturbation(
                                  ratios=params["ratios"], prompt_words=params["prompt_words"],
                                  overlap_extractor=params["overlap_extractor"],
                                  hypo_only_folds=params["hypo_only_folds"]))
    finally:
        run_mod.Perturber = original
    seconds = time.perf_counter() - t0
    log = pq.read_table(RUN / "work" / "perturbations.parquet",
                        columns=["source_uid", "case", "new_uid", "chosen", "status"]).to_pylist()
    same_ops = [(e["source_uid"], e["case"], e["new_uid"], e["chosen"], e["status"]) for e in log] == \
               [(e["source_uid"], e["case"], e["new_uid"], e["chosen"], e["status"]) for e in out.log]
    st = out.state
    kept_new = [u for u, a in zip(st.uid, st.alive) if a]
    kept_old = pq.read_table(sorted((RELEASE / "data" / "pdd").glob("train-*.parquet"))[0], columns=["uid"]).column(
        "uid").to_pylist() if RELEASE.exists() else None
    old_texts = sum(sum(c["confidence"] is not None for c in e["result"]["candidates"]) for e in cache)
    return {"seconds": round(seconds, 1), "operations": len(out.log), "same_operations_as_committed": same_ops,
            "same_output_rows_as_release": (kept_new == kept_old) if kept_old is not None else None,
            "release": str(RELEASE), "old": {"prepared": len(cache), "scored_requests": len(cache),
                                             "scored_texts": old_texts},
            "new": stats,
            "teacher_work_saved": round(1 - stats["scored_texts"] / old_texts, 4),
            "fill_work_saved": round(1 - stats["prepared"] / len(cache), 4)}


def near_ties(cache: list[dict], eps: float) -> dict:
    """Operations of the whole run whose best two surviving candidates are within ``eps`` (6-decimal
    confidences): the only ones whose choice a float difference of at most ``eps`` could change."""
    n, close = 0, 0
    for e in cache:
        conf = sorted((c["confidence"] for c in e["result"]["candidates"] if c["confidence"] is not None), reverse=True)
        if len(conf) >= 2:
            n += 1
            close += conf[0] - conf[1] <= eps
    return {"operations_with_2_or_more_survivors": n, "eps": eps, "within_eps": close}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the blocks (each block: old, new or new, old)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check", type=int, default=0,
                    help="N more requests, spread over the whole run, perturbed by the new path only and compared "
                         "with the committed run's results (equality, not timed)")
    ap.add_argument("--out", default=str(RESULTS / "pdd_bench"), help="writes OUT.json and OUT.md")
    ap.add_argument("--render", action="store_true", help="only rewrite OUT.md from OUT.json")
    args = ap.parse_args(argv)
    if args.render:
        Path(args.out + ".md").write_text(render(json.loads(Path(args.out + ".json").read_text())))
        return 0

    import torch
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer

    from debiased_nli.methods.pdd.algorithm import Perturber
    from debiased_nli.methods.pdd.fill import MaskFiller
    from debiased_nli.methods.pdd.teacher import Teacher

    torch.set_num_threads(args.threads)
    meta = json.loads((RUN / "work" / "run.json").read_text())
    t0 = time.perf_counter()
    task, feat, rows, params = setup(meta)
    cache = _read_cache(RUN / "work" / "perturbations.cache.jsonl")
    starts = [int(i * (len(cache) - args.block_size) / max(1, args.blocks - 1)) for i in range(args.blocks)]
    blocks = [build_requests(cache[s:s + args.block_size], rows, params) for s in starts]
    setup_s = time.perf_counter() - t0

    mlm, mlm_tok = AutoModelForMaskedLM.from_pretrained(str(MLM)), AutoTokenizer.from_pretrained(str(MLM))
    clf, clf_tok = AutoModelForSequenceClassification.from_pretrained(str(TEACHER)), AutoTokenizer.from_pretrained(str(TEACHER))
    tmax = meta["models"]["teacher"]["max_length"]
    words = params["prompt_words"]
    make = lambda engine: Perturber(task.labels, feat,  # noqa: E731
                                    MaskFiller(mlm, mlm_tok, candidates=meta["models"]["filler"]["candidates"],
                                               batch_size=32, max_length=256, engine=engine),
                                    Teacher(clf, task.labels, tokenizer=clf_tok, batch_size=64, max_length=tmax,
                                            engine=engine), words, params["ratios"])
    paths = {"old": make("padded"), "new": make("auto")}
    engines = {k: {"teacher": p.teacher.engine, "fill": p.filler.engine} for k, p in paths.items()}
    # warm-up (first-call allocations), not timed
    for p in paths.values():
        p.perturb([r for r, _ in blocks[0][:4]])
        p.seconds = dict.fromkeys(p.seconds, 0.0)
    wall = {"old": 0.0, "new": 0.0}
    results: dict[str, dict[str, dict]] = {"old": {}, "new": {}}
    for rnd in range(args.rounds):
        for b, block in enumerate(blocks):
            reqs = [r for r, _ in block]
            order = ("old", "new") if (rnd + b) % 2 == 0 else ("new", "old")
            for name in order:
                t = time.perf_counter()
                out = paths[name].perturb(reqs)
                wall[name] += time.perf_counter() - t
                if rnd == 0:
                    results[name].update({r.key: res for r, res in zip(reqs, out)})
            print(f"round {rnd} block {b}: old {wall['old']:.1f} s, new {wall['new']:.1f} s so far", flush=True)

    committed = {r.key: res for block in blocks for r, res in block}
    reqs = {r.key: r for block in blocks for r, _ in block}
    cmp = {}
    for a, b in (("new", "old"), ("old", "committed"), ("new", "committed")):
        A = results[a] if a != "committed" else committed
        B = results[b] if b != "committed" else committed
        rows_ = [compare(A[k], B[k], task.labels[reqs[k].label], f"pdd:{reqs[k].feature}:{reqs[k].case}") for k in reqs]
        cmp[f"{a}_vs_{b}"] = {
            "requests": len(rows_), "candidates_equal": sum(r["candidates_equal"] for r in rows_),
            "chosen_equal": sum(r["chosen_equal"] for r in rows_),
            "confidences": sum(r["confidences"] for r in rows_),
            "confidences_equal_6_decimals": sum(r["confidences_equal"] for r in rows_),
            "max_abs_confidence_diff": round(max((r["max_abs_diff"] for r in rows_), default=0.0), 7)}
    secs = {k: {s: round(v, 2) for s, v in p.seconds.items()} for k, p in paths.items()}
    check = None
    if args.check:
        timed = {r.key for block in blocks for r, _ in block}
        stride = max(1, len(cache) // args.check)
        pool = [(r, res) for r, res in build_requests(cache[stride // 2::stride], rows, params) if r.key not in timed]
        rows_ = []
        for b in range(0, len(pool), 32):
            part = pool[b:b + 32]
            for (r, ref), res in zip(part, paths["new"].perturb([r for r, _ in part])):
                rows_.append(compare(res, ref, task.labels[r.label], f"pdd:{r.feature}:{r.case}"))
        check = {"stride": stride, "requests": len(rows_), "candidates_equal": sum(r["candidates_equal"] for r in rows_),
                 "chosen_equal": sum(r["chosen_equal"] for r in rows_),
                 "confidences": sum(r["confidences"] for r in rows_),
                 "confidences_equal_6_decimals": sum(r["confidences_equal"] for r in rows_),
                 "max_abs_confidence_diff": round(max((r["max_abs_diff"] for r in rows_), default=0.0), 7)}
    n_req = sum(len(b) for b in blocks)
    n_cand = sum(sum(c["confidence"] is not None for c in res["candidates"]) for res in results["new"].values())
    ratio = lambda k: round(secs["old"][k] / secs["new"][k], 3) if secs["new"][k] else None  # noqa: E731
    saving = replay_walk(meta, cache, paths["new"])
    eps = max([c["max_abs_confidence_diff"] for c in cmp.values()] + ([check["max_abs_confidence_diff"]] if check else []))
    out = {
        "command": "python benchmarks/bench_pdd.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {**machine(), "threads": args.threads, "torch": torch.__version__,
                    "shared": "another long job (an IBADR run) and other short jobs used the same 2 cores"},
        "run": str(RUN), "requests": n_req, "survivors_scored_per_round": n_cand, "rounds": args.rounds,
        "blocks": [{"start": s, "requests": len(b), "families": sorted({r.family for r, _ in b})}
                   for s, b in zip(starts, blocks)],
        "engines": engines, "seconds": secs, "wall": {k: round(v, 2) for k, v in wall.items()},
        "ratio": {"teacher": ratio("teacher"), "fill": ratio("fill"),
                  "perturb_wall": round(wall["old"] / wall["new"], 3) if wall["new"] else None},
        "equality": cmp, "equality_check_new_vs_committed": check, "walk_replay": saving, "near_ties": near_ties(cache, eps), "setup_seconds": round(setup_s, 1),
    }
    # projection onto the committed run: its stage seconds, split as measured there (teacher 73%, fill 19%)
    rep = json.loads((RUN / "pdd.json").read_text())
    s2 = rep["seconds"]
    stage_s = sum(json.loads(l)["seconds"] for l in (RUN / "stages.jsonl").read_text().splitlines() if l.strip())
    share_t, share_f = s2["teacher"] / s2["total"], s2["fill"] / s2["total"]
    rest = 1 - share_t - share_f
    proj = stage_s * (share_t * (1 - saving["teacher_work_saved"]) / out["ratio"]["teacher"]
                      + share_f * (1 - saving["fill_work_saved"]) / out["ratio"]["fill"] + rest)
    out["projection"] = {"committed_stage_seconds": round(stage_s, 1), "teacher_share": round(share_t, 3),
                         "fill_share": round(share_f, 3), "projected_seconds": round(proj, 0)}
    Path(args.out + ".json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    Path(args.out + ".md").write_text(render(out))
    print(json.dumps({k: out[k] for k in ("ratio", "wall", "projection")}, indent=1))
    print(json.dumps(cmp, indent=1))
    return 0


def render(o: dict) -> str:
    e = o["equality"]
    nv, oc, nc = e["new_vs_old"], e["old_vs_committed"], e["new_vs_committed"]
    s, w, p = o["seconds"], o["walk_replay"], o["projection"]
    nt = o["near_ties"]
    L = ["# PDD perturbations: old engines against new, on the real tau' = 4.52 workload", "",
         f"Command: `{o['command'].strip()}` ({o['machine']['cpus']} CPUs, {o['machine']['threads']} torch threads, "
         f"torch {o['machine']['torch']}). **The machine was shared**: {o['machine']['shared']}, so absolute "
         "times are inflated and noisy; the figures that matter are the ratios, old and new timed in the same run, "
         "alternating block by block.", "",
         f"{o['requests']} requests of the committed run (`{o['run']}`): {len(o['blocks'])} blocks of consecutive "
         f"checkpoint entries at offsets {', '.join(str(b['start']) for b in o['blocks'])} (families: "
         f"{', '.join(sorted({f for b in o['blocks'] for f in b['families']}))}), rebuilt with the run's keys, seeds, "
         f"folds and models (MiniLM masked-LM stand-in, MiniLM teacher at max length 64), each block perturbed as one "
         f"batch (as the walk batches a plan and its speculation) by both paths, {o['rounds']} rounds; "
         f"{o['survivors_scored_per_round']:,} candidates scored by the teacher per round and path.", "",
         "| | old (`padded`) | new (`" + o["engines"]["new"]["teacher"] + "` teacher, `" + o["engines"]["new"]["fill"]
         + "` fill) | ratio old / new |", "|---|---:|---:|---:|",
         f"| teacher (s) | {s['old']['teacher']} | {s['new']['teacher']} | **{o['ratio']['teacher']}** |",
         f"| masked-LM fill (s) | {s['old']['fill']} | {s['new']['fill']} | **{o['ratio']['fill']}** |",
         f"| masking + containment (s) | {round(s['old']['mask'] + s['old']['containment'], 2)} | "
         f"{round(s['new']['mask'] + s['new']['containment'], 2)} | |",
         f"| whole perturbation, wall (s) | {o['wall']['old']} | {o['wall']['new']} | **{o['ratio']['perturb_wall']}** |",
         "", "## Equality", "",
         f"- new vs old: candidates (fill + containment) identical for {nv['candidates_equal']} of {nv['requests']} "
         f"requests; the teacher's choice identical for {nv['chosen_equal']} of {nv['requests']}; "
         f"{nv['confidences_equal_6_decimals']} of {nv['confidences']} confidences equal to 6 decimals, largest "
         f"difference {nv['max_abs_confidence_diff']:.1e}.",
         f"- old vs the committed run: candidates identical {oc['candidates_equal']}/{oc['requests']}, choices "
         f"{oc['chosen_equal']}/{oc['requests']}, confidences {oc['confidences_equal_6_decimals']}/{oc['confidences']} "
         f"(largest difference {oc['max_abs_confidence_diff']:.1e}: the committed run batched differently, so its "
         "padding, and with it the last bits, differed).",
         f"- new vs the committed run: candidates {nc['candidates_equal']}/{nc['requests']}, choices "
         f"{nc['chosen_equal']}/{nc['requests']}, confidences {nc['confidences_equal_6_decimals']}/{nc['confidences']} "
         f"(largest difference {nc['max_abs_confidence_diff']:.1e}).",
         *([f"- {o['equality_check_new_vs_committed']['requests']} more requests spread over the whole run (one "
            f"checkpoint entry in {ec['stride']}, those whose source is an input row; new path only, not timed) "
            "against the committed run: "
            f"candidates identical {ec['candidates_equal']}/{ec['requests']}, choices {ec['chosen_equal']}/{ec['requests']}, "
            f"confidences {ec['confidences_equal_6_decimals']}/{ec['confidences']} (largest difference "
            f"{ec['max_abs_confidence_diff']:.1e})."] if (ec := o.get("equality_check_new_vs_committed")) else []),
         f"- Whole run: of the {nt['operations_with_2_or_more_survivors']:,} checkpointed perturbations with two or "
         f"more surviving candidates, {nt['within_eps']} had their best two within {nt['eps']:.1e} (the largest "
         "difference seen above), the only ones whose choice float rounding of that size could change (the old "
         "path itself moves the 6th decimal with the batch composition, see old vs committed).", "",
         "## The walk: speculative perturbations reach the teacher only when planned", "",
         f"The whole tau' = 4.52 walk replayed with the new `Algorithm1` ({w['seconds']:.0f} s; every perturbation "
         "served from the committed checkpoint, the teacher's part put back when the new walk scores it): "
         f"{w['operations']:,} operations, the same operations, choices and new rows as the committed run: "
         f"**{w['same_operations_as_committed']}**; the same output rows as the release `{w['release']}`: "
         f"**{w['same_output_rows_as_release']}**. Work: the committed walk computed {w['old']['prepared']:,} "
         f"perturbations and scored {w['old']['scored_texts']:,} candidates; the new one prepares "
         f"{w['new']['prepared']:,} (masking, fill, containment; {w['new']['not_in_checkpoint']} not in the checkpoint, "
         f"computed with the real models) and its teacher scores {w['new']['scored_texts']:,} candidates of "
         f"{w['new']['scored_requests']:,} perturbations: {100 * w['teacher_work_saved']:.1f}% less teacher work, "
         f"{100 * w['fill_work_saved']:.1f}% less fill work.", "",
         "## Projection for the full run", "",
         f"The committed tau' = 4.52 run took {p['committed_stage_seconds']:.0f} s of stages, the teacher "
         f"{100 * p['teacher_share']:.0f}% and the fill {100 * p['fill_share']:.0f}% of it (its second stage's split). "
         f"With the ratios above and the walk's savings: about **{p['projected_seconds']:.0f} s** "
         "(teacher x (1 - saving) / ratio + fill x (1 - saving) / ratio + the rest unchanged), to be confirmed by the "
         "rerun; the ratios were measured on a shared machine (see above).", ""]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
