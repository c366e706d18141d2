"""Placement and layouts: pools on the cluster, engines on pools, layouts, GPU ids, memory, the default schedule."""

from __future__ import annotations

import pytest
from schedule_flows import REPO, grpo

from flowrl.diagnostics import FlowError
from flowrl.plan import ExecutionPlan


def engines(plan: ExecutionPlan) -> dict:
    return {f"{m.id}.{e.role}": e for m in plan.models for e in (m.train_engine, m.rollout_engine) if e}


def test_default_schedule_is_one_gpu_all_colocated_sync_inplace(plan_of):
    plan = plan_of(grpo())
    assert [(p.name, p.gpus, p.gpu_ids) for p in plan.pools] == [("all", 1, (0,))]
    es = engines(plan)
    assert {k: e.kind for k, e in es.items()} == {"policy.train": "torch", "policy.rollout": "vllm",
                                                  "ref.train": "torch"}
    assert all(e.pool == "all" and e.gpus == (0,) and e.gpus_per_rank == pytest.approx(1 / 3) for e in es.values())
    assert plan.staleness == 1 and [r.protocol for r in plan.resyncs] == ["inplace"]
    assert plan.resyncs[0].route == "local" and plan.pipeline.in_flight == 1 and not plan.auto


def test_disaggregated_pools_are_disjoint_slices(plan_of):
    plan = plan_of(grpo(schedule="""
schedule main on cluster(nodes = 2, gpus_per_node = 8, gpu = "H100") {
  pool gen = gpus(gpus = 8)
  pool train = gpus(gpus = 8)
  place policy.rollout on gen
  colocate policy.train, ref on train
  policy.train = megatron(tp = 2, pp = 2)
  policy.rollout = vllm(tp = 2)
  staleness 2
}"""))
    pools = {p.name: p for p in plan.pools}
    assert list(pools) == ["gen", "train"]
    assert pools["gen"].gpu_ids == tuple(range(8)) and pools["gen"].nodes == (0,) * 8
    assert pools["train"].gpu_ids == tuple(range(8, 16)) and pools["train"].strategy == "STRICT_PACK"
    es = engines(plan)
    assert (es["policy.train"].tp, es["policy.train"].pp, es["policy.train"].dp) == (2, 2, 2)  # dp fills the pool
    assert (es["policy.rollout"].tp, es["policy.rollout"].dp) == (2, 4)
    assert es["policy.rollout"].gpus_per_rank == 1.0 and es["policy.train"].gpus_per_rank == 0.5
    assert es["policy.rollout"].colocated_with == () and es["policy.train"].colocated_with == ("ref.train",)
    # the reference shares its base trainer's GPUs, so it borrows the trainer's layout
    assert (es["ref.train"].kind, es["ref.train"].tp, es["ref.train"].pp, es["ref.train"].chosen) == \
        ("megatron", 2, 2, True)
    assert es["policy.train"].gpus == tuple(range(8, 16)) and es["policy.train"].bundles == tuple(range(8))
    r = plan.resyncs[0]
    assert (r.protocol, r.route, r.transport, r.overlap) == ("nccl", "inter-node", "nccl", True)


def test_pool_spanning_nodes_packs(plan_of):
    # the 2-node pool holds the rollout engine's replicas, the trainers share GPU 3
    plan = plan_of(grpo(schedule="""
schedule main on cluster(nodes = 2, gpus_per_node = 4) {
  pool gen = gpus(gpus = 6, nodes = 2)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  colocate policy.train, ref on train
}"""))
    pools = {p.name: p for p in plan.pools}
    gen = pools["gen"]
    assert gen.gpu_ids == (0, 1, 2, 4, 5, 6) and gen.nodes == (0, 0, 0, 1, 1, 1) and gen.strategy == "PACK"
    assert pools["train"].gpu_ids == (3,) and pools["train"].strategy == "STRICT_PACK"
    es = engines(plan)
    # GPU 3 holds two engines, so each asks for half of it
    assert es["policy.train"].gpus_per_rank == pytest.approx(1 / 2) and es["policy.rollout"].gpus_per_rank == 1
    assert es["policy.rollout"].dp == 6 and es["policy.train"].dp == 1


def test_unplaced_reference_follows_its_base_trainer(plan_of):
    plan = plan_of(grpo(schedule="""
schedule main on cluster(gpus_per_node = 4) {
  pool gen = gpus(gpus = 2)
  pool train = gpus(gpus = 2)
  place policy.rollout on gen
  place policy.train on train
}"""))
    assert engines(plan)["ref.train"].pool == "train"


