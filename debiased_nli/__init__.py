"""debiased-nli: build debiased versions of NLU datasets and publish them on the Hugging Face Hub.

The Python API (:mod:`debiased_nli.api`) is importable from here: ``debiased_nli.build``, ``push``, ``diff``,
``audit``, ``train``, ``evaluate``, ``compare``, their result classes and their options classes. They are loaded on first use, so that
``import debiased_nli`` stays fast and imports neither torch nor the Hugging Face libraries.
"""
__version__ = "0.1.0"

_API = ("build", "push", "diff", "audit", "train", "evaluate", "compare", "AuditResult", "PushResult",
        "TrainOutcome", "EvaluateOutcome", "CompareOutcome", "BuildOptions", "AuditOptions", "TrainOptions",
        "EvaluateOptions", "CompareOptions")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'debiased_nli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
