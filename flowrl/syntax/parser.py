"""Text -> AST. The grammar lives in ``grammar.lark`` and is loaded once (LALR, positions on).

Every failure becomes a :class:`~flowrl.diagnostics.FlowError` with a position:
malformed, binary, huge or deeply nested input never escapes as another exception.
"""

from __future__ import annotations

import ast as pyast
import functools
import math
import re
import threading
from pathlib import Path

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from flowrl.diagnostics import PYTHON_VALUES, Collector, Diagnostic, FlowError, SourceMap, Span, quotable
from flowrl.syntax import ast

MAX_BYTES = 4 * 1024 * 1024
"""Largest source file accepted (a flow is a few hundred lines; this is 100x that)."""
MAX_NESTING = 64
"""Deepest bracket nesting accepted; deeper input is rejected before parsing."""

_GRAMMAR = Path(__file__).with_name("grammar.lark")

# Human names for the grammar's terminals, used in "expected ..." messages.
_TOKEN_NAMES = {
    "NAME": "a name", "STRING": "a string", "INT": "an integer", "FLOAT": "a number",
    "SIZE": "a size", "LPAR": "`(`", "RPAR": "`)`", "LBRACE": "`{`", "RBRACE": "`}`",
    "LSQB": "`[`", "RSQB": "`]`", "COMMA": "`,`", "EQUAL": "`=`", "COLON": "`:`",
    "DOT": "`.`", "MINUS": "`-`", "LE": "`<=`", "$END": "end of file",
}


def parse(text: str | bytes, path: str = "<input>", sources: SourceMap | None = None) -> ast.Module:
    """Parse one ``.flow`` file. Raises FlowError (never anything else) on bad input."""
    sources = sources if sources is not None else SourceMap()
    text = _decode(text, path, sources).removeprefix("\ufeff")  # editors may write a UTF-8 byte-order mark
    if quotable(path):  # never the lines of a file that is not a flow source
        sources.add(path, _printable(text))
    _check_limits(text, path, sources)
    comments: list[Token] = []
    try:
        tree = _parse_with_comments(text, comments)
        module = _ToAst(path, text, sources).transform(tree)
    except UnexpectedInput as e:
        raise FlowError([_syntax_diagnostic(e, text, path)], sources) from None
    except VisitError as e:
        if isinstance(e.orig_exc, FlowError):
            raise e.orig_exc from None
        raise
    cmts = tuple(ast.Comment(str(t), _tok_span(path, t)) for t in comments)
    return ast.Module(path, module.items, cmts, module.span)


def _parse_with_comments(text: str, comments: list[Token]):
    # The cached parser appends comments to a module-level sink (lark binds lexer
    # callbacks at construction); the lock keeps concurrent parses apart.
    with _SINK_LOCK:
        _COMMENT_SINK.clear()
        try:
            return _comment_lark().parse(text, on_error=_keyword_as_name)
        finally:
            comments.extend(_COMMENT_SINK)
            _COMMENT_SINK.clear()


def _keyword_as_name(e: UnexpectedInput) -> bool:
    """Read a keyword as a name where only a name fits (lark's ``on_error`` hook).

    Keywords are contextual: the lexer reads ``pool`` as a name inside a flow, except
    right after a `)`, where the LALR state shared with schedules (``... via nccl()``
    may be followed by ``pool``) lexes it as the keyword. Feeding it back as a NAME
    makes every keyword usable as a name wherever a name is valid, not only in some
    positions. Returns False (the error stands) for anything else.
    """
    if not isinstance(e, UnexpectedToken) or e.token.type not in _KEYWORDS:
        return False
    if "NAME" not in (e.accepts or ()):
        return False
    e.interactive_parser.feed_token(Token.new_borrow_pos("NAME", str(e.token), e.token))
    return True


_COMMENT_SINK: list[Token] = []
_SINK_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _keywords() -> frozenset[str]:
    return frozenset(t.name for t in _comment_lark().terminals
                     if t.pattern.type == "str" and t.pattern.value.isidentifier())


class _KeywordSet:
    """``in`` test against the grammar's keyword terminals (built with the parser)."""

    def __contains__(self, name: str) -> bool:
        return name in _keywords()


_KEYWORDS = _KeywordSet()


@functools.lru_cache(maxsize=1)
def _comment_lark() -> Lark:
    # cache=True keeps the LALR tables in a temp file: `flowrl check` starts in ~15 ms instead of ~400 ms.
    return Lark(_GRAMMAR.read_text(), parser="lalr", propagate_positions=True, cache=True,
                maybe_placeholders=True, lexer_callbacks={"COMMENT": _COMMENT_SINK.append})


