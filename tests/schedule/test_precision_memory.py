"""The memory model counts a model's precision (flowrl.catalog.precision): fp32 4 + 4 + 8 bytes per
parameter (weights, grads, Adam moments), mixed bf16 2 + 4 (fp32 master) + 4 + 8, pure bf16 2 + 2 + 4;
FSDP's mixed precision shards fp32 parameters (the masters) and gathers bf16 layers."""

from __future__ import annotations

import pytest

from flowrl.catalog.models import PRESETS
from flowrl.catalog.precision import train_bytes
from flowrl.cost.model import train_memory
from flowrl.cost.profiles import get_profile

F, H100 = PRESETS["qwen/qwen2.5-7b"], get_profile("H100")
P = F.params

FLOW = '''
model policy = hf("Qwen/Qwen2.5-0.5B"{options})
dataset d = jsonl("d.jsonl")
reward v = verifier("exact")
flow main() {{
  b   = sample(d, size = 16)
  r   = generate(policy, b, n = 4, max_tokens = 256)
  lp  = logprobs(policy, r)
  update(policy, r, group_advantage(v(r), group = 4), lp)
}}
schedule main on cluster(gpus_per_node = {gpus}, gpu = "H100") {{
  colocate policy.train, policy.rollout on all
  policy.train = {train}
  policy.rollout = vllm(tp = 1, dp = {gpus})
}}
'''


@pytest.mark.parametrize("dtype, precision, total", [("float32", "mixed", 16), ("float32", "pure", 16),
                                                      ("bfloat16", "mixed", 18), ("bfloat16", "pure", 8),
                                                      ("float16", "mixed", 18)])
def test_bytes_per_parameter(dtype, precision, total):
    assert train_bytes(dtype, precision).total == total


def test_replicated_engine_holds_bf16_weights_fp32_grads_masters_and_moments():
    mixed = train_memory(F, H100, "torch", param_bytes=train_bytes("bfloat16", "mixed"))
    assert mixed.weights_gb == pytest.approx(P * 2 / 1e9)  # the bf16 compute copy
    assert mixed.grads_gb == pytest.approx(P * 4 / 1e9)
    assert mixed.optimizer_gb == pytest.approx(P * (4 + 8) / 1e9)  # fp32 master + two fp32 moments
    pure = train_memory(F, H100, "torch", param_bytes=train_bytes("bfloat16", "pure"))
    assert (pure.weights_gb, pure.grads_gb, pure.optimizer_gb) == pytest.approx((P * 2 / 1e9, P * 2 / 1e9,
                                                                                 P * 4 / 1e9))
    fp32 = train_memory(F, H100, "torch", param_bytes=train_bytes("float32"))
    assert (fp32.weights_gb, fp32.optimizer_gb) == pytest.approx((P * 4 / 1e9, P * 8 / 1e9))


def test_fsdp_mixed_shards_fp32_masters_and_gathers_bf16_layers():
    mem = train_memory(F, H100, "fsdp", dp=4, param_bytes=train_bytes("bfloat16", "mixed"))
    assert mem.weights_gb == pytest.approx((P * 4 / 4 + 2 * F.layer_params * 2) / 1e9)  # no separate master
    assert mem.grads_gb == pytest.approx(P * 4 / 4 / 1e9)
    assert mem.optimizer_gb == pytest.approx(P * 8 / 4 / 1e9)


def test_megatron_keeps_fp32_main_params_with_its_distributed_optimizer():
    mem = train_memory(F, H100, "megatron", tp=2, dp=4, param_bytes=train_bytes("bfloat16", "mixed"))
    assert mem.weights_gb == pytest.approx(P * 2 / 2 / 1e9)
    assert mem.optimizer_gb == pytest.approx(P * 12 / 8 / 1e9)


def test_the_plan_counts_the_flows_dtype_and_precision(plan_of):
    def train(options: str, engine: str = "torch(dp = 1)", gpus: int = 1):
        return plan_of(FLOW.format(options=options, train=engine, gpus=gpus)).model("policy").train_engine.memory

    P = plan_of(FLOW.format(options="", train="torch(dp = 1)", gpus=1)).model("policy").facts["params"]

    mixed, pure = train(', dtype = "bfloat16"'), train(', dtype = "bfloat16", precision = "pure"')
    fp32 = train(', dtype = "float32"')
    assert mixed.optimizer_gb == pytest.approx(P * 12 / 1e9, rel=1e-3)
    assert pure.optimizer_gb == pytest.approx(P * 4 / 1e9, rel=1e-3)
    assert (fp32.weights_gb, fp32.optimizer_gb) == pytest.approx((P * 4 / 1e9, P * 8 / 1e9), rel=1e-3)
    assert fp32.activations_gb == pytest.approx(2 * mixed.activations_gb)  # fp32 activations
    sharded = train(', dtype = "bfloat16"', "fsdp(dp = 8)", gpus=8)
    assert sharded.optimizer_gb == pytest.approx(P * 8 / 8 / 1e9, rel=1e-3)
