"""The hypothesis-only model of PDD's third feature family, kept fold by fold so new rows can be predicted.

Guo et al. (2023) name the feature ("the predictions of a model that takes only the hypothesis as
the input", section 3.1) but not the model. This is the library's out-of-fold TF-IDF + logistic
regression (:func:`debiased_nli.bias.hypothesis_only.out_of_fold_tfidf`, same inputs, folds, seed and
settings, so the original rows get exactly its predictions), with the k fold models kept: a
perturbed row S' is predicted by the fold model that held its source row out (its *fold* is inherited
from its source), so no row is ever predicted by a model that was trained on its own source.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...bias.features import extract_table
from ...utils.errors import ConfigError

INPUT_EXTRACTORS = ("unigram_v1", "bigram_v1")


def hypothesis_inputs(feats: pa.Table) -> tuple[pa.Array, np.ndarray]:
    """(the ``*@hypothesis`` n-grams, their row) from a table of ``feat_unigram_v1`` / ``feat_bigram_v1``."""
    lists = [feats.column("feat_" + name).combine_chunks() for name in INPUT_EXTRACTORS]
    flat = pa.concat_arrays([pc.list_flatten(x) for x in lists])
    parents = np.concatenate([pc.list_parent_indices(x).to_numpy() for x in lists]).astype(np.int64)
    keep = pc.ends_with(flat, "@hypothesis").to_numpy(zero_copy_only=False)
    return flat.filter(pa.array(keep)), parents[keep]


class HypothesisOnlyFolds:
    """k fold models of TF-IDF + logistic regression on the hypothesis n-grams."""

    def __init__(self, labels: Sequence[str], *, folds: int = 5, seed: int = 0, C: float = 1.0, min_df: int = 2,
                 max_iter: int | None = None):
        self.labels = tuple(labels)
        self.folds, self.seed, self.C, self.min_df, self.max_iter = folds, seed, C, min_df, max_iter

    def describe(self) -> dict:
        return {"method": "tfidf-logreg-oof (fold models kept)", "folds": self.k, "seed": self.seed, "C": self.C,
                "min_df": self.min_df, "n_inputs": len(self.columns)}

    def _matrix(self, premises, hypotheses, fixed_columns: bool, feats: pa.Table | None = None):
        import scipy.sparse as sp

        if feats is None:
            table = pa.table({"premise": pa.array(list(premises), pa.string()),
                              "hypothesis": pa.array(list(hypotheses), pa.string())})
            feats = extract_table(table, list(INPUT_EXTRACTORS), self.labels)
        flat, parents = hypothesis_inputs(feats)
        n = len(hypotheses)
        if not fixed_columns:
            # the vocabulary in string order, as FeatureMatrix ids are, so columns match hypothesis_matrix
            vocab = np.array(sorted(set(flat.to_pylist())), dtype=object)
            self.index = {str(v): i for i, v in enumerate(vocab)}
        col = np.array([self.index.get(v, -1) for v in flat.to_pylist()], dtype=np.int64)
        ok = col >= 0
        X = sp.csr_matrix((np.ones(int(ok.sum()), dtype=np.float32), (parents[ok], col[ok])),
                          shape=(n, len(self.index)))
        X.data[:] = 1.0  # presence, as the feature matrix stores each feature once per row
        return X

    def fit(self, premises: Sequence[str], hypotheses: Sequence[str], labels: np.ndarray,
            progress: bool = False) -> np.ndarray:
        """Fit the fold models; returns the out-of-fold predictions of the given rows (``self.fold_of``
        holds each row's fold)."""
        from sklearn.model_selection import StratifiedKFold

        from ...bias.hypothesis_only import LOGREG_SOLVER, logistic_regression, tfidf_transformer
        from ...bias.logreg import decide

        labels = np.asarray(labels, dtype=np.int64)
        n, K = len(labels), len(self.labels)
        if n < self.folds * 2:
            raise ConfigError(f"the hypothesis-only model needs at least {self.folds * 2} rows, got {n}")
        X = self._matrix(premises, hypotheses, fixed_columns=False)
        df = np.asarray((X > 0).sum(axis=0)).ravel()
        self.columns = np.nonzero(df >= self.min_df)[0]
        self.tfidf = tfidf_transformer().fit(X[:, self.columns])
        Xt = self.tfidf.transform(X[:, self.columns])
        counts = np.bincount(labels, minlength=K)
        present = counts[counts > 0]
        k = int(min(self.folds, present.min())) if present.min() >= 2 else 2
        self.k = max(k, 2)
        splitter = StratifiedKFold(n_splits=self.k, shuffle=True, random_state=self.seed)
        self.models, self.fold_of = [], np.zeros(n, dtype=np.int64)
        logits = np.full((n, K), -np.inf)
        for f, (train, held) in enumerate(splitter.split(np.zeros(n), labels)):
            clf = logistic_regression(self.C, self.seed, self.max_iter)
            clf.fit(Xt[train], labels[train])
            logits[np.ix_(held, clf.classes_)] = clf.decision_function(Xt[held])
            self.models.append(clf)
            self.fold_of[held] = f
        # as the library decides them: the highest logit, the exact tie rule (the same bits on any machine)
        return decide(logits.T, LOGREG_SOLVER["tie_margin"])[0]

    def predict(self, premises: Sequence[str], hypotheses: Sequence[str], folds: Sequence[int],
                feats: pa.Table | None = None) -> np.ndarray:
        """Predictions of new rows, each by the model of its fold (``feats``: their unigram_v1/bigram_v1
        columns when already extracted)."""
        if not len(hypotheses):
            return np.zeros(0, dtype=np.int64)
        Xt = self.tfidf.transform(self._matrix(premises, hypotheses, fixed_columns=True, feats=feats)[:, self.columns])
        folds = np.asarray(folds, dtype=np.int64)
        from ...bias.hypothesis_only import decide

        out = np.zeros(len(hypotheses), dtype=np.int64)
        for f in np.unique(folds):
            rows = np.nonzero(folds == f)[0]
            clf = self.models[int(f)]
            z = np.full((len(rows), len(self.labels)), -np.inf)
            z[:, clf.classes_] = clf.decision_function(Xt[rows])
            out[rows] = decide(z)
        return out
