"""Build snli's aflite and pdd profiles with tiny models (as tests/test_profiles.py does) into argv[1]."""
import copy
import sys
from pathlib import Path

import datasets
import torch
from transformers import BertConfig, BertModel

from debiased_nli.data.tasks import get_task
from debiased_nli.release.recipe import build, load_recipe
from pdd_helpers import tiny_classifier, tiny_mlm, tiny_tokenizer

out = Path(sys.argv[1])
root = Path(__file__).resolve().parents[1] if (Path(__file__).resolve().parents[1] / "builders").is_dir() else Path.cwd()
task = get_task("snli")
rows = datasets.load_dataset("parquet", data_files="/work/shared/data/snli/train_sample.parquet", split="train")
rows = rows.shuffle(seed=0).select(range(60))
models = Path("/tmp/bi47b_tiny_models")  # one path for every run: the steps record their models by path
if not (models / "classifier" / "config.json").is_file():  # built once: AFLite's cache key reads the files' times
    models.mkdir(parents=True, exist_ok=True)
    rows.to_parquet(str(models / "snli.parquet"))
    tok = tiny_tokenizer([str(t) for c in ("premise", "hypothesis") for t in rows[c]])
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=256)).save_pretrained(models / "encoder")
    tiny_mlm(tok).save_pretrained(models / "mlm")
    tiny_classifier(tok, labels=task.labels).save_pretrained(models / "classifier")
    for n in ("encoder", "mlm", "classifier"):
        tok.save_pretrained(models / n)
for profile in ("aflite", "pdd"):
    rec = copy.deepcopy(load_recipe(Path.cwd() / "builders" / "snli.yaml", profile))
    for spec in rec["filters"]:
        if spec["step"] == "aflite":
            spec.update(encoder=str(models / "encoder"), warmup_epochs=1, warmup_batch_size=8, max_length=32, m=4,
                        target_n=30, progress=False)
        else:
            spec.update(mlm=str(models / "mlm"), teacher=str(models / "classifier"), tau=3.0, candidates=2,
                        max_passes=1, hypo_only_folds=2, progress=False)
    rec["features"].update(folds=2)
    rec["z_filter"].update(batch_size=16)
    build(rec, out / profile, data_files={"train": str(models / "snli.parquet")}, progress=False)
    print(profile, "built")
