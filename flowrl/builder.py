"""The Python front end: write a flow (and its schedule) with method calls instead of ``.flow`` text.

::

    from flowrl import Flow, ctor
    f = Flow("grpo", params=[("policy", "model"), ("prompts", "dataset"), ("reward", "reward"),
                             ("group", "int", 8)])
    policy, prompts, reward, group = f.params
    ref = f.frozen(policy, name="ref")
    batch = f.sample(prompts, size=64, name="batch")
    rollouts = f.generate(policy, batch, n=group, name="rollouts")
    scores = reward(rollouts, name="scores")          # score(reward, rollouts), as in text
    ...
    f.update(policy, rollouts, adv, old_lp, ref_lp, loss=f.ppo_clip(0.2), kl=0.001)
    s = f.schedule(nodes=1, gpus_per_node=1)            # schedule grpo on cluster(...) { ... }
    s.layout("policy.train", "torch", dp=1)
    module = f.to_module()     # the program as flowrl.syntax.ast nodes, spans at the Python lines
    graph = f.compile()        # compile_module(module): the same graph building and PASSES as text
    plan = f.plan(steps=2)     # the ExecutionPlan `flowrl plan` makes
    print(f.to_flow_text())    # the program as .flow text

One front end: the builder records the calls, writes them as an AST :class:`~flowrl.syntax.ast.Module`
(imports, declarations, the builder flows it calls, this flow, its schedule) whose every node has
the span of the Python call (file, line, column of the argument), and hands that module to
:func:`flowrl.compiler.pipeline.compile_module`, exactly as the parser's module of a ``.flow``
file is handed. Graphs from the builder and from text agree by construction, and every
diagnostic is the text's, positioned at the user's Python line.

How Python maps onto the language:

* ``name="x"`` is the binding ``x = op(...)``; later uses of the handle are written ``x``; a
  handle whose name was re-bound since is still usable (the text reaches it through an alias
  ``x_1 = x`` written right after it; aliases add no node to the compiled graph).
* without ``name=`` a call is a nested call (``generate(policy, sample(prompts))``) when it is
  used once, a call statement when unused, and otherwise bound to its op name.
* a value carried from one turn of a ``repeat`` loop to the next is re-bound under the same
  name inside the loop (``name="convo"``), exactly as in text.
* ``reward(rollouts)`` for a reward handle is ``score(reward, rollouts)``.

Mistakes the compiler can see (unknown ops, options, names, wrong types of values) are left to
the passes, so they raise the same :class:`~flowrl.diagnostics.FlowError` as the text would;
mistakes only Python can make (a Python object that is not a flow value, a handle of another
flow, a name the language cannot spell) raise :class:`BuilderError` (a ``TypeError``) at once,
at the offending call.
"""

from __future__ import annotations

import ast as pyast
import functools
import itertools
import linecache
import math
import numbers
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from flowrl.catalog.ops import DECL_KINDS, LOSSES, OPS, OpKind, OpSpec
from flowrl.diagnostics import FlowError, SourceMap, Span, did_you_mean
from flowrl.syntax import ast

__all__ = ["BuilderError", "Flow", "Loss", "Params", "Schedule", "Size", "Value", "ctor", "size"]


class BuilderError(TypeError):
    """A builder call Python cannot turn into a flow (not a compiler diagnostic)."""


# ---- spans: the Python call that made each node ---------------------------------------------

_THIS_FILE = __file__


@functools.lru_cache(maxsize=512)
def _positions(code) -> tuple:
    """(lineno, end_lineno, col, end_col) of each code unit of ``code`` (bytes offsets)."""
    return tuple(code.co_positions())


