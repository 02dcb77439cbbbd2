import json

import pandas as pd
import pyarrow as pa
import pytest

from debiased_nli.data.loading import load_task, new_rows, parse_data_files
from debiased_nli.utils.errors import ConfigError, InvalidInputError
from debiased_nli.data.tasks import TaskSpec


def test_snli_sample_loads_through_the_user_code_path(shared_data):
    loaded = load_task("snli", data_files=str(shared_data / "snli/train_sample.parquet"))
    ds = loaded.dataset
    assert len(ds) == 20_000
    assert ds.column_names == ["premise", "hypothesis", "label", "uid", "origin", "method"]
    assert ds.features["label"].names == ["entailment", "neutral", "contradiction"]
    assert ds[0]["uid"] == "snli:train:0" and ds[0]["origin"] == "original"
    assert loaded.source["inputs"][0]["sha256"]
    assert loaded.counts == {"loaded": 20_000, "kept": 20_000}


def test_split_syntax_and_other_tasks(shared_data):
    mnli = load_task("mnli", "validation", data_files=[f"validation={shared_data}/mnli/dev_matched.parquet"])
    assert len(mnli.dataset) == 9_815
    fever = load_task("fever", data_files=str(shared_data / "fever_symmetric/v0.1_generated.parquet"))
    row = fever.dataset[0]
    assert row["hypothesis"].startswith("Telemundo is a") and "Telemundo -LRB-" in row["premise"]
    qqp = load_task("qqp", data_files=str(shared_data / "qqp/bimpm_dev.parquet"))
    assert qqp.dataset.features["label"].names == ["not_duplicate", "duplicate"]
    assert sum(qqp.dataset["label"]) == 5000


def test_parse_data_files(tmp_path):
    a = tmp_path / "a.parquet"
    a.write_bytes(b"")
    assert parse_data_files(str(a)) == {"train": [str(a)]}
    assert parse_data_files([f"validation={a}"]) == {"validation": [str(a)]}
    with pytest.raises(ConfigError, match="does not exist"):
        parse_data_files("train=/nope/x.parquet")


def _write(tmp_path, rows, name="bad.jsonl"):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


GOOD = {"premise": "A man sleeps.", "hypothesis": "A person rests.", "label": 0}


@pytest.mark.parametrize("bad,column,value,reason", [
    ({"label": -1}, "label", -1, "no gold label"),
    ({"label": "-"}, "label", "-", "no gold label"),
    ({"label": 7}, "label", 7, "label out of range"),
    ({"hypothesis": ""}, "hypothesis", "", "empty or null text"),
    ({"premise": None}, "premise", None, "empty or null text"),
])
def test_bad_rows_are_named_by_file_row_column_value(tmp_path, bad, column, value, reason):
    rows = [dict(GOOD), dict(GOOD, **bad), dict(GOOD)]
    if column == "label" and isinstance(value, str):
        rows = [dict(r, label=str(r["label"])) for r in rows]
        rows[1]["label"] = value
    path = _write(tmp_path, rows)
    with pytest.raises(InvalidInputError) as err:
        load_task("snli", data_files=path)
    e = err.value
    assert (e.file, e.row, e.column, e.reason) == (path, 1, column, reason)
    assert e.value == value or (value is None and e.value is None) or str(e.value) == str(value)
    assert f"row 1" in str(e) and repr(column) in str(e) and "--on-invalid set_aside" in str(e)
    # set aside instead: counted, written with the reason, nothing lost
    loaded = load_task("snli", data_files=path, on_invalid="set_aside")
    assert len(loaded.dataset) == 2 and len(loaded.set_aside) == 1
    aside = loaded.set_aside[0]
    assert aside["row"] == 1 and aside["reason"] == reason and aside["column"] == column
    assert loaded.counts == {"loaded": 3, "kept": 2, f"set_aside:{reason}": 1}
    assert loaded.dataset["uid"] == ["snli:train:0", "snli:train:2"]


def test_missing_column_names_file_and_columns(tmp_path):
    path = _write(tmp_path, [{"sentence1": "a", "sentence2": "b", "label": 0}], "x.csv")
    with pytest.raises(InvalidInputError, match=r"missing column\(s\) premise \(source column 'premise'\).*sentence1"):
        load_task("snli", data_files=path)
    task = TaskSpec.custom("pairs", ["entailment", "neutral", "contradiction"], premise="sentence1",
                           hypothesis="sentence2")
    assert load_task(task, data_files=path).dataset[0]["premise"] == "a"


def test_duplicate_ids_are_an_error_or_set_aside(tmp_path):
    rows = [dict(GOOD, id="x1"), dict(GOOD, id="x2"), dict(GOOD, id="x1", hypothesis="Other.")]
    path = _write(tmp_path, rows)
    task = TaskSpec.custom("withids", ["entailment", "neutral", "contradiction"], id_column="id")
    with pytest.raises(InvalidInputError, match=r"row 2 .*column 'id', value 'x1': duplicate id"):
        load_task(task, data_files=path)
    loaded = load_task(task, data_files=path, on_invalid="set_aside")
    assert len(loaded.dataset) == 2 and loaded.set_aside[0]["row"] == 2


