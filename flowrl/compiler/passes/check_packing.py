"""Check each ``update`` that asks for token-budget micro-batches or sequence packing can have them.

Requires: check_model_fit (engines planned with their kinds, model facts known: ``graph.sched``),
check_roles (``Node.model`` on every model op).

Guarantees, for each ``update`` with ``micro_batch_tokens > 0`` or ``pack = true`` (E615, at the
option as written):

* its model's train engine forms micro-batches by tokens and packs
  (:attr:`~flowrl.catalog.engines.EngineSpec.token_batches`: torch, fsdp; with several ranks,
  the engine whose ranks it runs on; Megatron's own schedule splits by rows);
* a packed update does not replay routes (the replayed experts are per padded row);
* a packed model is an architecture of :data:`~flowrl.catalog.architectures.ARCHITECTURES`: those
  take a 4-D attention mask and per-sequence position ids in transformers' eager and sdpa kernels
  (:func:`flowrl.engines.batching.pack`); a class flowrl does not know may ignore them and attend
  across sequences. Nor does it apply a sliding window shorter than the context (the packed mask
  replaces the window's).

A budget below the longest sequence is not an error: such a sequence runs alone.
The graph is returned unchanged.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... model m = tiny()
... reward v = verifier("exact")
... flow f(d: dataset) {
...   r = generate(m, sample(d), n = 2)
...   update(m, r, group_advantage(v(r), group = 2), logprobs(m, r), pack = true) }
... schedule f on cluster(nodes = 1, gpus_per_node = 2) {
...   colocate m.train, m.rollout on all
...   m.train = megatron(tp = 1, dp = 2)  m.rollout = vllm(tp = 1, dp = 2) }''', "doc.flow", allow_missing=True)
... except FlowError as e:
...     print(str(e).splitlines()[0])
doc.flow:6:73: error[E615]: `update` of `m` packs sequences, but its train engine `m.train` is `megatron`, which micro-batches by rows only
"""

from __future__ import annotations

from flowrl.catalog.architectures import ARCHITECTURES
from flowrl.catalog.engines import ENGINES
from flowrl.catalog.ops import OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.passes.check_routing import replays
from flowrl.diagnostics import Collector, Span
from flowrl.ir.graph import FlowGraph, Node, plain


def check_packing(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    for node in graph.nodes():
        if node.kind != OpKind.UPDATE:
            continue
        tokens, pack = int(plain(node.attr("micro_batch_tokens", 0)) or 0), bool(plain(node.attr("pack", False)))
        if not (tokens or pack):
            continue
        option = "pack" if pack else "micro_batch_tokens"
        span = _span(node, option)
        what = "packs sequences" if pack else "forms micro-batches by tokens"
        _check_engine(graph, node, what, span, errors)
        if pack and replays(node):
            errors.error("E615", f"`update` of `{node.model}` packs sequences and replays routes; the replayed "
                                 "experts are laid out per padded row", span,
                         "drop `pack = true` (keep `micro_batch_tokens`), or use routing = \"native\"")
        facts = graph.sched.facts.get(node.model) if graph.sched is not None else None
        if pack and facts is not None and facts.architecture not in ARCHITECTURES:
            errors.error("E615", f"`update` of `{node.model}` packs sequences, but {facts.name} is "
                                 f"`{facts.architecture or 'an unknown architecture'}`, which flowrl does not "
                                 "know to take a 4-D attention mask and per-sequence position ids", span,
                         f"drop `pack = true` (`micro_batch_tokens` alone still cuts the padding); packing runs "
                         f"{', '.join(sorted(ARCHITECTURES))}")
        elif pack and facts is not None and facts.window is not None and facts.window < facts.max_len:
            errors.error("E615", f"`update` of `{node.model}` packs sequences, but {facts.name} attends within a "
                                 f"sliding window of {facts.window} tokens, which a packed row's mask does not keep",
                         span, "drop `pack = true` (`micro_batch_tokens` alone still cuts the padding)")
    errors.raise_if_any()
    return graph


def _span(node: Node, option: str) -> Span:
    """Where ``option`` was written (its value), else the op."""
    return getattr(node.attr(option), "span", None) or node.span


def _check_engine(graph: FlowGraph, node: Node, what: str, span: Span, errors: Collector) -> None:
    st = graph.sched
    key = f"{node.model}.train"
    eng = st.engines.get(key) if st is not None else None
    if eng is None or eng.kind not in ENGINES:
        return
    spec = ENGINES[eng.kind]
    runs_on = ENGINES.get(spec.multi_rank_as) if spec.multi_rank_as and eng.world_size > 1 else spec
    if spec.token_batches and runs_on.token_batches:
        return
    able = sorted(e.name for e in ENGINES.values() if e.serves == "train" and e.token_batches)
    via = f" (with {eng.world_size} ranks it runs on `{runs_on.name}`'s)" if runs_on is not spec else ""
    errors.error("E615", f"`update` of `{node.model}` {what}, but its train engine `{key}` is `{eng.kind}`{via}, "
                         "which micro-batches by rows only", span,
                 f"give `{key}` " + " or ".join(f"`{n}(...)`" for n in able)
                 + ", or drop `micro_batch_tokens` and `pack` (micro-batches of `micro_batch` rows)")


__all__ = ["check_packing"]
