"""The evaluation stage: does training on a release help? It comes after ``release`` (which builds, diffs and
publishes releases) and before ``api`` and ``cli``.

* :mod:`.scores`: score fine-tuned classifiers on the challenge suite (``debiased-nli evaluate``): accuracy and
  breakdowns per set, mean ± sd over seeds, ``results.json``, ``report.md``, ``accuracy.png``.
* :mod:`.significance`: seed-row t intervals, paired bootstrap, multiple-comparison corrections.
* :mod:`.compare`: plans of trained rows x seeds scored on challenge sets, resumable units, the report of their
  differences, and its Hub model-index (``debiased-nli compare``).

Named ``evaluation`` (not ``evaluate``), so that no one reads ``debiased_nli.evaluate`` for the ``evaluate``
library that scores the sets (models/challenge.py loads its metric modules).
"""
