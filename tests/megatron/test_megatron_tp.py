"""megatron(tp=2) on 2 gloo ranks: same step as tp=1 and as the torch engine; HF round trip exact."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from conftest import assert_same_step, run_megatron  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


@pytest.fixture(scope="module")
def tp2(tiny_dir):
    return run_megatron(tiny_dir, tp=2)


def test_tp1_matches_torch_engine(megatron_tp1, torch_reference):
    assert_same_step(megatron_tp1, torch_reference)


def test_tp2_matches_tp1_and_torch_engine(tp2, megatron_tp1, torch_reference):
    assert_same_step(tp2, megatron_tp1)
    assert_same_step(tp2, torch_reference)


def test_hf_to_megatron_tp2_to_hf_is_bit_exact(tp2, tiny_dir):
    """Weights loaded into the sharded model and gathered back equal the checkpoint bit for bit."""
    hf = load_file(f"{tiny_dir}/model.safetensors")
    assert sorted(tp2.initial) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(tp2.initial[name], tensor), name


def test_the_step_changed_the_weights(tp2):
    moved = {k: float((tp2.weights[k] - tp2.initial[k]).abs().max()) for k in tp2.initial}
    assert all(v > 0 for v in moved.values())
