"""Staleness as dependency distance, the modulo schedule's sizes, and weight-sync protocol selection."""

from __future__ import annotations

import math

import pytest
from schedule_flows import grpo

from flowrl.diagnostics import FlowError
from flowrl.ir.graph import EdgeKind


def weight_edges(g) -> dict:
    return {(u, v): e.distance for u, v, e in g.edges() if e.kind == EdgeKind.WEIGHTS}


@pytest.mark.parametrize("s", [1, 2, 3, 5])
def test_staleness_is_the_distance_of_the_edge_into_generate(compile_flow, s):
    g = compile_flow(grpo(schedule=f"schedule main on cluster() {{ staleness {s} }}"))
    edges = weight_edges(g)
    assert edges[("resync.policy", "rollouts")] == s
    assert edges[("update", "old_lp")] == 1          # the trainer reads its own weights: still the next step
    assert edges[("update", "resync.policy")] == 0
    assert g.sched.staleness == s


def test_pipeline_sizes_with_partial_rollout(plan_of):
    plan = plan_of(grpo(batch=16, n=4, schedule="""
schedule main on cluster(gpus_per_node = 2) {
  pool gen = gpus(gpus = 1)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  colocate policy.train, ref on train
  staleness 3
  resync policy via gloo() every 2
  partial_rollout(over_provision = 1.5)
}"""))
    p = plan.pipeline
    assert (p.in_flight, p.samples_per_step, p.requests_per_step) == (3, 64, 96)
    assert p.buffer_samples == 96 * 3 and p.recycle and p.over_provision == 1.5
    assert p.max_version_lag == (3 - 1) + (2 - 1)     # staleness - 1, plus the steps between pushes
    assert plan.resyncs[0].every == 2


def test_partial_rollout_without_recycling_is_fine_when_synchronous(plan_of):
    plan = plan_of(grpo(schedule="""
schedule main on cluster() {
  staleness 1
  partial_rollout(over_provision = 1.25, recycle = false)
}"""))
    assert plan.staleness == 1 and plan.pipeline.requests_per_step == math.ceil(512 * 1.25)
    assert not plan.pipeline.recycle


def test_staleness_without_a_resync_is_noted(plan_of):
    text = """
model m = tiny()
dataset d = jsonl("d.jsonl")
flow main() { x = generate(m, sample(d))  return x }
schedule main on cluster() { staleness 2 }
"""
    plan = plan_of(text)
    assert any("no effect" in n for n in plan.estimate.notes)


@pytest.mark.parametrize("s,tis,noted", [(1, None, False), (2, None, True), (4, None, True), (4, "2.0", False)])
def test_stale_samples_without_an_off_policy_correction_are_noted(plan_of, s, tis, noted):
    text = grpo(schedule=f"schedule main on cluster() {{ staleness {s} }}")
    if tis is not None:
        text = text.replace("kl = 0.001)", f"kl = 0.001, tis = {tis})")
        assert f"tis = {tis}" in text
    notes = [n for n in plan_of(text).estimate.notes if "off-policy" in n]
    assert bool(notes) == noted
    if noted:
        assert f"up to {s - 1} version(s) behind" in notes[0] and "tis = 2.0" in notes[0]


@pytest.mark.parametrize("cluster,pools,expect", [
    ('cluster(gpus_per_node = 8)', "", ("inplace", "local", "ray")),
    ('cluster(gpus_per_node = 8, gpu = "H100")', "", ("inplace", "local", "ray")),  # Ray's object store, any platform
    ('cluster(gpus_per_node = 8)', "split", ("gloo", "intra-node", "gloo")),
    ('cluster(gpus_per_node = 8, gpu = "A100")', "split", ("nccl", "intra-node", "nccl")),
    ('cluster(nodes = 2, gpus_per_node = 4, gpu = "H200")', "split", ("nccl", "inter-node", "nccl")),
])
def test_protocol_follows_the_placement(plan_of, cluster, pools, expect):
    body = """
  pool gen = gpus(gpus = 4)
  pool train = gpus(gpus = 4)
  place policy.rollout on gen
  colocate policy.train, ref on train
  staleness 2""" if pools else "colocate policy.train, policy.rollout, ref on all"
    plan = plan_of(grpo(schedule=f"schedule main on {cluster} {{ {body} }}"))
    r = plan.resyncs[0]
    assert (r.protocol, r.route, r.transport) == expect
    assert r.overlap == (expect[1] != "local")
    assert r.reason.startswith("the rollout engine shares" if not pools else "disaggregated")


def test_written_protocol_is_kept_and_nccl_on_cpu_runs_over_gloo(plan_of):
    plan = plan_of(grpo(schedule="""
schedule main on cluster(gpus_per_node = 8) {
  colocate policy.train, policy.rollout, ref on all
  resync policy via nccl(bucket = 64MB)
}"""))
    r = plan.resyncs[0]
    assert (r.protocol, r.transport, r.bucket_bytes, r.overlap) == ("nccl", "gloo", 64 * 10**6, False)
    assert "runs over gloo" in r.reason


