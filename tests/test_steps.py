"""The recipe steps' contract (release/step_registry.py): a step is declared once, gets exactly the context it
declares, has its card section found through the registry, and hands its dropped rows, with their reason,
to the build, which alone writes them."""
import importlib
import json
from pathlib import Path

import datasets
import pytest
import yaml

from debiased_nli.data.loading import new_rows
from debiased_nli.release import step_registry
from debiased_nli.release.recipe import build, known_steps, register_filter_step, register_source_step
from debiased_nli.release.step_registry import CONTEXT, Rejects, Step, declare, get_step
from debiased_nli.utils.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DEMO = yaml.safe_load((ROOT / "builders/demo.yaml").read_text())


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """The steps a test declares are gone after it."""
    monkeypatch.setattr(step_registry, "_STEPS", dict(step_registry._STEPS))


def _keep_all(ds, task, params, ctx):
    return ds, None, {"rows": len(ds)}


def test_a_step_gets_exactly_the_context_keys_it_declares(tmp_path):
    seen = {}

    def probe(name):
        def fn(*args):
            seen[name] = args[-1]
            return _keep_all(*args) if len(args) == 4 else new_rows("demo", ["A dog runs."], ["An animal moves."],
                                                                     ["entailment"], origin="generated", method="probe")
        return fn

    declare(Step("probe_seed", "filter", probe("probe_seed"), needs=("seed", "recipe")))
    declare(Step("probe_nothing", "filter", probe("probe_nothing")))
    declare(Step("probe_rows", "source", probe("probe_rows"), needs=("sources",)))
    res = build({**DEMO, "seed": 3, "filters": [{"step": "probe_seed"}, {"step": "probe_nothing"}],
                 "new_rows": [{"step": "probe_rows"}]}, tmp_path / "rel", max_rows=300, progress=False)
    assert set(seen["probe_seed"]) == {"seed", "recipe"} and seen["probe_seed"]["seed"] == 3
    # the build's own, effective recipe (the manifest leaves out the options past the paper while they are off)
    from debiased_nli.release.recipe import _recorded_recipe
    assert _recorded_recipe(seen["probe_seed"]["recipe"]) == res.manifest["recipe"]
    assert seen["probe_seed"]["recipe"]["filters"] is res.manifest["recipe"]["filters"]
    assert seen["probe_nothing"] == {}
    assert set(seen["probe_rows"]) == {"sources"} and seen["probe_rows"]["sources"] is res.manifest["inputs"]
    assert {"probe_seed", "probe_nothing", "z_aug", "seq_z"} <= set(res.configs)
    # what a step may ask for is a closed list, with "did you mean"
    with pytest.raises(ConfigError, match="needs 'seeds'.*Did you mean 'seed'"):
        Step("x", "filter", _keep_all, needs=("seeds",))
    assert set(CONTEXT) == {"recipe", "seed", "sources", "set_aside"}


def describe_the_probe(report):
    return f"# The probe\n\nIt kept {report['rows']} rows.\n"


def render_probe_cards_md(report):  # the name the old lookup would have found: the registry never uses it
    return "# WRONG\n"


def test_a_card_section_is_found_through_the_registry_not_by_name(tmp_path):
    declare(Step("probe_cards", "filter", _keep_all, card_section="test_steps:describe_the_probe"))
    build({**DEMO, "filters": [{"step": "probe_cards"}]}, tmp_path / "rel", max_rows=300, progress=False)
    card = (tmp_path / "rel/README.md").read_text()
    assert "The probe" in card and "It kept 300 rows." in card and "WRONG" not in card
    # the built-in steps declare theirs; AFLite's lives in its report module, not beside the step
    assert get_step("filter", "aflite").card_section == "debiased_nli.methods.aflite.report:render_aflite_md"
    assert not hasattr(importlib.import_module("debiased_nli.methods.aflite.step"), "render_aflite_md")
    assert get_step("filter", "pdd").card_section.endswith(":render_pdd_md")
    assert get_step("filter", "ibadr").card_section.endswith(":render_ibadr_md")


def render_short_md(report):
    return f"# Short hypotheses\n\n{report['dropped']} rows with a hypothesis of {report['max_words']} words or fewer.\n"


