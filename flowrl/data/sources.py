"""Row sources: where a dataset's rows come from, in blocks (see :mod:`flowrl.data.datasets` for the design).

A source lists its blocks without reading rows (file sizes, Parquet footers, Arrow schemas and
batch lengths) and reads one block at a time, so a run can stream a file of any size
(:class:`~flowrl.data.sampler.StreamSampler`) and ``flowrl check`` reads its head only.

* :class:`JsonlFiles`: JSON-lines files; a block is :data:`BLOCK_BYTES` of a file (the rows that
  *start* in it). A row longer than :data:`MAX_ROW_BYTES` is a bad row, never read whole.
* :class:`ParquetFiles`: a block is a row group.
* :class:`ArrowFiles`: the Arrow files `datasets`' ``save_to_disk`` writes (IPC streams), memory-mapped
  and read as data (no code runs: no loading script, no ``trust_remote_code``, no hub); a block is
  :data:`ARROW_BLOCK_ROWS` rows.

:func:`hf_files` finds the files of a split of an ``hf_dataset(path)``: a ``save_to_disk``
directory (a DatasetDict's ``dataset_dict.json`` and split folders, or one Dataset's
``state.json``), a folder of shards named after their split (``train-00000-of-00002.parquet``,
``test.jsonl``, ``train/part-0.parquet``), or a glob.
:data:`SOURCES` maps a dataset op's catalogue ``handler`` to its opener.
"""

from __future__ import annotations

import glob as globlib
import json
import os
from array import array
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from flowrl.data import reasoning_gym
from flowrl.data.datasets import HEAD_BYTES, DatasetError, _parse_line, not_found_hint, open_data
from flowrl.userfiles import read_bounded

class MissingData(DatasetError):
    """A dataset path or glob that names nothing (``flowrl check``: E601)."""


class MissingSplit(DatasetError):
    """A split a dataset does not have (``flowrl check``: E663, at the option naming it)."""


BLOCK_BYTES = 1 << 20
"""A JSON-lines block: the rows starting in these many bytes of a file."""
MAX_ROW_BYTES = 16 << 20
"""The longest JSON-lines row read (a longer one is a bad row, skipped over in pieces)."""
ARROW_BLOCK_ROWS = 1000
"""An Arrow block: these many rows of a file (`datasets` writes record batches of 1000 rows)."""

Block = tuple[int, int]
"""``(file index, block index within the file)``; a procedural source may use ``(0, range index)``."""
Row = tuple[str, Any]
"""``(where, row)``: where the row is (``file:line``, ``file@byte N``), for messages; the row a dict, or a
:class:`DatasetError` standing for a row that could not be parsed."""


