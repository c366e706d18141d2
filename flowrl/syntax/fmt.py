"""The canonical formatter behind ``flowrl fmt``: AST + comments -> text.

Layout rules:

* one top-level item per paragraph, separated by one blank line; consecutive imports
  and consecutive declarations stay together (a blank line the author put between
  them is kept, at most one);
* two spaces of indentation per ``{ }`` level; ``name = value`` and ``key = value``
  with spaces around ``=``; ``a, b`` in lists, calls and parameters;
* literals are printed from the text they were written with (``512MB``, ``1e-6``,
  ``"a\\"b"``); a literal built in code with no valid text is spelt from its value;
* a line longer than :data:`WIDTH` columns breaks its outermost call (or list, or
  flow parameter list) one argument per line with a trailing comma, recursively;
* every comment is kept, in source order: own-line comments before the statement
  (or ``}``) that follows them, at its indentation; a comment after code on the
  same line stays trailing; comments inside a multi-line statement move above it
  (and a comment after the ``) {`` of a broken flow signature becomes the body's
  first comment, where it reads back the same way);
* blank lines between statements are kept, at most one; none after ``{`` or
  before ``}``.

The formatter is a fixed point: ``format_source(format_source(x)) == format_source(x)``,
and the output parses to the same AST (spans aside). :func:`format_source` checks the
second property on every call, so ``flowrl fmt`` can never rewrite a file into a
different program.

How comments are placed: the printer first lays the module out as a list of
:class:`_Entry` records, one per printed statement, block header and closing brace,
each with the source range it came from. Every comment is then given to one entry
(leading, inside or trailing) by its position, and the entries are rendered in order.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable

from flowrl.syntax import ast
# The parser's own decoders: a literal's text is kept only if they read it back as the
# literal's value, so the formatter and the parser cannot disagree on escapes or units.
from flowrl.syntax.parser import _parse_size, _unquote, format_size, parse

WIDTH = 100
"""Longest line (in characters, comments not counted) before calls are broken."""
INDENT = "  "
"""One level of indentation inside ``{ }`` and inside a broken call."""

Pos = tuple[int, int]  # (line, column), both from 1, as in Span


class FormatError(ValueError):
    """An AST the formatter cannot print (built in code with an impossible value), or
    an internal check failure: the output would not parse back to the same program."""


# ---- public API ---------------------------------------------------------------------


def format_source(text: str | bytes, path: str = "<input>") -> str:
    """Format one ``.flow`` file: parse ``text`` (raises FlowError if it does not parse),
    print it canonically, and check that the result parses to the same AST and keeps
    every comment (raises FormatError otherwise, which is a bug in the formatter)."""
    module = parse(text, path)
    out = format_module(module)
    again = parse(out, path)
    if _shape(again) != _shape(module) or _comment_texts(again) != _comment_texts(module):
        raise FormatError(f"internal error: formatting {path} would change the program; "
                          "please report it with the file (the file was left as it was)")
    return out


def format_module(module: ast.Module) -> str:
    """Print ``module`` (with ``module.comments``) in canonical layout. Returns the whole
    file text: lines joined by ``\\n`` with one final newline, or ``""`` for an empty
    module. Comment positions are read from the spans, so the module should come from
    :func:`flowrl.syntax.parser.parse`; a module built in code prints fine without comments."""
    builder = _Builder()
    for item in module.items:
        builder.item(item)
    tail = _attach_comments(builder.entries, module.comments)
    entries = _collapse_empty_blocks(builder.entries)
    return _render(entries, tail)


def format_expr(expr: ast.Expr) -> str:
    """One expression on one line, e.g. ``generate(policy, batch, n = 8)``."""
    return _flat(expr)


# ---- literals -----------------------------------------------------------------------

# The grammar's terminals (grammar.lark), anchored; a literal's text is kept only if it
# is still a valid token that reads back as the same value. A test checks these agree
# with the grammar.
_INT_RE = re.compile(r"-?\d+")
_FLOAT_RE = re.compile(r"-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\.\d+(?:[eE][-+]?\d+)?)")
_SIZE_RE = re.compile(r"\d+(?:\.\d+)?(?:B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)")
_STRING_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def quote_string(value: str) -> str:
    """A string literal for ``value``: ``"`` and ``\\`` escaped, newline as ``\\n`` and
    tab as ``\\t`` (the escapes the parser decodes); other characters are written as is."""
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"')
               .replace("\n", "\\n").replace("\t", "\\t"))
    return f'"{escaped}"'


def _int_text(lit: ast.Literal) -> str:
    if _INT_RE.fullmatch(lit.text) and int(lit.text) == lit.value:
        return lit.text
    if isinstance(lit.value, int) and not isinstance(lit.value, bool):
        return str(lit.value)
    raise FormatError(f"int literal has a non-integer value {lit.value!r}")


def _float_text(lit: ast.Literal) -> str:
    if _FLOAT_RE.fullmatch(lit.text) and float(lit.text) == lit.value:
        return lit.text
    text = repr(float(lit.value))
    if _FLOAT_RE.fullmatch(text):
        return text
    raise FormatError(f"float literal {lit.value!r} has no spelling in flowrl "
                      "(only finite numbers like 1.5 or 1e-6 can be written)")


def _size_text(lit: ast.Literal) -> str:
    if _SIZE_RE.fullmatch(lit.text) and _parse_size(lit.text) == lit.value:
        return lit.text
    text = format_size(lit.value) if isinstance(lit.value, int) else ""
    if _SIZE_RE.fullmatch(text):
        return text
    raise FormatError(f"size literal {lit.value!r} has no spelling in flowrl "
                      "(a size is a whole, non-negative number of bytes, e.g. 512MB)")


def _str_text(lit: ast.Literal) -> str:
    if _STRING_RE.fullmatch(lit.text) and _unquote(lit.text) == lit.value:
        return lit.text
    if isinstance(lit.value, str):
        return quote_string(lit.value)
    raise FormatError(f"str literal has a non-string value {lit.value!r}")


def _bool_text(lit: ast.Literal) -> str:
    if lit.value is True or lit.value is False:
        return "true" if lit.value else "false"
    raise FormatError(f"bool literal has a non-boolean value {lit.value!r}")


_LITERAL_TEXT: dict[str, Callable[[ast.Literal], str]] = {
    "int": _int_text, "float": _float_text, "size": _size_text, "str": _str_text, "bool": _bool_text,
}


def _literal(lit: ast.Literal) -> str:
    spell = _LITERAL_TEXT.get(lit.kind)
    if spell is None:
        raise FormatError(f"unknown literal kind {lit.kind!r} (expected one of {sorted(_LITERAL_TEXT)})")
    return spell(lit)


# ---- expressions: flat text and line breaking -----------------------------------------

# An item of a bracketed sequence: a prefix (``key = ``, ``name: type = ``) and the
# expression after it, or None for a parameter without a default.
_SeqItem = tuple[str, "ast.Expr | None"]


def _call_items(call: ast.Call) -> list[_SeqItem]:
    return [("", a) for a in call.args] + [(f"{k.name} = ", k.value) for k in call.kwargs]


def _flat(expr: ast.Expr) -> str:
    flat = _FLAT.get(type(expr))
    if flat is None:
        raise FormatError(f"cannot format expression of type {type(expr).__name__}")
    return flat(expr)


def _flat_seq(items: list[_SeqItem]) -> str:
    return ", ".join(p + ("" if v is None else _flat(v)) for p, v in items)


_FLAT: dict[type, Callable] = {
    ast.Literal: _literal,
    ast.Name: lambda e: e.id,
    ast.ListExpr: lambda e: "[" + _flat_seq([("", x) for x in e.items]) + "]",
    ast.Call: lambda e: f"{e.func}(" + _flat_seq(_call_items(e)) + ")",
}


def _layout(prefix: str, expr: ast.Expr | None, suffix: str, depth: int) -> list[str]:
    """Lines (indented ``depth`` levels) for ``prefix + expr + suffix``: one line if it
    fits in WIDTH, else the expression's call or list broken one item per line."""
    if isinstance(expr, ast.Call):
        return _layout_seq(f"{prefix}{expr.func}(", _call_items(expr), ")" + suffix, depth)
    if isinstance(expr, ast.ListExpr):
        return _layout_seq(prefix + "[", [("", x) for x in expr.items], "]" + suffix, depth)
    return [INDENT * depth + prefix + ("" if expr is None else _flat(expr)) + suffix]


