"""The steps a recipe runs, each declared once here: its name, its kind, its function, what it needs from
the build, its card section and how the rows it drops are written.

    source step   function(task, params, ctx) -> (new rows, dropped, report)   rows for D_G (``new_rows``)
    filter step   function(ds, task, params, ctx) -> (kept, dropped, report)    one extra config (``filters``)

``ctx`` holds exactly the keys the step declares in ``needs`` (see :data:`CONTEXT`), nothing else. A step
never writes the rows it drops: it returns them with their reason column, and the build writes them to
``rejected/<config>/`` in the columns its :class:`Rejects` declares, beside the z-filter's (as datatrove's
filters hand theirs to an exclusion writer); a source step's dropped rows (e.g. the generator's confidence
filter's, with M's confidence) are recorded beside its new rows in ``decisions/new_rows/`` (``release.decisions``). Its card section is the markdown its declared renderer makes
of its report. A function is named by ``"module:attr"`` and imported only when a recipe runs it: the
methods import heavy libraries, and they never import this stage.

A plugin declares its step with :func:`declare`, or with the decorators::

    @register_filter_step("my_filter", needs=("seed",), card_section=render_my_filter_md,
                          rejects=Rejects(extra=("score",)))
    def my_filter(ds, task, params, ctx):
        return kept, dropped_with_a_reason_column, report
"""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from ..utils.errors import ConfigError, did_you_mean, excerpt
from ..utils.params import Param, Params

KINDS = ("source", "filter")
CONTEXT = {
    "recipe": "the defaults-merged recipe (its `data` names the effective D0 files)",
    "seed": "the build's seed",
    "sources": "a list: append the provenance of every input the step reads (the manifest's `inputs`)",
    "set_aside": "a list: append (input name, rows set aside on loading it); written to "
                 "rejected/set_aside_on_load.parquet",
}
"""What a step may ask the build for, and what it gets."""


class StepResult(NamedTuple):
    """What a step returns (a plain 3-tuple in this order is the same)."""

    rows: Any                      # source step: its new rows; filter step: its config's train split
    rejected: Any = None           # the rows it dropped, with their reason column (filter steps)
    report: dict | None = None     # recorded in the manifest's stage (filter steps) and rendered into the card


@dataclasses.dataclass(frozen=True)
class Rejects:
    """How a filter step's dropped rows are written to ``rejected/<config>/train-*.parquet``: the canonical
    columns, then ``reason`` (the column that says why; every dropped row has it), then those of ``extra``
    the rows have."""

    reason: str = "reason"
    extra: tuple[str, ...] = ()

    def table(self, rows, step: str):
        """``rows`` as the release writes them (None or no rows: nothing to write)."""
        from .configs import canonical_only

        if rows is None or not len(rows):
            return rows
        if self.reason not in rows.column_names:
            raise ConfigError(f"step {step!r} dropped {len(rows):,} rows without their reason: they have no "
                              f"{self.reason!r} column (columns: {rows.column_names}); every dropped row says why")
        return canonical_only(rows, [self.reason] + [c for c in self.extra if c in rows.column_names])


