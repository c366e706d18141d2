"""The rule that sizes an environment's pool of workers (``size_env_pools``)."""

from __future__ import annotations

import math

from flowrl.catalog.ops import ENV_CALLS_PER_WORKER
from flowrl.compiler.sched import SchedState
from flowrl.plan import EnvSizing


def env_sizing(written, per_step: int, st: SchedState) -> EnvSizing:
    """The workers of one environment: ``written`` (its ``workers`` option) if an int, else sized
    from the episodes the schedule keeps in flight: ``per_step`` episodes a step (the rows its
    ``env_step`` reads, times a partial rollout's over-provisioning) x the steps in flight."""
    if isinstance(written, int):
        return EnvSizing(written, "as written")
    p = st.pipeline
    steps = p.in_flight if p is not None else 1
    per_step = math.ceil(per_step * (p.over_provision if p is not None else 1.0))
    episodes = max(per_step * steps, 1)
    return EnvSizing(math.ceil(episodes / ENV_CALLS_PER_WORKER),
                     f"sized by the schedule: {episodes} episodes in flight ({per_step} per step x {steps} "
                     f"step{'s' if steps != 1 else ''}), {ENV_CALLS_PER_WORKER} calls per worker")


__all__ = ["env_sizing"]