def _layout_seq(opener: str, items: list[_SeqItem], closer: str, depth: int) -> list[str]:
    pad = INDENT * depth
    flat = pad + opener + _flat_seq(items) + closer
    if len(flat) <= WIDTH or not items:
        return [flat]
    lines = [pad + opener]
    for prefix, value in items:
        lines += _layout(prefix, value, ",", depth + 1)
    lines.append(pad + closer)
    return lines


# ---- pass 1: lay the module out as entries ----------------------------------------------


@dataclass
class _Entry:
    """One printed statement, block header (``kind="open"``) or ``}`` (``kind="close"``)."""

    kind: str  # "stmt" | "open" | "close"
    depth: int  # indentation level of the code; a close's comments go one deeper
    lines: list[str]  # indented code, no trailing comment
    start: Pos  # source range the comments are placed against
    end: Pos
    group: str | None = None  # top-level item kind, set on an item's first entry
    trail_ok: bool = True  # False: a trailing comment would not read back as trailing
    leading: list[ast.Comment] = field(default_factory=list)
    inside: list[ast.Comment] = field(default_factory=list)
    trailing: ast.Comment | None = None


def _start(span) -> Pos:
    return (span.line, span.column)


def _end(span) -> Pos:
    return (span.end_line, span.end_column)


