"""The hypothesis-only model behind the ``hypo-only-pred=<label>`` feature.

Wu et al. (2022), appendix B, Table 11: "We train a hypothesis-only model on the original dataset and
use its prediction as a feature"; section 3.1 names "a BERT-base (Devlin et al., 2019)
hypothesis-only model". It must never predict a row it was trained on, so D0's rows get
**out-of-fold** predictions: the rows are split into k stratified folds (seeded) and each fold is
predicted by a model fitted on the other k-1 folds. New rows D_G are predicted by one model fitted
on every row of D0 (``full_model``), never on D_G itself, so Z(D0) is a function of D0 alone.

Models:

* **TF-IDF + logistic regression** (the default, :func:`out_of_fold_tfidf`): its input is the
  hypothesis unigram and bigram features already in the feature matrix (``*@hypothesis``; features
  seen in fewer than ``min_df`` rows of D0 are ignored), sublinear TF-IDF weighting with D0's idf, so
  nothing is tokenised twice. This is the project's cheap stand-in for the paper's BERT-base. Its
  TF-IDF and logistic regressions are :mod:`debiased_nli.logreg`'s, whose results are the same bits on
  any CPU and thread count (:data:`LOGREG_SOLVER`), and a prediction is the label of the highest logit
  with an exact tie rule (:func:`debiased_nli.logreg.decide`), so the feature, and every row's fate in
  z-filtering, does not depend on the machine that builds the release.
* **A transformer fine-tuned out of fold** (:func:`out_of_fold_transformer`; in a recipe
  ``features: {hypothesis_only: {model: PATH, folds: 5, epochs: 1}}``): trained with the project's
  own ``train`` on rows whose premise is empty, so the classifier reads ``[CLS] [SEP] hypothesis
  [SEP]``: the hypothesis in the segment it has in a full pair, and nothing of the premise. Each
  fold is a resumable unit. Its epochs, length, batch size and learning rate are the project's
  choices (the paper gives none for this model).
* **An already fine-tuned classifier** (a folder or Hub id, :func:`transformer_predictions`) applied
  to the hypothesis alone; its ``id2label`` is mapped onto the task's labels. It should have been
  trained on other data: it is not out of fold.

For FEVER this is the claim-only model (the claim is the hypothesis).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow.compute as pc

from ..utils.cache import load_npz, save_npz
from ..utils.errors import ConfigError
from .features import FeatureMatrix

# The TF-IDF model's logistic regressions: debiased_nli.logreg's Newton-CG, run until the largest gradient
# entry is below 1e-10 (4-6 Newton steps on the 20k SNLI sample's folds), with every sum in a fixed order,
# no BLAS and its own exp/log, so its weights and predictions are the same bits on any CPU and thread count.
# It replaced scikit-learn's Newton-CG at tolerance 1e-4, whose out-of-fold predictions on the 20k SNLI
# sample differed between OpenBLAS's native kernels at 2 threads and its Haswell kernels at 1 thread
# (out-of-fold accuracy 0.59645 and 0.5966; z_filtered 7,454 and 7,609 rows); this one gives 0.59685
# everywhere. (scikit-learn's L-BFGS before that stopped at its iteration cap on large inputs:
# the build-at-scale measurement of the documentation, Development page.) Part of the cache key of the model's predictions.
LOGREG_SOLVER = {"solver": "newton-cg (debiased_nli.logreg, machine-independent)", "tol": 1e-10, "max_iter": 100,
                 "tie_margin": 1e-7}


def logistic_regression(C: float = 1.0, seed: int = 0, max_iter: int | None = None):
    """The TF-IDF model's (unfitted) logistic regression: L2 penalty ``C``, :data:`LOGREG_SOLVER`, the same
    bits on every machine (:class:`debiased_nli.logreg.LogisticRegression`; it draws nothing at random,
    so ``seed`` changes nothing: kept for the callers that pass one)."""
    from .logreg import LogisticRegression

    return LogisticRegression(C=C, tol=LOGREG_SOLVER["tol"],
                              max_iter=int(max_iter) if max_iter is not None else LOGREG_SOLVER["max_iter"])


def tfidf_transformer():
    """The TF-IDF model's (unfitted) TF-IDF: scikit-learn's ``sublinear_tf=True`` weighting, computed
    with the same bits on every machine (:class:`debiased_nli.logreg.TfidfTransformer`)."""
    from .logreg import TfidfTransformer

    return TfidfTransformer()


def decide(logits: np.ndarray) -> np.ndarray:
    """Predictions from rows x labels logits: the highest, with ties within ``LOGREG_SOLVER["tie_margin"]``
    going to the lowest label index (:func:`debiased_nli.logreg.decide`)."""
    from .logreg import decide as _decide

    return _decide(np.asarray(logits).T, LOGREG_SOLVER["tie_margin"])[0]


@dataclasses.dataclass
class HypothesisOnlyResult:
    predictions: np.ndarray       # int label per row
    probabilities: np.ndarray     # rows x K
    accuracy: float               # out-of-fold accuracy against the gold labels
    method: str
    params: dict

    def to_dict(self) -> dict:
        return {"method": self.method, "accuracy": round(self.accuracy, 6), **self.params}


def hypothesis_columns(fm: FeatureMatrix, min_df: int = 2) -> np.ndarray:
    """The vocabulary ids the model reads: hypothesis n-grams (``*@hypothesis``) in >= ``min_df`` rows."""
    cols = np.nonzero(fm.feature_mask(lambda v: pc.ends_with(v, "@hypothesis")))[0]
    df = np.asarray((fm.csr()[:, cols] > 0).sum(axis=0)).ravel()
    return cols[df >= min_df]


def hypothesis_matrix(fm: FeatureMatrix, min_df: int = 2, columns: np.ndarray | None = None):
    """The rows x (hypothesis n-gram) sub-matrix used as the model's input (``columns``: see
    :func:`hypothesis_columns`; computed from ``fm`` when not given)."""
    cols = hypothesis_columns(fm, min_df) if columns is None else columns
    return fm.csr()[:, cols]


@dataclasses.dataclass
class TfidfHypothesisOnly:
    """TF-IDF + logistic regression on the hypothesis n-grams of D0, fitted on every row of D0:
    the model that predicts rows it was not trained on (new rows D_G)."""

    columns: np.ndarray   # vocabulary ids of its inputs
    tfidf: object         # fitted debiased_nli.logreg.TfidfTransformer (idf of D0)
    clf: object           # fitted debiased_nli.logreg.LogisticRegression
    num_labels: int

    def logits(self, fm: FeatureMatrix) -> np.ndarray:
        """rows x labels logits (-inf for a label the model never saw)."""
        X = self.tfidf.transform(hypothesis_matrix(fm, columns=self.columns))
        out = np.full((fm.n_rows, self.num_labels), -np.inf)
        if fm.n_rows:
            out[:, self.clf.classes_] = self.clf.decision_function(X)
        return out

    def predict_proba(self, fm: FeatureMatrix) -> np.ndarray:
        X = self.tfidf.transform(hypothesis_matrix(fm, columns=self.columns))
        probs = np.zeros((fm.n_rows, self.num_labels))
        if fm.n_rows:
            probs[:, self.clf.classes_] = self.clf.predict_proba(X)
        return probs

    def predict(self, fm: FeatureMatrix) -> np.ndarray:
        """The label of the highest logit, ties within the margin to the lowest index (:func:`decide`)."""
        return decide(self.logits(fm)) if fm.n_rows else np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True)
class TfidfSettings:
    """The TF-IDF model's settings (the project's; the paper's model is a BERT-base, module docstring):
    ``C``, the logistic regression's inverse L2 penalty; ``min_df``, the fewest rows of the training rows a
    hypothesis n-gram must be in to be an input; ``max_iter``, the most Newton steps (None:
    :data:`LOGREG_SOLVER`'s)."""

    C: float = 1.0
    min_df: int = 2
    max_iter: int | None = None


def out_of_fold_tfidf(fm: FeatureMatrix, labels: np.ndarray, num_labels: int, *, folds: int = 5,
                      seed: int = 0, settings: TfidfSettings | None = None, progress: bool = True,
                      full_model: bool = False, n_jobs: "int | str | None" = None
                      ) -> "HypothesisOnlyResult | tuple[HypothesisOnlyResult, TfidfHypothesisOnly]":
    """Out-of-fold predictions of TF-IDF + logistic regression on the hypothesis n-grams.

    ``full_model``: also fit the model on every row (for rows outside ``fm``) and return it too.
    ``n_jobs`` fits the folds (and the full model) in that many processes; each fit is the same.
    """
    return start_out_of_fold_tfidf(fm, labels, num_labels, folds=folds, seed=seed, settings=settings,
                                   progress=progress, full_model=full_model, n_jobs=n_jobs)()


def start_out_of_fold_tfidf(fm: FeatureMatrix, labels: np.ndarray, num_labels: int, *, folds: int = 5,
                            seed: int = 0, settings: TfidfSettings | None = None, progress: bool = True,
                            full_model: bool = False, n_jobs: "int | str | None" = None):
    """:func:`out_of_fold_tfidf` in two steps: this call starts the fits and returns a function that
    waits for them and returns what :func:`out_of_fold_tfidf` returns.

    With more than one process (``n_jobs``), the fits run in those processes while the caller goes
    on (the build extracts the new rows' features meanwhile); with one, they run when the returned
    function is called. The result is the same either way.
    """
    from sklearn.model_selection import StratifiedKFold

    s = settings or TfidfSettings()
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    if n < folds * 2:
        raise ConfigError(f"the hypothesis-only model needs at least {folds * 2} rows for {folds}-fold "
                          f"prediction, got {n}")
    columns = hypothesis_columns(fm, s.min_df)
    tfidf = tfidf_transformer()
    X = tfidf.fit_transform(hypothesis_matrix(fm, columns=columns))
    counts = np.bincount(labels, minlength=num_labels)
    present = counts[counts > 0]
    k = int(min(folds, present.min())) if present.min() >= 2 else 2
    splitter = StratifiedKFold(n_splits=max(k, 2), shuffle=True, random_state=seed)
    splits = list(splitter.split(np.zeros(n), labels))
    jobs = [train for train, _ in splits] + ([np.arange(n)] if full_model else [])
    collect = _fit_logregs(X, labels, jobs, C=s.C, max_iter=s.max_iter, seed=seed, n_jobs=n_jobs,
                           progress=progress, background=True)

    def finish():
        from .logreg import decide as _decide

        fitted = collect()
        probs = np.zeros((n, num_labels))
        logits = np.full((n, num_labels), -np.inf)
        for (_, held), clf in zip(splits, fitted):
            probs[np.ix_(held, clf.classes_)] = clf.predict_proba(X[held])
            logits[np.ix_(held, clf.classes_)] = clf.decision_function(X[held])
        # the prediction is decided on the logits, with the exact tie rule (not on rounded probabilities)
        pred, tie = _decide(logits.T, LOGREG_SOLVER["tie_margin"])
        oof = fitted[:len(splits)]
        result = HypothesisOnlyResult(pred, probs, float((pred == labels).mean()), "tfidf-logreg-oof",
                                      {"folds": int(max(k, 2)), "seed": seed, "C": s.C, "min_df": s.min_df,
                                       "n_inputs": int(X.shape[1]), "solver": LOGREG_SOLVER["solver"],
                                       "tol": LOGREG_SOLVER["tol"], "tie_margin": LOGREG_SOLVER["tie_margin"],
                                       "ties": int(tie.sum()),
                                       "converged": all(c.info_["converged"] for c in oof),
                                       "newton_steps": [int(c.info_["newton_steps"]) for c in oof]})
        if full_model:
            return result, TfidfHypothesisOnly(columns, tfidf, fitted[-1], num_labels)
        return result

    return finish


def fit_tfidf(fm: FeatureMatrix, labels: np.ndarray, num_labels: int, *, seed: int = 0,
              settings: TfidfSettings | None = None) -> TfidfHypothesisOnly:
    """The TF-IDF + logistic regression model fitted on every row of ``fm`` (as
    :func:`out_of_fold_tfidf` with ``full_model=True`` fits it, without the folds)."""
    s = settings or TfidfSettings()
    columns = hypothesis_columns(fm, s.min_df)
    tfidf = tfidf_transformer()
    X = tfidf.fit_transform(hypothesis_matrix(fm, columns=columns))
    clf = logistic_regression(s.C, seed, s.max_iter).fit(X, np.asarray(labels, dtype=np.int64))
    return TfidfHypothesisOnly(columns, tfidf, clf, num_labels)


def _fit(model, X, y):
    return model.fit(X, y)


# "auto" fits the folds in processes from this many rows: below it, starting them (a fresh interpreter
# each, importing scikit-learn) costs more than the fits (55k rows: about 1 s a fit; project choice)
PARALLEL_FIT_MIN_ROWS = 200_000


def _fit_logregs(X, labels: np.ndarray, row_sets: Sequence[np.ndarray], *, C: float, max_iter: int | None,
                 seed: int, n_jobs: "int | str | None", progress: bool, background: bool = False):
    """One logistic regression per row set (same settings), sequentially or in ``n_jobs`` processes
    (``"auto"``: the usable CPUs, at most 4, for :data:`PARALLEL_FIT_MIN_ROWS` rows or more). Each fit
    is the same either way: the models are made here, with this process's :data:`LOGREG_SOLVER`, and
    only fitted there. The processes are joblib's (loky: started fresh, not forked, since the fits use
    OpenMP, which does not survive a fork) and exit a second after the last fit instead of idling for
    minutes with their memory while the build goes on (each fit is single-threaded numpy: the same bits
    in any process). ``background``: return at once a function that
    waits for the fits and returns them (in processes, the fits go on while the caller works; in this
    process, they run when the function is called)."""
    from tqdm.auto import tqdm

    if n_jobs == "auto":  # parallel only where it pays for starting the processes
        n_jobs = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) \
            if X.shape[0] >= PARALLEL_FIT_MIN_ROWS else 1
    models = [logistic_regression(C, seed, max_iter) for _ in row_sets]
    if n_jobs is not None and int(n_jobs) > 1 and len(row_sets) > 1:
        from joblib import Parallel, delayed

        # the first 2 x n_jobs fits are dispatched now, the others by joblib's callback thread as fits
        # finish (not all at once: each holds a copy of its rows); the generator hands them back in order
        fits = Parallel(n_jobs=int(n_jobs), idle_worker_timeout=1, return_as="generator")(
            delayed(_fit)(m, X[r], labels[r]) for m, r in zip(models, row_sets))
        return (lambda: list(fits)) if background else list(fits)

    def sequential():
        return [m.fit(X[r], labels[r]) for m, r in
                zip(models, tqdm(row_sets, desc="hypothesis-only (out-of-fold)", disable=not progress))]

    return sequential if background else sequential()


