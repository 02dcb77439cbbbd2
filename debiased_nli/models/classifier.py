"""One sequence classifier: how it is loaded and how it scores pairs of texts.

:func:`load_classifier` gives a :class:`LoadedClassifier` (model, tokenizer, the names of its outputs, the
training record of a folder written by ``debiased-nli train``) from a folder, a Hub id or an already loaded
model; :func:`predict_probabilities` is the one prediction loop: ``softmax(f(premise, hypothesis))`` for
every row, in batches. Every user goes through these two: evaluation on the challenge sets, confidence
filtering, IBADR's bias degree, PDD's teacher (its ``padded`` engine) and the hypothesis-only classifier.

The loop tokenizes every row once (no padding) and pads each batch to its own longest row. Which rows
share a batch is the caller's choice, since it moves the probabilities in their last bits (a batch's
shape changes the order of the floating-point sums): by token length, under a token budget
(:func:`length_batches`, the default: little compute goes to padding), or in a given order cut into
batches of ``batch_size`` rows (``order=range(n)``: the input order). The same rows in the same batches
give the same probabilities to the last bit as padding each batch with the tokenizer would.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..utils.errors import ConfigError

logger = logging.getLogger(__name__)

TRAIN_RECORD_FILE = "debiased_nli_train.json"  # written by debiased_nli.models.training next to the weights


@dataclasses.dataclass
class LoadedClassifier:
    path: str                    # the folder or Hub id; for a model given loaded, its class name
    model: Any
    tokenizer: Any
    id2label: dict[int, str]     # the name of each output (``label_order`` applied)
    train_record: dict | None    # debiased_nli_train.json of a folder written by `debiased-nli train`

    @property
    def device(self):
        return next(self.model.parameters()).device


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def output_names(config_id2label: dict | None, label_order: Sequence[str] | None, path: str) -> dict[int, str]:
    """The name of each output of a classifier with ``config.id2label``; ``label_order`` names them instead.

    A head whose outputs are named ``LABEL_0..K`` is taken in the task's order, with a warning."""
    id2label = {int(i): str(l) for i, l in (config_id2label or {}).items()}
    if label_order is not None:
        if len(label_order) != len(id2label):
            raise ConfigError(f"--label-order names {len(label_order)} labels but {path} has {len(id2label)} outputs")
        return dict(enumerate(label_order))
    if id2label and all(l.upper().startswith("LABEL_") for l in id2label.values()):
        logger.warning("%s names its outputs %s; taking them to be the task's labels in the task's order. If "
                       "they are not, pass --label-order NAME,NAME,... (the label of each output, in order).",
                       path, ", ".join(id2label[i] for i in sorted(id2label)))
    return id2label


def read_train_record(folder: "str | Path") -> dict | None:
    """The training record of a folder written by ``debiased-nli train``; None where there is none."""
    path = Path(folder) / TRAIN_RECORD_FILE
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except ValueError as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from err


def load_classifier(model: "str | LoadedClassifier | Any", device: str | None = None, *, tokenizer: Any = None,
                    label_order: Sequence[str] | None = None) -> LoadedClassifier:
    """A sequence classifier ready to score (on ``device``, default: cuda if available; in eval mode).

    ``model``: a folder or Hub id (``tokenizer`` optional: read from the same place when not given), an
    ``AutoModelForSequenceClassification`` already loaded (with its ``tokenizer``), or a
    :class:`LoadedClassifier` (returned as it is, moved to ``device`` when one is given).

    A folder or Hub id is refused when its classification head was never trained: ``from_pretrained``
    initialises missing weights at random (an encoder without a head, or a folder saved without them) and
    only logs it, and such a model scores at chance. Its outputs are named by :func:`output_names`.
    """
    if isinstance(model, LoadedClassifier):
        if device is not None:
            model.model.to(device)
        return model
    if not isinstance(model, str):
        if tokenizer is None:
            raise ConfigError("pass the tokenizer together with an already loaded model")
        model.to(device or default_device()).eval()
        return LoadedClassifier(type(model).__name__, model, tokenizer,
                                output_names(model.config.id2label, label_order, type(model).__name__), None)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    path = model
    folder = Path(path)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its load report is checked below, and said in one line
    try:
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        clf, info = AutoModelForSequenceClassification.from_pretrained(path, output_loading_info=True)
    except OSError as err:
        if folder.exists():
            raise ConfigError(f"{path} is not a model folder ({err}); give a folder written by "
                              f"`debiased-nli train`") from err
        raise ConfigError(f"model {path!r}: no such folder, and not a Hub model id that can be reached "
                          f"({type(err).__name__}). Give a folder written by `debiased-nli train` or a Hub id.") from err
    except Exception as err:  # a corrupt weights file, an unknown architecture
        from ..data.loading import root_cause
        raise ConfigError(f"model {path}: cannot load it ({root_cause(err)})") from err
    finally:
        transformers_logging.set_verbosity(verbosity)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ConfigError(f"model {path}: weights missing from the folder ({shown}), so they would be random and "
                          f"the scores meaningless; its classification head was never trained. Evaluate a model "
                          f"fine-tuned with `debiased-nli train`.")
    clf.to(device or default_device()).eval()
    record = read_train_record(folder)
    return LoadedClassifier(path, clf, tok, output_names(clf.config.id2label, label_order, path), record)