def _decode(text: str | bytes, path: str, sources: SourceMap) -> str:
    if isinstance(text, str):
        return text
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as e:
        before = text[: e.start].decode("utf-8", errors="replace")
        line = before.count("\n") + 1
        col = len(before) - (before.rfind("\n") + 1) + 1
        if quotable(path):
            sources.add(path, _printable(text.decode("utf-8", errors="replace")))
        raise FlowError([Diagnostic(
            "E002", f"file is not UTF-8 text (byte 0x{text[e.start]:02x} at offset {e.start})",
            Span.point(path, line, col), "a .flow file is UTF-8 text; is this the right file?")],
            sources) from None


# Characters Python's ``str.splitlines`` treats as line breaks but the lexer does not
# (it counts only ``\n``), and control characters that would garble a terminal.
_QUOTE_UNSAFE = {c: " " if c in "\r\f\v" else "\ufffd"
                 for c in [chr(i) for i in range(32) if chr(i) not in "\n\t"]
                 + ["\x7f", "\x85", "\u2028", "\u2029"]}
_QUOTE_TABLE = str.maketrans(_QUOTE_UNSAFE)


def _printable(text: str) -> str:
    """The text diagnostics quote: same lines and columns as the lexer's, nothing unprintable.

    ``\r\n`` becomes ``\n`` (the ``\r`` ends a line, so no column moves); any other
    control or line-separator character becomes one space or one U+FFFD.
    """
    return text.replace("\r\n", "\n").translate(_QUOTE_TABLE)


_SIGNIFICANT = re.compile(r'[\n#"\\()\[\]{}]')
"""The characters :func:`_check_limits` follows: newlines, comments, strings and their escapes, brackets."""


def _check_limits(text: str, path: str, sources: SourceMap) -> None:
    if len(text) > MAX_BYTES:
        raise FlowError([Diagnostic(
            "E003", f"file is too large ({len(text):,} characters; the limit is {MAX_BYTES:,})",
            Span.point(path, 1, 1), "split the program into files and use `import`")], sources)
    if "\x00" in text:
        pos = text.index("\x00")
        line = text.count("\n", 0, pos) + 1
        col = pos - (text.rfind("\n", 0, pos) + 1) + 1
        raise FlowError([Diagnostic("E002", "file contains a NUL byte; it looks binary",
                                    Span.point(path, line, col),
                                    "a .flow file is UTF-8 text; is this the right file?")], sources)
    # Only the characters that change the state are visited (a 10^6-digit literal is skipped in C).
    depth, line, line_start, in_str, in_comment = 0, 1, -1, False, False
    escaping = -2  # where a backslash that escapes the next character is (an escaped backslash escapes nothing)
    for m in _SIGNIFICANT.finditer(text):
        ch, pos = m.group(), m.start()
        if ch == "\\":
            escaping = -2 if escaping == pos - 1 else pos
        elif ch == "\n":
            line, line_start, in_comment, in_str = line + 1, pos, False, False
        elif in_comment:
            pass
        elif in_str:
            if ch == '"' and escaping != pos - 1:
                in_str = False
        elif ch == "#":
            in_comment = True
        elif ch == '"':
            in_str = True
        elif ch in "([{":
            depth += 1
            if depth > MAX_NESTING:
                raise FlowError([Diagnostic(
                    "E004", f"brackets nested deeper than {MAX_NESTING} levels",
                    Span.point(path, line, pos - line_start), "flatten the expression into named bindings")], sources)
        elif ch in ")]}":
            depth = max(0, depth - 1)


def _tok_span(path: str, tok: Token) -> Span:
    line = tok.line or 1
    col = tok.column or 1
    end_line = tok.end_line or line
    end_col = tok.end_column or (col + len(str(tok)))
    return Span(path, line, col, end_line, end_col)


# ---- parse errors -> diagnostics ----------------------------------------------------

