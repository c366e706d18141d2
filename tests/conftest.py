"""Suite-wide settings (estimates never depend on this machine's speed) and fixtures (bench scripts as modules)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# `flowrl plan` measures the machine for gpu = "cpu" on first use (flowrl.cost.autoprofile); the suite's
# plans, goldens and documented commands use the fixed figures instead (tests of the automatic
# profile turn it back on for themselves)
os.environ["FLOWRL_AUTO_PROFILE"] = "0"
# the local Ray instances the tests start themselves (e2e_kit.shared_ray) run their workers at normal
# priority, as flowrl's own do (flowrl.runtime.environment.RAY_DEFAULTS): at Ray's default nice 15 a
# suite run beside other work starved its engines (a vLLM start-up took 13 minutes)
os.environ.setdefault("RAY_worker_niceness", "0")
# W&B goes online when the environment has a credential (a developer's `wandb login`): the suite's runs stay
# offline unless a test asks otherwise (tests/runtime/test_trackers_online.py sets its own W&B environment)
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def load_bench():
    """``load_bench("e2e_vs_trl")``: a script of ``bench/`` imported as a module (once a session)."""
    loaded = {}

    def load(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    return load
