"""Tests of the canonical formatter (``flowrl fmt``).

Golden files: ``tests/syntax/fmt/NAME.flow`` is formatted and compared with
``NAME.expected.flow``; run with ``FLOWRL_REGEN=1`` to rewrite the expected files.
Every test also checks the two invariants: formatting is idempotent, and the output
parses to the same AST (spans aside) with the same comments in the same order.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lark import Lark

from flowrl.diagnostics import FlowError, Span
from flowrl.syntax import ast, fmt
from flowrl.syntax.fmt import WIDTH, FormatError, format_module, format_source
from flowrl.syntax.parser import parse

HERE = Path(__file__).parent
FIXTURES = HERE / "fmt"
REPO = HERE.parents[1]
REGEN = os.environ.get("FLOWRL_REGEN") == "1"


# ---- helpers ------------------------------------------------------------------------


def strip_spans(node):
    """``node`` with every Span replaced by None (recursively through dataclasses and
    tuples), and comment texts without trailing whitespace (the formatter drops it)."""
    if isinstance(node, Span):
        return None
    if isinstance(node, ast.Comment):
        return ast.Comment(node.text.rstrip(), None)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return type(node)(**{f.name: strip_spans(getattr(node, f.name)) for f in dataclasses.fields(node)})
    if isinstance(node, tuple):
        return tuple(strip_spans(x) for x in node)
    return node


def assert_invariants(text: str, path: str = "t.flow") -> str:
    """Format ``text``; check idempotence and that the AST and comments survive. Returns the output."""
    out = format_source(text, path)
    assert format_source(out, path) == out, "formatting is not idempotent"
    assert strip_spans(parse(out, path)) == strip_spans(parse(text, path))
    assert out == "" or out.endswith("\n") and not out.endswith("\n\n")
    for line in out.split("\n"):
        assert line == line.rstrip(), f"trailing whitespace in {line!r}"
    return out


def fmt_(text: str) -> str:
    return assert_invariants(text)


# ---- golden files -----------------------------------------------------------------------

CASES = sorted(p for p in FIXTURES.glob("*.flow") if not p.name.endswith(".expected.flow"))


def _expected_path(src: Path) -> Path:
    return src.with_name(src.name[: -len(".flow")] + ".expected.flow")


def test_fixtures_present():
    names = {p.stem for p in CASES}
    assert {"constructs", "comments", "long_lines", "blank_lines", "literals", "empty"} <= names
    for src in CASES:
        assert _expected_path(src).exists() or REGEN, f"{src.name} has no expected output"


@pytest.mark.parametrize("src", CASES, ids=lambda p: p.stem)
def test_golden(src: Path):
    out = assert_invariants(src.read_text(), src.name)
    expected = _expected_path(src)
    if REGEN:
        expected.write_text(out)
    assert out == expected.read_text()


@pytest.mark.parametrize("src", CASES, ids=lambda p: p.stem)
def test_golden_output_is_a_fixed_point(src: Path):
    expected = _expected_path(src).read_text()
    assert format_source(expected, src.name) == expected


# ---- every shipped program ---------------------------------------------------------------

SHIPPED = sorted(REPO.glob("stdlib/*.flow")) + sorted(REPO.glob("flows/*.flow"))


@pytest.mark.parametrize("src", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_programs_format_cleanly(src: Path):
    assert_invariants(src.read_text(), str(src))


# ---- layout ---------------------------------------------------------------------------------


def test_spacing_and_indentation():
    src = 'model p=hf("x")\nflow f(a:model,n:int=8){x=g(a,k=[1,2],s=512MB)\nreturn x}'
    assert fmt_(src) == (
        'model p = hf("x")\n'
        "\n"
        "flow f(a: model, n: int = 8) {\n"
        "  x = g(a, k = [1, 2], s = 512MB)\n"
        "  return x\n"
        "}\n"
    )


def test_schedule_statements_in_grammar_spelling():
    src = ("schedule g on cluster(nodes=1){colocate a.train,b on all place a.rollout on p "
           "pool p=gpus(2) a.train=megatron(tp=2) staleness 1 staleness<=4 "
           "resync a via nccl(bucket=512MB) every 1 partial_rollout(over_provision=1.5)}"
           " schedule g auto on cluster(nodes=2) schedule h auto")
    assert fmt_(src) == (
        "schedule g on cluster(nodes = 1) {\n"
        "  colocate a.train, b on all\n"
        "  place a.rollout on p\n"
        "  pool p = gpus(2)\n"
        "  a.train = megatron(tp = 2)\n"
        "  staleness 1\n"
        "  staleness <= 4\n"
        "  resync a via nccl(bucket = 512MB) every 1\n"
        "  partial_rollout(over_provision = 1.5)\n"
        "}\n"
        "\n"
        "schedule g auto on cluster(nodes = 2)\n"
        "\n"
        "schedule h auto\n"
    )


def test_imports_and_declarations_group_other_items_are_separated():
    src = 'import a\nimport "b.flow" as b\nmodel m = f()\ndataset d = f()\nflow x() {}\nflow y() {}\n'
    assert fmt_(src) == (
        'import a\nimport "b.flow" as b\n\nmodel m = f()\ndataset d = f()\n\nflow x() {}\n\nflow y() {}\n'
    )


def test_repeat_and_empty_blocks():
    assert fmt_("flow f() { repeat n until done { x = 1 } repeat 2 { } }") == (
        "flow f() {\n  repeat n until done {\n    x = 1\n  }\n  repeat 2 {}\n}\n"
    )
    # `schedule g auto {}` and `schedule g auto` parse to the same AST.
    assert fmt_("schedule g auto { }") == "schedule g auto\n"


def test_keywords_used_as_names_where_the_grammar_allows_them_round_trip():
    # The contextual lexer reads a keyword as a name where no keyword fits; the
    # formatter prints every token in the same grammatical position, so this survives.
    src = "model auto = f(repeat, via.every, on = 1)\nflow f(flow: int, until: model = schedule) { return place }"
    assert fmt_(src) == (
        "model auto = f(repeat, via.every, on = 1)\n\n"
        "flow f(flow: int, until: model = schedule) {\n  return place\n}\n"
    )


def test_blank_lines_kept_at_most_one_and_never_after_open_or_before_close():
    src = "flow f() {\n\n\n  a = 1\n\n\n\n  b = 2\n  c = 3\n\n}\n\n\n\n# end\n"
    assert fmt_(src) == "flow f() {\n  a = 1\n\n  b = 2\n  c = 3\n}\n\n# end\n"


def test_line_of_exactly_width_stays_one_line_longer_breaks():
    head = "  x = f("
    fits = "flow g() {\n" + head + "a" * (WIDTH - len(head) - 1) + ")\n}\n"
    assert max(len(line) for line in fmt_(fits).split("\n")) == WIDTH
    too_long = "flow g() {\n" + head + "a" * (WIDTH - len(head)) + ")\n}\n"
    assert fmt_(too_long).split("\n")[1:4] == ["  x = f(", "    " + "a" * (WIDTH - len(head)) + ",", "  )"]


def test_breaking_is_recursive_and_only_as_deep_as_needed():
    inner = ", ".join(f"argument_{i}" for i in range(12))
    out = fmt_(f"model m = outer(short, inner({inner}), k = [1, 2])")
    assert out == (
        "model m = outer(\n"
        "  short,\n"
        "  inner(\n" + "".join(f"    argument_{i},\n" for i in range(12)) + "  ),\n"
        "  k = [1, 2],\n"
        ")\n"
    )


def test_long_flow_signature_breaks_one_parameter_per_line():
    params = ", ".join(f"parameter_{i}: int = {i}" for i in range(6))
    out = fmt_(f"flow f({params}) {{ return parameter_0 }}")
    assert out.split("\n")[:3] == ["flow f(", "  parameter_0: int = 0,", "  parameter_1: int = 1,"]
    assert ") {" in out.split("\n")


# ---- comments ---------------------------------------------------------------------------------


def test_own_line_comments_stay_before_what_follows_at_its_indentation():
    src = "# top\nflow f() {\n# a\n      # b\n  x = 1\n        # before close\n}\n# eof\n"
    assert fmt_(src) == "# top\nflow f() {\n  # a\n  # b\n  x = 1\n  # before close\n}\n# eof\n"


def test_trailing_comments_stay_trailing_with_two_spaces():
    src = "flow f() {   # head\n  x = 1 # one\n  repeat 2 {# rep\n y = 2#two\n }    # end rep\n} # end\n"
    assert fmt_(src) == (
        "flow f() {  # head\n  x = 1  # one\n  repeat 2 {  # rep\n    y = 2  #two\n"
        "  }  # end rep\n}  # end\n"
    )


def test_comments_inside_a_multiline_statement_move_before_it():
    src = "flow f() {\n  x = g(a,  # first\n    # second\n    b)  # after\n}\n"
    assert fmt_(src) == "flow f() {\n  # first\n  # second\n  x = g(a, b)  # after\n}\n"


def test_trailing_comment_on_a_broken_statement_goes_after_its_last_line():
    args = ", ".join(f"argument_{i}" for i in range(10))
    out = fmt_(f"flow f() {{\n  x = g({args})  # note\n}}\n")
    assert "  )  # note" in out.split("\n")


def test_header_comment_of_a_broken_signature_becomes_the_first_body_comment():
    params = ", ".join(f"parameter_{i}: int" for i in range(8))
    out = fmt_(f"flow f({params}) {{  # about f\n  x = 1\n}}\n")
    lines = out.split("\n")
    assert lines[lines.index(") {") + 1] == "  # about f"


def test_empty_block_with_comments_is_not_collapsed():
    assert fmt_("flow f() { # c\n}") == "flow f() {  # c\n}\n"
    assert fmt_("flow f() {\n # c\n}") == "flow f() {\n  # c\n}\n"
    assert fmt_("flow f() {} # c") == "flow f() {}  # c\n"


def test_comment_order_is_preserved_in_a_dense_program():
    # Every token on its own line, a comment after each: all must survive, in order.
    tokens = "flow f ( a : int = 1 ) { x = g ( a , k = [ 1 , 2 ] ) return x }".split()
    src = "".join(f"{t}  # c{i}\n" for i, t in enumerate(tokens))
    out = fmt_(src)
    assert re.findall(r"# c(\d+)", out) == [str(i) for i in range(len(tokens))]


def test_crlf_input():
    assert fmt_("model m = f()  # c\r\n# d\r\n") == "model m = f()  # c\n# d\n"


# ---- literals -----------------------------------------------------------------------------------

P = Span.point("<built>", 1, 1)


def _lit(value, kind, text=""):
    return ast.Literal(value, kind, text, P)


@pytest.mark.parametrize("lit, text", [
    (_lit(1e-6, "float", "1e-6"), "1e-6"),  # the source spelling is kept
    (_lit(1e-6, "float"), "1e-06"),  # no spelling: from the value
    (_lit(2.0, "float", "3.0"), "2.0"),  # a spelling of another value is not trusted
    (_lit(-7, "int"), "-7"),
    (_lit(512 * 10**6, "size", "512MB"), "512MB"),
    (_lit(512 * 2**20, "size"), "512MiB"),
    (_lit(3, "size"), "3B"),
    (_lit(True, "bool"), "true"),
    (_lit('a"b\\c\nd\te', "str"), '"a\\"b\\\\c\\nd\\te"'),
    (_lit("x\\qy", "str", '"x\\qy"'), '"x\\qy"'),
])
def test_literal_spelling(lit, text):
    assert fmt.format_expr(lit) == text
    parsed = parse(f"model m = f({text})").items[0].value.args[0]
    assert (parsed.value, parsed.kind) == (lit.value, lit.kind)


@pytest.mark.parametrize("lit, match", [
    (_lit(float("inf"), "float"), "float literal inf"),
    (_lit(float("nan"), "float"), "float literal nan"),
    (_lit(-1, "size"), "size literal -1"),
    (_lit(1, "complex"), "unknown literal kind 'complex'"),
    (_lit("yes", "bool"), "bool literal"),
])
def test_unprintable_literals_raise(lit, match):
    with pytest.raises(FormatError, match=match):
        fmt.format_expr(lit)


def test_literal_patterns_agree_with_the_grammar():
    grammar = Lark((REPO / "flowrl/syntax/grammar.lark").read_text(), parser="lalr")
    samples = ["0", "007", "1.", "1.5", ".5", "1e5", "1E-5", "1.e3", "2.5e+3", ".5e1", "e5", "1.5.2",
               "1B", "512MB", "1.5GiB", "1.GB", "1KiBx", "3TiB", '""', '"a\\"b"', '"a\\\\"', '"a\\"',
               '"a\nb"', '"\\q"', "1", "-1", "x"]
    for term, ours in [("INT", fmt._INT_RE), ("FLOAT", fmt._FLOAT_RE), ("SIZE", fmt._SIZE_RE),
                       ("STRING", fmt._STRING_RE)]:
        theirs = re.compile(grammar.get_terminal(term).pattern.to_regexp())
        for s in samples:
            unsigned = s[1:] if s.startswith("-") and term in ("INT", "FLOAT") else s
            assert bool(ours.fullmatch(s)) == bool(theirs.fullmatch(unsigned)), (term, s)


# ---- modules built in code and errors -------------------------------------------------------------


def test_module_built_in_code_formats_and_parses_back():
    call = ast.Call("hf", (_lit("m", "str", '"m"'),), (ast.KwArg("dtype", _lit("bf16", "str"), P),), P, P)
    body = (ast.Binding("x", ast.Call("g", (ast.Name("p", P), ast.ListExpr((_lit(1, "int", "1"),), P)), (), P, P), P, P),
            ast.Return(ast.Name("x", P), P))
    module = ast.Module("<built>", (
        ast.Decl("model", "p", call, P, P, P),
        ast.FlowDef("f", (ast.Param("p", "model", None, P), ast.Param("n", "int", _lit(8, "int", "8"), P)), body, P, P),
        ast.ScheduleDef("f", True, None, (ast.Staleness(2, True, P),), P, P),
    ), (), P)
    out = format_module(module)
    assert out == (
        'model p = hf("m", dtype = "bf16")\n\n'
        "flow f(p: model, n: int = 8) {\n  x = g(p, [1])\n  return x\n}\n\n"
        "schedule f auto {\n  staleness <= 2\n}\n"
    )
    # Equal but for the one literal built without its text (it reads back with one).
    dtype = parse(out, "<built>").items[0].value.kwargs[0].value
    assert (dtype.value, dtype.text) == ("bf16", '"bf16"')
    fixed = dataclasses.replace(call, kwargs=(ast.KwArg("dtype", _lit("bf16", "str", '"bf16"'), P),))
    expected = dataclasses.replace(module, items=(dataclasses.replace(module.items[0], value=fixed),) + module.items[1:])
    assert strip_spans(parse(out, "<built>")) == strip_spans(expected)


def test_unknown_node_raises_format_error():
    module = ast.Module("<built>", (ast.Name("x", P),), (), P)
    with pytest.raises(FormatError, match="cannot format top-level item of type Name"):
        format_module(module)


def test_syntax_errors_are_reported_not_formatted():
    with pytest.raises(FlowError, match=r"bad.flow:1:\d+: error\[E\d+\]"):
        format_source("flow f( {", "bad.flow")


def test_empty_and_comment_only_files():
    assert fmt_("") == ""
    assert fmt_("\n\n  \n") == ""
    assert fmt_("\n\n# a   \n\n\n\n# b") == "# a\n\n# b\n"


# ---- random programs ---------------------------------------------------------------------------------

KEYWORDS = {"import", "as", "flow", "schedule", "on", "auto", "colocate", "place", "pool", "staleness",
            "resync", "via", "every", "repeat", "until", "return", "true", "false"}
# Plain strategies (not from_regex, which is slow): short names, and long ones that force line breaks.
names = (st.builds(str.__add__, st.sampled_from("abcxyz_"), st.text("abcxyz019_", max_size=5))
         | st.text("abcdefghijklmnopqrstuvwxyz", min_size=20, max_size=30)).filter(lambda s: s not in KEYWORDS)
digits = st.integers(0, 999).map(str)
exponents = st.builds("{}{}".format, st.sampled_from(["e", "E", "e-", "E+"]), st.integers(0, 20))
floats = st.one_of(
    st.builds("{}.{}{}".format, digits, digits | st.just(""), exponents | st.just("")),
    st.builds("{}{}".format, digits, exponents),
    st.builds(".{}{}".format, digits, exponents | st.just("")),
)
units = st.sampled_from(["B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"])
sizes = st.builds("{}{}{}".format, digits, st.just("") | digits.map(lambda d: "." + d), units)
string_pieces = st.sampled_from(["a", "B", " ", "#", "{", "}", "(", "é", "\t", '\\"', "\\\\", "\\n", "\\t", "\\q"])
Tokens = list[str]


def dotted() -> st.SearchStrategy[Tokens]:
    return st.lists(names, min_size=1, max_size=3).map(lambda ns: [t for n in ns for t in (".", n)][1:])


def join_commas(parts: list[Tokens], trailing: bool) -> Tokens:
    out: Tokens = []
    for i, p in enumerate(parts):
        out += ([","] if i else []) + p
    return out + ([","] if trailing and parts else [])


@st.composite
def exprs(draw, depth: int = 2) -> Tokens:
    kinds = ["name", "int", "float", "size", "str", "bool", "neg"] + (["list", "call", "call"] if depth else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "name":
        return draw(dotted())
    if kind == "int":
        return [str(draw(st.integers(0, 10**12)))]
    if kind == "float":
        return [draw(floats)]
    if kind == "size":
        return [draw(sizes)]
    if kind == "str":
        return ['"' + "".join(draw(st.lists(string_pieces, max_size=6))) + '"']
    if kind == "bool":
        return [draw(st.sampled_from(["true", "false"]))]
    if kind == "neg":
        return ["-", draw(st.sampled_from(["3", "1.5", "1e-6", ".25"]))]
    if kind == "list":
        items = draw(st.lists(exprs(depth - 1), max_size=4))
        return ["[", *join_commas(items, draw(st.booleans())), "]"]
    return draw(calls(depth - 1))


@st.composite
def calls(draw, depth: int = 1) -> Tokens:
    args = draw(st.lists(exprs(depth), max_size=5))
    keys = draw(st.lists(names, max_size=4, unique=True))
    kwargs = [[k, "=", *draw(exprs(depth))] for k in keys]
    return [*draw(dotted()), "(", *join_commas(args + kwargs, draw(st.booleans())), ")"]


@st.composite
def flow_stmts(draw, depth: int = 1) -> Tokens:
    kind = draw(st.sampled_from(["bind", "bind", "call", "return"] + (["repeat"] if depth else [])))
    if kind == "bind":
        return [draw(names), "=", *draw(exprs())]
    if kind == "call":
        return draw(calls())
    if kind == "return":
        return ["return", *draw(exprs())]
    until = ["until", draw(names)] if draw(st.booleans()) else []
    body = draw(st.lists(flow_stmts(depth - 1), max_size=3))
    return ["repeat", *draw(exprs(1)), *until, "{", *[t for s in body for t in s], "}"]


def targets() -> st.SearchStrategy[Tokens]:
    one = st.tuples(names, st.none() | names).map(lambda t: [t[0], ".", t[1]] if t[1] else [t[0]])
    return st.lists(one, min_size=1, max_size=3).map(lambda ts: join_commas(ts, False))


@st.composite
def sched_stmts(draw) -> Tokens:
    kind = draw(st.sampled_from(["colocate", "place", "pool", "layout", "staleness", "resync", "call"]))
    if kind == "colocate":
        return ["colocate", *draw(targets()), *(["on", draw(names)] if draw(st.booleans()) else [])]
    if kind == "place":
        return ["place", *draw(targets()), "on", draw(names)]
    if kind == "pool":
        return ["pool", draw(names), "=", *draw(calls())]
    if kind == "layout":
        return [draw(names), ".", draw(names), "=", *draw(calls())]
    if kind == "staleness":
        return ["staleness", *(["<="] if draw(st.booleans()) else []), str(draw(st.integers(0, 99)))]
    if kind == "resync":
        every = ["every", str(draw(st.integers(1, 9)))] if draw(st.booleans()) else []
        return ["resync", draw(names), "via", *draw(calls()), *every]
    return draw(calls())


@st.composite
def items(draw) -> Tokens:
    kind = draw(st.sampled_from(["import", "decl", "decl", "flow", "flow", "manual", "auto"]))
    if kind == "import":
        target = ['"' + "".join(draw(st.lists(string_pieces, min_size=1, max_size=4))) + '.flow"'] \
            if draw(st.booleans()) else draw(dotted())
        return ["import", *target, *(["as", draw(names)] if draw(st.booleans()) else [])]
    if kind == "decl":
        return [draw(names), draw(names), "=", *draw(exprs())]
    if kind == "flow":
        params = [[draw(names), ":", draw(names), *(["=", *draw(exprs(1))] if draw(st.booleans()) else [])]
                  for _ in range(draw(st.integers(0, 6)))]
        body = draw(st.lists(flow_stmts(), max_size=4))
        return ["flow", draw(names), "(", *join_commas(params, draw(st.booleans())), ")",
                "{", *[t for s in body for t in s], "}"]
    body = [t for s in draw(st.lists(sched_stmts(), max_size=4)) for t in s]
    if kind == "manual":
        return ["schedule", draw(names), "on", *draw(calls()), "{", *body, "}"]
    cluster = ["on", *draw(calls())] if draw(st.booleans()) else []
    block = ["{", *body, "}"] if body or draw(st.booleans()) else []
    return ["schedule", draw(names), "auto", *cluster, *block]


@st.composite
def programs(draw) -> str:
    """A random valid program, its tokens separated by random whitespace and comments."""
    tokens = [t for item in draw(st.lists(items(), max_size=4)) for t in item]
    seps = st.sampled_from([" ", " ", " ", "\n", "  ", "\n\n", "\n\n\n", "\t", "#"])
    out, n = [], 0
    for t in ["", *tokens, ""]:
        sep = draw(seps)
        if sep == "#":  # a trailing or own-line comment with a unique, checkable text
            n += 1
            sep = draw(st.sampled_from([f"  # c{n}\n", f"\n# c{n}\n", f"\n\n    # c{n}   \n\n", f"# c{n}\n"]))
        out += [t, sep]
    return "".join(out)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(programs())
def test_random_programs_round_trip(src: str):
    out = assert_invariants(src)
    assert re.findall(r"# c(\d+)", out) == re.findall(r"# c(\d+)", src)