def length_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """Row indices in order of length, cut into batches of at most ``batch_size`` rows and (when
    ``max_tokens`` is given) at most ``max_tokens`` padded tokens (rows x the longest row of the batch).

    Sorting by length keeps the padding small; the token budget lets batches of short rows (the
    Dasgupta sets, HANS) be large while batches of long rows (MNLI) stay within a fixed amount of work.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        stop = min(start + batch_size, len(order))
        if max_tokens:  # sorted ascending: the batch's longest row is its last one
            while stop - start > 1 and (stop - start) * lengths[order[stop - 1]] > max_tokens:
                stop = start + max(1, min(stop - start - 1, max_tokens // max(1, int(lengths[order[stop - 1]]))))
        batches.append(order[start:stop])
        start = stop
    return batches


def predict_probabilities(clf: LoadedClassifier, premises: "Sequence[str] | None", hypotheses: Sequence[str], *,
                          batch_size: int = 64, max_length: int = 128, max_tokens: int | None = None,
                          order: Sequence[int] | None = None, labels: Sequence[str] | None = None,
                          progress: "bool | str" = True, dtype: str = "float32") -> np.ndarray:
    """softmax(f(premise, hypothesis)) for every row, rows x outputs (float32), rows in input order.

    ``premises=None`` scores the hypotheses alone (one segment each). Columns are the model's outputs in
    its order, or, given ``labels`` (the task's label names), those labels in that order (outputs matched
    by name, :func:`debiased_nli.models.labels.map_model_labels`; a model whose names do not match is refused).

    Batches: by default rows in order of token length under ``batch_size`` rows and ``max_tokens`` padded
    tokens (:func:`length_batches`); given ``order`` (row indices), rows in that order cut into batches of
    ``batch_size`` (``range(n)``: the input order). Each batch is padded to its own longest row.
    ``dtype="bfloat16"`` runs the forward passes under bfloat16 autocast (:mod:`debiased_nli.utils.precision`;
    the probabilities stay float32). ``progress``: a progress bar with that label, True for one labelled
    "predict", False for none.
    """
    import torch
    from tqdm.auto import tqdm

    from ..utils.precision import check_dtype, compute_context
    from .labels import map_model_labels

    check_dtype(dtype, "evaluation dtype")
    columns = None if labels is None else map_model_labels(clf.id2label, labels, clf.path)
    n = len(hypotheses)
    if premises is not None and len(premises) != n:
        raise ValueError(f"{len(premises)} premises but {n} hypotheses")
    width_out = len(clf.id2label) if columns is None else len(columns)
    out = np.zeros((n, len(clf.id2label)), dtype=np.float32)
    if n == 0:
        return np.zeros((0, width_out), dtype=np.float32)
    tok = clf.tokenizer
    texts = (list(hypotheses),) if premises is None else (list(premises), list(hypotheses))
    enc = tok(*texts, truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    lengths = [len(x) for x in enc["input_ids"]]
    pad_values = {"input_ids": tok.pad_token_id if tok.pad_token_id is not None else 0, "attention_mask": 0,
                  "token_type_ids": getattr(tok, "pad_token_type_id", 0)}
    left = getattr(tok, "padding_side", "right") == "left"
    device = clf.device
    if order is None:
        batches = length_batches(lengths, batch_size, max_tokens)
    else:
        if max_tokens:
            raise ConfigError("max_tokens applies to batches by length; with a row order, batches have batch_size rows")
        rows = np.asarray(order, dtype=np.int64)
        batches = [rows[s:s + batch_size] for s in range(0, len(rows), batch_size)]
    with torch.inference_mode(), compute_context(device, dtype), \
            tqdm(total=n, desc=progress if isinstance(progress, str) else "predict", disable=not progress,
                 unit="ex") as bar:
        for idx in batches:
            width = max(lengths[i] for i in idx)
            arrays = {}
            for k in keys:
                a = np.full((len(idx), width), pad_values[k], dtype=np.int64)
                for r, i in enumerate(idx):
                    row = enc[k][i]
                    if left:
                        a[r, width - len(row):] = row
                    else:
                        a[r, :len(row)] = row
                arrays[k] = torch.from_numpy(a).to(device)
            out[idx] = torch.softmax(clf.model(**arrays).logits.float(), dim=-1).cpu().numpy()
            bar.update(len(idx))
    return out if columns is None else out[:, columns]
