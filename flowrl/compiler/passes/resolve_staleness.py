"""Relax the loop-carried weight edge to the schedule's staleness and size the modulo schedule.

Requires: plan_layouts (engines laid out), insert_resyncs (``resync.M -> generate`` edges).

Guarantees: every WEIGHTS edge from a ``resync`` node into a ``generate`` has distance
``s`` (the schedule's ``staleness s``; 1 without one): generation at step k reads the
weights pushed at step k - s, so the runtime keeps s steps in flight.
``graph.sched.pipeline`` holds the steps in flight, the largest version lag a trained
sample can have (``s - 1 + every - 1``), the versioned buffer's capacity and, with
``partial_rollout(over_provision = f)``, the requests sent per step (f x samples).

``partial_rollout(recycle = true)`` resumes unfinished generations under newer weights,
so their samples mix policy versions: it needs ``staleness >= 2`` (E431). An ``update`` that
will train stale samples without ``tis`` gets a note; under ``schedule auto`` it gets
``tis = 2.0`` instead (unless ``auto_correct = false``). The rules are
:mod:`flowrl.compiler.schedule.staleness`'s.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... reward v = verifier("exact")
... flow f(d: dataset) {
...   b = sample(d)  r = generate(m, b, n = 2)  lp = logprobs(m, r)
...   update(m, r, group_advantage(v(r), group = 2), lp)
... }
... schedule f on cluster() { staleness 3 }''', "doc.flow", until="resolve_staleness", allow_missing=True)
>>> [(u, v, e.distance) for u, v, e in g.edges() if u == "resync.m"]
[('resync.m', 'r', 3)]
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.catalog.ops import OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.sched import SchedState
from flowrl.compiler.schedule.staleness import auto_corrections, off_policy_notes, pipeline_plan, staleness_problems
from flowrl.compiler.workload import workload
from flowrl.diagnostics import Collector
from flowrl.ir.graph import EdgeKind, FlowGraph


def resolve_staleness(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    st: SchedState = graph.sched
    spec = st.spec
    errors = Collector(ctx.sources)
    errors.items.extend(staleness_problems(spec, spec.staleness))
    errors.raise_if_any()
    s = spec.staleness
    out = graph
    relax = [(u, v, e) for u, v, e in graph.edges()
             if e.kind == EdgeKind.WEIGHTS and graph.node(u).kind == OpKind.RESYNC and e.distance != s]
    if relax:
        out = graph.copy()
        for u, v, e in relax:
            out.set_edge(u, v, replace(e, distance=s))
    notes = list(st.notes)
    if s > 1 and not any(n.kind == OpKind.RESYNC for n in graph.nodes()):
        notes.append(f"staleness {s} has no effect: no model is both trained and generated with")
    pipeline = pipeline_plan(spec, s, workload(graph).gens)
    out, corrected = auto_corrections(out, spec, pipeline.max_version_lag)  # `schedule auto` adds tis, and says so
    notes += corrected + off_policy_notes(out, pipeline.max_version_lag)
    return replace(out, sched=replace(st, staleness=s, pipeline=pipeline, notes=tuple(notes)))


__all__ = ["resolve_staleness"]
