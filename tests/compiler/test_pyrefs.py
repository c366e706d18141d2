"""Finding a user's module without importing it, reading what it defines, importing it as the runtime does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flowrl.pyrefs import (RefError, defined_names, defined_names_of_source, find_module, folder_of,
                           import_module_from, split_ref)


def test_split_ref():
    assert split_ref("a.b:c") == ("a.b", "c")
    for bad in ("a", "a:", ":c", "a b:c", "a:b:c", "1a:b"):
        with pytest.raises(RefError):
            split_ref(bad)


def test_find_module_order_flow_folder_then_pythonpath_then_installed(tmp_path, monkeypatch):
    (tmp_path / "flow").mkdir()
    (tmp_path / "path").mkdir()
    (tmp_path / "flow" / "json.py").write_text("x = 1\n")  # shadows the standard library's, as the import would
    (tmp_path / "path" / "mine.py").write_text("y = 1\n")
    (tmp_path / "path" / "pkg").mkdir()
    (tmp_path / "path" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "path" / "pkg" / "sub.py").write_text("z = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "path"))
    assert find_module("json", tmp_path / "flow").source == tmp_path / "flow" / "json.py"
    assert find_module("json", None).where == "installed packages"
    assert find_module("mine", tmp_path / "flow").source == tmp_path / "path" / "mine.py"
    assert find_module("pkg.sub", tmp_path / "flow").source == tmp_path / "path" / "pkg" / "sub.py"
    assert find_module("pkg.nope", tmp_path / "flow") is None
    assert find_module("flowrl.rewards.pool", None).source.name == "pool.py"
    assert find_module("math", None).source is None  # built in: no source to read
    assert find_module("no_such_top_level_module_x", tmp_path) is None


def test_find_module_runs_no_code_of_an_uninstalled_package(tmp_path, monkeypatch):
    pkg = tmp_path / "boom"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported')\n")
    (pkg / "mod.py").write_text("def f():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # found through the interpreter's path (find_spec)
    found = find_module("boom.mod", None)
    assert found is not None and found.source == pkg / "mod.py"
    assert "boom" not in sys.modules


def test_defined_names():
    names, open_ended = defined_names_of_source(
        "import a.b\nimport c as d\nfrom e import f as g, h\nx: int = 1\ny += 1\n"
        "if True:\n    def i(): pass\nelse:\n    class j: pass\n"
        "try:\n    import k\nexcept ImportError:\n    k = None\n"
        "def outer():\n    hidden = 1\n")
    assert names == {"a", "d", "g", "h", "x", "y", "i", "j", "k", "outer"}
    assert not open_ended
    assert defined_names_of_source("from m import *\n")[1]
    assert defined_names_of_source("def __getattr__(n):\n    return n\n")[1]
    with pytest.raises(SyntaxError):
        defined_names_of_source("def (:\n")


def test_folder_of_origin(tmp_path):
    assert folder_of(f"{tmp_path}/f.flow:3:4") == str(tmp_path)
    assert folder_of("<input>:1:1") is None


def test_import_module_from_the_flow_folder_first(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "h4_probe_rewards.py").write_text("def score(c, a):\n    return [1.0] * len(c)\n")
    try:
        mod = import_module_from("h4_probe_rewards", str(tmp_path))
        assert mod.score(["x"], ["y"]) == [1.0]
        assert sys.path[0] == str(tmp_path)
        assert "score" in defined_names(Path(mod.__file__))[0]
    finally:
        sys.modules.pop("h4_probe_rewards", None)