class RowSource(Protocol):
    """Rows in blocks (see :mod:`flowrl.data.datasets`)."""

    name: str
    """What messages call the source (a path, a glob)."""

    def blocks(self) -> list[Block]:
        """Every block, in the source's order; listed without reading rows."""

    def read(self, block: Block) -> Iterator[Row]:
        """The rows of one block, in order."""

    def rows(self) -> Iterator[Row]:
        """Every row in order (a whole read: JSON lines are numbered by line)."""

    def head(self, n: int) -> list[Row]:
        """The first ``n`` rows (fewer if the source has fewer), reading a bounded amount."""

    def columns(self) -> tuple[str, ...] | None:
        """The fields every row has, where the format declares them (Parquet, Arrow); None for JSON lines."""

    def nbytes(self) -> int:
        """Bytes on disk (what ``stream = "auto"`` decides by); 0 for a source that is not files."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise DatasetError(f"{path}: cannot read the dataset ({e.strerror})") from None


class JsonlFiles:
    """JSON-lines files as blocks of :data:`BLOCK_BYTES` (``block_bytes``)."""

    def __init__(self, files: list[Path], name: str | None = None, block_bytes: int = BLOCK_BYTES) -> None:
        self.files, self.block_bytes = list(files), block_bytes
        self.name = name or ", ".join(map(str, self.files))
        self.bytes_read = 0
        """Bytes read so far (what streaming tests and the benchmark assert on)."""

    def nbytes(self) -> int:
        return sum(_size(f) for f in self.files)

    def blocks(self) -> list[Block]:
        return [(i, k) for i, f in enumerate(self.files) for k in range(-(-_size(f) // self.block_bytes))]

    def columns(self) -> tuple[str, ...] | None:
        return None

    def _lines(self, f, start: int, stop: int | None) -> Iterator[tuple[int, bytes | None]]:
        """``(offset, line)`` of the lines starting in ``[start, stop)``; None for a line over
        :data:`MAX_ROW_BYTES` (read past in pieces)."""
        pos = start
        if start > 0:  # the row that started before `start` belongs to an earlier block
            f.seek(start - 1)
            while True:
                piece = f.readline(MAX_ROW_BYTES)
                self.bytes_read += len(piece)
                if not piece or piece.endswith(b"\n"):
                    break
            pos = f.tell()
        while stop is None or pos < stop:
            line = f.readline(MAX_ROW_BYTES + 1)
            if not line:
                return
            self.bytes_read += len(line)
            at = pos
            if len(line) > MAX_ROW_BYTES:
                while not line.endswith(b"\n"):
                    line = f.readline(MAX_ROW_BYTES)
                    self.bytes_read += len(line)
                    if not line:
                        break
                pos = f.tell()
                yield at, None
                continue
            pos += len(line)
            yield at, line

    def _row(self, where: str, path: Path, lineno: int | None, raw: bytes | None) -> Row | None:
        if raw is None:
            return where, DatasetError(f"{where}: a row longer than {MAX_ROW_BYTES:,} bytes; hint: a .jsonl file "
                                       "holds one JSON object per line")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return where, DatasetError(f"{where}: not UTF-8 text ({e.reason}); hint: a .jsonl file holds one JSON "
                                       "object per line, in UTF-8")
        if not line.strip():
            return None
        try:
            return where, json.loads(line)
        except json.JSONDecodeError as e:
            return where, DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); hint: a .jsonl file "
                                       "holds one JSON object per line")

    def read(self, block: Block) -> Iterator[Row]:
        i, k = block
        path = self.files[i]
        with open_data(path) as f:
            start = k * self.block_bytes
            for at, raw in self._lines(f, start, start + self.block_bytes):
                row = self._row(f"{path}@byte {at}", path, None, raw)
                if row is not None:
                    yield row

    def window(self, blocks: list[Block]) -> "JsonlWindow":
        """The rows of ``blocks`` as bytes, parsed one by one when drawn (what a streamed run holds)."""
        return JsonlWindow(self, blocks)

    def rows(self) -> Iterator[Row]:
        for path in self.files:
            with open_data(path) as f:
                for lineno, (_, raw) in enumerate(self._lines(f, 0, None), start=1):
                    row = self._row(f"{path}:{lineno}", path, lineno, raw)
                    if row is not None:
                        yield row

    def head(self, n: int) -> list[Row]:
        out: list[Row] = []
        for path in self.files:
            start = self.bytes_read
            with open_data(path) as f:
                for lineno, (_, raw) in enumerate(self._lines(f, 0, None), start=1):
                    row = self._row(f"{path}:{lineno}", path, lineno, raw)
                    if row is not None:
                        out.append(row)
                    if len(out) >= n or self.bytes_read - start > HEAD_BYTES:
                        return out
        return out


class JsonlWindow:
    """Rows of some blocks of JSON-lines files, held as their bytes in one buffer and an offset, a file and a
    position per row (about 20 bytes a row beyond the text); :meth:`get` parses one."""

    def __init__(self, source: JsonlFiles, blocks: list[Block]) -> None:
        self.source = source
        self.buf = bytearray()
        self.starts, self.at, self.file = array("Q"), array("Q"), array("I")
        self.long: set[int] = set()  # rows over MAX_ROW_BYTES: bad rows, their bytes not kept
        for i, k in blocks:
            with open_data(source.files[i]) as f:
                start = k * source.block_bytes
                for at, raw in source._lines(f, start, start + source.block_bytes):
                    if raw is not None and not raw.strip():
                        continue
                    if raw is None:
                        self.long.add(len(self.starts))
                    self.starts.append(len(self.buf))
                    self.at.append(at)
                    self.file.append(i)
                    self.buf += raw or b""
        self.ends = len(self.buf)

    def __len__(self) -> int:
        return len(self.starts)

    def get(self, n: int) -> Row:
        end = self.starts[n + 1] if n + 1 < len(self.starts) else self.ends
        raw = None if n in self.long else bytes(self.buf[self.starts[n]:end])
        path = self.source.files[self.file[n]]
        return self.source._row(f"{path}@byte {self.at[n]}", path, None, raw)


class ParquetFiles:
    """Parquet files; a block is a row group (rows numbered from 1 per file in messages)."""

    def __init__(self, files: list[Path], name: str | None = None) -> None:
        self.files = list(files)
        self.name = name or ", ".join(map(str, self.files))
        self.rows_read = 0

    def _open(self, path: Path):
        pq = _pyarrow("parquet", path)
        try:
            return pq.ParquetFile(open_data(path))
        except DatasetError:
            raise
        except Exception as e:  # pyarrow raises several unrelated types for bad files
            raise DatasetError(f"{path}: not a readable Parquet file ({e}); hint: check the file is complete") from None

    def nbytes(self) -> int:
        return sum(_size(f) for f in self.files)

    def blocks(self) -> list[Block]:
        out = []
        for i, f in enumerate(self.files):
            with self._open(f) as pf:
                out += [(i, g) for g in range(pf.metadata.num_row_groups)]
        return out

    def columns(self) -> tuple[str, ...] | None:
        """The first file's top-level columns, from its footer (no pyarrow: ``flowrl check`` imports none)."""
        from flowrl.data.parquet_footer import ParquetFooterError, read_footer

        for f in self.files[:1]:
            try:
                return tuple(sorted(read_footer(f).columns))
            except ParquetFooterError as e:
                raise DatasetError(f"{f}: not a readable Parquet file ({e}); hint: check the file is complete") from None
            except OSError as e:
                raise DatasetError(f"{f}: cannot read the dataset ({e.strerror})") from None
        return None

    def read(self, block: Block) -> Iterator[Row]:
        i, g = block
        path = self.files[i]
        with self._open(path) as pf:
            first = sum(pf.metadata.row_group(j).num_rows for j in range(g)) + 1
            rows = pf.read_row_group(g).to_pylist()
        self.rows_read += len(rows)
        for n, row in enumerate(rows, start=first):
            yield f"{path}:{n}", row

    def rows(self) -> Iterator[Row]:
        for block in self.blocks():
            yield from self.read(block)

    def head(self, n: int) -> list[Row]:
        out: list[Row] = []
        for path in self.files:
            with self._open(path) as pf:
                for batch in pf.iter_batches(batch_size=max(1, n - len(out))):
                    out += [(f"{path}:{len(out) + j + 1}", r) for j, r in enumerate(batch.to_pylist())]
                    break
            if len(out) >= n:
                break
        return out[:n]


