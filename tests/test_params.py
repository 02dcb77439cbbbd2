"""A step's parameters, declared once (utils/params.py): the build checks a recipe's values against the
declaration before any work, the step fills its defaults from it, and the command line's options are made
from it."""
from __future__ import annotations

import pytest

from debiased_nli.cli import build_parser
from debiased_nli.release.recipe import load_recipe
from debiased_nli.release.step_registry import get_step, known_steps
from debiased_nli.utils.errors import ConfigError
from debiased_nli.utils.params import NOT_GIVEN, Param, Params

DEMO = {"task": "demo"}


def test_a_value_of_the_wrong_type_names_the_step_the_key_and_the_value():
    with pytest.raises(ConfigError, match=r"filters\[0\] \(aflite\): `tau` must be a number > 0 and <= 1, got 1.5"):
        load_recipe({**DEMO, "filters": [{"step": "aflite", "tau": 1.5}]})
    with pytest.raises(ConfigError, match=r"`warmup_lr` must be a number.*got '1e-5' \(str\).*write 1.0e-5"):
        load_recipe({**DEMO, "filters": [{"step": "aflite", "warmup_lr": "1e-5"}]})
    with pytest.raises(ConfigError, match=r"new_rows\[0\] \(ibadr_rows\): `seed` must be an integer from 0"):
        load_recipe({**DEMO, "new_rows": [{"step": "ibadr_rows", "seed": -1}]})
    with pytest.raises(ConfigError, match="`order` must be one of 'z', 'given', got 'zz'"):
        load_recipe({**DEMO, "filters": [{"step": "pdd", "order": "zz"}]})


def test_an_unknown_key_of_a_step_is_refused_when_the_recipe_is_read_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown PDD parameter\(s\) \['taus'\].*Did you mean 'tau'"):
        load_recipe({**DEMO, "filters": [{"step": "pdd", "config": "pdd", "taus": 3}]})
    with pytest.raises(ConfigError, match=r"unknown IBADR parameter\(s\) \['epsilonn'\].*Did you mean 'epsilon'"):
        load_recipe({**DEMO, "new_rows": [{"step": "ibadr_rows", "epsilonn": 0.9}]})


def test_merge_fills_the_defaults_and_treats_none_as_not_given():
    params = Params("toy", [Param("a", "int", 3, low=1), Param("b", "str", None, required=True, help="the b")])
    assert params.merge({"a": None, "b": "x"}) == {"a": 3, "b": "x"}
    with pytest.raises(ConfigError, match="the toy step needs `b`: the b"):
        params.merge({"a": 2})
    assert params.sources({"a"}) == {"a": "set for this run", "b": "project's choice"}


def test_the_paper_s_values_carry_their_words():
    from debiased_nli.methods.aflite.params import PARAMS as AFLITE
    from debiased_nli.methods.ibadr.params import PARAMS as IBADR
    from debiased_nli.methods.pdd.params import PARAMS as PDD

    assert AFLITE["warmup_lr"].origin() == 'paper A.4 ("a learning rate of 1e-05")'
    assert AFLITE["tau"].paper is NOT_GIVEN and AFLITE["tau"].origin().startswith("project's choice")
    assert PDD["tau"].paper == 20.0 and "Threshold τ 20" in PDD["tau"].quote
    assert IBADR.paper_values()["samples_per_iter"] == 200_000
    for declared in (AFLITE, PDD, IBADR):  # every quote is the paper's text, found in papers/
        for p in declared:
            if p.paper is not NOT_GIVEN:
                assert p.quote, p.name


@pytest.mark.parametrize("command,module", [("aflite", "aflite"), ("pdd", "pdd"), ("ibadr", "ibadr")])
def test_every_declared_parameter_with_an_option_is_an_option_of_the_command(command, module):
    import importlib

    declared = importlib.import_module(f"debiased_nli.methods.{module}.params").PARAMS
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices[command]
    options = {o for a in sub._actions for o in a.option_strings}
    missing = [p.option for p in declared if p.option is not None and p.option not in options]
    assert missing == []


def test_the_built_in_steps_declare_their_parameters_and_the_seed_route():
    for kind, names in known_steps().items():
        for name in names:
            step = get_step(kind, name)
            assert step.declared() is not None, f"{kind} step {name!r} declares no parameters"
    # the seed: one route, params["seed"], for every step that declares one
    assert get_step("source", "ibadr_rows").takes_seed() and get_step("filter", "ibadr").takes_seed()
    assert get_step("filter", "aflite").takes_seed() and not get_step("source", "files").takes_seed()
