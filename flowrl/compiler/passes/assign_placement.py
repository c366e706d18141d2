"""Assign every engine of the flow a pool of GPUs on the declared cluster.

Requires: choose_schedule (``graph.sched`` holds the schedule as data, the model facts, the
hardware profile and the engines the flow uses).

Guarantees: ``graph.sched`` holds the pools (with their GPUs, nodes and Ray
placement-group strategy) and one :class:`~flowrl.plan.EnginePlan` per engine the flow
uses (``policy.train``, ``policy.rollout``, ``grpo.ref.train``) with its pool, its
colocated neighbours and its share of each GPU; layouts come in plan_layouts. The rules
(pools carved in declaration order, derived models following their base's trainer,
overlapping engines time-sharing) are :mod:`flowrl.compiler.schedule.placement`'s.

Errors (E422, E423) point at the pool line, with the numbers.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... flow f(m: model, d: dataset) { b = sample(d)  r = generate(m, b)  return r }
... schedule f on cluster(nodes = 2, gpus_per_node = 4) { pool gen = gpus(gpus = 6, nodes = 2)  place m.rollout on gen }
... ''', "doc.flow", until="assign_placement")
>>> gen = next(p for p in g.sched.pools if p.name == "gen")
>>> gen.gpu_ids, gen.strategy
((0, 1, 2, 4, 5, 6), 'PACK')
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.compiler.context import CompileContext
from flowrl.compiler.sched import SchedState
from flowrl.compiler.schedule.placement import base_models, place
from flowrl.diagnostics import Collector
from flowrl.ir.graph import FlowGraph


def assign_placement(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    st: SchedState = graph.sched
    pools, engines, problems = place(st.spec, st.engines_needed, base_models(graph))
    errors = Collector(ctx.sources)
    errors.items.extend(problems)
    errors.raise_if_any()
    return replace(graph, sched=replace(st, pools=pools, engines=engines))


__all__ = ["assign_placement"]
