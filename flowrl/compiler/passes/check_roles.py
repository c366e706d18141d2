"""Check what each model may do, and record which model's engine runs each op.

Requires: check_edge_types.

Guarantees: ``update`` only trains trainable models (``hf``/``tiny``/parameters: the
policy; ``critic(...)``: a value model) with a loss meant for that role; ``values`` reads
a critic; ``generate`` samples from a policy (not a critic); a reward model (``tiny_rm``)
only scores, through ``reward_model(...)``; a model is updated at most once per step;
``Node.model`` is set on every op that runs on a model's engine.

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
from flowrl.catalog.ops import LOSSES, OPS, OpKind

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
        if role == "reward":
            pass  # E306, below
        elif node.kind == OpKind.UPDATE:
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
    _check_reward_models(out, errors)
    errors.raise_if_any()
    return out


def _check_reward_models(graph: FlowGraph, errors: Collector) -> None:
    """E306: a reward model (``tiny_rm``: a sequence classifier, no language-model head) is read only by
    ``reward_model(...)``; generating, log-probs, updates, ``frozen``/``critic`` copies and judges need
    a language model."""
    for node in graph.nodes():
        spec = OPS.get(node.op)
        if spec is not None and spec.serves_model == "reward":
            continue
        for arg in node.args:
            if not (isinstance(arg, Ref) and arg.target in graph):
                continue
            model = graph.node(arg.target)
            if model.kind == OpKind.MODEL and model.role == "reward":
                errors.error("E306", f"`{arg.target}` is a reward model ({model.op}): `{node.op}` cannot use it",
                             arg.span, f"a reward model only scores completions: `reward r = reward_model("
                                       f"{arg.target})`, then `r(rollouts)`; generate, train and judge with a "
                                       "language model (`tiny(...)`, `hf(...)`)")
