"""The examples in the schedule passes' and the cost model's docstrings run and hold."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["flowrl.compiler.passes.assign_placement", "flowrl.compiler.passes.plan_layouts",
           "flowrl.compiler.passes.resolve_staleness", "flowrl.compiler.passes.select_sync_protocol",
           "flowrl.compiler.passes.estimate_cost", "flowrl.compiler.workload", "flowrl.compiler.model_info",
           "flowrl.compiler.reshard", "flowrl.cost.model", "flowrl.cost.profiles", "flowrl.cost.sim"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0, name
