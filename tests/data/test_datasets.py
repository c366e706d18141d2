"""flowrl.data.datasets: JSON-lines / Parquet rows, and errors that name file, line and field."""

import json

import pytest

from flowrl.data.datasets import DatasetError, load_rows


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_rows_keep_every_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+2=", "answer": "3", "id": 7}, "", {"prompt": "2+2=", "answer": "4"}])
    rows = load_rows(path)
    assert rows == [{"prompt": "1+2=", "answer": "3", "id": 7}, {"prompt": "2+2=", "answer": "4"}]


def test_custom_field_names(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "gold": "a", "alt": "b"}])
    assert load_rows(path, prompt_field="question", answer_fields=("gold", "alt"))[0]["alt"] == "b"


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(DatasetError, match=r"nope\.jsonl: dataset file not found"):
        load_rows(tmp_path / "nope.jsonl")


def test_missing_field_names_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}, {"prompt": "c", "solution": "d"}])
    with pytest.raises(DatasetError) as err:
        load_rows(path)
    msg = str(err.value)
    assert f"{path}:2: missing field 'answer'" in msg
    assert "['prompt', 'solution']" in msg and "hint" in msg


def test_bad_json_line_is_located(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}, '{"prompt": "c",'])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: invalid JSON"):
        load_rows(path)


def test_non_object_line_and_non_string_prompt(tmp_path):
    with pytest.raises(DatasetError, match=r":1: expected a JSON object, got list"):
        load_rows(write_jsonl(tmp_path / "a.jsonl", ["[1, 2]"]))
    with pytest.raises(DatasetError, match=r":1: field 'prompt' must be a string, got int"):
        load_rows(write_jsonl(tmp_path / "b.jsonl", [{"prompt": 5, "answer": "5"}]))


def test_unknown_extension_and_empty_file(tmp_path):
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"unsupported dataset format '\.csv'"):
        load_rows(tmp_path / "d.csv")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="dataset is empty"):
        load_rows(tmp_path / "e.jsonl")


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+3="], "answer": ["2", "5"]}), path)
    assert load_rows(path) == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]
    with pytest.raises(DatasetError, match=r"d\.parquet:1: missing field 'gold'"):
        load_rows(path, answer_fields=("gold",))


def test_parquet_without_pyarrow_says_how_to_fix(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"d\.parquet: reading Parquet needs pyarrow.*pip install pyarrow"):
        load_rows(tmp_path / "d.parquet")
