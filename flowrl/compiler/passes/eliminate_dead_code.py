"""Remove ops whose result nothing reads, and warn where the value was named.

Requires: check_roles (a resolved, type-checked graph; no resync nodes needed: the pass
reads every edge, so it may run later too).

Guarantees: every op left either has an effect (``OpSpec.effect``: ``update``,
``resync``, ``env_step``, ``call``), is read by an op left (through any edge: data,
resource, weights, or a ``repeat`` loop's turn edge), produces the ``until`` field of its
loop, or is the flow's return value; resources left are read by an op left (a parameter
without a value stays: it is the flow's interface). Each removed value a statement wrote
and nothing at all read gets one positioned warning: W001 where its name is bound, W002
at a call statement that drops it. Loops left without ops are removed.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... flow f(m: model, d: dataset, v: reward) {
...   b = sample(d)  r = generate(m, b, n = 2)  lp = logprobs(m, r)
...   update(m, r, group_advantage(v(r), group = 2), loss = pg())
... }''', "doc.flow", until="eliminate_dead_code")
>>> "lp" in g, [(w.code, w.message) for w in g.warnings]
(False, [('W001', '`lp` is never read, so `logprobs` does not run')])
"""

from __future__ import annotations

import re

from flowrl.catalog.ops import OPS, RESOURCE_KINDS
from flowrl.compiler.context import CompileContext
from flowrl.diagnostics import Collector
from flowrl.ir.graph import EdgeKind, FlowGraph, Node, Ref


def eliminate_dead_code(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    live = _live(graph)
    dead = [n for n in graph.nodes() if n.id not in live]
    if not dead:
        return graph
    warnings = Collector(ctx.sources)
    dead_ids = {n.id for n in dead}
    roots = [n for n in dead if not any(e.kind != EdgeKind.TURN for _, e in graph.out_edges(n.id))]
    owner = _owners(graph, [r.id for r in roots], dead_ids)
    for n in roots:
        if n.id in graph.binding_spans:  # written as a statement (a parameter's unused default is not)
            _warn(graph, n, sorted(u for u, o in owner.items() if o == n.id), warnings)
    out = graph.copy()
    out.g.remove_nodes_from(dead_ids)
    for nid in dead_ids:
        out.bindings.pop(nid, None)
        out.binding_spans.pop(nid, None)
    used = {n.region for n in out.nodes()}
    out.regions = {rid: r for rid, r in graph.regions.items() if rid in used}
    out.warnings = graph.warnings + warnings.warnings
    return out


def _live(graph: FlowGraph) -> set[str]:
    """Nodes that must run: roots (effects, the return value, loop exits, the flow's
    interface) and everything they read, through every kind of edge."""
    until = {r.id: r.until for r in graph.regions.values() if r.until}
    roots = [n.id for n in graph.nodes() if _is_root(graph, n, until)]
    if isinstance(graph.returns, Ref) and graph.returns.target in graph:
        roots.append(graph.returns.target)
    live: set[str] = set()
    while roots:
        nid = roots.pop()
        if nid in live:
            continue
        live.add(nid)
        roots.extend(u for u, _ in graph.in_edges(nid) if u not in live)
    return live


def _is_root(graph: FlowGraph, n: Node, until: dict) -> bool:
    """Decided from the graph's structure alone, so the Python builder's graph and the
    parser's lose the same nodes."""
    spec = OPS.get(n.op)
    if n.op == "param" or (spec is not None and spec.effect):
        return True  # a parameter without a value is the flow's interface
    return n.region in until and until[n.region] in n.fields  # the loop reads it to stop


_SHARED = ""


def _owners(graph: FlowGraph, roots: list[str], dead: set[str]) -> dict[str, str]:
    """Each other dead node -> the one root whose value alone reads it (directly or through
    other dead nodes), or ``_SHARED`` when several roots do. Every node is claimed once and
    marked shared at most once, so this is linear in the graph's size."""
    owner: dict[str, str] = {}
    is_root = set(roots)

    def share(start: str) -> None:
        stack = [start]
        while stack:
            x = stack.pop()
            if owner.get(x) == _SHARED:
                continue
            owner[x] = _SHARED
            stack.extend(u for u, _ in graph.in_edges(x) if u in dead and u not in is_root)

    for root in roots:
        stack = [root]
        while stack:
            x = stack.pop()
            for u, _ in graph.in_edges(x):
                if u not in dead or u in is_root:
                    continue
                if u not in owner:
                    owner[u] = root
                    stack.append(u)
                elif owner[u] not in (root, _SHARED):
                    share(u)
    return owner


def _warn(graph: FlowGraph, n: Node, feeders: list[str], warnings: Collector) -> None:
    does = "is removed" if n.kind in RESOURCE_KINDS else "does not run"
    notes = tuple((f"removed too, as only this value reads it: `{_name(graph, f)}`",
                   graph.binding_spans.get(f, graph.node(f).span)) for f in feeders)
    span = graph.binding_spans[n.id]
    name = graph.bindings.get(n.id)
    called = _called(graph, span)
    if name is not None:
        warnings.warning("W001", f"`{name}` is never read, so `{n.op}` {does}", span,
                         f"use `{name}`, or delete its line", notes)
    elif called != n.op:  # a call statement dropped the value a flow returns
        warnings.warning("W002", f"the value `{called}` returns is never read, so `{n.op}` computing it {does}",
                         span, f"bind the result and use it (`x = {called}(...)`), or delete the call", notes)
    else:
        warnings.warning("W002", f"the result of `{n.op}` is never read, so the call {does}", span,
                         f"bind it and use it (`x = {n.op}(...)`), or delete the call", notes)


def _called(graph: FlowGraph, span) -> str:
    """The name a call statement starts with, as written (``rollout`` in ``rollout(policy, d)``)."""
    line = graph.sources.line(span.path, span.line) or ""
    m = re.match(r"[A-Za-z_][A-Za-z0-9_.]*", line[span.column - 1:])
    return m.group(0) if m else ""


def _name(graph: FlowGraph, nid: str) -> str:
    """How the source names a node: its binding, else its op (a nested call, a declaration)."""
    node = graph.node(nid)
    if graph.bindings.get(nid):
        return graph.bindings[nid]
    return nid.rsplit(".", 1)[-1].split("#")[0] if node.kind in RESOURCE_KINDS else node.op
