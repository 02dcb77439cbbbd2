"""Pair embeddings for AFLite (Le Bras et al. 2020): Φ(x) for every row, computed once and cached.

Each row is encoded as the pair ``(premise, hypothesis)`` with the encoder's own tokenizer (so
``[CLS] premise [SEP] hypothesis [SEP]`` for BERT, ``<s> premise </s></s> hypothesis </s>`` for
RoBERTa), and its embedding is read from the last hidden layer:

    Φ(x) = h_0                                     (``pooling="cls"``, the default: the first token)
    Φ(x) = Σ_t mask_t · h_t / Σ_t mask_t          (``pooling="mean"``: masked mean over the real tokens)

The paper's protocol (§2, "Implementation"): "to obtain Φ, we train a first 'warm-up' model on a
small fraction of the data based on the learning curve in low-data regime, and do not reuse this data
for the rest of our experiments. Moreover, this fraction corresponds to the training size for AFLite";
§4: the features are "extracted from the final layer before the output layer, trained on a random
sample (warm-up) of the original training set". :func:`warm_up_encoder` does that fine-tuning (a
sequence-pair classifier on a seeded warm-up share of the rows) and returns the rows it used; the
AFLite step embeds the other rows with the fine-tuned encoder's first token (the input of the
classification head) and reports the warm-up rows as removed with reason ``warm-up``.

Warm-up hyper-parameters: Appendix A.4 of the paper gives, "for every training set up" of its NLP
experiments, Adam with "a learning rate of 1e-05, and an epsilon value of 1e-08, keeping other
parameters the same as in the original PyTorch repository", "3 epochs for all *NLI tasks" and "a batch
size of 92"; those are the defaults here (the paper does not list the warm-up separately). "Other
parameters the same" is read as the Transformers defaults: no weight decay, a linear decay of the
learning rate without warm-up steps, gradient clipping at 1.0 (project's reading). The warm-up share
itself is not given for NLI ("a small fraction"; ImageNet used "a fixed 20% sample"): the default of
0.1 is the project's choice.

Embeddings and warm-up models are cached on disk (``<cache_dir>/embeddings/``), keyed by the rows'
content (premise, hypothesis and label of every row, in order), the model identity (Hub id and
revision, or folder and the size and modification time of its files) and the parameters, so a second
run (or a recipe build over the same rows with extra feature columns) reads them instead of
recomputing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import __version__
from ..utils.cache import discard_entry, load_npy, record_entry, save_npy, temp_name, usable
from ..utils.outputs import marker_of
from ..utils.errors import ConfigError, InvalidInputError
from .aflite.params import PARAMS as _AFLITE

log = logging.getLogger(__name__)

#: the encoder of the paper (for users with the Hub)
DEFAULT_ENCODER = "roberta-large"
#: the encoder available offline on the development machines
OFFLINE_ENCODER = str(Path.home() / ".cache" / "debiased-nli" / "models" / "all-minilm-l6-v2")
POOLINGS = ("cls", "mean")
#: Appendix A.4 of the paper (see the module docstring), as AFLite's parameters declare it (aflite/params.py)
PAPER_WARMUP = {k: _AFLITE[f"warmup_{k}"].default for k in ("epochs", "lr", "eps", "batch_size")}
#: "a small fraction of the data" (§2): the share is the project's choice
DEFAULT_WARMUP_SHARE = _AFLITE["warmup_share"].default


def default_encoder() -> str:
    """roberta-large (the paper's), or the offline MiniLM folder where it exists (machines without the Hub)."""
    return OFFLINE_ENCODER if Path(OFFLINE_ENCODER).is_dir() else DEFAULT_ENCODER


def default_embedding_cache() -> Path:
    from ..utils.cache import default_cache_dir
    return default_cache_dir() / "embeddings"


def model_identity(model: str, revision: str | None = None) -> dict:
    """What identifies an encoder for the cache: a folder by its files' names, sizes and mtimes,
    a Hub id by its name and revision."""
    path = Path(model).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"folder": str(path.resolve()),
                "files": [(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]}
    return {"hub": model, "revision": revision}


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def rows_key(ds, batch_size: int = 50_000) -> str:
    """A content hash of the rows' premise, hypothesis and label (in order): the same rows give the
    same key whatever other columns the dataset carries (e.g. the feature columns of a build)."""
    h = hashlib.sha256()
    cols = [c for c in ("premise", "hypothesis", "label") if c in ds.column_names]
    for batch in ds.select_columns(cols).iter(batch_size=batch_size):
        h.update(json.dumps([batch[c] for c in cols], default=str).encode())
    return f"{len(ds)}-{h.hexdigest()[:24]}"


def _resolve_device(device: str | None):
    import torch
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _with_pad_token(tok):
    # byte-level BPE tokenizers (GPT-2 family) have no pad token; padding is masked out anyway
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def _load_encoder(model: str, revision: str | None = None):
    from transformers import AutoModel, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(model, revision=revision)
        enc = AutoModel.from_pretrained(model, revision=revision)
    except OSError as err:
        raise ConfigError(f"cannot load encoder {model!r}: {err}. Give a model folder (e.g. {OFFLINE_ENCODER}) "
                          f"or a Hub id reachable from this machine") from err
    return _with_pad_token(tok), enc


def _check_rows(ds) -> None:
    for col in ("premise", "hypothesis"):
        if col not in ds.column_names:
            raise InvalidInputError(f"compute_embeddings needs a canonical dataset with column {col!r}; "
                                    f"the dataset has {ds.column_names}. Load it with debiased_nli.data.loading.load_task.",
                                    column=col)


def encode_pairs(premises: Sequence[str], hypotheses: Sequence[str], tokenizer, encoder, *, batch_size: int = 64,
                 max_length: int = 128, pooling: str = "cls", device=None, bar=None) -> np.ndarray:
    """Encode (premise, hypothesis) pairs; returns float32 [n, hidden]. Rows are batched by length
    (sorted, then put back in input order) so little time goes into padding. ``bar``: an open tqdm
    bar to advance as rows are encoded (None: no progress shown)."""
    import torch

    if pooling not in POOLINGS:
        raise ConfigError(f"pooling must be one of {POOLINGS}, not {pooling!r}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    device = _resolve_device(device) if device is None or isinstance(device, str) else device
    encoder = encoder.to(device).eval()
    n = len(premises)
    hidden = encoder.config.hidden_size
    out = np.zeros((n, hidden), dtype=np.float32)
    # the character length is a good enough proxy of the token length for bucketing
    order = np.argsort([len(p) + len(h) for p, h in zip(premises, hypotheses)], kind="stable")
    with torch.inference_mode():
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            batch = tokenizer([premises[i] for i in idx], [hypotheses[i] for i in idx], padding=True,
                              truncation=True, max_length=max_length, return_tensors="pt").to(device)
            h = encoder(**batch).last_hidden_state
            if pooling == "mean":
                mask = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
                pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            else:
                pooled = h[:, 0]
            out[idx] = pooled.float().cpu().numpy()
            if bar is not None:
                bar.update(len(idx))
    return out


SHARD_ROWS = 4096
"""Rows per saved shard of a long embedding run: an interrupted run resumes at the first missing shard."""


def compute_embeddings(ds, model: str = DEFAULT_ENCODER, *, batch_size: int = 64, max_length: int = 128,
                       pooling: str = "cls", cache_dir: "str | Path | None" = None, progress: bool = True,
                       revision: str | None = None, device: str | None = None,
                       shard_rows: int = SHARD_ROWS) -> np.ndarray:
    """Φ(row) for every row of a canonical dataset: the last layer of ``model`` on the pair
    (premise, hypothesis) at the first token (``cls``) or averaged (``mean``), float32
    [len(ds), hidden]. Cached by the rows' content + model + params; computed in shards of
    ``shard_rows`` rows, each saved as it is done, so an interrupted run resumes where it stopped."""
    from tqdm.auto import tqdm

    _check_rows(ds)
    if max_length < 8:
        raise ConfigError(f"max_length must be at least 8 tokens, got {max_length}")
    cache = Path(cache_dir) if cache_dir is not None else default_embedding_cache()
    key = _hash({"rows": rows_key(ds), "model": model_identity(model, revision),
                 "max_length": max_length, "pooling": pooling, "version": __version__})
    path = cache / f"emb-{key}.npy"
    cache.mkdir(parents=True, exist_ok=True)
    emb = load_npy(path, rows=len(ds))  # an unreadable or short entry is a miss (removed, with a warning)
    if emb is not None:
        log.info("embeddings read from cache %s", path)
        return emb
    parts = cache / f"emb-{key}.parts-{shard_rows}"  # shard files are only valid for their shard size
    parts.mkdir(parents=True, exist_ok=True)
    bounds = [(a, min(a + shard_rows, len(ds))) for a in range(0, len(ds), shard_rows)]
    names = [parts / f"{i:05d}.npy" for i in range(len(bounds))]
    chunks = [load_npy(f, rows=b - a) for (a, b), f in zip(bounds, names)]  # what an interrupted run saved
    done = sum(b - a for (a, b), c in zip(bounds, chunks) if c is not None)
    tok = enc = None
    with tqdm(total=len(ds), initial=done, desc="embeddings", unit="row", disable=not progress) as bar:
        for i, ((a, b), f) in enumerate(zip(bounds, names)):
            if chunks[i] is not None:
                continue
            if enc is None:
                tok, enc = _load_encoder(model, revision)
            rows = ds.select(range(a, b))
            chunks[i] = encode_pairs(rows["premise"], rows["hypothesis"], tok, enc, batch_size=batch_size,
                                     max_length=max_length, pooling=pooling, device=device, bar=bar)
            save_npy(f, chunks[i])  # a shard is saved whole or not at all
    emb = np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32)
    save_npy(path, emb)
    for f in names:
        f.unlink(missing_ok=True)
        marker_of(f).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        parts.rmdir()
    return emb


@dataclasses.dataclass
class WarmUp:
    """The encoder fine-tuned on the warm-up slice, and which rows (indices into the input) it saw."""

    model_dir: str
    indices: np.ndarray
    params: dict
    train_loss: float

    def rest(self, n_rows: int) -> np.ndarray:
        """Indices of the rows not used for warm-up (the ones AFLite filters)."""
        keep = np.ones(n_rows, bool)
        keep[self.indices] = False
        return np.nonzero(keep)[0]


def warm_up_indices(n_rows: int, share: float, seed: int = 0) -> np.ndarray:
    """The warm-up slice: round(share * n_rows) rows drawn without replacement (seeded), sorted."""
    if not 0 < share < 1:
        raise ConfigError(f"the warm-up share must lie strictly between 0 and 1, got {share}")
    size = int(round(share * n_rows))
    if size < 1 or size >= n_rows:
        raise ConfigError(f"a warm-up share of {share} of {n_rows} rows gives {size} rows; choose a share that "
                          f"leaves at least one row on each side")
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_rows, size=size, replace=False))