# Programs that fail in a characteristic parser state, mapped to messages for people
# (lark's ``match_examples``). Keys are (code, message, hint).
_EXAMPLES: dict[tuple[str, str, str], list[str]] = {
    ("E011", "expected an expression after `=`",
     "write a value or a call, e.g. `x = generate(policy, batch)`"): [
        "flow f() { x = }", "flow f() { x = ) }", "model m =", "flow f() { x = , }",
        "model m = }",
    ],
    ("E012", "a flow statement must be `name = expr`, a call, `return` or `repeat`",
     "bind the result to a name (`x = op(...)`) or call an op (`update(...)`)"): [
        "flow f() { 3 }", "flow f() { \"s\" }", "flow f() { x }", "flow f() { x y }",
        "flow f() { x.y }", "flow f() { [1] }", "flow f() { x.y z }",
    ],
    ("E013", "expected a flow, a schedule, an import or a declaration at top level",
     "top-level items are `flow`, `schedule`, `import` and declarations like `model m = hf(\"...\")`"): [
        "x", "3", "x(", "x.y", "\"s\"", "}", "x x x", "{", "x = 1", "x(1)",
    ],
    ("E014", "expected `:` and a type after a parameter name",
     "parameters are written `name: type` or `name: type = default`, e.g. `group: int = 8`"): [
        "flow f(a) {}", "flow f(a, b: int) {}", "flow f(a = 1) {}", "flow f(a b) {}",
    ],
    ("E015", "missing `{` to open the body",
     "a body is a block in braces: `flow f() { ... }`"): [
        "flow f() x", "flow f()", "flow f() }", "flow f() x = 1",
    ],
    ("E016", "a call's arguments are expressions separated by commas",
     "close the call with `)`; separate arguments with `,`"): [
        "flow f() { x = g(1 2) }", "flow f() { x = g(a b) }", "flow f() { x = g(a, }",
        "flow f() { x = g(a = ) }", "flow f() { x = g(, a) }",
    ],
    ("E017", "unknown schedule statement",
     "schedule statements: colocate, place, pool, `ENGINE = layout(...)`, staleness, resync, partial_rollout(...)"): [
        "schedule g on cluster() { 3 }", "schedule g on cluster() { x }",
        "schedule g on cluster() { x y }", "schedule g on cluster() { \"s\" }",
        "schedule g on cluster() { x.y }", "schedule g on cluster() { x.y z }",
    ],
    ("E025", "`staleness` takes its number without `=`",
     "write `staleness 2` (a manual schedule) or `staleness <= 2` (a limit for `schedule ... auto`)"): [
        "schedule g on cluster() { staleness = 2 }", "schedule g on cluster() { staleness == 2 }",
        "schedule g on cluster() { staleness := 2 }",
    ],
    ("E018", "a schedule needs `on cluster(...)` or `auto`",
     "write `schedule NAME on cluster(nodes = 1, gpus_per_node = 8) { ... }` or `schedule NAME auto`"): [
        "schedule g { }", "schedule g cluster() { }", "schedule g", "schedule g on x { }",
    ],
}


def _syntax_diagnostic(e: UnexpectedInput, text: str, path: str) -> Diagnostic:
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        span = Span.point(path, e.line, e.column)
        if ch == '"':
            return Diagnostic("E005", "unterminated string", span,
                              "close the string with `\"` on the same line")
        if ch == "'":
            return Diagnostic("E006", "strings use double quotes", span, "write \"...\" instead of '...'")
        foreign = _foreign_syntax(text, e.pos_in_stream, path)
        if foreign is not None:
            return foreign
        shown = ch if ch.isprintable() else repr(ch)
        return Diagnostic("E001", f"unexpected character `{shown}`", span,
                          _CHAR_HINTS.get(ch, "names are letters, digits and `_`; strings are in double quotes"))
    label = _match_example(e)
    tok = getattr(e, "token", None)
    if label is None or label[0] != "E025":
        foreign = _foreign_token(e, text, path)
        if foreign is not None:
            return foreign
    if isinstance(e, UnexpectedEOF) or (tok is not None and tok.type == "$END"):
        unclosed = _unclosed_bracket(text, path)
        if unclosed is not None:
            # The useful position is the bracket left open, not the end of the file.
            kind, where = unclosed
            return Diagnostic("E007", f"`{kind}` is never closed: the file ends first", where,
                              f"add the matching `{_CLOSERS[kind]}`")
        span = _eof_span(text, path, tok)
        if label:
            return Diagnostic(label[0], f"{label[1]} (found end of file)", span, label[2])
        return Diagnostic("E008", "unexpected end of file", span, _expected_hint(e))
    span = _tok_span(path, tok) if tok is not None else Span.point(path, e.line, e.column)
    notes = _open_bracket_note(e, text, path)
    dangling = _dangling_name(e, path) if label and label[0] in _DANGLING else None
    if dangling is not None:  # `b }`: the bare name is the mistake, not the `}` after it
        name, name_span = dangling
        unclosed = _unclosed_bracket(text[: e.pos_in_stream], path)
        if name in ("flow", "schedule", "import") and unclosed is not None and unclosed[0] == "{":
            return Diagnostic("E007", f"`{name}` inside a block: the `{{` before it is never closed", name_span,
                              "add `}` before this line", notes=(("`{` opened", unclosed[1]),))
        if label[0] == "E012" and tok is not None and tok.type == "COLON":
            return Diagnostic("E012", f"a binding has no type annotation: `{name}:`", name_span,
                              f"write `{name} = ...`; types are written on flow parameters only")
        python = _PYTHON_KEYWORDS.get(name)
        return Diagnostic(label[0], _DANGLING[label[0]].format(name=name, msg=label[1]), name_span,
                          python or label[2])
    if label and label[0] == "E013":
        python = _top_level_python(text, e, path)
        if python is not None:
            return python
    if label:
        return Diagnostic(label[0], f"{label[1]} (found `{tok}`)" if tok is not None else label[1],
                          span, label[2], notes=notes)
    return Diagnostic("E009", f"unexpected `{tok}`", span, _expected_hint(e), notes=notes)


