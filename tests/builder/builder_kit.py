"""What the builder tests share: graphs compared spans aside, and :func:`replay`, which writes
a parsed ``.flow`` module again through the Python builder (``flowrl.builder``).

A module of its own, imported by its name (test folders' conftest modules share one name).

:func:`replay` walks the AST of a file and makes, for every declaration, statement and
schedule statement, the builder call a user would write; the builder's flow must then
compile to the same IR as the file. Generated from the files themselves, the mirrors cannot
go stale when a standard-library flow gains a parameter.
"""

from __future__ import annotations

import dataclasses
import keyword
from pathlib import Path

from flowrl import Flow
from flowrl.builder import Value, ctor, size
from flowrl.catalog.ops import LOSSES, OPS
from flowrl.compiler.pipeline import entry_flow
from flowrl.diagnostics import Span
from flowrl.ir.graph import FlowGraph
from flowrl.ir.printer import print_graph
from flowrl.syntax import ast
from flowrl.syntax.parser import parse

_METHODS = {n for n in dir(Flow) if not n.startswith("_")} - set(OPS) - set(LOSSES)
"""Flow methods that are not ops (an op of such a name is called with f.op(name, ...))."""


# ---- comparing graphs, spans aside -----------------------------------------------------------


def nospan(x):
    """``x`` with every Span replaced by None (recursively, via dataclasses.replace).
    Literal texts are dropped except for sizes: ``1e-6`` and ``1e-06`` are one value
    (the IR keeps a literal's text only for sizes, too)."""
    if isinstance(x, Span):
        return None
    if isinstance(x, ast.Literal) and x.kind != "size":
        x = dataclasses.replace(x, text="")
    if dataclasses.is_dataclass(x) and not isinstance(x, (type, FlowGraph)):
        return dataclasses.replace(x, **{f.name: nospan(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, tuple):
        return tuple(nospan(i) for i in x)
    if isinstance(x, frozenset):
        return frozenset(nospan(i) for i in x)
    if isinstance(x, dict):
        return {k: nospan(v) for k, v in x.items()}
    return x


def records(g: FlowGraph, raw: bool = False) -> dict:
    """Everything a graph holds, spans stripped: nodes in order, edges, regions, returns, params."""
    out = {
        "name": g.name,
        "nodes": [nospan(n) for n in g.nodes()],
        "edges": sorted(((u, v, k), nospan(d["edge"])) for u, v, k, d in g.g.edges(keys=True, data=True)),
        "regions": nospan(g.regions),
        "returns": nospan(g.returns),
        "params": nospan(g.params),
    }
    if raw:
        out["bindings"] = dict(g.bindings)
    return out


def assert_same_graph(a: FlowGraph, b: FlowGraph, raw: bool = False) -> None:
    assert print_graph(a) == print_graph(b)
    ra, rb = records(a, raw), records(b, raw)
    for key in ra:
        assert ra[key] == rb[key], key


# ---- the builder calls that write a parsed module again ------------------------------------------


def replay(path: str | Path) -> Flow:
    """The entry flow of ``path`` (with its imports, declarations, local flows and schedule), built
    with the builder."""
    module = parse(Path(path).read_text(), str(path))
    entry = entry_flow(module)
    flows: dict[str, Flow] = {}
    for fdef in (i for i in module.items if isinstance(i, ast.FlowDef)):
        flows[fdef.name] = _Replay(module, fdef, flows, fdef is entry).flow
    return flows[entry.name]


def _literal(e: ast.Expr):
    """A constant expression (parameter defaults, constructors, schedules) as a Python value."""
    if isinstance(e, ast.Literal):
        return size(e.text) if e.kind == "size" else e.value
    if isinstance(e, ast.ListExpr):
        return [_literal(i) for i in e.items]
    if isinstance(e, ast.Call):
        args, kwargs = _ctor_args(e, _literal)
        return ctor(e.func, *args, **kwargs)
    raise AssertionError(f"not a constant: {e}")


def _ctor_args(call: ast.Call, convert):
    return [convert(a) for a in call.args], {k.name: convert(k.value) for k in call.kwargs}


def _options(kwargs: dict) -> tuple[dict, dict]:
    """Keyword options Python can pass as keywords, and the others (``options=``)."""
    reserved = {k: v for k, v in kwargs.items() if keyword.iskeyword(k) or k in ("name", "options")}
    return {k: v for k, v in kwargs.items() if k not in reserved}, reserved


class _Replay:
    def __init__(self, module: ast.Module, fdef: ast.FlowDef, flows: dict, is_entry: bool):
        self.flows = flows
        params = [(p.name, p.type) if p.default is None else (p.name, p.type, _literal(p.default))
                  for p in fdef.params]
        imports = [(i.target, i.alias) for i in module.items if isinstance(i, ast.Import)]
        self.f = f = Flow(fdef.name, params=params, imports=imports)
        self.env: dict[str, Value] = {v.name: v for v in f.params}
        if is_entry:
            for d in (i for i in module.items if isinstance(i, ast.Decl)):
                args, kwargs = _ctor_args(d.value, self._decl_arg)
                self.env.setdefault(d.name, f.declare(d.kind, d.name, d.value.func, *args, **kwargs))
        self.stmts(fdef.body)
        if is_entry:
            for s in (i for i in module.items if isinstance(i, ast.ScheduleDef) and i.flow == fdef.name):
                self.schedule(s)
        self.flow = f

    def _decl_arg(self, e: ast.Expr):
        if isinstance(e, ast.Name):
            return self.env[e.id]
        if isinstance(e, ast.Call):
            args, kwargs = _ctor_args(e, self._decl_arg)
            return ctor(e.func, *args, **kwargs)
        return _literal(e)

    def stmts(self, body) -> None:
        f = self.f
        for s in body:
            if isinstance(s, ast.Binding):
                if isinstance(s.value, ast.Call) and s.value.func not in LOSSES:
                    self.env[s.name] = self.call(s.value, s.name)
                else:
                    self.env[s.name] = f.bind(s.name, self.value(s.value))
            elif isinstance(s, ast.CallStmt):
                self.call(s.call, None)
            elif isinstance(s, ast.Return):
                f.returns(self.value(s.value))
            else:
                with f.repeat(self.value(s.count), until=s.until):
                    self.stmts(s.body)

    def value(self, e: ast.Expr):
        if isinstance(e, ast.Name):
            return self.env[e.id]
        if isinstance(e, ast.ListExpr):
            return [self.value(i) for i in e.items]
        if isinstance(e, ast.Call):
            if e.func in LOSSES:
                args, kwargs = _ctor_args(e, self.value)
                return self.f.loss(e.func, *args, **kwargs)
            return self.call(e, None)
        return _literal(e)

    def call(self, c: ast.Call, name: str | None) -> Value:
        f = self.f
        args, kwargs = _ctor_args(c, self.value)
        kwargs, reserved = _options(kwargs)
        if isinstance(self.env.get(c.func), Value):  # `reward(rollouts)`
            return self.env[c.func](*args, name=name, options=reserved, **kwargs)
        if c.func in OPS:
            method = f.op if c.func in _METHODS else None
            if method is not None:
                return method(c.func, *args, name=name, options=reserved, **kwargs)
            return getattr(f, c.func)(*args, name=name, options=reserved, **kwargs)
        target = self.flows.get(c.func, c.func)  # a flow of this file, or an imported one by name
        return f.call_flow(target, *args, name=name, options=reserved, **kwargs)

    def schedule(self, s: ast.ScheduleDef) -> None:
        c = s.cluster
        if c is None:
            sched = self.f.schedule(auto=s.auto)
        elif c.func == "cluster" and not c.args:
            sched = self.f.schedule(auto=s.auto, **{k.name: _literal(k.value) for k in c.kwargs})
        else:
            sched = self.f.schedule(_literal(c), auto=s.auto)
        for st in s.body:
            if isinstance(st, ast.Colocate):
                sched.colocate(*map(str, st.targets), on=st.pool)
            elif isinstance(st, ast.Place):
                sched.place(*map(str, st.targets), on=st.pool)
            elif isinstance(st, ast.Pool):
                sched.pool(st.name, st.value.func, *[_literal(a) for a in st.value.args],
                           **{k.name: _literal(k.value) for k in st.value.kwargs})
            elif isinstance(st, ast.Layout):
                sched.layout(str(st.target), st.engine.func, **{k.name: _literal(k.value) for k in st.engine.kwargs})
            elif isinstance(st, ast.Staleness):
                sched.staleness(st.value, at_most=st.bound_only)
            elif isinstance(st, ast.Resync):
                sched.resync(st.model, st.protocol.func, every=st.every,
                             **{k.name: _literal(k.value) for k in st.protocol.kwargs})
            else:
                args, kwargs = _ctor_args(st.call, _literal)
                sched.call(st.call.func, *args, **kwargs)
