"""Fixtures for the cost-model tests: a fixed CPU profile, the tests' flow, a synthetic run directory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from cost_cases import ROOT, TEST_FLOW, write_synthetic_run


@pytest.fixture
def test_flow(tmp_path) -> str:
    """Path of :data:`TEST_FLOW` written to a temp directory."""
    path = tmp_path / "grpo_test.flow"
    path.write_text(TEST_FLOW.replace("{ROOT}", str(ROOT)))
    return str(path)


@pytest.fixture(autouse=True)
def _cost_cpu_profile(monkeypatch, tmp_path):
    """Estimates for gpu = "cpu" use the built-in figures with fixed costs set, never this machine's."""
    from flowrl.cost.profiles import CPU_FALLBACK, save_profile

    path = tmp_path / "cost-profile.json"
    save_profile(replace(CPU_FALLBACK, op_overhead_s=0.01, iter_overhead_s=0.02, source="test profile"), path)
    monkeypatch.setenv("FLOWRL_PROFILE", str(path))
    return path


@pytest.fixture
def synthetic_run(tmp_path, test_flow):
    """``synthetic_run(steps=4, slow_step=None)`` -> a run directory of :data:`TEST_FLOW`
    (see :func:`write_synthetic_run`)."""
    def make(steps: int = 4, slow_step: int | None = None) -> Path:
        return write_synthetic_run(tmp_path / "run", test_flow, steps, slow_step)

    return make
