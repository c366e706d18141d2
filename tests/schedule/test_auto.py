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


def test_a_flow_vllm_cannot_serve_gets_another_rollout_engine(plan_of):
    """vLLM refuses temperatures above 2 (its record's sampling limits, E438): the search keeps only
    the rollout engines that take the flow's sampling options, and says why vLLM lost."""
    text = auto("cluster(gpus_per_node = 4)", "  staleness <= 2").replace(
        "n = 8, max_tokens = 64)", "n = 8, max_tokens = 64, temperature = 2.5)")
    plan = plan_of(text)
    assert next(m.rollout_engine for m in plan.models if m.id == "policy").kind == "sglang"
    verdicts = {(v.role, v.engine): v for v in plan.search.engines}
    assert verdicts[("rollout", "sglang")].verdict == "chosen" and verdicts[("rollout", "sglang")].seconds > 0
    assert verdicts[("rollout", "vllm")].verdict == "refused"
    assert verdicts[("rollout", "vllm")].why.startswith("E438: `temperature = 2.5`")
    assert verdicts[("rollout", "hf_generate")].verdict == "not searched"
    assert {v.engine for v in plan.search.engines if v.role == "train"} == {"torch", "fsdp", "megatron"}
    assert any(k.startswith("E438") for k in plan.search.rejected)


def test_a_model_vllm_does_not_run_gets_another_rollout_engine(plan_of, monkeypatch):
    """An architecture vLLM's record does not list (a catalogue where vLLM runs only GPT-2): the
    search gives the model the rollout engine that runs it, and the explanation names both."""
    from dataclasses import replace

    from flowrl.catalog.engines import ENGINES

    monkeypatch.setitem(ENGINES, "vllm", replace(ENGINES["vllm"], architectures=frozenset({"GPT2LMHeadModel"})))
    plan = plan_of(auto("cluster(gpus_per_node = 4)", "  staleness <= 2"))
    assert next(m.rollout_engine for m in plan.models if m.id == "policy").kind == "sglang"
    vllm = next(v for v in plan.search.engines if v.engine == "vllm")
    assert vllm.verdict == "refused" and vllm.why.startswith("E607:") and "LlamaForCausalLM" in vllm.why
    assert any(k.startswith("E607") for k in plan.search.rejected)


def test_train_engines_that_do_not_run_the_architecture_are_refused(plan_of):
    """GPT-2 runs on the plain torch trainer only (fsdp wraps Llama-style layers, Megatron converts
    Llama-style families; torch with dp > 1 runs on fsdp's ranks): the search finds the schedule
    with one torch trainer rank instead of one the passes would refuse (E607)."""
    plan = plan_of(auto("cluster(gpus_per_node = 4)", "  staleness <= 2", model='tiny(task = "arith", arch = "gpt2")'))
    train = next(m.train_engine for m in plan.models if m.id == "policy")
    assert (train.kind, train.dp) == ("torch", 1)
    verdicts = {(v.role, v.engine): v.verdict for v in plan.search.engines}
    assert verdicts[("train", "fsdp")] == verdicts[("train", "megatron")] == "refused"
    assert verdicts[("rollout", "vllm")] == "chosen"


def test_explain_lists_every_engine_considered(capsys):
    from flowrl.cli import main

    assert main(["plan", "flows/grpo_auto.flow", "--explain"]) == 0
    out = capsys.readouterr().out
    block = out.split("  engines (every one the catalogue has for the flow's roles):\n")[1].split("  runners-up:")[0]
    rows = [line.split()[:3] for line in block.splitlines()]
    # a train engine may span the 8 nodes (its ranks are Ray actors): the search picks megatron(tp = 2) over them
    assert ["rollout", "vllm", "chosen"] in rows and ["train", "megatron", "chosen"] in rows
    assert {r[1] for r in rows} == {"vllm", "sglang", "hf_generate", "torch", "fsdp", "megatron"}