# ------------------------------------------------------------------------- a transformer, out of fold

TRANSFORMER_DEFAULTS = {
    "model": None,          # a model folder or Hub id (an encoder gets a fresh 3-way head)
    "folds": 5,             # k of the k-fold split (the TF-IDF model's split: same seed, same folds)
    "epochs": 1.0,
    "max_length": 48,       # hypotheses are short: 48 word pieces cover SNLI's (project choice)
    "batch_size": 32,       # the project's training default (Wu et al. 2022, appendix A.2)
    "learning_rate": 5e-5,  # project choice for a one-epoch fine-tune (Devlin et al. 2019 try 5e-5, 3e-5, 2e-5)
    "eval_batch_size": 256,
    "num_threads": None,
    "checkpoint_steps": 200,  # a fold interrupted mid-epoch resumes from its last checkpoint
}
# settings that do not change the predictions (left out of the cache key)
TRANSFORMER_RUNTIME_KEYS = ("eval_batch_size", "num_threads", "checkpoint_steps")


def transformer_params(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's ``features.hypothesis_only`` mapping, checked and completed with the defaults."""
    unknown = sorted(set(spec) - set(TRANSFORMER_DEFAULTS))
    if unknown:
        raise ConfigError(f"features.hypothesis_only: unknown key(s) {unknown}; known: {sorted(TRANSFORMER_DEFAULTS)}")
    params = {**TRANSFORMER_DEFAULTS, **dict(spec)}
    if not params["model"]:
        raise ConfigError("features.hypothesis_only needs `model` (a folder or Hub id), e.g. "
                          "{model: bert-base-uncased, folds: 5, epochs: 1}")
    if int(params["folds"]) < 2:
        raise ConfigError(f"features.hypothesis_only.folds must be >= 2, got {params['folds']}")
    return params


def _hypothesis_only_rows(hypotheses: Sequence[str], labels: np.ndarray, task):
    """Canonical rows whose premise is empty: the classifier sees ``[CLS] [SEP] hypothesis [SEP]``, the
    hypothesis in the segment it has in a full pair, and nothing of the premise."""
    import datasets

    from ..data.loading import canonical_features

    n = len(labels)
    feats = canonical_features(task)
    return datasets.Dataset.from_dict(
        {"premise": [""] * n, "hypothesis": list(hypotheses), "label": np.asarray(labels).tolist(),
         "uid": [str(i) for i in range(n)], "origin": ["original"] * n, "method": ["hypothesis-only"] * n},
        features=feats)


def _train_and_predict(params: Mapping[str, Any], task, train_hyps: Sequence[str], train_labels: np.ndarray,
                       predict_hyps: Sequence[str], model_dir: Path, seed: int, progress: bool) -> np.ndarray:
    """Fine-tune on hypotheses alone (the project's ``train``), then the task-order probabilities of
    ``predict_hyps``."""
    from ..models.classifier import load_classifier, predict_probabilities
    from ..models.training import TrainConfig, train_classifier

    cfg = TrainConfig(model=str(params["model"]), output_dir=str(model_dir), learning_rate=float(params["learning_rate"]),
                      batch_size=int(params["batch_size"]), eval_batch_size=int(params["eval_batch_size"]),
                      max_length=int(params["max_length"]), epochs=float(params["epochs"]), seed=seed,
                      num_threads=params["num_threads"], eval_steps=params["checkpoint_steps"], progress=progress)
    train_classifier(cfg, task, _hypothesis_only_rows(train_hyps, train_labels, task))
    clf = load_classifier(str(model_dir))
    probs = predict_probabilities(clf, [""] * len(predict_hyps), list(predict_hyps), labels=task.labels,
                                  batch_size=int(params["eval_batch_size"]), max_length=int(params["max_length"]),
                                  progress=progress and "hypothesis-only (predict)")
    return probs.astype(np.float64)


def out_of_fold_transformer(hypotheses: Sequence[str], labels: np.ndarray, task, params: Mapping[str, Any], *,
                            work_dir: "str | Path", seed: int = 0, new_hypotheses: Sequence[str] | None = None,
                            only_folds: Sequence[int] | None = None, keep_models: bool = False,
                            progress: bool = True) -> "tuple[HypothesisOnlyResult | None, np.ndarray | None]":
    """Out-of-fold predictions of a fine-tuned transformer on the hypotheses alone, like the TF-IDF
    model's: k stratified folds (seeded), each predicted by a model trained on the other k-1; then,
    when ``new_hypotheses`` are given, one model trained on every row predicts them.

    Each fold is a resumable unit: its held-out probabilities go to ``work_dir/fold-<i>.npz`` (read
    back on a rerun) and its model folder is removed once they are written (``keep_models`` keeps
    it); a fold interrupted mid-training resumes from its last checkpoint. ``only_folds`` runs just
    those folds (one unit per call) and returns ``(None, None)``.
    """
    from sklearn.model_selection import StratifiedKFold

    params = transformer_params(params)
    labels = np.asarray(labels, dtype=np.int64)
    n, K = len(labels), len(task.labels)
    folds = int(params["folds"])
    if n < folds * 2:
        raise ConfigError(f"the hypothesis-only model needs at least {folds * 2} rows for {folds}-fold "
                          f"prediction, got {n}")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    splits = list(StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed).split(np.zeros(n), labels))
    hyps = np.asarray(list(hypotheses), dtype=object)
    probs = np.zeros((n, K))
    todo = range(folds) if only_folds is None else [int(i) for i in only_folds]
    for i in todo:
        path = work / f"fold-{i}.npz"
        train, held = splits[i]
        saved = load_npz(path, ("held", "probs"))  # an unreadable fold is a miss: trained again
        if saved is None:
            model_dir = work / f"fold-{i}-model"
            p = _train_and_predict(params, task, hyps[train].tolist(), labels[train], hyps[held].tolist(),
                                   model_dir, seed, progress)
            save_npz(path, held=held, probs=p)
            if not keep_models:
                import shutil
                shutil.rmtree(model_dir, ignore_errors=True)
            saved = {"held": held, "probs": p}
        if not np.array_equal(saved["held"], held):
            raise ConfigError(f"{path} holds another split's predictions; remove {work} and rerun")
        probs[held] = saved["probs"]
    if only_folds is not None:
        return None, None
    pred = probs.argmax(axis=1)
    result = HypothesisOnlyResult(pred, probs, float((pred == labels).mean()), "transformer-oof",
                                  {"folds": folds, "seed": seed, **{k: params[k] for k in
                                   ("model", "epochs", "max_length", "batch_size", "learning_rate")}})
    new_probs = None
    if new_hypotheses is not None and len(new_hypotheses):
        path = work / f"new-{_fingerprint_texts(new_hypotheses)}.npz"
        saved = load_npz(path, ("probs",))
        if saved is not None:
            new_probs = saved["probs"]
        else:
            new_probs = _train_and_predict(params, task, hyps.tolist(), labels, list(new_hypotheses),
                                           work / "full-model", seed, progress)
            save_npz(path, probs=new_probs)
    return result, new_probs


def _fingerprint_texts(texts: Sequence[str]) -> str:
    import hashlib

    h = hashlib.sha1()
    for t in texts:
        h.update(t.encode())
        h.update(b"\x1f")
    return h.hexdigest()[:16]


def transformer_predictions(model: str, hypotheses: Sequence[str], labels: np.ndarray,
                            label_names: Sequence[str], *, batch_size: int = 64, max_length: int = 64,
                            device: str | None = None, progress: bool = True) -> HypothesisOnlyResult:
    """Predictions of a fine-tuned sequence classifier (folder or Hub id) on the hypothesis alone (one
    segment), in batches of rows in input order."""
    from ..models.classifier import load_classifier, predict_probabilities

    clf = load_classifier(model, device)
    probs = predict_probabilities(clf, None, hypotheses, batch_size=batch_size, max_length=max_length,
                                  order=range(len(hypotheses)), labels=label_names,
                                  progress=progress and "hypothesis-only (model)")
    pred = probs.argmax(axis=1)
    labels = np.asarray(labels)
    return HypothesisOnlyResult(pred, probs, float((pred == labels).mean()) if len(labels) else 0.0,
                                "transformers", {"model": model})
