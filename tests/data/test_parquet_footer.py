"""A Parquet file's schema and row count from its footer alone, against what pyarrow wrote."""

from __future__ import annotations

import pytest

from flowrl.data.parquet_footer import ParquetFooterError, read_footer, read_footer_bytes

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TABLE = {
    "prompt": ["1+1=", "2+3=", "7+7="],
    "answer": ["2", "5", "14"],
    "n": [1, 2, 3],
    "score": [0.5, 1.0, 0.0],
    "tags": [["a"], [], ["b", "c"]],
    "meta": [{"x": 1, "y": "a"}, {"x": 2, "y": "b"}, {"x": 3, "y": "c"}],
    "raw": [b"x", b"y", b"z"],
}


@pytest.mark.parametrize("options", [{}, {"compression": "none"}, {"compression": "gzip", "row_group_size": 1},
                                     {"use_dictionary": False, "write_statistics": False},
                                     {"version": "1.0"}])
def test_columns_and_rows_match_pyarrow(tmp_path, options):
    table = pa.table(TABLE).append_column("big", pa.array(["u", "v", "w"], type=pa.large_string()))
    pq.write_table(table, tmp_path / "t.parquet", **options)
    footer = read_footer(tmp_path / "t.parquet")
    assert footer.num_rows == 3 == pq.ParquetFile(tmp_path / "t.parquet").metadata.num_rows
    assert list(footer.columns) == table.column_names  # top level only, in order
    strings = {name for name, c in footer.columns.items() if c.string}
    assert strings == {"prompt", "answer", "big"}  # what pyarrow reads back as str
    kinds = {name: c.kind for name, c in footer.columns.items()}
    assert kinds["n"] == "INT64" and kinds["score"] == "DOUBLE" and kinds["raw"] == "BYTE_ARRAY"
    assert kinds["tags"] == kinds["meta"] == "group"


def test_many_row_groups_are_not_decoded(tmp_path):
    n = 20_000
    pq.write_table(pa.table({"prompt": [str(i) for i in range(n)], "answer": ["x"] * n}), tmp_path / "big.parquet",
                   row_group_size=10)  # 2,000 row groups after the schema in the footer
    assert read_footer(tmp_path / "big.parquet").num_rows == n


def test_empty_table(tmp_path):
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    footer = read_footer(tmp_path / "e.parquet")
    assert footer.num_rows == 0 and footer.columns["prompt"].string


def test_broken_files(tmp_path):
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "ok.parquet")
    data = (tmp_path / "ok.parquet").read_bytes()
    (tmp_path / "text.parquet").write_text('{"prompt": "a"}\n')
    with pytest.raises(ParquetFooterError, match="does not start with PAR1"):
        read_footer(tmp_path / "text.parquet")
    with pytest.raises(ParquetFooterError, match="does not end with PAR1"):
        read_footer_bytes(data[:-3])
    cut = data[:-8 - 5] + data[-8:]  # footer bytes lost: the length no longer matches
    with pytest.raises(ParquetFooterError):
        read_footer_bytes(cut)
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")  # the footer's first byte
    garbled = data[:start] + b"\xff" * 16 + data[start + 16:]  # the schema: an integer that never ends
    with pytest.raises(ParquetFooterError):
        read_footer_bytes(garbled)
    # Only the schema and row count are decoded: bytes after them (row groups) are never read.
    assert read_footer_bytes(data[:-40] + bytes(32) + data[-8:]).num_rows == 1
    encrypted = data[:-4] + b"PARE"
    (tmp_path / "enc.parquet").write_bytes(encrypted)
    with pytest.raises(ParquetFooterError, match="encrypted"):
        read_footer(tmp_path / "enc.parquet")
