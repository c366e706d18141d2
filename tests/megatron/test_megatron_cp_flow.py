"""`policy.train = megatron(cp = 2)` through the whole stack: the schedule compiles and lowers to a
2-rank context-parallel trainer, the driver accepts it, and a GRPO run on Ray with vLLM rollout
trains for two steps; after each resync vLLM's log-probabilities of the sampled tokens match the
trainer's (which the CP ranks computed on their chunks and gathered back into token order)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("vllm")
pytest.importorskip("ray")

from flowrl.launch import build_plan, run_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GRPO = "grpo(policy, prompts, sevens, batch = 4, group = 2, max_tokens = 8, lr = 3e-3, kl = 0.0, seed = 1)"
CP_SCHEDULE = """schedule main on cluster(nodes = 1, gpus_per_node = 2) {
  policy.train = megatron(cp = 2)
  policy.rollout = vllm(tp = 1)
}
"""
RUNTIME_DIR = str(Path(__file__).resolve().parents[1] / "runtime")
"""tests/runtime: e2e_kit (the work directory) and e2e_rewards (the flow's reward, imported by name)."""


@pytest.fixture(scope="module")
def flow_file(tmp_path_factory):
    sys.path.insert(0, RUNTIME_DIR)
    try:
        from e2e_kit import make_workdir, write_flow
    finally:
        sys.path.remove(RUNTIME_DIR)
    tmp = make_workdir(tmp_path_factory.mktemp("megatron_cp_flow"), rows=48, train=40, seed=3)
    return write_flow(tmp / "cp.flow", GRPO, 2, CP_SCHEDULE)


def test_cp2_lowers_to_a_context_parallel_megatron_trainer(flow_file):
    engine = build_plan(str(flow_file)).model("policy").train_engine
    assert (engine.kind, engine.tp, engine.pp, engine.dp, engine.cp, engine.world_size) == ("megatron", 1, 1, 1, 2, 2)


@pytest.mark.long  # make test-long, 84 s; in make test: CP x DP at engine level (test_megatron_cp.py), Megatron tp=2 through the runtime (test_e2e)
def test_cp2_grpo_runs_and_matches_vllm_after_each_resync(flow_file, monkeypatch):
    monkeypatch.syspath_prepend(RUNTIME_DIR)  # e2e_rewards, for the reward pool's processes
    result = run_file(str(flow_file), out=str(flow_file.parent / "run"))
    assert len(result.rows) == 2
    plan = json.loads((result.out / "plan.json").read_text())
    assert [m["train_engine"]["cp"] for m in plan["models"] if m["id"] == "policy"] == [2]
    for row in result.rows:
        assert row["train/policy/grad_norm"] > 0, row  # the step trained: the resync sends new weights
        assert row["mismatch/abs_max"] < 1e-4, row  # vLLM vs the cp=2 trainer, after each resync
        assert row["sync/bytes"] > 0
    assert [r["policy/version"] for r in result.rows] == [1, 2]
