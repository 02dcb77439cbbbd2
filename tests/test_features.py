import datasets
import numpy as np
import pyarrow as pa
import pytest

from debiased_nli.utils.errors import ConfigError
from debiased_nli.bias.features import (OVERLAP_NAMES, FeatureMatrix, add_feature_columns, build_feature_matrices,
                                        build_feature_matrix, extract_table, register_extractor, tokenize)
from debiased_nli.bias.task_features import add_features

LEXICAL = ["unigram_v1", "bigram_v1", "hypo_len_v1", "len_ratio_v1", "overlap_v1", "low_overlap_v1", "null_v1"]


def features_of(premise, hypothesis, extractors=LEXICAL):
    table = pa.table({"premise": [premise], "hypothesis": [hypothesis]})
    out = extract_table(table, extractors, ["entailment", "neutral", "contradiction"])
    return {c: out.column(c)[0].as_py() for c in out.column_names}


def test_tokenisation_is_as_documented():
    assert tokenize("Nobody's here, 'tis the dogs' ball!") == ["nobody's", "here", "tis", "the", "dogs", "ball"]
    assert tokenize("...") == []
    assert tokenize("Café  AU lait") == ["café", "au", "lait"]


def test_features_of_a_crafted_pair_are_exactly_as_documented():
    f = features_of("A man is sleeping on a sofa.", "Nobody is sleeping.")
    assert f["feat_unigram_v1"] == ["a@premise", "man@premise", "is@premise", "sleeping@premise", "on@premise",
                                    "sofa@premise", "nobody@hypothesis", "is@hypothesis", "sleeping@hypothesis"]
    assert f["feat_bigram_v1"] == ["a man@premise", "man is@premise", "is sleeping@premise", "sleeping on@premise",
                                   "on a@premise", "a sofa@premise", "nobody is@hypothesis", "is sleeping@hypothesis"]
    assert f["feat_hypo_len_v1"] == ["hypo-len<5"]             # 3 tokens
    assert f["feat_len_ratio_v1"] == ["len-ratio0.25-0.5"]     # 3 / 7
    assert f["feat_overlap_v1"] == ["lex-overlap0.6-0.8"]      # 2 of 3 hypothesis tokens in the premise
    assert f["feat_low_overlap_v1"] == ["lex-overlap<0.8"]
    assert f["feat_null_v1"] == ["<null>"]


@pytest.mark.parametrize("premise,hypothesis,overlap,ratio,length", [
    ("A dog runs.", "A dog runs.", ["lex-overlap>0.8", "full-lex-overlap"], "len-ratio>=1", "hypo-len<5"),
    ("Two kids play in the park today.", "Two kids play outside in the park", ["lex-overlap>0.8"],
     "len-ratio>=1", "hypo-len5-9"),
    ("A b c d e f g h i j", "x y z w v u t s r q p o n m l", ["lex-overlap<0.2"], "len-ratio>=1", "hypo-len15-19"),
    ("one two three four five six seven eight nine ten eleven twelve thirteen", "one two x", ["lex-overlap0.6-0.8"],
     "len-ratio<0.25", "hypo-len<5"),
])
def test_bins(premise, hypothesis, overlap, ratio, length):
    f = features_of(premise, hypothesis)
    assert f["feat_overlap_v1"] == overlap
    assert f["feat_len_ratio_v1"] == [ratio]
    assert f["feat_hypo_len_v1"] == [length]


def test_repeated_words_count_once_per_row():
    f = features_of("the the the", "a a b a")
    assert f["feat_unigram_v1"] == ["the@premise", "a@hypothesis", "b@hypothesis"]
    assert f["feat_bigram_v1"] == ["the the@premise", "a a@hypothesis", "a b@hypothesis", "b a@hypothesis"]


def test_register_a_versioned_extractor():
    @register_extractor("negation_test_v1")
    def negation(batch):
        return [["negation"] if {"no", "not", "nobody", "never"} & set(t) else []
                for t in batch.tokens("hypothesis").to_pylist()]

    assert features_of("A man.", "Nobody is here.", ["negation_test_v1"]) == {"feat_negation_test_v1": ["negation"]}
    with pytest.raises(ConfigError, match="must carry a version"):
        register_extractor("negation")
    with pytest.raises(ConfigError, match="already registered"):
        register_extractor("negation_test_v1")(negation)