@dataclasses.dataclass(frozen=True)
class Step:
    """One recipe step. ``function`` and ``card_section``: a callable or ``"module:attr"``, imported when
    used. ``needs``: the keys of :data:`CONTEXT` the function gets in its ``ctx``. ``card_section``: the
    report -> markdown of the step's section in the card (filter steps; None: no section). ``rejects``:
    how the rows it drops are written (filter steps; a source step drops none into the release)."""

    name: str
    kind: str
    function: "str | Callable"
    needs: tuple[str, ...] = ()
    card_section: "str | Callable | None" = None
    rejects: Rejects | None = None
    params: "str | Params | None" = None

    def declared(self) -> "Params | None":
        """The step's parameters as it declares them (:class:`~debiased_nli.utils.params.Params`; None: not
        declared, any key is passed on)."""
        return None if self.params is None else _resolve(self.params)

    def takes_seed(self) -> bool:
        """Whether the build hands the step its seed as ``params["seed"]``: every step that declares a ``seed``
        (and, as before declarations, every filter step that declares none)."""
        declared = self.declared()
        return "seed" in declared if declared is not None else self.kind == "filter"

    def check_params(self, params: Mapping[str, Any], where: str) -> None:
        """The recipe's values for this step against its declaration: an unknown key gets "did you mean", a
        value of the wrong type is named with its key (nothing is checked for a step that declares nothing)."""
        declared = self.declared()
        if declared is not None:
            declared.check(params, where)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"step {self.name!r}: kind must be one of {KINDS}, not {self.kind!r}")
        object.__setattr__(self, "needs", tuple(self.needs))
        unknown = [k for k in self.needs if k not in CONTEXT]
        if unknown:
            raise ConfigError(f"step {self.name!r} needs {unknown[0]!r}, which the build does not give."
                              f"{did_you_mean(unknown[0], list(CONTEXT))} It gives: {list(CONTEXT)}")
        if self.kind == "source" and (self.rejects is not None or self.card_section is not None):
            raise ConfigError(f"source step {self.name!r}: only a filter step (one config) has rejected rows and "
                              f"a card section")
        if self.kind == "filter" and self.rejects is None:
            object.__setattr__(self, "rejects", Rejects())

    def run(self, *args, context: Mapping[str, Any]) -> StepResult:
        """Call the function with ``args`` and a ``ctx`` of exactly the keys it needs."""
        out = _resolve(self.function)(*args, {key: context[key] for key in self.needs})
        if self.kind == "source" and not isinstance(out, tuple):
            out = (out,)  # a source step may return its new rows alone
        result = StepResult(*out)
        if self.kind == "source" and result.rejected is not None and len(result.rejected) and \
                not {"reason", "rejected_by"} & set(getattr(result.rejected, "column_names", ())):
            # they are recorded beside the new rows (decisions/new_rows/..., release.decisions): each says why
            raise ConfigError(f"source step {self.name!r} dropped {len(result.rejected):,} rows without their reason "
                              f"(a 'reason' or 'rejected_by' column; columns: {result.rejected.column_names})")
        return result

    def section(self, report) -> str | None:
        """The step's markdown section of the card, from its report (None without a renderer)."""
        return None if self.card_section is None else _resolve(self.card_section)(report)


def _resolve(ref):
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


# (kind, name) -> step; the built-in steps are declared at the bottom of this module
_STEPS: dict[tuple[str, str], Step] = {}


def declare(step: Step) -> Step:
    """Add ``step`` to the registry (a step of the same kind and name is replaced)."""
    _STEPS[(step.kind, step.name)] = step
    return step


def get_step(kind: str, name: str) -> Step:
    """The declared step (its function is not imported), or a :class:`ConfigError` with the known names."""
    if (kind, name) not in _STEPS:
        known = known_steps()[kind]
        raise ConfigError(f"unknown {kind} step {excerpt(name)}.{did_you_mean(name, known)} Known {kind} steps: {known}")
    return _STEPS[(kind, name)]


def known_steps() -> dict[str, list[str]]:
    """The declared step names by kind (``source``: new rows, ``filter``: extra configs), e.g. for ``--help``."""
    return {kind: sorted(name for k, name in _STEPS if k == kind) for kind in KINDS}


def register_source_step(name: str, *, needs=tuple(CONTEXT), params=None):
    """Decorator: declare ``function(task, params, ctx)`` (new rows, or ``(rows, None, report)``) as the
    source step ``name``; by default its ``ctx`` has every key of :data:`CONTEXT`."""
    def wrap(fn):
        declare(Step(name, "source", fn, needs=needs, params=params))
        return fn
    return wrap


def register_filter_step(name: str, *, needs=tuple(CONTEXT), card_section=None, rejects: Rejects | None = None,
                         params=None):
    """Decorator: declare ``function(ds, task, params, ctx) -> (kept, dropped, report)`` as the filter
    step ``name``; by default its ``ctx`` has every key of :data:`CONTEXT` and its dropped rows keep a
    ``reason`` column."""
    def wrap(fn):
        declare(Step(name, "filter", fn, needs=needs, card_section=card_section, rejects=rejects, params=params))
        return fn
    return wrap


FILES_PARAMS = Params("files", [
    Param("data_files", "str_list", None, "the files of new rows (the task's columns or the canonical ones)",
          required=True),
    Param("origin", "str", "generated", "the rows' `origin`"),
    Param("method", "str", None, "the rows' `method` (default: files:<the first file's name>)"),
    Param("on_invalid", "str", "error", "bad rows: stop with an error naming the row, or set them aside",
          choices=("error", "set_aside")),
])


