"""Generating debiased rows (Wu et al. 2022, "Generating Data to Mitigate Spurious Correlations in NLI
Datasets", ACL; the LLaMA + LoRA family as in IBADR, Wang et al. 2023).

Pipeline (each piece a module, each a builder step in :mod:`.step`, their values in :mod:`.params`):

1. ``format``  -- rows as ``premise, label, hypothesis`` sequences with an end marker, parsed back.
2. ``losses``  -- MLE, label-consistency unlikelihood (lambda), the debiasing L_UL (alpha).
3. ``models``  -- any causal LM by Hub id or folder, full fine-tune or LoRA (peft), save / merge.
4. ``train``   -- G (MLE + lambda L_LC) and G* (MLE on Z(D0) + alpha L_UL on Z-(D0)) under accelerate,
                  with checkpoints and resume.
5. ``sample``  -- sharded, resumable sampling (one Parquet file per shard, rejects kept).
6. :mod:`debiased_nli.methods.confidence` -- confidence filtering with an NLI model M (tau).

``PAPER_DEFAULTS`` are the paper's settings for the ``snli`` / ``mnli`` builder recipes: train G,
fine-tune G*, sample, confidence-filter, then z-filter into Z-Aug / Par-Z / Seq-Z.
``GENERATOR_TRAINING`` and ``SAMPLING`` hold every value the generator's training and sampling use
by default, each with its source: the paper's words (table or section) or "project's choice".
Table numbers are those of the ACL version (``shared/papers/wu2022_generating_data_acl.txt``); its
appendix tables are garbled in the text extraction and were read in the submission version, where
Table 7 is Table 6 and Table 8 is Table 7.
"""
from __future__ import annotations

from .params import GENERATOR_TRAINING, PAPER_DEFAULTS, SAMPLING, paper_value, resolve

__all__ = ["PAPER_DEFAULTS", "GENERATOR_TRAINING", "SAMPLING", "resolve", "paper_value"]
