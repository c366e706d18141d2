"""megatron(pp=2) on 2 gloo ranks (Megatron's 1F1B pipeline schedule over 4 micro-batches):
same step as tp=1 and as the torch engine."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from mcore_cases import assert_same_step, run_megatron  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


@pytest.fixture(scope="module")
def pp2(tiny_dir):
    return run_megatron(tiny_dir, pp=2)


def test_pp2_matches_tp1_and_torch_engine(pp2, megatron_tp1, torch_reference):
    assert_same_step(pp2, megatron_tp1)
    assert_same_step(pp2, torch_reference)


def test_pp2_exports_both_stages_exactly(pp2, tiny_dir):
    hf = load_file(f"{tiny_dir}/model.safetensors")
    assert list(pp2.initial)[0] == "model.embed_tokens.weight" and list(pp2.initial)[-1] == "lm_head.weight"
    for name, tensor in hf.items():
        assert torch.equal(pp2.initial[name], tensor), name