# ---- other languages' syntax -> messages that say what flowrl writes instead ------------

_CHAR_HINTS = {
    ";": "statements need no `;`: remove it (newlines and spaces separate statements)",
    "\\": "a statement may span lines as it is: remove the `\\`",
    "`": "strings are in double quotes: \"...\"",
    "$": "names are letters, digits and `_`; a flow parameter is used by its name, without `$`",
}

_PYTHON_KEYWORDS = {
    "for": "flowrl has no `for`: a flow is one step; loop turns of a conversation with `repeat N { ... }`",
    "while": "flowrl has no `while`: loop turns with `repeat N until FIELD { ... }`",
    "if": "flowrl has no `if`: a flow runs the same ops every step",
    "elif": "flowrl has no `if`: a flow runs the same ops every step",
    "else": "flowrl has no `if`: a flow runs the same ops every step",
    "def": "define a flow with `flow NAME(PARAMS) { ... }`",
    "lambda": "flowrl has no functions as values: write a flow, or a Python function for `call(...)`",
    "and": "flowrl has no boolean operators: a flow runs the same ops every step",
    "or": "flowrl has no boolean operators: a flow runs the same ops every step",
    "let": "bind with `name = expr` (no `let`)",
    "var": "bind with `name = expr` (no `var`)",
    "const": "bind with `name = expr` (no `const`)",
}

_SIZE_OPERAND = r"\d+(?:\.\d+)?(?:B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)(?![A-Za-z0-9_])"
_OPERAND = (rf"(?:{_SIZE_OPERAND}|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
            r"|[A-Za-z_][A-Za-z0-9_.]*)")
_ARITHMETIC = re.compile(rf"-?{_OPERAND}(?:\s*(?:\*\*|//|[-+*/%])\s*-?{_OPERAND})+")
_KEY_BEFORE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*$")


def _line_at(text: str, pos: int) -> tuple[str, int, int]:
    """(the line holding ``pos``, its number, the 0-based column of ``pos`` in it)."""
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start: end if end >= 0 else len(text)], text.count("\n", 0, pos) + 1, pos - start


def _foreign_syntax(text: str, pos: int, path: str) -> Diagnostic | None:
    """A character that starts another language's syntax: a comment, arithmetic, a comparison."""
    line, lineno, col = _line_at(text, pos)
    rest = line[col:]
    if rest.startswith(("//", "/*")):
        return Diagnostic("E024", f"comments start with `#`, not `{rest[:2]}`",
                          Span(path, lineno, col + 1, lineno, col + 3),
                          f"write `# {rest[2:].split('*/')[0].strip() or '...'}`")
    if rest[:2] in ("+=", "-=", "*=", "/=", "%="):
        return Diagnostic("E023", f"flowrl has no `{rest[:2]}`: a name is bound to one value",
                          Span(path, lineno, col + 1, lineno, col + 3),
                          "bind the new value to a name of its own: `y = ...`")
    if rest.startswith(("!=", "<", ">")):
        op = "!=" if rest.startswith("!=") else rest[0]
        return _no_comparison(op, Span(path, lineno, col + 1, lineno, col + 1 + len(op)))
    if rest[:1] and rest[:1] in "*/+%^":
        return _arithmetic(line, lineno, col, path)
    return None


