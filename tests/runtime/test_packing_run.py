"""`flowrl run` of an update with token-budget micro-batches and packing: two steps through Ray,
the torch rollout engine (``hf_generate``: no vLLM start-up) and the torch trainer on the tiny model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")

from e2e_kit import make_workdir, shared_ray, write_flow  # noqa: E402

from flowrl.launch import run_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BODY = """b = sample(prompts, size = 4)
  x = generate(policy, b, n = 2, max_tokens = 6)
  update(policy, x, group_advantage(sevens(x), group = 2), logprobs(policy, x), lr = 3e-3,
         micro_batch_tokens = 24, pack = true)"""

SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  policy.rollout = hf_generate()
}
"""


def test_a_packed_token_budget_update_runs(tmp_path):
    workdir = make_workdir(tmp_path)
    path = write_flow(workdir / "packed.flow", BODY, steps=2, schedule=SCHEDULE, imports=())
    out = workdir / "run"
    run_file(str(path), out=str(out), ray_address=shared_ray())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["train/policy/pad_fraction"] == 0.0  # packed rows carry no padding
        assert r["train/policy/grad_norm"] > 0
