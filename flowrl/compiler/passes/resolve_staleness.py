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
will train stale samples without ``tis`` gets a note (:func:`off_policy_notes`).

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

import math
from dataclasses import replace

from flowrl.compiler.context import CompileContext
from flowrl.plan import PipelinePlan
from flowrl.compiler.sched import SchedState, ScheduleSpec
from flowrl.compiler.workload import workload
from flowrl.diagnostics import Collector, Diagnostic
from flowrl.ir.graph import EdgeKind, FlowGraph
from flowrl.catalog.ops import OpKind


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
    notes += off_policy_notes(graph, pipeline.max_version_lag)
    return replace(out, sched=replace(st, staleness=s, pipeline=pipeline, notes=tuple(notes)))


def off_policy_notes(graph: FlowGraph, lag: int) -> list[str]:
    """Updates that train samples up to ``lag`` versions old without an importance correction.

    With one optimiser step per batch the PPO ratio is taken against log-probs the trainer
    computes now, so it is 1 and does not see the staleness; truncated importance sampling
    against the rollout engine's own log-probs (``tis``) does (veRL and AReaL use it for async RL).
    """
    if lag < 1:
        return []
    out = []
    for n in graph.nodes():
        if n.kind != OpKind.UPDATE or not n.model:
            continue
        if not getattr(n.attr("tis"), "value", 0.0):
            out.append(f"`{n.id}` trains samples up to {lag} version(s) behind the weights without an off-policy "
                       f"correction: consider `tis = 2.0` (truncated importance sampling against the rollout's "
                       f"log-probs)")
    return out


def staleness_problems(spec: ScheduleSpec, s: int) -> list[Diagnostic]:
    """What is wrong with staleness ``s`` under ``spec`` (partial-rollout recycling needs s >= 2)."""
    p = spec.partial
    if p is not None and p.recycle and p.over_provision > 1.0 and s < 2:
        return [Diagnostic(
            "E431", f"partial_rollout(recycle = true) resumes unfinished generations under newer weights, so their "
                    f"samples are up to 1 version stale, but staleness {s} allows none", p.span,
            "write `staleness 2` (one-step-off), or `recycle = false` to drop unfinished generations")]
    return []


def pipeline_plan(spec: ScheduleSpec, s: int, gens) -> PipelinePlan:
    samples = sum(g.samples for g in gens)
    p = spec.partial
    f = p.over_provision if p is not None else 1.0
    every = max((r.every for r in spec.resyncs.values()), default=1)
    requests = math.ceil(samples * f)
    return PipelinePlan(in_flight=s, max_version_lag=s - 1 + every - 1, buffer_samples=requests * s,
                        samples_per_step=samples, requests_per_step=requests, over_provision=f,
                        recycle=bool(p.recycle) if p is not None else False,
                        origin=str(spec.staleness_span or spec.span))


__all__ = ["resolve_staleness", "staleness_problems", "pipeline_plan", "off_policy_notes"]
