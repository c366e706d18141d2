"""Source hygiene, read from the AST of every file: what a linter would catch and a test run might not.

- A module or class that defines one name twice silently keeps the last one (stop 18's CI
  failed on exactly that: a test helper re-defined with another signature shadowed the first).
- flowrl has no import cycles, not even through imports inside functions.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("flowrl", "tests", "bench", "docs") for p in (ROOT / d).rglob("*.py"))
# A second def of the same name is intended only for these decorators.
REDEFINING_DECORATORS = {"setter", "deleter", "overload", "register"}


def _decorator_names(node) -> set[str]:
    names = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _defined_twice(body: list[ast.stmt], where: str) -> list[str]:
    counts = Counter(n.name for n in body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and not _decorator_names(n) & REDEFINING_DECORATORS)
    found = [f"{where}: {name!r} is defined {k} times" for name, k in counts.items() if k > 1]
    for n in body:
        if isinstance(n, ast.ClassDef):
            found += _defined_twice(n.body, f"{where}, class {n.name}")
    return found


def test_no_module_or_class_defines_a_name_twice():
    found = []
    for path in SOURCES:
        found += _defined_twice(ast.parse(path.read_text()).body, str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """Every flowrl module ``path`` imports, at any depth (functions included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != module:
                out.add(t)
    return out


def test_flowrl_has_no_import_cycles():
    paths = {_module_name(p): p for p in (ROOT / "flowrl").rglob("*.py")}
    graph = nx.DiGraph()
    for module, path in paths.items():
        graph.add_node(module)
        for target in _imports(path, module, set(paths)):
            # a package's __init__ importing its own submodules is not a cycle through the package
            if not target.startswith(module + "."):
                graph.add_edge(module, target)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles[:20])

