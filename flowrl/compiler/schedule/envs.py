"""The rule that sizes an environment's pool of workers (``size_env_pools``)."""

from __future__ import annotations

import math

from flowrl.catalog.ops import ENV_CALLS_PER_WORKER
from flowrl.compiler.sched import SchedState
from flowrl.plan import EnvSizing


ENDPOINT_BYTES_PER_TOKEN = 24
"""What the rollout endpoint keeps per token of an in-flight episode's row: its id, mask and
log-prob (:class:`flowrl.runtime.endpoint.Call`, Python lists of 8-byte slots)."""


def env_sizing(written, per_step: int, st: SchedState, row_tokens: int | None = None) -> EnvSizing:
    """The workers of one environment: ``written`` (its ``workers`` option) if an int, else sized
    from the episodes the schedule keeps in flight: ``per_step`` episodes a step (the rows its
    ``env_step`` reads, times a partial rollout's over-provisioning) x the steps in flight.
    ``row_tokens``: an environment that drives the policy through the rollout endpoint, the tokens
    one episode may hold; the reason then says the endpoint's concurrency (every episode in flight
    may have a request waiting: one engine call serves them all) and what it holds for them.

    >>> from types import SimpleNamespace
    >>> env_sizing(None, 96, SimpleNamespace(pipeline=None), 512).why
    'sized by the schedule: 96 episodes in flight (96 per step x 1 step), 64 calls per worker; endpoint: up to 96 requests batched per engine call, ~1.1 MiB of token records in flight (512 tokens an episode)'
    """
    p = st.pipeline
    steps = p.in_flight if p is not None else 1
    per_step = math.ceil(per_step * (p.over_provision if p is not None else 1.0))
    episodes = max(per_step * steps, 1)
    endpoint = ""
    if row_tokens is not None:
        mib = episodes * row_tokens * ENDPOINT_BYTES_PER_TOKEN / 2 ** 20
        endpoint = (f"; endpoint: up to {episodes} requests batched per engine call, ~{mib:.1f} MiB of token records "
                    f"in flight ({row_tokens} tokens an episode)")
    if isinstance(written, int):
        return EnvSizing(written, "as written" + endpoint)
    return EnvSizing(math.ceil(episodes / ENV_CALLS_PER_WORKER),
                     f"sized by the schedule: {episodes} episodes in flight ({per_step} per step x {steps} "
                     f"step{'s' if steps != 1 else ''}), {ENV_CALLS_PER_WORKER} calls per worker" + endpoint)


__all__ = ["env_sizing"]
