"""A mixture of experts (Qwen3-MoE) in the Megatron engine on CPU/gloo: the HF <-> Megatron conversion
of its router and experts, sharded by expert parallelism; Megatron-core's MoE layers (SequentialMLP,
all-to-all token dispatcher) computing what transformers computes; and ``ep = 2`` training the same
step as the torch engine (so as ``ep = 1``), saving and loading each rank's experts.

Tolerance: mcore_cases.TOL (1e-5, fp32), the acceptance tolerance of every Megatron layout. The
experts see the same tokens in another order (all-to-all, then grouped by expert) and their
gradients are summed over dp ranks in another order, so results differ from the torch engine by
rounding only (measured: log-probs 5e-7, weights after a step 7e-9); a routing decision flipped by
rounding would show as an error far above it.
"""

from __future__ import annotations


import pytest
import torch

from mcore_cases import assert_same_step, run_megatron, run_torch
from flowrl.catalog.architectures import expert_layout_problems
from flowrl.engines.base import EngineConfigError
from flowrl.engines.megatron.convert import (
    ConversionError,
    Layout,
    ModelSpec,
    check_layout,
    expert_range,
    hf_to_megatron,
    megatron_to_hf,
    shard_state,
    unshard_state,
)
from flowrl.engines.megatron.worker import load_hf_state
from flowrl.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """The tiny Qwen3-MoE: 2 layers, hidden 128, 8 experts of width 64, top-2 (vocab 17)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("megatron_moe") / "m", arch="qwen3_moe", seed=0))


@pytest.fixture(scope="module")
def torch_moe(moe_dir):
    return run_torch(moe_dir)


def test_spec_reads_the_experts_and_router_settings(moe_dir):
    spec = ModelSpec.from_pretrained(moe_dir)
    assert (spec.experts, spec.experts_per_token, spec.expert_ffn, spec.norm_topk_prob) == (8, 2, 64, True)
    assert spec.moe_pattern == (1, 1) and spec.qk_norm


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_round_trip_is_bit_exact_and_each_ep_rank_holds_its_experts(moe_dir, ep):
    spec, hf = ModelSpec.from_pretrained(moe_dir), load_hf_state(moe_dir)
    full = hf_to_megatron(hf, spec)
    assert full["decoder.layers.1.mlp.router.weight"] is hf["model.layers.1.mlp.gate.weight"]
    shards = {(0, 0, r) if ep > 1 else (0, 0): shard_state(full, spec, Layout(ep_size=ep, ep_rank=r))
              for r in range(ep)}
    for r, local in enumerate(shards.values()):
        experts = sorted({int(n.split("local_experts.")[1].split(".")[0]) for n in local if "local_experts" in n})
        assert experts == list(range(8 // ep))  # Megatron's rank-local numbering
        first = expert_range(spec, ep, r).start  # local expert 0 of rank r is global expert r * 8 / ep
        assert torch.equal(local["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"],
                           hf[f"model.layers.0.mlp.experts.{first}.down_proj.weight"])
        assert torch.equal(local["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
                           torch.cat([hf[f"model.layers.0.mlp.experts.{first}.gate_proj.weight"],
                                      hf[f"model.layers.0.mlp.experts.{first}.up_proj.weight"]]))
    back = megatron_to_hf(unshard_state(shards, spec, 1, 1, ep=ep), spec)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_layouts_that_cannot_split_the_experts_are_refused(moe_dir, tmp_path):
    spec = ModelSpec.from_pretrained(moe_dir)
    with pytest.raises(ConversionError, match="8 experts per layer are not divisible by ep=3"):
        check_layout(spec, 1, 1, 3)
    dense = ModelSpec.from_pretrained(build_tiny_model(tmp_path / "dense", seed=0))
    with pytest.raises(ConversionError, match="ep=2 splits a mixture of experts, and this llama model has none"):
        check_layout(dense, 1, 1, 2)
    assert expert_layout_problems(8, dp=4, ep=2) == [] and expert_layout_problems(0, tp=2) == []
    assert [o for o, _ in expert_layout_problems(8, tp=2, cp=2, dp=2, ep=4)] == ["ep", "tp"]
    pytest.importorskip("megatron.core")
    from flowrl.engines.megatron import MegatronTrainEngine

    with pytest.raises(EngineConfigError, match="ep = 2 does not divide dp = 1"):
        MegatronTrainEngine(moe_dir, ep=2)  # refused before any rank process starts
    with pytest.raises(EngineConfigError, match="^ep=0: each of tp, pp, dp, cp and ep must be an integer >= 1"):
        MegatronTrainEngine(moe_dir, ep=0)


def test_ep2_trains_the_torch_engines_step_and_saves_each_ranks_experts(moe_dir, torch_moe, tmp_path):
    """dp = 2 ranks that are one expert-parallel group: forward, one step (gradients gathered over
    the experts' ranks), weights; then save, another step, load: the first step's weights again;
    offload / reload keeps every rank's state; a transformers export loads as the same model."""
    pytest.importorskip("megatron.core")
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    def offload_and_export(eng) -> None:
        before = eng.state_checksums()
        assert eng.offload() > 0 and eng.reload() > 0
        assert eng.state_checksums() == before
        eng.save_pretrained(str(tmp_path / "hf"))

    got = run_megatron(moe_dir, dp=2, ep=2, save_and_reload=str(tmp_path / "ckpt"), then=offload_and_export)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in got.grads
    assert_same_step(got, torch_moe)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    state = revert_weight_conversion(exported, exported.state_dict())
    assert sorted(state) == sorted(got.weights)
    assert all(torch.equal(state[k], got.weights[k]) for k in state)


@pytest.mark.long
def test_ep1_pp2_and_cp2_train_the_same_step(moe_dir, torch_moe):
    """ep = 1 (every expert on the one rank), two pipeline stages of one MoE layer each, and two
    context-parallel ranks each routing its own chunks' tokens."""
    pytest.importorskip("megatron.core")
    ep1 = run_megatron(moe_dir)
    assert_same_step(ep1, torch_moe)
    assert_same_step(run_megatron(moe_dir, dp=2, ep=2), ep1)
    assert_same_step(run_megatron(moe_dir, pp=2), torch_moe)
    assert_same_step(run_megatron(moe_dir, cp=2), torch_moe)


@pytest.mark.long
def test_unnormalised_top_k_weights_train_the_same_step(moe_dir, tmp_path):
    """``norm_topk_prob = false`` (transformers' default): the top-k weights are the softmax over all
    experts, not renormalised; Megatron's ``moe_router_pre_softmax``. Same weights, another step."""
    pytest.importorskip("megatron.core")
    import json
    import shutil

    path = shutil.copytree(moe_dir, tmp_path / "unnormalised")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    assert not ModelSpec.from_pretrained(path).norm_topk_prob
    ref = run_torch(str(path))
    assert abs(ref.stats["loss"] - run_torch(moe_dir).stats["loss"]) > 1e-6  # the setting changes the model
    assert_same_step(run_megatron(str(path), dp=2, ep=2), ref)