def _foreign_token(e: UnexpectedInput, text: str, path: str) -> Diagnostic | None:
    """A token the grammar rejects because it continues another language's expression."""
    tok = getattr(e, "token", None)
    if not isinstance(e, UnexpectedToken) or tok is None or tok.type == "$END" or tok.start_pos is None:
        return None
    line, lineno, col = _line_at(text, tok.start_pos)
    if tok.type == "EQUAL" and line[col:col + 2] == "==":
        return _no_comparison("==", Span(path, lineno, col + 1, lineno, col + 3))
    if tok.type == "COLON" and line[col:col + 2] == ":=":
        return Diagnostic("E012", "flowrl binds with `=`, not `:=`", Span(path, lineno, col + 1, lineno, col + 3),
                          "write `name = ...`")
    if tok.type == "MINUS" and line[col:col + 2] == "->":
        return Diagnostic("E009", "a flow has no return type (`->`)", Span(path, lineno, col + 1, lineno, col + 3),
                          "remove it: a flow's value is what its `return` statement gives")
    if tok.type == "LBRACE" and re.search(r"[=(,]\s*$", line[:col]):
        return Diagnostic("E011", "flowrl has no dictionaries", _tok_span(path, tok),
                          "options are keyword arguments: `f(key = value, ...)`")
    if tok.type == "MINUS" and col > 0 and re.search(rf"{_OPERAND}\s*$", line[:col]):
        return _arithmetic(line, lineno, col, path)
    if tok.type == "NAME" and str(tok).startswith("_") and col > 0 and line[col - 1].isdigit():
        digits = re.search(r"[\d.]+$", line[:col]).group(0) + str(tok)
        return Diagnostic("E009", f"unexpected `{tok}`: numbers have no `_` separators",
                          _tok_span(path, tok), f"write `{digits.replace('_', '')}`")
    return None


def _no_comparison(op: str, span: Span) -> Diagnostic:
    return Diagnostic("E023", f"flowrl has no comparisons (`{op}`)", span,
                      "a flow runs the same ops every step; to end a loop on a field write "
                      "`repeat N until FIELD { ... }`; to set a value write `=`")


def _arithmetic(line: str, lineno: int, col: int, path: str) -> Diagnostic:
    """E023 for ``lr = 1e-4 * 2``: the expression's span, and its value when it is all numbers."""
    found = next((m for m in _ARITHMETIC.finditer(line) if m.start() <= col < m.end()), None)
    if found is None:
        shown, span, value = line[col], Span(path, lineno, col + 1, lineno, col + 2), None
    else:
        shown = found.group(0)
        span = Span(path, lineno, found.start() + 1, lineno, found.end() + 1)
        value = _evaluate(shown)
    key = _KEY_BEFORE.search(line[: found.start()] if found else "")
    lhs = f"{key.group(1)} = " if key else ""
    if value is not None:
        hint = f"write the value itself: `{lhs}{value}`"
    else:
        hint = ("compute the value and write it as one literal, or make it a flow parameter "
                "(`--set NAME=VALUE` changes it per run)")
    return Diagnostic("E023", f"expressions are not supported here: `{shown}`", span, hint)


_OPS = {pyast.Add: lambda a, b: a + b, pyast.Sub: lambda a, b: a - b, pyast.Mult: lambda a, b: a * b,
        pyast.Div: lambda a, b: a / b, pyast.FloorDiv: lambda a, b: a // b, pyast.Mod: lambda a, b: a % b,
        pyast.Pow: lambda a, b: a ** b}


def _evaluate(expr: str) -> str | None:
    """The value of a numbers-only arithmetic expression as a flowrl literal, else None.

    Parsed with Python's ``ast`` and evaluated node by node (never ``eval``): only numbers,
    ``+ - * / // % **`` and a unary minus; powers are bounded so the hint is cheap.
    """
    sizes = re.findall(_SIZE_OPERAND, expr)
    expr = re.sub(_SIZE_OPERAND, lambda m: str(_parse_size(m.group(0))), expr)
    try:
        tree = pyast.parse(expr, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None

    def ev(n):
        if isinstance(n, pyast.Constant) and type(n.value) in (int, float):
            return n.value
        if isinstance(n, pyast.UnaryOp) and isinstance(n.op, pyast.USub):
            return -ev(n.operand)
        if isinstance(n, pyast.BinOp) and type(n.op) in _OPS:
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, pyast.Pow) and (abs(b) > 64 or abs(a) > 1e6):
                raise OverflowError
            return _OPS[type(n.op)](a, b)
        raise ValueError

    try:
        v = ev(tree)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError):
        return None
    if isinstance(v, complex) or (isinstance(v, float) and not math.isfinite(v)):
        return None
    if sizes:  # bytes: written as a size when whole, in the units the expression used
        if v != int(v) or v < 0 or v >= 10**18:
            return None
        binary = any("i" in x for x in sizes)
        for unit in (("TiB", "GiB", "MiB", "KiB") if binary else ("TB", "GB", "MB", "KB")):
            if int(v) and int(v) % _UNITS[unit] == 0:
                return f"{int(v) // _UNITS[unit]}{unit}"
        return format_size(int(v))
    if isinstance(v, int):
        return str(v) if abs(v) < 10**18 else None
    text = f"{v:.12g}"
    return text if any(c in text for c in ".e") else text + ".0"


