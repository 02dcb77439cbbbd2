"""A step's parameters, declared once: name, type, default, the paper's value with its quote, and help.

The build reads a step's declaration to check a recipe's values (an unknown key gets "did you mean", a value
of the wrong type names the step, the key and the value) and the step reads it to fill in its defaults; the
command line makes its options from it (:func:`debiased_nli.cli.commands._common.add_param_options`), and a
report says where each value came from (:meth:`Params.sources`). As datasets' ``BuilderConfig`` and
datatrove's constructor keywords do, the value is written in one place::

    PARAMS = Params("AFLite", [
        Param("tau", "float", 0.75, "predictability threshold", low=0, high=1, low_open=True,
              source="project's choice (the paper gives no value for the early-stopping threshold)"),
        Param("warmup_lr", "float", 1e-5, "warm-up learning rate", low=0, low_open=True,
              paper=1e-5, quote="A.4: \"a learning rate of 1e-05\""),
        ...])
    p = PARAMS.merge(params)            # the defaults, then the values given (None: not given)

The public API's functions take their options the same way, once: as keywords checked against a dataclass
of options (:func:`options_of`), an unknown one refused with the closest name.

This module imports nothing heavy: ``--help`` reads the declarations.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Iterable, Iterator, Mapping

from .errors import ConfigError, did_you_mean, excerpt

KINDS = ("int", "float", "str", "bool", "seed", "str_list", "mapping", "any")
"""What a parameter holds. ``int``/``float`` may carry a range; ``str`` may carry ``choices``; ``seed``: an
integer from 0 to 2**32 - 1; ``str_list``: a string or a list of strings; ``any``: not checked (Python
objects such as an already loaded model, or a value of several shapes that the step checks itself)."""
SEED_LIMIT = 2 ** 32


class _NotGiven:
    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()
"""The paper's value of a parameter the paper does not give."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a step.

    ``paper``/``quote``: the value the paper gives and where it says so, as ``section ("its words")``;
    ``source``: where the default comes from, when the paper gives no value or it is said another way (e.g.
    "project's choice (...)"). ``cli``: the
    command-line option (``"auto"``: ``--name-with-dashes``; None: no option, e.g. for Python objects);
    ``flag``: a bool as a switch, ``"on"`` (``--x`` sets True) or ``"off"`` (``--no-x`` sets False);
    ``parse``: how the option's text becomes the value (default: by ``kind``); ``metavar``, ``nargs``: as
    argparse's; ``required``: a value must be given (checked when the step runs)."""

    name: str
    kind: str
    default: Any = None
    help: str = ""
    paper: Any = NOT_GIVEN
    quote: str = ""
    source: str = ""
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = True
    required: bool = False
    cli: str | None = "auto"
    flag: str | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    nargs: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"parameter {self.name!r}: kind must be one of {KINDS}, not {self.kind!r}")

    @property
    def option(self) -> str | None:
        """The command-line option (None: none)."""
        if self.cli != "auto":
            return self.cli
        name = self.name.replace("_", "-")
        return f"--no-{name}" if self.flag == "off" else f"--{name}"

    def describe(self) -> str:
        """What a value must be, in words (for errors)."""
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        says = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                "seed": f"an integer from 0 to {SEED_LIMIT - 1} (2**32 - 1)", "str_list": "a string or a list of strings",
                "mapping": "a mapping", "any": "any value"}[self.kind]
        if self.kind in ("int", "float") and (self.low is not None or self.high is not None):
            parts = []
            if self.low is not None:
                parts.append(f"{'>' if self.low_open else '>='} {self.low}")
            if self.high is not None:
                parts.append(f"{'<' if self.high_open else '<='} {self.high}")
            says += " " + " and ".join(parts)
        return says + (" or null" if self.nullable and self.default is None and self.kind != "any" else "")

    def ok(self, value: Any) -> bool:
        """Whether ``value`` fits this parameter (None fits a parameter that may be null)."""
        if value is None:
            return self.nullable
        if self.choices:
            return value in self.choices
        k = self.kind
        if k == "any":
            return True
        if k == "bool":
            return isinstance(value, bool)
        if k in ("int", "seed"):
            if not isinstance(value, int) or isinstance(value, bool):
                return False
            if k == "seed":
                return 0 <= value < SEED_LIMIT
        elif k == "float":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
                return False
        elif k == "str":
            return isinstance(value, str)
        elif k == "str_list":
            return isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)
        elif k == "mapping":
            return isinstance(value, Mapping)
        if self.low is not None and (value < self.low or self.low_open and value == self.low):
            return False
        if self.high is not None and (value > self.high or self.high_open and value == self.high):
            return False
        return True

    def check(self, value: Any, where: str) -> None:
        """A :class:`ConfigError` naming ``where``, the key, the value and the expected type, unless it fits."""
        if not self.ok(value):
            hint = ""
            if self.kind == "float" and isinstance(value, str):
                hint = " (YAML reads 1e-5 as a string: write 1.0e-5)"
            raise ConfigError(f"{where}: `{self.name}` must be {self.describe()}, got {excerpt(value)} "
                              f"({type(value).__name__}){hint}")

    def origin(self) -> str:
        """Where the default comes from: the declared ``source``, else the paper's words (``paper <quote>``),
        else "project's choice"."""
        if self.source:
            return self.source
        if self.paper is not NOT_GIVEN:
            return f"paper {self.quote}" if self.quote else "paper"
        return "project's choice"


