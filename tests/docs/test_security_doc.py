"""docs/security.md stays true: every test it names exists (file, and the test function where it names
one), every module and diagnostic code it names is real, and each promise section names a test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"
TEXT = DOC.read_text()


def _tests(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")}


def test_every_test_the_doc_names_exists():
    cited = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", TEXT)
    assert len(cited) >= 15, cited
    missing = [f"{f}::{t}" if t else f for f, t in cited
               if not (ROOT / f).is_file() or (t and t not in _tests(ROOT / f))]
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"


def test_every_test_function_the_doc_names_by_itself_exists():
    names = set(re.findall(r"`(test_\w+)`", TEXT))
    every = set().union(*(_tests(p) for p in (ROOT / "tests").rglob("test_*.py")))
    assert names and not names - every, sorted(names - every)


def test_every_module_the_doc_names_exists():
    modules = re.findall(r"`(flowrl/[\w/]+\.py)", TEXT)
    assert modules and not [m for m in modules if not (ROOT / m).is_file()]


def test_every_code_the_doc_names_is_reported_by_flowrl():
    codes = set(re.findall(r"\bE\d{3}\b", TEXT))
    source = "\n".join(p.read_text() for p in (ROOT / "flowrl").rglob("*.py"))
    assert codes and not [c for c in sorted(codes) if f'"{c}"' not in source], codes


def test_each_promise_names_its_tests():
    sections = re.split(r"^## ", TEXT, flags=re.M)[1:]
    assert len(sections) >= 5
    for section in sections:
        assert re.search(r"`tests/[\w/]+\.py", section), f"section `{section.splitlines()[0]}` names no test"