@dataclasses.dataclass(frozen=True)
class WarmUpParams:
    """The warm-up fine-tuning: the share of the rows it takes (drawn with ``seed``), epochs, Adam's lr and ε,
    batch size and tokens per pair. Defaults: Appendix A.4 of the paper (:data:`PAPER_WARMUP`) and the project's
    share (:data:`DEFAULT_WARMUP_SHARE`)."""

    share: float = DEFAULT_WARMUP_SHARE
    seed: int = 0
    epochs: float = PAPER_WARMUP["epochs"]
    lr: float = PAPER_WARMUP["lr"]
    eps: float = PAPER_WARMUP["eps"]
    batch_size: int = PAPER_WARMUP["batch_size"]
    max_length: int = 128

    def normalised(self) -> "WarmUpParams":
        """Checked, with normalised types: a YAML ``1`` and a command-line ``1.0`` epoch are the same run (and
        cache entry)."""
        if self.epochs <= 0 or self.lr <= 0 or self.batch_size < 1:
            raise ConfigError(f"warm-up needs epochs > 0, lr > 0 and batch_size >= 1; got epochs={self.epochs}, "
                              f"lr={self.lr}, batch_size={self.batch_size}")
        return WarmUpParams(share=float(self.share), seed=int(self.seed), epochs=float(self.epochs), lr=float(self.lr),
                            eps=float(self.eps), batch_size=int(self.batch_size), max_length=int(self.max_length))


