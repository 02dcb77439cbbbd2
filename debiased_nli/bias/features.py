"""Task-independent features of a sentence pair, as a registry of named, versioned extractors.

A feature is a string; each extractor writes one column ``feat_<name>`` (a list of strings per row),
so a stored feature column says exactly what produced it (dolma's ``char_length_v1`` idea). Features
are computed once and every later stage reads them through a :class:`FeatureMatrix` (CSR over integer
ids into a vocabulary whose ids follow the strings' order). Two ways to compute them, with the same
result: ``datasets.map`` into ``feat_*`` columns (cached by fingerprint for file-backed datasets;
:func:`add_feature_columns`, then :func:`build_feature_matrices`), or a chunk of rows at a time into
:class:`ChunkedFeatures`, which keeps integer codes and only each chunk's distinct strings (the
build's path, for millions of rows).

Tokenisation (``tokenize``): lower-case (Unicode); every run of characters that are not letters,
digits or apostrophes separates tokens; apostrophes at the start or end of a token are dropped, so
``"Nobody's here, 'tis"`` -> ``["nobody's", "here", "tis"]``. Punctuation is never a token.

Built-in extractors (a row carries each feature at most once; ``n`` counts rows):

========================  =====================================================================
``unigram_v1``            ``<token>@premise``, ``<token>@hypothesis``
``unigram_pair_v1``       ``<token>@pair``: a token of the premise or the hypothesis, not tagged by side
                          (PDD's unigrams, Guo et al. 2023: its Table 14 debiases ``carry``, a
                          premise word)
``bigram_v1``             ``<token> <token>@premise``, ``<token> <token>@hypothesis`` (adjacent)
``hypo_len_v1``           hypothesis length in tokens: ``hypo-len<5``, ``hypo-len5-9``,
                          ``hypo-len10-14``, ``hypo-len15-19``, ``hypo-len>=20``
``len_ratio_v1``          hypothesis/premise token ratio r: ``len-ratio<0.25``,
                          ``len-ratio0.25-0.5``, ``len-ratio0.5-0.75``, ``len-ratio0.75-1``
                          (r < 1), ``len-ratio>=1``
``overlap_v1``            share s of hypothesis tokens (occurrences) found in the premise:
                          ``lex-overlap<0.2``, ``lex-overlap0.2-0.4``, ``lex-overlap0.4-0.6``,
                          ``lex-overlap0.6-0.8`` (s <= 0.8), ``lex-overlap>0.8``; plus
                          ``full-lex-overlap`` when s == 1
``overlap_v2``            cumulative thresholds on s (a row carries every one it passes, so
                          s = 0.95 carries ``lex-overlap>0.5`` ... ``lex-overlap>0.9``):
                          ``lex-overlap>0.5``, ``>0.6``, ``>0.7``, ``>0.8``, ``>0.9``; plus
                          ``full-lex-overlap`` when s == 1 (the names of Wu et al. 2022, Table 12)
``low_overlap_v1``        ``lex-overlap<0.8`` when s < 0.8 (the QQP artifact)
``hypo_only_v1``          ``hypo-only-pred=<label>``: the prediction of a hypothesis-only model,
                          read from the ``hypo_only_pred`` column (see ``hypothesis_only.py``)
``null_v1``               ``<null>`` in every row (its z measures the label imbalance)
========================  =====================================================================
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..utils.errors import ConfigError

FEATURE_PREFIX = "feat_"
NULL_FEATURE = "<null>"
HYPO_ONLY_COLUMN = "hypo_only_pred"

HYPO_LEN_BINS = ((5, "hypo-len<5"), (10, "hypo-len5-9"), (15, "hypo-len10-14"), (20, "hypo-len15-19"),
                 (np.inf, "hypo-len>=20"))
LEN_RATIO_BINS = ((0.25, "len-ratio<0.25"), (0.5, "len-ratio0.25-0.5"), (0.75, "len-ratio0.5-0.75"),
                  (1.0, "len-ratio0.75-1"), (np.inf, "len-ratio>=1"))
OVERLAP_NAMES = ("lex-overlap<0.2", "lex-overlap0.2-0.4", "lex-overlap0.4-0.6", "lex-overlap0.6-0.8",
                 "lex-overlap>0.8")
# overlap_v2: Wu et al. (2022), Table 12 (ACL; Table 10 of the submission), lists among SNLI's top
# entailment features "lex-overlap> 0.8 123.3", "full-lex-overlap 117.3" and "lex-overlap> 0.9 90.4":
# threshold features, a row with s > 0.9 carrying both. The paper names only 0.8 and 0.9; the lower
# thresholds 0.5-0.7 (steps of 0.1) are this project's choice.
OVERLAP_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)
FULL_OVERLAP = "full-lex-overlap"


# ---------------------------------------------------------------------------------------------
# tokenisation and list helpers (vectorised with pyarrow; no Python loop per row)

def tokenize_arrow(texts: pa.Array | pa.ChunkedArray) -> pa.ListArray:
    """Tokenise a string array (see the module docstring for the rules).

    Each distinct string is tokenised once (premises repeat: SNLI has about three hypotheses per
    premise) and the token lists are then gathered for every row.
    """
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    if not pa.types.is_string(texts.type):  # large_string (e.g. parquet written by pandas), dictionary, ...
        texts = texts.cast(pa.string())
    texts = texts.fill_null("")
    enc = pc.dictionary_encode(texts)
    if len(enc.dictionary) < 0.8 * len(texts):
        return _tokenize_distinct(enc.dictionary).take(enc.indices)
    return _tokenize_distinct(texts)


# every run of characters that are not letters, digits or apostrophes becomes one space. A run that is
# already a single space needs no replacement, so the pattern matches only the other runs (those with
# a character other than a space, or two spaces or more): the same text, and about 4x faster, since
# Arrow's regex replace pays per match and most runs are the single space between two words
_SEPARATOR_RUNS = r"[^\pL\pN']*[^\pL\pN' ][^\pL\pN']*| {2,}"


def _tokenize_distinct(texts: pa.Array) -> pa.ListArray:
    t = pc.utf8_lower(texts)
    t = pc.replace_substring_regex(t, _SEPARATOR_RUNS, " ")
    t = pc.replace_substring_regex(t, r"(^| )'+|'+( |$)", " ")
    t = pc.utf8_trim_whitespace(t)
    # the text is now tokens separated by spaces (one, or two where an apostrophe run was cut out):
    # a plain split, then the empty tokens are dropped
    split = pc.split_pattern(t, " ")
    flat = pc.list_flatten(split)
    keep = pc.greater(pc.utf8_length(flat), 0)
    if pc.all(keep).as_py() is not False:
        return split
    parents = pc.list_parent_indices(split).to_numpy()
    keep_np = keep.to_numpy(zero_copy_only=False)
    return _lists_from_parents(flat.filter(keep), parents[keep_np], len(split))


def tokenize(text: str) -> list[str]:
    """The same tokenisation for one string."""
    return tokenize_arrow(pa.array([text], pa.string()))[0].as_py()


def _lists_from_parents(values: pa.Array, parents: np.ndarray, n_rows: int) -> pa.ListArray:
    """Rebuild a list array from flat values and their (non-decreasing) row index."""
    counts = np.bincount(parents, minlength=n_rows) if len(parents) else np.zeros(n_rows, np.int64)
    offsets = np.zeros(n_rows + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def _singletons(names: Sequence[str], codes: np.ndarray) -> pa.ListArray:
    """One feature per row, chosen from ``names`` by ``codes``."""
    values = pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(list(names))).cast(pa.string())
    return pa.ListArray.from_arrays(pa.array(np.arange(len(codes) + 1, dtype=np.int32)), values)


def _first_occurrences(keys: np.ndarray) -> np.ndarray:
    """Mask of the entries whose key no earlier entry has. ``keys`` are ``row * size + code`` with the
    rows non-decreasing, so they come in short sorted-ish runs: a stable sort (timsort) finds the
    repeats about 4x faster than a hash table over millions of entries."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    first = np.ones(len(keys), bool)
    first[order[1:][ordered[1:] == ordered[:-1]]] = False  # equal keys: the stable sort puts the earliest first
    return first


