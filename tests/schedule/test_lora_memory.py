"""The memory check knows a LoRA's smaller training state: gradients and Adam states for the (fp32)
adapters only (flowrl.cost.model.train_memory, ``trained_params``)."""

from __future__ import annotations

import pytest

from flowrl.catalog.adapters import lora_params
from flowrl.catalog.models import PRESETS
from flowrl.diagnostics import FlowError

FLOW = '''
model policy = hf("Qwen/Qwen2.5-7B"{lora})
dataset d = jsonl("d.jsonl")
reward v = verifier("exact")
flow main() {{
  b  = sample(d, size = 8)
  r  = generate(policy, b, n = 4, max_tokens = 256)
  lp = logprobs(policy, r)
  update(policy, r, group_advantage(v(r), group = 4), lp)
}}
schedule main on cluster(nodes = 1, gpus_per_node = 2, gpu = "H100") {{
  pool gen = gpus(gpus = 1)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  place policy.train on train
  policy.train = torch(dp = 1)
  policy.rollout = vllm(tp = 1)
}}
'''
LORA = ', lora = lora(r = 16, alpha = 32, targets = ["q_proj", "k_proj", "v_proj", "o_proj"])'


def test_lora_counts_optimizer_state_of_the_adapters_only(plan_of, compile_flow):
    # 7.6B parameters trained in full on one H100: 2 (bf16) + 4 (grads) + 12 (fp32 master, Adam) bytes each
    with pytest.raises(FlowError, match=r"E428.*needs 147.0 GB per GPU"):
        compile_flow(FLOW.format(lora=""))
    plan = plan_of(FLOW.format(lora=LORA))
    mem = plan.model("policy").train_engine.memory
    facts = PRESETS["qwen/qwen2.5-7b"]
    adapters = lora_params(facts, 16, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert adapters == 28 * 16 * ((3584 + 3584) + 2 * (3584 + 512) + (3584 + 3584))  # 10.1M
    assert mem.grads_gb == pytest.approx(adapters * 4 / 1e9, rel=1e-6)
    assert mem.optimizer_gb == pytest.approx(adapters * 8 / 1e9, rel=1e-6)  # Adam's moments; fp32 adapters: no master
    assert mem.weights_gb == pytest.approx((facts.params * 2 + adapters * 4) / 1e9, rel=1e-6)  # bf16 base, fp32 adapters
    assert mem.total_gb < 80