def _top_level_python(text: str, e: UnexpectedInput, path: str) -> Diagnostic | None:
    """``from x import y`` / ``def f():`` / ``class C:`` where a top-level item belongs."""
    tok = getattr(e, "token", None)
    if tok is None or tok.start_pos is None:
        return None
    line, lineno, _ = _line_at(text, tok.start_pos)
    m = re.match(r"\s*from\s+([\w.]+)\s+import\s+(\w+)?", line)
    if m:
        col = line.index("from") + 1
        module = f"{m.group(1)}.{m.group(2)}" if m.group(2) else m.group(1)
        return Diagnostic("E013", "flowrl imports whole files: there is no `from ... import`",
                          Span(path, lineno, col, lineno, col + 4),
                          f"write `import {module}` (its flows are then visible by name) or "
                          f"`import {module} as NAME`")
    m = re.match(r"\s*(def|class)\b", line)
    if m:
        col = line.index(m.group(1)) + 1
        word = m.group(1)
        return Diagnostic("E013", f"flowrl has no `{word}`", Span(path, lineno, col, lineno, col + len(word)),
                          "define a flow with `flow NAME(PARAMS) { ... }`")
    return None


# Labels whose error is a bare name the parser only rejects at the *next* token.
_DANGLING = {"E012": "{msg}; `{name}` alone is none of these",
             "E017": "unknown schedule statement `{name}`"}


def _dangling_name(e: UnexpectedInput, path: str) -> tuple[str, Span] | None:
    """The bare (dotted) name just before the error, from the parser's value stack."""
    stack = getattr(e.state, "value_stack", None) or ()
    top = stack[-1] if stack else None
    if isinstance(top, Token) and top.type == "NAME":
        i = len(stack) - 1  # a schedule target `a.b` stays as tokens NAME DOT NAME
        while i >= 2 and isinstance(stack[i - 1], Token) and stack[i - 1].type == "DOT" \
                and isinstance(stack[i - 2], Token) and stack[i - 2].type == "NAME":
            i -= 2
        first = _tok_span(path, stack[i])
        return "".join(str(t) for t in stack[i:]), Span(path, first.line, first.column, top.end_line or first.line,
                                                        top.end_column or first.column + 1)
    if isinstance(top, Tree) and top.data == "dotted" and not top.meta.empty:
        return ".".join(str(c) for c in top.children), _meta_span(path, top.meta)
    return None


_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_CLOSER_TERMINALS = {"(": "RPAR", "[": "RSQB", "{": "RBRACE"}


def _open_bracket_note(e: UnexpectedInput, text: str, path: str) -> tuple[tuple[str, Span], ...]:
    """Where the bracket the parser wanted closed was opened, when that is on an earlier line."""
    unclosed = _unclosed_bracket(text[: e.pos_in_stream], path)
    if unclosed is None:
        return ()
    kind, where = unclosed
    # `{` spans lines by design; only a `(` or `[` left open across lines is suspicious.
    if kind == "{" or _CLOSER_TERMINALS[kind] not in (getattr(e, "expected", None) or ()) \
            or where.line == e.line:
        return ()
    return ((f"unclosed `{kind}` opened", where),)


@functools.lru_cache(maxsize=1)
def _example_states() -> tuple[tuple[int, str, tuple[str, str, str]], ...]:
    """(parser state, token type, label) of every example in ``_EXAMPLES``, computed once."""
    out = []
    for label, examples in _EXAMPLES.items():
        for example in examples:
            try:
                _parse_with_comments(example, [])
            except UnexpectedToken as ut:
                out.append((ut.state.position, ut.token.type, label))
    return tuple(out)


def _match_example(e: UnexpectedInput) -> tuple[str, str, str] | None:
    """The label of the example that failed in the same parser state (same token type first).

    lark's ``match_examples`` also compares the depth of the parser stack, so an example
    written as the first item of a file never matched an error after earlier items or
    statements; the LALR state alone decides what may come next, so it is compared alone.
    """
    if not isinstance(e, UnexpectedToken) or e.state is None:
        return None
    same_state = [(tt, label) for pos, tt, label in _example_states() if pos == e.state.position]
    for tt, label in same_state:
        if tt == e.token.type:
            return label
    return same_state[0][1] if same_state else None