@functools.lru_cache(maxsize=64)
def _calls_in(path: str, text: str) -> dict:
    """The calls of a Python source text by their extent -> (arg extents, keyword extents)."""
    try:
        tree = pyast.parse(text, path)
    except (SyntaxError, ValueError):
        return {}
    out = {}
    for node in pyast.walk(tree):
        if isinstance(node, pyast.Call):
            if any(isinstance(a, pyast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                continue  # *args / **kwargs: positions cannot be matched to values
            items = {i: _items(a) for i, a in enumerate(node.args)}
            items.update({k.arg: _items(k.value) for k in node.keywords})
            out[_extent(node)] = (tuple(_extent(a) for a in node.args),
                                  {k.arg: _extent(k) for k in node.keywords},  # `key=value`
                                  {k: v for k, v in items.items() if v is not None})
    return out


def _items(node) -> tuple | None:
    """Extents of the elements of a list or tuple display (``params=[(...), (...)]``)."""
    if isinstance(node, (pyast.List, pyast.Tuple)) and not any(isinstance(e, pyast.Starred) for e in node.elts):
        return tuple(_extent(e) for e in node.elts)
    return None


def _extent(node) -> tuple:
    return (node.lineno, node.end_lineno, node.col_offset, node.end_col_offset)


class _Site:
    """Where a builder call was written: the call's span and, when the source is readable,
    the span of each positional and keyword argument."""

    def __init__(self, span: Span, args: tuple = (), kwargs: dict | None = None, items: dict | None = None):
        self.span = span
        self.args = args
        self.kwargs = kwargs or {}
        self.items = items or {}
        """Positional index or keyword -> spans of the elements of a list written there."""

    def item(self, key, i: int) -> Span:
        spans = self.items.get(key, ())
        return spans[i] if i < len(spans) else self.kwargs.get(key, self.span) if isinstance(key, str) \
            else self.arg(key)

    def arg(self, i: int) -> Span:
        return self.args[i] if i < len(self.args) else self.span

    def kw(self, key: str) -> Span:
        return self.kwargs.get(key, self.span)


def _site(texts: dict) -> _Site:
    """The site of the innermost call from outside this module; records its file's text in
    ``texts`` (path -> source) so diagnostics can quote the Python line."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == _THIS_FILE:
        frame = frame.f_back
    if frame is None:
        return _Site(Span.point("<python>", 1, 1))
    path = frame.f_code.co_filename
    lines = linecache.getlines(path, frame.f_globals)
    if lines and path not in texts:
        texts[path] = "".join(lines)
    pos = _positions(frame.f_code)
    i = frame.f_lasti // 2
    ext = pos[i] if 0 <= i < len(pos) else (None, None, None, None)
    if ext[0] is None or ext[2] is None:
        line = frame.f_lineno or 1
        return _Site(Span.point(path, line, 1, len(lines[line - 1].rstrip("\n")) if line <= len(lines) else 1))
    span = _span(path, lines, ext)
    found = _calls_in(path, texts[path]).get(tuple(ext)) if path in texts else None
    if not found:
        return _Site(span)
    args, kwargs, items = found
    return _Site(span, tuple(_span(path, lines, e) for e in args),
                 {k: _span(path, lines, e) for k, e in kwargs.items()},
                 {k: tuple(_span(path, lines, e) for e in v) for k, v in items.items()})


def _span(path: str, lines: list[str], ext: tuple) -> Span:
    line, end_line, col, end_col = ext
    return Span(path, line, _char_col(lines, line, col), end_line, _char_col(lines, end_line, end_col))


def _char_col(lines: list[str], line: int, byte_col: int) -> int:
    """1-based character column of a 0-based UTF-8 byte offset (Python reports bytes)."""
    if not 1 <= line <= len(lines):
        return byte_col + 1
    return len(lines[line - 1].encode("utf-8")[:byte_col].decode("utf-8", errors="replace")) + 1


# ---- names the language can spell -----------------------------------------------------------

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@functools.lru_cache(maxsize=4096)
def _spellable(name: str) -> bool:
    """Whether ``name`` reads back as a name in every place a flow writes one (binding,
    reference, call, keyword, parameter). Decided by the parser, so keywords such as
    ``true`` or ``repeat`` are rejected however the grammar evolves."""
    if not _NAME_RE.match(name):
        return False
    from flowrl.syntax.parser import parse

    try:
        module = parse(f"flow {name}({name}: {name}) {{ {name} = g({name}, {name} = 1)  {name}(x) }}",
                       "<name check>")
    except FlowError:
        return False
    flow = module.items[0]
    bind, stmt = flow.body
    return (flow.name == name and flow.params[0].name == name and flow.params[0].type == name
            and isinstance(bind, ast.Binding) and bind.name == name
            and isinstance(bind.value.args[0], ast.Name) and bind.value.args[0].id == name
            and bind.value.kwargs[0].name == name
            and isinstance(stmt, ast.CallStmt) and stmt.call.func == name)


def _check_name(name, what: str, dotted: bool = False) -> str:
    if not isinstance(name, str):
        raise BuilderError(f"{what} must be a str, got {type(name).__name__} {name!r}")
    parts = name.split(".") if dotted else [name]
    if not all(_spellable(p) for p in parts):
        raise BuilderError(f"{what} {name!r} is not a flowrl name; hint: names are letters, digits and `_`, "
                           f"start with a letter or `_`, and are not keywords such as `true` or `repeat`")
    return name


# ---- what the builder records: calls, by value, until they are written as an AST ----------------


@dataclass(frozen=True)
class _Ref:
    """A use of a value: a source name (``policy``), or ``#node:ID``, the value of recorded call
    ``ID`` itself (its name was re-bound, or it has none); the writer picks how text spells it."""

    target: str
    span: Span


@dataclass(frozen=True)
class _Loss:
    """A loss configuration ``ppo_clip(0.2, agg = "token-mean")`` (a keyword value, not an op)."""

    name: str
    args: tuple
    options: tuple  # ((name, value, span of `name=value`), ...), as written
    span: Span


@dataclass(frozen=True)
class _Op:
    """One recorded call: an op, a flow call, ``reward(x)``, or an alias ``x = value`` (op ``=``).

    Values (in ``args`` and ``kwargs``) are :class:`_Ref`, :class:`ast.Literal`, :class:`_Loss` or
    tuples of them (lists)."""

    id: str
    """Unique in the flow; the id the graph gives the node when the text keeps its name."""
    op: str
    args: tuple
    kwargs: tuple  # ((name, value, span of `name=value`), ...), as written
    span: Span
    region: str | None
    """The ``repeat`` loop the call is in (``repeatN``), None outside loops."""


@dataclass(frozen=True)
class _Loop:
    id: str
    count: object
    until: str | None
    span: Span
    parent: str | None


_TYPE_OF_KIND = {OpKind.MODEL: "model", OpKind.DATASET: "dataset", OpKind.REWARD_FN: "reward",
                 OpKind.ENV: "env", OpKind.CALL: None}
_VALUE_TYPES = ("model", "dataset", "reward", "env", "data")


class Value:
    """A handle on a value of one flow: a parameter, a declaration, an op's result or a
    ``bind``-ing. Pass it as an argument of ops; call it if it is a reward."""

    __slots__ = ("flow", "name", "node", "type", "span", "target")

    def __init__(self, flow: "Flow", *, name: str | None, node: str | None, type: str | None,
                 span: Span, target=None):
        self.flow = flow
        self.name = name
        """The source name this value is bound to, if any."""
        self.node = node
        """The recorded call that makes it (None for parameters, declarations, aliases); the id
        of its node in the graph."""
        self.type = type
        """model | dataset | reward | env | data, a scalar type, or None when unknown (flow calls)."""
        self.span = span
        self.target = target
        """Aliases (``bind``): the Value or the constant bound."""

    def __call__(self, *args, name: str | None = None, options: dict | None = None, **kwargs) -> "Value":
        """``reward(rollouts)``: sugar for ``score(reward, rollouts)``, as in text."""
        return self.flow._call_value(self, args, kwargs, name, options)

    def __repr__(self) -> str:
        what = self.type or "value"
        made = f" from {self.flow._ops[self.node].op}" if self.node else ""
        return f"<Value {self.name or self.node or '?'}: {what}{made} at {self.span}>"


class Loss:
    """A loss configuration such as ``ppo_clip(0.2)``: a keyword value, not a node."""

    __slots__ = ("flow", "config")

    def __init__(self, flow: "Flow", config: _Loss):
        self.flow = flow
        self.config = config

    def __repr__(self) -> str:
        return f"<Loss {self.config.name} at {self.config.span}>"


_SIZE_RE = re.compile(r"\d+(\.\d+)?(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)")


class Size:
    """A size literal (bytes) as the language writes it, e.g. ``size("512MB")``."""

    __slots__ = ("bytes", "text")

    def __init__(self, text: str):
        from flowrl.syntax.parser import _parse_size

        if not isinstance(text, str) or not _SIZE_RE.fullmatch(text):
            raise BuilderError(f"size {text!r} is not a size literal; hint: write e.g. size(\"512MB\") "
                               f"(units B KB MB GB TB KiB MiB GiB TiB)")
        self.bytes = _parse_size(text)
        self.text = text

    def __repr__(self) -> str:
        return f"size({self.text!r})"


def size(text: str) -> Size:
    """A size literal in bytes, written with a unit: ``size("512MB")`` is 512 * 10**6 bytes."""
    return Size(text)


class Ctor:
    """A constructor call written as a constant: a parameter default, a declaration's
    argument or a schedule's engine, e.g. ``ctor("tiny", task="arith")`` for ``tiny(task = "arith")``."""

    __slots__ = ("op", "args", "kwargs", "site", "texts")

    def __init__(self, op: str, args: tuple, kwargs: dict):
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.texts: dict[str, str] = {}
        """The Python source it was written in (joins the flow's, for diagnostics)."""
        self.site = _site(self.texts)


def ctor(op: str, *args, **kwargs) -> Ctor:
    """A constructor call as a constant: ``("policy", "model", ctor("tiny"))``."""
    _check_name(op, "constructor", dotted=True)
    return Ctor(op, args, kwargs)


class Params(tuple):
    """The parameter handles of a flow, in order; also by name: ``f.params.group``."""

    def __getattr__(self, name: str) -> Value:
        for v in self:
            if v.name == name:
                return v
        hint = did_you_mean(name, [v.name for v in self])
        raise AttributeError(f"the flow has no parameter `{name}`" + (f"; {hint}" if hint else ""))


class _Imported:
    """``lib = f.import_("stdlib.grpo", alias="g")``; ``lib.grpo(...)`` calls ``g.grpo``."""

    def __init__(self, flow: "Flow", alias: str | None):
        self._flow = flow
        self._prefix = f"{alias}." if alias else ""

    def __getattr__(self, flow_name: str):
        if flow_name.startswith("_"):
            raise AttributeError(flow_name)
        flow, qualified = self._flow, self._prefix + _check_name(flow_name, "flow name")

        def call(*args, name: str | None = None, options: dict | None = None, **kwargs) -> Value:
            return flow._emit(qualified, args, kwargs, name, options, flow_call=True)

        call.__name__ = flow_name
        call.__doc__ = f"Call the imported flow `{qualified}` (inlined by the compiler)."
        return call


class _Repeat:
    """The context manager of ``with f.repeat(count, until=...)``: its calls form one loop."""

    def __init__(self, flow: "Flow", count, until: str | None, site: "_Site"):
        self.flow, self.count, self.until, self.site = flow, count, until, site
        self.saved = None

    def __enter__(self) -> "_Repeat":
        if self.saved is not None:
            raise BuilderError("this repeat block was already entered; write `with f.repeat(...)` again")
        f = self.flow
        f._n_regions += 1
        rid = f"repeat{f._n_regions}"
        f._loops[rid] = _Loop(rid, self.count, self.until, self.site.span, parent=f._region)
        body: list = []
        f._block.append(("repeat", rid, body))
        self.saved = (f._block, f._region)
        f._block, f._region = body, rid
        return self

    def __exit__(self, *exc) -> None:
        self.flow._block, self.flow._region = self.saved
        return None


# ---- the builder -------------------------------------------------------------------------------


class Flow:
    """A flow built in Python. Every built-in op of :data:`flowrl.catalog.ops.OPS` is a method
    (``f.generate(...)``), every loss of :data:`~flowrl.catalog.ops.LOSSES` too (``f.ppo_clip(0.2)``).

    ``params``: ``(name, type)`` or ``(name, type, default)``; a default is a constant
    (int, float, str, bool, list, :func:`size`) or a :func:`ctor` such as ``ctor("tiny")``.
    ``imports``: targets as for :meth:`import_` (``"stdlib.grpo"``, ``"lib.flow"``), or
    ``(target, alias)`` pairs.
    """

    def __init__(self, name: str, params=(), *, imports=()):
        self._texts: dict[str, str] = {}
        site = _site(self._texts)
        self.name = _check_name(name, "flow name")
        self.span = site.span
        where = "params" if "params" in site.kwargs else 1  # Flow(name, params=[...]) or Flow(name, [...])
        self._params = tuple(self._param(p, site.item(where, i)) for i, p in enumerate(params))
        self._ops: dict[str, _Op] = {}
        """Recorded calls by id, in call order."""
        self._bindings: dict[str, str] = {}
        """Call id -> the name the user bound it to (``name=``, ``bind``)."""
        self._loops: dict[str, _Loop] = {}
        self._scope: dict[str, Value] = {}
        self._events: list = []
        self._block = self._events
        self._region: str | None = None
        self._n_regions = 0
        self._imports: list[ast.Import] = []
        self._decls: list[ast.Decl] = []
        self._schedules: list[Schedule] = []
        self._callees: dict[str, Flow] = {}
        values = []
        for p in self._params:
            if p.name in self._scope:
                raise BuilderError(f"flow `{name}` has two parameters named `{p.name}`")
            v = Value(self, name=p.name, node=None, type=p.type, span=p.span)
            self._scope[p.name] = v
            values.append(v)
        self.params = Params(values)
        """Parameter handles, in order (also by name: ``f.params.group``)."""
        for imp in imports:
            target, alias = (imp, None) if isinstance(imp, str) else tuple(imp)
            self._import(target, alias, site)

    def _param(self, p, span: Span) -> ast.Param:
        if isinstance(p, str) or not isinstance(p, (tuple, list)) or len(p) not in (2, 3):
            raise BuilderError(f"a parameter is (name, type) or (name, type, default), got {p!r}; "
                               f"hint: params=[(\"policy\", \"model\"), (\"group\", \"int\", 8)]")
        name = _check_name(p[0], "parameter name")
        typ = _check_name(p[1], f"type of parameter `{name}`")
        default = _const_expr(p[2], span, f"default of parameter `{name}`", self) if len(p) == 3 else None
        return ast.Param(name, typ, default, span)

    def param(self, name: str) -> Value:
        """The handle of parameter ``name``."""
        return getattr(self.params, name)

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        known = list(OPS) + list(LOSSES) + [a for a in dir(type(self)) if not a.startswith("_")]
        hint = did_you_mean(attr, known)
        raise AttributeError(f"Flow has no op or method `{attr}`" + (f"; {hint}" if hint else "")
                             + "; hint: call a flow with f.call_flow(\"NAME\", ...), any op by name with "
                               "f.op(\"NAME\", ...)")

    def __repr__(self) -> str:
        return f"<Flow {self.name} ({len(self._ops)} calls) at {self.span}>"

    # ---- ops ---------------------------------------------------------------------------------
    def op(self, op: str, *args, name: str | None = None, options: dict | None = None, **kwargs) -> Value:
        """Call an op or a flow by name: ``f.op("generate", policy, batch, n=4)``. Unknown names
        become flow calls, which the compiler resolves (or reports, with a suggestion).
        ``options`` passes keyword options whose names Python reserves (``name``, ``lambda``)."""
        _check_name(op, "op name", dotted=True)
        return self._emit(op, args, kwargs, name, options)

    def call_flow(self, flow, *args, name: str | None = None, options: dict | None = None,
                  **kwargs) -> Value:
        """Call another flow, inlined by the compiler: ``flow`` is the name of a flow visible
        here (imported: ``"grpo"``, ``"g.grpo"``) or another :class:`Flow`."""
        if isinstance(flow, Flow):
            if flow is not self:
                seen = self._callees.get(flow.name)
                if seen is not None and seen is not flow:
                    raise BuilderError(f"two different flows named `{flow.name}` are called from `{self.name}`; "
                                       f"rename one of them")
                self._callees[flow.name] = flow
            target = flow.name
        else:
            target = _check_name(flow, "flow name", dotted=True)
            if target in OPS or target in LOSSES:
                raise BuilderError(f"`{target}` is a built-in op, not a flow; hint: call f.{target}(...)")
        return self._emit(target, args, kwargs, name, options, flow_call=True)

    def loss(self, loss: str, *args, **options) -> "Loss | Value":
        """A loss configuration for ``update(..., loss=...)``: ``f.loss("ppo_clip", 0.2, agg="seq-mean-token-sum")``.

        An unknown loss name is kept as the text would keep it (a call), so the compiler
        reports it with a suggestion."""
        _check_name(loss, "loss name")
        if loss not in LOSSES:
            return self._emit(loss, args, options, None, None)
        site = _site(self._texts)
        opts = tuple((_check_name(k, "loss option"), self._value(v, site.kw(k), f"option `{k}` of {loss}"),
                      site.kw(k)) for k, v in options.items())
        args = tuple(self._value(a, site.arg(i), f"argument {i + 1} of {loss}") for i, a in enumerate(args))
        return Loss(self, _Loss(loss, args, opts, site.span))

    def bind(self, name: str, value) -> Value:
        """``name = value`` for a value that is not an op call: another handle, a constant or a
        loss. Re-binding a name inside a ``repeat`` loop carries it to the next turn."""
        site = _site(self._texts)
        _check_name(name, "binding name")
        ir = self._value(value, site.arg(1), f"the value bound to `{name}`")
        op = _Op(self._fresh_id(name), "=", (ir,), (), site.span, self._region)
        self._record(op)
        self._bindings[op.id] = name
        vtype = value.type if isinstance(value, Value) else ir.kind if isinstance(ir, ast.Literal) else None
        target = value if isinstance(value, Value) else ir
        v = Value(self, name=name, node=None, type=vtype, span=site.span, target=target)
        self._scope[name] = v
        return v

    def import_(self, target: str, alias: str | None = None) -> _Imported:
        """``import stdlib.grpo [as alias]`` or ``import "path/file.flow" [as alias]`` (a path
        ends in ``.flow``; relative to the Python file). Returns a handle whose attributes call
        the imported flows: ``g = f.import_("stdlib.grpo", "g"); g.grpo(policy, ...)``."""
        return self._import(target, alias, _site(self._texts))

    def _import(self, target: str, alias: str | None, site: "_Site") -> _Imported:
        if not isinstance(target, str):
            raise BuilderError(f"an import target is a str such as \"stdlib.grpo\", got {target!r}")
        is_path = target.endswith(".flow")
        if not is_path:
            _check_name(target, "import target", dotted=True)
        if alias is not None:
            _check_name(alias, "import alias")
        self._imports.append(ast.Import(target, is_path, alias, site.span))
        return _Imported(self, alias)

    def declare(self, kind: str, name: str, op: str, *args, **kwargs) -> Value:
        """A declaration ``KIND NAME = OP(...)`` of this flow's file, e.g.
        ``policy = f.declare("model", "policy", "tiny", task="arith")``. Relative paths in it
        are resolved against the folder of the Python file, as a ``.flow`` file's against its own."""
        site = _site(self._texts)
        _check_name(kind, "declaration kind")
        _check_name(name, "declaration name")
        _check_name(op, "constructor", dotted=True)
        call = _ctor_call(op, args, kwargs, site, self)
        self._decls.append(ast.Decl(kind, name, call, site.span, site.span, site.span))
        v = Value(self, name=name, node=None, type=kind if kind in DECL_KINDS else None, span=site.span)
        self._scope.setdefault(name, v)  # a parameter of the same name shadows it, as in text
        return v

    def repeat(self, count, until: str | None = None) -> _Repeat:
        """``with f.repeat(max_turns, until="done"): ...``: the ops inside run up to ``count``
        turns per step, stopping early when the field ``until`` is true for every sample."""
        site = _site(self._texts)
        ir = self._value(count, site.arg(0), "the turn count of repeat")
        if until is not None:
            _check_name(until, "`until` field")
        return _Repeat(self, ir, until, site)

    def returns(self, value) -> None:
        """``return value``: what a call of this flow evaluates to (the value handed in, even
        if its name is re-bound afterwards; text resolves ``return x`` after the body)."""
        site = _site(self._texts)
        self._value(value, site.arg(0), "the returned value")  # Python misuse fails here, not later
        self._block.append(("return", value, site.span, site.arg(0)))

    def schedule(self, cluster: "Ctor | None" = None, *, auto: bool = False, **cluster_options) -> "Schedule":
        """``schedule NAME on cluster(...) { ... }`` (``auto=True``: ``schedule NAME auto [on ...]``).

        The cluster is ``cluster_options`` (``nodes=1, gpus_per_node=8, gpu="H100"``) or a
        :func:`ctor`; returns a :class:`Schedule` whose methods add its statements."""
        site = _site(self._texts)
        if cluster is not None and cluster_options:
            raise BuilderError("schedule(): give the cluster as ctor(\"cluster\", ...) or as keyword options, "
                               "not both")
        if cluster is not None:
            if not isinstance(cluster, Ctor):
                raise BuilderError(f"schedule(): the cluster is a ctor(\"cluster\", ...), got {cluster!r}")
            call = _ctor_call(cluster.op, cluster.args, cluster.kwargs, cluster.site, self, names=False)
            self._texts.update(cluster.texts)
        elif cluster_options or not auto:
            call = _ctor_call("cluster", (), cluster_options, site, self, names=False)
        else:
            call = None
        s = Schedule(self, bool(auto), call, site.span)
        self._schedules.append(s)
        return s

    # ---- results -----------------------------------------------------------------------------
    def to_module(self) -> ast.Module:
        """The program as an AST module (spans at the Python lines): imports, declarations, the
        builder flows it calls, this flow and its schedule; what :meth:`compile` compiles."""
        return self._module()

    def graph(self):
        """The raw FlowGraph of this flow (before any pass), built from :meth:`to_module` by
        :func:`flowrl.ir.build.build_flow`, as for a ``.flow`` file."""
        from flowrl.compiler.pipeline import entry_flow
        from flowrl.ir.build import build_flow

        module = self._module()
        return build_flow(entry_flow(module, self.name), module, self._source_map())

    def compiled(self, until: str | None = None, lint_each: bool = False, options: dict | None = None,
                 dump_after: tuple[str, ...] = ()):
        """:func:`~flowrl.compiler.pipeline.compile_module` of :meth:`to_module` (a ``Compiled``:
        the graph and the dumps asked for); raises FlowError with spans at the Python lines."""
        from flowrl.compiler.pipeline import compile_module
        from flowrl.compiler.unit import Unit

        module = self._module()
        unit = Unit(self._source_map())
        unit.modules[module.path] = module
        return compile_module(module, unit, self.name, until=until, lint_each=lint_each,
                              dump_after=dump_after, options=dict(options or {}))

    def compile(self, until: str | None = None, lint_each: bool = False, options: dict | None = None):
        """The compiled FlowGraph (``flowrl check``): every pass up to ``until`` (all by default)."""
        return self.compiled(until, lint_each, options).graph

    def check(self) -> list:
        """Compile like ``flowrl check``: the warnings (Diagnostics); FlowError on errors."""
        return list(self.compile().warnings)

    def plan(self, *, steps: int | None = None, save_every: int | None = None, run: dict | None = None,
             options: dict | None = None):
        """The :class:`~flowrl.plan.ExecutionPlan` ``flowrl plan`` makes of this flow (the same
        lowering; warnings are printed to stderr, errors raise FlowError). ``steps``,
        ``save_every``, ``run``: run settings, as :func:`flowrl.launch.build_plan` takes them."""
        from flowrl.launch import lower_compiled

        return lower_compiled(self.compile(options=options), steps=steps, save_every=save_every, run=run)

    def run(self, out: str | Path | None = None, *, steps: int | None = None, save_every: int | None = None,
            overwrite: bool = False, log: str | None = None, log_samples: int | None = None,
            ray_address: str | None = None, stream=None):
        """``flowrl run`` of this flow: plan it, then run the plan into ``out`` (default
        ``runs/<flow>-<time>``) through :func:`flowrl.launch.run_built`. Returns the driver's result."""
        from flowrl.launch import default_out, loggers_setting, run_built

        settings = {}
        if log is not None:
            settings["log"] = loggers_setting(log)
        if log_samples is not None:
            settings["log_samples"] = log_samples
        plan = self.plan(steps=steps, save_every=save_every, run=settings)
        out_dir = Path(out) if out is not None else default_out(f"{self.name}.flow")
        return run_built(plan, out_dir, overwrite=overwrite, ray_address=ray_address, stream=stream)

    def to_flow_text(self) -> str:
        """The program as canonical ``.flow`` text; it parses and compiles to the same IR.

        Unnamed values are written as nested calls where that keeps the order of the ops,
        otherwise bound to their op name (so node ids stay the same); a handle whose name
        was re-bound is reached through a generated alias (``x_1 = x``), which adds no node.
        One case changes a node id: an unnamed value used more than once whose op name the
        flow also looks up later (``scores = reward(x)`` without ``name=``, used twice, with
        ``reward`` called again afterwards) is bound to a fresh ``reward_1``; pass ``name=``.
        """
        from flowrl.syntax.fmt import format_module

        return format_module(_respan(self._module()))

    # ---- internals ---------------------------------------------------------------------------
    def _source_map(self) -> SourceMap:
        sources = SourceMap()
        texts: dict[str, str] = {}
        for f in [self, *self._all_callees()]:
            texts.update(f._texts)
        for path, text in texts.items():
            sources.add(path, text)
        return sources

    def _fresh_id(self, base: str) -> str:
        """``base``, else ``base#2``, ``base#3``...: the ids the graph gives nodes (FlowGraph.fresh_id)."""
        if base not in self._ops:
            return base
        for i in itertools.count(2):
            if f"{base}#{i}" not in self._ops:
                return f"{base}#{i}"
        raise AssertionError("unreachable")

    def _record(self, op: _Op) -> None:
        self._ops[op.id] = op
        self._block.append(("node", op.id))

    def _emit(self, op: str, args: tuple, kwargs: dict, name: str | None, options: dict | None,
              flow_call: bool = False) -> Value:
        site = _site(self._texts)
        if options:
            clash = sorted(set(options) & set(kwargs))
            if clash:
                raise BuilderError(f"{op}(): option `{clash[0]}` given both as a keyword and in options=")
            kwargs = {**kwargs, **options}
        if name is not None:
            _check_name(name, "name=")
        spec = None if flow_call else OPS.get(op)
        if spec is not None:
            _check_positional(op, spec, args)
        ir_args = tuple(self._value(a, site.arg(i), f"{op}(): argument {i + 1}") for i, a in enumerate(args))
        ir_kwargs = tuple((_check_name(k, f"{op}(): option name"), self._value(v, site.kw(k), f"{op}(): option `{k}`"),
                           site.kw(k)) for k, v in kwargs.items())
        rec = _Op(self._fresh_id(name or op.rsplit(".", 1)[-1]), op, ir_args, ir_kwargs, site.span, self._region)
        self._record(rec)
        rtype = _TYPE_OF_KIND.get(spec.kind, "data") if spec is not None else None
        if spec is None and op in self._scope and self._scope[op].type == "reward":
            rtype = "data"  # reward sugar: the scores
        v = Value(self, name=name, node=rec.id, type=rtype, span=site.span)
        if name is not None:
            self._bindings[rec.id] = name
            self._scope[name] = v
        return v

    def _call_value(self, v: Value, args: tuple, kwargs: dict, name, options) -> Value:
        self._own(v, "the called value")
        if v.type not in (None, "reward"):
            raise BuilderError(f"{v!r} is a {v.type}; only a reward can be called (`reward(rollouts)` means "
                               f"score(reward, rollouts))")
        if v.name is not None and self._scope.get(v.name) is v and v.name not in OPS:
            return self._emit(v.name, args, kwargs, name, options, flow_call=True)  # `reward(x)`, as in text
        if v.type == "reward":
            return self._emit("score", (v, *args), kwargs, name, options)
        raise BuilderError(f"{v!r} is not known to be a reward and has no name to call it by; only a reward "
                           f"can be called (`reward(rollouts)` means score(reward, rollouts))")

    def _own(self, v, what: str) -> None:
        if v.flow is not self:
            raise BuilderError(f"{what}: {v!r} belongs to flow `{v.flow.name}`, not `{self.name}`; hint: pass "
                               f"values between flows as arguments of call_flow")

    def _value(self, x, span: Span, what: str):
        """A Python argument as a recorded value (_Ref, ast.Literal, _Loss or a tuple of them)."""
        if isinstance(x, Value):
            self._own(x, what)
            return self._ref(x, span, what)
        if isinstance(x, Loss):
            self._own(x, what)
            return x.config
        if isinstance(x, (list, tuple)):
            return tuple(self._value(i, span, what) for i in x)
        return _const(x, span, what)

    def _ref(self, v: Value, span: Span, what: str):
        if v.name is not None and self._scope.get(v.name) is v:
            return _Ref(v.name, span)
        if isinstance(v.target, Value):
            return self._ref(v.target, span, what)
        if v.target is not None:
            return v.target  # a re-bound constant alias: its value
        if v.node is not None:
            return _Ref(f"#node:{v.node}", span)  # the name was re-bound: refer to the call itself
        raise BuilderError(f"{what}: `{v.name}` was re-bound since, so the {v.type} it named can no longer "
                           f"be referenced; hint: give the new value another name=")

    def _final_events(self, events=None) -> list:
        """The statement events with each ``return`` value recorded as it stands after the
        whole body (by name while the name is still its own, else by call)."""
        out = []
        for ev in self._events if events is None else events:
            if ev[0] == "return":
                out.append(("return", self._value(ev[1], ev[3], "the returned value"), ev[2]))
            elif ev[0] == "repeat":
                out.append(("repeat", ev[1], self._final_events(ev[2])))
            else:
                out.append(ev)
        return out

    def _all_callees(self) -> list["Flow"]:
        """Builder flows this flow calls, directly or not, callees before callers."""
        out: list[Flow] = []

        def visit(f: Flow, path: tuple) -> None:
            for c in f._callees.values():
                if c in path or c in out:
                    continue
                visit(c, path + (c,))
                out.append(c)

        visit(self, (self,))
        names: dict[str, Flow] = {}
        for c in out:
            if names.setdefault(c.name, c) is not c:
                raise BuilderError(f"two different builder flows are named `{c.name}`; rename one of them")
        return [c for c in out if c.name != self.name]

    def _module(self) -> ast.Module:
        callees = self._all_callees()
        for c in callees:
            if c._decls or c._schedules:
                what = f"declares `{c._decls[0].name}`" if c._decls else "has a schedule"
                raise BuilderError(f"flow `{c.name}` is called from `{self.name}` but {what}; hint: declare "
                                   f"resources and the schedule in the calling flow and pass them as arguments")
        imports, seen = [], set()
        for f in [*callees, self]:
            for imp in f._imports:
                key = (imp.target, imp.is_path, imp.alias)
                if key not in seen:
                    seen.add(key)
                    imports.append(imp)
        flows = [_Writer(f).flow_def() for f in [*callees, self]]
        schedules = [s._def() for s in self._schedules]
        return ast.Module(self.span.path, tuple(imports) + tuple(self._decls) + tuple(flows) + tuple(schedules),
                          (), self.span)


class Schedule:
    """The schedule of a flow (``schedule NAME on cluster(...) { ... }``), made by
    :meth:`Flow.schedule`; each method adds one statement, in order. Targets are written as
    in text: ``"policy.train"``, ``"policy.rollout"``, ``"ref"``."""

    def __init__(self, flow: Flow, auto: bool, cluster: ast.Call | None, span: Span):
        self.flow, self.auto, self.cluster, self.span = flow, auto, cluster, span
        self._body: list = []

    def __repr__(self) -> str:
        return f"<Schedule of {self.flow.name}{' auto' if self.auto else ''} ({len(self._body)} statements)>"

    def colocate(self, *targets: str, on: str | None = None) -> "Schedule":
        """``colocate policy.train, policy.rollout, ref [on POOL]``: share GPUs (``on="all"``: every GPU)."""
        site = _site(self.flow._texts)
        self._body.append(ast.Colocate(self._targets(targets, site), _pool_name(on, "colocate()"), site.span))
        return self

    def place(self, *targets: str, on: str) -> "Schedule":
        """``place policy.rollout on POOL``."""
        site = _site(self.flow._texts)
        self._body.append(ast.Place(self._targets(targets, site), _pool_name(on, "place()"), site.span))
        return self

    def pool(self, name: str, kind: str = "gpus", **options) -> "Schedule":
        """``pool NAME = KIND(options)``, e.g. ``s.pool("gen", gpus=4)`` for ``pool gen = gpus(gpus = 4)``."""
        site = _site(self.flow._texts)
        _check_name(name, "pool name")
        _check_name(kind, "pool kind")
        call = _ctor_call(kind, (), options, site, self.flow, names=False)
        self._body.append(ast.Pool(name, call, site.span))
        return self

    def layout(self, target: str, engine: str, **options) -> "Schedule":
        """``TARGET = ENGINE(options)``, e.g. ``s.layout("policy.train", "megatron", tp=2, dp=4)``."""
        site = _site(self.flow._texts)
        _check_name(engine, "engine name")
        (t,) = self._targets((target,), site)
        self._body.append(ast.Layout(t, _ctor_call(engine, (), options, site, self.flow, names=False), site.span))
        return self

    def staleness(self, value: int, *, at_most: bool = False) -> "Schedule":
        """``staleness N`` (``at_most=True``: ``staleness <= N``, a bound for ``auto``)."""
        site = _site(self.flow._texts)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise BuilderError(f"staleness(): the staleness is an int, got {value!r}")
        self._body.append(ast.Staleness(int(value), bool(at_most), site.span))
        return self

    def resync(self, model: str, protocol: str, *, every: int | None = None, **options) -> "Schedule":
        """``resync MODEL via PROTOCOL(options) [every N]``, e.g. ``s.resync("policy", "nccl",
        bucket=size("512MB"), every=1)``."""
        site = _site(self.flow._texts)
        _check_name(model, "resync model")
        _check_name(protocol, "protocol name")
        if every is not None and (isinstance(every, bool) or not isinstance(every, numbers.Integral)):
            raise BuilderError(f"resync(): every is an int, got {every!r}")
        call = _ctor_call(protocol, (), options, site, self.flow, names=False)
        self._body.append(ast.Resync(model, call, None if every is None else int(every), site.span))
        return self

    def call(self, op: str, *args, **options) -> "Schedule":
        """A call statement of a schedule, e.g. ``s.call("partial_rollout", over_provision=1.5)``."""
        site = _site(self.flow._texts)
        _check_name(op, "schedule call")
        self._body.append(ast.SchedCall(_ctor_call(op, args, options, site, self.flow, names=False), site.span))
        return self

    def partial_rollout(self, **options) -> "Schedule":
        """``partial_rollout(over_provision = 1.25, recycle = true)``: APRIL-style partial rollouts."""
        site = _site(self.flow._texts)
        self._body.append(ast.SchedCall(_ctor_call("partial_rollout", (), options, site, self.flow, names=False),
                                        site.span))
        return self

    def _targets(self, targets, site: "_Site") -> tuple:
        if not targets:
            raise BuilderError("name at least one target, e.g. \"policy.train\"")
        out = []
        for i, t in enumerate(targets):
            _check_name(t, "schedule target", dotted=True)
            parts = t.split(".")
            if len(parts) > 2:
                raise BuilderError(f"schedule target {t!r}: write MODEL or MODEL.ROLE, e.g. \"policy.train\"")
            out.append(ast.Target(parts[0], parts[1] if len(parts) == 2 else None, site.arg(i)))
        return tuple(out)

    def _def(self) -> ast.ScheduleDef:
        return ast.ScheduleDef(self.flow.name, self.auto, self.cluster, tuple(self._body), self.span, self.span)


def _pool_name(on, what: str) -> str | None:
    if on is None:
        return None
    return _check_name(on, f"{what}: on=")


def _check_positional(op: str, spec: OpSpec, args: tuple) -> None:
    for i, a in enumerate(args[: len(spec.args)]):
        aspec = spec.args[i]
        if aspec.type in _VALUE_TYPES and not isinstance(a, Value):
            raise BuilderError(f"{op}(): argument {i + 1} (`{aspec.name}`) needs a {aspec.type} value (a flow "
                               f"parameter or the result of an op), got {type(a).__name__} {a!r}")


# ---- constants as AST literals ----------------------------------------------------------------


def _const(x, span: Span, what: str):
    """A Python constant as an ``ast.Literal`` (a list: a tuple of them)."""
    from flowrl.syntax.fmt import quote_string

    if isinstance(x, Size):
        return ast.Literal(x.bytes, "size", x.text, span)
    if isinstance(x, bool):
        return ast.Literal(x, "bool", "true" if x else "false", span)
    if isinstance(x, numbers.Integral):
        return ast.Literal(int(x), "int", str(int(x)), span)
    if isinstance(x, numbers.Real):
        if not math.isfinite(float(x)):
            raise BuilderError(f"{what}: {x!r} cannot be written in a flow; hint: use a finite number")
        return ast.Literal(float(x), "float", _float_text(float(x)), span)
    if isinstance(x, str):
        return ast.Literal(x, "str", quote_string(x), span)
    if isinstance(x, (list, tuple)):
        return tuple(_const(i, span, what) for i in x)
    raise BuilderError(f"{what}: cannot use {type(x).__name__} {x!r} in a flow; hint: pass a Value (a parameter "
                       f"or an op's result), a number, a str, a bool, a list, size(\"512MB\") or a loss")


def _float_text(x: float) -> str:
    """The shortest text of ``x`` that reads back as ``x``, exponent unpadded (``1e-6``, not ``1e-06``)."""
    text = repr(x)
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


def _const_expr(x, span: Span, what: str, flow: "Flow") -> ast.Expr:
    """A parameter default: a constant or a ctor(...) (which may not name declarations)."""
    if isinstance(x, Ctor):
        flow._texts.update(x.texts)
        return _ctor_call(x.op, x.args, x.kwargs, x.site, flow, names=False)
    return _literal_expr(_const(x, span, what), span)


def _literal_expr(v, span: Span) -> ast.Expr:
    return ast.ListExpr(tuple(_literal_expr(i, span) for i in v), span) if isinstance(v, tuple) else v


def _ctor_call(op: str, args: tuple, kwargs: dict, site: "_Site", flow: "Flow", names: bool = True) -> ast.Call:
    """A constructor call as AST: constants, nested ctor(...) and (with ``names``) handles of
    declarations of ``flow`` as arguments."""
    def one(x, span, what):
        if isinstance(x, Ctor):
            flow._texts.update(x.texts)
            return _ctor_call(x.op, x.args, x.kwargs, x.site, flow, names)
        if isinstance(x, Value):
            if not names or x.flow is not flow or x.node is not None or x.target is not None:
                raise BuilderError(f"{what}: a constructor takes constants, ctor(...) calls and declared names, "
                                   f"got {x!r}")
            return ast.Name(x.name, span)
        return _literal_expr(_const(x, span, what), span)

    pos = tuple(one(a, site.arg(i), f"{op}(): argument {i + 1}") for i, a in enumerate(args))
    kws = tuple(ast.KwArg(_check_name(k, f"{op}(): option name"), one(v, site.kw(k), f"{op}(): option `{k}`"),
                          site.kw(k)) for k, v in kwargs.items())
    return ast.Call(op, pos, kws, site.span, site.span)


# ---- writing a builder flow as an AST ----------------------------------------------------------


def _refs(v):
    """The _Refs inside a recorded value, in the order the parser hoists nested calls
    (list items in order; a loss's options before its positional arguments, as ir.build does)."""
    if isinstance(v, _Ref):
        yield v
    elif isinstance(v, tuple):
        for i in v:
            yield from _refs(i)
    elif isinstance(v, _Loss):
        for _, x, _ in v.options:
            yield from _refs(x)
        for a in v.args:
            yield from _refs(a)


def _op_refs(op: _Op):
    for a in op.args:
        yield from _refs(a)
    for _, v, _ in op.kwargs:
        yield from _refs(v)


def _node_target(ref: _Ref) -> str | None:
    return ref.target[6:] if ref.target.startswith("#node:") else None


class _Writer:
    """Writes one builder flow as an ``ast.FlowDef`` meaning what the Python calls meant.

    1. *Nesting*: an unnamed value used once, in the same loop, is written inside its
       consumer (``generate(frozen(policy), b)``) when the parser's hoisting order then
       keeps the order of the Python calls; otherwise it is un-nested (checked by
       re-deriving the order until it matches; each round un-nests one call).
    2. *Naming*: an unnamed value that is used but not nested is bound to its op name
       (``frozen = frozen(policy)``: the node id is the same as a nested call's), unless the
       flow looks that name up later (a parameter or binding of that name used after it),
       then to a fresh ``op_N`` (the one case where the text changes a node id).
    3. *Aliases*: a reference to a call whose name is re-bound at that point (or whose
       name would make a spurious loop-carried edge) goes through ``name_N = name``,
       written right after the call; aliases add no node to the compiled graph.
    """

    def __init__(self, flow: Flow):
        self.flow = flow
        self.events = flow._final_events()
        self.nodes = flow._ops
        self.bindings = dict(flow._bindings)
        self.uses: dict[str, list] = {}
        self._collect_uses(self.events, None)
        self.order = [nid for nid in self._walk_nodes(self.events)]
        self.nested = self._plan_nesting()
        self.names = self._names()
        self.bound_in_region: dict[str | None, set] = {}
        for nid, name in self.names.items():
            self.bound_in_region.setdefault(self.nodes[nid].region, set()).add(name)
        self.final = {self.names[nid]: nid for nid in self.order if nid in self.names}
        """name -> the call it is bound to after the whole body (what `return` resolves against)."""
        self.aliases: dict[str, str] = {}
        self.need_alias: set[str] = set()

    # -- analysis
    def _collect_uses(self, events, region) -> None:
        for ev in events:
            if ev[0] == "node":
                node = self.nodes[ev[1]]
                for r in _op_refs(node):
                    self._use(r, (node.id, node.region, node.op == "="))
            elif ev[0] == "return":
                for r in _refs(ev[1]):
                    self._use(r, (None, region, False))
            else:
                for r in _refs(self.flow._loops[ev[1]].count):
                    self._use(r, (None, region, False))
                self._collect_uses(ev[2], ev[1])

    def _use(self, ref: _Ref, consumer) -> None:
        x = _node_target(ref)
        if x is not None:
            self.uses.setdefault(x, []).append(consumer)

    def _walk_nodes(self, events):
        for ev in events:
            if ev[0] == "node":
                yield ev[1]
            elif ev[0] == "repeat":
                yield from self._walk_nodes(ev[2])

    def _plan_nesting(self) -> set[str]:
        nested = set()
        for x, uses in self.uses.items():
            node = self.nodes[x]
            if (len(uses) == 1 and x not in self.bindings and node.op != "="
                    and not uses[0][2] and uses[0][1] == node.region):
                nested.add(x)
        for _ in range(len(nested) + 1):
            implied = self._implied_order(nested)
            if implied == self.order:
                break
            k = next((i for i, (a, b) in enumerate(zip(self.order, implied)) if a != b), None)
            if k is None:
                raise AssertionError("nesting changed the number of ops")  # each nested call has one consumer
            a, b = self.order[k], implied[k]
            nested.discard(a if a in nested else b)
        return nested

    def _implied_order(self, nested: set[str]) -> list[str]:
        """The call order the parser would produce if ``nested`` were written nested."""
        out: list[str] = []

        def value(v) -> None:
            for r in _refs(v):
                x = _node_target(r)
                if x in nested:
                    node_(x)

        def node_(nid: str) -> None:
            n = self.nodes[nid]
            for a in n.args:
                value(a)
            for _, v, _ in n.kwargs:
                value(v)
            out.append(nid)

        def block(events) -> None:
            for ev in events:
                if ev[0] == "node":
                    if ev[1] not in nested:
                        node_(ev[1])
                elif ev[0] == "return":
                    value(ev[1])
                else:
                    value(self.flow._loops[ev[1]].count)
                    block(ev[2])

        block(self.events)
        return out

    def _names(self) -> dict[str, str]:
        """call id -> the name its statement binds (the user's, or one generated here)."""
        pos = {nid: i for i, nid in enumerate(self.order)}
        self.source_uses: dict[str, list] = {}  # name -> [(position, region)] of uses by name
        for n in self.nodes.values():
            used = {r.target for r in _op_refs(n) if _node_target(r) is None}
            if n.op != "=" and n.op not in OPS and n.op not in LOSSES:
                used.add(n.op)  # `reward(x)` and flow calls look their name up too
            for name in used:
                self.source_uses.setdefault(name, []).append((pos[n.id], n.region))
        for value in self._return_and_count_values(self.events):
            for r in _refs(value):
                if _node_target(r) is None:  # returns resolve after every op: always "later"
                    self.source_uses.setdefault(r.target, []).append((len(self.order), None))
        self.rebinds: dict[str, list] = {}  # name -> positions of the user's bindings of it
        for nid, name in self.bindings.items():
            self.rebinds.setdefault(name, []).append(pos[nid])
        taken = set(self.bindings.values()) | {p.name for p in self.flow._params} \
            | {d.name for d in self.flow._decls} | set(self.source_uses)
        names = dict(self.bindings)
        self.taken = set(taken)
        for nid in self.order:
            if nid in names or nid in self.nested or not self.uses.get(nid):
                continue
            base = nid.split("#")[0]
            ok = _spellable(base) and (base not in taken or self._may_shadow(base, pos[nid], self.nodes[nid].region))
            names[nid] = base if ok else self._fresh(base)
            self.taken.add(names[nid])
        return names

    def _may_shadow(self, name: str, at: int, region: str | None) -> bool:
        """Whether binding ``name`` at position ``at`` changes no lookup of ``name`` by source:
        nothing uses the name after it until the user binds the name again, and (in a loop)
        nothing in the loop uses it, where the binding would make a use loop-carried. Calls
        reached through ``#node`` references stay reachable: the writer aliases them."""
        until = min((p for p in self.rebinds.get(name, ()) if p > at), default=len(self.order) + 1)
        return not any(at < p <= until or (region is not None and r == region)
                       for p, r in self.source_uses.get(name, ()))

    def _return_and_count_values(self, events):
        for ev in events:
            if ev[0] == "return":
                yield ev[1]
            elif ev[0] == "repeat":
                yield self.flow._loops[ev[1]].count
                yield from self._return_and_count_values(ev[2])

    def _fresh(self, base: str) -> str:
        for i in itertools.count(1):
            name = f"{base}_{i}"
            if name not in self.taken and _spellable(name):
                self.taken.add(name)
                return name
        raise AssertionError("unreachable")

    # -- writing
    def flow_def(self) -> ast.FlowDef:
        f = self.flow
        self._block(self.events, {})  # first pass: find the references that need an alias
        for x in sorted(self.need_alias, key=self.order.index):
            self.aliases[x] = self._fresh(self.names[x])
        body = self._block(self.events, {})
        return ast.FlowDef(f.name, f._params, tuple(body), f.span, f.span)

    def _block(self, events, env: dict) -> list:
        stmts: list = []
        for ev in events:
            if ev[0] == "node":
                nid = ev[1]
                if nid in self.nested:
                    continue
                node = self.nodes[nid]
                name = self.names.get(nid)
                if node.op == "=":
                    stmts.append(ast.Binding(name, self._expr(node.args[0], env, None, node.span),
                                             node.span, node.span))
                else:
                    call = self._call(nid, env)
                    stmts.append(ast.Binding(name, call, node.span, node.span) if name
                                 else ast.CallStmt(call, node.span))
                if name:
                    env[name] = nid
                if nid in self.aliases:
                    alias = self.aliases[nid]
                    stmts.append(ast.Binding(alias, ast.Name(name, node.span), node.span, node.span))
                    env[alias] = nid
            elif ev[0] == "return":  # resolved after the whole body: against the final bindings
                stmts.append(ast.Return(self._expr(ev[1], self.final, None, ev[2]), ev[2]))
            else:
                loop = self.flow._loops[ev[1]]
                count = self._expr(loop.count, env, None, loop.span)
                body = self._block(ev[2], env)
                stmts.append(ast.Repeat(count, loop.until, tuple(body), loop.span))
        return stmts

    def _call(self, nid: str, env: dict) -> ast.Call:
        n = self.nodes[nid]
        args = tuple(self._expr(a, env, n.region, n.span) for a in n.args)
        kwargs = tuple(ast.KwArg(k, self._expr(v, env, None, span), span) for k, v, span in n.kwargs)
        return ast.Call(n.op, args, kwargs, n.span, n.span)

    def _expr(self, v, env: dict, turn_region: str | None, span: Span) -> ast.Expr:
        """A recorded value as an expression; ``turn_region``: the loop of the op whose positional
        argument this is (where a re-bound name makes a loop-carried edge)."""
        if isinstance(v, _Ref):
            x = _node_target(v)
            if x is None:
                return ast.Name(v.target, v.span)
            if x in self.nested:
                return self._call(x, env)
            name = self.names[x]
            spurious_turn = (turn_region is not None and name in self.bound_in_region.get(turn_region, ())
                             and self.nodes[x].region != turn_region)
            if env.get(name) == x and not spurious_turn:
                return ast.Name(name, v.span)
            self.need_alias.add(x)
            return ast.Name(self.aliases.get(x, name), v.span)
        if isinstance(v, tuple):
            return ast.ListExpr(tuple(self._expr(i, env, turn_region, span) for i in v), span)
        if isinstance(v, _Loss):
            return ast.Call(v.name, tuple(self._expr(a, env, None, v.span) for a in v.args),
                            tuple(ast.KwArg(k, self._expr(x, env, None, s), s) for k, x, s in v.options),
                            v.span, v.span)
        return v  # an ast.Literal


def _respan(module: ast.Module) -> ast.Module:
    """The module with synthetic spans, one line per statement, so the formatter lays it out
    without blank lines inside bodies (its blank-line rule reads spans)."""
    path = "<builder>"
    line = itertools.count(1)

    def at(node, ln: int):
        if isinstance(node, Span):
            return Span(path, ln, 1, ln, 2)
        if isinstance(node, tuple):
            return tuple(at(i, ln) for i in node)
        if hasattr(node, "__dataclass_fields__"):
            return replace(node, **{k: at(getattr(node, k), ln) for k in node.__dataclass_fields__})
        return node

    def stmt(s):
        if isinstance(s, ast.Repeat):
            start = next(line)
            body = tuple(stmt(b) for b in s.body)
            end = next(line)
            return replace(s, count=at(s.count, start), body=body, span=Span(path, start, 1, end, 2))
        return at(s, next(line))

    items = []
    for item in module.items:
        if isinstance(item, ast.FlowDef):
            start = next(line)
            body = tuple(stmt(b) for b in item.body)
            end = next(line)
            items.append(replace(item, params=at(item.params, start), body=body,
                                 span=Span(path, start, 1, end, 2), name_span=Span(path, start, 1, start, 2)))
        elif isinstance(item, ast.ScheduleDef):
            start = next(line)
            body = tuple(at(b, next(line)) for b in item.body)
            end = next(line)
            items.append(replace(item, cluster=at(item.cluster, start), body=body,
                                 span=Span(path, start, 1, end, 2), flow_span=Span(path, start, 1, start, 2)))
        else:
            items.append(at(item, next(line)))
    return ast.Module(path, tuple(items), (), Span(path, 1, 1, next(line), 1))


def _op_method(op: str, spec: OpSpec):
    def method(self: Flow, *args, name: str | None = None, options: dict | None = None, **kwargs) -> Value:
        return self._emit(op, args, kwargs, name, options)

    sig = ", ".join([f"{a.name}{'?' if a.optional else ''}: {a.type}" for a in spec.args]
                    + ([f"{spec.rest.name}: {spec.rest.type}..."] if spec.rest is not None else [])
                    + (["..."] if spec.variadic else [])
                    + [f"{k}: {s.type} = {s.default!r}" for k, s in spec.kwargs.items()])
    method.__name__ = method.__qualname__ = op
    method.__doc__ = (f"``{op}({sig})``: {spec.doc}\n\n``name=`` binds the result (``x = {op}(...)``); "
                      f"returns a :class:`Value`." + (f" Produces fields {', '.join(sorted(spec.produces))}."
                                                      if spec.produces else ""))
    return method


def _loss_method(loss: str):
    def method(self: Flow, *args, **options) -> Loss:
        return self.loss(loss, *args, **options)

    cspec = LOSSES[loss]
    method.__name__ = method.__qualname__ = loss
    method.__doc__ = (f"``{loss}({', '.join(k for k, _ in cspec.params)})``: {cspec.doc} A value for "
                      f"``update(..., loss=...)``.")
    return method


for _name, _spec in OPS.items():
    if not hasattr(Flow, _name):  # a future op named like a method stays reachable as f.op(name)
        setattr(Flow, _name, _op_method(_name, _spec))
for _name in LOSSES:
    if not hasattr(Flow, _name):
        setattr(Flow, _name, _loss_method(_name))
del _name, _spec
