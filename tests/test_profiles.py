"""Every profile of every recipe in builders/ builds end to end, on CPU, with tiny models built from a config
(random weights) and a few rows of the task's data in ../shared/data: the profile's steps as written (two IBADR
steps sharing one run, no seed of their own), with only the models, the run folders and the sizes made tiny."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from debiased_nli.data.tasks import get_task
from debiased_nli.release.recipe import build, load_recipe
from debiased_nli.utils.safe_yaml import read_yaml_input
from test_ibadr_loop import world  # noqa: F401  (the tiny IBADR generator, a module fixture)

ROOT = Path(__file__).resolve().parents[1]
BUILDERS = ROOT / "builders"
ROWS = 36
# D0 for each task: a file of its own data that the tests have
DATA = {"snli": "snli/train_sample.parquet", "mnli": "mnli/dev_matched.parquet",
        "fever": "fever_symmetric/v0.1_full.parquet", "qqp": "qqp/bimpm_dev.parquet", "demo": None}


def _profiles() -> list[tuple[str, str]]:
    out = []
    for path in sorted(BUILDERS.glob("*.yaml")):
        raw = read_yaml_input(path, "recipe") or {}
        if raw.get("new_rows") or raw.get("filters"):  # the recipe itself runs steps (builders/seqz.yaml)
            out.append((path.stem, None))
        out += [(path.stem, name) for name in (raw.get("profiles") or {})]
    return out


PROFILES = _profiles()


def test_the_builders_have_the_profiles_this_test_knows():
    steps = {s["step"] for recipe, profile in PROFILES
             for key in ("new_rows", "filters") for s in load_recipe(BUILDERS / f"{recipe}.yaml", profile)[key]}
    assert {p for _, p in PROFILES} >= {"paper", "ibadr", "pdd", "aflite", "gpu", None}
    assert steps <= set(TINY), f"a profile uses a step this test cannot make tiny: {steps - set(TINY)}"


@pytest.fixture(scope="module")
def models(tmp_path_factory, shared_data, world):
    """Per task: a tiny word-level BERT encoder (AFLite, IBADR's shallow model), masked LM (PDD), classifier with
    the task's labels (PDD's teacher, the confidence model M); one tiny GPT-2 with the real GPT-2 tokenizer that
    ends a text early (Wu et al.'s generator: some samples parse), and the tiny GPT-2 of the IBADR tests that
    writes IBADR's conditional format (test_ibadr_loop.world)."""
    import datasets
    from transformers import BertConfig, BertModel

    from pdd_helpers import tiny_classifier, tiny_mlm, tiny_tokenizer
    from test_generation_sample import eos_generator

    root = tmp_path_factory.mktemp("profile_models")
    out = {"generator": eos_generator(root / "generator"), "ibadr_generator": world["generator"], "data": {}}
    for task_name, rel in DATA.items():
        if rel is None:
            continue
        task = get_task(task_name)
        rows = datasets.load_dataset("parquet", data_files=str(shared_data / rel), split="train")
        rows = rows.shuffle(seed=0).select(range(ROWS))  # a few rows of every label (some files are sorted by label)
        rows.to_parquet(str(root / f"{task_name}.parquet"))
        out["data"][task_name] = str(root / f"{task_name}.parquet")
        texts = [str(t) for col in task.columns.values() if col in rows.column_names and col != task.columns["label"]
                 for t in rows[col]]
        tok = tiny_tokenizer(texts)
        folder = root / task_name
        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=256)).save_pretrained(folder / "encoder")
        tiny_mlm(tok).save_pretrained(folder / "mlm")
        tiny_classifier(tok, labels=task.labels).save_pretrained(folder / "classifier")
        for name in ("encoder", "mlm", "classifier"):
            tok.save_pretrained(folder / name)
        out[task_name] = {name: str(folder / name) for name in ("encoder", "mlm", "classifier")}
    return out


