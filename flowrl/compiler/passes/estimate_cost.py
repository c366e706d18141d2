"""Estimate each op's time, each GPU's memory, and the step time, bubble and utilisation.

Requires: select_sync_protocol (everything placed, laid out, staleness and protocols set).

Guarantees: ``graph.sched.estimate`` is a :class:`~flowrl.plan.CostPlan`: the step's ops
simulated over a few steps (``ctx.options["sim_steps"]``, default 6; seed 0, so the estimate
is deterministic) by :func:`flowrl.compiler.schedule.estimate.estimate`, the same estimate
``schedule auto`` ranks its candidates by. Reports no errors: infeasible schedules were
rejected before.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... reward v = verifier("exact")
... flow f(d: dataset) {
...   b = sample(d)  r = generate(m, b, n = 2)  lp = logprobs(m, r)
...   update(m, r, group_advantage(v(r), group = 2), lp, epochs = 2)
... }''', "doc.flow", allow_missing=True)
>>> est = g.sched.estimate
>>> est.step_s > 0 and set(est.breakdown) >= {"generate", "update", "logprobs"}
True

(With ``epochs = 1`` the old-logprob pass would be elided, see
:mod:`flowrl.compiler.passes.elide_logprobs`, and cost nothing.)
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.compiler.context import CompileContext
from flowrl.compiler.sched import SchedState
from flowrl.compiler.schedule.estimate import SIM_STEPS, estimate
from flowrl.compiler.workload import workload
from flowrl.ir.graph import FlowGraph


def estimate_cost(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    st: SchedState = graph.sched
    steps = int(ctx.options.get("sim_steps", SIM_STEPS)) if ctx is not None else SIM_STEPS
    est = estimate(graph, st, workload(graph), steps=steps)
    return replace(graph, sched=replace(st, estimate=est))


__all__ = ["estimate_cost"]
