"""size_env_pools: an environment's pool is sized from the episodes the schedule keeps in flight."""

from __future__ import annotations

import pytest

from flowrl.compiler.explain import describe_plan
from flowrl.compiler.lower import lower
from flowrl.compiler.pipeline import compile_text

FLOW = '''
model m = tiny()
dataset d = jsonl("d.jsonl")
env tool = python_env("flowrl.envs.calculator:Calculator"WORKERS)
reward v = verifier("exact")
flow f() {
  c = generate(m, sample(d, size = 32), n = 8)
  repeat 2 until done { o = env_step(tool, c)  c = generate(m, o) }
  update(m, c, group_advantage(v(c), group = 8), loss = pg())
}
schedule f on cluster() { SCHEDULE }
'''


def _graph(workers="", schedule="staleness 1"):
    text = FLOW.replace("WORKERS", workers).replace("SCHEDULE", schedule)
    return compile_text(text, "doc.flow", allow_missing=True)


@pytest.mark.parametrize("schedule, workers, episodes", [
    ("staleness 1", 4, "256 episodes in flight (256 per step x 1 step)"),
    ("staleness 3", 12, "768 episodes in flight (256 per step x 3 steps)"),
    ("staleness 2\n partial_rollout(over_provision = 1.5, recycle = true)", 12,
     "768 episodes in flight (384 per step x 2 steps)"),
])
def test_the_pool_has_a_call_slot_for_every_episode_in_flight(schedule, workers, episodes):
    sizing = _graph(schedule=schedule).sched.envs["tool"]
    assert sizing.workers == workers and sizing.why == f"sized by the schedule: {episodes}, 64 calls per worker"


def test_written_workers_are_kept_and_reach_the_plan_and_its_display():
    g = _graph(", workers = 3", "staleness 3")
    assert (g.sched.envs["tool"].workers, g.sched.envs["tool"].why) == (3, "as written")
    plan = lower(g, {})
    (env,) = plan.envs
    assert env.options["workers"] == 3 and env.workers_why == "as written"
    sized = lower(_graph(), {})
    assert sized.envs[0].options["workers"] == 4
    assert ('  tool: python_env("flowrl.envs.calculator:Calculator"), 4 workers (sized by the schedule: 256 episodes '
            'in flight (256 per step x 1 step), 64 calls per worker), timeout 10 s a call') in describe_plan(sized)


def test_the_estimate_divides_the_environments_time_by_its_workers():
    def env_seconds(g):
        return sum(o.seconds for o in g.sched.estimate.ops if o.kind == "env_step")

    one, eight = env_seconds(_graph(", workers = 1")), env_seconds(_graph(", workers = 8"))
    assert one > eight > 0