def test_string_labels_and_label_names_are_accepted(tmp_path):
    rows = [dict(GOOD, label="entailment"), dict(GOOD, label="contradiction"), dict(GOOD, label="1")]
    path = _write(tmp_path, rows)
    assert load_task("snli", data_files=path).dataset["label"] == [0, 2, 1]


def test_multiple_files_number_rows_across_the_split(tmp_path):
    a = _write(tmp_path, [GOOD, GOOD], "a.jsonl")
    b = _write(tmp_path, [GOOD, dict(GOOD, label=9)], "b.jsonl")
    with pytest.raises(InvalidInputError) as err:
        load_task("snli", data_files=[f"train={a}", f"train={b}"])
    assert err.value.file == b and err.value.row == 1
    loaded = load_task("snli", data_files=[f"train={a}", f"train={b}"], on_invalid="set_aside")
    assert loaded.dataset["uid"] == ["snli:train:0", "snli:train:1", "snli:train:2"]
    assert loaded.set_aside[0]["uid"] == "snli:train:3"


def test_new_rows_get_content_hash_uids():
    ds = new_rows("snli", ["P."], ["H."], ["neutral"], origin="generated", method="gpt2")
    again = new_rows("snli", ["P."], ["H."], [1], origin="generated", method="gpt2")
    assert ds[0]["uid"] == again[0]["uid"] and ds[0]["uid"].startswith("gpt2:")
    with pytest.raises(InvalidInputError, match="label 'maybe'"):
        new_rows("snli", ["P."], ["H."], ["maybe"], origin="generated", method="gpt2")


def test_rows_are_taken_from_many_chunks_without_changing_them():
    import datasets
    import numpy as np
    import pyarrow as pa

    from debiased_nli.data.loading import _take_rows, contiguous, materialize

    n = 1000
    full = pa.table({"premise": [f"p{i}" for i in range(n)], "label": list(range(n)),
                     "tags": [[f"t{i}"] * (i % 3) for i in range(n)]})
    # columns cut in different places, as a table read from files and extended column by column is
    cut = pa.table({"premise": pa.chunked_array([full["premise"][:300].combine_chunks(),
                                                 full["premise"][300:].combine_chunks()]),
                    "label": pa.chunked_array([c for c in full["label"].slice(0, 500).chunks] +
                                              [full["label"][500:].combine_chunks()]),
                    "tags": full["tags"]})
    rng = np.random.default_rng(0)
    for positions in (np.arange(0, n, 3), np.concatenate([rng.permutation(400), 400 + rng.permutation(600)]),
                      rng.permutation(n), np.array([999, 0, 500, 299, 300])):
        assert _take_rows(cut, positions).equals(full.take(pa.array(positions)))
    ds = datasets.Dataset(cut, fingerprint="abc")
    one = contiguous(ds)
    assert one._fingerprint == "abc" and one.data.table.equals(full)
    assert all(c.num_chunks == 1 for c in one.data.table.columns)
    assert contiguous(one) is one
    both = datasets.concatenate_datasets([ds.select([5, 1]), ds.select([700, 2])])
    assert materialize(both)["premise"] == ["p5", "p1", "p700", "p2"]


def test_content_uids_of_a_table_are_the_uids_of_its_rows():
    import pyarrow as pa

    from debiased_nli.data.loading import content_uid, content_uids

    names = ["entailment", "neutral", "contradiction"]
    premises = [f"A man {i} is here." for i in range(2500)] + ["Ünïcödé \x1f ok", ""]
    hypotheses = [f"Nobody {i % 7}." for i in range(2500)] + ["x", "y"]
    labels = [i % 3 for i in range(len(premises))]
    table = pa.table({"premise": premises, "hypothesis": hypotheses, "label": labels})
    want = [content_uid(p, h, names[c], prefix="files:x:") for p, h, c in zip(premises, hypotheses, labels)]
    assert content_uids(table, names, "files:x:").to_pylist() == want
    # in chunks hashed by two forked processes, and from a table in several chunks: the same uids
    chunked = pa.concat_tables([table.slice(0, 1000), table.slice(1000)])
    assert content_uids(chunked, names, "files:x:", chunk_rows=700, num_proc=2).to_pylist() == want


def test_content_fingerprint_sees_values_and_nulls_not_arrow_layout():
    import datasets

    from debiased_nli.data.loading import content_fingerprint

    t = pa.table({"a": pa.array(["x", None, "yz", "w"]), "b": pa.array([1, None, 3, 4]),
                  "c": pa.array([[1], [2, 3], None, []])})
    one = datasets.Dataset(t)
    pieces = datasets.Dataset(pa.concat_tables([t.slice(0, 1), t.slice(1, 2), t.slice(3, 1)]))  # 3 chunks, offsets
    assert content_fingerprint(one) == content_fingerprint(pieces)
    assert content_fingerprint(one.select([1, 2])) == content_fingerprint(datasets.Dataset(t.slice(1, 2)))
    empty_not_null = t.set_column(0, "a", pa.array(["x", "", "yz", "w"]))
    for other in (empty_not_null, t.set_column(1, "b", pa.array([1, 0, 3, 4])),
                  t.set_column(2, "c", pa.array([[1], [2, 3], None, [0]])),
                  t.set_column(0, "a", pa.array(["x", None, "y", "zw"]))):  # same bytes, other boundaries
        assert content_fingerprint(datasets.Dataset(other)) != content_fingerprint(one)
