"""Bind names, load imports and inline flow calls.

Requires: a raw FlowGraph from :func:`flowrl.ir.build.build_flow` (one node per
statement, ``Ref`` arguments holding source names, ``CALL`` nodes for non-built-ins).

Guarantees: no ``CALL`` node is left; every ``Ref`` names a node id and has an edge
(``DATA`` from ops, ``RESOURCE`` from models/datasets/rewards/environments); calls of
other flows are inlined with their node ids prefixed by the flow name (``grpo.adv``);
scalar parameters are replaced by their values; a value re-bound inside a ``repeat``
loop gets a ``TURN`` edge (distance 1) to its first use in the loop.

>>> from flowrl.compiler.pipeline import compile_text
>>> g = compile_text('''
... flow inner(m: model, d: dataset) { b = sample(d, size = 4)  return b }
... flow main(m: model, d: dataset) { x = inner(m, d) }
... ''', "doc.flow", until="resolve_names")
>>> [n.id for n in g.nodes()]
['m', 'd', 'inner.b']
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flowrl.compiler.context import CompileContext
from flowrl.compiler.kwargs import show
from flowrl.diagnostics import Collector, FlowError, did_you_mean
from flowrl.ir.build import build_flow
from flowrl.ir.graph import Config, Const, Edge, EdgeKind, FlowGraph, Node, Ref, Region, Symbol, Value
from flowrl.catalog.ops import BUILTIN_NAMES, DECL_KINDS, LOSSES, OPS, RESOURCE_KINDS, RESOURCE_TYPES, OpKind, PARAM_TYPES
from flowrl.syntax import ast
from flowrl.syntax.fmt import format_expr

MAX_INLINE_DEPTH = 32


@dataclass(frozen=True)
class _Bound:
    """What a name means in a scope: a node (``node``) or a constant value (``value``)."""

    node: str | None = None
    value: Value | None = None
    failed: bool = False
    """The statement that bound the name failed (and was reported): uses stay silent."""


_FAILED = _Bound(failed=True)


class _Resolver:
    def __init__(self, raw: FlowGraph, ctx: CompileContext):
        self.ctx = ctx
        self.errors = Collector(ctx.sources)
        self.out = FlowGraph(raw.name, raw.span, params=raw.params, schedule=raw.schedule,
                             sources=ctx.sources, unit=ctx.unit)
        self.globals_made: dict[tuple[str, str], str] = {}
        self.decls_open: list[tuple[tuple[str, str], ast.Decl]] = []
        """Declarations being built, outermost first: one met again is a cycle (E130)."""
        self._prefixes: set[str] = set()
        self._heads: set[str] = set()  # first dotted part of every node id in self.out
        self._next_suffix: dict[str, int] = {}
        self._bodies_checked: set = set()  # flow bodies whose parameters were checked (once, not per call)
        self._rebound: dict[tuple, tuple] = {}  # statement -> (name, old value, where bound, what, where again)
        self._read: dict[int, _Bound] = {}  # every _Bound a name lookup returned, by id (kept alive)
        self._returned: set[str] = set()  # nodes read other than by name: returned by a flow, or a builder handle

    # ---- entry ---------------------------------------------------------------------
    def run(self, raw: FlowGraph) -> FlowGraph:
        module = self.ctx.module
        try:
            vis = self.ctx.unit.visible(module)
        except FlowError as e:
            self.errors.items.extend(e.diagnostics)
            self.errors.raise_if_any()
        env: dict[str, _Bound] = {}
        for p in raw.params:  # the graph's own params: `--set` overrides are already applied
            env[p.name] = self.entry_param(p, env)
        result = self.inline(raw, env, module, prefix="", scope=(), stack=(raw.name,))
        if result is not None and result.node:
            self.out.returns = Ref(result.node, getattr(raw.returns, "span", raw.span))
        elif result is not None and result.value is not None:
            self.out.returns = result.value
        self.check_rebindings()
        unused = [d for d in vis.decls.values() if (module.path, d.name) not in self.globals_made]
        if unused:  # every declaration is checked, used or not, but only used ones join the graph
            kept, self.out = self.out, _resources_of(self.out, self.ctx)  # what unused ones may refer to
            for decl in unused:
                self.global_node(module, decl)
            spare, self.out = self.out, kept
            if not self.errors.has_errors:
                self.check_spare(spare)
        self.errors.raise_if_any()
        return self.out

    def check_spare(self, spare: FlowGraph) -> None:
        """Type-check unused declarations (arguments, options) as check_edge_types would."""
        from flowrl.compiler.passes.check_edge_types import check_edge_types  # the next pass; no cycle at import

        try:
            check_edge_types(spare, self.ctx)
        except FlowError as e:
            self.errors.items.extend(e.diagnostics)

    def entry_param(self, p: ast.Param, env) -> _Bound:
        if p.type not in PARAM_TYPES:
            self.errors.error("E114", f"unknown type `{p.type}` for parameter `{p.name}`", p.span,
                              did_you_mean(p.type, PARAM_TYPES) or f"types: {', '.join(PARAM_TYPES)}")
            return _Bound(value=Symbol(p.name, p.type, p.span))
        if p.default is not None:
            return self.bind_default(p, env)
        if p.type in RESOURCE_TYPES:
            role = "trainable" if p.type == "model" else None
            node = Node(self.out.fresh_id(p.name), RESOURCE_TYPES[p.type], "param", (), (), p.span, role=role)
            self.add(node)
            return _Bound(node=node.id)
        if p.type == "data":
            node = Node(self.out.fresh_id(p.name), OpKind.USER_CALL, "param", (), (), p.span,
                        fields=frozenset({"*"}))
            self.add(node)
            return _Bound(node=node.id)
        return _Bound(value=Symbol(p.name, p.type, p.span))

    def bind_default(self, p: ast.Param, env) -> _Bound:
        expr = p.default
        if isinstance(expr, ast.Call):
            if expr.func not in OPS or OPS[expr.func].kind not in RESOURCE_KINDS:
                self.errors.error("E115", f"the default of `{p.name}` must be a constant or a "
                                          f"model/dataset/reward/env constructor", expr.span,
                                  "e.g. `policy: model = hf(\"path\")` or `group: int = 8`")
                return _Bound(value=Symbol(p.name, p.type, p.span))
            node = self.make_node(expr, p.name, env, self.ctx.module, prefix="", scope=(), region=None)
            if node is not None:
                self.check_kind(p, node)
                return _Bound(node=node)
            return _Bound(value=Symbol(p.name, p.type, p.span))
        value = self.value_of(_expr_value(expr), env, self.ctx.module)
        self.check_scalar(p, value)
        return _Bound(value=value) if not isinstance(value, str) else _Bound(node=value)

    # ---- checks of parameter kinds ------------------------------------------------------
    def check_kind(self, p: ast.Param, node_id: str) -> None:
        node = self.out.node(node_id)
        want = RESOURCE_TYPES.get(p.type)
        if want is not None and node.kind != want:
            self.errors.error("E116", f"parameter `{p.name}` is a {p.type}, but `{node.op}(...)` makes "
                                      f"{_kind_word(node.kind)}", node.span,
                              f"pass a {p.type}")

    def check_scalar(self, p: ast.Param, value) -> None:
        if isinstance(value, Const) and p.type in ("int", "float", "str", "bool", "size"):
            ok = (value.kind == p.type or (p.type == "float" and value.kind == "int"))
            if not ok:
                self.errors.error("E117", f"parameter `{p.name}` is {p.type}, but its value "
                                          f"`{value.text or _show(value.value)}` is {value.kind}",
                                  value.span, f"give a value of type {p.type}")
        elif isinstance(value, tuple) and p.type not in ("list",):
            self.errors.error("E117", f"parameter `{p.name}` is {p.type}, but its value is a list", p.span,
                              f"give a value of type {p.type}")

    # ---- inlining ---------------------------------------------------------------------------
    def inline(self, raw: FlowGraph, env: dict[str, _Bound], module: ast.Module, prefix: str,
               scope: tuple[str, ...], stack: tuple[str, ...]) -> Value | None:
        local_ids: dict[str, str] = {}  # raw node id -> out node id (for hoisted nested calls)
        region_map = {rid: prefix + rid for rid in raw.regions}
        self.check_params_once(raw)
        bound_at = {p.name: (_name_span(p.span, p.name), "parameter") for p in raw.params}
        nested = _nested_calls(raw)

        def bind(name: str, new: _Bound, span, nid: str) -> None:
            old = env.get(name)
            if old is not None and not old.failed and name in bound_at:
                # keyed by the statement: a flow inlined twice reports its body once
                self._rebound.setdefault((raw.span, nid), (name, old, *bound_at[name], span))
            env[name] = new
            bound_at[name] = (span, "binding")

        def open_region(rid: str | None) -> None:
            # A loop's count is resolved where the loop starts: names bound before it are visible.
            if rid is None or region_map[rid] in self.out.regions:
                return
            region = raw.regions[rid]
            open_region(region.parent)
            count = self.value_of(region.count, env, module, local_ids)
            self.out.regions[region_map[rid]] = Region(region_map[rid], count, region.until, region.span,
                                                       parent=region_map.get(region.parent))
        bound_in_region = {}
        for n in raw.nodes():
            if n.region is not None and n.id in raw.bindings:
                bound_in_region.setdefault(n.region, set()).add(raw.bindings[n.id])
        pending_turns: list[tuple[str, str, str, str]] = []  # (region, name, consumer, arg)
        current_region = None
        for n in raw.nodes():
            if n.region != current_region:
                self.close_turns(pending_turns, env, current_region)
                current_region = n.region
                open_region(n.region)
            region = region_map.get(n.region) if n.region else None
            binding = raw.bindings.get(n.id)
            where = raw.binding_spans.get(n.id, n.span)
            if n.op == "=":  # alias binding
                value = n.args[0]
                if isinstance(value, Ref):
                    target = self.lookup(value, env, module, local_ids)
                    bind(binding, target if target is not None else _FAILED, where, n.id)
                else:
                    bind(binding, _Bound(value=self.value_of(value, env, module, local_ids)), where, n.id)
                continue
            if n.kind == OpKind.CALL:
                result = self.call(n, env, module, prefix, scope, stack, local_ids, region,
                                   turns=(pending_turns, bound_in_region.get(n.region, set())))
                if result is None or result.failed:
                    if binding:  # reported already; later uses of the name would only repeat it
                        env[binding] = _FAILED
                    continue
                local_ids[n.id] = result.node or ""
                if binding and result.node is None and result.value is None:
                    self.errors.error("E122", f"flow `{n.op}` returns nothing, so `{binding}` has no value",
                                      n.span, f"add `return ...` to flow `{n.op}`, or call it without `{binding} =`")
                    env[binding] = _FAILED
                elif binding:
                    bind(binding, result, where, n.id)
                    if result.node:
                        self.name(result.node, binding, where)
                elif result.node and n.id not in nested:  # a call statement drops the value the flow returns
                    self.name(result.node, None, n.span)
                continue
            vis = self.visible(module)
            # Inside flow `rloo` itself, `rloo(...)` can only mean the op (flows do not recurse).
            if vis is not None and n.op in vis.flows and n.op in OPS and vis.flows[n.op][1].name not in stack:
                where = vis.flows[n.op][0].path
                self.errors.error("E127", f"`{n.op}` is both a built-in op and a flow from {where}", n.span,
                                  f"this calls the built-in op; to call the flow, import it with an alias "
                                  f"(`import ... as algo`) and write `algo.{n.op}(...)`")
                continue
            if n.op in OPS and OPS[n.op].kind == OpKind.RESYNC:
                self.errors.error("E110", f"`{n.op}` is inserted by the compiler, not written in a flow",
                                  n.span, "remove it; to choose how weights travel write "
                                          "`resync MODEL via PROTOCOL(...)` in a schedule")
                continue
            nid = self.emit(n, env, module, prefix, scope, region, local_ids, binding,
                            turns=(pending_turns, bound_in_region.get(n.region, set())))
            local_ids[n.id] = nid
            if binding:
                bind(binding, _Bound(node=nid), where, n.id)
                self.name(nid, binding, where)
            elif n.id not in nested:  # a call statement: its result, if any, is dropped
                self.name(nid, None, n.span)
        self.close_turns(pending_turns, env, current_region)
        for rid in raw.regions:  # loops without ops still get their count checked
            open_region(rid)
        if raw.returns is None:
            return None
        if isinstance(raw.returns, Ref):
            b = self.lookup(raw.returns, env, module, local_ids)
            if b is not None and b.node:
                self._returned.add(b.node)
            return b if b is not None else _FAILED
        return _Bound(value=self.value_of(raw.returns, env, module, local_ids))

    def name(self, nid: str, binding: str | None, span) -> None:
        """Record the name a node's value is bound to (the caller's name wins: it is recorded last)."""
        self.out.bindings[nid] = binding
        self.out.binding_spans[nid] = span

    def check_params_once(self, raw: FlowGraph) -> None:
        """A flow declares each parameter once (else the last default silently won)."""
        if raw.span in self._bodies_checked:
            return
        self._bodies_checked.add(raw.span)
        first: dict[str, object] = {}
        for p in raw.params:
            span = _name_span(p.span, p.name)
            if p.name in first:
                self.errors.error("E128", f"parameter `{p.name}` is declared twice", span,
                                  "remove one of them (a call or `--set` could only ever give one value)",
                                  notes=(("first declared", first[p.name]),))
                continue
            first[p.name] = span

    def check_rebindings(self) -> None:
        """A name may be bound again once its value has been used (later uses see the new
        value; a ``repeat`` body carries a value to the next turn this way). Bound again
        before the first value was ever read, the first binding did nothing but run its op:
        a parameter's value from a caller or ``--set`` was ignored, an op ran for nothing."""
        returned = self._returned | ({self.out.returns.target} if isinstance(self.out.returns, Ref) else set())
        for name, old, first, what, again in self._rebound.values():
            # read by name (an op's argument, an alias, a return), or, for a node, by any edge
            # (the builder refers to a node whose name was re-bound directly) or as an effect
            used = id(old) in self._read or old.node is not None and (
                old.node not in self.out or old.node in returned or bool(self.out.users(old.node))
                or getattr(OPS.get(self.out.node(old.node).op), "effect", False))
            if used:
                continue
            if what == "parameter":
                message = f"parameter `{name}` is bound again before its value is ever read"
                hint = "give this value its own name: as it is, the value a caller or `--set` gives is never used"
            else:
                message = f"`{name}` is bound again before its value is ever read"
                hint = ("give this value its own name, or delete the first binding "
                        "(a name may be bound again once its value has been used)")
            self.errors.error("E129", message, again, hint,
                              notes=(("declared as a parameter" if what == "parameter" else "first bound", first),))

    def close_turns(self, pending, env, region) -> None:
        keep = []
        for reg, name, consumer, arg in pending:
            if reg != region:
                keep.append((reg, name, consumer, arg))
                continue
            last = env.get(name)
            if last is not None and last.node:
                self.out.connect(last.node, consumer, Edge(EdgeKind.TURN, arg, distance=1))
        pending[:] = keep

    def emit(self, n: Node, env, module, prefix, scope, region, local_ids, binding, turns) -> str:
        pending, rebound = turns
        spec = OPS[n.op]
        nid = self.out.fresh_id(prefix + (binding or n.id.split("#")[0]))
        args: list[Value] = []
        edges: list[tuple[str, Edge]] = []
        for i, a in enumerate(n.args):
            arg_name = spec.args[i].name if i < len(spec.args) else f"arg{i}"
            if isinstance(a, Ref):
                b = self.lookup(a, env, module, local_ids)
                if b is None:
                    args.append(a)
                    continue
                if b.node is None:
                    args.append(b.value)
                    continue
                src = self.out.node(b.node)
                kind = EdgeKind.RESOURCE if src.kind in RESOURCE_KINDS else EdgeKind.DATA
                args.append(Ref(b.node, a.span))
                edges.append((b.node, Edge(kind, arg_name)))
                if n.region is not None and a.target in rebound and src.region != region:
                    pending.append((n.region, a.target, nid, arg_name))
            else:
                args.append(self.value_of(a, env, module, local_ids))
        attrs = tuple((k, self.kwarg_value(k, v, env, module, local_ids)) for k, v in n.attrs)
        node = Node(nid, n.kind, n.op, tuple(args), attrs, n.span, region=region, scope=scope,
                    role=spec.role, key_spans=n.key_spans)
        self.add(node)
        for src, e in edges:
            self.out.connect(src, nid, e)
        return nid

    def kwarg_value(self, key: str, v: Value, env, module, local_ids) -> Value:
        if isinstance(v, Ref):
            b = self.lookup(v, env, module, local_ids)
            if b is None:
                return v
            if b.node is not None:
                node = self.out.node(b.node)
                self.errors.error("E118", f"keyword `{key}` needs a constant, but `{v.target}` is "
                                          f"{_kind_word(node.kind)} (from `{node.op}` at {node.span.line}:{node.span.column})", v.span,
                                  "pass data and models as positional arguments")
                return v
            return b.value
        return self.value_of(v, env, module, local_ids)

    def value_of(self, v: Value, env, module, local_ids=None) -> Value:
        """Resolve names inside a constant expression (list items, config options)."""
        if isinstance(v, Ref):
            b = self.lookup(v, env, module, local_ids or {})
            if b is None:
                return v
            if b.node is not None:
                node = self.out.node(b.node)
                self.errors.error("E118", f"`{v.target}` is {_kind_word(node.kind)}, but a constant is needed "
                                          f"here", v.span, "use a literal or a scalar parameter")
                return v
            return b.value
        if isinstance(v, tuple):
            return tuple(self.value_of(i, env, module, local_ids) for i in v)
        if isinstance(v, Config):
            return replace(v, options=tuple((k, self.value_of(x, env, module, local_ids)) for k, x in v.options),
                           args=tuple(self.value_of(x, env, module, local_ids) for x in v.args))
        return v

    # ---- names ------------------------------------------------------------------------------
    def lookup(self, ref: Ref, env, module, local_ids) -> _Bound | None:
        if ref.target.startswith("#node:"):
            nid = local_ids.get(ref.target[6:])
            if nid:
                self._returned.add(nid)  # a builder handle refers to the node itself: a read
            return _Bound(node=nid) if nid else None
        if ref.target in env:
            bound = env[ref.target]
            self._read[id(bound)] = bound
            return None if bound.failed else bound
        vis = self.visible(module)
        if vis is not None and ref.target in vis.decls:
            nid = self.global_node(module, vis.decls[ref.target])
            return _Bound(node=nid) if nid else None
        if vis is not None and ref.target in vis.flows:
            self.errors.error("E109", f"`{ref.target}` is a flow; call it: `{ref.target}(...)`", ref.span)
            return None
        if ref.target in BUILTIN_NAMES:
            self.errors.error("E109", f"`{ref.target}` is a built-in op; call it: `{ref.target}(...)`", ref.span)
            return None
        names = list(env) + (list(vis.decls) if vis else [])
        self.errors.error("E101", f"unknown name `{ref.target}`", ref.span,
                          did_you_mean(ref.target, names) or "define it before its use, or make it a parameter")
        return None

    def visible(self, module):
        try:
            return self.ctx.unit.visible(module)
        except FlowError as e:
            self.errors.items.extend(d for d in e.diagnostics if d not in self.errors.items)
            return None

    def global_node(self, module: ast.Module, decl: ast.Decl) -> str | None:
        key = (module.path, decl.name)
        open_keys = [k for k, _ in self.decls_open]
        if key in open_keys:  # `model m = frozen(m)`, or `a` in terms of `b` in terms of `a`
            cycle = [d.name for _, d in self.decls_open[open_keys.index(key):]] + [decl.name]
            self.errors.error("E130", f"`{decl.name}` is declared in terms of itself ({' -> '.join(cycle)})",
                              decl.value.span, "a declaration may use others, but not one that uses it back")
            return None
        if key in self.globals_made:
            return self.globals_made[key] or None
        self.decls_open.append((key, decl))
        try:
            nid = self._declare(module, decl)
        finally:
            self.decls_open.pop()
        self.globals_made[key] = nid or ""
        return nid

    def _declare(self, module: ast.Module, decl: ast.Decl) -> str | None:
        """The graph node of declaration ``decl`` (None after an error)."""
        want = DECL_KINDS.get(decl.kind)
        if want is None:
            self.errors.error("E119", f"unknown declaration kind `{decl.kind}`", decl.kind_span,
                              did_you_mean(decl.kind, DECL_KINDS) or "declarations are model, dataset, reward, env")
            return None
        if not isinstance(decl.value, ast.Call) or decl.value.func not in OPS \
                or OPS[decl.value.func].kind not in RESOURCE_KINDS:
            ctors = sorted(k for k, s in OPS.items() if s.kind == want)
            self.errors.error("E120", f"a {decl.kind} declaration needs a {decl.kind} constructor",
                              decl.value.span, f"use one of: {', '.join(ctors)}")
            return None
        prefix = "" if module is self.ctx.module else module.path.rsplit("/", 1)[-1].removesuffix(".flow") + "."
        nid = self.make_node(decl.value, prefix + decl.name, {}, module, prefix="", scope=(), region=None)
        if nid is None:
            return None
        node = self.out.node(nid)
        if node.kind != want:
            ctors = sorted(k for k, s in OPS.items() if s.kind == want)
            self.errors.error("E120", f"`{decl.name}` is declared a {decl.kind}, but `{node.op}(...)` makes "
                                      f"{_kind_word(node.kind)}", decl.value.func_span,
                              f"use one of: {', '.join(ctors)}")
        return nid

    def make_node(self, call: ast.Call, name: str, env, module, prefix, scope, region) -> str | None:
        """Build and emit one node from an AST call (defaults and declarations)."""
        tmp = FlowGraph(name, call.span)
        from flowrl.ir.build import _Builder  # the builder's expression rules, shared

        b = _Builder(tmp)
        b.call(call, None, binding=name)
        last = None
        local: dict[str, str] = {}
        for n in tmp.nodes():
            if n.kind == OpKind.CALL:
                self.errors.error("E121", f"`{n.op}(...)` cannot be used here", n.span,
                                  "declarations and parameter defaults take a constructor such as "
                                  "hf(...), jsonl(...), verifier(...)")
                return None
            last = self.emit(n, env, module, prefix, scope, region, local, tmp.bindings.get(n.id),
                             turns=([], set()))
            local[n.id] = last
        return last

    # ---- calls of flows / reward values ----------------------------------------------------------
    def call(self, n: Node, env, module, prefix, scope, stack, local_ids, region,
             turns=((), frozenset())) -> _Bound | None:
        name = n.op
        vis = self.visible(module)
        bound = env.get(name)
        if bound is None and vis is not None and name in vis.decls and name not in vis.flows:  # a declared reward...
            nid = self.global_node(module, vis.decls[name])
            bound = _Bound(node=nid) if nid else _FAILED
        if bound is not None and bound.failed:
            return None
        if bound is not None and bound.node is not None:
            target = self.out.node(bound.node)
            if target.kind == OpKind.REWARD_FN:  # `scores = reward(rollouts)`: sugar for score(reward, rollouts)
                call = replace(n, kind=OpKind.SCORE, op="score", args=(Ref(name, n.span),) + n.args)
                nid = self.emit(call, env, module, prefix, scope, region, local_ids, None, turns=turns)
                return _Bound(node=nid)
            self.errors.error("E109", f"`{name}` is {_kind_word(target.kind)}, not something to call",
                              _func_span(n), "only ops, flows and rewards can be called")
            return None
        if vis is None:
            return None
        if bound is not None and name not in vis.flows:
            self.errors.error("E109", f"`{name}` is a constant, not something to call", _func_span(n),
                              "only ops, flows and rewards can be called")
            return None
        if name not in vis.flows:
            names = list(OPS) + list(LOSSES) + list(vis.flows) + [k for k, b in env.items() if b.node]
            hint = did_you_mean(name, names)
            if hint is None and "." in name:
                hint = "import the file that defines it (`import stdlib.NAME as alias`)"
            self.errors.error("E104", f"unknown op or flow `{name}`", _func_span(n),
                              hint or "see docs/language.md for the built-in ops")
            return None
        callee_module, callee = vis.flows[name]
        if region is not None:
            # Inlined ops would land outside the loop and values re-bound in the loop would
            # not be carried into the callee: refuse rather than compile a different program.
            self.errors.error("E217", f"flow `{name}` is called inside `repeat`; flow calls in a loop are "
                                      "not supported", _func_span(n),
                              f"write the ops of `{name}` directly in the `repeat` body")
            return None
        if callee.name in stack:
            cycle = stack[stack.index(callee.name):] + (callee.name,)
            self.errors.error("E105", f"flow `{callee.name}` calls itself ({' -> '.join(cycle)})",
                              n.span, "flows are inlined, so they cannot recurse; use `repeat` for loops")
            return None
        if len(stack) > MAX_INLINE_DEPTH:
            self.errors.error("E105", f"flow calls nested deeper than {MAX_INLINE_DEPTH} levels "
                                      f"({stack[0]} -> ... -> {stack[-1]} -> {callee.name})", n.span,
                              "inline some of the intermediate flows by hand")
            return None
        callee_env = self.bind_call(n, callee, env, module, local_ids)
        if callee_env is None:
            return None
        raw = build_flow(callee, callee_module)
        base = prefix + callee.name.rsplit(".", 1)[-1]
        sub_prefix = self.unique_prefix(base) + "."
        result = self.inline(raw, callee_env, callee_module, sub_prefix, scope + (callee.name,),
                             stack + (callee.name,))
        return result if result is not None else _Bound()

    def add(self, node: Node) -> None:
        self.out.add(node)
        self._heads.add(node.id.split(".", 1)[0])

    def unique_prefix(self, base: str) -> str:
        # The first dotted part of every node id is taken too (`lib.policy` from an import);
        # `add` keeps that set current, so a prefix costs O(1), not a scan of the graph
        # (which made inlining quadratic in the number of flow calls).
        taken = self._heads
        name, i = base, self._next_suffix.get(base, 2)
        if name in taken or name in self._prefixes:
            name = f"{base}#{i}"
        while name in taken or name in self._prefixes:
            i += 1
            name = f"{base}#{i}"
        self._next_suffix[base] = i  # `block#k` were all taken: the next search starts at k
        self._prefixes.add(name)
        return name

    def bind_call(self, n: Node, callee: ast.FlowDef, env, module, local_ids) -> dict | None:
        params = {p.name: p for p in callee.params}
        order = [p.name for p in callee.params]
        bound: dict[str, _Bound] = {}
        ok = True
        if len(n.args) > len(order):
            extra = n.args[len(order)]
            self.errors.error("E106", f"flow `{callee.name}` takes {len(order)} positional argument"
                                      f"{'s' if len(order) != 1 else ''}, got {len(n.args)}",
                              _value_span(extra, n), f"signature: {_signature(callee)}")
            ok = False
        pairs = list(zip(order, n.args)) + [(k, v) for k, v in n.attrs]
        for key, v in pairs:
            if key not in params:
                span = n.key_span(key) or _value_span(v, n)
                self.errors.error("E107", f"flow `{callee.name}` has no parameter `{key}`", span,
                                  did_you_mean(key, order) or f"signature: {_signature(callee)}")
                ok = False
                continue
            if key in bound:
                self.errors.error("E107", f"parameter `{key}` of flow `{callee.name}` is given twice",
                                  n.key_span(key) or _value_span(v, n), f"signature: {_signature(callee)}")
                ok = False
                continue
            p = params[key]
            if isinstance(v, Ref):
                b = self.lookup(v, env, module, local_ids)
                if b is None:
                    ok = False
                    continue
            else:
                b = _Bound(value=self.value_of(v, env, module, local_ids))
            if not self.check_arg(callee, p, b, v, n):
                ok = False
            bound[key] = b
        callee_env: dict[str, _Bound] = {}
        for p in callee.params:
            if p.name in bound:
                callee_env[p.name] = bound[p.name]
            elif p.default is not None:
                callee_env[p.name] = self.bind_default(p, callee_env)
            else:
                self.errors.error("E108", f"flow `{callee.name}` needs argument `{p.name}` ({p.type})", n.span,
                                  f"signature: {_signature(callee)}")
                ok = False
        return callee_env if ok else None

    def check_arg(self, callee, p: ast.Param, b: _Bound, v: Value, n: Node) -> bool:
        span = _value_span(v, n)
        if p.type in RESOURCE_TYPES or p.type == "data":
            if b.node is None:
                self.errors.error("E116", f"argument `{p.name}` of flow `{callee.name}` must be a {p.type}, "
                                          f"got a constant", span, f"signature: {_signature(callee)}")
                return False
            node = self.out.node(b.node)
            want = RESOURCE_TYPES.get(p.type)
            is_data = node.kind not in RESOURCE_KINDS
            if (want is not None and node.kind != want) or (p.type == "data" and not is_data):
                self.errors.error("E116", f"argument `{p.name}` of flow `{callee.name}` must be a {p.type}, "
                                          f"but `{_name_of(v)}` is {_kind_word(node.kind)}", span,
                                  f"signature: {_signature(callee)}")
                return False
            return True
        if b.node is not None:
            node = self.out.node(b.node)
            self.errors.error("E116", f"argument `{p.name}` of flow `{callee.name}` must be {p.type}, "
                                      f"but `{_name_of(v)}` is {_kind_word(node.kind)}", span,
                              f"signature: {_signature(callee)}")
            return False
        self.check_scalar(p, b.value)
        return True


