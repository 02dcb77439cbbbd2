"""The parameters of IBADR, declared once (Wang et al. 2023, ``papers/wang2023_ibadr.txt``; section 3.1
"Implementation Details" unless noted): :class:`.loop.IbadrConfig`'s defaults, the recipe steps ``ibadr`` and
``ibadr_rows`` and ``debiased-nli ibadr``'s options read them from here. The last four (``out`` ...) belong to
the step, not to the run's settings."""
from __future__ import annotations

from ...utils.params import Param, Params

_31 = "section 3.1"
PARAMS = Params("IBADR", [
    Param("generator", "str", None, "causal LM to start from (Hub id or folder)", required=True, nullable=False,
          paper="gpt2-large", quote=f"{_31} (\"we use GPT2-large ... to construct the sample generator\")"),
    Param("confidence_model", "str", None, "the NLI classifier M of the confidence filter", required=True,
          nullable=False),
    Param("shallow_model", "str", "gpt2-large", "the shallow model theta_s (a classifier to fine-tune)",
          paper="gpt2-large", quote=f"{_31} (\"we use GPT2-large ... to construct ... the shallow model\")"),
    Param("lora", "any", None, "LoRA options (r, alpha, dropout, target_modules) for the generator; true: the "
          "defaults (r 8, alpha 16, dropout 0.05, all linear layers); null: the full model", cli=None),
    Param("n_bi", "int", 5, "number of bias indicators N_bi", low=1,
          paper=5, quote="section 3.2 (\"we set N_bi to 5 for all subsequent experiments\")"),
    Param("n_iter", "int", 5, "iterations N_iter", low=1,
          paper=5, quote=f"{_31} (\"the iteration number N_iter to 5\")"),
    Param("samples_per_iter", "int", 200_000, "pseudo samples generated per iteration", low=1,
          paper=200_000, quote=f"{_31} (\"the number of pseudo sample generated per iteration to 200K\")"),
    Param("epsilon", "float", 0.95, "keep samples with p_M(label) > epsilon", low=0, high=1, high_open=True,
          source="Wu et al. (2022)'s tau, which section 2.2 step 4 follows (the paper gives no value)"),
    Param("shallow_rows", "int", 2000, "rows theta_s is trained on (FEVER: 500)", low=1,
          source=f"paper, {_31} (\"we randomly select 2K, 2K, and 0.5K samples from the original training sets of "
                 f"MNLI, SNLI, and FEVER\")"),
    Param("shallow_epochs", "float", 3.0, "epochs of theta_s", low=0, low_open=True,
          paper=3, quote=f"{_31} (\"These shallow models are trained for 3 epochs\")"),
    Param("shallow_lr", "float", 5e-5, "learning rate of theta_s", low=0, low_open=True,
          paper=5e-5, quote=f"{_31} (\"with a learning rate of 5e-5\")"),
    Param("shallow_batch_size", "int", 16, "batch size of theta_s", low=1),
    Param("shallow_max_length", "int", 128, "max tokens of a pair for theta_s", low=1),
    Param("update_shallow", "bool", True, "ablation: keep the first theta_s (w/o USM)", flag="off"),
    Param("usm_rows", "int", 2000, "pool rows theta_s is re-trained on (USM)", low=1,
          paper=2000, quote=f"{_31} (\"we randomly select 2K samples from the sample pool to finetune it\")"),
    Param("usm_continue", "bool", False, "USM fine-tunes the previous theta_s, not the pretrained model", flag="on"),
    Param("indicator", "str", "random_low", "b-bar: random among b1..b_{N_bi/2} (the paper), always b1, or no "
          "indicator at all", choices=("random_low", "lowest", "none"),
          paper="random_low", quote="section 2.3 (\"b-bar = b_r, where 1 <= r <= N_bi/2\")"),
    Param("iterate", "bool", True, "ablation: one iteration sampling n-iter x samples-per-iter rows", flag="off"),
    Param("gen_lr", "float", 5e-5, "learning rate of the generator", low=0, low_open=True,
          paper=5e-5, quote=f"{_31} (\"When training the sample generator, we set the learning rate to 5e-5\")"),
    Param("gen_epochs_first", "int", 3, "generator epochs in the first iteration", low=0,
          paper=3, quote=f"{_31} (\"we train the sample generator for 3 epochs in the first iteration\")"),
    Param("gen_epochs_later", "int", 1, "generator epochs in later iterations", low=0,
          paper=1, quote=f"{_31} (\"and for only 1 epoch in the subsequent iterations\")"),
    Param("gen_batch_size", "int", 8, "generator batch size", low=1),
    Param("gen_grad_accum", "int", 1, "generator gradient accumulation steps", low=1),
    Param("gen_max_length", "int", 128, "max tokens of a generator training sequence", low=1),
    Param("gen_rows", "int", None, "train the generator on this many indicator-stratified pool rows per iteration "
          "(default: all of S, the paper)", low=1),
    Param("gen_checkpoint_every", "int", 500, "generator checkpoint interval (steps)", low=1,
          cli="--checkpoint-every"),
    Param("top_p", "float", 0.9, "nucleus sampling top-p", low=0, high=1, low_open=True,
          source="Wu et al. (2022)'s nucleus sampling (not in the paper)"),
    Param("temperature", "float", 1.0, "sampling temperature", low=0, low_open=True),
    Param("max_new_tokens", "int", 96, "most new tokens per sample", low=1),
    Param("sample_batch_size", "int", 16, "prompts per sampling batch", low=1),
    Param("shard_size", "int", 1000, "samples per shard file", low=1),
    Param("confidence_batch_size", "int", 64, "rows per batch of the confidence filter", low=1),
    Param("seed", "seed", 0, "seed of the run's random choices (theta_s's rows, the indicators, the generator's "
          "training and sampling; iteration k uses seed + k)"),
    Param("cpu", "bool", False, "run on CPU even when a GPU is visible", flag="on"),
    Param("mixed_precision", "str", "no", "mixed precision of the generator's training",
          choices=("no", "fp16", "bf16")),
    Param("dtype", "str", None, "generator dtype for sampling", choices=("float32", "bfloat16", "float16")),
    # the step's, not the run's
    Param("out", "str", None, "the run folder: one resumable folder per iteration", cli=None),
    Param("gen_chunk_steps", "int", None, "with --time-budget: generator steps between deadline checks (default 20)",
          low=1),
    Param("progress", "bool", True, "progress bars", cli=None),
    Param("data_files", "any", None, "D0's files for `ibadr_rows` (default: the recipe's data)", cli=None),
])
"""IBADR's parameters."""
STEP_ONLY = ("out", "gen_chunk_steps", "progress", "data_files")
"""The parameters of the step that are not :class:`.loop.IbadrConfig` fields."""
SHALLOW_ROWS = {"mnli": 2000, "snli": 2000, "fever": 500}
"""Section 3.1: "we randomly select 2K, 2K, and 0.5K samples from the original training sets of MNLI, SNLI,
and FEVER"; other tasks: 2000."""
