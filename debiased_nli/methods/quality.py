"""What a set of generated rows is worth, measured beside real rows (issue 45, item 1).

Wu et al. (2022) report the size of their generated datasets (Table 1) and what models trained on them
score, not how good the rows are; a generator's rows can be fluent nonsense, copies of D0, or mislabelled,
and a confidence filter or a z-filter keeps them anyway. Every measure here compares the generated rows
with real rows of the same task, so a reader sees the gap, not a number alone:

- **copies** (:func:`copies`): rows whose (premise, hypothesis) pair, hypothesis or premise is a D0 row's,
  after normalising case, spaces and end punctuation;
- **near-duplicates** (:func:`pair_near_duplicates`): rows whose premise and hypothesis each have a
  character 5-gram Jaccard similarity of at least 0.8 with one D0 row's (MinHash with 64 permutations in 16 bands of 4
  (Broder 1997; Leskovec, Rajaraman & Ullman, *Mining of Massive Datasets*, ch. 3), every candidate pair
  checked exactly); within-set duplicates likewise;
- **fluency** (:func:`fluency_scores`): the mean token log-probability of ``premise + " " + hypothesis``
  under a base language model that was not trained on D0 (the generator's own base, without its
  fine-tuning), and the share of rows under a bound: the 5th percentile of real held-out rows' scores
  (so 5% of real rows are under it by construction);
- **label agreement with a cross-fitted ensemble** (:func:`cross_fitted_agreement`): k classifiers, each
  trained on D0 without one of its k folds; a generated row's label is compared with the ensemble's
  majority (the mean of the k probabilities), a D0 row's with the one model that did not see it (the
  control: how often real labels agree with such models);
- **train on generated, test on real** (:func:`train_on_generated`): a classifier trained on N generated
  rows and one trained on N real D0 rows, with the same settings and seeds, both scored on held-out real
  rows (a validation split, never a challenge set); the ratio is the generated rows' worth per row.

The thresholds (0.8 Jaccard, 5-grams, the 5th percentile, k = 3) are the project's choice; the papers give
none. All randomness takes a seed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
import unicodedata
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..data.loading import labels_of
from ..data.tasks import TaskSpec
from ..utils.errors import ConfigError

NEAR_DUP_JACCARD = 0.8   # project's choice: near-duplicate at >= 0.8 character 5-gram Jaccard
SHINGLE = 5              # project's choice: character 5-grams (robust for one-sentence texts)
NUM_PERM, BANDS = 64, 16  # project's choice: 16 bands of 4 rows; P(candidate | J = 0.8) = 1 - (1 - 0.8**4)**16 > 0.9999
FLUENCY_QUANTILE = 0.05  # project's choice: the bound is real rows' 5th percentile
_PRIME = (1 << 61) - 1  # shingle hashes (exact Jaccard on these)
_P31 = (1 << 31) - 1  # MinHash arithmetic
_PUNCT = re.compile(r"[\s.!?,;:'\"`]+$")


def normalize(text: str) -> str:
    """Lower case, NFKC, one space between words, no end punctuation (``"A dog runs."`` == ``"a dog  runs"``)."""
    t = unicodedata.normalize("NFKC", str(text)).lower()
    t = " ".join(t.split())
    return _PUNCT.sub("", t)


def _require(ds, cols: Sequence[str], what: str) -> None:
    missing = [c for c in cols if c not in ds.column_names]
    if missing:
        raise ConfigError(f"{what} need the column(s) {missing}; they have {ds.column_names}")


def copies(rows, reference) -> dict:
    """Shares of ``rows`` whose normalised pair, hypothesis or premise occurs in ``reference`` (D0)."""
    _require(rows, ("premise", "hypothesis"), "the rows")
    _require(reference, ("premise", "hypothesis"), "the reference rows")
    rp = [normalize(p) for p in reference["premise"]]
    rh = [normalize(h) for h in reference["hypothesis"]]
    pairs, hyps, prems = set(zip(rp, rh)), set(rh), set(rp)
    gp = [normalize(p) for p in rows["premise"]]
    gh = [normalize(h) for h in rows["hypothesis"]]
    n = max(len(gp), 1)
    pair = np.array([(p, h) in pairs for p, h in zip(gp, gh)], dtype=bool)
    return {"rows": len(gp), "pair_copies": int(pair.sum()), "pair_copy_share": round(float(pair.sum()) / n, 6),
            "hypothesis_copy_share": round(sum(h in hyps for h in gh) / n, 6),
            "premise_copy_share": round(sum(p in prems for p in gp) / n, 6),
            "within_set_pair_duplicates": len(gp) - len(set(zip(gp, gh))), "pair_copy_mask": pair}


def _shingles(text: str, k: int = SHINGLE) -> set[int]:
    t = f" {normalize(text)} "
    grams = {t[i:i + k] for i in range(max(len(t) - k + 1, 1))}
    return {int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little") & _PRIME for g in grams}


def _minhash(sets: list[set[int]], num_perm: int, seed: int) -> np.ndarray:
    """MinHash signatures: for each of ``num_perm`` hash functions ``(a x + b) mod p`` (p = 2^31 - 1, the
    shingles' hashes reduced mod p first, so that a x < 2^62 stays exact in 64 bits), the minimum over a set."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, _P31, size=num_perm, dtype=np.uint64)
    b = rng.integers(0, _P31, size=num_perm, dtype=np.uint64)
    out = np.full((len(sets), num_perm), _P31, dtype=np.uint64)
    for i, s in enumerate(sets):
        if s:
            x = np.fromiter(s, dtype=np.uint64, count=len(s)) % np.uint64(_P31)
            out[i] = ((a[None, :] * x[:, None] + b[None, :]) % np.uint64(_P31)).min(axis=0)
    return out


def _lsh_candidates(sig_own: np.ndarray, sig_ref: np.ndarray, bands: int, self_ref: bool, earlier_only: bool):
    """(i, j) for every own row i and reference row j that share a band of their MinHash signatures (a pair may
    come once per band it shares); a set against itself skips i == j, or with ``earlier_only`` every j >= i."""
    rows = sig_own.shape[1] // bands
    for b in range(bands):
        buckets: dict[bytes, list[int]] = {}
        for j, sig in enumerate(sig_ref[:, b * rows:(b + 1) * rows]):
            buckets.setdefault(sig.tobytes(), []).append(j)
        for i, sig in enumerate(sig_own[:, b * rows:(b + 1) * rows]):
            for j in buckets.get(sig.tobytes(), ()):
                if self_ref and (j >= i if earlier_only else j == i):
                    continue
                yield i, j


def near_duplicates(texts: Sequence[str], reference: Sequence[str] | None = None, *,
                    threshold: float = NEAR_DUP_JACCARD, num_perm: int = NUM_PERM, bands: int = BANDS,
                    seed: int = 0, earlier_only: bool = False) -> dict:
    """For each text, the largest exact character-5-gram Jaccard similarity with a ``reference`` text (or,
    without ``reference``, with another text of the same set; with ``earlier_only``, with an earlier one, so
    that dropping every row at or above ``threshold`` keeps the first of each group) among the MinHash-LSH
    candidates, and the share at or above ``threshold``. Pairs below the LSH's reach count as 0 (they are far
    below the threshold)."""
    if earlier_only and reference is not None:
        raise ConfigError("earlier_only compares a set with itself; it takes no reference")
    if num_perm % bands:
        raise ConfigError(f"num_perm ({num_perm}) must be a multiple of bands ({bands})")
    own = [_shingles(t) for t in texts]
    ref = own if reference is None else [_shingles(t) for t in reference]
    sig_own = _minhash(own, num_perm, seed)
    sig_ref = sig_own if reference is None else _minhash(ref, num_perm, seed)
    best = np.zeros(len(own))
    match = np.full(len(own), -1, dtype=np.int64)
    for i, j in _lsh_candidates(sig_own, sig_ref, bands, reference is None, earlier_only):
        inter = len(own[i] & ref[j])
        jac = inter / max(len(own[i] | ref[j]), 1)
        if jac > best[i]:
            best[i], match[i] = jac, j
    hit = best >= threshold
    return {"rows": len(own), "threshold": threshold, "near_duplicates": int(hit.sum()),
            "near_duplicate_share": round(float(hit.mean()) if len(own) else 0.0, 6),
            "max_jaccard": best, "match": match, "mask": hit}


def pair_near_duplicates(premises: Sequence[str], hypotheses: Sequence[str],
                         ref_premises: Sequence[str] | None = None, ref_hypotheses: Sequence[str] | None = None, *,
                         threshold: float = NEAR_DUP_JACCARD, num_perm: int = NUM_PERM, bands: int = BANDS,
                         seed: int = 0, earlier_only: bool = False) -> dict:
    """Rows whose premise and hypothesis are both near-duplicates of one reference row's (character 5-gram
    Jaccard at least ``threshold`` for each), or without a reference, of another row of the set (with
    ``earlier_only``: of an earlier one). The pair's similarity is the smaller of the two.

    This is the near-duplicate of an NLI row. The text ``premise + hypothesis`` is not: SNLI gives each premise
    three hypotheses, one per label, and a shared premise with different hypotheses reaches 0.8 on the joined
    text (SNLI dev's rows 4 and 5, entailment "Two kids in numbered jerseys wash their hands." and neutral "Two
    kids at a ballgame wash their hands." under one premise: 0.83). Candidates come from
    MinHash-LSH over the hypotheses; every candidate is checked exactly on both fields."""
    if (ref_premises is None) != (ref_hypotheses is None):
        raise ConfigError("give both reference premises and hypotheses, or neither")
    if earlier_only and ref_premises is not None:
        raise ConfigError("earlier_only compares a set with itself; it takes no reference")
    if len(premises) != len(hypotheses):
        raise ConfigError(f"{len(premises)} premises but {len(hypotheses)} hypotheses")
    if num_perm % bands:
        raise ConfigError(f"num_perm ({num_perm}) must be a multiple of bands ({bands})")
    own_h = [_shingles(t) for t in hypotheses]
    own_p: dict[int, set[int]] = {}
    self_ref = ref_premises is None
    ref_h = own_h if self_ref else [_shingles(t) for t in ref_hypotheses]
    ref_p: dict[int, set[int]] = own_p if self_ref else {}
    sig_own = _minhash(own_h, num_perm, seed)
    sig_ref = sig_own if self_ref else _minhash(ref_h, num_perm, seed)
    src_p = premises if self_ref else ref_premises

    def shingles_of(cache, texts, i):
        if i not in cache:
            cache[i] = _shingles(texts[i])
        return cache[i]

    def jac(a, b):
        return len(a & b) / max(len(a | b), 1)

    best = np.zeros(len(own_h))
    match = np.full(len(own_h), -1, dtype=np.int64)
    checked: list[set[int]] = [set() for _ in own_h]
    for i, j in _lsh_candidates(sig_own, sig_ref, bands, self_ref, earlier_only):
        if j in checked[i]:
            continue
        checked[i].add(j)
        jh = jac(own_h[i], ref_h[j])
        if jh < threshold or jh <= best[i]:
            continue
        sim = min(jh, jac(shingles_of(own_p, premises, i), shingles_of(ref_p, src_p, j)))
        if sim > best[i]:
            best[i], match[i] = sim, j
    hit = best >= threshold
    return {"rows": len(own_h), "threshold": threshold, "near_duplicates": int(hit.sum()),
            "near_duplicate_share": round(float(hit.mean()) if len(own_h) else 0.0, 6),
            "max_jaccard": best, "match": match, "mask": hit,
            "definition": "premise and hypothesis each at least the threshold (character 5-gram Jaccard) with one row's"}


def pair_texts(ds) -> list[str]:
    """``premise + " " + hypothesis`` per row. A ``datasets.Dataset`` is read in one batch of the two columns:
    iterating its columns formats one row at a time, 40x slower (0.6 s for 16k rows)."""
    cols = ds.select_columns(["premise", "hypothesis"])[:] if hasattr(ds, "select_columns") else ds
    return [f"{p} {h}" for p, h in zip(cols["premise"], cols["hypothesis"])]


def fluency_scores(texts: Sequence[str], lm: "str | Any", *, tokenizer: Any = None, batch_size: int = 32,
                   max_length: int = 128, device: str | None = None, progress: bool = True) -> np.ndarray:
    """Mean token log-probability of each text under the causal LM ``lm`` (folder, Hub id or a loaded model
    with ``tokenizer``): every token after the first, given the ones before it; float64, one per text."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(lm, str):
        tokenizer = AutoTokenizer.from_pretrained(lm)
        lm = AutoModelForCausalLM.from_pretrained(lm)
    if tokenizer is None:
        raise ConfigError("pass the tokenizer together with an already loaded language model")
    from ..models.classifier import default_device
    device = device or default_device()
    lm = lm.to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    enc = tokenizer(list(texts), add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None:  # the first word is scored too, given the start of a text
        enc = [[bos] + e for e in enc]
    order = np.argsort([len(e) for e in enc], kind="stable")
    out = np.zeros(len(enc))
    with torch.no_grad():
        for start in tqdm(range(0, len(enc), batch_size), desc="fluency", disable=not progress):
            idx = order[start:start + batch_size]
            width = max(len(enc[i]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :len(enc[i])] = torch.tensor(enc[i])
                mask[r, :len(enc[i])] = 1
            logits = lm(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None].to(device))[..., 0]
            m = mask[:, 1:].to(device).float()
            mean = (logp * m).sum(1) / m.sum(1).clamp(min=1)
            out[idx] = mean.double().cpu().numpy()
    return out


def fluency_summary(scores: np.ndarray, real_scores: np.ndarray, quantile: float = FLUENCY_QUANTILE) -> dict:
    """Mean score and the share under the bound (``quantile`` of the real rows' scores)."""
    if len(real_scores) == 0:
        raise ConfigError("the fluency bound needs real rows' scores; got none")
    bound = float(np.quantile(real_scores, quantile))
    return {"bound": round(bound, 6), "bound_quantile_of_real": quantile, "mean": round(float(np.mean(scores)), 6),
            "real_mean": round(float(np.mean(real_scores)), 6), "under_bound_share": round(float(np.mean(scores < bound)), 6),
            "real_under_bound_share": round(float(np.mean(real_scores < bound)), 6)}


@dataclasses.dataclass(frozen=True)
class Classifiers:
    """The classifiers the quality measures train: ``model`` (a Hub id or folder) fine-tuned for ``epochs`` at
    learning rate 5e-5 on pairs of up to ``max_length`` tokens, with ``threads`` torch CPU threads."""

    model: str
    epochs: float
    threads: int | None = None
    max_length: int = 64


def _fit(task: TaskSpec, fit: Classifiers, train_ds, out_dir: str, *, seed: int, progress: bool):
    from ..models.training import TrainConfig, train_classifier

    cfg = TrainConfig(model=fit.model, output_dir=out_dir, epochs=fit.epochs, seed=seed, num_threads=fit.threads,
                      max_length=fit.max_length, learning_rate=5e-5, progress=progress, resume=True,
                      early_stopping_patience=0 if fit.epochs else 3)
    train_classifier(cfg, task, train_ds)
    return out_dir


def rows_fingerprint(ds) -> str:
    """12 hex digits of the sha256 of the rows' (premise, hypothesis, label): names a classifier trained on them, so
    that a folder of trained classifiers shared by several runs never serves one trained on other rows."""
    h = hashlib.sha256()
    for p, hy, lab in zip(ds["premise"], ds["hypothesis"], labels_of(ds).tolist()):
        h.update(f"{p}\t{hy}\t{lab}\n".encode())
    return h.hexdigest()[:12]


def set_fingerprint(ds) -> str:
    """16 hex digits of the sha256 of the sorted (premise, hypothesis, label) rows: the same for the same set of
    rows in any order. A quality report records it, so a release build can tell which of its sets it measured."""
    labels = labels_of(ds).tolist()
    digests = sorted(hashlib.sha256(f"{p}\t{h}\t{lab}".encode()).digest()
                     for p, h, lab in zip(ds["premise"], ds["hypothesis"], labels))
    h = hashlib.sha256()
    for d in digests:
        h.update(d)
    return h.hexdigest()[:16]


def _probs(model_dir: str, ds, task: TaskSpec, progress: bool) -> np.ndarray:
    from ..models.classifier import load_classifier, predict_probabilities

    clf = load_classifier(model_dir)
    return predict_probabilities(clf, ds["premise"], ds["hypothesis"], labels=task.labels,
                                 progress=progress and "quality scoring")


def cross_fitted_agreement(rows, d0, task: TaskSpec, fit: Classifiers, work_dir: str, *, k: int = 3, seed: int = 0,
                           progress: bool = True) -> dict:
    """k classifiers (``fit.model`` fine-tuned on D0 without fold i, resumable in ``work_dir/fold-i``): the share
    of ``rows`` whose label is the ensemble's (mean probability) argmax, per label, and the same share of D0 rows
    against the one model that did not train on them (the control)."""
    epochs = fit.epochs
    if k < 2:
        raise ConfigError(f"cross-fitting needs k >= 2 folds, not {k}")
    fold = np.random.default_rng(seed).permutation(len(d0)) % k
    ens = np.zeros((len(rows), task.num_labels))
    oof = np.zeros(len(d0), dtype=np.int64)
    name = f"k{k}-e{epochs:g}-s{seed}-{rows_fingerprint(d0)}"  # what the ensemble depends on
    for i in range(k):
        out = str(Path(work_dir) / name / f"fold-{i}")
        if not (Path(out) / "debiased_nli_train.json").is_file():
            _fit(task, fit, d0.select(np.nonzero(fold != i)[0]), out, seed=seed + i, progress=progress)
        ens += _probs(out, rows, task, progress)
        held = np.nonzero(fold == i)[0]
        oof[held] = _probs(out, d0.select(held), task, progress).argmax(1)
    gold, pred = labels_of(rows), ens.argmax(1)
    d0_gold = labels_of(d0)
    per_label = {name: round(float((pred[gold == j] == j).mean()), 6) if (gold == j).any() else None
                 for j, name in enumerate(task.labels)}
    return {"k": k, "epochs": epochs, "model": fit.model, "rows": len(rows), "agreement": round(float((pred == gold).mean()), 6),
            "agreement_per_label": per_label, "d0_rows": len(d0),
            "d0_agreement_cross_fitted": round(float((oof == d0_gold).mean()), 6),
            "ensemble_label": pred, "ensemble_confidence": ens.max(1) / k}


def train_on_generated(generated, real, heldout, task: TaskSpec, fit: Classifiers, work_dir: str, *,
                       n: int | None = None, seeds: Sequence[int] = (0,), progress: bool = True) -> dict:
    """Accuracy on ``heldout`` real rows of a classifier trained on n generated rows and of one trained on n real
    rows (the same n, settings and seeds; n defaults to the smaller set's size), and their ratio."""
    epochs = fit.epochs
    n = min(len(generated), len(real)) if n is None else n
    if n < 1 or n > len(generated) or n > len(real):
        raise ConfigError(f"n = {n} rows must be between 1 and the smaller set's {min(len(generated), len(real))}")
    gold = labels_of(heldout)
    runs = []
    for s in seeds:
        row = {"seed": s}
        for name, ds in (("generated", generated), ("real", real)):
            pick = np.sort(np.random.default_rng(s).permutation(len(ds))[:n])
            out = str(Path(work_dir) / f"{name}-n{n}-s{s}-e{epochs:g}-{rows_fingerprint(ds)}")
            if not (Path(out) / "debiased_nli_train.json").is_file():
                _fit(task, fit, ds.select(pick), out, seed=s, progress=progress)
            row[name] = round(float((_probs(out, heldout, task, progress).argmax(1) == gold).mean()), 6)
        runs.append(row)
    g = float(np.mean([r["generated"] for r in runs]))
    r = float(np.mean([r["real"] for r in runs]))
    return {"n": n, "heldout_rows": len(heldout), "model": fit.model, "epochs": epochs, "runs": runs,
            "generated_accuracy": round(g, 6), "real_accuracy": round(r, 6), "ratio": round(g / r, 6) if r else None}


def _near_dup_rule(nd: dict) -> str:
    if nd.get("definition", "").startswith("premise and hypothesis"):
        return f"premise and hypothesis each Jaccard >= {nd['threshold']}"
    return f"premise + hypothesis Jaccard >= {nd['threshold']}"  # reports written before pair_near_duplicates


def render_report(r: dict) -> str:
    """``quality.md``: the measures of a report (``debiased-nli quality``'s ``quality.json``) as tables, then
    the examples."""
    def pct(x):
        return "–" if x is None else f"{100 * x:.1f}%"

    L = [f"# Quality of {r['rows']:,} generated rows ({r['task']})", "",
         f"Against {r['reference_rows']:,} real rows (D0: `{r['reference']}`)"
         + (f" and held-out real rows `{r['heldout']}`" if r.get("heldout") else "") + ". Labels: "
         + ", ".join(f"{k} {v:,}" for k, v in r["labels"].items()) + ".", "", "| measure | generated | real |", "|---|---:|---:|"]
    c, nd = r["copies"], r["near_duplicates"]
    L += [f"| (premise, hypothesis) copied from D0 | {pct(c['pair_copy_share'])} | – |",
          f"| hypothesis copied from D0 | {pct(c['hypothesis_copy_share'])} | – |",
          f"| premise copied from D0 | {pct(c['premise_copy_share'])} | – |",
          f"| near-duplicate of a D0 row ({_near_dup_rule(nd)}) | {pct(nd['near_duplicate_share'])} | – |",
          f"| near-duplicate within the set | {pct(nd['within_set_share'])} | – |"]
    fl = r.get("fluency")
    if fl:
        L += [f"| mean token log-prob under `{Path(fl['lm']).name}` | {fl['mean']:.3f} | {fl['real_mean']:.3f} |",
              f"| under the fluency bound ({fl['bound']:.3f}: real rows' 5th percentile) | {pct(fl['under_bound_share'])} | "
              f"{pct(fl['real_under_bound_share'])} |"]
    ag = r.get("agreement")
    if ag:
        L.append(f"| label = the {ag['k']}-fold cross-fitted ensemble's | {pct(ag['agreement'])} | "
                 f"{pct(ag['d0_agreement_cross_fitted'])} |")
        L += [f"| ... {k} | {pct(v)} | – |" for k, v in ag["agreement_per_label"].items()]
    tg = r.get("train_on_generated")
    if tg:
        L.append(f"| held-out accuracy of a classifier trained on {tg['n']:,} of these rows / of D0's "
                 f"({tg['epochs']:g} epoch{'s' if tg['epochs'] != 1 else ''}) | "
                 f"{pct(tg['generated_accuracy'])} | {pct(tg['real_accuracy'])} |")
        L += ["", f"Train on generated, test on real: the generated rows are worth **{tg['ratio']:.3f}x** real rows at equal "
                  f"n ({len(tg['runs'])} seed(s), {tg['heldout_rows']:,} held-out rows)."]
    for key, title in (("examples", "Examples of the rows"), ("rejected_examples", "Examples of the rows a filter dropped")):
        if r.get(key):
            L += ["", f"## {title}", "", "| premise | hypothesis | label |", "|---|---|---|"]
            L += [f"| {e['premise'].replace('|', '/')} | {e['hypothesis'].replace('|', '/')} | {e['label']}"
                  + (f" ({e['confidence']:.2f})" if "confidence" in e else "") + " |" for e in r[key]]
    return "\n".join(L) + "\n"