def test_feature_matrix_shares_vocab_and_selects_rows():
    a = datasets.Dataset.from_dict({"premise": ["A b.", "C d."], "hypothesis": ["B.", "E."]})
    b = datasets.Dataset.from_dict({"premise": ["Z."], "hypothesis": ["B."]})
    a = add_feature_columns(a, ["unigram_v1"], ["x", "y"])
    b = add_feature_columns(b, ["unigram_v1"], ["x", "y"])
    fa, fb = build_feature_matrices([a, b])
    assert fa.vocab is fb.vocab and list(fa.vocab) == sorted(fa.vocab)
    assert fb.row(0) == ["z@premise", "b@hypothesis"]
    sub = fa.select(np.array([1]))
    assert sub.row(0) == ["c@premise", "d@premise", "e@hypothesis"]
    assert fa.csr().shape == (2, len(fa.vocab))


def test_feature_matrix_save_and_load(tmp_path):
    ds = add_feature_columns(datasets.Dataset.from_dict({"premise": ["A b."], "hypothesis": ["B."]}),
                             ["unigram_v1"], ["x"])
    fm = build_feature_matrix(ds)
    fm.save(tmp_path / "fm")
    back = FeatureMatrix.load(tmp_path / "fm")
    assert back.row(0) == fm.row(0)


def test_add_features_is_cached_and_hypothesis_only_is_out_of_fold(shared_data):
    from debiased_nli.data.loading import load_task

    ds = load_task("snli", data_files=str(shared_data / "snli/train_sample.parquet"), max_rows=3000).dataset
    out, hyp = add_features(ds, "snli", progress=False)
    again, hyp2 = add_features(ds, "snli", progress=False)
    assert out.cache_files and out.cache_files[0]["filename"] == again.cache_files[0]["filename"]
    np.testing.assert_array_equal(hyp.predictions, hyp2.predictions)
    assert 0.4 < hyp.accuracy < 0.8  # far from the ~100% a model tested on its own training rows would get
    assert set(out.column_names) >= {"feat_unigram_v1", "feat_hypo_only_v1", "hypo_only_pred"}
    labels = ["entailment", "neutral", "contradiction"]
    assert out[0]["feat_hypo_only_v1"] == [f"hypo-only-pred={labels[out[0]['hypo_only_pred']]}"]


def test_large_string_columns_are_featurised_like_strings():
    table = pa.table({"premise": pa.array(["A dog runs."], pa.large_string()),
                      "hypothesis": pa.array(["Nobody runs."], pa.large_string())})
    out = extract_table(table, LEXICAL, ["entailment", "neutral", "contradiction"])
    assert out.column("feat_unigram_v1")[0].as_py() == features_of("A dog runs.", "Nobody runs.")["feat_unigram_v1"]


@pytest.mark.parametrize("premise,hypothesis,share,expected", [
    # 19 of 20 hypothesis tokens in the premise: s = 0.95 passes every threshold but full overlap
    (" ".join(f"w{i}" for i in range(20)), " ".join(f"w{i}" for i in range(19)) + " new", 0.95,
     ["lex-overlap>0.5", "lex-overlap>0.6", "lex-overlap>0.7", "lex-overlap>0.8", "lex-overlap>0.9"]),
    ("A dog runs in the park.", "A dog runs.", 1.0,
     ["lex-overlap>0.5", "lex-overlap>0.6", "lex-overlap>0.7", "lex-overlap>0.8", "lex-overlap>0.9",
      "full-lex-overlap"]),
    ("one two three four five", "one two three four x", 0.8,                  # 0.8 is not > 0.8
     ["lex-overlap>0.5", "lex-overlap>0.6", "lex-overlap>0.7"]),
    ("one two three", "one two x y", 0.5, []),                                # 0.5 is not > 0.5
    ("A b c", "x y z", 0.0, []),
])
def test_overlap_v2_thresholds_are_cumulative(premise, hypothesis, share, expected):
    # Wu et al. (2022), Table 12: "lex-overlap> 0.8" and "lex-overlap> 0.9" are both top features of
    # SNLI's entailment rows, so a row with overlap 0.95 must carry both
    f = features_of(premise, hypothesis, ["overlap_v2"])
    assert f["feat_overlap_v2"] == expected


def test_overlap_v2_counts_nest_and_overlap_v1_is_unchanged(shared_data):
    import pandas as pd

    df = pd.read_parquet(shared_data / "snli" / "train_sample.parquet").head(3000)
    table = pa.table({"premise": df.premise.tolist(), "hypothesis": df.hypothesis.tolist()})
    out = extract_table(table, ["overlap_v1", "overlap_v2"], ["entailment", "neutral", "contradiction"])
    v1, v2 = out.column("feat_overlap_v1").to_pylist(), out.column("feat_overlap_v2").to_pylist()
    count = {name: sum(name in row for row in v2) for name in
             ["lex-overlap>0.5", "lex-overlap>0.6", "lex-overlap>0.7", "lex-overlap>0.8", "lex-overlap>0.9",
              "full-lex-overlap"]}
    values = list(count.values())
    assert all(a >= b for a, b in zip(values, values[1:])) and values[-1] > 0
    # v1 stays the binned extractor old releases were built with: exactly one bin per row (+ full overlap),
    # and its ">0.8" bin holds the same rows as v2's ">0.8" threshold
    assert all(len([x for x in row if x != "full-lex-overlap"]) == 1 for row in v1)
    assert [("lex-overlap>0.8" in a) for a in v1] == [("lex-overlap>0.8" in b) for b in v2]
    assert [("full-lex-overlap" in a) for a in v1] == [("full-lex-overlap" in b) for b in v2]
    assert {x for row in v1 for x in row} <= set(OVERLAP_NAMES) | {"full-lex-overlap"}


