"""Fixtures of the Megatron engine tests: one tiny Llama and the reference results of the
torch engine and of Megatron at tp=pp=dp=1 (computed once per session and compared against
every parallel layout). The shared helpers live in ``mcore_cases``."""

from __future__ import annotations

import pytest

from mcore_cases import StepResult, run_megatron, run_torch
from flowrl.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """The acceptance model: tiny Llama, hidden 128, 4 heads, 2 KV heads, 2 layers (vocab 17)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("megatron_tiny"), hidden=128, heads=4, kv_heads=2,
                                layers=2, seed=0))


@pytest.fixture(scope="session")
def torch_reference(tiny_dir) -> StepResult:
    return run_torch(tiny_dir)


@pytest.fixture(scope="session")
def megatron_tp1(tiny_dir) -> StepResult:
    pytest.importorskip("megatron.core")
    return run_megatron(tiny_dir, tp=1, pp=1, dp=1)
