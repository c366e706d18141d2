"""Choose the schedule the later passes place, lay out and check: written, default, or searched.

Requires: check_platform (the schedule block is well-formed and everything the flow uses
runs on its platform).

Guarantees: ``graph.sched`` is a :class:`~flowrl.compiler.sched.SchedState` holding the
schedule as data (:class:`~flowrl.compiler.sched.ScheduleSpec`: the ``schedule`` block, or
the default schedule of a flow without one), the facts of every model, the cluster's
hardware profile (and so its platform), the engines the flow uses and the prompt and
reference completion lengths measured from its datasets (:mod:`flowrl.compiler.data_workload`). For
``schedule ... auto`` the spec is the winner of :func:`flowrl.compiler.auto.search_schedule`
(placement x layouts x staleness x protocol, every candidate checked by the same
library functions the later passes apply) and ``search`` its report; E436 when nothing
fits, E437 when ``every`` already exceeds the staleness limit.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... flow f(m: model, d: dataset) { b = sample(d)  r = generate(m, b)  return r }
... schedule f on cluster(gpus_per_node = 2, gpu = "H100") { staleness 2 }
... ''', "doc.flow", until="choose_schedule")
>>> g.sched.hw.name, g.sched.hw.platform, g.sched.engines_needed, g.sched.spec.staleness
('H100', 'cuda', ('m.rollout',), 2)
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.compiler.auto import search_schedule
from flowrl.compiler.context import CompileContext
from flowrl.compiler.model_info import model_facts
from flowrl.compiler.data_workload import measured_workload
from flowrl.compiler.sched import SchedState, engines_needed, spec_from_ast
from flowrl.cost.profiles import get_profile
from flowrl.ir.graph import FlowGraph


def choose_schedule(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    spec = spec_from_ast(graph)
    facts = model_facts(graph)
    hw = get_profile(str(spec.cluster["gpu"]), int(spec.cluster["gpus_per_node"]))
    needed = engines_needed(graph)
    search = None
    data = measured_workload(graph, ctx)
    if spec.auto:
        spec, search = search_schedule(graph, spec, facts, hw, needed, ctx, data)
    lengths = dict(ctx.options.get("lengths", {})) if ctx is not None else {}
    state = SchedState(spec, facts, hw, needed, staleness=spec.staleness, search=search, lengths=lengths,
                       data=data)
    return replace(graph, sched=state)


__all__ = ["choose_schedule"]
