"""Load prompt/answer rows from local JSON-lines and Parquet files.

How datasets are built (read this to add a kind of dataset, a file format or a procedural source):

* **Row source** (:class:`flowrl.data.sources.RowSource`): where rows come from. An ordered list of
  *blocks* that is cheap to list (1 MiB byte ranges of a JSON-lines file, a Parquet file's row
  groups, an Arrow file's record batches; for a procedural source, ranges of item indices), each
  read on its own as ``(where, row)`` pairs (``where``: ``file:line``, ``file@byte``, ``task#index``,
  quoted by messages; ``row``: a dict, or a :class:`DatasetError` standing for a bad row), plus
  ``head(n)`` (the first rows, read boundedly: what ``flowrl check`` reads) and ``columns()`` (the
  schema where the format has one). :data:`flowrl.data.sources.SOURCES` maps a dataset op's
  catalogue ``handler`` to its opener ``(path, options, which, folder) -> RowSource | None``
  (``which``: ``"train"`` or ``"eval"``); the compiler's check (``check_datasets``) and the runtime
  (:mod:`flowrl.runtime.data`) both open sources through it, so a new source is one opener there and
  one catalogue record (no ``paths``/``file_format`` for a source that is not a file).
* **Row format** (:class:`flowrl.data.rows.RowFormat`): the prompt field or the ``template`` with
  ``{field}`` slots, the answer (and completion) fields, ``system``, ``chat``: turns a source's raw
  row into a training row (or a bad row), the same for every source.
* **Sampling** (:mod:`flowrl.data.sampler`): a split read whole is drawn by :class:`BatchSampler`
  (a seeded permutation per epoch); a streamed one (``stream``) by :class:`StreamSampler` (a seeded
  order of blocks per epoch, ``window`` blocks read and shuffled together; its state, saved in a
  checkpoint, is ``(epoch, window, rows taken)``, so a resumed run continues the same order); a
  ``mix`` by :class:`MixSampler` over its parts' samplers. Held-out splits are read whole.

This module keeps the whole-file readers of ``jsonl`` / ``parquet`` (:func:`load_rows`) and their
head check (:func:`check_head`).

A dataset is a list of rows ``{"prompt": str, <answer fields>...}``. Field names are the
user's (a flow says which field is the prompt and which hold answers); every row is
checked to have them, and a missing file, a malformed line or a missing field raises
``DatasetError`` naming the file, the line (1-based; the row number for Parquet) and
the field, with a hint.

:func:`check_head` checks a file the same way without reading it whole (the first row of a
JSON-lines file, the footer of a Parquet file): ``flowrl check`` runs it on every dataset a
flow names, so a run never starts on a file the runtime would refuse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from flowrl.data.chat import message_problem, prompt_words
from flowrl.userfiles import NOT_REGULAR, open_regular


class DatasetError(ValueError):
    """A dataset that cannot be loaded; the message names file, line and field."""


HEAD_BYTES = 16 * 1024 * 1024
"""What a check reads of a JSON-lines file at most (:func:`check_head`, :func:`head_rows`): a
compile stays small whatever file a flow names."""


def open_data(path: Path):
    """``path`` opened for binary reading, if it is a regular file; else :class:`DatasetError`.

    Opened without blocking and checked once open: a FIFO would block the reader forever, a
    device (``/dev/zero``) never end.
    """
    try:
        return open_regular(path)
    except IsADirectoryError:
        raise DatasetError(f"{path}: is a directory, not a dataset file; hint: name the file itself") from None
    except OSError as e:
        if e.strerror != NOT_REGULAR:
            raise
        raise DatasetError(f"{path}: not a regular file (a pipe, a device or a socket); hint: name a dataset file") \
            from None


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """``(line number, parsed object)`` for every non-blank line; a line that is not UTF-8 or not JSON
    comes as a :class:`DatasetError` in place of its object (:func:`load_rows` applies the policy)."""
    out: list[tuple[int, Any]] = []
    with open_data(path) as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                out.append((lineno, DatasetError(f"{path}:{lineno}: not UTF-8 text ({e.reason}); "
                                                 "hint: a .jsonl file holds one JSON object per line, in UTF-8")))
                continue
            if line.strip():
                try:
                    out.append((lineno, _parse_line(path, lineno, line)))
                except DatasetError as e:
                    out.append((lineno, e))
    return out


def _parse_line(path: Path, lineno: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(
            f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
            "hint: a .jsonl file holds one JSON object per line"
        ) from None


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    """``(row number, row dict)`` for every row (1-based row numbers)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"{path}: reading Parquet needs pyarrow, which is not installed; "
            "fix: `.venv/bin/pip install pyarrow`, or convert the file to .jsonl"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for bad files
        raise DatasetError(f"{path}: not a readable Parquet file ({e}); hint: check the file is complete") from None
    return list(enumerate(table.to_pylist(), start=1))


