"""Check routing replay (``routing = "replay"``) and make the rollouts it reads carry their routes.

Requires: check_model_fit (engines planned with their kinds, model facts known: ``graph.sched``),
check_roles (``Node.model`` on every model op).

Guarantees, for each ``logprobs`` / ``update`` with ``routing = "replay"`` (R3: the train engine's
forward uses the experts the rollout engine routed each token to):

* its model is a mixture of experts (its facts count experts);
* its rollouts come from a ``generate`` of the same model (through ops that pass rollouts on), in a
  single-turn step without ``partial_rollout`` (routes are assembled per generate call);
* that model's rollout engine returns routes and its train engine replays them
  (:attr:`~flowrl.catalog.engines.EngineSpec.routing_replay`; ``torch(dp > 1)`` runs on fsdp's
  ranks, which do not);
* an ``update`` and the ``logprobs`` giving it its old log-probs route alike: PPO's ratio compares
  two forwards, both replayed or neither (E612, at the option as written);
* the ``generate`` and every op passing its rollouts on to a replaying op carry the field
  ``routed_experts`` (``Node.fields``): the runtime asks the rollout engine for routes exactly
  there. The user writes replay once per train-engine op, never on ``generate``.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... model m = tiny(arch = "qwen3_moe", warm_start = 0)
... reward v = verifier("exact")
... flow f(d: dataset) {
...   b = sample(d)  r = generate(m, b, n = 2)  lp = logprobs(m, r, routing = "replay")
...   update(m, r, group_advantage(v(r), group = 2), lp, routing = "replay")
... }''', "doc.flow", allow_missing=True)
>>> "routed_experts" in g.node("r").fields
True
"""

from __future__ import annotations

from dataclasses import replace

from flowrl.catalog.engines import ENGINES
from flowrl.catalog.ops import OPS, ROUTES, OpKind
from flowrl.compiler.context import CompileContext
from flowrl.diagnostics import Collector, Span
from flowrl.ir.graph import FlowGraph, Node, plain

_REPLAYING = (OpKind.LOGPROBS, OpKind.UPDATE)


def check_routing(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    carriers: set[str] = set()
    for node in graph.nodes():
        if node.kind in _REPLAYING and replays(node):
            path = _rollouts_path(graph, node)
            if _check_replay(graph, node, path, errors):
                carriers.update(path)
        if node.kind == OpKind.UPDATE:
            _check_old_logprobs(graph, node, errors)
    errors.raise_if_any()
    if not carriers:
        return graph
    out = graph.copy()
    for node_id in carriers:
        n = out.node(node_id)
        out.replace(replace(n, fields=n.fields | {ROUTES}))
    return out


def replays(node: Node) -> bool:
    """Whether ``node`` (a logprobs or update op) replays the rollout engine's routes."""
    return plain(node.attr("routing", "native")) == "replay"


def _span(node: Node) -> Span:
    """Where the op's ``routing`` was written (its value), else the op."""
    value = node.attr("routing")
    return getattr(value, "span", None) or node.span


def _rollouts_path(graph: FlowGraph, node: Node) -> list[str]:
    """The ops from ``node``'s rollouts back to the op that made them: each passes its rollouts
    argument on (``OpSpec.passthrough``) until one does not (a ``generate``, or not)."""
    path, current = [], graph.producers(node.id).get("rollouts")
    while current is not None and current in graph:
        path.append(current)
        n = graph.node(current)
        spec = OPS.get(n.op)
        if n.kind == OpKind.GENERATE or spec is None or spec.passthrough is None:
            break
        current = graph.producers(current).get(spec.args[spec.passthrough].name)
    return path


def _check_replay(graph: FlowGraph, node: Node, path: list[str], errors: Collector) -> bool:
    """Report why ``node`` cannot replay routes (E612); True when it can."""
    span, model = _span(node), node.model
    gen = graph.node(path[-1]) if path else None
    if gen is None or gen.kind != OpKind.GENERATE:
        errors.error("E612", f"`{node.id}` replays routes, but its rollouts come from no `generate`", span,
                     "routes are recorded by the rollout engine that generates the rollouts; replay "
                     "in ops reading a generate's value")
        return False
    if any(graph.node(p).kind == OpKind.ENV_STEP for p in path) or gen.region is not None:
        errors.error("E612", f"`{node.id}` replays the routes of multi-turn episodes (`{gen.id}` runs in a "
                             "conversation loop), which flowrl does not assemble", span,
                     "use routing = \"native\" in multi-turn flows")
        return False
    if gen.model != model:
        errors.error("E612", f"`{node.id}` replays in `{model}` the routes `{gen.model}` chose for `{gen.id}`",
                     span, f"replay only in the ops of the model that generated the rollouts; "
                           f"use routing = \"native\" for `{model}`")
        return False
    st = graph.sched
    if st is None:
        return True  # a library flow checked without a schedule: engines and facts are the caller's
    if st.spec.partial is not None:
        errors.error("E612", f"`{node.id}` replays routes, but the schedule's partial_rollout continues "
                             "completions over several generate calls, whose routes flowrl does not join",
                     span, "remove partial_rollout from the schedule, or use routing = \"native\"")
        return False
    facts = st.facts.get(model)
    if facts is not None and not facts.experts:
        errors.error("E612", f"`{node.id}` replays routes, but `{model}` is a dense model ({facts.name}: no "
                             "experts, no router)", span,
                     "routing replay is for mixtures of experts; drop `routing = \"replay\"`")
        return False
    ok = _engine_replays(st, f"{model}.rollout", "returns the experts it routes each token to", span, errors)
    return _engine_replays(st, f"{model}.train", "routes its forward by given experts", span, errors) and ok


def _engine_replays(st, key: str, what: str, span: Span, errors: Collector) -> bool:
    eng = st.engines.get(key)
    if eng is None or eng.kind not in ENGINES:
        return True
    spec = ENGINES[eng.kind]
    runs_on = ENGINES.get(spec.multi_rank_as) if spec.multi_rank_as and eng.world_size > 1 else spec
    if spec.routing_replay and runs_on.routing_replay:
        return True
    able = sorted(e.name for e in ENGINES.values() if e.serves == spec.serves and e.routing_replay)
    via = f" (with {eng.world_size} ranks it runs on `{runs_on.name}`'s)" if runs_on is not spec else ""
    errors.error("E612", f"routing replay needs a {spec.serves} engine that {what}; `{key}` is "
                         f"`{eng.kind}`{via}, which does not", span,
                 f"give `{key}` " + " or ".join(f"`{n}(...)`" + (" with one rank" if ENGINES[n].multi_rank_as else "")
                                                for n in able) + ", or use routing = \"native\"")
    return False


def _check_old_logprobs(graph: FlowGraph, update: Node, errors: Collector) -> None:
    """An update and the logprobs op giving its old log-probs (same model) must route alike."""
    old_id = graph.producers(update.id).get("old")
    old = graph.node(old_id) if old_id in graph else None
    if old is None or old.kind != OpKind.LOGPROBS or old.model != update.model or replays(old) == replays(update):
        return
    replaying, native = (update, old) if replays(update) else (old, update)
    errors.error("E612", f"`{replaying.id}` replays the rollout engine's routes but `{native.id}` routes natively; "
                         "PPO's ratio would compare two differently routed forwards", _span(replaying),
                 f"write routing = \"replay\" in `{native.id}` too, or in neither")


__all__ = ["check_routing", "replays"]
