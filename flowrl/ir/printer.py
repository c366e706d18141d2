"""The deterministic text form of a FlowGraph (``flowrl ir FILE``), for humans and golden tests.

::

    flow grpo(policy: model, prompts: dataset, reward: reward, group: int = 8)
      %policy   = model param [trainable]
      %batch    = sample(%prompts, size=64) -> {answers, prompt_ids}
      ...
      %resync.policy = resync(%policy, every=1, protocol="auto") on policy
    edges
      %update -> %resync.policy  weights
      %resync.policy -> %rollouts  weights  loop distance=1

Nodes print in a topological order of the intra-step graph (ties broken by source
order); spans are not printed, so the builder and the parser print the same text.
"""

from __future__ import annotations

from flowrl.ir.graph import Config, Const, EdgeKind, FlowGraph, Node, Ref, Symbol
from flowrl.syntax import ast
from flowrl.syntax.parser import format_size


def print_graph(graph: FlowGraph) -> str:
    lines = [f"flow {graph.name}({_params(graph)})"]
    order = _order(graph)
    width = max((len(n.id) for n in order), default=0) + 1
    for n in order:
        lines.append(f"  %{n.id:<{width}} = {_node(n)}")
    for rid, region in sorted(graph.regions.items()):
        lines.append(f"  region {rid}: repeat {_value(region.count)}"
                     + (f" until {region.until}" if region.until else ""))
    if graph.returns is not None:
        lines.append(f"  return {_value(graph.returns)}")
    pos = {nid: i for i, nid in enumerate(graph.g.nodes)}
    edges = sorted(graph.edges(), key=lambda t: (pos[t[0]], pos[t[1]], t[2].kind.value, t[2].arg))
    lines.append("edges")
    for u, v, e in edges:
        extra = f" {{{', '.join(sorted(e.fields))}}}" if e.fields else ""
        loop = f"  loop distance={e.distance}" if e.distance else ""
        lines.append(f"  %{u} -> %{v}  {e.kind.value}:{e.arg}{extra}{loop}")
    return "\n".join(lines) + "\n"


def _order(graph: FlowGraph) -> list[Node]:
    try:
        return graph.topo_order()
    except Exception:  # a cyclic (invalid) graph still prints, in source order, for debugging
        return list(graph.nodes())


def _params(graph: FlowGraph) -> str:
    out = []
    for p in graph.params:
        out.append(f"{p.name}: {p.type}" + (f" = {_default(p.default)}" if p.default is not None else ""))
    return ", ".join(out)


def _default(e) -> str:
    """A parameter's default by its value, as the IR prints values (``1e-4`` and ``0.0001``
    print alike, so the builder's graphs and the parser's print the same)."""
    if isinstance(e, ast.Literal):
        return _value(Const(e.value, e.kind, e.span, e.text if e.kind == "size" else None))
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.ListExpr):
        return "[" + ", ".join(_default(x) for x in e.items) + "]"
    parts = [_default(a) for a in e.args] + [f"{k.name}={_default(k.value)}" for k in e.kwargs]
    return f"{e.func}({', '.join(parts)})"


def _node(n: Node) -> str:
    if n.op == "param":
        text = f"{n.kind.value} param"
    else:
        parts = [_value(a) for a in n.args] + [f"{k}={_value(v)}" for k, v in n.attrs]
        text = f"{n.op}({', '.join(parts)})"
    if n.role:
        text += f" [{n.role}]"
    if n.fields:
        text += f" -> {{{', '.join(sorted(n.fields))}}}"
    if n.model and n.op != "param":
        text += f" on {n.model}"
    if n.region:
        text += f" in {n.region}"
    return text


def _value(v) -> str:
    if isinstance(v, Ref):
        return f"%{v.target}"
    if isinstance(v, Const):
        if v.kind == "size":
            return format_size(int(v.value))
        if v.kind == "str":
            return '"' + str(v.value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        if v.kind == "bool":
            return "true" if v.value else "false"
        return repr(v.value)
    if isinstance(v, Config):
        parts = [_value(a) for a in v.args] + [f"{k}={_value(x)}" for k, x in v.options]
        return f"{v.name}({', '.join(parts)})"
    if isinstance(v, Symbol):
        return f"${v.name}"
    if isinstance(v, tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def edge_label(kind: EdgeKind, fields) -> str:
    return ", ".join(sorted(fields)) if fields else kind.value