_READERS: dict[str, Callable[[Path], list[tuple[int, Any]]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_jsonl,  # tolerated: many "JSON" datasets are JSON-lines in practice
    ".parquet": _read_parquet,
}


BAD_ROWS_HINT = 'or give the dataset `bad_rows = "skip"` to skip and count such rows'


def load_rows(
    path: str | Path, *, prompt_field: str = "prompt", answer_fields: tuple[str, ...] | list[str] = ("answer",),
    format: str | None = None, relative_to: str | Path | None = None, chat: bool = False,
    bad_rows: str = "error", check: Callable[[dict], str | None] | None = None, skipped: list | None = None,
) -> list[dict[str, Any]]:
    """All rows of a ``.jsonl`` / ``.parquet`` file, each checked to hold the named fields.

    Returns the rows as dicts with every original field kept. Raises ``DatasetError`` for
    a missing file, an unknown extension, a non-object line, a missing field or a
    non-string prompt; the message names the file, the line and the field. ``format`` (a key of
    the readers, e.g. ``".parquet"``) reads the file as that format whatever its name.
    ``relative_to``: the folder a flow's relative path was resolved against (the folder of the
    flow file that declares the dataset), named by the message if the file is missing. ``chat``:
    the prompt may also be a list of chat messages (:mod:`flowrl.data.chat`).

    Bad rows (not UTF-8, not JSON, not an object, a missing field, an empty or non-string prompt,
    or one ``check(row)`` describes, e.g. too long for the rollout engine): ``bad_rows="error"``
    raises naming the file and row; ``"skip"`` leaves them out and appends their messages to
    ``skipped``. A file without one good row is refused either way.
    """
    p = Path(path)
    reader = _reader(p, format)
    _check_exists(p, relative_to)
    rows = []
    fields = (prompt_field, *answer_fields)
    for lineno, row in reader(p):
        try:
            if isinstance(row, DatasetError):
                raise row
            row = _check_row(f"{p}:{lineno}", row, prompt_field, fields, chat)
            problem = check(row) if check is not None else None
            if problem:
                raise DatasetError(f"{p}:{lineno}: {problem}")
        except DatasetError as bad:
            if bad_rows != "skip":
                raise DatasetError(f"{bad}; {BAD_ROWS_HINT}") from None
            if skipped is not None:
                skipped.append(str(bad))
            continue
        rows.append(row)
    if not rows:
        what = "every row is bad (skipped)" if bad_rows == "skip" and skipped else "dataset is empty"
        raise DatasetError(f"{p}: {what}; hint: a training run needs at least one row")
    return rows


def check_head(
    path: str | Path, *, prompt_field: str = "prompt", answer_fields: tuple[str, ...] | list[str] = ("answer",),
    format: str | None = None, relative_to: str | Path | None = None, chat: bool = False, bad_rows: str = "error",
    template: str = "",
) -> str | None:
    """Check a dataset file as :func:`load_rows` would, reading only its head; return the first prompt.
    ``bad_rows="skip"``: bad leading lines are passed over to the first good one.

    JSON lines: the first non-blank line is parsed and checked (an object with the named
    fields and a string prompt). Parquet: the footer (:mod:`flowrl.data.parquet_footer`,
    no pyarrow) must list the named columns, the prompt's as strings, and at least one row;
    the values themselves are not decoded, so None is returned. Raises ``DatasetError``
    with :func:`load_rows`' messages. A chat prompt is returned as its messages' text
    (:func:`~flowrl.data.chat.prompt_words`: fewer tokens than the rendered prompt).
    With a ``template`` the prompt field is not read: the first row must hold the other fields, and its
    prompt is the template filled (None where the row lacks a slot's field: ``check_datasets`` says so).
    """
    p = Path(path)
    reader = _reader(p, format)
    _check_exists(p, relative_to)
    fields = (prompt_field, *answer_fields)
    if reader is _read_parquet:
        _check_footer(p, None if template else prompt_field, tuple(answer_fields) if template else fields, chat)
        return None
    try:
        with open_data(p) as f:
            left = HEAD_BYTES
            for lineno, raw in enumerate(iter(lambda: f.readline(left + 1), b""), start=1):
                left -= len(raw)
                if left < 0:  # a row (or the bad rows before the first good one) past what a check reads
                    raise DatasetError(f"{p}:{lineno}: no complete good row in the first {HEAD_BYTES:,} bytes; "
                                       "hint: a .jsonl file holds one JSON object per line")
                try:
                    line = raw.decode("utf-8")
                    if not line.strip():
                        continue
                    row = _parse_line(p, lineno, line)
                    if template:
                        return _templated(f"{p}:{lineno}", row, tuple(answer_fields), template)
                    row = _check_row(f"{p}:{lineno}", row, prompt_field, fields, chat)
                    return prompt_words(row[prompt_field])
                except UnicodeDecodeError as e:
                    if bad_rows != "skip":
                        raise DatasetError(f"{p}:{lineno}: not UTF-8 text ({e.reason}); hint: a .jsonl file holds "
                                           f"one JSON object per line, in UTF-8; {BAD_ROWS_HINT}") from None
                except DatasetError as bad:
                    if bad_rows != "skip":
                        raise DatasetError(f"{bad}; {BAD_ROWS_HINT}") from None
    except OSError as e:
        raise DatasetError(f"{p}: cannot read the dataset ({e.strerror})") from None
    raise DatasetError(f"{p}: dataset is empty; hint: a training run needs at least one row")


def head_rows(path: str | Path, *, prompt_field: str = "prompt", fields: tuple[str, ...] = ("answer",),
              format: str | None = None, rows: int = 64, template: str = "") -> list[tuple[str, tuple]]:
    """``(prompt, (value of each of fields))`` of the first ``rows`` rows of a JSON-lines file that
    have a prompt (as :func:`check_head` returns it; a value None where the row has no such field),
    reading no further; rows that are not JSON objects with a non-empty prompt are passed over
    (:func:`check_head` is what reports them). With a ``template`` the prompt is the template filled
    (a row lacking one of its fields is passed over). Parquet files, whose values are not decoded here,
    and files that cannot be read give ``[]``.

    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "d.jsonl")
    >>> _ = open(f, "w").write('{"prompt": "1+1=", "answer": 2}\\nnot json\\n{"prompt": "2+3="}\\n{"prompt": "4="}\\n')
    >>> head_rows(f, rows=2)
    [('1+1=', (2,)), ('2+3=', (None,))]
    """
    p = Path(path)
    if (format or p.suffix.lower()) != ".jsonl":
        return []
    out: list[tuple[str, tuple]] = []
    try:
        with open_data(p) as f:
            left = HEAD_BYTES
            for raw in iter(lambda: f.readline(left + 1), b""):
                left -= len(raw)
                if len(out) >= rows or left < 0:
                    break
                try:
                    row = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    continue
                prompt = row.get(prompt_field) if isinstance(row, dict) else None
                if template and isinstance(row, dict):
                    prompt = _templated("", row, (), template)
                if (isinstance(prompt, str) and prompt.strip()) or (isinstance(prompt, list) and prompt
                                                                    and message_problem(prompt) is None):
                    out.append((prompt_words(prompt), tuple(row.get(k) for k in fields)))
    except (OSError, DatasetError):
        return []
    return out


def not_found_hint(path: Path, relative_to: str | Path | None = None) -> str:
    """Where a missing dataset was looked for, in words: the folder a flow's relative paths are resolved against."""
    if relative_to is not None:
        return f"relative paths are resolved against the folder of the flow file that declares the dataset, {relative_to}"
    if not path.is_absolute():
        return f"the path is relative to the current directory, {Path.cwd()}"
    return ("relative paths in a flow are resolved against the folder of the flow file that declares "
            "the dataset; check the path")


def _reader(p: Path, format: str | None) -> Callable[[Path], list[tuple[int, Any]]]:
    reader = _READERS.get(format or p.suffix.lower())
    if reader is None:
        raise DatasetError(f"{p}: unsupported dataset format {format or p.suffix!r}; use one of {sorted(_READERS)}")
    return reader


def _check_exists(p: Path, relative_to: str | Path | None) -> None:
    if p.is_dir():
        raise DatasetError(f"{p}: is a directory, not a dataset file; hint: name the file itself")
    if p.exists() and not p.is_file():
        raise DatasetError(f"{p}: not a regular file (a pipe, a device or a socket); hint: name a dataset file")
    if not p.is_file():
        raise DatasetError(f"{p}: dataset file not found; hint: {not_found_hint(p, relative_to)}")


def _check_row(where: str, row: Any, prompt_field: str, fields: tuple[str, ...], chat: bool = False) -> dict:
    """``row`` if it is an object with ``fields`` and a usable prompt; else :class:`DatasetError` at ``where`` (``file:line``)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name in fields:
        if name not in row:
            raise DatasetError(
                f"{where}: missing field {name!r}; the row has {sorted(row)}; "
                "hint: name the right field in the flow's dataset (prompt=..., answer=...)"
            )
    prompt = row[prompt_field]
    if isinstance(prompt, list) and chat:
        problem = message_problem(prompt)
        if problem is not None:
            raise DatasetError(f"{where}: field {prompt_field!r} is not a list of chat messages: {problem}; "
                               'hint: write [{"role": "user", "content": "..."}]')
    elif isinstance(prompt, list) and message_problem(prompt) is None:
        raise DatasetError(f"{where}: field {prompt_field!r} holds chat messages; hint: give the dataset "
                           "`chat = true` to render them with the model's chat template")
    elif not isinstance(prompt, str):
        raise DatasetError(
            f"{where}: field {prompt_field!r} must be a string"
            + (" or a list of chat messages" if chat else "") + f", got {type(prompt).__name__}"
        )
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise DatasetError(f"{where}: field {prompt_field!r} is empty; hint: every row needs a prompt")
    return row


def _templated(where: str, row: Any, fields: tuple[str, ...], template: str) -> str | None:
    """A templated dataset's first row: an object with ``fields``; its prompt, the template filled (None where
    a slot's field is missing or the template is malformed: ``check_datasets`` reports those at the template)."""
    import string

    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name in fields:
        if name not in row:
            raise DatasetError(f"{where}: missing field {name!r}; the row has {sorted(row)}; "
                               "hint: name the right field in the flow's dataset (answer=...)")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError:
        return None
    if any(name is not None and name not in row for _, name, _, _ in parts):
        return None
    return "".join(lit + (v if isinstance(v := row[name], str) else json.dumps(v, ensure_ascii=False))
                   if name is not None else lit for lit, name, _, _ in parts)


def _check_footer(p: Path, prompt_field: str | None, fields: tuple[str, ...], chat: bool = False) -> None:
    from flowrl.data.parquet_footer import ParquetFooterError, read_footer

    try:
        footer = read_footer(p)
    except ParquetFooterError as e:
        raise DatasetError(f"{p}: not a readable Parquet file ({e}); hint: check the file is complete") from None
    except OSError as e:
        raise DatasetError(f"{p}: cannot read the dataset ({e.strerror})") from None
    for name in fields:
        if name not in footer.columns:
            raise DatasetError(
                f"{p}: missing field {name!r}; the file has columns {sorted(footer.columns)}; "
                "hint: name the right field in the flow's dataset (prompt=..., answer=...)"
            )
    column = footer.columns[prompt_field] if prompt_field is not None else None  # None: a template writes it
    # chat: a list of {role, content} structs
    if column is not None and not column.string and not (chat and column.kind == "group"):
        raise DatasetError(f"{p}: field {prompt_field!r} must be a string"
                           + (" or a list of chat messages" if chat else "") + f", got a {column.kind} column")
    if footer.num_rows == 0:
        raise DatasetError(f"{p}: dataset is empty; hint: a training run needs at least one row")
