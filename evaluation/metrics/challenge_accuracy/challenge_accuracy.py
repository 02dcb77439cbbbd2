"""Accuracy with breakdowns: the metric of every challenge set of debiased-nli.

accuracy = (1/n) * sum_i [prediction_i == reference_i]; with ``groups`` (one list of group keys per
breakdown, each as long as the predictions) it also returns, for every breakdown and every group g,
accuracy_g = (1/n_g) * sum_{i in g} [prediction_i == reference_i] and n_g.
"""
import evaluate
import datasets
import numpy as np

_DESCRIPTION = """Accuracy, plus accuracy and count per group for any number of named breakdowns
(e.g. HANS heuristic / subcase / gold label, ANLI round, Dasgupta subset)."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted label ids, in the challenge set's label space.
    references (`list` of `int`): gold label ids, same space.
    breakdowns (`dict` of `str` -> `list` of `str`, optional): breakdown name -> the group key of each row.
Returns:
    accuracy (`float`), n (`int`), correct (`int`), and, with breakdowns,
    breakdowns (`dict`): name -> {group -> {"accuracy": float, "n": int, "correct": int}}, groups sorted.
Examples:
    >>> from debiased_nli.models.challenge import load_metric
    >>> metric = load_metric()  # evaluate.load() of this folder, wherever debiased-nli is installed
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0], breakdowns={"h": ["a", "a", "b"]})
    {'accuracy': 0.6666666666666666, 'n': 3, 'correct': 2, 'breakdowns': {'h': {'a': {'accuracy': 1.0, 'n': 2, 'correct': 2}, 'b': {'accuracy': 0.0, 'n': 1, 'correct': 0}}}}
"""

# The metric is plain accuracy; what it serves is the challenge-set evaluation of Wu et al. (2022),
# whose breakdowns (e.g. by HANS heuristic) follow the sets' own papers.
_CITATION = """\
@inproceedings{wu-etal-2022-generating,
  title = {Generating Data to Mitigate Spurious Correlations in Natural Language Inference Datasets},
  author = {Wu, Yuxiang and Gardner, Matt and Stenetorp, Pontus and Dasigi, Pradeep},
  booktitle = {Proceedings of the 60th Annual Meeting of the Association for Computational Linguistics (Volume 1: Long Papers)},
  pages = {2660--2676},
  year = {2022},
  address = {Dublin, Ireland},
  publisher = {Association for Computational Linguistics},
  url = {https://aclanthology.org/2022.acl-long.190},
  doi = {10.18653/v1/2022.acl-long.190}
}
"""

_REFERENCE_URLS = [
    "https://aclanthology.org/2022.acl-long.190",  # Wu et al. 2022: the challenge-set evaluation
    "https://arxiv.org/abs/2203.12942",
]


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ChallengeAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            reference_urls=_REFERENCE_URLS,
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, breakdowns=None):
        pred = np.asarray(predictions, dtype=np.int64)
        ref = np.asarray(references, dtype=np.int64)
        hit = pred == ref
        out = {"accuracy": float(hit.mean()) if len(hit) else 0.0, "n": int(len(hit)), "correct": int(hit.sum())}
        if breakdowns:
            out["breakdowns"] = {}
            for name, keys in breakdowns.items():
                keys = np.asarray([str(k) for k in keys])
                if len(keys) != len(hit):
                    raise ValueError(f"breakdown {name!r} has {len(keys)} keys for {len(hit)} predictions")
                groups, inverse = np.unique(keys, return_inverse=True)
                n = np.bincount(inverse, minlength=len(groups))
                correct = np.bincount(inverse, weights=hit, minlength=len(groups)).astype(np.int64)
                out["breakdowns"][name] = {str(g): {"accuracy": float(c / k), "n": int(k), "correct": int(c)}
                                           for g, k, c in zip(groups, n, correct)}
        return out
