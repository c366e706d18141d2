"""parse -> fmt -> parse gives the same IR, for every shipped flow (the formatter is semantics-preserving)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.compiler.pipeline import check_file
from flowrl.ir.printer import print_graph
from flowrl.syntax.fmt import format_source

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p.relative_to(ROOT) for p in [*ROOT.glob("stdlib/*.flow"), *ROOT.glob("flows/*.flow")])


def _graphs(rel: Path) -> dict:
    return check_file(rel)  # every shipped flow is accepted by check (tests/docs/test_shipped_flows.py runs them)


@pytest.mark.parametrize("rel", FILES, ids=str)
def test_fmt_preserves_ir(rel, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    before = {k: print_graph(g) for k, g in _graphs(rel).items()}
    formatted = format_source((ROOT / rel).read_text(), str(rel))
    assert format_source(formatted, str(rel)) == formatted  # idempotent
    # Same directory, so relative imports and paths resolve the same way.
    copy = ROOT / rel.parent / f".fmt-{rel.name}"
    copy.write_text(formatted)
    try:
        after = {k: print_graph(g) for k, g in _graphs(copy.relative_to(ROOT)).items()}
    finally:
        copy.unlink()
    assert after == before


def test_there_are_shipped_flows():
    assert len(FILES) >= 10