def test_unlaid_out_rollout_engine_gets_the_smallest_tp_that_fits(plan_of):
    plan = plan_of(grpo('hf("Qwen/Qwen2.5-72B")', schedule="""
schedule main on cluster(nodes = 3, gpus_per_node = 8, gpu = "H100") {
  pool gen = gpus(gpus = 16)
  pool train = gpus(gpus = 8)
  place policy.rollout on gen
  colocate policy.train, ref on train
  policy.train = fsdp(offload = true)
  staleness 2
}"""))
    roll = engines(plan)["policy.rollout"]
    # 145.4 GB of weights: tp = 4 puts 36.4 GB + 2 GB workspace on a GPU, inside vLLM's 0.5 x 80 GB;
    # tp = 2 (72.7 GB) would not fit
    assert (roll.kind, roll.tp, roll.dp, roll.chosen) == ("vllm", 4, 4, True)
    assert roll.memory.weights_gb + roll.memory.other_gb <= roll.memory.reserved_gb


def test_memory_estimate_numbers(plan_of):
    plan = plan_of(grpo('hf("Qwen/Qwen2.5-7B")', max_tokens=1024, schedule="""
schedule main on cluster(nodes = 1, gpus_per_node = 8, gpu = "H100") {
  colocate policy.train, policy.rollout, ref on all
  policy.train = megatron(tp = 2, pp = 1, dp = 4)
  policy.rollout = vllm(tp = 1, dp = 8, gpu_memory_utilization = 0.6)
}"""))
    es = engines(plan)
    m = es["policy.train"].memory
    params = 7_615_616_512
    assert m.weights_gb == pytest.approx(params * 2 / 2 / 1e9)        # bf16, split by tp x pp = 2
    assert m.grads_gb == pytest.approx(params * 4 / 2 / 1e9)          # fp32 gradients
    assert m.optimizer_gb == pytest.approx(params * 12 / 8 / 1e9)     # master + Adam m, v over tp x pp x dp
    ref = es["ref.train"].memory
    assert ref.grads_gb == 0 and ref.optimizer_gb == 0                # frozen: weights only
    r = es["policy.rollout"].memory
    assert r.reserved_gb == pytest.approx(0.6 * 80) and r.weights_gb == pytest.approx(params * 2 / 1e9)
    assert r.kv_cache_gb == pytest.approx(48 - r.weights_gb - r.other_gb)
    mem = plan.estimate.memory["all"]
    assert mem["capacity_gb"] == 80 and mem["peak_gb"] >= max(m.total_gb, r.total_gb)


def test_default_schedule_reports_no_memory_errors(plan_of):
    """Without a schedule block the plan shows the estimate; a flow is not rejected for its default."""
    plan = plan_of(grpo('hf("Qwen/Qwen2.5-72B")'))
    e = engines(plan)["policy.train"]
    assert e.memory.total_gb > 100 and plan.pools[0].gpus == 1


def test_ranks_put_tensor_parallel_groups_on_consecutive_gpus(plan_of):
    plan = plan_of(grpo(schedule="""
schedule main on cluster(nodes = 3, gpus_per_node = 4, gpu = "H100") {
  pool gen = gpus(gpus = 8)
  pool train = gpus(gpus = 4)
  place policy.rollout on gen
  colocate policy.train, ref on train
  policy.train = megatron(tp = 2, pp = 2)
  policy.rollout = vllm(tp = 2, dp = 4)
}"""))
    e = engines(plan)["policy.rollout"]
    groups = [e.gpus[i:i + e.tp] for i in range(0, len(e.gpus), e.tp)]
    assert groups == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(len({g // 4 for g in grp}) == 1 for grp in groups)


REFUSED: dict[str, str] = {}
"""Shipped flows ``check`` refuses, and the op the catalogue says runs on no platform yet (issue 9:
what is not built is refused by ``check``, with the reason)."""


@pytest.mark.parametrize("path", sorted((REPO / "flows").glob("*.flow")), ids=lambda p: p.name)
def test_shipped_flows_plan_and_round_trip(path, monkeypatch):
    from flowrl.compiler.lower import lower
    from flowrl.compiler.pipeline import compile_file

    monkeypatch.chdir(REPO)
    if path.name in REFUSED:
        with pytest.raises(FlowError) as info:
            compile_file(str(path.relative_to(REPO)))
        assert {d.code for d in info.value.diagnostics} == {"E444"}
        assert all(f"`{REFUSED[path.name]}`" in d.message and "not built yet" in d.hint
                   for d in info.value.diagnostics)
        return
    plan = lower(compile_file(str(path.relative_to(REPO))).graph)
    assert ExecutionPlan.from_json(plan.to_json()) == plan
    assert plan.estimate.step_s > 0 and 0 <= plan.estimate.bubble <= 1
    for m in plan.models:
        for e in (m.train_engine, m.rollout_engine):
            if e is not None:
                pool = next(p for p in plan.pools if p.name == e.pool)
                assert e.world_size == pool.gpus and set(e.gpus) <= set(pool.gpu_ids)
                assert len(e.bundles) == e.world_size and max(e.bundles) < pool.gpus
