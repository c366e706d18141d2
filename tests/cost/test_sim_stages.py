"""The compiled simulation follows the runtime: producer/consumer stages, and on CPU every engine
process computes on its own cores (colocated engines overlap), on GPUs colocated engines take turns."""

from __future__ import annotations

import pytest
from cost_cases import ROOT, TEST_FLOW

from flowrl.compiler import calibrate
from flowrl.cost.sim import producer_ids, simulate


def _flow(tmp_path, staleness: int, gpu: str | None = None) -> str:
    text = TEST_FLOW.replace("{ROOT}", str(ROOT)).replace("staleness 1", f"staleness {staleness}")
    if gpu:
        text = text.replace("cluster(nodes = 1, gpus_per_node = 1)", f'cluster(nodes = 1, gpus_per_node = 1, gpu = "{gpu}")')
    path = tmp_path / f"s{staleness}_{gpu or 'cpu'}.flow"
    path.write_text(text)
    return str(path)


def test_stages_are_the_runtimes(tmp_path):
    from flowrl.launch import build_plan
    from flowrl.runtime.pipeline import split_stages

    flow = _flow(tmp_path, 2)
    _, spec, _ = calibrate.compile_spec(flow)
    producer, consumer = split_stages(build_plan(flow, steps=4))
    sim_ids = {p.id for p in spec.phases}
    assert producer_ids(spec) == {op.id for op in producer} & sim_ids == {"grpo.prompt_batch", "grpo.rollouts",
                                                                           "grpo.scores"}
    assert {op.id for op in consumer} & sim_ids == sim_ids - producer_ids(spec)


def test_cpu_engines_have_lanes_of_their_own(tmp_path):
    _, spec, _ = calibrate.compile_spec(_flow(tmp_path, 1))
    lanes = {p.lane for p in spec.phases if spec.lanes.get(p.lane)}
    assert lanes == {"all:policy.rollout", "all:policy.train", "all:grpo.ref.train"}


def test_on_cpu_one_step_off_overlaps_colocated_engines(tmp_path):
    s1 = simulate(calibrate.compile_spec(_flow(tmp_path, 1))[1], steps=12)
    s2 = simulate(calibrate.compile_spec(_flow(tmp_path, 2))[1], steps=12)
    assert s2.step_s < 0.95 * s1.step_s  # the generation (a fraction of the step here) is hidden
    span = {lab: {k: (a, b) for _l, lb, k, a, b in s2.timeline if lb == lab} for lab in ("generate", "resync")}
    gen, push = span["generate"], span["resync"]
    k = s2.warmup + 1
    # generation of step k+1 starts at the push of step k-1 and runs while step k trains
    assert gen[k + 1][0] == pytest.approx(push[k - 1][1]) and gen[k + 1][1] <= push[k][0]


def test_on_gpus_colocated_engines_take_turns(tmp_path):
    s1 = simulate(calibrate.compile_spec(_flow(tmp_path, 1, "H100"))[1], steps=24)
    s2 = simulate(calibrate.compile_spec(_flow(tmp_path, 2, "H100"))[1], steps=24)
    assert s2.step_s == pytest.approx(s1.step_s, rel=0.05)
    _, spec, _ = calibrate.compile_spec(_flow(tmp_path, 2, "H100"))
    assert {p.lane for p in spec.phases if spec.lanes.get(p.lane)} == {"all"}
