"""The shallow model theta_s and the bias degree (Wang et al. 2023, section 2.1).

"we randomly select some training samples to train a shallow model ... we directly use the model
confidence p(y_i | x_i; theta_s) to quantify the bias degree of (x_i, y_i)". theta_s is any sequence
classifier fine-tuned with :func:`debiased_nli.models.training.train_classifier` on a seeded random subset
(``max_train_rows``; 2K rows for SNLI/MNLI, 0.5K for FEVER, 3 epochs, lr 5e-5, section 3.1), and
beta_i is its softmax probability of the gold label (:func:`debiased_nli.models.classifier.predict_probabilities`,
columns mapped onto the task's labels by name).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from ...data.loading import labels_of
from ...data.tasks import TaskSpec
from ...models.classifier import LoadedClassifier, load_classifier, predict_probabilities


@dataclasses.dataclass(frozen=True)
class ShallowTraining:
    """How theta_s is fine-tuned: on ``rows`` random rows of the pool (drawn with ``seed``, also the training
    seed), for ``epochs`` at learning rate ``lr``, batches of ``batch_size`` pairs of ``max_length`` tokens, a
    checkpoint every ``save_steps`` steps (the paper's values: :mod:`.params`)."""

    rows: int
    epochs: float
    lr: float
    seed: int
    batch_size: int = 16
    max_length: int = 128
    save_steps: int = 50


def train_shallow(pool, task: TaskSpec, model: str, out_dir: "str | Path", training: ShallowTraining, *,
                  progress: bool = True) -> dict:
    """Fine-tune theta_s from ``model`` on ``training.rows`` random rows of ``pool`` into ``out_dir``.

    No dev set: the paper trains a fixed number of epochs. A checkpoint every ``training.save_steps`` steps;
    a rerun resumes from the last one, and a folder with a finished model (``debiased_nli_train.json``)
    is reused as it is.
    """
    from ...models.training import TRAIN_CONFIG_FILE, TrainConfig, train_classifier

    out = Path(out_dir)
    done = out / TRAIN_CONFIG_FILE
    if done.exists():
        return json.loads(done.read_text())["result"]
    t = training
    cfg = TrainConfig(model=model, output_dir=str(out), learning_rate=t.lr, batch_size=t.batch_size,
                      max_length=t.max_length, epochs=float(t.epochs), seed=t.seed, data_seed=t.seed,
                      max_train_rows=t.rows, save_total_limit=1, eval_steps=t.save_steps, progress=progress)
    return train_classifier(cfg, task, pool).to_dict()


def gold_label_probabilities(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """beta_i = p(y_i | x_i): the probability of each row's own label."""
    labels = np.asarray(labels, dtype=np.int64)
    return probs[np.arange(len(labels)), labels] if len(labels) else np.zeros(0)


def bias_degree(ds, model: "str | LoadedClassifier | Any", task: TaskSpec, *, batch_size: int = 64,
                max_length: int = 128, progress: bool = True, tokenizer=None) -> np.ndarray:
    """beta of every row of ``ds`` under theta_s (a folder, a :class:`LoadedClassifier`, or a loaded model
    with ``tokenizer``), scored in batches of rows in input order."""
    clf = load_classifier(model, tokenizer=tokenizer)
    probs = predict_probabilities(clf, ds["premise"], ds["hypothesis"], batch_size=batch_size, max_length=max_length,
                                  order=range(len(ds)), labels=task.labels,
                                  progress=progress and "bias degree")
    return gold_label_probabilities(probs, labels_of(ds))
