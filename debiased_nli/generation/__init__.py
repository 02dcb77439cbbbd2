"""Generating debiased rows (Wu et al. 2022, "Generating Data to Mitigate Spurious Correlations in NLI
Datasets", ACL; the LLaMA + LoRA family as in IBADR, Wang et al. 2023).

Pipeline (each piece a module, each a builder step in :mod:`.steps`):

1. ``format``  -- rows as ``premise, label, hypothesis`` sequences with an end marker, parsed back.
2. ``losses``  -- MLE, label-consistency unlikelihood (lambda), the debiasing L_UL (alpha).
3. ``models``  -- any causal LM by Hub id or folder, full fine-tune or LoRA (peft), save / merge.
4. ``train``   -- G (MLE + lambda L_LC) and G* (MLE on Z(D0) + alpha L_UL on Z-(D0)) under accelerate,
                  with checkpoints and resume.
5. ``sample``  -- sharded, resumable sampling (one Parquet file per shard, rejects kept).
6. :mod:`debiased_nli.confidence` -- confidence filtering with an NLI model M (tau).

``PAPER_DEFAULTS`` are the paper's settings (Wu et al. 2022, sections 3-5 and appendix A), for the
``snli`` / ``mnli`` builder recipes: train G, fine-tune G*, sample, confidence-filter, then
z-filter into Z-Aug / Par-Z / Seq-Z.
"""
from __future__ import annotations

PAPER_DEFAULTS = {
    "generator": "gpt2-large",          # fully fine-tuned (section 3.1)
    "generator_llama": "huggyllama/llama-7b",  # IBADR's LLaMA-7b, trained with LoRA
    "lambda": 0.5,                       # weight of the label-consistency unlikelihood
    "alpha": 1.0,                        # weight of L_UL on Z-(D0) in the debiasing fine-tune
    "top_p": 0.9,                        # nucleus sampling
    "num_samples": {"snli": 5_000_000, "mnli": 4_000_000},
    "confidence_model": "roberta-large",  # M, fine-tuned on the task
    "tau": 0.95,                         # confidence threshold
    "z_top_k": 20,                       # biased features per label for the z-filters
    "order": "premise, label, hypothesis",
}

__all__ = ["PAPER_DEFAULTS"]
