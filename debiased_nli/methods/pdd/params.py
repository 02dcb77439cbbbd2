"""The parameters of the PDD step, declared once (Guo et al. 2023, ``papers/guo2023_pdd.txt``): the recipe step
and ``debiased-nli pdd``'s options read them from here."""
from __future__ import annotations

from ...utils.params import Param, Params, comma_list, mapping_parser

PARAMS = Params("PDD", [
    Param("mlm", "str", "xlm-roberta-large", "any AutoModelForMaskedLM, Hub id or folder",
          paper="xlm-roberta-large", quote="Table 10 (\"Pre-trained MLM XLM-large\"); section 4.5"),
    Param("teacher", "any", None, "NLI classifier choosing among candidates (folder or Hub id; e.g. `debiased-nli "
          "train` output; the paper's is BERT-base trained on the original data), or an object with label_probs()",
          required=True),
    Param("filler", "any", None, "an already built filler (MaskFiller or a stand-in) instead of `mlm`", cli=None),
    Param("tau", "float", 20.0, "z threshold (scale it as tau*sqrt(N'/N) for a sample of N' of N rows)",
          low=0, low_open=True, paper=20.0, quote="Table 10 (\"Threshold τ 20\")"),
    Param("families", "str_list", "auto", "feature families, e.g. hypo_only,overlap,unigram (auto: all three)"),
    Param("order", "str", "z", "process the families in decreasing z (the paper's) or in the order given",
          choices=("z", "given"), paper="z", quote="section 4.1 (\"debias them in descending order of z-value\")"),
    Param("overlap_feature", "str", "lex-overlap>0.8", "the overlap feature (QQP: lex-overlap<0.8)"),
    Param("overlap_extractor", "str", None, "extractor that emits it (default: the task's overlap_vN, or "
          "low_overlap_v1 for <)"),
    Param("label_groups", "any", None, "label groups for z (FEVER: SUPPORTS \"REFUTES,NOT ENOUGH INFO\")",
          parse=comma_list, nargs="+", metavar="LABEL,LABEL"),
    Param("ratios", "mapping", None, "masking ratios (default the paper's, Table 10: unigram 0.25, overlap 0.4, "
          "hypo_only 0.4)", cli="--mask-ratio", parse=mapping_parser(float, "--mask-ratio NAME=VALUE,..."),
          metavar="unigram=0.25,overlap=0.4,hypo_only=0.4"),
    Param("prompt_words", "mapping", None, "label -> prompt word (default the paper's, section 3.3.2: entailment "
          "Yes, neutral Maybe, contradiction No)", parse=mapping_parser(str, "--prompt-words NAME=VALUE,..."),
          metavar="entailment=Yes,..."),
    Param("candidates", "int", 8, "fills per masked row", low=1,
          source="project's choice (the paper: \"we generate various candidates\")"),
    Param("max_passes", "int", 20, "walks over a feature's rows before giving up", low=1),
    Param("max_sweeps", "int", 1, "repeat the whole schedule while a feature is above tau", low=1),
    Param("batch_size", "int", 32, "perturbations per batch (MLM and teacher)", low=1),
    Param("mlm_batch_size", "int", 32, "rows per forward pass of the masked LM", low=1),
    Param("mlm_max_length", "int", 256, "max tokens of a masked-LM input", low=1),
    Param("teacher_batch_size", "int", 64, "rows per forward pass of the teacher", low=1),
    Param("teacher_max_length", "int", 128, "max tokens of a teacher input", low=1),
    Param("engine", "str", "auto", "forward passes of the masked LM and the teacher: auto (packed, i.e. no padding "
          "and the last layer only where it is read, for BERT models; padded for others), bucketed (exact-length "
          "groups, any model) or padded (the straightforward reference); the same results up to float rounding",
          choices=("auto", "packed", "bucketed", "padded")),
    Param("dtype", "str", "float32", "arithmetic of the masked LM and the teacher: float32 (the models' own) or "
          "bfloat16 (matrix products in bfloat16 under autocast: about twice as fast on CPUs with AVX512-BF16/AMX "
          "and on GPUs, several times slower on CPUs without them; a near-tied choice or a sampled fill can differ "
          "from float32's)", choices=("float32", "bfloat16")),
    Param("hypo_only_folds", "int", 5, "folds of the out-of-fold hypothesis-only model", low=2),
    Param("seed", "seed", 0, "seed of the walk order, the masking and the fills' sampling"),
    Param("work_dir", "str", None, "the run's checkpoint folder (a build: in the cache)", cli=None),
    Param("checkpoint_every", "int", 256, "operations between checkpoints", low=1),
    Param("examples", "int", 20, "operations shown as examples in the report", low=0),
    Param("progress", "bool", True, "progress bars", flag="off"),
])
"""PDD's parameters (the defaults of :func:`.step.pdd_step`)."""
