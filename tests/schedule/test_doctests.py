"""Every module of flowrl with examples in its docstrings runs them, and they hold.

Modules are discovered, not listed: any ``flowrl/**/*.py`` with a ``>>>`` line is imported and
its examples run, so a new pass (each has one doctest, by convention) or library module is
covered as soon as it is written. A module whose import needs an optional package that is not
installed (Megatron-core, vLLM, SGLang) is skipped with that reason.
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = re.compile(r"^\s*>>> ", re.M)


def _modules() -> list[str]:
    out = []
    for path in sorted((ROOT / "flowrl").rglob("*.py")):
        if EXAMPLE.search(path.read_text(encoding="utf-8")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


MODULES = _modules()


def test_discovery_finds_the_compiler_and_cost_model():
    """The discovery is not vacuous: the passes and the cost model have examples."""
    assert {"flowrl.compiler.passes.plan_layouts", "flowrl.compiler.passes.insert_resyncs",
            "flowrl.compiler.schedule.memory", "flowrl.cost.sim", "flowrl.catalog.engines"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("flowrl"):
            pytest.skip(f"{name} needs {e.name}, which is not installed")
        raise
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, name
