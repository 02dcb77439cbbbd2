import json

import pandas as pd
import pytest

from debiased_nli.data import load_task, new_rows, parse_data_files
from debiased_nli.errors import ConfigError, InvalidInputError
from debiased_nli.tasks import TaskSpec


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