def test_feature_matrices_of_chunked_columns_with_empty_chunks():
    # a feature column whose values are empty in a whole chunk (no row passes any overlap_v2 threshold)
    cols = {"premise": ["A dog runs.", "x y", "one two", "A cat sits."],
            "hypothesis": ["A dog runs.", "p q", "three four", "A cat sits."]}
    ds = add_feature_columns(datasets.Dataset.from_dict(cols), ["overlap_v2", "null_v1"],
                             ["entailment", "neutral", "contradiction"], batch_size=1)  # one Arrow chunk per row
    fm = build_feature_matrix(ds)
    rows = [sorted(fm.row(i)) for i in range(4)]
    assert rows[1] == rows[2] == ["<null>"]
    assert "full-lex-overlap" in rows[0] and "full-lex-overlap" in rows[3]


ODD_TEXTS = ["Nobody's here, 'tis", "x' 'y", "  a  b ", "'''", "a\tb\nc", "Ça va? Ünïcödé — ok!!", "", "5 , 6",
             "it's  'quoted'  ", "a ' b", "''a''b''", "日本語 テキスト", "x -- y", " lead", "trail ", "a,b", "a , , b"]


def _nli_texts(shared_data) -> pa.Array:
    import pyarrow.parquet as pq

    texts = []
    for name in ("snli/train_sample.parquet", "snli/dev.parquet"):
        t = pq.read_table(shared_data / name, columns=["premise", "hypothesis"])
        texts += t.column("premise").to_pylist() + t.column("hypothesis").to_pylist()
    return pa.array(texts + ODD_TEXTS, pa.string())


def test_the_separator_pattern_gives_the_text_of_the_plain_one(shared_data):
    # the tokeniser's fast pattern leaves single spaces alone; every other run is replaced as the plain
    # pattern "[^\pL\pN']+" -> " " would, so the text (and every token) is the same
    import pyarrow.compute as pc

    from debiased_nli.bias.features import _SEPARATOR_RUNS

    texts = pc.utf8_lower(_nli_texts(shared_data))
    assert pc.replace_substring_regex(texts, _SEPARATOR_RUNS, " ").equals(
        pc.replace_substring_regex(texts, r"[^\pL\pN']+", " "))


def test_extractors_that_promise_unique_rows_never_repeat_a_feature(shared_data):
    from debiased_nli.bias.features import _EXTRACTORS, HYPO_ONLY_COLUMN, _as_list_array, _unique_per_row, FeatureBatch

    texts = _nli_texts(shared_data)
    n = len(texts) // 2
    table = pa.table({"premise": texts[:n], "hypothesis": texts[n:2 * n],
                      HYPO_ONLY_COLUMN: pa.array(np.arange(n) % 3, pa.int64())})
    batch = FeatureBatch(table, ["entailment", "neutral", "contradiction"])
    promised = [e for e in _EXTRACTORS.values() if e.unique_rows]
    assert {e.name for e in promised} >= {"unigram_v1", "bigram_v1", "overlap_v2", "null_v1"}
    for ex in promised:
        col = _as_list_array(ex.fn(batch), n, ex.name)
        assert _unique_per_row(col).equals(col), ex.name
    # the one built-in that does repeat (a token of both sides) is deduplicated by extract_table
    assert not _EXTRACTORS["unigram_pair_v1"].unique_rows
    assert features_of("a dog", "a cat", ["unigram_pair_v1"])["feat_unigram_pair_v1"] == ["a@pair", "dog@pair",
                                                                                          "cat@pair"]


def test_first_occurrences_keep_the_first_of_each_key_in_a_row():
    import pandas as pd

    from debiased_nli.bias.features import _first_occurrences

    rng = np.random.default_rng(0)
    rows = np.sort(rng.integers(0, 500, 20_000))
    keys = rows * 1000 + rng.integers(0, 30, len(rows))  # many repeats inside rows
    np.testing.assert_array_equal(_first_occurrences(keys), ~pd.Series(keys).duplicated().to_numpy())
    assert _first_occurrences(np.zeros(0, np.int64)).shape == (0,)
