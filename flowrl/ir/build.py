"""AST -> raw FlowGraph: one node per statement, names not yet bound.

A raw graph has no edges: every argument is a ``Ref`` holding the *source* name, and a
call of anything that is not a built-in op is an ``OpKind.CALL`` node. The first pass,
``resolve_names``, binds names, inlines flow calls and draws the edges. The Python
builder (:mod:`flowrl.builder`) writes the same AST and calls this function, so both front ends
share the graph building and every pass.
"""

from __future__ import annotations

from flowrl.diagnostics import Span
from flowrl.ir.graph import Config, Const, FlowGraph, Node, Ref, Region, Value
from flowrl.catalog.ops import CONFIG_NAMES, OPS, OpKind
from flowrl.syntax import ast


def build_flow(flow: ast.FlowDef, module: ast.Module, sources=None) -> FlowGraph:
    """The raw graph of one flow definition."""
    graph = FlowGraph(flow.name, flow.span, params=flow.params)
    if sources is not None:
        graph.sources = sources
    _Builder(graph).stmts(flow.body, region=None)
    schedules = [i for i in module.items if isinstance(i, ast.ScheduleDef) and i.flow == flow.name]
    graph.schedule = schedules[0] if schedules else None
    return graph


def key_spans(call: ast.Call) -> tuple[tuple[str, Span], ...]:
    """(name, span of the name) of each keyword argument of a call, as written."""
    return tuple((k.name, Span(k.span.path, k.span.line, k.span.column, k.span.line, k.span.column + len(k.name)))
                 for k in call.kwargs)


class _Builder:
    def __init__(self, graph: FlowGraph):
        self.graph = graph
        self.n_regions = 0

    def stmts(self, body, region: str | None) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Binding):
                self.bind(stmt.name, stmt.value, stmt.span, region, stmt.name_span)
            elif isinstance(stmt, ast.CallStmt):
                self.call(stmt.call, region, binding=None)
            elif isinstance(stmt, ast.Return):
                self.graph.returns = self.expr(stmt.value, region)
            elif isinstance(stmt, ast.Repeat):
                self.n_regions += 1
                rid = f"repeat{self.n_regions}"
                self.graph.regions[rid] = Region(rid, self.expr(stmt.count, region), stmt.until, stmt.span,
                                                 parent=region)
                self.stmts(stmt.body, rid)

    def bind(self, name: str, value: ast.Expr, span, region, name_span=None) -> None:
        if isinstance(value, ast.Call) and value.func not in CONFIG_NAMES:
            nid = self.call(value, region, binding=name)
            self.graph.binding_spans[nid] = name_span or span
            return
        # `x = y` or `x = 3`: an alias; recorded as a binding of a value, not a node.
        node = Node(self.graph.fresh_id(name), OpKind.CALL, "=", (self.expr(value, region),), (), span,
                    region=region)
        self.graph.add(node)
        self.graph.bindings[node.id] = name
        self.graph.binding_spans[node.id] = name_span or span

    def call(self, call: ast.Call, region, binding: str | None) -> str:
        spec = OPS.get(call.func)
        kind = spec.kind if spec else OpKind.CALL
        args = tuple(self.expr(a, region) for a in call.args)
        attrs = tuple(sorted((k.name, self.expr(k.value, region)) for k in call.kwargs))
        node = Node(self.graph.fresh_id(binding or call.func.rsplit(".", 1)[-1]), kind, call.func,
                    args, attrs, call.span, region=region, key_spans=key_spans(call))
        self.graph.add(node)
        if binding is not None:
            self.graph.bindings[node.id] = binding
        return node.id

    def expr(self, e: ast.Expr, region) -> Value:
        if isinstance(e, ast.Literal):
            return Const(e.value, e.kind, e.span, e.text if e.kind == "size" else None)
        if isinstance(e, ast.Name):
            return Ref(e.id, e.span)
        if isinstance(e, ast.ListExpr):
            return tuple(self.expr(i, region) for i in e.items)
        if e.func in CONFIG_NAMES:
            return Config(e.func, tuple(sorted((k.name, self.expr(k.value, region)) for k in e.kwargs)),
                          e.span, tuple(self.expr(a, region) for a in e.args))
        # A nested op call, e.g. generate(frozen(policy), batch): hoisted into its own node.
        nid = self.call(e, region, binding=None)
        return Ref(f"#node:{nid}", e.span)

