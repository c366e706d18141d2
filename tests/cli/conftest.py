"""Fixtures for the CLI tests: flow files written to tmp_path."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture
def write_flow(tmp_path: Path) -> Callable[[str, str], Path]:
    """``write_flow(name, text)`` -> the path of a new file under tmp_path."""

    def write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    return write
