"""IBADR: iterative bias-aware dataset refinement (Wang et al. 2023, "IBADR: an Iterative Bias-Aware
Dataset Refinement Framework for Debiasing NLU models", EMNLP Findings; section 2, Figure 1).

    theta_s <- a classifier fine-tuned on a random subset of D0         (section 2.1: 2K rows SNLI/MNLI, 0.5K FEVER)
    S <- D0;  theta_g <- a pretrained causal LM
    for t = 1..N_iter:                                                   (N_iter = 5)
        beta_i = p(y_i | x_i; theta_s) for every row of S                (the bias degree)
        sort S by beta, split into N_bi equal groups; group n gets b_n   (N_bi = 5; b_1 least biased)
        fine-tune theta_g on S with L_g = -sum_i log p(x_i | b_i, y_i)   (Eq. 1; 3 epochs at t = 1, then 1)
        repeat M times: b-bar = b_r, r ~ U{1..N_bi/2}; y-bar ~ U(labels)  (section 2.3 (i))
                        x-bar ~ p_g(. | b-bar, y-bar)
        keep (x-bar, y-bar) when p_M(y-bar | x-bar) > epsilon            (confidence filtering, Wu et al. 2022)
        S <- S + kept
        theta_s <- re-trained on a random sample of S                    (USM, section 2.3 (ii))
    retrain the NLU model on S

Modules: :mod:`.shallow` (theta_s, beta), :mod:`.indicators` (binning and b-bar; a slow reference
binning beside the fast one), :mod:`.loop` (the iterations, each in its own resumable folder),
:mod:`.params` (every parameter, declared once), :mod:`.step` (the recipe's ``ibadr`` filter step and ``ibadr_rows`` source step, and the card
section). The generator is :mod:`debiased_nli.methods.generation` (models, LoRA, training under
accelerate, sharded sampling) with the conditional format :mod:`debiased_nli.methods.generation.conditional`.

Ablations of Table 5, each a switch of :class:`.loop.IbadrConfig`: ``update_shallow=False`` (w/o
USM), ``indicator="lowest"`` (b_r => b_1), ``indicator="none"`` (w/o bias indicator: the generator
learns p(x | y), and no theta_s is trained), ``iterate=False`` (w/o iterative generation: all
N_iter x M samples come from the generator of the first iteration, in one iteration).

Choices the paper leaves open (this project's, each a parameter):

* The sequence: ``{bos}bias: b<n>\\nlabel: <y>\\npremise: <P>\\nhypothesis: <H>{eos}``; the indicator
  is text (no new embeddings, so LoRA needs no resize); the loss covers x (premise, hypothesis, their
  markers, the end marker) and not the prefix.
* epsilon and M: not given ("we follow Wu et al. (2022) to filter ... with model confidence lower than a
  threshold epsilon"); the default is Wu et al.'s tau = 0.95 with a given classifier M. The filter keeps
  p > epsilon, as :func:`debiased_nli.methods.confidence.confidence_filter` does.
* USM: "we randomly select 2K samples from the sample pool to finetune it": the default re-trains
  theta_s from the pretrained model on a fresh seeded sample of S each iteration (keeps it *shallow*,
  section 2.1's premise); ``usm_continue`` fine-tunes the previous theta_s instead. USM uses the same
  epochs and lr as the first theta_s (not stated). The first theta_s is trained on D0 = S.
* theta_s also scores the rows it was trained on (the paper scores "each sample in S").
* Ties in beta are broken by uid; group sizes differ by at most one (the first groups take the extra
  rows).
* theta_g continues from the previous iteration's weights (the same LoRA adapter); every iteration
  has its own linear learning-rate decay to 0.
* Decoding: nucleus sampling, top-p 0.9 (Wu et al.'s), at most ``max_new_tokens``; exact repeats
  within an iteration are dropped (reason recorded); copies of pool rows are kept and counted.
* ``gen_rows``: for small machines, theta_g may be trained on a sample of S with every indicator
  equally represented, instead of all of S (the paper trains on S). Off by default.
* The shallow model is any sequence classifier (the paper's is GPT-2 large); batch size 16 and
  maximum length 128 are not in the paper.
"""
from __future__ import annotations

# the parameters, each with the paper's value and its words: .params.PARAMS (section 3.10's LLaMA-7b with LoRA,
# "we finetune the LLaMA-7b model ... using LORA", is huggyllama/llama-7b with `lora`)
