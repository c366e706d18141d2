"""A LoRA policy's KL reference, ``frozen(policy)``, is the policy's base: its log-prob pass runs on the policy's
train engine with the adapters disabled (flowrl.compiler.passes.share_base_weights). The plan has no reference
engine, the memory check counts no reference weights, `flowrl plan` says so, and the op the runtime executes
carries ``adapters = "off"``. A reference given an engine of its own by the schedule, or of a full-weight
policy, keeps its copy."""

from __future__ import annotations

import pytest

from flowrl.catalog.models import PRESETS
from flowrl.compiler.explain import describe_plan

FLOW = '''
model policy = hf("Qwen/Qwen2.5-7B"{lora})
dataset d = jsonl("d.jsonl")
reward v = verifier("exact")
flow main() {{
  ref = frozen(policy)
  b  = sample(d, size = 8)
  r  = generate(policy, b, n = 4, max_tokens = 256)
  update(policy, r, group_advantage(v(r), group = 4), logprobs(policy, r), logprobs(ref, r), kl = {kl})
}}
schedule main on cluster(nodes = 1, gpus_per_node = 2, gpu = "H100") {{
  pool gen = gpus(gpus = 1)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  colocate policy.train, ref on train
  policy.train = torch(dp = 1)
  policy.rollout = vllm(tp = 1){ref_layout}
}}
'''
LORA = ', lora = lora(r = 16, alpha = 32, targets = ["q_proj", "k_proj", "v_proj", "o_proj"])'


def _flow(lora: str = LORA, kl: float = 0.05, ref_layout: str = "") -> str:
    return FLOW.format(lora=lora, kl=kl, ref_layout=ref_layout)


def _train_pool_peak(plan) -> float:
    return next(m for m in plan.memory if m.pool == "train").peak_gb


def test_the_reference_pass_runs_on_the_policy_engine_with_adapters_off(plan_of):
    plan = plan_of(_flow())
    assert plan.model("ref").train_engine is None  # no second copy of the weights
    assert "ref.train" not in {e for p in plan.pools for e in p.engines}
    op = next(o for o in plan.ops if o.options.get("reference") == "ref")
    assert (op.kind, op.model, op.engine, op.options["adapters"]) == ("logprobs", "policy", "train", "off")
    assert op.inputs["model"] == "ref"  # the value it computes is still the reference's
    # the memory of the train pool is the policy's engine alone: no reference weights counted
    policy = plan.model("policy").train_engine.memory
    assert _train_pool_peak(plan) == pytest.approx(policy.total_gb, abs=1e-3)  # the plan keeps MB
    text = describe_plan(plan)
    assert "on policy.train (adapters off: `ref` is its base, no copy)" in text
    assert "no weights of `ref`: its passes run on policy.train with the LoRA adapters off (its base)" in text


def test_an_own_layout_or_a_full_weight_policy_keeps_the_reference_copy(plan_of):
    shared = plan_of(_flow())
    own = plan_of(_flow(ref_layout="\n  ref.train = torch(dp = 1)"))
    ref = own.model("ref").train_engine
    assert ref is not None and not any(o.options.get("adapters") for o in own.ops)
    bf16_weights = PRESETS["qwen/qwen2.5-7b"].params * 2 / 1e9
    assert ref.memory.weights_gb == pytest.approx(bf16_weights, rel=1e-6)
    # the copy's weights (and its pass's activations) are what sharing saves on the pool
    assert _train_pool_peak(own) - _train_pool_peak(shared) >= bf16_weights
    full = plan_of(_flow(lora="").replace("Qwen2.5-7B", "Qwen2.5-0.5B"))  # a full-weight 7B is too big for one GPU
    assert full.model("ref").train_engine is not None
    assert not any(o.options.get("adapters") for o in full.ops)


def test_without_kl_the_reference_is_neither_run_nor_shared(plan_of):
    plan = plan_of(_flow(kl=0.0))
    assert plan.model("ref").train_engine is None
    assert not any(o.options.get("reference") for o in plan.ops)
    assert not any(o.model == "policy" and o.kind == "logprobs" for o in plan.ops)  # both passes elided