def warm_up_encoder(ds, model: str = DEFAULT_ENCODER, *, num_labels: int, params: WarmUpParams | None = None,
                    cache_dir: "str | Path | None" = None, progress: bool = True,
                    device: str | None = None) -> WarmUp:
    """Fine-tune ``model`` as a sequence-pair classifier on a seeded warm-up share of the rows, as Le
    Bras et al. do before embedding (cross-entropy on the gold label; Adam without weight decay, lr
    and ε of Appendix A.4, a linear decay, gradient clipping at 1.0); save it (cached by the rows'
    content + model + params) and return it with the warm-up row indices. ``params``: the share and the
    fine-tuning's values (:class:`WarmUpParams`; default: the paper's)."""
    _check_rows(ds)
    wp = (params or WarmUpParams()).normalised()
    idx = warm_up_indices(len(ds), wp.share, wp.seed)
    record = {**dataclasses.asdict(wp), "num_labels": int(num_labels), "base_model": model}
    cache = Path(cache_dir) if cache_dir is not None else default_embedding_cache()
    key = _hash({"rows": rows_key(ds), "model": model_identity(model), **record, "version": __version__})
    out_dir = cache / f"warmup-{key}"
    meta = _read_warm_up(out_dir)
    if meta is not None:
        return WarmUp(str(out_dir), idx, {**record, **meta.get("run", {})}, float(meta["train_loss"]))
    clf, tok, train_loss, run = _fine_tune(ds.select(idx), model, wp, int(num_labels), progress=progress,
                                           device=device)
    _save_warm_up(out_dir, clf, tok, {"train_loss": train_loss, "params": record, "run": run})
    return WarmUp(str(out_dir), idx, {**record, **run}, train_loss)


