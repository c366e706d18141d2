"""Run a LoRA policy's frozen reference on the policy's own train engine, its adapters disabled: no second copy.

Requires: elide_logprobs (``graph.elided``: passes that never run need no engine), check_platform
(the schedule block is well-formed).

Guarantees: a ``logprobs`` op of a frozen model ``ref = frozen(policy)``, where ``policy`` trains LoRA
adapters (``lora = lora(...)``) and is updated in the flow, runs on ``policy``'s train engine with the
adapters disabled, unless the schedule gives ``ref.train`` an engine of its own (a layout, or a ``place``
in a pool; a ``colocate`` beside the policy shares): the op's ``model`` is ``policy`` (so
``engines_needed`` plans no ``ref.train``, the memory check counts no reference weights, the estimate
charges the pass to ``policy.train``), and ``graph.on_base`` maps the op to ``ref``; lowering marks it
``adapters = "off"`` and the runtime computes it inside PEFT's ``disable_adapter`` (veRL's ``ref_in_actor``
for LoRA, TRL's reference for a PEFT model). The base weights are frozen, so the reference is the base
at every step: exactly what a second copy of the initial weights would compute.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny(lora = lora(r = 4))
... reward v = verifier("exact")
... flow f(d: dataset) {
...   ref = frozen(m)  b = sample(d)  r = generate(m, b, n = 2)
...   update(m, r, group_advantage(v(r), group = 2), logprobs(m, r), logprobs(ref, r), kl = 0.1)
... }''', "doc.flow", until="share_base_weights", allow_missing=True)
>>> [(op, g.node(op).model, ref) for op, ref in g.on_base.items()]
[('logprobs#2', 'm', 'ref')]
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.catalog.ops import OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.sched import spec_from_ast
from flowrl.ir.graph import Config, FlowGraph, Node, Ref


def share_base_weights(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    trained = {n.model for n in graph.nodes() if n.kind == OpKind.UPDATE and n.model}
    spec = spec_from_ast(graph)
    out = graph.copy()
    on_base: dict[str, str] = {}
    for node in graph.nodes():
        if node.kind != OpKind.LOGPROBS or node.id in graph.elided or node.model not in graph:
            continue
        base = lora_base(graph, graph.node(node.model))
        if base is None or base not in trained or _own_engine(spec, f"{node.model}.train"):
            continue
        out.replace(replace(node, model=base))
        on_base[node.id] = node.model
    out.on_base = on_base
    return out


def lora_base(graph: FlowGraph, model: Node) -> str | None:
    """The model ``model`` is ``frozen(...)`` of, when that one trains LoRA adapters; else None."""
    if model.kind != OpKind.MODEL or model.role != "frozen" or not model.args or not isinstance(model.args[0], Ref):
        return None
    base = model.args[0].target
    if base not in graph or not isinstance(graph.node(base).attr("lora"), Config):
        return None
    return base


def _own_engine(spec, key: str) -> bool:
    """The schedule gives engine ``key`` a layout or a pool of its own (``colocate`` beside others shares)."""
    placed = spec.placement.get(key)
    return key in spec.layouts or (placed is not None and not placed.colocate)


__all__ = ["share_base_weights", "lora_base"]
