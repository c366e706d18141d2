"""Check each model that trains LoRA adapters (``hf(path, lora = lora(...))``) can: its targets, its engines.

Requires: check_model_fit (engines planned with their kinds, model facts known: ``graph.sched``),
check_edge_types (the ``lora`` option checked against its record: ``r >= 1``, ``alpha >= 0``...).

Guarantees, for each model declared with ``lora = lora(...)`` (E613, at the option as written):

* ``targets`` is ``"all-linear"`` or a list of module names, each a linear module of the model's
  decoder layers (:func:`~flowrl.catalog.adapters.lora_modules`: attention and dense-MLP
  projections; a mixture of experts' attention and dense layers, not its experts: fused tensors, not
  linear layers); a name that is not one is refused naming those that are, and so is a family with
  none (GPT-2's ``Conv1D`` layers);
* its train engine trains adapters (:attr:`~flowrl.catalog.engines.EngineSpec.lora` ``train``:
  ``torch``, whose several ranks run on ``fsdp``'s, and ``fsdp``; not ``megatron``, for the reason its
  record gives, :attr:`~flowrl.catalog.engines.EngineSpec.lora_refused`);
* its rollout engine takes them, loaded as an adapter (``adapters``: vLLM, up to its largest rank; not a
  mixture of experts', :attr:`~flowrl.catalog.engines.EngineSpec.lora_experts_refused`) or merged into the
  base weights by the runtime (``merged``: SGLang, ``hf_generate``).

The graph is returned unchanged.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... model m = tiny(lora = lora(r = 4, targets = ["q_proj", "qkv"]))
... flow main(d: dataset, r: reward) {
...   x = generate(m, sample(d), n = 2, max_tokens = 4)
...   update(m, x, group_advantage(r(x), group = 2), logprobs(m, x)) }''', "doc.flow")
... except FlowError as e:
...     print(str(e).splitlines()[0])
doc.flow:2:56: error[E613]: `lora` of `m` targets `qkv`, which is not a linear module of tiny(arith)'s layers (LlamaForCausalLM)
"""

from __future__ import annotations

from flowrl.catalog.adapters import ALL_LINEAR, lora_modules
from flowrl.catalog.engines import ENGINES
from flowrl.compiler.context import CompileContext
from flowrl.compiler.schedule.layouts import lora_engine_problem
from flowrl.diagnostics import Collector
from flowrl.ir.graph import Config, Const, FlowGraph, Node, plain
from flowrl.catalog.ops import OpKind


def check_adapters(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    st = graph.sched
    for node in graph.nodes():
        lora = node.attr("lora") if node.kind == OpKind.MODEL else None
        if not isinstance(lora, Config):
            continue
        facts = st.facts.get(node.id) if st is not None else None
        if facts is not None:
            _check_targets(node, lora, facts, errors)
        if st is not None:
            _check_engine(node, lora, st, "train", facts, errors)
            _check_engine(node, lora, st, "rollout", facts, errors)
    errors.raise_if_any()
    return graph


def _check_targets(node: Node, lora: Config, facts, errors: Collector) -> None:
    modules = lora_modules(facts)
    value = dict(lora.options).get("targets")  # the value as written (Const / tuple of Consts), with spans
    span = getattr(value, "span", None) or lora.span
    what = f"{facts.name}'s layers ({facts.architecture or 'architecture unknown'})"
    if facts.experts:  # its experts are fused tensors, not linear layers: its attention (and dense layers) adapt
        what += "; a mixture of experts' experts are fused tensors, which no adapter wraps"
    if not modules:
        errors.error("E613", f"`{node.id}` has no linear modules flowrl adapts ({what}: GPT-2-style `Conv1D` "
                             "layers)", lora.span, "drop `lora`, or use a Llama-style family (q/k/v/o and "
                                                   "gate/up/down projections)")
        return
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        name = plain(item)
        if not isinstance(item, Const) or not isinstance(name, str):
            errors.error("E613", f"`targets` of `lora` must be \"{ALL_LINEAR}\" or a list of module names", span,
                         f"e.g. `targets = [{', '.join(repr(m).replace(chr(39), chr(34)) for m in modules[:2])}]`")
            return
        if name == ALL_LINEAR and not isinstance(value, tuple):
            continue
        if name not in modules:
            errors.error("E613", f"`lora` of `{node.id}` targets `{name}`, which is not a linear module of {what}",
                         getattr(item, "span", None) or span,
                         f"its modules: {', '.join(modules)} (or \"{ALL_LINEAR}\": every one)")
    if isinstance(value, tuple) and not value:
        errors.error("E613", f"`lora` of `{node.id}` targets no module", span,
                     f"name some of {', '.join(modules)}, or write `targets = \"{ALL_LINEAR}\"`")


def _check_engine(node: Node, lora: Config, st, role: str, facts, errors: Collector) -> None:
    eng = st.engines.get(f"{node.id}.{role}")
    if eng is None or eng.kind not in ENGINES:
        return
    rank = dict(lora.options).get("r")
    problem = lora_engine_problem(node.id, role, eng, int(plain(rank) or 0), facts)
    if problem is not None:
        message, hint = problem
        at = getattr(rank, "span", None) if message.startswith("`lora` of") else None  # a rank: at the rank
        errors.error("E613", message, at or lora.span, hint)


__all__ = ["check_adapters"]