def _tiny_generator(spec, m, run, task):
    # mixed precision: one process's accelerate state is set once (by the first step that ran)
    spec["train"].update(model=m["generator"], out=str(run / "G"), max_steps=1, batch_size=4, lr=1e-9, cpu=True,
                         mixed_precision=None)
    if "debias" in spec:
        spec["debias"].update(out=str(run / "G_star"), max_steps=1, batch_size=4, lr=1e-9, cpu=True, z_batch_size=100,
                              mixed_precision=None)
    # a random model cannot write a whole row: given the premise and the label, about half its samples parse
    spec["generate"].update(out=str(run / "samples"), num_samples=8, num_shards=1, batch_size=4, max_new_tokens=6,
                            condition="premise+label", cpu=True, progress=False)
    spec["confidence"].update(model=m[task]["classifier"], tau=0.0, batch_size=16, progress=False, calibration=None)
    if "train_m" in spec:  # M trained on the few rows, from the tiny classifier
        spec["train_m"].update(model=m[task]["classifier"], out=str(run / "M"), epochs=1, batch_size=8, max_length=32,
                               dev_files=None, cpu=True, progress=False)


def _tiny_ibadr(spec, m, run, task):
    spec.update(out=str(run / "ibadr"), generator=m["ibadr_generator"], shallow_model=m[task]["encoder"],
                confidence_model=m[task]["classifier"], shallow_rows=12, shallow_epochs=1, shallow_max_length=32,
                usm_rows=10, n_iter=1, samples_per_iter=8, gen_epochs_first=1, top_p=0.3, gen_batch_size=4, gen_max_length=64, max_new_tokens=24,
                sample_batch_size=8, shard_size=8, confidence_batch_size=16, epsilon=0.0, cpu=True, progress=False)


def _tiny_pdd(spec, m, run, task):
    spec.update(mlm=m[task]["mlm"], teacher=m[task]["classifier"], tau=3.0, candidates=2, max_passes=1,
                hypo_only_folds=2, progress=False)


def _tiny_aflite(spec, m, run, task):
    spec.update(encoder=m[task]["encoder"], warmup_epochs=1, warmup_batch_size=8, max_length=32, m=4,
                target_n=ROWS // 2, progress=False)


TINY = {"generator": _tiny_generator, "ibadr": _tiny_ibadr, "ibadr_rows": _tiny_ibadr, "pdd": _tiny_pdd,
        "aflite": _tiny_aflite}
"""How each step is made tiny: only models, folders and sizes; never its seed or the values it shares with
another step of the profile."""


@pytest.mark.parametrize("recipe,profile", PROFILES, ids=[f"{r}-{p}" for r, p in PROFILES])
def test_every_profile_builds_end_to_end_with_tiny_models(recipe, profile, models, tmp_path):
    rec = load_recipe(BUILDERS / f"{recipe}.yaml", profile)
    task = rec["task"]
    tiny = copy.deepcopy(rec)
    for key in ("new_rows", "filters"):
        for spec in tiny[key]:
            TINY[spec["step"]](spec, models, tmp_path / "runs", task)
    tiny["features"].update(folds=2)
    tiny["z_filter"].update(batch_size=16)
    res = build(tiny, tmp_path / "release", data_files={"train": models["data"][task]}, progress=False)
    wanted = {s.get("config", s["step"]) for s in rec["filters"]}
    if rec["configs"] != "auto":
        wanted &= set(rec["configs"])
    assert wanted <= set(res.configs), (wanted, res.configs)
    if rec["new_rows"]:
        made = sum(s["counts"]["rows"] for s in res.manifest["stages"] if s["stage"].startswith("new rows"))
        # the tiny IBADR generator learnt the NLI tasks' label words; FEVER's it writes rarely
        assert made > 0 or task == "fever"
        assert {"z_aug", "par_z", "seq_z"} <= set(res.configs) or made == 0
    # every step that takes a seed ran with the build's (the recipe's) seed, the same for steps that share a run
    for stage in res.manifest["stages"]:
        report = stage.get("report") or {}
        seed = (report.get("config") or {}).get("seed")
        if seed is not None:
            assert seed == rec["seed"], stage["stage"]
    assert (tmp_path / "release" / "README.md").is_file()