class ArrowFiles:
    """Arrow IPC files (`datasets`' ``save_to_disk``), memory-mapped; a block is :data:`ARROW_BLOCK_ROWS` rows."""

    def __init__(self, files: list[Path], name: str | None = None) -> None:
        self.files = list(files)
        self.name = name or ", ".join(map(str, self.files))
        self._tables: dict[int, Any] = {}
        self.rows_read = 0

    def _table(self, i: int):
        if i not in self._tables:
            pa = _pyarrow("", self.files[i])
            path = self.files[i]
            try:
                source = pa.memory_map(str(path), "r")
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_file(source).read_all()
            except (OSError, pa.ArrowException) as e:
                raise DatasetError(f"{path}: not a readable Arrow file ({e}); hint: write it with `datasets`' "
                                   "save_to_disk") from None
            self._tables = {i: table}  # one file mapped at a time
        return self._tables[i]

    def nbytes(self) -> int:
        return sum(_size(f) for f in self.files)

    def blocks(self) -> list[Block]:
        return [(i, k) for i in range(len(self.files))
                for k in range(-(-self._table(i).num_rows // ARROW_BLOCK_ROWS))]

    def columns(self) -> tuple[str, ...] | None:
        return tuple(sorted(self._table(0).schema.names)) if self.files else None

    def read(self, block: Block) -> Iterator[Row]:
        i, k = block
        rows = self._table(i).slice(k * ARROW_BLOCK_ROWS, ARROW_BLOCK_ROWS).to_pylist()
        self.rows_read += len(rows)
        for n, row in enumerate(rows, start=k * ARROW_BLOCK_ROWS + 1):
            yield f"{self.files[i]}:{n}", row

    def rows(self) -> Iterator[Row]:
        for block in self.blocks():
            yield from self.read(block)

    def head(self, n: int) -> list[Row]:
        out: list[Row] = []
        for i, path in enumerate(self.files):
            rows = self._table(i).slice(0, n - len(out)).to_pylist()
            out += [(f"{path}:{j}", r) for j, r in enumerate(rows, start=1)]
            if len(out) >= n:
                break
        return out


def _pyarrow(module: str, path: Path):
    try:
        if module == "parquet":
            import pyarrow.parquet as pq

            return pq
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401 - pa.ipc

        return pa
    except ImportError:
        raise DatasetError(f"{path}: reading it needs pyarrow, which is not installed; "
                           "fix: `.venv/bin/pip install pyarrow`, or convert the data to .jsonl") from None


# ---- hf_dataset: which files hold a split ----------------------------------------------------------------

SHARD_SUFFIXES = {".parquet": ParquetFiles, ".jsonl": JsonlFiles, ".json": JsonlFiles, ".arrow": ArrowFiles}
"""Shard files by suffix -> their source (a folder of shards holds one kind)."""
GLOB_CHARS = "*?["


def is_glob(path: str) -> bool:
    return any(c in path for c in GLOB_CHARS)


def hf_files(path: str | Path, split: str) -> tuple[list[Path], str]:
    """The files of ``split`` of an ``hf_dataset(path)`` and their kind (a :data:`SHARD_SUFFIXES` key), sorted;
    :class:`DatasetError` naming what was looked for and what is there."""
    text = str(path)
    if is_glob(text):
        files = sorted(Path(p) for p in globlib.glob(text, recursive=True) if os.path.isfile(p))
        if not files:
            raise MissingData(f"{text}: no file matches the glob; hint: {not_found_hint(Path(text))}")
        return files, _one_kind(files, text)
    p = Path(text)
    if p.is_file():
        return [p], _one_kind([p], text)
    if not p.is_dir():
        raise MissingData(f"{p}: dataset not found; hint: {not_found_hint(p)}")
    if (p / "dataset_dict.json").is_file():
        splits = _json(p / "dataset_dict.json").get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DatasetError(f"{p / 'dataset_dict.json'}: no list of splits; hint: write it with `datasets`' "
                               "DatasetDict.save_to_disk")
        if split not in splits:
            raise MissingSplit(f"{p}: the DatasetDict has no split {split!r}; its splits: {', '.join(splits)}")
        return _saved_dataset(p / split, split), ".arrow"
    if (p / "state.json").is_file():
        return _saved_dataset(p, split), ".arrow"
    shards = sorted(f for f in p.rglob("*") if f.suffix.lower() in SHARD_SUFFIXES and f.is_file()
                    and not any(part.startswith(".") for part in f.relative_to(p).parts))
    if not shards:
        raise DatasetError(f"{p}: holds no `datasets` save_to_disk files (dataset_dict.json, state.json) nor "
                           f"shards ({', '.join(sorted(SHARD_SUFFIXES))}); hint: name a folder written by "
                           "save_to_disk, or a glob of shards")
    matched = [f for f in shards if _in_split(f.relative_to(p), split)]
    if matched:
        return matched, _one_kind(matched, str(p))
    named = sorted({s for f in shards for s in KNOWN_SPLITS if _in_split(f.relative_to(p), s)})
    if not named and split == "train":  # shards without split names: all of them are the training split
        return shards, _one_kind(shards, str(p))
    raise MissingSplit(f"{p}: no shards of split {split!r} (shards are named `{split}-00000-of-00001.parquet`, "
                       f"`{split}.jsonl` or put in `{split}/`); splits found: "
                       f"{', '.join(named) or 'none (shards without split names are the train split)'}")


SPLIT_SEPARATORS = "-_."


def _in_split(rel: Path, split: str) -> bool:
    """Whether a shard (its path below the dataset's folder) belongs to ``split``: it is in a folder of that
    name, or its name starts with it and ``-``, ``_`` or ``.`` (HF's ``train-00000-of-00004.parquet``)."""
    if len(rel.parts) > 1:
        return rel.parts[0] == split
    return any(rel.name.startswith(split + c) for c in SPLIT_SEPARATORS)


KNOWN_SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")
"""Split names that make a folder's shards split by name (a folder whose shards name none of these, and not
the split asked for, is all training split)."""


def _one_kind(files: list[Path], where: str) -> str:
    kinds = {f.suffix.lower() for f in files}
    unknown = kinds - set(SHARD_SUFFIXES)
    if unknown:
        raise DatasetError(f"{where}: unsupported dataset format {sorted(unknown)[0]!r}; use one of "
                           f"{sorted(SHARD_SUFFIXES)}")
    if len({SHARD_SUFFIXES[k] for k in kinds}) > 1:
        raise DatasetError(f"{where}: mixes shard formats ({', '.join(sorted(kinds))}); hint: a split's shards are "
                           "of one format")
    return sorted(kinds)[0]


def _json(path: Path) -> dict:
    try:
        value = json.loads(read_bounded(path, 16 << 20))
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not readable JSON ({e}); hint: write it with `datasets`' save_to_disk") from None
    if not isinstance(value, dict):
        raise DatasetError(f"{path}: not a JSON object; hint: write it with `datasets`' save_to_disk")
    return value


def _saved_dataset(folder: Path, split: str) -> list[Path]:
    """The Arrow files of one saved Dataset (its ``state.json``'s ``_data_files``)."""
    state = _json(folder / "state.json")
    saved_split = state.get("_split")
    if folder.parent.joinpath("dataset_dict.json").is_file() is False and saved_split not in (None, split):
        raise MissingSplit(f"{folder}: a Dataset saved alone, of split {saved_split!r}, not {split!r}; hint: name "
                           f"split = \"{saved_split}\", or save a DatasetDict with both splits")
    names = [d.get("filename") for d in state.get("_data_files") or [] if isinstance(d, dict)]
    if not names or not all(isinstance(n, str) and "/" not in n and n not in ("", ".", "..") for n in names):
        raise DatasetError(f"{folder / 'state.json'}: lists no data files; hint: write it with `datasets`' "
                           "save_to_disk")
    files = [folder / n for n in names]
    for f in files:
        if not f.is_file():
            raise DatasetError(f"{f}: listed in {folder / 'state.json'} but missing; hint: copy the whole "
                               "save_to_disk folder")
    return files


def files_source(files: list[Path], kind: str, name: str) -> RowSource:
    return SHARD_SUFFIXES[kind](files, name)


# ---- openers: a dataset op's handler -> its sources ------------------------------------------------------

Opener = Callable[[str, dict, str, str], "RowSource | None"]
"""``(path, options, which, folder) -> source``: ``path`` as the flow wrote it or resolved, ``options`` the
constructor's plain options, ``which`` ``"train"`` or ``"eval"`` (None: no such split), ``folder`` the folder
relative paths are resolved against."""


def _resolve(path: str, folder: str) -> str:
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(folder, path))


def _open_file(suffix: str, path: str, options: dict, which: str, folder: str) -> RowSource | None:
    name = path if which == "train" else str(options.get("eval") or "")
    if not name:
        return None
    p = Path(_resolve(name, folder))
    if p.is_dir():
        raise DatasetError(f"{p}: is a directory, not a dataset file; hint: name the file itself")
    if not p.is_file():
        raise MissingData(f"{p}: dataset file not found; hint: {not_found_hint(p, folder)}")
    return SHARD_SUFFIXES[suffix]([p], str(p))


def jsonl(path: str, options: dict, which: str, folder: str) -> RowSource | None:
    """``jsonl(path, eval = ...)``: one JSON-lines file per split."""
    return _open_file(".jsonl", path, options, which, folder)


def parquet(path: str, options: dict, which: str, folder: str) -> RowSource | None:
    """``parquet(path, eval = ...)``: one Parquet file per split."""
    return _open_file(".parquet", path, options, which, folder)


def hf_dataset(path: str, options: dict, which: str, folder: str) -> RowSource | None:
    """``hf_dataset(path, split = ..., eval = ...)``: ``eval`` a split name, or a glob (a file) where ``path`` is
    one."""
    resolved = _resolve(path, folder)
    if which == "train":
        split = str(options.get("split") or "train")
        files, kind = hf_files(resolved, split)
        return files_source(files, kind, f"{path} (split {split!r})" if not is_glob(path) else path)
    ev = str(options.get("eval") or "")
    if not ev:
        return None
    if is_glob(path) or is_glob(ev) or os.path.isfile(resolved):  # `eval` names files too
        files, kind = hf_files(_resolve(ev, folder), "train")
        return files_source(files, kind, ev)
    files, kind = hf_files(resolved, ev)
    return files_source(files, kind, f"{path} (split {ev!r})")


SOURCES: dict[str, Opener] = {f.__name__: f for f in (jsonl, parquet, hf_dataset, reasoning_gym.reasoning_gym)}
"""A dataset op's catalogue ``handler`` -> its opener (:data:`Opener`), each named after the handler it serves."""


__all__ = ["ArrowFiles", "BLOCK_BYTES", "Block", "JsonlFiles", "MAX_ROW_BYTES", "MissingData", "MissingSplit",
           "Opener", "ParquetFiles", "Row", "RowSource", "SOURCES", "files_source", "hf_dataset", "hf_files", "is_glob", "jsonl", "parquet"]
