"""The memory check models what the runtime does: phases of engines taking turns, or resident together.

Figures are the cost model's (flowrl.cost.model), so each assertion is arithmetic on the plan's
own per-engine estimates: a phase holds its running engines in full, released engines' remainders
(a sleeping rollout engine keeps its workspace and CUDA context, an offloaded trainer its CUDA
context) and engines that cannot free their memory in full.
"""

from __future__ import annotations

import pytest

from flowrl.compiler.explain import describe_plan
from flowrl.plan import ExecutionPlan

FLOW = '''
model policy = hf("Qwen/Qwen2.5-7B")
dataset d = jsonl("d.jsonl")
reward v = verifier("exact")
flow main() {{
  ref = frozen(policy)
  b   = sample(d, size = 64)
  r   = generate(policy, b, n = 8, max_tokens = 1024)
  lp  = logprobs(policy, r)
  rl  = logprobs(ref, r)
  update(policy, r, group_advantage(v(r), group = 8), lp, rl, kl = {kl})
}}
schedule main on {cluster} {{
{body}
}}
'''
H100x8 = 'cluster(nodes = 1, gpus_per_node = 8, gpu = "H100")'


def _flow(body: str, cluster: str = H100x8, kl: str = "0.0") -> str:
    return FLOW.format(body=body, cluster=cluster, kl=kl)


def test_issue_9_example_reports_the_phases_the_runtime_runs(plan_of):
    """7B policy, fsdp(dp = 8) + vllm(dp = 8, gpu_memory_utilization = 0.9) colocated on 8 x H100."""
    plan = plan_of(_flow("  colocate policy.train, policy.rollout on all\n"
                         "  policy.train = fsdp(dp = 8)\n"
                         "  policy.rollout = vllm(dp = 8, gpu_memory_utilization = 0.9)"))
    train, roll = plan.model("policy").train_engine, plan.model("policy").rollout_engine
    assert (train.releases, roll.releases) == ("offload", "sleep")
    (m,) = plan.memory
    assert m.pool == "all" and m.turns and m.capacity_gb == 80
    gen, trn = m.phases
    assert (gen.name, gen.active, gen.released) == ("generate", ("policy.rollout",), (("policy.train", "offload"),))
    assert (trn.name, trn.active, trn.released) == ("train", ("policy.train",), (("policy.rollout", "sleep"),))
    # generate: vLLM's reservation (0.9 x 80 GB) + the offloaded trainer's CUDA context (0.5 GB)
    assert roll.memory.total_gb == pytest.approx(72.0)
    assert gen.peak_gb == pytest.approx(72.0 + 0.5, abs=1e-3)
    # train: the trainer in full + the sleeping engine's workspace and context (1.5 + 0.5 GB)
    assert trn.peak_gb == pytest.approx(train.memory.total_gb + 2.0, abs=1e-3)
    assert m.peak_gb == max(gen.peak_gb, trn.peak_gb) < 80
    assert plan.estimate.memory["all"]["peak_gb"] == m.peak_gb
    # resident together the two would need their sum: the figure the runtime had before turns
    assert train.memory.total_gb + roll.memory.total_gb > 80
    text = describe_plan(plan)
    assert "engines take turns:" in text
    assert "72.5 GB: runs policy.rollout; policy.train offloaded" in text
    assert "runs policy.train; policy.rollout asleep" in text


def test_on_cpu_engines_are_resident_together(plan_of):
    plan = plan_of(_flow("  colocate policy.train, policy.rollout on all", "cluster(gpus_per_node = 1)")
                   .replace('hf("Qwen/Qwen2.5-7B")', "tiny()").replace("max_tokens = 1024", "max_tokens = 64"))
    (m,) = plan.memory
    (ph,) = m.phases
    engines = [plan.model("policy").train_engine, plan.model("policy").rollout_engine]
    assert not m.turns and ph.name == "resident" and all(e.releases == "" for e in engines)
    assert ph.peak_gb == pytest.approx(sum(e.memory.total_gb for e in engines), abs=1e-3)
    assert "engines resident together" in describe_plan(plan)


def test_a_pool_of_train_engines_holds_them_together(plan_of):
    """Disaggregated: the trainer and the reference share the train pool in one phase (both run)."""
    plan = plan_of(_flow("  pool gen = gpus(gpus = 4)\n  pool train = gpus(gpus = 4)\n"
                         "  place policy.rollout on gen\n  colocate policy.train, ref on train\n"
                         "  policy.train = fsdp(dp = 4)\n  staleness 2", kl="0.001"))
    mem = {m.pool: m for m in plan.memory}
    train, ref = plan.model("policy").train_engine, plan.model("ref").train_engine
    assert not mem["train"].turns and train.releases == ref.releases == ""
    assert mem["train"].peak_gb == pytest.approx(train.memory.total_gb + ref.memory.total_gb, abs=1e-3)
    assert mem["gen"].engines == ("policy.rollout",)


def test_an_engine_that_cannot_free_memory_stays_resident(plan_of):
    plan = plan_of(_flow("  colocate policy.train, policy.rollout on all\n"
                         "  policy.train = fsdp(dp = 8)\n  policy.rollout = hf_generate(dp = 8)"))
    train, roll = plan.model("policy").train_engine, plan.model("policy").rollout_engine
    assert (train.releases, roll.releases) == ("offload", "")
    gen, trn = plan.memory[0].phases
    assert trn.resident == ("policy.rollout",) and not trn.released
    assert trn.peak_gb == pytest.approx(train.memory.total_gb + roll.memory.total_gb, abs=1e-3)
    # the swap after each generation moves only what is released: the trainer's states
    switch = plan.estimate.breakdown["sleep/wake"]
    moved = 2 * (train.memory.weights_gb + train.memory.grads_gb + train.memory.optimizer_gb)
    assert switch == pytest.approx(moved / 64.0, rel=1e-3)  # H100 host link: 64 GB/s


def test_memory_phases_round_trip_as_json(plan_of):
    plan = plan_of(_flow("  colocate policy.train, policy.rollout on all\n  policy.train = fsdp(dp = 8)"))
    assert ExecutionPlan.from_json(plan.to_json()) == plan
    assert plan.memory and plan.memory[0].phases[0].released


def test_the_elided_reference_takes_no_memory(plan_of):
    """kl = 0: the reference's pass is elided, so its engine is not placed and holds nothing."""
    plan = plan_of(_flow("  colocate policy.train, policy.rollout, ref on all\n  policy.train = fsdp(dp = 8)"))
    assert plan.model("ref").train_engine is None
    assert all("ref.train" not in m.engines for m in plan.memory)
    assert all("ref.train" not in p.engines for p in plan.pools)
