"""`schedule auto`: the search respects the staleness limit and the schedule's own statements, rejects
infeasible candidates with reasons, and its winner is a real schedule that compiles back to the same plan."""

from __future__ import annotations

import pytest
from schedule_flows import grpo

from flowrl.plan import ExecutionPlan
from flowrl.diagnostics import FlowError


def auto(cluster: str, body: str = "", **kw) -> str:
    return grpo(schedule=f"schedule main auto on {cluster} {{\n{body}\n}}", **kw)


def test_winner_respects_the_staleness_limit(plan_of):
    for limit in (1, 2, 3):
        plan = plan_of(auto("cluster(gpus_per_node = 8)", f"  staleness <= {limit}"))
        assert plan.auto and 1 <= plan.staleness <= limit
        assert plan.search.staleness_limit == limit
        assert all(f"staleness {limit + 1}" not in c.summary for c in (plan.search.winner,) + plan.search.runners_up)


def test_without_a_limit_auto_stays_synchronous(plan_of):
    plan = plan_of(auto("cluster(gpus_per_node = 4)"))
    assert plan.staleness == 1 and plan.search.staleness_limit == 1


def test_report_counts_and_reasons(plan_of):
    plan = plan_of(auto('cluster(nodes = 2, gpus_per_node = 8, gpu = "H100")', "  staleness <= 2",
                        model='hf("Qwen/Qwen2.5-7B")', max_tokens=2048))
    r = plan.search
    assert r.considered >= r.feasible > 0 and r.simulated >= 2
    assert r.winner.rank == 1 and [c.rank for c in r.runners_up] == list(range(2, 2 + len(r.runners_up)))
    assert r.winner.samples_per_s >= max(c.samples_per_s for c in r.runners_up) * 0.99
    assert r.rejected and sum(r.rejected.values()) == r.considered - r.feasible
    # Qwen2.5-7B has 28 heads: tp = 8 is rejected, with the numbers
    key = next(k for k in r.rejected if k.startswith("E425"))
    assert "28 attention heads" in r.examples[key]
    assert r.winner.why.startswith("fastest")


def test_winner_is_a_schedule_that_compiles_to_the_same_plan(plan_of):
    text = auto('cluster(nodes = 2, gpus_per_node = 8, gpu = "H100")', "  staleness <= 2",
                model='hf("Qwen/Qwen2.5-7B")', max_tokens=2048)
    chosen = plan_of(text)
    manual = plan_of(text.split("schedule main auto")[0] + chosen.search.winner.schedule + "\n")
    assert not manual.auto
    strip = lambda p: [(m.id, m.train_engine and (m.train_engine.kind, m.train_engine.tp, m.train_engine.pp,  # noqa
                                                  m.train_engine.dp, m.train_engine.gpus),
                        m.rollout_engine and (m.rollout_engine.kind, m.rollout_engine.tp, m.rollout_engine.dp,
                                              m.rollout_engine.gpus)) for m in p.models]
    assert strip(manual) == strip(chosen)
    assert manual.staleness == chosen.staleness
    assert [r.protocol for r in manual.resyncs] == [r.protocol for r in chosen.resyncs]
    assert [(p.name, p.gpu_ids) for p in manual.pools] == [(p.name, p.gpu_ids) for p in chosen.pools]


def test_a_written_protocol_constrains_the_placement(plan_of):
    plan = plan_of(auto("cluster(gpus_per_node = 8)", "  staleness <= 2\n  resync policy via inplace()"))
    assert plan.resyncs[0].protocol == "inplace" and "colocated" in plan.search.winner.summary
    assert any(k.startswith("E432") for k in plan.search.rejected)  # disaggregated candidates: inplace impossible


def test_partial_rollout_in_auto_needs_staleness_two(plan_of):
    plan = plan_of(auto("cluster(gpus_per_node = 4)", "  staleness <= 2\n  partial_rollout(over_provision = 1.5)"))
    assert plan.staleness == 2 and plan.pipeline.requests_per_step == 768
    assert any(k.startswith("E431") for k in plan.search.rejected)


def test_large_models_need_sharded_layouts(plan_of):
    """A 14B policy does not fit replicated (E428): the winner shards it (megatron or fsdp)."""
    plan = plan_of(auto('cluster(nodes = 2, gpus_per_node = 8, gpu = "H100")', "  staleness <= 2",
                        model='hf("Qwen/Qwen2.5-14B")', max_tokens=2048))
    train = next(m.train_engine for m in plan.models if m.id == "policy")
    assert train.kind in ("megatron", "fsdp") and train.memory.total_gb <= 80
    assert any(k.startswith("E428") for k in plan.search.rejected)


def test_nothing_fits_is_one_error_at_the_schedule_line(compile_flow):
    with pytest.raises(FlowError) as info:
        compile_flow(auto('cluster(gpus_per_node = 1, gpu = "A100")', model='hf("Qwen/Qwen2.5-72B")'))
    (d,) = info.value.diagnostics
    assert d.code == "E436" and d.span.line == 15 and "rejected because" in d.hint


def test_auto_plan_round_trips_as_json(plan_of):
    plan = plan_of(auto("cluster(nodes = 2, gpus_per_node = 4)", "  staleness <= 2"))
    assert ExecutionPlan.from_json(plan.to_json()) == plan
    assert plan.search.winner.schedule.startswith("schedule main on cluster(nodes = 2, gpus_per_node = 4) {")