class Params:
    """The declared parameters of one step (``what``: its name in errors, e.g. "AFLite"), in order."""

    def __init__(self, what: str, params: Iterable[Param]):
        self.what = what
        self._by_name: dict[str, Param] = {}
        for p in params:
            if p.name in self._by_name:
                raise ConfigError(f"{what}: parameter {p.name!r} is declared twice")
            self._by_name[p.name] = p

    def __iter__(self) -> Iterator[Param]:
        return iter(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Param:
        return self._by_name[name]

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self}

    def paper_values(self) -> dict[str, Any]:
        """The values the paper gives, by name."""
        return {p.name: p.paper for p in self if p.paper is not NOT_GIVEN}

    def check(self, given: Mapping[str, Any] | None, where: str | None = None) -> None:
        """Every key of ``given`` is declared (else "did you mean") and every value fits its declaration."""
        where = where or f"the {self.what} step"
        given = given or {}
        unknown = sorted(str(k) for k in given if k not in self._by_name)
        if unknown:
            raise ConfigError(f"{where}: unknown {self.what} parameter(s) {unknown}."
                              f"{did_you_mean(unknown[0], self.names())} Known: {sorted(self.names())}")
        for key, value in given.items():
            self._by_name[key].check(value, where)

    def merge(self, given: Mapping[str, Any] | None, where: str | None = None) -> dict[str, Any]:
        """The defaults, then the values of ``given`` (checked; None means "not given")."""
        self.check(given, where)
        out = self.defaults()
        out.update({k: v for k, v in (given or {}).items() if v is not None})
        missing = [p.name for p in self if p.required and out.get(p.name) in (None, "")]
        if missing:
            p = self._by_name[missing[0]]
            raise ConfigError(f"{where or f'the {self.what} step'} needs `{p.name}`: {p.help}")
        return out

    def sources(self, given: Iterable[str], names: Iterable[str] | None = None) -> dict[str, str]:
        """Where each value of a run comes from: "set for this run" for those in ``given``, else its declaration's
        origin (the paper's words or the project's choice)."""
        given = set(given)
        return {n: "set for this run" if n in given else self._by_name[n].origin()
                for n in (names if names is not None else self.names())}


def mapping_parser(cast: Callable[[str], Any] = str, what: str = "NAME=VALUE,...") -> Callable[[str], dict]:
    """A command-line parser for ``NAME=VALUE,NAME=VALUE`` (e.g. ``unigram=0.25,overlap=0.4``)."""
    def parse(text: str) -> dict:
        out = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"expected {what}, got {item!r}")
            out[key.strip()] = cast(value.strip())
        return out
    parse.__name__ = "mapping"
    return parse


def comma_list(text: str) -> list[str]:
    """A command-line parser for ``A,B,C``."""
    return [t for t in text.split(",") if t]


class UnknownOptionError(ConfigError, TypeError):
    """A keyword that names no option of a function (a :class:`TypeError` too, as Python's own for an
    unexpected keyword argument)."""


def options_of(cls: type, base: Any, given: Mapping[str, Any], where: str) -> Any:
    """The options of a call as an instance of the dataclass ``cls``: ``base`` (an instance of ``cls``, or None
    for the defaults) with the keyword values ``given`` in place of its fields. A keyword that is no field of
    ``cls`` is an :class:`UnknownOptionError` naming it, the closest field, and ``where`` (e.g. ``"train()"``)::

        def train(task, *, model, out, options: TrainOptions | None = None, **values):
            opts = options_of(TrainOptions, options, values, "train()")
    """
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in given if k not in names]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), names, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownOptionError(f"{where} got an unknown option {unknown[0]!r}.{hint} "
                                 f"Its options are the fields of {cls.__name__}.")
    if base is None:
        return cls(**given)
    if not isinstance(base, cls):
        raise ConfigError(f"{where}: `options` must be a {cls.__name__}, got {type(base).__name__}")
    return dataclasses.replace(base, **given)
