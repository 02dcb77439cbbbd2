"""The parameters of the AFLite step, declared once (Le Bras et al. 2020, ``papers/lebras2020_aflite.txt``):
the recipe step, ``debiased-nli aflite``'s options, :func:`.algorithm.aflite`'s defaults and the report's
"source" of every value read them from here. The paper gives the warm-up (Appendix A.4), t (the warm-up size)
and n (a third of the data); m, k and tau are the project's choices (the paper's text has its maths stripped
and says they are "determined by the available computation budget")."""
from __future__ import annotations

from ...utils.params import Param, Params

PARAMS = Params("AFLite", [
    Param("encoder", "str", None, "encoder folder or Hub id (default: roberta-large, the paper's, or the offline "
          "all-MiniLM-L6-v2 folder ~/.cache/debiased-nli/models/all-minilm-l6-v2 where it exists)",
          source="paper: RoBERTa-large (§4); here the offline all-MiniLM-L6-v2 where it exists"),
    Param("warmup_share", "float", 0.1, "fine-tune the encoder on this share of the rows first; those rows are "
          "removed with reason 'warm-up' and their number is t; 0 = no warm-up, embed with the encoder as it is",
          low=0, high=1, high_open=True,
          source="project's choice (§2: \"a small fraction of the data\"; §5 ImageNet: \"a fixed 20% sample\")"),
    Param("warmup_epochs", "float", 3.0, "warm-up epochs", low=0, low_open=True,
          paper=3.0, quote="A.4 (\"3 epochs for all *NLI tasks\")"),
    Param("warmup_lr", "float", 1e-5, "warm-up learning rate", low=0, low_open=True,
          paper=1e-5, quote="A.4 (\"a learning rate of 1e-05\")"),
    Param("warmup_eps", "float", 1e-8, "warm-up Adam epsilon", low=0, low_open=True,
          paper=1e-8, quote="A.4 (\"an epsilon value of 1e-08\")"),
    Param("warmup_batch_size", "int", 92, "warm-up batch size", low=1,
          paper=92, quote="A.4 (\"a batch size of 92\")"),
    Param("batch_size", "int", 64, "rows per embedding batch", low=1),
    Param("max_length", "int", 128, "max tokens of a pair, warm-up and embeddings", low=1),
    Param("pooling", "str", "cls", "cls: the first token of the last layer, the input of the classification head; "
          "mean: the masked mean of the last layer", choices=("cls", "mean"),
          source="the fine-tuned encoder's first token, the input of its classification head (§4: \"extracted from "
                 "the final layer before the output layer\")"),
    Param("m", "int", 64, "partitions (linear classifiers) per round", low=1,
          source="project's choice (§2: \"number of partitions ... determined by the available computation budget\")"),
    Param("train_size", "int", None, "t, rows in each train part (default: the warm-up size)", low=1,
          source="paper: the warm-up size (§2: \"this fraction corresponds to the training size for AFLite "
                 "and it remains unchanged across iterations\")"),
    Param("k", "int", None, "slice size, the most rows removed per round (default: 1/20 of the rows filtered)", low=1,
          source="project's choice, a twentieth of the rows filtered (§2: \"slice size ... determined by the "
                 "available computation budget\")"),
    Param("tau", "float", 0.75, "predictability threshold", low=0, high=1, low_open=True,
          source="project's choice (the paper gives no value for the early-stopping threshold)"),
    Param("target_n", "int", None, "stop when this many rows remain (default: |D|/3, the paper's 182k of 550k)", low=1,
          source="paper: a third of the input (§4: SNLI-AFLite \"size 182k\" of 550k, \"only a third of the full "
                 "data\")"),
    Param("selection", "str", "greedy", "greedy: remove the top-k scores; sample: the slice-sampling variant "
          "(Gumbel top-k on log scores)", choices=("greedy", "sample")),
    Param("C", "float", 1.0, "inverse L2 strength of the logistic regressions", low=0, low_open=True,
          source="project's choice (scikit-learn's default L2 strength; the paper says \"typically a linear "
                 "classifier\")"),
    Param("tol", "float", 1e-4, "stop a logistic regression when its largest absolute gradient entry is below this "
          "(scikit-learn's gtol)", low=0, low_open=True,
          source="project's choice (scikit-learn's default tolerance for LogisticRegression)"),
    Param("max_iter", "int", 1000, "most L-BFGS iterations per fit", low=1),
    Param("max_rounds", "int", None, "stop after this many rounds", low=1),
    Param("device", "str", None, "torch device of the encoder and the linear models (default: cuda if available)"),
    Param("seed", "seed", 0, "seed of partitions, sampling and warm-up"),
    Param("audit", "bool", True, "the bias audit before/after/random control", flag="off", cli="--no-audit"),
    Param("top_k", "int", 20, "top z-statistics per label in the audit", low=1),
    Param("random_control", "bool", True, "audit a random subset of the kept size too (the paper's control)",
          flag="off"),
    Param("progress", "bool", True, "progress bars", cli=None),
])
"""AFLite's parameters (the defaults of :func:`.step.aflite_step`)."""
