"""docs/language.md shows what the compiler says: each listed section's example, compiled,
prints the section's ```text block (without the quoted source lines).

The codes are those of silent mis-executions turned into diagnostics and of other
languages' syntax; warnings (Wxxx) are checked here too (the catalogue test in
``tests/stdlib`` runs error examples only).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowrl.compiler.pipeline import check_file
from flowrl.diagnostics import FlowError, in_source_order, render_all

DOC = Path(__file__).resolve().parents[2] / "docs" / "language.md"
CODES = ("E001", "E022", "E023", "E024", "E025", "E128", "E129", "E130", "E207", "E208", "E209", "E210", "E213",
         "E218", "E219", "E220", "E221", "E222", "E413", "E416", "E446", "E510", "E511", "E513", "E611", "E613", "E614", "E615", "E616", "W001", "W002")


def _sections() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    parts = re.split(r"^#### ([EW]\d{3})\b.*$", text, flags=re.M)
    out = {}
    for code, body in zip(parts[1::2], parts[2::2]):
        body = body.split("\n### ", 1)[0].split("\n## ", 1)[0]
        flow = re.search(r"```flow\n(.*?)```", body, flags=re.S)
        shown = re.search(r"```text\n(.*?)```", body, flags=re.S)
        if flow and shown:
            out[code] = (flow.group(1), shown.group(1))
    return out


SECTIONS = _sections()


def _printed(example: str, tmp_path, monkeypatch) -> str:
    """What ``flowrl check`` prints for the example, minus the file name and quoted lines."""
    (tmp_path / "example.flow").write_text(example)
    monkeypatch.chdir(tmp_path)
    try:
        graphs = check_file("example.flow")
        diagnostics = in_source_order(dict.fromkeys(w for g in graphs.values() for w in g.warnings))
        rendered = render_all(diagnostics, next(iter(graphs.values())).sources)
    except FlowError as e:
        rendered = e.render()
    keep = [line.removeprefix("example.flow:") for line in rendered.splitlines()
            if line.startswith("example.flow:") or line.startswith("  = ")]
    return "\n".join(keep) + "\n"


@pytest.mark.parametrize("code", CODES)
def test_documented_example_prints_what_the_doc_shows(code, tmp_path, monkeypatch):
    assert code in SECTIONS, f"docs/language.md has no example for {code}"
    example, shown = SECTIONS[code]
    printed = _printed(example, tmp_path, monkeypatch)
    assert f"[{code}]" in printed
    assert printed == shown