def test_a_plugin_step_registered_through_the_public_api_builds_the_demo(tmp_path):
    @register_filter_step("drop_short", needs=("seed",), card_section=render_short_md,
                          rejects=Rejects(extra=("words",)))
    def drop_short(ds, task, params, ctx):
        words = [len(h.split()) for h in ds["hypothesis"]]
        short = [i for i, w in enumerate(words) if w <= params["max_words"]]
        long = [i for i, w in enumerate(words) if w > params["max_words"]]
        dropped = ds.select(short).add_column("words", [words[i] for i in short])
        dropped = dropped.add_column("reason", [f"hypothesis of <= {params['max_words']} words"] * len(short))
        return ds.select(long), dropped, {"dropped": len(short), "max_words": params["max_words"], "seed": ctx["seed"]}

    @register_source_step("two_rows")  # the documented plugin form: (task, params, ctx) -> the new rows alone
    def two_rows(task, params, ctx):
        ctx["sources"].append({"plugin": "two_rows"})
        return new_rows(task, ["A man sleeps.", "A girl sings."], ["A person rests.", "Nobody sings."],
                        ["entailment", "contradiction"], origin="generated", method="two_rows")

    assert "drop_short" in known_steps()["filter"] and "two_rows" in known_steps()["source"]
    out = tmp_path / "rel"
    res = build({**DEMO, "filters": [{"step": "drop_short", "max_words": 4}], "new_rows": [{"step": "two_rows"}]},
                out, max_rows=600, progress=False)
    assert set(res.configs) == {"z_filtered", "z_aug", "par_z", "seq_z", "drop_short"}
    kept = datasets.load_dataset(str(out), "drop_short", split="train")
    dropped = datasets.Dataset.from_parquet(str(next((out / "rejected/drop_short").glob("*.parquet"))))
    assert len(kept) + len(dropped) == 600 and len(dropped) > 0
    # the build writes the dropped rows: the canonical columns, the reason, the declared extra; no feature column
    assert dropped.column_names == ["premise", "hypothesis", "label", "uid", "origin", "method", "reason", "words"]
    assert set(dropped["reason"]) == {"hypothesis of <= 4 words"} and max(dropped["words"]) <= 4
    stage = next(s for s in res.manifest["stages"] if s["stage"] == "drop_short: drop_short")
    assert stage["counts"] == {"kept": len(kept), "removed": len(dropped)} and stage["report"]["seed"] == 0
    assert res.reports["drop_short: drop_short"]["dropped"] == len(dropped)
    assert {"plugin": "two_rows"} in json.loads((out / "manifest.json").read_text())["inputs"]
    card = (out / "README.md").read_text()
    assert f"{len(dropped)} rows with a hypothesis of 4 words or fewer." in card


def test_dropped_rows_without_their_reason_are_refused(tmp_path):
    @register_filter_step("silent_drop", needs=())
    def silent_drop(ds, task, params, ctx):
        return ds.select(range(10, len(ds))), ds.select(range(10)), {}

    with pytest.raises(ConfigError, match="step 'silent_drop' dropped 10 rows without their reason"):
        build({**DEMO, "filters": [{"step": "silent_drop"}]}, tmp_path / "rel", max_rows=300, progress=False)
    assert not (tmp_path / "rel").exists()
    # a source step's rows feed three configs: no rejected/ config and no card section of its own; the rows
    # it drops are recorded beside its new rows (decisions/new_rows/), each with its reason
    with pytest.raises(ConfigError, match="only a filter step"):
        Step("x", "source", _keep_all, rejects=Rejects())
    dropped = datasets.Dataset.from_dict({"premise": ["p"], "hypothesis": ["h"], "label": [0]})
    with pytest.raises(ConfigError, match="source step 'x' dropped 1 rows without their reason"):
        Step("x", "source", lambda task, params, ctx: ([], dropped, {})).run("demo", {}, context={})
    with_reason = dropped.add_column("rejected_by", ["confidence<=0.95"])
    assert Step("x", "source", lambda task, params, ctx: ([], with_reason, {})).run(
        "demo", {}, context={}).rejected is with_reason