def test_bucket_plan_of_a_7b_model(plan_of):
    plan = plan_of(grpo('hf("Qwen/Qwen2.5-7B")', max_tokens=1024, schedule="""
schedule main on cluster(nodes = 2, gpus_per_node = 8, gpu = "H100") {
  pool gen = gpus(gpus = 8)
  pool train = gpus(gpus = 8)
  place policy.rollout on gen
  colocate policy.train, ref on train
  policy.train = megatron(tp = 2, pp = 1)
  staleness 2
  resync policy via nccl(bucket = 512MB)
}"""))
    r = plan.resyncs[0]
    total = 7_615_616_512 * 2
    assert r.total_bytes == total and r.buckets == math.ceil(total / 512e6)
    assert r.largest_tensor in ("model.embed_tokens.weight", "lm_head.weight")
    assert r.largest_bytes == 152064 * 3584 * 2 > r.bucket_bytes   # split across buckets
    # gather of 2 tp shards over NVLink, then 15.2 GB over a 50 GB/s NIC at 80%
    assert r.seconds == pytest.approx(total / 2 / (450e9 * 0.8) + total / (50e9 * 0.8) + r.buckets * 30e-6,
                                      rel=1e-4)
    assert r.reshard is not None and r.reshard.src == "megatron(tp=2, pp=1)" and r.reshard.dst_tp == 1
    # `flowrl plan` shows the resharding as what the rollout ranks need, not as a copy the runtime makes
    from flowrl.compiler.explain import describe_plan

    (line,) = [x for x in describe_plan(plan).splitlines() if x.strip().startswith("reshard ")]
    assert "rows of a train rank that a rollout rank needs" in line and "its engine shards them" in line
    assert "to copy" not in line


def test_plan_prints_the_bytes_each_vllm_tp_rank_is_given(plan_of):
    """vLLM with tp > 1 is sent its shards per rank (the executed reshard plan): half the 7B model
    each, plus the norms every rank holds whole (Qwen2.5-7B's 4 KV heads divide by tp = 2)."""
    from flowrl.compiler.explain import describe_plan

    plan = plan_of(grpo('hf("Qwen/Qwen2.5-7B")', max_tokens=1024, schedule="""
schedule main on cluster(nodes = 2, gpus_per_node = 8, gpu = "H100") {
  pool gen = gpus(gpus = 8)
  pool train = gpus(gpus = 8)
  place policy.rollout on gen
  colocate policy.train, ref on train
  policy.train = megatron(tp = 2, pp = 1)
  policy.rollout = vllm(tp = 2)
  resync policy via nccl(bucket = 512MB)
}"""))
    (line,) = [x for x in describe_plan(plan).splitlines() if x.strip().startswith("reshard ")]
    norms = (2 * 28 + 1) * 3584 * 2  # bytes: two per layer and the final one, bf16
    total = 7_615_616_512 * 2
    assert f"each of its 2 ranks only its shards: {(total + norms) / 2 / 1e9:.1f} GB per rank" in line, line


def test_checkpoint_with_a_shared_dir_crosses_nodes(plan_of):
    plan = plan_of(grpo(schedule="""
schedule main on cluster(nodes = 2, gpus_per_node = 1) {
  pool gen = gpus(gpus = 1)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  colocate policy.train, ref on train
  resync policy via checkpoint(dir = "/shared/ckpt", keep = 2)
}"""))
    r = plan.resyncs[0]
    assert (r.protocol, r.transport, r.options) == ("checkpoint", "disk", {"dir": "/shared/ckpt", "keep": 2})


def test_cuda_ipc_runs_colocated_on_nvidia_gpus_only(plan_of, compile_flow):
    """`cuda_ipc` shares device buffers with the rollout engine on the trainer's GPUs: accepted there
    on an NVIDIA cluster; refused between pools (E432) and on a CPU cluster (E443)."""
    colocated = 'colocate policy.train, policy.rollout, ref on all\n  resync policy via cuda_ipc(bucket = 64MB)'
    plan = plan_of(grpo(schedule=f'schedule main on cluster(gpus_per_node = 8, gpu = "H100") {{\n  {colocated}\n}}'))
    r = plan.resyncs[0]
    assert (r.protocol, r.route, r.transport, r.bucket_bytes) == ("cuda_ipc", "local", "cuda_ipc", 64 * 10**6)
    with pytest.raises(FlowError) as info:
        compile_flow(grpo(schedule=f"schedule main on cluster(gpus_per_node = 8) {{\n  {colocated}\n}}"))
    assert [d.code for d in info.value.diagnostics] == ["E443"] and "NVIDIA" in info.value.diagnostics[0].hint
    with pytest.raises(FlowError) as info:
        compile_flow(grpo(schedule="""schedule main on cluster(gpus_per_node = 8, gpu = "H100") {
  pool gen = gpus(gpus = 4)
  pool train = gpus(gpus = 4)
  place policy.rollout on gen
  colocate policy.train, ref on train
  resync policy via cuda_ipc()
}"""))
    assert [d.code for d in info.value.diagnostics] == ["E432"]