def _expected_hint(e: UnexpectedInput) -> str:
    expected = sorted({_TOKEN_NAMES.get(t, f"`{t.lower()}`" if t.isalpha() else t)
                       for t in getattr(e, "expected", ()) or ()})
    expected = [x for x in expected if not x.startswith("`__")]
    return "expected " + ", ".join(expected[:8]) if expected else "check the syntax near here"


def _eof_span(text: str, path: str, tok: Token | None) -> Span:
    """Just after the last token (lark's end token borrows its position), else after the text."""
    if tok is not None and tok.end_line is not None and tok.end_column is not None:
        return Span.point(path, tok.end_line, tok.end_column)
    lines = text.rstrip().split("\n")
    return Span.point(path, len(lines), len(lines[-1]) + 1)


def _unclosed_bracket(text: str, path: str) -> tuple[str, Span] | None:
    stack: list[tuple[str, int, int]] = []
    line, col, in_str, in_comment, esc = 1, 0, False, False, False
    for ch in text:
        col += 1
        if ch == "\n":
            line, col, in_str, in_comment = line + 1, 0, False, False
            continue
        if in_comment:
            continue
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == "#":
            in_comment = True
        elif ch == '"':
            in_str = True
        elif ch in _CLOSERS:
            stack.append((ch, line, col))
        elif ch in ")]}" and stack:
            stack.pop()
    if not stack:
        return None
    kind, l, c = stack[-1]
    return kind, Span.point(path, l, c)


# ---- parse tree -> AST ------------------------------------------------------------


def _meta_span(path: str, meta, fallback: Span | None = None) -> Span:
    if getattr(meta, "empty", True):
        return fallback or Span.point(path, 1, 1)
    return Span(path, meta.line, meta.column, meta.end_line, meta.end_column)


