"""Close the loop: draw the loop-carried weight edges and insert resync nodes.

Requires: check_roles (``Node.model`` set).

Guarantees: for each trained model M (updated by node U), every op that reads M gets a
``WEIGHTS`` edge with distance 1 (it reads, at step k+1, the weights U wrote at step k).
Ops on an *inference* engine (``generate``) cannot see the trainer's weights, so a
``resync`` node is inserted: ``U -> resync.M`` (distance 0) and ``resync.M -> generate``
(distance 1). Train-engine readers (``logprobs``/``values`` of M) read U directly.
Frozen models are never updated, so they get no edges and no resync.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... flow f(m: model, d: dataset, v: reward) {
...   b = sample(d)  r = generate(m, b, n = 2)  lp = logprobs(m, r)
...   adv = group_advantage(v(r), group = 2)  update(m, r, adv, lp)
... }''', "doc.flow", until="insert_resyncs", allow_missing=True)
>>> [(u, v, e.distance) for u, v, e in g.edges() if e.kind.value == "weights"]
[('update', 'resync.m', 0), ('update', 'lp', 1), ('resync.m', 'r', 1)]
"""

from __future__ import annotations

from flowrl.compiler.context import CompileContext
from flowrl.ir.graph import Const, Edge, EdgeKind, FlowGraph, Node, Ref
from flowrl.catalog.ops import OpKind

INFERENCE_OPS = (OpKind.GENERATE,)
"""Ops that run on a rollout engine and so need weights pushed to them."""


def insert_resyncs(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    out = graph.copy()
    updates = {n.model: n for n in graph.nodes() if n.kind == OpKind.UPDATE and n.model}
    readers_of: dict[str, list] = {mid: [] for mid in updates}  # one pass, not one per model
    for n in graph.nodes():
        if n.model in readers_of and n.kind != OpKind.UPDATE:
            readers_of[n.model].append(n)
    for mid, upd in updates.items():
        readers = readers_of[mid]
        rollout_readers = [n for n in readers if n.kind in INFERENCE_OPS]
        if rollout_readers:
            resync = Node(out.fresh_id(f"resync.{mid}"), OpKind.RESYNC, "resync", (Ref(mid, upd.span),),
                          (("every", Const(1, "int", upd.span)), ("protocol", Const("auto", "str", upd.span))),
                          upd.span, model=mid, scope=upd.scope)
            out.add(resync)
            out.connect(mid, resync.id, Edge(EdgeKind.RESOURCE, "model"))
            out.connect(upd.id, resync.id, Edge(EdgeKind.WEIGHTS, "weights", distance=0))
            for r in rollout_readers:
                out.connect(resync.id, r.id, Edge(EdgeKind.WEIGHTS, "weights", distance=1))
        for r in readers:
            if r.kind not in INFERENCE_OPS:
                out.connect(upd.id, r.id, Edge(EdgeKind.WEIGHTS, "weights", distance=1))
    return out