def files_source(task, params: Mapping[str, Any], ctx: Mapping[str, Any]):
    """New rows (e.g. generated elsewhere) from local files in the task's schema or the canonical one."""
    from ..data.loading import content_uids, load_task

    p = FILES_PARAMS.merge(params, "the `files` step")
    files, origin = p["data_files"], p["origin"]
    method = p["method"] or f"files:{Path(str(files if isinstance(files, str) else files[0])).name}"
    loaded = load_task(task, "train", data_files={"train": files}, on_invalid=p["on_invalid"])
    ds = loaded.dataset
    # new rows are named by their content, as new_rows() names them (see the card's column table);
    # a chunk of rows at a time (in worker processes for large inputs), so no Python string outlives its chunk
    import datasets
    import pyarrow as pa
    from datasets.fingerprint import Hasher

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    if ds._indices is not None:
        table = ds.with_format("arrow")[:]
    uids = content_uids(table.select(["premise", "hypothesis", "label"]), task.labels, prefix=f"{method}:",
                        num_proc="auto")
    n = table.num_rows
    out = pa.table({"premise": table.column("premise"), "hypothesis": table.column("hypothesis"),
                    "label": table.column("label"), "uid": uids,
                    "origin": pa.repeat(pa.scalar(origin, pa.string()), n),
                    "method": pa.repeat(pa.scalar(method, pa.string()), n)})
    ds = datasets.Dataset(out.cast(ds.features.arrow_schema), info=ds.info.copy(),
                          fingerprint=Hasher.hash([ds._fingerprint, "files_source", origin, method]))
    ctx["sources"].append(loaded.source)
    ctx["set_aside"].append((f"new_rows:{method}", loaded.set_aside))
    return ds


GENERATOR_PARAMS = Params("generator", [
    Param("generator", "str", None, "an already trained G (skips `train`)"),
    Param("train", "mapping", None, "train G: the parameters of `debiased-nli train-generator` (out, model, lr, ...)"),
    Param("debias", "mapping", None, "fine-tune G* on Z(D0) with unlikelihood on Z-(D0) (out, alpha, ...)"),
    Param("generate", "mapping", None, "sample: the parameters of `debiased-nli generate` (out, num_samples, ...)",
          required=True),
    Param("train_m", "mapping", None, "train the confidence model M on D0 (out, model, dev_files, epochs, ...); "
          "the filter then scores with it"),
    Param("confidence", "mapping", None, "confidence-filter the samples (model, tau, tau_rule, ...)"),
    Param("data_files", "any", None, "D0's files (default: the recipe's data)"),
    Param("seed", "seed", 0, "the seed of G*'s Z(D0) (the build's seed unless set: the Z(D0) of the release)"),
])
"""The generator step's parameters (the pipeline of Wu et al. 2022: each part's own values are checked by that
part, methods/generation). Like every step that declares a ``seed``, it gets the build's seed in ``params``."""

_METHODS = "debiased_nli.methods"
for _step in (
    Step("files", "source", files_source, needs=("sources", "set_aside"), params=FILES_PARAMS),
    Step("generator", "source", f"{_METHODS}.generation.step:generator_source", needs=("recipe",),
         params=GENERATOR_PARAMS),
    Step("ibadr_rows", "source", f"{_METHODS}.ibadr.step:ibadr_rows", needs=("recipe",),
         params=f"{_METHODS}.ibadr.params:PARAMS"),
    Step("aflite", "filter", f"{_METHODS}.aflite.step:aflite_step",
         card_section=f"{_METHODS}.aflite.report:render_aflite_md",
         rejects=Rejects(extra=("aflite_score", "aflite_round")), params=f"{_METHODS}.aflite.params:PARAMS"),
    Step("pdd", "filter", f"{_METHODS}.pdd.step:pdd_step", card_section=f"{_METHODS}.pdd.step:render_pdd_md",
         rejects=Rejects(extra=("replaced_by", "source_uid", "teacher_confidence")),
         params=f"{_METHODS}.pdd.params:PARAMS"),
    Step("ibadr", "filter", f"{_METHODS}.ibadr.step:ibadr_step", card_section=f"{_METHODS}.ibadr.step:render_ibadr_md",
         rejects=Rejects(extra=("stage",)), params=f"{_METHODS}.ibadr.params:PARAMS"),
):
    declare(_step)
del _step
