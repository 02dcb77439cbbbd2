"""The Python API: one function per command, returning a result object instead of printing.

    import debiased_nli as dn

    release = dn.build("demo", "out/debiased-demo")                       # debiased-nli build
    dn.push(release.out_dir, "org/debiased-demo", revision="v1.0")       # debiased-nli push
    d = dn.diff("out/old", release.out_dir)                               # debiased-nli diff
    a = dn.audit("snli", data_files="train.parquet", out="audit/")        # debiased-nli audit
    t = dn.train("snli", model="bert-base-uncased", release=str(release.out_dir), config="z_filtered",
                 out="runs/zf", push_to="org/bert-snli-zf")               # debiased-nli train
    e = dn.evaluate("runs/zf", suite="nli", out="eval/zf", push_to="org/bert-snli-zf")  # debiased-nli evaluate
    c = dn.compare("plan.yaml", "report")                                 # debiased-nli compare

Each takes its few essential arguments by name and every other option as a keyword, or as one object of its
options class (:mod:`.options`: ``BuildOptions``, ``AuditOptions``, ``TrainOptions``, ``EvaluateOptions``,
``CompareOptions``), or both; an unknown keyword is refused with the closest name.

Each command of the CLI is a thin wrapper over its function here: the same checks before any work (never a file
of the user's replaced, every Hub call within its deadline), the same files, and a bad input raises
:class:`debiased_nli.utils.errors.ConfigError` with the one line the command prints. ``import debiased_nli`` stays
light: this package is imported on first use of one of its names, and torch only when a function needs it.
"""
from __future__ import annotations

from .classifiers import CompareOutcome, EvaluateOutcome, TrainOutcome, compare, evaluate, train
from .options import AuditOptions, BuildOptions, CompareOptions, EvaluateOptions, TrainOptions
from .releases import AuditResult, PushResult, audit, build, diff, push

__all__ = ["build", "push", "diff", "audit", "train", "evaluate", "compare", "AuditResult", "PushResult",
           "TrainOutcome", "EvaluateOutcome", "CompareOutcome", "BuildOptions", "AuditOptions", "TrainOptions",
           "EvaluateOptions", "CompareOptions"]
