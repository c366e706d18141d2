"""Load prompt/answer rows from local JSON-lines and Parquet files.

A dataset is a list of rows ``{"prompt": str, <answer fields>...}``. Field names are the
user's (a flow says which field is the prompt and which hold answers); every row is
checked to have them, and a missing file, a malformed line or a missing field raises
``DatasetError`` naming the file, the line (1-based; the row number for Parquet) and
the field, with a hint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


class DatasetError(ValueError):
    """A dataset that cannot be loaded; the message names file, line and field."""


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """``(line number, parsed object)`` for every non-blank line."""
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                    "hint: a .jsonl file holds one JSON object per line"
                ) from None
    return out


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


def load_rows(
    path: str | Path, *, prompt_field: str = "prompt", answer_fields: tuple[str, ...] | list[str] = ("answer",)
) -> list[dict[str, Any]]:
    """All rows of a ``.jsonl`` / ``.parquet`` file, each checked to hold the named fields.

    Returns the rows as dicts with every original field kept. Raises ``DatasetError`` for
    a missing file, an unknown extension, a non-object line, a missing field or a
    non-string prompt; the message names the file, the line and the field.
    """
    p = Path(path)
    reader = _READERS.get(p.suffix.lower())
    if reader is None:
        raise DatasetError(f"{p}: unsupported dataset format {p.suffix!r}; use one of {sorted(_READERS)}")
    if not p.is_file():
        raise DatasetError(f"{p}: dataset file not found; hint: paths are relative to {Path.cwd()}")
    rows = []
    fields = (prompt_field, *answer_fields)
    for lineno, row in reader(p):
        if not isinstance(row, dict):
            raise DatasetError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
        for name in fields:
            if name not in row:
                raise DatasetError(
                    f"{p}:{lineno}: missing field {name!r}; the row has {sorted(row)}; "
                    "hint: name the right field in the flow's dataset (prompt=..., answer=...)"
                )
        if not isinstance(row[prompt_field], str):
            raise DatasetError(
                f"{p}:{lineno}: field {prompt_field!r} must be a string, got {type(row[prompt_field]).__name__}"
            )
        rows.append(row)
    if not rows:
        raise DatasetError(f"{p}: dataset is empty; hint: a training run needs at least one row")
    return rows
