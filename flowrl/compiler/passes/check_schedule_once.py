"""Refuse a schedule statement written twice, where the second would replace the first.

Requires: nothing but the flow's ``schedule`` block (``FlowGraph.schedule``).

Guarantees: a schedule has at most one ``staleness``, one ``resync MODEL ...`` per
model and one of each schedule call (``partial_rollout(...)``): E416 otherwise, at the
second, with a note at the first. (Layouts, pools and placements written twice are
E407, E417 and E418 of ``check_schedule``.) The graph is returned unchanged. The check
is a pass rather than a parser rule so that ``flowrl fmt`` still formats such a file.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... flow f(m: model, d: dataset) { r = generate(m, sample(d))  return r }
... schedule f on cluster() { staleness 1  staleness 2 }''', "doc.flow", until="check_schedule_once")
... except FlowError as e:
...     print(e.diagnostics[0].code, e.diagnostics[0].message)
E416 `staleness` is given twice in this schedule
"""

from __future__ import annotations

from flowrl.compiler.context import CompileContext
from flowrl.diagnostics import Collector, Span
from flowrl.ir.graph import FlowGraph
from flowrl.syntax import ast


def check_schedule_once(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    if graph.schedule is None:
        return graph
    errors = Collector(ctx.sources)
    seen: dict[str, Span] = {}
    for st in graph.schedule.body:
        if isinstance(st, ast.Staleness):
            key, what = "staleness", "`staleness`"
        elif isinstance(st, ast.Resync):
            key, what = f"resync {st.model}", f"`resync {st.model}`"
        elif isinstance(st, ast.SchedCall):
            key, what = f"call {st.call.func}", f"`{st.call.func}(...)`"
        else:
            continue
        if key in seen:
            errors.error("E416", f"{what} is given twice in this schedule", st.span,
                         "keep one: the second would silently replace the first",
                         notes=(("first given", seen[key]),))
        else:
            seen[key] = st.span
    errors.raise_if_any()
    return graph