class _Builder:
    """Walks the AST in source order and appends one entry per printed unit."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []

    def item(self, item: ast.Item) -> None:
        build = _ITEMS.get(type(item))
        if build is None:
            raise FormatError(f"cannot format top-level item of type {type(item).__name__}")
        before = len(self.entries)
        build(self, item)
        self.entries[before].group = _GROUP[type(item)]

    def stmt(self, stmt, depth: int) -> None:
        build = _STMTS.get(type(stmt))
        if build is None:
            raise FormatError(f"cannot format statement of type {type(stmt).__name__}")
        build(self, stmt, depth)

    def simple(self, node, lines: list[str], depth: int) -> None:
        self.entries.append(_Entry("stmt", depth, lines, _start(node.span), _end(node.span)))

    def block(self, node, head: list[str], head_end: Pos, body, depth: int, trail_ok: bool = True) -> None:
        """A header ending in ``{``, the body one level deeper, and the closing ``}``.
        ``head_end`` is the end of the header's last token that has a span: comments
        before it are inside the header, comments after it on its line trail it."""
        self.entries.append(_Entry("open", depth, head, _start(node.span), head_end, trail_ok=trail_ok))
        for stmt in body:
            self.stmt(stmt, depth + 1)
        line, col = _end(node.span)
        self.entries.append(_Entry("close", depth, [INDENT * depth + "}"], (line, col - 1), (line, col)))


# -- top-level items

def _import(b: _Builder, node: ast.Import) -> None:
    target = quote_string(node.target) if node.is_path else node.target
    alias = f" as {node.alias}" if node.alias else ""
    b.simple(node, [f"import {target}{alias}"], 0)


def _decl(b: _Builder, node: ast.Decl) -> None:
    b.simple(node, _layout(f"{node.kind} {node.name} = ", node.value, "", 0), 0)


def _flow(b: _Builder, node: ast.FlowDef) -> None:
    params = [(f"{p.name}: {p.type}" + ("" if p.default is None else " = "), p.default)
              for p in node.params]
    head = _layout_seq(f"flow {node.name}(", params, ") {", 0)
    head_end = max([_end(node.name_span)] + [_end(p.span) for p in node.params])
    # A broken parameter list ends with `) {` on a line of its own, which holds no token
    # with a span: a comment there would read back as the body's first comment.
    b.block(node, head, head_end, node.body, 0, trail_ok=len(head) == 1)


def _schedule(b: _Builder, node: ast.ScheduleDef) -> None:
    if not node.auto and node.cluster is None:
        raise FormatError(f"schedule {node.flow!r} is neither `auto` nor `on cluster(...)`")
    has_block = bool(node.body) or not node.auto  # `auto {}` and `auto` are the same AST
    brace = " {" if has_block else ""
    words = f"schedule {node.flow} auto" if node.auto else f"schedule {node.flow}"
    if node.cluster is not None:
        head = _layout(words + " on ", node.cluster, brace, 0)
    else:
        head = [words + brace]
    if not has_block:
        b.simple(node, head, 0)
        return
    head_end = max([_end(node.flow_span)] + ([_end(node.cluster.span)] if node.cluster else []))
    b.block(node, head, head_end, node.body, 0)


_ITEMS: dict[type, Callable] = {
    ast.Import: _import, ast.Decl: _decl, ast.FlowDef: _flow, ast.ScheduleDef: _schedule,
}
_GROUP = {ast.Import: "import", ast.Decl: "decl", ast.FlowDef: "flow", ast.ScheduleDef: "schedule"}
_GROUPED = {"import", "decl"}
"""Item kinds whose consecutive items are not forced apart by a blank line."""


# -- statements (flow bodies and schedule bodies)

def _targets(targets: tuple[ast.Target, ...]) -> str:
    return ", ".join(str(t) for t in targets)


def _repeat(b: _Builder, node: ast.Repeat, depth: int) -> None:
    until = f" until {node.until}" if node.until else ""
    head = _layout("repeat ", node.count, until + " {", depth)
    b.block(node, head, _end(node.count.span), node.body, depth)


def _staleness(node: ast.Staleness) -> str:
    return f"staleness {'<= ' if node.bound_only else ''}{node.value}"


def _simple(render: Callable) -> Callable:
    """A builder for a statement printed as ``render(node, depth) -> lines``."""
    return lambda b, node, depth: b.simple(node, render(node, depth), depth)


_STMTS: dict[type, Callable] = {
    ast.Binding: _simple(lambda n, d: _layout(f"{n.name} = ", n.value, "", d)),
    ast.CallStmt: _simple(lambda n, d: _layout("", n.call, "", d)),
    ast.Return: _simple(lambda n, d: _layout("return ", n.value, "", d)),
    ast.Repeat: _repeat,
    ast.Colocate: _simple(lambda n, d: [INDENT * d + f"colocate {_targets(n.targets)}"
                                        + (f" on {n.pool}" if n.pool else "")]),
    ast.Place: _simple(lambda n, d: [INDENT * d + f"place {_targets(n.targets)} on {n.pool}"]),
    ast.Pool: _simple(lambda n, d: _layout(f"pool {n.name} = ", n.value, "", d)),
    ast.Layout: _simple(lambda n, d: _layout(f"{n.target} = ", n.engine, "", d)),
    ast.Staleness: _simple(lambda n, d: [INDENT * d + _staleness(n)]),
    ast.Resync: _simple(lambda n, d: _layout(f"resync {n.model} via ", n.protocol,
                                             "" if n.every is None else f" every {n.every}", d)),
    ast.SchedCall: _simple(lambda n, d: _layout("", n.call, "", d)),
}


# ---- pass 2: give every comment to an entry ------------------------------------------------


def _attach_comments(entries: list[_Entry], comments) -> list[ast.Comment]:
    """Give each comment to the entry it belongs to; return those after the last entry.

    A comment inside an entry's range goes above it (``inside``); one after an entry on
    the line the entry ends trails it; any other goes above the next entry (``leading``).
    Entries do not overlap and are in source order, so a bisection finds the one before."""
    starts = [e.start for e in entries]
    tail: list[ast.Comment] = []
    for c in sorted(comments, key=lambda c: _start(c.span)):
        pos = _start(c.span)
        i = bisect.bisect_right(starts, pos) - 1
        prev = entries[i] if i >= 0 else None
        if prev is not None and pos < prev.end:
            prev.inside.append(c)
        elif prev is not None and c.span.line == prev.end[0] and prev.trailing is None:
            prev.trailing = c
        elif i + 1 < len(entries):
            entries[i + 1].leading.append(c)
        else:
            tail.append(c)
    return tail


def _collapse_empty_blocks(entries: list[_Entry]) -> list[_Entry]:
    """``{`` directly followed by ``}`` with no comment between them prints as ``{}``."""
    out: list[_Entry] = []
    i = 0
    while i < len(entries):
        e = entries[i]
        nxt = entries[i + 1] if i + 1 < len(entries) else None
        if (e.kind == "open" and nxt is not None and nxt.kind == "close" and e.trailing is None
                and not nxt.leading and not nxt.inside):
            out.append(dataclasses.replace(
                e, kind="stmt", lines=e.lines[:-1] + [e.lines[-1] + "}"], end=nxt.end,
                trail_ok=True, trailing=nxt.trailing))
            i += 2
        else:
            out.append(e)
            i += 1
    return out


# ---- pass 3: render ------------------------------------------------------------------------


class _Renderer:
    """Appends lines and decides blank lines: at most one, where the source had one,
    never at the top of the file, after ``{`` or before ``}``; always one between
    top-level items except within a run of imports or a run of declarations."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.prev_end = 0  # source line of the last element printed
        self.after_open = False  # the last line printed ends with `{`
        self.last_group: str | None = None

    def blank(self, line: int, force: bool = False) -> bool:
        if not self.lines or self.after_open:
            return False
        return force or line > self.prev_end + 1

    def put(self, lines: list[str], blank: bool, src_line: int) -> None:
        if blank:
            self.lines.append("")
        self.lines += lines
        self.prev_end = src_line
        self.after_open = False

    def comment(self, c: ast.Comment, depth: int, blank: bool) -> None:
        self.put([INDENT * depth + c.text.rstrip()], blank, c.span.line)

    def entry(self, e: _Entry) -> None:
        force = False
        if e.group is not None:
            force = self.last_group is not None and not (e.group == self.last_group and e.group in _GROUPED)
            self.last_group = e.group
        cdepth = e.depth + 1 if e.kind == "close" else e.depth
        for c in e.leading:
            self.comment(c, cdepth, self.blank(c.span.line, force))
            force = False
        blank = e.kind != "close" and self.blank(e.start[0], force)
        for c in e.inside:
            self.comment(c, cdepth, blank)
            blank = False
        lines = list(e.lines)
        if e.trailing is not None and e.trail_ok:
            lines[-1] += "  " + e.trailing.text.rstrip()
        self.put(lines, blank, e.end[0])
        if e.kind == "open":
            self.after_open = True
            if e.trailing is not None and not e.trail_ok:
                self.comment(e.trailing, e.depth + 1, False)


def _render(entries: list[_Entry], tail: list[ast.Comment]) -> str:
    r = _Renderer()
    for e in entries:
        r.entry(e)
    for c in tail:
        r.comment(c, 0, r.blank(c.span.line))
    return "\n".join(r.lines) + "\n" if r.lines else ""


# ---- the self-check of format_source ----------------------------------------------------------

_SPAN_FIELDS = {"span", "name_span", "kind_span", "flow_span", "func_span"}


def _shape(node):
    """``node`` as nested tuples with every span (and the module's comments and path)
    left out: two parses of the same program give equal shapes."""
    if isinstance(node, ast.Module):
        return ("Module", _shape(node.items))
    if dataclasses.is_dataclass(node):
        return (type(node).__name__,) + tuple(
            _shape(getattr(node, f.name)) for f in dataclasses.fields(node) if f.name not in _SPAN_FIELDS)
    if isinstance(node, tuple):
        return tuple(_shape(x) for x in node)
    return node


def _comment_texts(module: ast.Module) -> list[str]:
    return [c.text.rstrip() for c in sorted(module.comments, key=lambda c: _start(c.span))]
