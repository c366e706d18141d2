"""User code a flow names as ``"module:attribute"``: where the module is, and what it defines.

``python_reward("rewards:score")``, ``python_env("tools:Calculator")`` and
``call("filters:keep", ...)`` name a module and an attribute of it. The module is looked for,
in this order, by ``flowrl check`` and by the runtime alike:

1. the folder of the flow file that names it (a ``rewards.py`` next to the flow is found);
2. each folder of ``PYTHONPATH``;
3. the interpreter's own path (installed packages): ``importlib.util.find_spec`` of the
   *top-level* name only (finding ``a`` runs no code of it, finding ``a.b`` would import
   ``a``), then the rest of a dotted name below the folders it names.

:func:`find_module` answers without importing anything, :func:`defined_names` reads the
module's source with :mod:`ast` (never running it), and :func:`import_module_from` is the
runtime's import, with the flow file's folder first on ``sys.path``. Plain standard library:
nothing here imports torch, Ray or an engine.

>>> split_ref("my_pkg.rewards:score")
('my_pkg.rewards', 'score')
>>> sorted(defined_names_of_source("import os as o\\nfrom x import y\\ndef f(): pass\\nclass C: pass\\nA, B = 1, 2")[0])
['A', 'B', 'C', 'f', 'o', 'y']
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from flowrl.userfiles import read_bounded


class RefError(ValueError):
    """A reference that is not ``"module:attribute"``."""


def split_ref(ref: str) -> tuple[str, str]:
    """``"pkg.mod:name"`` -> ``("pkg.mod", "name")``; :class:`RefError` unless both are dotted identifiers."""
    module, sep, attr = ref.partition(":")
    if not sep or not _dotted(module) or not _dotted(attr):
        raise RefError(f"`{ref}` is not of the form \"module:attribute\" (e.g. \"my_rewards:score\")")
    return module, attr


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


@dataclass(frozen=True)
class Found:
    """Where a module was found."""

    source: Path | None
    """Its ``.py`` file (a package's ``__init__.py``); None when it has no Python source to
    read (a compiled extension, a built-in module, a namespace package)."""
    where: str
    """Which place on the search path found it, in words."""


def search_folders(folder: str | Path | None) -> list[tuple[str, Path]]:
    """The folders looked in before the interpreter's path, labelled: the flow file's folder, then ``PYTHONPATH``."""
    out = [(f"the flow file's folder {folder}", Path(folder))] if folder else []
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry:
            out.append((f"PYTHONPATH entry {entry}", Path(entry)))
    return out


def looked_in(folder: str | Path | None) -> str:
    """Where :func:`find_module` looks, in words (for error messages; the same whatever the
    environment holds, so diagnostics read the same on every machine)."""
    first = f"the flow file's folder {folder}, then " if folder else ""
    return f"{first}the folders on PYTHONPATH, then installed packages"


def find_module(module: str, folder: str | Path | None) -> Found | None:
    """Where ``module`` (dotted) would be imported from, without importing it; None if nowhere."""
    parts = module.split(".")
    for label, root in search_folders(folder):
        hit = _below([root], parts)
        if hit is not None:
            return Found(hit if hit.suffix == ".py" else None, label)
    try:
        spec = importlib.util.find_spec(parts[0])  # top level only: runs no code of the package
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    where = "installed packages"
    if len(parts) == 1:
        origin = Path(spec.origin) if spec.origin and spec.has_location else None
        return Found(origin if origin is not None and origin.suffix == ".py" else None, where)
    roots = [Path(p) for p in (spec.submodule_search_locations or ())]
    hit = _below(roots, parts[1:]) if roots else None
    return None if hit is None else Found(hit if hit.suffix == ".py" else None, where)


def _below(roots: list[Path], parts: list[str]) -> Path | None:
    """The file (or namespace-package folder) of ``parts`` under one of ``roots``."""
    for root in roots:
        base = root.joinpath(*parts[:-1])
        if len(parts) > 1 and not base.is_dir():
            continue
        last = base / parts[-1]
        if (last / "__init__.py").is_file():
            return last / "__init__.py"
        if (base / f"{parts[-1]}.py").is_file():
            return base / f"{parts[-1]}.py"
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if (base / f"{parts[-1]}{suffix}").is_file():
                return base / f"{parts[-1]}{suffix}"
        if last.is_dir():
            return last  # a namespace package: no source of its own
    return None


MODULE_MAX_BYTES = 64 << 20
"""The largest module source read for its names (a regular file only: never a pipe or a device)."""


def defined_names(path: Path) -> tuple[set[str], bool]:
    """Names a module's source binds at top level, and whether any other name may exist too
    (``from x import *`` or a module ``__getattr__``). Reads, never runs, the file;
    :class:`SyntaxError` / :class:`OSError` if it cannot be read."""
    return defined_names_of_source(read_bounded(path, MODULE_MAX_BYTES).decode("utf-8"), str(path))


def defined_names_of_source(text: str, filename: str = "<module>") -> tuple[set[str], bool]:
    names: set[str] = set()
    open_ended = False
    todo = list(ast.parse(text, filename).body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name.split(".")[0]) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name == "*":
                    open_ended = True
                else:
                    names.add(a.asname or a.name)
        elif isinstance(node, _BLOCKS):
            # Bindings inside top-level blocks count (``try: import x except ImportError: x = None``).
            for block in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, block, ()) or ())
    return names, open_ended or "__getattr__" in names


_BLOCKS = (ast.If, ast.Try, ast.With, ast.For, ast.While, ast.ExceptHandler) + \
    ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


@dataclass(frozen=True)
class Params:
    """What a function's ``def`` says about its positional parameters (read from source, not run)."""

    required: int
    """Positional parameters without a default."""
    total: int
    """Positional parameters (with or without a default)."""
    star: bool
    """It takes ``*args``."""
    is_async: bool
    line: int

    def takes(self, count: int) -> bool:
        """Whether a call with ``count`` positional arguments fits."""
        return self.required <= count and (self.star or count <= self.total)


def function_params(path: Path, name: str) -> Params | None:
    """The positional parameters of the top-level ``def name`` in the module at ``path``; None when
    the module binds ``name`` otherwise (an import, an assignment, a class) or not at all.

    >>> import tempfile; f = Path(tempfile.mkdtemp()) / "m.py"; _ = f.write_text("async def run(client, row, k=1): pass")
    >>> p = function_params(f, "run"); (p.required, p.total, p.is_async, p.takes(2), p.takes(4))
    (2, 3, True, True, False)
    """
    tree = ast.parse(read_bounded(path, MODULE_MAX_BYTES).decode("utf-8"), str(path))
    found = None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            found = node  # the last definition wins, as when the module runs
        elif isinstance(node, (ast.ClassDef, ast.Assign, ast.Import, ast.ImportFrom)) and name in \
                {getattr(node, "name", None)} | {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
                {a.asname or a.name for a in getattr(node, "names", ())}:
            found = None
    if found is None:
        return None
    a = found.args
    positional = len(a.posonlyargs) + len(a.args)
    return Params(positional - len(a.defaults), positional, a.vararg is not None,
                  isinstance(found, ast.AsyncFunctionDef), found.lineno)


def folder_of(origin: str) -> str | None:
    """The folder of the flow file an origin (``path:line:col``, a plan record's) points into;
    None for text that came from no file (``<input>``)."""
    path = origin.rsplit(":", 2)[0] if origin.count(":") >= 2 else origin
    if not path or path.startswith("<"):
        return None
    return os.path.dirname(os.path.abspath(path))


def import_module_from(module: str, folder: str | None):
    """Import ``module`` with the flow file's ``folder`` first on ``sys.path`` (as :func:`find_module` looks).

    The folder stays on ``sys.path``: the module may import its neighbours when it runs, and
    worker processes started later ("spawn") inherit the path.
    """
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(module)


__all__ = ["RefError", "split_ref", "Found", "find_module", "search_folders", "looked_in", "defined_names",
           "Params", "function_params",
           "defined_names_of_source", "folder_of", "import_module_from"]
