"""Check what each model may do, and record which model's engine runs each op.

Requires: check_edge_types.

Guarantees: ``update`` only trains trainable models (``hf``/``tiny``/parameters: the
policy; ``critic(...)``: a value model) with a loss meant for that role; ``values`` reads
a critic; ``generate`` samples from a policy (not a critic); a model is updated at most
once per step; ``Node.model`` is set on every op that runs on a model's engine.

>>> from flowrl.compiler.pipeline import compile_text
>>> compile_text('''
... flow f(m: model, d: dataset) {
...   ref = frozen(m)  b = sample(d)  r = generate(m, b)  lp = logprobs(ref, r)
... }''', "doc.flow", until="check_roles").node("lp").model
'ref'
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.compiler.context import CompileContext
from flowrl.diagnostics import Collector
from flowrl.ir.graph import Config, FlowGraph, Ref
from flowrl.catalog.ops import LOSSES, OpKind

_MODEL_OPS = (OpKind.GENERATE, OpKind.LOGPROBS, OpKind.VALUES, OpKind.UPDATE)


def check_roles(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    out = graph.copy()
    errors = Collector(ctx.sources)
    updated: dict[str, object] = {}
    for node in list(out.nodes()):
        if node.kind not in _MODEL_OPS or not node.args or not isinstance(node.args[0], Ref):
            continue
        mid = node.args[0].target
        if mid not in out or out.node(mid).kind != OpKind.MODEL:
            continue
        model = out.node(mid)
        role = model.role or "trainable"
        span = node.args[0].span
        if node.kind == OpKind.UPDATE:
            if role == "frozen":
                errors.error("E301", f"cannot update `{mid}`: it is frozen", span,
                             "frozen(...) models are read-only; update the model it was made from")
            loss = node.attr("loss")
            lspec = LOSSES.get(loss.name) if isinstance(loss, Config) else None
            if lspec is not None and role != "frozen" and lspec.model_role != role:
                want = "a critic (critic(...))" if lspec.model_role == "critic" else "a policy"
                errors.error("E302", f"`{lspec.name}` trains {want}, but `{mid}` is a "
                                     f"{'critic' if role == 'critic' else 'policy'}", loss.span,
                             "use `value_clip(...)` for critics and `ppo_clip(...)` or `pg()` for policies")
            if mid in updated:
                errors.error("E305", f"`{mid}` is updated twice in one step", node.span,
                             "merge them into one update; use `epochs` or `minibatches` for more passes",
                             notes=(("first update", updated[mid]),))
            updated[mid] = node.span
        elif node.kind == OpKind.VALUES and role != "critic":
            errors.error("E303", f"`values` needs a critic, but `{mid}` is a {role} model", span,
                         f"make one with `vf = critic({mid})` and read its values with `values(vf, ...)`")
        elif node.kind == OpKind.GENERATE and role == "critic":
            errors.error("E304", f"cannot generate with critic `{mid}`", span, "generate with the policy")
        out.replace(replace(node, model=mid))
    errors.raise_if_any()
    return out
