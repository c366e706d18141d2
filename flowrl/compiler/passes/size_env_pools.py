"""Size the pool of workers of each environment the flow steps, from the schedule.

Requires: resolve_staleness (``graph.sched.pipeline``: requests per step, steps in flight).

Guarantees: ``graph.sched.envs`` has an :class:`~flowrl.plan.EnvSizing` for every environment an
``env_step`` calls: its ``workers`` as written on the ``python_env``, else enough Ray actors that
every episode the schedule keeps in flight (the rows its ``env_step`` reads per step, times a
partial rollout's over-provisioning, x the steps in flight) has a call slot,
``ceil(episodes / ENV_CALLS_PER_WORKER)`` (each worker runs that many calls at a time,
:mod:`flowrl.runtime.env_pool`), with the reason. The cost estimate, ``flowrl plan`` and the
runtime's pools read it.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... env tool = python_env("flowrl.envs.calculator:Calculator")
... reward v = verifier("exact")
... flow f(d: dataset) {
...   c = generate(m, sample(d, size = 64), n = 8)
...   repeat 2 until done { o = env_step(tool, c)  c = generate(m, o) }
...   update(m, c, group_advantage(v(c), group = 8), loss = pg())
... }
... schedule f on cluster() { staleness 2 }''', "doc.flow", until="size_env_pools", allow_missing=True)
>>> g.sched.envs["tool"].workers, g.sched.envs["tool"].why
(16, 'sized by the schedule: 1024 episodes in flight (512 per step x 2 steps), 64 calls per worker')
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.catalog.ops import OPS, OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.sched import SchedState
from flowrl.compiler.schedule.envs import env_sizing
from flowrl.compiler.workload import int_option, workload
from flowrl.ir.graph import FlowGraph, Ref, plain


def size_env_pools(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    st: SchedState | None = graph.sched
    if st is None:
        return graph
    rows = workload(graph).samples
    per_step: dict[str, int] = {}  # environment -> episodes a step (its busiest env_step's rows)
    for n in graph.nodes():
        spec = OPS.get(n.op)
        for i, a in enumerate(spec.args if spec is not None and spec.kind != OpKind.ENV else ()):
            if a.type == "env" and i < len(n.args) and isinstance(n.args[i], Ref):  # env_step, agent_rollout
                env = n.args[i].target
                per_step[env] = max(per_step.get(env, 0), rows.get(n.id, 0))
    envs = {env: env_sizing(plain(graph.node(env).attr("workers")), count, st, _endpoint_rows(graph, env, st))
            for env, count in sorted(per_step.items())
            if env in graph and graph.node(env).kind == OpKind.ENV and graph.node(env).op != "param"}
    return replace(graph, sched=replace(st, envs=envs)) if envs else graph


def _endpoint_rows(graph: FlowGraph, env: str, st: SchedState) -> int | None:
    """Tokens one episode of an environment that drives the policy through the rollout endpoint may
    hold (its ``max_turns`` calls of the longest ``max_tokens`` that runs it, as long again for what
    comes back between them, within its policy's context); None for the ``env_step`` protocol."""
    node = graph.node(env)
    spec = OPS.get(node.op)
    if spec is None or spec.protocol is None:
        return None
    turns = int_option(node, "max_turns", 1)
    longest, context = 0, None
    for n in graph.nodes():
        if any(isinstance(a, Ref) and a.target == env for a in n.args) and n.kind != OpKind.ENV:
            longest = max(longest, int_option(n, "max_tokens", 64))
            facts = st.facts.get(n.model) if n.model else None
            context = getattr(facts, "max_len", None) or context
    tokens = 2 * turns * longest
    return min(tokens, context) if isinstance(context, int) and context > 0 else tokens


__all__ = ["size_env_pools"]
