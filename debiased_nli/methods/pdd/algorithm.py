"""PDD's Algorithm 1, "Z-value Reducing" (Guo et al. 2023, section 3.2), over three feature families.

    D <- D_b
    for each family, in decreasing order of its largest z-value (section 4.1):
        X_b <- the family's features x with max_l |z*(l, x)| > tau on D, in decreasing max |z*|
        for x in X_b:
            counts <- x's count vector over D (one per label group); D_b <- D
            while max_l |z*(l, x)| > tau:                       (guards: max_passes, unreachable)
                for S = (P, H, l) in D_b that contains x and is still in D (seeded order):
                    if |z*(l, x)| > tau:
                        if p_hat(l|x) < p0: S' <- perturb S keeping x;  add S'            n_l += 1
                        else:               S' <- perturb S losing x;   add S', remove S  n_l -= 1
                        (O(1): only x's count vector changes)
    perturb S = feature-specific masking (masking.py) -> label-prompted MLM fill, several candidates
                (fill.py) -> containment check (the candidate really keeps / loses x) -> the candidate
                the teacher gives label l the highest probability (teacher.py)

z*(l, x) is Eq. 1 over label *groups* (``label_groups``: FEVER's "refutes" + "not enough info" are one
class, section 4.2; by default every label is its own group), p0 = 1/K. The families are pair
unigrams (``unigram_pair_v1``: ``<w>@pair``), the lexical-overlap feature (by name: ``lex-overlap>0.8``
for MNLI, ``lex-overlap<0.8`` for QQP, from whichever overlap extractor is named) and the
hypothesis-only prediction (``hypo-only-pred=<label>``, hypothesis_folds.py).

**Batching without changing the result.** Algorithm 1 is sequential: whether the next row is perturbed,
and how, depends on the counts after the previous operation. Here every perturbation is a pure
function of (feature, source row, case, pass, sweep, seed) (its random masking and sampling use a
generator seeded from those), so the walk *plans* the next ``batch_size`` operations assuming they
succeed, perturbs them in one batch (one MLM forward pass, one teacher pass), and applies them in
order; at the first failure the rest of the plan is re-planned from the real counts (results already
computed are reused, since they are pure). The rows perturbed and the output are exactly those of the
one-by-one walk (:func:`reference_reduce_feature`, the slow obvious version that recounts x over all
of D after every operation, agrees operation for operation in the tests).
The teacher, most of the time on CPU, scores only planned operations: a batch is first *prepared*
(masking, fill, containment check), and the teacher scores the plan's requests; the speculative ones
wait prepared until a later plan reaches them, and are never scored if none does
(``Algorithm1._ensure``).
The cache is also the checkpoint: complete results are appended to
``<work_dir>/perturbations.cache.jsonl`` as it grows; a rerun replays the bookkeeping (seconds) and
perturbs only what is missing, so an interrupted run continues where it stopped.

**Deviations and choices (the paper is silent on each):**
- The pseudocode walks D_b, which still holds rows already removed from D; rows no longer in D are
  skipped (a removed row cannot be perturbed again).
- Guards: a feature stops with status ``max_passes`` after ``max_passes`` walks over its rows (default
  20), and with status ``unreachable`` when a whole walk makes no successful operation (e.g. p_hat(l|x)
  < p0 and no row of label l contains x, or every candidate fails the containment check); the reason
  is reported. The loop never runs without bound.
- Order: families in decreasing max |z*| on the input (section 4.1, "The order is determined by
  ranking the z-value from highest to lowest"; ``families`` may fix it); inside a family, features in
  decreasing max |z*| on D when the family starts (ties by name); X_b of a family is computed when the
  family starts, on the D the earlier families left. Rows are walked in a seeded random order, a new
  one per pass.
- A later operation may raise the z of a feature already processed (the paper's Limitations: "the
  operation to mitigate the z-value of one class may influence the z-values of other classes").
  ``max_sweeps`` > 1 (default 1, the paper's single sweep) repeats the whole schedule while any feature
  of the families is above tau.
- A candidate equal to its source, or whose text duplicates a row already made (same content, same
  method), is not used (the next best candidate is).
- A row made by PDD can be the source of a later operation (it is in D_b for later features); when it
  is replaced it goes to the removed rows like an original.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from ...bias.features import extract_table
from ...bias.zstats import group_labels
from ...data.loading import content_uid
from ...utils.errors import ConfigError
from .masking import FAMILIES, HYPO_ONLY, OVERLAP, PAPER_RATIOS, UNIGRAM, mask_pair, overlap_direction, unigram_word
from .zvalue import KEEP, LOSE, apply_case, case_for, z_star

logger = logging.getLogger(__name__)

PAIR_EXTRACTOR = "unigram_pair_v1"
HYPO_PREFIX = "hypo-only-pred="
CACHE_FILE = "perturbations.cache.jsonl"
META_FILE = "run.json"

# reasons an operation fails
NOTHING_TO_MASK = "nothing to mask"
TRUNCATED = "prompt too long (masks truncated)"
NO_SURVIVOR = "no candidate passed the containment check"
DUPLICATE = "every surviving candidate duplicates a row already made"
# why a candidate is rejected
SAME_AS_SOURCE = "identical to the source"
STILL_HAS_X = "still contains x"
LOST_X = "lost x"


def derive_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}|{key}".encode()).digest()[:8], "little")


def _z_list(counts: Sequence[int], p0: float) -> list[float]:
    """z* of a small count vector in plain Python (the walk's hot path; same values as zvalue.z_star)."""
    n = sum(counts)
    if n <= 0:
        return [0.0] * len(counts)
    sd = math.sqrt(p0 * (1 - p0) / n)
    return [(c / n - p0) / sd for c in counts]


def walk_order(rows: Sequence[int], seed: int, feature: str, sweep: int, pass_: int) -> list[int]:
    """The seeded order in which one pass walks the rows that contain ``feature``."""
    rows = list(rows)
    perm = np.random.default_rng(derive_seed(seed, f"walk|{sweep}|{feature}|{pass_}")).permutation(len(rows))
    return [rows[i] for i in perm]


def op_key(sweep: int, feature: str, uid: str, case: str, pass_: int) -> str:
    return f"{sweep}|{feature}|{uid}|{case}|{pass_}"


def family_of(feature: str, overlap_feature: str) -> str | None:
    if feature.endswith("@pair"):
        return UNIGRAM
    if feature == overlap_feature:
        return OVERLAP
    if feature.startswith(HYPO_PREFIX):
        return HYPO_ONLY
    return None


def default_overlap_extractor(feature: str, task_features: Sequence[str] = ()) -> str:
    """``lex-overlap<0.8`` -> ``low_overlap_v1``; otherwise the task's newest ``overlap_vN`` (or v1)."""
    if overlap_direction(feature) == "low":
        return "low_overlap_v1"
    cands = sorted((f for f in task_features if f.startswith("overlap_v") and f[len("overlap_v"):].isdigit()),
                   key=lambda f: int(f[len("overlap_v"):]))
    return cands[-1] if cands else "overlap_v1"


# ---------------------------------------------------------------------------------------------------
# features of rows and candidates

class PairFeaturizer:
    """The PDD features of pairs: ``<w>@pair``, the overlap feature, ``hypo-only-pred=<label>``."""

    def __init__(self, labels: Sequence[str], families: Sequence[str], overlap_feature: str,
                 overlap_extractor: str, hyponly=None):
        self.labels = tuple(labels)
        self.families = tuple(families)
        self.overlap_feature, self.overlap_extractor = overlap_feature, overlap_extractor
        self.hyponly = hyponly
        if HYPO_ONLY in self.families and hyponly is None:
            raise ConfigError("the hypo_only family needs a hypothesis-only model")

    def features(self, premises: Sequence[str], hypotheses: Sequence[str], folds: Sequence[int] | None = None,
                 hypo_pred: Sequence[int] | None = None) -> list[list[str]]:
        n = len(premises)
        out: list[list[str]] = [[] for _ in range(n)]
        if not n:
            return out
        table = pa.table({"premise": pa.array(list(premises), pa.string()),
                          "hypothesis": pa.array(list(hypotheses), pa.string())})
        from .hypothesis_folds import INPUT_EXTRACTORS

        predict = HYPO_ONLY in self.families and hypo_pred is None
        extractors = ([PAIR_EXTRACTOR] if UNIGRAM in self.families else []) + \
                     ([self.overlap_extractor] if OVERLAP in self.families else []) + \
                     (list(INPUT_EXTRACTORS) if predict else [])
        feats = extract_table(table, extractors, self.labels) if extractors else None  # one tokenisation
        if extractors:
            if UNIGRAM in self.families:
                for i, row in enumerate(feats.column("feat_" + PAIR_EXTRACTOR).to_pylist()):
                    out[i].extend(row)
            if OVERLAP in self.families:
                for i, row in enumerate(feats.column("feat_" + self.overlap_extractor).to_pylist()):
                    if self.overlap_feature in row:
                        out[i].append(self.overlap_feature)
        if HYPO_ONLY in self.families:
            pred = hypo_pred if hypo_pred is not None else self.hyponly.predict(premises, hypotheses, folds, feats)
            for i, p in enumerate(pred):
                out[i].append(HYPO_PREFIX + self.labels[int(p)])
        return out


# ---------------------------------------------------------------------------------------------------
# perturbation: masking -> fill -> containment -> teacher (a pure function of the request)

@dataclasses.dataclass(frozen=True)
class PerturbRequest:
    key: str
    feature: str
    family: str
    case: str
    premise: str
    hypothesis: str
    label: int
    fold: int
    seed: int


@dataclasses.dataclass
class Prepared:
    """A perturbation before the teacher: its result (masked prompt, candidates, rejections; the
    survivors' confidences still None) and the survivors, as candidate indices."""
    request: PerturbRequest
    result: dict
    survivors: list


class Perturber:
    """Turn requests into results: the masked prompt, every candidate with its teacher confidence or
    the reason it was rejected, and the features of the survivors.

    ``perturb`` = ``prepare`` (masking, fill, containment check) then ``score`` (one teacher pass over the
    survivors of every request given, identical candidate texts scored once). The walk calls the two
    halves separately so that speculative requests reach the teacher only once a plan includes them
    (see :meth:`Algorithm1._ensure`)."""

    def __init__(self, labels: Sequence[str], featurizer: PairFeaturizer, filler, teacher,
                 prompt_words: Mapping[str, str], ratios: Mapping[str, float] | None = None):
        from .fill import FillRequest

        self.labels = tuple(labels)
        self.featurizer, self.filler, self.teacher = featurizer, filler, teacher
        self.prompt_words = dict(prompt_words)
        self.ratios = {**PAPER_RATIOS, **(ratios or {})}
        self.seconds = {"mask": 0.0, "fill": 0.0, "containment": 0.0, "teacher": 0.0}
        self.scored = 0        # candidate texts the teacher scored
        self.deduplicated = 0  # survivors whose text another survivor of the same teacher pass had

    def perturb(self, requests: Sequence[PerturbRequest]) -> list[dict]:
        prepared = self.prepare(requests)
        self.score(prepared)
        return [p.result for p in prepared]

    def prepare(self, requests: Sequence[PerturbRequest]) -> list[Prepared]:
        from .fill import FillRequest, prompt_text
        from .masking import MASK

        t0 = time.perf_counter()
        results: list[dict] = []
        masked = []
        fill_reqs, fill_of = [], {}
        for i, r in enumerate(requests):
            rng = np.random.default_rng(r.seed)
            mp = mask_pair(r.family, r.case, r.feature, r.premise, r.hypothesis, self.ratios[r.family], rng)
            masked.append(mp)
            pm, hm = mp.masked_text()
            word = self.prompt_words[self.labels[r.label]]
            results.append({"masked_prompt": prompt_text(pm, word, hm).replace(MASK, "<mask>"),
                            "n_masks": mp.n_masks, "candidates": [], "status": "failed", "reason": None})
            if mp.n_masks == 0:
                results[-1]["reason"] = NOTHING_TO_MASK
                continue
            banned = (unigram_word(r.feature),) if r.family == UNIGRAM and r.case == LOSE else ()
            fill_of[i] = len(fill_reqs)
            fill_reqs.append(FillRequest(pm, hm, mp.n_masks, word, derive_seed(r.seed, "fill"), banned))
        t1 = time.perf_counter()
        fills = self.filler.fill(fill_reqs) if fill_reqs else []
        t2 = time.perf_counter()
        cand_p, cand_h, cand_fold, owner = [], [], [], []
        for i, r in enumerate(requests):
            if i not in fill_of:
                continue
            words = fills[fill_of[i]]
            if words is None:
                results[i]["reason"] = TRUNCATED
                continue
            for w in words:
                p, h = masked[i].fill(w)
                cand = {"premise": p, "hypothesis": h, "confidence": None, "rejected_by": None}
                if p == r.premise and h == r.hypothesis:
                    cand["rejected_by"] = SAME_AS_SOURCE
                else:
                    cand_p.append(p)
                    cand_h.append(h)
                    cand_fold.append(r.fold)
                    owner.append((i, len(results[i]["candidates"])))
                results[i]["candidates"].append(cand)
        feats = self.featurizer.features(cand_p, cand_h, cand_fold)
        survivors: list[list[int]] = [[] for _ in requests]
        for (i, c), f in zip(owner, feats):
            r, cand = requests[i], results[i]["candidates"][c]
            has_x = r.feature in f
            if r.case == KEEP and not has_x:
                cand["rejected_by"] = LOST_X
            elif r.case == LOSE and has_x:
                cand["rejected_by"] = STILL_HAS_X
            else:
                cand["features"] = f
                survivors[i].append(c)
        for res, surv in zip(results, survivors):
            if res["reason"] is None and not surv:
                res["reason"] = NO_SURVIVOR
        t3 = time.perf_counter()
        for k, v in zip(("mask", "fill", "containment"), (t1 - t0, t2 - t1, t3 - t2)):
            self.seconds[k] += v
        return [Prepared(r, res, surv) for r, res, surv in zip(requests, results, survivors)]

    def score(self, prepared: Sequence[Prepared]) -> None:
        """The teacher's p(label of the request | candidate) for every survivor, in place; a result with a
        survivor becomes ``ok``. Identical candidate texts are scored once (a pure function of the text)."""
        t0 = time.perf_counter()
        index: dict[tuple[str, str], int] = {}
        texts_p, texts_h, slots = [], [], []
        for j, p in enumerate(prepared):
            for c in p.survivors:
                cand = p.result["candidates"][c]
                key = (cand["premise"], cand["hypothesis"])
                if key not in index:
                    index[key] = len(texts_p)
                    texts_p.append(key[0])
                    texts_h.append(key[1])
                else:
                    self.deduplicated += 1
                slots.append((j, c, index[key]))
        if texts_p:
            probs = self.teacher.label_probs(texts_p, texts_h)
            self.scored += len(texts_p)
            for j, c, u in slots:
                p = prepared[j]
                row = probs[u]
                cand = p.result["candidates"][c]
                cand["confidence"] = round(float(row[p.request.label]), 6)
                cand["teacher_pred"] = self.labels[int(np.argmax(row))]
        for p in prepared:
            if p.survivors:
                p.result["status"] = "ok"
        self.seconds["teacher"] += time.perf_counter() - t0


def choose(result: Mapping[str, Any], taken: "set[str] | Callable[[str], bool]", label_name: str,
           method: str) -> tuple[int | None, str | None]:
    """The teacher's choice: the surviving candidate with the highest confidence (lowest index on ties)
    whose row is not already made. Returns (candidate index, its uid) or (None, None)."""
    is_taken = taken if callable(taken) else taken.__contains__
    ranked = sorted((i for i, c in enumerate(result["candidates"]) if c["confidence"] is not None),
                    key=lambda i: (-result["candidates"][i]["confidence"], i))
    for i in ranked:
        c = result["candidates"][i]
        uid = content_uid(c["premise"], c["hypothesis"], label_name, prefix=f"{method}:")
        if not is_taken(uid):
            return i, uid
    return None, None


# ---------------------------------------------------------------------------------------------------
# the state of D and the fast walk

@dataclasses.dataclass
class PDDConfig:
    tau: float = 20.0                      # Table 10, "Threshold τ 20"
    families: "Sequence[str] | str" = "auto"   # which families ("auto": all three)
    order: str = "z"                        # "z": decreasing max |z*| (section 4.1); "given": as listed
    overlap_feature: str = "lex-overlap>0.8"
    label_groups: "Sequence[Sequence[str]] | None" = None
    max_passes: int = 20
    max_sweeps: int = 1
    batch_size: int = 32
    seed: int = 0
    checkpoint_every: int = 256            # results between appends to the cache file

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class PDDState:
    """D as parallel lists (the input rows first, then every row PDD made, in order), with postings."""

    def __init__(self, premises, hypotheses, labels, uids, folds, features: list[list[str]], group_of: np.ndarray):
        n = len(premises)
        self.premise, self.hypothesis = list(premises), list(hypotheses)
        self.label = list(int(x) for x in labels)
        self.uid = list(uids)
        self.fold = list(int(f) for f in folds)
        self.method = [None] * n
        self.source = [None] * n
        self.confidence = [None] * n
        self.features = [list(f) for f in features]
        self.alive = [True] * n
        self.replaced_by: dict[int, str] = {}
        self.n_input = n
        self.group_of = group_of
        self.uids = set(self.uid)
        if len(self.uids) != n:
            dup = next(u for i, u in enumerate(self.uid) if u in self.uid[:i])
            raise ConfigError(f"the input has duplicate uid {dup!r}; PDD needs unique uids")
        self.postings: dict[str, list[int]] = {}
        for i, f in enumerate(self.features):
            for x in f:
                self.postings.setdefault(x, []).append(i)

    def __len__(self) -> int:
        return len(self.uid)

    def group(self, row: int) -> int:
        return int(self.group_of[self.label[row]])

    def rows_with(self, x: str) -> list[int]:
        return [r for r in self.postings.get(x, ()) if self.alive[r]]

    def counts(self, x: str, K: int) -> np.ndarray:
        c = np.zeros(K, dtype=np.int64)
        for r in self.rows_with(x):
            c[self.group(r)] += 1
        return c

    def add(self, premise, hypothesis, label, uid, fold, method, source_uid, confidence, features) -> int:
        i = len(self.uid)
        self.premise.append(premise)
        self.hypothesis.append(hypothesis)
        self.label.append(int(label))
        self.uid.append(uid)
        self.fold.append(int(fold))
        self.method.append(method)
        self.source.append(source_uid)
        self.confidence.append(confidence)
        self.features.append(list(features))
        self.alive.append(True)
        self.uids.add(uid)
        for x in features:
            self.postings.setdefault(x, []).append(i)
        return i

    def family_z(self, family: str, overlap_feature: str, K: int, p0: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """(counts, z*) of every feature of a family over D."""
        out = {}
        for x, rows in self.postings.items():
            if family_of(x, overlap_feature) != family:
                continue
            c = np.zeros(K, dtype=np.int64)
            for r in rows:
                if self.alive[r]:
                    c[self.group(r)] += 1
            if c.sum():
                out[x] = (c, z_star(c, p0))
        return out


@dataclasses.dataclass
class FeatureRecord:
    feature: str
    family: str
    sweep: int
    counts_before: list
    z_before: list
    counts_after: list = None
    z_after: list = None
    keep_ops: int = 0
    lose_ops: int = 0
    failed_ops: int = 0
    failures: dict = dataclasses.field(default_factory=dict)
    passes: int = 0
    status: str = ""
    reason: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ResultCache:
    """Perturbation results by key, appended to a JSONL file (the run's checkpoint)."""

    def __init__(self, path: Path | None, every: int = 256):
        self.path, self.every = path, every
        self.data: dict[str, dict] = {}
        self.pending: list[str] = []
        self.loaded = 0
        if path is not None and path.exists():
            with open(path) as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by an interruption
                        continue
                    self.data[rec["key"]] = rec["result"]
            self.loaded = len(self.data)

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def __getitem__(self, key: str) -> dict:
        return self.data[key]

    def put(self, key: str, result: dict) -> None:
        self.data[key] = result
        self.pending.append(key)
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.path is None or not self.pending:
            self.pending = []
            return
        with open(self.path, "a") as f:
            for k in self.pending:
                f.write(json.dumps({"key": k, "result": self.data[k]}, sort_keys=True) + "\n")
        self.pending = []


class Algorithm1:
    """The fast walk (see the module docstring)."""

    def __init__(self, state: PDDState, perturber, cfg: PDDConfig, labels: Sequence[str], K: int,
                 cache: ResultCache | None = None, progress: bool = False, group_names: Sequence[str] = ()):
        self.state, self.perturber, self.cfg = state, perturber, cfg
        self.labels, self.K, self.p0 = tuple(labels), K, 1.0 / K
        self.group_names = list(group_names) if group_names else [str(g) for g in range(K)]
        self.cache = cache if cache is not None else ResultCache(None)
        self.log: list[dict] = []
        self.computed = 0          # perturbations run (not from the cache)
        self.discarded = 0         # results computed ahead and then not used
        self.n_applied = self.n_failed = 0   # the failure rate that sizes the speculation
        self._prepared: dict[str, Prepared] = {}   # prepared, not yet scored by the teacher (see _ensure)
        self.never_scored = 0      # prepared (speculatively) and dropped at the end of their pass, never scored
        self.progress = progress
        self._bar = None
        self._memo_id, self._memo = None, {}   # requests of the current (feature, sweep, pass), see _request

    # one operation -------------------------------------------------------------------------------
    def _request(self, x: str, family: str, case: str, row: int, sweep: int, pass_: int) -> PerturbRequest:
        # memoised per (feature, sweep, pass): re-planning after a failure walks the same rows again
        memo_id = (x, sweep, pass_)
        if self._memo_id != memo_id:
            self._memo_id, self._memo = memo_id, {}
        req = self._memo.get((row, case))
        if req is None:
            s = self.state
            key = op_key(sweep, x, s.uid[row], case, pass_)
            req = PerturbRequest(key, x, family, case, s.premise[row], s.hypothesis[row], s.label[row], s.fold[row], 0)
            self._memo[(row, case)] = req
        return req

    def _seeded(self, req: PerturbRequest) -> PerturbRequest:
        # the seed is derived here, only for what is perturbed (planning builds many requests)
        return dataclasses.replace(req, seed=derive_seed(self.cfg.seed, req.key))

    def _ensure(self, plan: Sequence[PerturbRequest], spec: Sequence[PerturbRequest] = ()) -> None:
        """Make the results of the planned operations available (complete) in the cache.

        Every request of ``plan`` and ``spec`` not yet computed is prepared (masking, fill, containment)
        in one batch; the teacher then scores the planned operations only. Speculative requests (rows
        after the plan, needed only if a planned operation fails) stay prepared in memory and are scored
        when a later plan reaches them; those no plan reaches never cost a teacher pass. Results are pure
        functions of their request, so when the teacher runs does not change them; only complete
        results go to the cache (the checkpoint)."""
        todo = [self._seeded(r) for r in list(plan) + list(spec) if self._unprepared(r.key)]
        if todo:
            for p in self.perturber.prepare(todo):
                self._prepared[p.request.key] = p
        now = [self._prepared[r.key] for r in plan if r.key not in self.cache]
        if not now:
            return
        self.perturber.score(now)
        for p in now:
            del self._prepared[p.request.key]
            self.cache.put(p.request.key, p.result)
        self.computed += len(now)
        if self._bar is not None:
            self._bar.update(len(now))

    def _apply(self, x: str, family: str, req: PerturbRequest, row: int, counts: np.ndarray, rec: FeatureRecord,
               sweep: int, pass_: int) -> bool:
        s = self.state
        g = s.group(row)
        z = z_star(counts, self.p0)
        if not (abs(z[g]) > self.cfg.tau and case_for(counts, g, self.p0) == req.case):
            raise RuntimeError(f"internal: planned operation {req.key} no longer applies")
        res = self.cache[req.key]
        method = f"pdd:{x}:{req.case}"
        entry = {"op": len(self.log), "sweep": sweep, "family": family, "feature": x, "pass": pass_, "case": req.case,
                 "source_uid": s.uid[row], "label": self.labels[s.label[row]], "z_before": round(float(z[g]), 4),
                 "masked_prompt": res["masked_prompt"], "candidates": res["candidates"], "chosen": -1,
                 "new_uid": None, "status": "failed", "reason": res["reason"]}
        ok = False
        if res["status"] == "ok":
            idx, uid = choose(res, s.uids, self.labels[s.label[row]], method)
            if idx is None:
                entry["reason"] = DUPLICATE
            else:
                c = res["candidates"][idx]
                if (x in c["features"]) != (req.case == KEEP):
                    raise RuntimeError(f"internal: candidate of {req.key} fails its containment check")
                s.add(c["premise"], c["hypothesis"], s.label[row], uid, s.fold[row], method, s.uid[row],
                      c["confidence"], c["features"])
                if req.case == LOSE:
                    s.alive[row] = False
                    s.replaced_by[row] = uid
                apply_case(counts, g, req.case)
                entry.update(chosen=idx, new_uid=uid, status="ok", reason=None)
                ok = True
        entry["z_after"] = round(float(z_star(counts, self.p0)[g]), 4)
        self.log.append(entry)
        self.n_applied += 1
        self.n_failed += not ok
        if ok:
            if req.case == KEEP:
                rec.keep_ops += 1
            else:
                rec.lose_ops += 1
        else:
            rec.failed_ops += 1
            rec.failures[entry["reason"]] = rec.failures.get(entry["reason"], 0) + 1
        return ok

    def _unprepared(self, key: str) -> bool:
        """Neither in the cache nor prepared: the request still needs masking and a fill."""
        return key not in self.cache and key not in self._prepared

    def _plan(self, x, family, order, pos, counts, sweep, pass_):
        """The next operations of the walk, assuming each succeeds, until ``batch_size`` of them need a
        perturbation not yet prepared; then *speculative* requests for the next rows of the label
        groups still being worked on (needed if some planned operation fails), so that every batch
        perturbs about ``batch_size`` rows. Speculation only prepares results (the teacher scores one
        when a later plan applies it): it never changes which operations are applied."""
        s, tau, p0 = self.state, self.cfg.tau, self.p0
        sim = [int(c) for c in counts]
        plan, spec = [], []
        q, fresh = pos, 0
        limit = 16 * self.cfg.batch_size
        z = _z_list(sim, p0)   # recomputed only when sim changes (planning walks many rows; bookkeeping only)
        above = [abs(v) > tau for v in z]
        while q < len(order) and fresh < self.cfg.batch_size and len(plan) < limit:
            if not any(above):
                break
            r = order[q]
            g = s.group(r)
            if above[g] and s.alive[r]:
                case = KEEP if z[g] < 0 else LOSE
                req = self._request(x, family, case, r, sweep, pass_)
                fresh += self._unprepared(req.key)
                plan.append((q, r, req))
                sim[g] += 1 if case == KEEP else -1
                z = _z_list(sim, p0)
                above = [abs(v) > tau for v in z]
            q += 1
        z_real = _z_list([int(c) for c in counts], p0)
        active = {g: (KEEP if z_real[g] < 0 else LOSE) for g in range(self.K) if abs(z_real[g]) > tau}
        # as many speculative requests as the failures seen so far predict among the new planned ones, plus
        # one; none when the plan is all in the cache (a replay after a restart computes nothing extra)
        rate = (self.n_failed + 1) / (self.n_applied + 2)
        budget = min(self.cfg.batch_size, fresh + math.ceil(fresh * rate / max(1e-6, 1 - rate)) + 1) if fresh else 0
        while q < len(order) and fresh < budget and active:
            r = order[q]
            g = s.group(r)
            if s.alive[r] and g in active:
                req = self._request(x, family, active[g], r, sweep, pass_)
                if self._unprepared(req.key):
                    spec.append(req)
                    fresh += 1
            q += 1
        return plan, spec

    # one feature ---------------------------------------------------------------------------------
    def reduce_feature(self, x: str, family: str, sweep: int = 0) -> FeatureRecord:
        s, tau = self.state, self.cfg.tau
        start_rows = s.rows_with(x)           # D_b for x: the rows of D that contain x now
        counts = s.counts(x, self.K)
        rec = FeatureRecord(x, family, sweep, counts.tolist(), np.round(z_star(counts, self.p0), 4).tolist())
        while np.max(np.abs(z_star(counts, self.p0))) > tau:
            if rec.passes >= self.cfg.max_passes:
                rec.status, rec.reason = "max_passes", f"still above tau after {rec.passes} passes"
                break
            order = walk_order([r for r in start_rows if s.alive[r]], self.cfg.seed, x, sweep, rec.passes)
            successes, attempts, pos = 0, 0, 0
            used: set[str] = set()
            planned: set[str] = set()
            while pos < len(order):
                plan, spec = self._plan(x, family, order, pos, counts, sweep, rec.passes)
                if not plan:
                    break
                planned.update(req.key for _, _, req in plan)
                planned.update(req.key for req in spec)
                self._ensure([req for _, _, req in plan], spec)
                for q, r, req in plan:
                    attempts += 1
                    used.add(req.key)
                    if self._apply(x, family, req, r, counts, rec, sweep, rec.passes):
                        successes += 1
                    else:
                        pos = q + 1
                        break
                else:
                    pos = plan[-1][0] + 1
            self.discarded += len(planned - used)
            # keys name their pass: what this pass prepared and never scored cannot be used later
            self.never_scored += len(self._prepared)
            self._prepared.clear()
            rec.passes += 1
            if successes == 0:
                rec.status = "unreachable"
                rec.reason = self._unreachable_reason(x, counts, attempts, rec)
                break
        else:
            rec.status = "reached" if rec.passes else "already below tau"
        rec.counts_after = counts.tolist()
        rec.z_after = np.round(z_star(counts, self.p0), 4).tolist()
        if counts.tolist() != s.counts(x, self.K).tolist():
            raise RuntimeError(f"internal: the O(1) counts of {x} drifted from D")
        return rec

    def _unreachable_reason(self, x, counts, attempts, rec) -> str:
        z = z_star(counts, self.p0)
        if attempts == 0:
            need = [self.group_names[g] for g in range(self.K) if abs(z[g]) > self.cfg.tau]
            return (f"no row of D_b with label {' or '.join(need)} contains x, and rows of the other labels are "
                    f"within tau, so Algorithm 1 has no operation left (z* = {np.round(z, 2).tolist()})")
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(rec.failures.items()))
        return f"a pass made no successful operation ({attempts} attempted; failures so far: {reasons})"


def reference_reduce_feature(rows: list[dict], x: str, perturb_one: Callable[[dict, str, int, int], dict],
                             *, K: int, group_of: np.ndarray, labels: Sequence[str], tau: float, seed: int,
                             max_passes: int = 20, sweep: int = 0) -> tuple[list[dict], list[tuple]]:
    """The slow obvious Algorithm 1 for one feature: rows are dicts (uid, premise, hypothesis, label,
    fold, features, alive); after every operation z is recomputed by counting x over all of D.
    ``perturb_one(row, case, pass, sweep)`` returns a perturbation result (as the fast walk's cache holds).
    Returns the rows (new rows appended) and the operations as (source uid, case, new uid or None)."""
    p0 = 1.0 / K

    def z_now() -> np.ndarray:
        c = np.zeros(K)
        for r in rows:
            if r["alive"] and x in r["features"]:
                c[group_of[r["label"]]] += 1
        return z_star(c, p0), c

    d_b = [i for i, r in enumerate(rows) if r["alive"] and x in r["features"]]
    ops: list[tuple] = []
    passes = 0
    while np.max(np.abs(z_now()[0])) > tau and passes < max_passes:
        order = walk_order([i for i in d_b if rows[i]["alive"]], seed, x, sweep, passes)
        success = 0
        for i in order:
            S = rows[i]
            if not S["alive"]:
                continue
            z, c = z_now()
            g = group_of[S["label"]]
            if not abs(z[g]) > tau:
                continue
            case = KEEP if c[g] / c.sum() < p0 else LOSE
            res = perturb_one(S, case, passes, sweep)
            new_uid = None
            if res["status"] == "ok":
                idx, new_uid = choose(res, {r["uid"] for r in rows}, labels[S["label"]], f"pdd:{x}:{case}")
                if idx is not None:
                    cand = res["candidates"][idx]
                    rows.append({"uid": new_uid, "premise": cand["premise"], "hypothesis": cand["hypothesis"],
                                 "label": S["label"], "fold": S["fold"], "features": set(cand["features"]),
                                 "alive": True, "source_uid": S["uid"]})
                    if case == LOSE:
                        S["alive"] = False
                    success += 1
            ops.append((S["uid"], case, new_uid))
        passes += 1
        if success == 0:
            break
    return rows, ops
