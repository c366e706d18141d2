"""docs/builder.md runs: its Python blocks execute as a file next to the repository's data."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "builder.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_every_python_block_of_the_builder_doc_runs(tmp_path, capsys):
    found = blocks()
    assert len(found) == 3
    (tmp_path / "data").symlink_to(ROOT / "data")  # the example's declarations name data/arith/*.jsonl
    for i, code in enumerate(found):
        path = tmp_path / f"example{i}.py"
        path.write_text(code)
        runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert "main 2 ['policy', 'grpo.ref']" in out and "schedule main on cluster(nodes = 1, gpus_per_node = 1) {" in out
