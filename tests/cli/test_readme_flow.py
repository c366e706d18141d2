"""The README's first flow compiles as printed (placed in flows/, where its relative paths point)."""

from __future__ import annotations

import re
from pathlib import Path

from flowrl.compiler.pipeline import compile_text

ROOT = Path(__file__).resolve().parents[2]


def test_readme_first_flow_compiles():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"## A first flow\n\n```\n(.*?)```", text, re.S)
    assert m, "README lost its 'A first flow' section"
    g = compile_text(m.group(1), str(ROOT / "flows" / "readme_first.flow"))
    assert g.node("grpo.update").model == "policy"
    assert any(n.kind.value == "resync" for n in g.nodes())  # the compiler closed the loop