def resolve_names(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    r = _Resolver(graph, ctx)
    r._prefixes = set()
    return r.run(graph)


def _resources_of(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    """A scratch graph holding ``graph``'s resource nodes (and the edges among them), so an
    unused declaration such as ``model ref = frozen(policy)`` can refer to a used one."""
    out = FlowGraph("", graph.span, sources=ctx.sources)
    for n in graph.nodes():
        if n.kind in RESOURCE_KINDS:
            out.add(n)
    for u, v, e in graph.edges():
        if u in out and v in out:
            out.connect(u, v, e)
    return out


def _nested_calls(raw: FlowGraph) -> set[str]:
    """Raw nodes another statement's value refers to (calls written inside an expression,
    hoisted into nodes of their own); every other unbound node is a call statement."""
    out: set[str] = set()

    def visit(v) -> None:
        if isinstance(v, Ref) and v.target.startswith("#node:"):
            out.add(v.target[6:])
        elif isinstance(v, tuple):
            for x in v:
                visit(x)
        elif isinstance(v, Config):
            for x in v.args:
                visit(x)
            for _, x in v.options:
                visit(x)

    for n in raw.nodes():
        for a in n.args:
            visit(a)
        for _, a in n.attrs:
            visit(a)
    visit(raw.returns)
    for region in raw.regions.values():
        visit(region.count)
    return out


def _expr_value(e: ast.Expr) -> Value:
    if isinstance(e, ast.Literal):
        return Const(e.value, e.kind, e.span, e.text if e.kind == "size" else None)
    if isinstance(e, ast.Name):
        return Ref(e.id, e.span)
    if isinstance(e, ast.ListExpr):
        return tuple(_expr_value(i) for i in e.items)
    return Config(e.func, tuple(sorted((k.name, _expr_value(k.value)) for k in e.kwargs)), e.span,
                  tuple(_expr_value(a) for a in e.args))


def _func_span(n: Node):
    """The called name at the start of a call's span (``genrate`` in ``genrate(policy, b)``)."""
    s = n.span
    return replace(s, end_line=s.line, end_column=s.column + len(n.op))


def _value_span(v, n: Node):
    return getattr(v, "span", None) or n.span


def _name_of(v) -> str:
    return v.target if isinstance(v, Ref) else str(v)


def _show(v) -> str:
    return show(v)


def _signature(flow: ast.FlowDef) -> str:
    return f"{flow.name}(" + ", ".join(f"{p.name}: {p.type}" + (f" = {format_expr(p.default)}" if p.default else "")
                                       for p in flow.params) + ")"


def _name_span(span, name: str):
    """The name at the start of a span (a parameter ``group: int = 8`` starts with its name)."""
    return replace(span, end_line=span.line, end_column=span.column + len(name))


_KIND_WORDS = {OpKind.MODEL: "a model", OpKind.DATASET: "a dataset", OpKind.REWARD_FN: "a reward",
               OpKind.ENV: "an environment"}


def _kind_word(kind: OpKind) -> str:
    return _KIND_WORDS.get(kind, "data")
