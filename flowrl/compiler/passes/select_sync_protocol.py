"""Choose how each resync moves weights, plan its buckets and its resharding.

Requires: resolve_staleness (engines placed and laid out).

Guarantees: ``graph.sched.resyncs`` has one :class:`~flowrl.plan.ResyncPlan` per
``resync`` node: the protocol (as written, else chosen from the placement), why, the
route the bytes take (``local``: the rollout engine sits on the trainer's GPUs;
``intra-node``; ``inter-node``), the transport on the cluster's platform, whether sending
overlaps generation, the bucket plan (bytes of one copy, buckets, the largest tensor), an
estimated time, and the resharding plan from the train layout to the rollout layout. A model that
trains LoRA adapters sends those only (fp32, unsharded: :func:`~flowrl.catalog.adapters.lora_tensors`),
with no resharding plan.

Chosen protocols: the record chosen for the route (colocated engines -> ``inplace``;
disaggregated -> ``nccl`` on GPUs, ``gloo`` on a CPU cluster), overlapped with the next
generation. A written protocol is checked against its record (E432-E435, E443, E445): see
:mod:`flowrl.compiler.schedule.sync`.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny()
... reward v = verifier("exact")
... flow f(d: dataset) {
...   b = sample(d)  r = generate(m, b, n = 2)  lp = logprobs(m, r)
...   update(m, r, group_advantage(v(r), group = 2), lp)
... }''', "doc.flow", until="select_sync_protocol", allow_missing=True)
>>> r = g.sched.resyncs["resync.m"]
>>> (r.protocol, r.route, r.buckets)
('inplace', 'local', 1)
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.catalog.ops import OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.sched import SchedState
from flowrl.compiler.schedule.sync import sync_plan
from flowrl.compiler.workload import lora_of
from flowrl.diagnostics import Collector
from flowrl.ir.graph import EdgeKind, FlowGraph


def select_sync_protocol(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    st: SchedState = graph.sched
    errors = Collector(ctx.sources)
    plans = {}
    lora = lora_of(graph)  # a LoRA model's resync sends its adapters only
    for n in graph.nodes():
        if n.kind != OpKind.RESYNC:
            continue
        after = next((u for u, e in graph.in_edges(n.id) if e.kind == EdgeKind.WEIGHTS), "")
        plan, problems = sync_plan(n.id, n.model, after, st, str(n.span), lora.get(n.model))
        errors.items.extend(problems)
        plans[n.id] = plan
    errors.raise_if_any()
    return replace(graph, sched=replace(st, resyncs=plans))


__all__ = ["select_sync_protocol"]