@v_args(meta=True)
class _ToAst(Transformer):
    """Builds AST nodes; the only checks here are the ones the grammar cannot express."""

    def __init__(self, path: str, text: str, sources: SourceMap):
        super().__init__()
        self.path = path
        self.text = text
        self.errors = Collector(sources)

    def _span(self, meta) -> Span:
        return _meta_span(self.path, meta)

    def _tok(self, tok: Token) -> Span:
        return _tok_span(self.path, tok)

    # top level
    def start(self, meta, items):
        self.errors.raise_if_any()
        return ast.Module(self.path, tuple(items), (), self._span(meta))

    def import_stmt(self, meta, children):
        target, alias = children
        if isinstance(target, Token):  # STRING
            return ast.Import(_unquote(target), True, str(alias) if alias else None, self._span(meta))
        return ast.Import(target.id, False, str(alias) if alias else None, self._span(meta))

    def dotted(self, meta, names):
        return ast.Name(".".join(str(n) for n in names), self._span(meta))

    def decl(self, meta, children):
        kind, name, value = children
        return ast.Decl(str(kind), str(name), value, self._span(meta), self._tok(kind), self._tok(name))

    def flow_def(self, meta, children):
        name, *rest = children
        body = rest[-1]
        params = tuple(p for p in rest[:-1] if p is not None)
        return ast.FlowDef(str(name), params, body, self._span(meta), self._tok(name))

    def param(self, meta, children):
        name, typ, default = children
        return ast.Param(str(name), str(typ), default, self._span(meta))

    def block(self, meta, stmts):
        return tuple(stmts)

    def binding(self, meta, children):
        name, value = children
        return ast.Binding(str(name), value, self._span(meta), self._tok(name))

    def call_stmt(self, meta, children):
        return ast.CallStmt(children[0], self._span(meta))

    def return_stmt(self, meta, children):
        return ast.Return(children[0], self._span(meta))

    def repeat_stmt(self, meta, children):
        count, until, body = children
        for st in body:
            if isinstance(st, ast.Repeat):
                self.errors.error("E020", "`repeat` loops do not nest", st.span,
                                  "move the inner loop's ops into the outer loop")
        return ast.Repeat(count, str(until) if until else None, body, self._span(meta))

    # schedules
    def schedule_manual(self, meta, children):
        name, cluster, body = children
        return ast.ScheduleDef(str(name), False, cluster, body, self._span(meta), self._tok(name))

    def schedule_auto(self, meta, children):
        name, cluster, body = children
        return ast.ScheduleDef(str(name), True, cluster, body or (), self._span(meta), self._tok(name))

    def sched_block(self, meta, stmts):
        return tuple(stmts)

    def target(self, meta, children):
        model, role = children
        return ast.Target(str(model), str(role) if role else None, self._span(meta))

    def colocate(self, meta, children):
        *targets, pool = children
        return ast.Colocate(tuple(targets), str(pool) if pool else None, self._span(meta))

    def place(self, meta, children):
        *targets, pool = children
        return ast.Place(tuple(targets), str(pool), self._span(meta))

    def pool(self, meta, children):
        name, value = children
        return ast.Pool(str(name), value, self._span(meta))

    def layout(self, meta, children):
        target, engine = children
        return ast.Layout(target, engine, self._span(meta))

    def staleness(self, meta, children):
        le, value = children
        return ast.Staleness(value.value, le is not None, self._span(meta))

    def resync(self, meta, children):
        model, protocol, every = children
        return ast.Resync(str(model), protocol, every.value if every is not None else None, self._span(meta))

    def integer(self, meta, children):
        minus, tok = children
        return self._number(int, tok, "int", -1 if minus is not None else 1, self._span(meta))

    def sched_call(self, meta, children):
        return ast.SchedCall(children[0], self._span(meta))

    # expressions
    def call(self, meta, children):
        func, *args = children
        args = [a for a in args if a is not None]
        positional, keywords, seen = [], [], {}
        for a in args:
            if isinstance(a, ast.KwArg):
                if a.name in seen:
                    self.errors.error("E019", f"keyword argument `{a.name}` given twice", a.span,
                                      "remove one of them", notes=((f"first given", seen[a.name]),))
                seen[a.name] = a.span
                keywords.append(a)
            elif keywords:
                self.errors.error("E010", "positional argument after a keyword argument", _expr_span(a),
                                  "put positional arguments first, or name this one")
            else:
                positional.append(a)
        return ast.Call(func.id, tuple(positional), tuple(keywords), self._span(meta), func.span)

    def kwarg(self, meta, children):
        name, value = children
        return ast.KwArg(str(name), value, self._span(meta))

    def ref(self, meta, children):
        name = children[0]
        if name.id in PYTHON_VALUES:
            self.errors.error("E022", f"`{name.id}` is Python; flowrl has no value of that name", name.span,
                              PYTHON_VALUES[name.id][1])
        return name

    def size(self, meta, children):
        tok = children[0]
        return self._number(_parse_size, tok, "size", 1, self._tok(tok))

    def int(self, meta, children):
        tok = children[0]
        return self._number(int, tok, "int", 1, self._tok(tok))

    def neg_int(self, meta, children):
        tok = children[0]
        return self._number(int, tok, "int", -1, self._span(meta))

    def float(self, meta, children):
        tok = children[0]
        return self._number(float, tok, "float", 1, self._tok(tok))

    def neg_float(self, meta, children):
        tok = children[0]
        return self._number(float, tok, "float", -1, self._span(meta))

    def _number(self, convert, tok: Token, kind: str, sign: int, span: Span) -> ast.Literal:
        """A numeric literal; one too large to represent (an int of thousands of digits, a
        float or size that overflows to infinity) is reported instead of crashing."""
        text = str(tok) if sign > 0 else f"-{tok}"
        try:
            value = sign * convert(str(tok))
            if kind != "int" and value in (float("inf"), float("-inf")):
                raise OverflowError(text)
        except (ValueError, OverflowError):
            shown = text if len(text) <= 24 else f"{text[:12]}...{text[-8:]} ({len(text):,} characters)"
            self.errors.error("E021", f"number `{shown}` is too large to represent", span,
                              "check the literal for a typo")
            value = 0 if kind != "float" else 0.0
        return ast.Literal(value, kind, text, span)

    def string(self, meta, children):
        tok = children[0]
        return ast.Literal(_unquote(tok), "str", str(tok), self._tok(tok))

    def true(self, meta, children):
        return ast.Literal(True, "bool", "true", self._span(meta))

    def false(self, meta, children):
        return ast.Literal(False, "bool", "false", self._span(meta))

    def list(self, meta, children):
        return ast.ListExpr(tuple(c for c in children if c is not None), self._span(meta))


def _expr_span(e) -> Span:
    return e.span


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _parse_size(text: str) -> int:
    num = text.rstrip("BKMGTi")
    unit = text[len(num):]
    return int(round(float(num) * _UNITS[unit]))


def _unquote(tok) -> str:
    body = str(tok)[1:-1]
    out, i = [], 0
    escapes = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            out.append(escapes.get(body[i + 1], "\\" + body[i + 1]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def format_size(n: int) -> str:
    """Canonical text of a size in bytes: the largest binary or decimal unit that divides it."""
    for unit in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "KB"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return f"{n}B"
