"""Invariants every FlowGraph must keep after resolve_names; each message says how to fix it.

Run after every pass with ``flowrl ir FILE --lint`` (the pass manager names the pass that
broke an invariant and the passes before it). Lint failures are compiler bugs, never
user errors, so they raise :class:`LintError` rather than a diagnostic.
"""

from __future__ import annotations

import networkx as nx

from flowrl.ir.graph import Config, EdgeKind, FlowGraph, Ref
from flowrl.catalog.ops import OpKind, RESOURCE_KINDS


class LintError(Exception):
    pass


def lint(graph: FlowGraph) -> list[str]:
    """Return a list of broken invariants (empty when the graph is well formed)."""
    problems: list[str] = []
    for n in graph.nodes():
        if n.kind == OpKind.CALL:
            problems.append(f"node %{n.id}: unresolved call of `{n.op}` (resolve_names must inline or reject it)")
        inputs = {(u, e.arg) for u, e in graph.in_edges(n.id)}
        for i, a in enumerate(n.args):
            if isinstance(a, Ref):
                if a.target not in graph:
                    problems.append(f"node %{n.id}: argument {i} refers to missing node %{a.target}")
                elif not any(u == a.target for u, _ in inputs):
                    problems.append(f"node %{n.id}: argument {i} refers to %{a.target} but no edge connects them "
                                    "(passes that rewrite args must redraw edges)")
        for k, v in n.attrs:
            if isinstance(v, Ref):
                problems.append(f"node %{n.id}: option `{k}` holds a reference; options must be constants")
            if isinstance(v, Config) and any(isinstance(x, Ref) for _, x in v.options):
                problems.append(f"node %{n.id}: option `{k}` holds a reference inside {v.name}(...)")
        if n.region is not None and n.region not in graph.regions:
            problems.append(f"node %{n.id}: region {n.region} is not declared in graph.regions")
    for u, v, e in graph.edges():
        if e.distance < 0:
            problems.append(f"edge %{u} -> %{v}: negative distance {e.distance}")
        if e.distance > 0 and e.kind not in (EdgeKind.WEIGHTS, EdgeKind.TURN):
            problems.append(f"edge %{u} -> %{v}: only weights and turn edges may be loop-carried, not {e.kind.value}")
        if e.kind == EdgeKind.RESOURCE and graph.node(u).kind not in RESOURCE_KINDS:
            problems.append(f"edge %{u} -> %{v}: resource edge from a non-resource node")
        if e.kind == EdgeKind.WEIGHTS and graph.node(u).kind not in (OpKind.UPDATE, OpKind.RESYNC):
            problems.append(f"edge %{u} -> %{v}: weights edges start at update or resync nodes")
    dag = graph.step_dag()
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        problems.append("the intra-step graph has a cycle: " + " -> ".join(f"%{a}" for a, *_ in cycle)
                        + " (a loop-carried edge needs distance >= 1)")
    return problems
