"""End to end with SGLang as the rollout engine: real Ray actors, SGLang on CPU, the torch trainer.

The flow, data and reward of test_e2e.py (tests/runtime/e2e_kit.py). Every step resyncs the weights into
SGLang (the ``inplace`` protocol, checksummed buckets) and compares SGLang's
log-probs of the sampled tokens with the trainer's: a stale or half-loaded weight
shows as a mismatch. SGLang's sampling is not seeded on CPU (see
flowrl/engines/sglang_engine.py), so rewards are not compared with a fixed curve.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")
pytest.importorskip("ray")

from e2e_kit import make_workdir, shared_ray, write_flow  # noqa: E402

from flowrl.launch import run_file  # noqa: E402

# make test-long (the whole module: one run, 120 s); in make test: SGLang's CPU paths, generation and weight
# update (tests/engines/test_sglang_engine.py), and a flow on SGLang for one step (tests/property/test_executable.py)
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]

SGLANG_SCHEDULE = """
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  policy.rollout = sglang(tp = 1, mem_fraction = 0.5)
}
"""


GRPO = "grpo(policy, prompts, sevens, batch = 8, group = 4, max_tokens = 8, lr = 3e-3, kl = 0.0, seed = 1)"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("sglang_e2e"))


@pytest.fixture(scope="module")
def sglang_run(workdir):
    path = write_flow(workdir / "sglang.flow", GRPO, 4, SGLANG_SCHEDULE)
    return run_file(str(path), out=str(workdir / "sglang"), ray_address=shared_ray())


def test_grpo_trains_with_sglang_rollouts(sglang_run):
    rows = sglang_run.rows
    assert [r["policy/version"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["perf/gen_tokens"] > 0 and 0.0 <= row["reward/mean"] <= 1.0
        assert row["sync/bytes"] > 0 and row["sync/buckets"] >= 1  # weights crossed the inplace protocol
        assert row["mismatch/abs_max"] < 1e-4, row  # SGLang samples from exactly the trained weights
        assert row["staleness/hist/0"] == 32


def test_the_plan_ran_sglang(sglang_run, workdir):
    plan = (workdir / "sglang" / "plan.json").read_text()
    assert '"kind": "sglang"' in plan and '"kind": "vllm"' not in plan