def _unique_per_row(lists: pa.ListArray) -> pa.ListArray:
    """Drop repeated values inside each row, keeping first occurrences in order."""
    n_rows = len(lists)
    flat = pc.list_flatten(lists)
    if len(flat) == 0:
        return lists
    parents = pc.list_parent_indices(lists).to_numpy().astype(np.int64)
    if pa.types.is_dictionary(flat.type) and len(pc.unique(flat.dictionary)) == len(flat.dictionary):
        codes, size = flat.indices.to_numpy(zero_copy_only=False).astype(np.int64), len(flat.dictionary)
    else:
        enc = pc.dictionary_encode(flat.cast(pa.string()) if pa.types.is_dictionary(flat.type) else flat)
        codes, size = enc.indices.to_numpy().astype(np.int64), len(enc.dictionary)
    first = _first_occurrences(parents * size + codes)
    if first.all():
        return lists
    return _lists_from_parents(flat.filter(pa.array(first)), parents[first], n_rows)


def _tag(values: pa.Array, side: str) -> pa.Array:
    return pc.binary_join_element_wise(values, side, "@")


# ---------------------------------------------------------------------------------------------
# the batch an extractor sees

class FeatureBatch:
    """A batch of rows with lazily computed, shared token lists."""

    def __init__(self, table: pa.Table, labels: Sequence[str]):
        self.table = table
        self.labels = tuple(labels)
        self._cache: dict[str, object] = {}

    def __len__(self) -> int:
        return self.table.num_rows

    def column(self, name: str) -> pa.Array:
        if name not in self.table.column_names:
            raise ConfigError(f"feature extraction needs the column {name!r}; the batch has {self.table.column_names}")
        return self.table.column(name).combine_chunks()

    def tokens(self, side: str) -> pa.ListArray:
        key = f"tokens:{side}"
        if key not in self._cache:
            self._cache[key] = tokenize_arrow(self.column(side))
        return self._cache[key]  # type: ignore[return-value]

    def n_tokens(self, side: str) -> np.ndarray:
        return pc.list_value_length(self.tokens(side)).to_numpy(zero_copy_only=False).astype(np.int64)

    def token_codes(self) -> tuple[pa.Array, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """The batch's distinct tokens (both sides) and, per side, (row, token code) of every token in
        order: integer work for the n-gram and overlap extractors, one hash pass over the tokens."""
        if "codes" not in self._cache:
            p, h = self.tokens("premise"), self.tokens("hypothesis")
            pf, hf = pc.list_flatten(p), pc.list_flatten(h)
            enc = pc.dictionary_encode(pa.concat_arrays([pf.cast(pa.string()), hf.cast(pa.string())]))
            codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
            self._cache["codes"] = (enc.dictionary, {
                "premise": (pc.list_parent_indices(p).to_numpy().astype(np.int64), codes[:len(pf)]),
                "hypothesis": (pc.list_parent_indices(h).to_numpy().astype(np.int64), codes[len(pf):])})
        return self._cache["codes"]  # type: ignore[return-value]

    def overlap_share(self) -> np.ndarray:
        """Share of hypothesis tokens (occurrences) that also occur in the premise (0 if none)."""
        if "overlap" not in self._cache:
            import pandas as pd

            dictionary, sides = self.token_codes()
            v = max(len(dictionary), 1)
            ppar, pcodes = sides["premise"]
            hpar, hcodes = sides["hypothesis"]
            pkey = ppar * v + pcodes
            hkey = hpar * v + hcodes
            found = pd.Series(hkey).isin(pkey).to_numpy()  # hashed; np.isin sorts
            n_found = np.bincount(hpar, weights=found, minlength=len(self)) if len(hpar) else np.zeros(len(self))
            n_h = self.n_tokens("hypothesis")
            self._cache["overlap"] = np.divide(n_found, n_h, out=np.zeros(len(self)), where=n_h > 0)
        return self._cache["overlap"]  # type: ignore[return-value]


ExtractorFn = Callable[[FeatureBatch], "pa.ListArray | Sequence[Sequence[str]]"]


@dataclasses.dataclass(frozen=True)
class Extractor:
    name: str
    fn: ExtractorFn
    doc: str = ""
    requires: tuple[str, ...] = ()  # extra input columns, beyond premise/hypothesis
    # the extractor never lists a feature twice in a row, so extract_table skips its dedup pass
    unique_rows: bool = False

    @property
    def column(self) -> str:
        return FEATURE_PREFIX + self.name


_EXTRACTORS: dict[str, Extractor] = {}


def register_extractor(name: str, *, doc: str = "", requires: Sequence[str] = (), overwrite: bool = False,
                       unique_rows: bool = False):
    """Register a feature extractor under a versioned name (e.g. ``"negation_v1"``).

    The function receives a :class:`FeatureBatch` and returns, for every row, the list of feature
    strings of that row (a ``pa.ListArray`` of strings, or a list of lists). Repeats inside a row are
    dropped afterwards, unless ``unique_rows`` promises there are none (the built-in extractors that
    make their rows unique themselves; tested against the dedup pass).
    """
    if not name or not name[-1].isdigit() or "_v" not in name:
        raise ConfigError(f"extractor name {name!r} must carry a version, e.g. {name or 'negation'}_v1")

    def wrap(fn: ExtractorFn) -> ExtractorFn:
        if name in _EXTRACTORS and not overwrite:
            raise ConfigError(f"extractor {name!r} is already registered; bump its version or pass overwrite=True")
        _EXTRACTORS[name] = Extractor(name, fn, doc or (fn.__doc__ or "").strip(), tuple(requires), unique_rows)
        return fn

    return wrap


def get_extractor(name: str) -> Extractor:
    if name not in _EXTRACTORS:
        from ..utils.errors import did_you_mean
        raise ConfigError(f"unknown feature extractor {name!r}.{did_you_mean(name, list(_EXTRACTORS))} "
                          f"Registered: {', '.join(sorted(_EXTRACTORS))}")
    return _EXTRACTORS[name]


def list_extractors() -> list[str]:
    return sorted(_EXTRACTORS)


@register_extractor("unigram_v1", doc="<token>@premise and <token>@hypothesis", unique_rows=True)
def _unigrams(batch: FeatureBatch) -> pa.ListArray:
    dictionary, sides = batch.token_codes()
    T = len(dictionary)
    parts = [(sides[side][0], sides[side][1] + i * T) for i, side in enumerate(("premise", "hypothesis"))]
    tagged = pa.concat_arrays([_tag(dictionary, side) for side in ("premise", "hypothesis")])
    return _coded_rows(parts, len(batch), tagged)


@register_extractor("unigram_pair_v1", doc="<token>@pair: the tokens of premise and hypothesis together (PDD)")
def _unigrams_pair(batch: FeatureBatch) -> pa.ListArray:
    parts = []
    for side in ("premise", "hypothesis"):
        toks = batch.tokens(side)
        parts.append((pc.list_parent_indices(toks).to_numpy(), _tag(pc.list_flatten(toks), "pair")))
    return _merge_rows(parts, len(batch))  # a token in both sides is one feature (extract_table dedups)


def _bigram_codes(parents: np.ndarray, codes: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, left code * T + right code) of every adjacent token pair inside a row."""
    if len(codes) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    idx = np.nonzero(parents[:-1] == parents[1:])[0]
    return parents[idx], codes[idx] * T + codes[idx + 1]


@register_extractor("bigram_v1", doc="adjacent token pairs '<a> <b>@premise' and '<a> <b>@hypothesis'",
                    unique_rows=True)
def _bigrams(batch: FeatureBatch) -> pa.ListArray:
    import pandas as pd

    dictionary, sides = batch.token_codes()
    T = max(len(dictionary), 1)
    pairs = [_bigram_codes(*sides[side], T) for side in ("premise", "hypothesis")]
    keys = np.concatenate([k + i * T * T for i, (_, k) in enumerate(pairs)])
    codes, uniques = pd.factorize(keys)  # the batch's distinct (side, left, right), in order of appearance
    side, rest = np.divmod(np.asarray(uniques, np.int64), T * T)
    left, right = np.divmod(rest, T)
    names = _bigram_names(dictionary, left, right, side)
    split = len(pairs[0][1])
    return _coded_rows([(pairs[0][0], codes[:split]), (pairs[1][0], codes[split:])], len(batch), names)


def _bigram_names(dictionary: pa.Array, left: np.ndarray, right: np.ndarray, side: np.ndarray) -> pa.Array:
    """'<a> <b>@<side>' for each (left, right, side) code triple."""
    pair = pc.binary_join_element_wise(dictionary.take(pa.array(left)), dictionary.take(pa.array(right)), " ")
    tag = pa.DictionaryArray.from_arrays(pa.array(side.astype(np.int32)),
                                         pa.array(["premise", "hypothesis"])).cast(pa.string())
    return pc.binary_join_element_wise(pair, tag, "@")


def _coded_rows(parts: list[tuple[np.ndarray, np.ndarray]], n_rows: int, dictionary: pa.Array) -> pa.ListArray:
    """Per-row lists of dictionary-coded features: row r gets part 0's codes of r, then part 1's, ...
    (each part as its entries' rows, non-decreasing, and codes into ``dictionary``), repeats within a
    row dropped (first occurrences kept) and the dictionary cut to the codes used. The values stay
    dictionary-encoded: strings are built once per distinct feature of the batch, not per entry."""
    lengths = [np.bincount(p, minlength=n_rows) if len(p) else np.zeros(n_rows, np.int64) for p, _ in parts]
    indptr, codes = interleave_columns(lengths, [c for _, c in parts])
    if len(codes):
        rows = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(indptr))
        first = _first_occurrences(rows * len(dictionary) + codes)
        if not first.all():
            codes, rows = codes[first], rows[first]
            np.cumsum(np.bincount(rows, minlength=n_rows), out=indptr[1:])
    used = np.zeros(len(dictionary), bool)
    used[codes] = True
    remap = np.cumsum(used, dtype=np.int64) - 1
    values = pa.DictionaryArray.from_arrays(pa.array(remap[codes].astype(np.int32)), dictionary.filter(pa.array(used)))
    return pa.ListArray.from_arrays(pa.array(indptr.astype(np.int32)), values)


def _merge_rows(parts: list[tuple[np.ndarray, pa.Array]], n_rows: int) -> pa.ListArray:
    """Concatenate per-row lists of several parts (each given as parents + flat values; each part's
    parents non-decreasing): row r gets part 0's values of r, then part 1's, ..."""
    lengths = [np.bincount(np.asarray(p, np.int64), minlength=n_rows) if len(p) else np.zeros(n_rows, np.int64)
               for p, _ in parts]
    indptr, slots = interleave_columns(lengths, [np.arange(len(p), dtype=np.int64) + sum(len(q) for q, _ in parts[:i])
                                                 for i, (p, _) in enumerate(parts)])
    values = pa.concat_arrays([v.cast(pa.string()) for _, v in parts])
    # slots[j] = which concatenated value goes to entry j
    return pa.ListArray.from_arrays(pa.array(indptr.astype(np.int32)), values.take(pa.array(slots)))


def _bin(values: np.ndarray, bins: Sequence[tuple[float, str]]) -> pa.ListArray:
    edges = np.array([b for b, _ in bins[:-1]], dtype=float)
    return _singletons([n for _, n in bins], np.searchsorted(edges, values, side="right"))


@register_extractor("hypo_len_v1", doc="hypothesis length in tokens, binned", unique_rows=True)
def _hypo_len(batch: FeatureBatch) -> pa.ListArray:
    return _bin(batch.n_tokens("hypothesis").astype(float), HYPO_LEN_BINS)


@register_extractor("len_ratio_v1", doc="hypothesis/premise length ratio in tokens, binned", unique_rows=True)
def _len_ratio(batch: FeatureBatch) -> pa.ListArray:
    h, p = batch.n_tokens("hypothesis").astype(float), batch.n_tokens("premise").astype(float)
    ratio = np.divide(h, p, out=np.full(len(h), np.inf), where=p > 0)
    return _bin(ratio, LEN_RATIO_BINS)


@register_extractor("overlap_v1", doc="share of hypothesis tokens found in the premise, binned; full-lex-overlap",
                    unique_rows=True)
def _overlap(batch: FeatureBatch) -> pa.ListArray:
    s = batch.overlap_share()
    # [0,.2) [.2,.4) [.4,.6) [.6,.8] (.8,1]
    codes = np.where(s > 0.8, 4, np.minimum((s / 0.2 + 1e-12).astype(np.int64), 3))
    codes = np.where((s >= 0.6) & (s <= 0.8), 3, codes)
    binned = _singletons(OVERLAP_NAMES, codes)
    full = np.nonzero(s >= 1.0)[0]
    parts = [(np.arange(len(s)), pc.list_flatten(binned)),
             (full, pa.array(["full-lex-overlap"] * len(full), pa.string()))]
    return _merge_rows(parts, len(s))


@register_extractor("overlap_v2", doc="cumulative thresholds lex-overlap>0.5 ... >0.9 on the share of hypothesis "
                                      "tokens found in the premise; full-lex-overlap", unique_rows=True)
def _overlap_thresholds(batch: FeatureBatch) -> pa.ListArray:
    s = batch.overlap_share()
    parts = [(np.nonzero(s > t)[0], f"lex-overlap>{t:g}") for t in OVERLAP_THRESHOLDS]
    parts.append((np.nonzero(s >= 1.0)[0], FULL_OVERLAP))
    return _merge_rows([(rows, pa.array([name] * len(rows), pa.string())) for rows, name in parts], len(s))


@register_extractor("low_overlap_v1", doc="lex-overlap<0.8: fewer than 80% of the hypothesis tokens are in the premise",
                    unique_rows=True)
def _low_overlap(batch: FeatureBatch) -> pa.ListArray:
    rows = np.nonzero(batch.overlap_share() < 0.8)[0]
    return _merge_rows([(rows, pa.array(["lex-overlap<0.8"] * len(rows), pa.string()))], len(batch))


@register_extractor("hypo_only_v1", doc="hypo-only-pred=<label>: a hypothesis-only model's prediction",
                    requires=(HYPO_ONLY_COLUMN,), unique_rows=True)
def _hypo_only(batch: FeatureBatch) -> pa.ListArray:
    pred = batch.column(HYPO_ONLY_COLUMN).to_numpy(zero_copy_only=False).astype(np.int64)
    return _singletons([f"hypo-only-pred={name}" for name in batch.labels], pred)


@register_extractor("null_v1", doc="<null>, present in every row", unique_rows=True)
def _null(batch: FeatureBatch) -> pa.ListArray:
    return _singletons([NULL_FEATURE], np.zeros(len(batch), np.int64))


# ---------------------------------------------------------------------------------------------
# computing feature columns

def _as_list_array(out: object, n_rows: int, name: str) -> pa.ListArray:
    """An extractor's output as list<string>, or list<dictionary<int32, string>> when it gave
    dictionary-encoded values (kept: the chunked path reads their codes)."""
    if isinstance(out, pa.ChunkedArray):
        out = out.combine_chunks()
    if not isinstance(out, (pa.ListArray, pa.LargeListArray)):
        out = pa.array(list(out), pa.list_(pa.string()))  # type: ignore[arg-type]
    if len(out) != n_rows:
        raise ConfigError(f"extractor {name!r} returned {len(out)} rows for a batch of {n_rows}")
    if pa.types.is_dictionary(out.type.value_type) and pa.types.is_string(out.type.value_type.value_type):
        return out.cast(pa.list_(pa.dictionary(pa.int32(), pa.string())))
    return out.cast(pa.list_(pa.string()))


def _decoded(lists: pa.ListArray) -> pa.ListArray:
    return lists.cast(pa.list_(pa.string())) if pa.types.is_dictionary(lists.type.value_type) else lists


def extract_table(table: pa.Table, extractors: Sequence[str], labels: Sequence[str], *,
                  keep_dictionary: bool = False) -> pa.Table:
    """Feature columns (``feat_<name>``, list<string>, unique per row) for a batch of rows.

    ``keep_dictionary``: leave the values an extractor dictionary-encoded (the n-gram extractors do)
    as list<dictionary<int32, string>>; the strings are the same.
    """
    batch = FeatureBatch(table, labels)
    out = {}
    for name in extractors:
        ex = get_extractor(name)
        col = _as_list_array(ex.fn(batch), len(batch), name)
        if not ex.unique_rows:
            col = _unique_per_row(col)
        out[ex.column] = col if keep_dictionary else _decoded(col)
    return pa.table(out)


def _map_batch(table: pa.Table, extractors: Sequence[str], labels: Sequence[str]) -> pa.Table:
    feats = extract_table(table, extractors, labels)
    for col in feats.column_names:
        if col in table.column_names:
            table = table.drop_columns([col])
        table = table.append_column(col, feats.column(col))
    return table


def add_feature_columns(ds, extractors: Sequence[str], labels: Sequence[str], *, batch_size: int = 10_000,
                        num_proc: int | None = None, desc: str = "features", cache_file_name: str | None = None):
    """``ds.map`` that adds one ``feat_<name>`` column per extractor (cached by fingerprint)."""
    for name in extractors:
        ex = get_extractor(name)
        for col in ex.requires:
            if col not in ds.column_names:
                raise ConfigError(f"extractor {name!r} needs the column {col!r}, which the dataset lacks")
    if cache_file_name is not None:  # a cached file cut short or of another length is a miss, not an error
        from ..utils.cache import check_arrow_entry
        if not check_arrow_entry(cache_file_name, len(ds)):  # a file this tool did not record holds the name
            cache_file_name = None
    fmt = ds.format
    out = ds.with_format("arrow").map(
        _map_batch, batched=True, batch_size=batch_size, num_proc=num_proc, desc=desc,
        cache_file_name=cache_file_name,
        fn_kwargs={"extractors": list(extractors), "labels": list(labels)})
    return out.with_format(fmt["type"], columns=None) if fmt["type"] else out.with_format(None)


def feature_columns(ds_or_names) -> list[str]:
    names = ds_or_names if isinstance(ds_or_names, (list, tuple)) else ds_or_names.column_names
    return [c for c in names if c.startswith(FEATURE_PREFIX)]


# ---------------------------------------------------------------------------------------------
# the feature matrix every statistic and filter reads

@dataclasses.dataclass
class FeatureMatrix:
    """Rows x features in CSR form: row i carries ``indices[indptr[i]:indptr[i+1]]``.

    ``vocab[j]`` is the string of feature id j; ids follow the lexicographic order of the strings.
    Matrices built together share one vocabulary.
    """

    indptr: np.ndarray
    indices: np.ndarray
    vocab: np.ndarray  # object array of str
    # the same strings as an Arrow array, when the builder has it (saves converting millions of strings)
    vocab_arrow: pa.Array | None = dataclasses.field(default=None, repr=False, compare=False)

    def vocab_array(self) -> pa.Array:
        """The vocabulary as an Arrow string array."""
        if self.vocab_arrow is None:
            self.vocab_arrow = pa.array(self.vocab.tolist(), pa.string())
        return self.vocab_arrow

    @property
    def n_rows(self) -> int:
        return len(self.indptr) - 1

    @property
    def n_features(self) -> int:
        return len(self.vocab)

    def csr(self):
        import scipy.sparse as sp
        data = np.ones(len(self.indices), dtype=np.float32)
        return sp.csr_matrix((data, self.indices, self.indptr), shape=(self.n_rows, self.n_features))

    def row(self, i: int) -> list[str]:
        return [str(self.vocab[j]) for j in self.indices[self.indptr[i]:self.indptr[i + 1]]]

    def feature_id(self, name: str) -> int:
        if not hasattr(self, "_index"):
            self._index = {str(v): i for i, v in enumerate(self.vocab)}
        if name not in self._index:
            raise KeyError(f"feature {name!r} is not in the vocabulary")
        return self._index[name]

    def select(self, rows: np.ndarray, chunk: int = 1 << 20) -> "FeatureMatrix":
        rows = np.asarray(rows, dtype=np.int64)
        starts, ends = self.indptr[rows], self.indptr[rows + 1]
        lengths = ends - starts
        indptr = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=indptr[1:])
        indices = np.empty(int(indptr[-1]), self.indices.dtype)
        # gather the entries of the selected rows without a Python loop per row, in chunks of rows
        # so that the int64 position array stays small
        for lo in range(0, len(rows), chunk):
            hi = min(lo + chunk, len(rows))
            a, b = indptr[lo], indptr[hi]
            pos = np.repeat(starts[lo:hi] - indptr[lo:hi], lengths[lo:hi]) + np.arange(a, b)
            indices[a:b] = self.indices[pos]
        return FeatureMatrix(indptr, indices, self.vocab, self.vocab_arrow)

    def feature_mask(self, predicate: Callable[[pa.Array], pa.Array]) -> np.ndarray:
        """Boolean mask over the vocabulary, e.g. ``lambda v: pc.ends_with(v, "@hypothesis")``."""
        return predicate(self.vocab_array()).to_numpy(zero_copy_only=False)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        np.savez_compressed(path.with_suffix(".npz"), indptr=self.indptr, indices=self.indices)
        path.with_suffix(".vocab.json").write_text(json.dumps(self.vocab.tolist()))

    @classmethod
    def load(cls, path: str | Path) -> "FeatureMatrix":
        path = Path(path)
        arrays = np.load(path.with_suffix(".npz"))
        vocab = np.array(json.loads(path.with_suffix(".vocab.json").read_text()), dtype=object)
        return cls(arrays["indptr"], arrays["indices"], vocab)


def _list_column(ds, col: str) -> pa.ChunkedArray:
    table = ds.with_format("arrow")[:] if getattr(ds, "_indices", None) is not None else ds.data.table
    return table.column(col)


def build_feature_matrices(datasets: Sequence, columns: Sequence[str] | None = None) -> list[FeatureMatrix]:
    """Feature matrices of several datasets over one shared vocabulary (one dictionary encoding)."""
    if not datasets:
        return []
    cols = list(columns) if columns is not None else feature_columns(datasets[0])
    if not cols:
        raise ConfigError("the dataset has no feature columns (feat_*); run add_features first")
    for ds in datasets:
        missing = [c for c in cols if c not in ds.column_names]
        if missing:
            raise ConfigError(f"a dataset lacks the feature columns {missing}; compute features for every input")
    # per dataset and column: flat values (one piece per chunk) + the row of each value
    pieces, layout = [], []  # layout[d] = [(rows of the column's entries, number of chunks), ...]
    for ds in datasets:
        cols_layout = []
        for col in cols:
            lists = _list_column(ds, col)
            rows, base = [], 0
            for chunk in lists.chunks:
                pieces.append(pc.list_flatten(chunk))
                rows.append(pc.list_parent_indices(chunk).to_numpy().astype(np.int64) + base)
                base += len(chunk)
            cols_layout.append((np.concatenate(rows) if rows else np.zeros(0, np.int64), len(rows)))
        layout.append((cols_layout, len(ds)))
    encoded = pc.dictionary_encode(pa.chunked_array(pieces, pa.string()))
    dictionary = encoded.chunks[-1].dictionary if encoded.num_chunks else pa.array([], pa.string())
    # ids in lexicographic order of the feature strings: independent of row order, and the
    # tie-break "lower id first" of the statistics is the string order
    order = pc.sort_indices(dictionary).to_numpy()
    rank = np.empty(len(order), np.int32)
    rank[order] = np.arange(len(order), dtype=np.int32)
    vocab_arrow = dictionary.take(pa.array(order))
    vocab = np.array(vocab_arrow.to_pylist(), dtype=object)
    # dictionary_encode drops empty chunks (a column with no value in some chunk, e.g. overlap_v2 where
    # no row passes a threshold): split the codes by the pieces' own lengths, not by encoded.chunks
    codes = rank[np.concatenate([c.indices.to_numpy() for c in encoded.chunks])] if encoded.num_chunks \
        else np.zeros(0, np.int32)
    chunk_codes = np.split(codes, np.cumsum([len(p) for p in pieces])[:-1]) if pieces else []
    out, k = [], 0
    for cols_layout, n in layout:
        # CSR without sorting: each column's entries are in row order, so an entry's slot is its
        # row's start, plus what earlier columns put in that row, plus its rank in the column's row
        lens = [np.bincount(r, minlength=n) for r, _ in cols_layout]
        indptr = np.zeros(n + 1, np.int64)
        np.cumsum(np.sum(lens, axis=0) if lens else np.zeros(n, np.int64), out=indptr[1:])
        indices = np.empty(int(indptr[-1]), np.int32)
        filled = indptr[:-1].copy()
        for (r, n_chunks), ln in zip(cols_layout, lens):
            c = np.concatenate(chunk_codes[k:k + n_chunks]) if n_chunks else np.zeros(0, np.int32)
            k += n_chunks
            if len(r):
                first = np.cumsum(ln) - ln  # where each row's entries start inside this column
                indices[filled[r] + np.arange(len(r)) - first[r]] = c
            filled += ln
        out.append(FeatureMatrix(indptr, indices, vocab, vocab_arrow))
    return out


def build_feature_matrix(ds, columns: Sequence[str] | None = None) -> FeatureMatrix:
    return build_feature_matrices([ds], columns)[0]


def describe_extractors(names: Iterable[str]) -> Mapping[str, str]:
    return {n: get_extractor(n).doc for n in names}


# ---------------------------------------------------------------------------------------------
# chunked featurisation: feature strings live one chunk at a time, the rest is integer codes

def interleave_columns(lengths: Sequence[np.ndarray], codes: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``(indptr, indices)`` of rows whose entries are column 0's, then column 1's, ...

    ``lengths[j][r]`` is how many entries column j has in row r; ``codes[j]`` holds column j's
    entries in row order. This is the layout :func:`build_feature_matrices` gives a dataset's
    ``feat_*`` columns (each row: its features column after column, in the column's order).
    """
    n = len(lengths[0]) if lengths else 0
    total_per_row = np.zeros(n, np.int64)
    for ln in lengths:
        total_per_row += ln
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(total_per_row, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), np.int32)
    filled = indptr[:-1].copy()
    for ln, c in zip(lengths, codes):
        ln = ln.astype(np.int64, copy=False)
        if len(c):
            # the entry's slot: its row's next free slot plus its rank among the column's entries of that row
            first = np.cumsum(ln) - ln
            shift = np.repeat(filled - first, ln)
            indices[shift + np.arange(len(c))] = c
        filled += ln
    return indptr, indices


@dataclasses.dataclass
class _Chunk:
    n_rows: int
    lengths: list[np.ndarray]       # per column: entries per row (int32)
    codes: list[np.ndarray]         # per column: entry codes (into ``dictionary`` until finalised)
    dictionary: pa.Array | None     # the chunk's own feature strings (None once finalised)


class ChunkedFeatures:
    """Feature columns of many rows, added a chunk at a time and held as integer codes.

    Each chunk's feature strings are dictionary-encoded when the chunk is added and only the chunk's
    distinct strings are kept; :meth:`finalize` merges those into one vocabulary in the lexicographic
    order of the strings (the order :func:`build_feature_matrices` gives, so ids and tie-breaks are
    the same) and rewrites every chunk's codes as vocabulary ids. :meth:`matrix` then assembles the
    CSR of any run of chunks. Extra columns (e.g. the hypothesis-only prediction, known only after a
    model is fitted on the lexical features) can be put in at their place with :meth:`set_column`.
    """

    def __init__(self, columns: Sequence[str]):
        self.columns = list(columns)
        self.chunks: list[_Chunk] = []
        self.vocab: np.ndarray | None = None
        self.vocab_arrow: pa.Array | None = None

    @property
    def n_rows(self) -> int:
        return sum(c.n_rows for c in self.chunks)

    def add(self, table: pa.Table, columns: Sequence[str] | None = None) -> int:
        """Add a chunk of rows from a table of ``feat_*`` list<string> columns; returns its number.

        ``columns`` (default: all) are read from the table; the others stay empty until set.
        """
        return self.append(self.encode(table, self.columns, columns))

    def append(self, chunk: "_Chunk") -> int:
        """Add a chunk made by :meth:`encode` (e.g. in a worker process)."""
        if self.vocab is not None:
            raise ConfigError("ChunkedFeatures is finalised; add every chunk before finalize()")
        self.chunks.append(chunk)
        return len(self.chunks) - 1

    @staticmethod
    def encode(table: pa.Table, all_columns: Sequence[str], columns: Sequence[str] | None = None) -> "_Chunk":
        """A chunk's feature columns as integer codes into the chunk's own dictionary of strings."""
        present = list(columns) if columns is not None else list(all_columns)
        n = table.num_rows
        lengths, codes, dicts, size = [], [], [], 0
        for col in all_columns:
            if col not in present:
                lengths.append(np.zeros(n, np.int32))
                codes.append(np.zeros(0, np.int32))
                continue
            lists = table.column(col)
            lists = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
            flat = pc.list_flatten(lists)
            lengths.append(pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int32))
            if not pa.types.is_dictionary(flat.type):
                flat = pc.dictionary_encode(flat.cast(pa.string()))
            # each column's codes point into its own dictionary, placed after the previous ones';
            # a string in two dictionaries gets one id when the chunks are merged (finalize)
            codes.append(flat.indices.to_numpy(zero_copy_only=False).astype(np.int32) + size)
            dicts.append(flat.dictionary.cast(pa.string()))
            size += len(flat.dictionary)
        return _Chunk(n, lengths, codes, pa.concat_arrays(dicts) if dicts else pa.array([], pa.string()))

    def finalize(self, extra: Sequence[str] = ()) -> np.ndarray:
        """One vocabulary (strings in lexicographic order) for every chunk, plus ``extra`` strings."""
        dicts = [c.dictionary for c in self.chunks] + [pa.array(list(extra), pa.string())]
        enc = pc.dictionary_encode(pa.concat_arrays(dicts))
        order = pc.sort_indices(enc.dictionary).to_numpy()
        rank = np.empty(len(order), np.int32)
        rank[order] = np.arange(len(order), dtype=np.int32)
        to_vocab = rank[enc.indices.to_numpy(zero_copy_only=False)]
        pos = 0
        for c in self.chunks:
            m = len(c.dictionary)
            local = to_vocab[pos:pos + m]
            c.codes = [local[x] for x in c.codes]
            c.dictionary = None
            pos += m
        self.vocab_arrow = enc.dictionary.take(pa.array(order))
        self.vocab = np.array(self.vocab_arrow.to_pylist(), dtype=object)
        return self.vocab

    def local_matrix(self, chunks: Sequence[int], columns: Sequence[str] | None = None) -> FeatureMatrix:
        """The CSR matrix of some chunks over *their own* vocabulary, before :meth:`finalize`.

        The vocabulary holds only the strings of those chunks (and ``columns``), in lexicographic
        order, so its ids keep the order of the final vocabulary's ids for the same strings: any
        model that reads columns by their strings sees the same matrix it would see after
        :meth:`finalize` (e.g. the hypothesis-only model on D0, started while D_G is still being
        extracted). The chunks are left as they are.
        """
        if self.vocab is not None:
            raise ConfigError("local_matrix() is for chunks that are not finalised yet; use matrix()")
        ids = list(chunks)
        cols = [j for j, c in enumerate(self.columns) if columns is None or c in columns]
        dicts = [self.chunks[i].dictionary for i in ids]
        if not dicts:
            return FeatureMatrix(np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, dtype=object),
                                 pa.array([], pa.string()))
        enc = pc.dictionary_encode(pa.concat_arrays(dicts))
        order = pc.sort_indices(enc.dictionary).to_numpy()
        rank = np.empty(len(order), np.int32)
        rank[order] = np.arange(len(order), dtype=np.int32)
        to_local = rank[enc.indices.to_numpy(zero_copy_only=False)]
        per_chunk = [sum(int(self.chunks[i].codes[j].shape[0]) for j in cols) for i in ids]
        n = sum(self.chunks[i].n_rows for i in ids)
        indptr = np.zeros(n + 1, np.int64)
        indices = np.empty(sum(per_chunk), np.int32)
        row, pos, start = 0, 0, 0
        for i, size in zip(ids, per_chunk):
            c = self.chunks[i]
            local = to_local[start:start + len(c.dictionary)]
            start += len(c.dictionary)
            ptr, ind = interleave_columns([c.lengths[j] for j in cols], [local[c.codes[j]] for j in cols])
            indptr[row + 1:row + c.n_rows + 1] = ptr[1:] + pos
            indices[pos:pos + size] = ind
            row += c.n_rows
            pos += size
        vocab_arrow = enc.dictionary.take(pa.array(order))
        return FeatureMatrix(indptr, indices, np.array(vocab_arrow.to_pylist(), dtype=object), vocab_arrow)

    def feature_id(self, name: str) -> int:
        if self.vocab is None:
            raise ConfigError("finalize() first")
        j = int(np.searchsorted(self.vocab, name))
        if j >= len(self.vocab) or self.vocab[j] != name:
            raise KeyError(f"feature {name!r} is not in the vocabulary")
        return j

    def set_column(self, column: str, chunk: int, lengths: np.ndarray, ids: np.ndarray) -> None:
        """Set one column of one chunk from vocabulary ids (after :meth:`finalize`)."""
        if self.vocab is None:
            raise ConfigError("finalize() first")
        j = self.columns.index(column)
        c = self.chunks[chunk]
        if len(lengths) != c.n_rows or int(np.sum(lengths)) != len(ids):
            raise ConfigError(f"column {column!r} of chunk {chunk}: {len(lengths)} rows and {len(ids)} entries "
                              f"for a chunk of {c.n_rows} rows")
        c.lengths[j] = np.asarray(lengths, np.int32)
        c.codes[j] = np.asarray(ids, np.int32)

    def matrix(self, chunks: Sequence[int] | None = None, columns: Sequence[str] | None = None,
               release: bool = False) -> FeatureMatrix:
        """The CSR matrix of the given chunks (default: all), in chunk order.

        ``columns`` limits the matrix to some columns (in the stored order); ``release`` frees each
        chunk's codes once they are copied (for the last matrix built from them).
        """
        if self.vocab is None:
            raise ConfigError("finalize() first")
        ids = list(range(len(self.chunks))) if chunks is None else list(chunks)
        cols = [j for j, c in enumerate(self.columns) if columns is None or c in columns]
        per_chunk = [sum(int(self.chunks[i].codes[j].shape[0]) for j in cols) for i in ids]
        n = sum(self.chunks[i].n_rows for i in ids)
        indptr = np.zeros(n + 1, np.int64)
        indices = np.empty(sum(per_chunk), np.int32)
        row, pos = 0, 0
        for i, size in zip(ids, per_chunk):
            c = self.chunks[i]
            ptr, ind = interleave_columns([c.lengths[j] for j in cols], [c.codes[j] for j in cols])
            indptr[row + 1:row + c.n_rows + 1] = ptr[1:] + pos
            indices[pos:pos + size] = ind
            row += c.n_rows
            pos += size
            if release:
                c.codes = [np.zeros(0, np.int32) for _ in c.codes]
        return FeatureMatrix(indptr, indices, self.vocab, self.vocab_arrow)