def _fine_tune(sub, model: str, wp: WarmUpParams, num_labels: int, *, progress: bool, device: str | None):
    """``model`` fine-tuned on the warm-up rows ``sub``: (classifier, tokenizer, train loss (the mean of the last
    tenth of the steps' losses), the run's record)."""
    import time

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

    start = time.time()
    torch.manual_seed(wp.seed)
    dev = _resolve_device(device)
    try:
        tok = _with_pad_token(AutoTokenizer.from_pretrained(model))
        clf = AutoModelForSequenceClassification.from_pretrained(model, num_labels=num_labels)
    except OSError as err:
        raise ConfigError(f"cannot load encoder {model!r} for warm-up: {err}") from err
    if clf.config.pad_token_id is None:  # decoder-style classifiers find the last token through it
        clf.config.pad_token_id = tok.pad_token_id
    clf.to(dev).train()
    prem, hyp = sub["premise"], sub["hypothesis"]
    labels = torch.tensor(np.asarray(sub["label"], dtype=np.int64))
    rng = np.random.default_rng(wp.seed)
    n_steps = max(1, int(np.ceil(wp.epochs * len(sub) / wp.batch_size)))
    # Adam as in A.4 ("Adam ... learning rate of 1e-05, and an epsilon value of 1e-08"): AdamW without decay
    opt = torch.optim.AdamW(clf.parameters(), lr=wp.lr, eps=wp.eps, weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, 0, n_steps)
    order = np.concatenate([rng.permutation(len(sub)) for _ in range(int(np.ceil(wp.epochs)) + 1)])
    losses = []
    for step in tqdm(range(n_steps), desc="warm-up fine-tuning", disable=not progress):
        b = order[step * wp.batch_size:(step + 1) * wp.batch_size]
        batch = tok([prem[i] for i in b], [hyp[i] for i in b], padding=True, truncation=True,
                    max_length=wp.max_length, return_tensors="pt").to(dev)
        loss = clf(**batch, labels=labels[b].to(dev)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(clf.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    train_loss = float(np.mean(losses[-max(1, len(losses) // 10):]))
    return clf, tok, train_loss, {"steps": n_steps, "seconds": round(time.time() - start, 1),
                                  "first_loss": round(losses[0], 4)}


def _save_warm_up(out_dir: Path, clf, tok, meta: dict) -> None:
    """The fine-tuned classifier and its tokenizer into ``out_dir`` with ``warmup.json`` (``meta`` and the files'
    sizes), written under a temporary name and renamed once complete, then recorded as a cache entry; a folder
    cut short later is a miss (see :func:`_read_warm_up`). Another run that wrote it meanwhile wins."""
    tmp = temp_name(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # the encoder is what AFLite embeds with; the classification head is saved along for inspection
        clf.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / "warmup.json").write_text(json.dumps({**meta, "files": files}))
        if out_dir.exists():  # an unreadable or unfinished one (a readable one was returned above)
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _read_warm_up(out_dir, quiet=True) is None:  # not another run's, finished meanwhile
            raise
        log.info("warm-up encoder %s was written meanwhile by another run (%s)", out_dir, err)
    else:
        record_entry(out_dir)


def _read_warm_up(out_dir: Path, quiet: bool = False) -> dict | None:
    """The record of a cached warm-up encoder, or None: absent, or unreadable or missing a file it was
    saved with (then removed, with a warning, and trained again)."""
    if not out_dir.exists():
        return None
    if not quiet and not usable(out_dir):  # unrecorded, or its files changed since: trained again
        return None
    try:
        meta = json.loads((out_dir / "warmup.json").read_text())
        float(meta["train_loss"])
        for name, size in (meta.get("files") or {}).items():  # older records have no list
            if (out_dir / name).stat().st_size != size:
                raise ValueError(f"{name} has {(out_dir / name).stat().st_size} bytes, saved with {size}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        if not quiet:
            discard_entry(out_dir, err)
        return None
    return meta
