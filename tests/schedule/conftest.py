"""Fixtures for the schedule tests: compiling a flow text with a schedule, a fixed CPU profile."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fixed_cpu_profile(monkeypatch, tmp_path):
    """Estimates for gpu = "cpu" use the built-in figures, not a profile measured on this machine."""
    monkeypatch.setenv("FLOWRL_PROFILE", str(tmp_path / "no-profile.json"))


@pytest.fixture
def compile_flow(tmp_path):
    """``compile_flow(text, **options)`` -> the checked graph of the text's entry flow."""
    from flowrl.compiler.pipeline import compile_text

    def run(text: str, name: str = "sched.flow", **options):
        return compile_text(text, str(tmp_path / name), options=options)

    return run


@pytest.fixture
def plan_of(compile_flow):
    """``plan_of(text)`` -> the ExecutionPlan of the text's entry flow."""
    from flowrl.compiler.lower import lower

    def run(text: str, **options):
        return lower(compile_flow(text, **options))

    return run
