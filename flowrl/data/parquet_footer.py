"""A Parquet file's row count and top-level columns, read from its footer alone.

``flowrl check`` checks a Parquet dataset without pyarrow: importing ``pyarrow.parquet``
takes about 0.3 s, most of what a whole check may take. The footer holds everything the
check needs: the row count and the schema (each column's name, physical type and whether
it is a UTF-8 string). It is the file's ``FileMetaData`` struct, Thrift compact protocol,
written just before its last 8 bytes (footer length, little-endian u32, then ``PAR1``).
Only the schema and row count are decoded; the row groups after them are never read.

Format: https://github.com/apache/parquet-format (``parquet.thrift``: ``FileMetaData``
fields 2 ``schema`` and 3 ``num_rows``; ``SchemaElement`` fields 1 ``type``, 4 ``name``,
5 ``num_children``, 6 ``converted_type``, 10 ``logicalType``).

>>> try:
...     read_footer_bytes(b"PAR1" + b"x" * 8)
... except ParquetFooterError as e:
...     print(e)
it does not end with PAR1, the mark of a Parquet file
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"PAR1"
BYTE_ARRAY = 6
"""``Type.BYTE_ARRAY``: the physical type of strings."""
UTF8 = 0
"""``ConvertedType.UTF8``."""
MAX_FOOTER = 64 << 20
"""Footers longer than this are refused as corrupt (real ones are kilobytes to megabytes)."""


class ParquetFooterError(ValueError):
    """A file whose Parquet footer cannot be read."""


@dataclass(frozen=True)
class Column:
    name: str
    string: bool
    """Stored as UTF-8 strings (read back as ``str``)."""
    kind: str
    """The physical type in words (``BYTE_ARRAY``, ``INT64``, ``group`` for nested columns)."""


@dataclass(frozen=True)
class Footer:
    num_rows: int
    columns: dict[str, Column]
    """Top-level columns by name, in schema order."""


_TYPES = ("BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY")


def read_footer(path: str | Path) -> Footer:
    """The footer of the Parquet file at ``path``; :class:`ParquetFooterError` if it has none."""
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(0, 2)
        size = f.tell()
        if size < 12 or head != MAGIC:
            raise ParquetFooterError("it does not start with PAR1, the mark of a Parquet file")
        f.seek(size - 8)
        tail = f.read(8)
        length = struct.unpack("<I", tail[:4])[0]
        if tail[4:] == b"PARE":
            raise ParquetFooterError("its footer is encrypted; flowrl reads plain Parquet files")
        if tail[4:] != MAGIC:
            raise ParquetFooterError("it does not end with PAR1, the mark of a Parquet file")
        if length > min(size - 12, MAX_FOOTER):
            raise ParquetFooterError(f"its footer length ({length} bytes) does not fit the file ({size} bytes)")
        f.seek(size - 8 - length)
        return parse_metadata(f.read(length))


def read_footer_bytes(data: bytes) -> Footer:
    """:func:`read_footer` of a whole file held in memory."""
    if len(data) < 12 or data[-4:] != MAGIC:
        raise ParquetFooterError("it does not end with PAR1, the mark of a Parquet file")
    length = struct.unpack("<I", data[-8:-4])[0]
    if length > len(data) - 12:
        raise ParquetFooterError(f"its footer length ({length} bytes) does not fit the file ({len(data)} bytes)")
    return parse_metadata(data[-8 - length:-8])


def parse_metadata(data: bytes) -> Footer:
    """Decode the schema and row count of a serialized ``FileMetaData``."""
    r = _Compact(data)
    try:
        fields = r.struct(stop_after={2, 3})
    except (IndexError, struct.error, RecursionError):
        raise ParquetFooterError("its footer is truncated or corrupt") from None
    schema, rows = fields.get(2), fields.get(3)
    if not isinstance(schema, list) or not schema or not isinstance(rows, int):
        raise ParquetFooterError("its footer has no schema or row count")
    return Footer(rows, _top_level(schema))


def _top_level(schema: list) -> dict[str, Column]:
    """Top-level columns of a flattened schema tree (depth first; element 0 is the root)."""
    columns: dict[str, Column] = {}
    i = 1
    for _ in range(int(schema[0].get(5, 0))):
        if i >= len(schema):
            raise ParquetFooterError("its schema is truncated")
        el = schema[i]
        name = bytes(el.get(4, b"")).decode("utf-8", "replace")
        children = int(el.get(5, 0) or 0)
        physical = el.get(1)
        logical = el.get(10) if isinstance(el.get(10), dict) else {}
        string = not children and physical == BYTE_ARRAY and (el.get(6) == UTF8 or 1 in logical)
        kind = "group" if children else (_TYPES[physical] if isinstance(physical, int) and 0 <= physical < 8
                                         else "unknown")
        columns[name] = Column(name, string, kind)
        i = _skip(schema, i)
    return columns


def _skip(schema: list, i: int) -> int:
    """Index just past element ``i`` and its descendants."""
    pending = 1
    while pending:
        if i >= len(schema):
            raise ParquetFooterError("its schema is truncated")
        pending += int(schema[i].get(5, 0) or 0) - 1
        i += 1
    return i


class _Compact:
    """A reader of Thrift's compact protocol: structs become ``{field id: value}`` dicts."""

    def __init__(self, data: bytes):
        self.b, self.i = data, 0

    def byte(self) -> int:
        v = self.b[self.i]
        self.i += 1
        return v

    def varint(self) -> int:
        out = shift = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 70:
                raise ParquetFooterError("its footer holds a malformed integer")

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def binary(self) -> bytes:
        n = self.varint()
        if self.i + n > len(self.b):
            raise IndexError(n)
        out = self.b[self.i:self.i + n]
        self.i += n
        return out

    def value(self, t: int, depth: int):
        if depth > 32:
            raise ParquetFooterError("its footer nests too deep")
        if t in (1, 2):  # a bool field's value is its type; a bool list element is a byte
            return t == 1
        if t == 3:
            return struct.unpack("b", bytes([self.byte()]))[0]
        if t in (4, 5, 6):
            return self.zigzag()
        if t == 7:
            v = struct.unpack("<d", self.b[self.i:self.i + 8])[0]
            self.i += 8
            return v
        if t == 8:
            return self.binary()
        if t in (9, 10):
            header = self.byte()
            size, et = header >> 4, header & 0x0F
            if size == 15:
                size = self.varint()
            if et in (1, 2):
                return [self.byte() == 1 for _ in range(size)]
            return [self.value(et, depth + 1) for _ in range(size)]
        if t == 11:
            size = self.varint()
            if not size:
                return {}
            kv = self.byte()
            return {self._key(self.value(kv >> 4, depth + 1)): self.value(kv & 0x0F, depth + 1) for _ in range(size)}
        if t == 12:
            return self.struct(depth=depth + 1)
        raise ParquetFooterError(f"its footer holds an unknown Thrift type {t}")

    @staticmethod
    def _key(k):
        return k if not isinstance(k, (list, dict)) else repr(k)

    def struct(self, depth: int = 0, stop_after: set[int] | None = None) -> dict:
        fields: dict = {}
        last = 0
        while True:
            header = self.byte()
            if header == 0:
                return fields
            t, delta = header & 0x0F, header >> 4
            fid = last + delta if delta else self.zigzag()
            last = fid
            fields[fid] = self.value(t, depth)
            if stop_after is not None and stop_after <= fields.keys():
                return fields  # what the caller needs is read: the rest (row groups) is never decoded


__all__ = ["Footer", "Column", "ParquetFooterError", "read_footer", "read_footer_bytes", "parse_metadata"]
