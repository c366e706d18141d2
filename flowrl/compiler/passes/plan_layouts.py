"""Give every engine a parallel layout and check it against its pool, the model, the platform and memory.

Requires: assign_placement (``graph.sched`` holds pools and placed engines).

Guarantees: each engine in ``graph.sched.engines`` has its engine kind, ``tp``/``pp``/``dp``/``cp``,
options, one GPU per rank (tp fastest, then cp, dp, pp: a tensor-parallel group is
contiguous), its estimated memory per GPU and what it does with that memory while the
engines it shares GPUs with run (``releases``); ``graph.sched.memory`` holds each pool's
memory phases. The layout (:mod:`flowrl.compiler.schedule.layouts`, reading the engine's
record)

* uses exactly its pool (E424), runs on the cluster's platform within its limits (E440,
  E441), fits the model's heads, KV heads and layers (E425-E427), keeps tensor-parallel
  groups within a node (E429), and fits in memory alone (E428, E430);

the engines sharing a pool fit together in every phase the runtime runs (E439,
:mod:`flowrl.compiler.schedule.memory`), and every ``generate`` asks its rollout engine only
for sampling options it takes (E438).

An engine without a layout gets one: a frozen model or critic colocated with its base's
trainer shares that trainer's engine and layout (as veRL does for the reference); a
rollout engine gets the smallest tp that fits; anything else its role's default engine
with dp filling its pool.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... flow f(d: dataset) { b = sample(d)  r = generate(m, b)  return r }
... schedule f on cluster(gpus_per_node = 4) { m.rollout = sglang(tp = 2) }
... ''', "doc.flow", until="plan_layouts")
>>> e = g.sched.engines["m.rollout"]
>>> (e.tp, e.dp, e.gpus)
(2, 2, (0, 1, 2, 3))
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.catalog.ops import OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.sched import LayoutSpec, SchedState, model_of, role_of
from flowrl.compiler.schedule.layouts import layout_engine, sampling_problems
from flowrl.compiler.schedule.memory import pool_problems, with_memory
from flowrl.compiler.schedule.placement import base_models
from flowrl.compiler.workload import workload
from flowrl.diagnostics import Collector, Span
from flowrl.ir.graph import FlowGraph


def plan_layouts(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    st: SchedState = graph.sched
    errors = Collector(ctx.sources)
    work = workload(graph)
    trained = {n.model for n in graph.nodes() if n.kind == OpKind.UPDATE and n.model}
    pools = {p.name: p for p in st.pools}
    engines = dict(st.engines)
    bases = base_models(graph)
    failed: set[str] = set()
    for key in st.engines_needed:
        placed = engines[key]
        lspec = st.spec.layouts.get(key)
        span = _span_of(st, key)
        inherited = lspec is None and _inherited(key, bases, engines, st)
        if inherited:
            lspec = inherited
        plan, problems = layout_engine(key, placed, lspec, st.facts.get(model_of(key)), st.hw, pools[placed.pool],
                                       work, model_of(key) in trained, span, chosen=key not in st.spec.layouts,
                                       strict=st.spec.written)
        if problems:
            failed.add(key)
            if not (inherited and f"{bases.get(model_of(key))}.train" in failed):
                errors.items.extend(problems)  # a layout borrowed from a failing base is reported once, there
        engines[key] = plan
    errors.items.extend(sampling_problems(graph, engines))
    engines, memory = with_memory(engines, st.pools, st.hw)
    if st.spec.written and not failed:
        for m in memory:
            errors.items.extend(pool_problems(m, engines, st.hw, _pool_span(st, m.pool, m.engines)))
    errors.raise_if_any()
    return replace(graph, sched=replace(st, engines=engines, memory=memory))


def _span_of(st: SchedState, key: str) -> Span:
    if key in st.spec.layouts:
        return st.spec.layouts[key].span
    if key in st.spec.placement:
        return st.spec.placement[key].span
    return st.spec.span


def _pool_span(st: SchedState, pool: str, keys) -> Span:
    """Where the engines sharing a pool were put together: the first ``colocate`` naming one of
    them, else the pool's declaration, else the schedule."""
    for key in keys:
        p = st.spec.placement.get(key)
        if p is not None and p.colocate:
            return p.span
    return next((p.span for p in st.spec.pools if p.name == pool), st.spec.span)


def _inherited(key: str, bases: dict, engines: dict, st: SchedState) -> LayoutSpec | None:
    """A frozen model / critic without a layout, on its base trainer's GPUs: the base's layout."""
    base = bases.get(model_of(key))
    if base is None or role_of(key) != "train":
        return None
    base_key = f"{base}.train"
    src = engines.get(base_key)
    if src is None or src.pool != engines[key].pool or base_key not in st.spec.layouts:
        return None
    written = st.spec.layouts[base_key]
    return LayoutSpec(written.kind, dict(written.options), written.span)


__all__ = ["plan_layouts"]
