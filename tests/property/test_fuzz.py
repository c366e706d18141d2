"""Property tests of the front end: whatever the input, the only error is a positioned FlowError.

Inputs: random bytes, soups of the grammar's tokens, and mutations of valid programs
(a token or character deleted, duplicated, swapped or replaced; random characters
inserted; the text truncated). Each is fed to ``parse`` and to ``check_file`` (every
flow of the file through every pass). The properties:

* nothing but :class:`FlowError` escapes (no lark, networkx, KeyError, recursion errors);
* every diagnostic has a code ``E###`` (error) or ``W###`` (warning), a one-line message and
  a span with line >= 1 and column >= 1 that lies inside the file it names, and it renders;
* a program the compiler accepts has a well-formed IR (``lint`` finds nothing) that prints,
  and its warnings are well formed too.

Hypothesis runs derandomized (``derandomize=True`` in the ``flowrl-fuzz`` profile), so
every run tries the same examples. Extreme shapes (deep nesting, megabyte lines, huge
flows) are separate tests with a timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowrl.compiler.pipeline import check_file, compile_text
from flowrl.diagnostics import FlowError, render_all
from flowrl.ir.lint import lint
from flowrl.catalog.ops import LOSSES, OPS, PARAM_TYPES
from flowrl.ir.printer import print_graph
from flowrl.syntax.parser import MAX_NESTING, parse

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"

settings.register_profile(
    "flowrl-fuzz",
    derandomize=True,  # the same examples on every run: failures reproduce, CI is stable
    deadline=None,  # a first call pays for building the parser tables
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ = settings.get_profile("flowrl-fuzz")

_CODE = re.compile(r"^[EW]\d{3}$")


# ---- the checker ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir():
    """A directory holding the fuzzed file next to copies of the golden helper libraries."""
    old = os.environ.get("FLOWRL_STDLIB")
    os.environ["FLOWRL_STDLIB"] = str(GOLDEN / "stdlib")
    with tempfile.TemporaryDirectory(prefix="flowrl-fuzz-") as d:
        shutil.copytree(GOLDEN / "valid" / "lib", Path(d) / "lib", symlinks=True)
        (Path(d) / "data").symlink_to(REPO / "data")  # datasets are checked: `data/arith/...` exists
        for module in (GOLDEN / "valid").glob("*.py"):  # and so are the modules of `call(...)`
            shutil.copy(module, Path(d) / module.name)
        for extra in (*(GOLDEN / "valid").glob("*.parquet"), GOLDEN / "valid" / "models"):  # checked resources too
            (Path(d) / extra.name).symlink_to(extra)
        yield Path(d)
    if old is None:
        os.environ.pop("FLOWRL_STDLIB", None)
    else:
        os.environ["FLOWRL_STDLIB"] = old


def _lines_of(path: str, workdir: Path) -> list[str] | None:
    for base in (workdir, REPO, GOLDEN):
        p = base / path
        if p.is_file():
            return p.read_bytes().decode("utf-8", errors="replace").split("\n")
    return None


def assert_well_formed(err: FlowError, workdir: Path) -> None:
    """Every diagnostic is coded, positioned inside the file it names, and renders."""
    assert err.diagnostics and err.errors, "a FlowError without errors"
    rendered = err.render()
    assert isinstance(rendered, str) and str(err) == rendered
    assert_positioned(err.diagnostics, rendered, workdir)


def assert_positioned(diagnostics, rendered: str, workdir: Path) -> None:
    for d in diagnostics:
        assert _CODE.match(d.code) and d.code[0] == ("E" if d.is_error else "W"), d
        assert d.message and "\n" not in d.message, d
        s = d.span
        assert s.line >= 1 and s.column >= 1, d
        assert (s.end_line, s.end_column) >= (s.line, s.column), d
        assert f"{d.severity}[{d.code}]" in rendered
        lines = _lines_of(s.path, workdir)
        if lines is not None and d.code not in ("E003", "E124"):
            assert s.line <= len(lines), d
            assert s.column <= len(lines[s.line - 1]) + 1, d


def _write(workdir: Path, text: str) -> Path:
    path = workdir / "fuzz.flow"
    path.write_text(text)
    return path


def check_source(source: str | bytes, workdir: Path) -> dict | None:
    """``parse`` and ``check_file`` the source; only positioned FlowErrors may come out.

    Returns the compiled graphs, or None when the source was (rightly) rejected."""
    data = source.encode("utf-8", errors="surrogatepass") if isinstance(source, str) else source
    try:
        parse(data, "fuzz.flow")
    except FlowError as e:
        assert all(d.span.path == "fuzz.flow" for d in e.diagnostics)
    path = workdir / "fuzz.flow"
    path.write_bytes(data)
    try:
        graphs = check_file(path)
    except FlowError as e:
        assert_well_formed(e, workdir)
        return None
    for graph in graphs.values():
        assert lint(graph) == [], print_graph(graph)
        assert print_graph(graph).startswith(f"flow {graph.name}(")
        assert all(not w.is_error for w in graph.warnings)
        assert_positioned(graph.warnings, render_all(graph.warnings, graph.sources), workdir)
    return graphs


# ---- random bytes -------------------------------------------------------------------------


@settings(FUZZ, max_examples=400)
@given(st.binary(max_size=600))
def test_random_bytes(workdir, data):
    check_source(data, workdir)


@settings(FUZZ, max_examples=300)
@given(st.text(max_size=300))
def test_random_unicode_text(workdir, text):
    check_source(text, workdir)


# ---- token soups ------------------------------------------------------------------------

KEYWORDS = ["import", "as", "flow", "return", "repeat", "until", "schedule", "on", "auto", "colocate",
            "place", "pool", "staleness", "resync", "via", "every", "true", "false", "model", "dataset",
            "reward", "env", "stdlib", "stdlib.grpo", "main"]
PUNCT = ["(", ")", "{", "}", "[", "]", ",", "=", ":", ".", "-", "<=", "\n", "#c\n",
         # other languages' syntax, which gets messages of its own
         "*", "/", "+", "%", "**", "==", "!=", "<", ">", ";", "\\", "//c\n", "/* c */", "`"]
LITERALS = ["0", "1", "4", "-1", "0.5", "1e-3", ".5", "512MB", "2GiB", '"x"', '"a\\"b"', '"data/x.jsonl"',
            '"mod:fn"', '"', "'s'", "@", "\t", "\x00", "é", "True", "False", "None", "1_000"]
NAMES = ["policy", "ref", "b", "r", "s", "adv", "lp", "vf", "calc", "arith", "exact", "done", "group", "n",
         "x", "train", "rollout", "all", "gen", "cluster", "gpus", "vllm", "megatron", "fsdp", "nccl",
         "partial_rollout", "grpo", "g.grpo", "steps.train"]
VOCAB = KEYWORDS + PUNCT + LITERALS + NAMES + sorted(OPS) + sorted(LOSSES) + list(PARAM_TYPES)


@settings(FUZZ, max_examples=400)
@given(st.lists(st.sampled_from(VOCAB), max_size=60), st.sampled_from([" ", "\n", ""]))
def test_token_soup(workdir, tokens, sep):
    check_source(sep.join(tokens), workdir)


# Statement-shaped soups reach the later passes far more often than raw token soups.
STATEMENTS = [
    'model policy = tiny(task = "arith")', 'model policy = hf("m")', 'dataset arith = jsonl("d.jsonl")',
    'reward exact = verifier("math")', 'env calc = python_env("m:C")', "model ref = frozen(policy)",
    'import "lib/steps.flow" as steps', "import stdlib.grpo as g", "import stdlib.rollouts",
]
BODY = [
    "b = sample(arith, size = 8)", "r = generate(policy, b, n = 4)", "r = generate(policy, b)",
    "s = exact(r)", "s = score(exact, r)", "lp = logprobs(policy, r)", "ref = frozen(policy)",
    "rl = logprobs(ref, r)", "vf = critic(policy)", "v = values(vf, r)", "adv = group_advantage(s, group = 4)",
    "adv = rloo(s, group = 2)", "adv = gae(s, v, r)", "adv = reinforce_pp(s, r)", "s = kl_penalty(s, lp, rl, r)",
    "update(policy, r, adv, lp)", "update(policy, r, adv, loss = pg())", "update(vf, r, adv, v, loss = value_clip(0.2))",
    "update(ref, r, adv, lp)", "o = env_step(calc, r)", "repeat 2 until done { o = env_step(calc, r)  r = generate(policy, o) }",
    'u = call("m:f", r, s, produces = ["rewards"])', "g.grpo(policy, arith, exact, group = 2)",
    "steps.train(policy, arith, exact)", "y = rollout(policy, arith)", "return r",
    "helper(policy, arith)", "resync(policy)",
]
SCHEDULE = [
    "pool gen = gpus(gpus = 2)", "colocate policy.train, ref on all", "place policy.rollout on gen",
    "policy.train = fsdp(dp = 2)", "policy.rollout = vllm(tp = 1)", "ref = torch()", "staleness 1",
    "staleness <= 2", "resync policy via nccl(bucket = 512MB) every 1", "partial_rollout(over_provision = 1.5)",
    "staleness -1", "staleness = 2", "resync policy via nccl() every -1",
]


@st.composite
def statement_programs(draw):
    header = draw(st.lists(st.sampled_from(STATEMENTS), max_size=6))
    helper = draw(st.booleans())
    body = draw(st.lists(st.sampled_from(BODY), max_size=10))
    text = "\n".join(header) + "\n"
    if helper:
        text += "flow helper(m: model, d: dataset) { b = sample(d)  r = generate(m, b)  return r }\n"
    text += "flow main() {\n  " + "\n  ".join(body) + "\n}\n"
    if draw(st.booleans()):
        auto = draw(st.booleans())
        text += ("schedule main auto {\n  " if auto else "schedule main on cluster(nodes = 1, gpus_per_node = 2) {\n  ")
        text += "\n  ".join(draw(st.lists(st.sampled_from(SCHEDULE), max_size=5))) + "\n}\n"
    return text


@settings(FUZZ, max_examples=300)
@given(statement_programs())
def test_statement_soup(workdir, text):
    check_source(text, workdir)


# ---- mutations of valid programs -------------------------------------------------------------

SEEDS = [p.read_text() for p in sorted((GOLDEN / "valid").glob("*.flow"))]
_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?[A-Za-z]*'
                    r"|<=|\s+|.", re.S)


def tokens_of(text: str) -> list[str]:
    return _TOKEN.findall(text)


@st.composite
def mutated_programs(draw):
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 3))):
        text = draw(_mutation(text))
    return text


def _mutation(text: str):
    toks = tokens_of(text)
    n = len(toks)
    if n == 0:  # an earlier mutation truncated everything
        return st.just(text)
    idx = st.integers(0, max(n - 1, 0))
    pos = st.integers(0, len(text))

    def edit(f):
        return idx.map(lambda i: "".join(f(list(toks), i)))

    def delete(t, i):
        del t[i]
        return t

    def duplicate(t, i):
        t.insert(i, t[i])
        return t

    def shorten(t, i):  # `policy` -> `polic`: misspelt names reach the later passes
        t[i] = t[i][:-1]
        return t

    return st.one_of(
        edit(delete),
        edit(duplicate),
        edit(shorten),
        st.tuples(idx, idx).map(lambda ij: "".join(_swap(list(toks), *ij))),
        st.tuples(idx, st.sampled_from(VOCAB)).map(lambda iv: "".join(toks[:iv[0]] + [iv[1]] + toks[iv[0] + 1:])),
        pos.map(lambda p: text[:p] + text[p + 1:]),
        pos.map(lambda p: text[:p] + text[p:p + 1] + text[p:]),
        st.tuples(pos, pos).map(lambda ab: _swap_chars(text, *sorted(ab))),
        st.tuples(pos, st.text(min_size=1, max_size=4)).map(lambda pc: text[:pc[0]] + pc[1] + text[pc[0]:]),
        pos.map(lambda p: text[:p]),
    )


def _swap_chars(text: str, i: int, j: int) -> str:
    if j >= len(text) or i == j:
        return text
    return text[:i] + text[j] + text[i + 1:j] + text[i] + text[j + 1:]


def _swap(t: list[str], i: int, j: int) -> list[str]:
    t[i], t[j] = t[j], t[i]
    return t


@settings(FUZZ, max_examples=350)
@given(mutated_programs())
def test_mutated_valid_programs(workdir, text):
    check_source(text, workdir)


def test_seeds_are_valid(workdir):
    """The mutation seeds compile cleanly (so mutations start from real programs)."""
    assert len(SEEDS) >= 8
    for text in SEEDS:
        assert check_source(text, workdir), text.splitlines()[0]


def test_mutations_reach_every_pass(workdir):
    """Guard against a fuzzer that only exercises the parser: deleting a token, or the last
    character of a name, in the seeds produces diagnostics of syntax (E0xx), names (E1xx),
    types (E2xx) and schedules (E4xx). (Role errors, E3xx, come from the statement soups.)"""
    stages = set()
    for name in ("grpo", "ppo_critic", "multi_turn", "schedule_all"):
        text = (GOLDEN / "valid" / f"{name}.flow").read_text()
        toks = tokens_of(text)
        for i, tok in enumerate(toks):
            if tok.isspace() or tok.startswith("#"):
                continue
            variants = [toks[:i] + toks[i + 1:]]
            if tok.isidentifier() and len(tok) > 1:
                variants.append(toks[:i] + [tok[:-1]] + toks[i + 1:])
            for variant in variants:
                try:
                    check_file(_write(workdir, "".join(variant)))
                except FlowError as e:
                    stages |= {d.code[1] for d in e.diagnostics}
    assert stages >= {"0", "1", "2", "4"}, stages


# ---- extreme shapes ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opener,closer", [("(", ")"), ("[", "]"), ("{", "}")])
def test_deep_nesting_is_rejected_quickly(workdir, opener, closer):
    text = "flow main() { x = f" + opener * 200_000 + closer * 200_000 + " }"
    with pytest.raises(FlowError) as info:
        compile_text(text, "deep.flow")
    assert [d.code for d in info.value.diagnostics] == ["E004"]
    assert info.value.diagnostics[0].span.line == 1


@pytest.mark.timeout(120)
def test_nesting_at_the_limit_is_parsed(workdir):
    """Lists nested MAX_NESTING - 2 deep (inside the flow's braces and the call's
    parentheses) get through the parser: the limit guards it, not ordinary programs."""
    depth = MAX_NESTING - 2
    text = ('dataset d = jsonl("x")\nflow main() { b = sample(d)  u = call("m:f", b, produces = '
            + "[" * depth + "]" * depth + ") }")
    module = parse(text, "limit.flow")
    value = module.items[1].body[1].value.kwargs[0].value
    for _ in range(depth - 1):
        value = value.items[0]
    assert value.items == ()


@pytest.mark.timeout(120)
def test_nested_repeat_is_rejected_at_any_depth(workdir):
    depth = 30
    body = "o = env_step(calc, r)  r = generate(policy, o)"
    for _ in range(depth):
        body = f"repeat 2 until done {{ {body} }}"
    text = ('model policy = tiny(task = "arith")\ndataset arith = jsonl("x")\nenv calc = python_env("m:C")\n'
            f"flow main() {{ b = sample(arith)  r = generate(policy, b)  {body} }}\n")
    with pytest.raises(FlowError) as info:
        compile_text(text, "loops.flow")
    assert [d.code for d in info.value.diagnostics] == ["E020"] * (depth - 1)


@pytest.mark.timeout(120)
def test_many_loops_in_sequence(workdir):
    loops = "  ".join("repeat 2 until done { o = env_step(calc, r)  r = generate(policy, o) }" for _ in range(200))
    text = ('model policy = tiny(task = "arith")\ndataset arith = jsonl("x")\nenv calc = python_env("m:C")\n'
            f"flow main() {{ b = sample(arith)  r = generate(policy, b)  {loops} }}\n")
    graph = compile_text(text, "loops.flow")
    assert lint(graph) == []
    assert len(graph.regions) == 200
    assert sum(e.kind.value == "turn" for _, _, e in graph.edges()) == 200


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["name", "string", "comment", "number", "spaces"])
def test_megabyte_lines(workdir, kind):
    """A 1M-character line of one token: parsed in linear time; errors quote a window of it."""
    big = {"name": "x" * 1_000_000, "string": '"' + "s" * 1_000_000 + '"', "comment": "#" + "c" * 1_000_000,
           "number": "9" * 1_000_000, "spaces": " " * 1_000_000}[kind]
    text = f"flow main() {{ y = unknown_op({big}) }}\n"
    with pytest.raises(FlowError) as info:
        compile_text(text, "long.flow")
    rendered = info.value.render()
    assert max(len(line) for line in rendered.splitlines()) < 400
    assert_well_formed(info.value, workdir)


@pytest.mark.timeout(120)
def test_many_statements_on_one_line(workdir):
    """5,000 statements on a single 200 KB line compile (the IR does not care about layout);
    nothing reads them, so each is warned about once and removed."""
    stmts = "  ".join(f"b{i} = sample(arith, size = {i + 1})" for i in range(5000))
    text = f'dataset arith = jsonl("x")\nflow main() {{ {stmts} }}\n'
    assert len(list(compile_text(text, "oneline.flow", until="check_roles").nodes())) == 5001
    graph = compile_text(text, "oneline.flow")
    assert list(graph.nodes()) == [] and [w.code for w in graph.warnings] == ["W001"] * 5000
    assert [w.span.column for w in graph.warnings][:2] == [15, 45]


@pytest.mark.timeout(120)
def test_many_errors_render_in_reasonable_time(workdir):
    """2,000 unknown names: every one is reported, each with its position."""
    stmts = "\n".join(f"  b{i} = sample(missing{i})" for i in range(2000))
    with pytest.raises(FlowError) as info:
        compile_text(f"flow main() {{\n{stmts}\n}}\n", "errors.flow")
    diags = info.value.diagnostics
    assert len(diags) == 2000 and {d.code for d in diags} == {"E101"}
    assert [d.span.line for d in diags] == list(range(2, 2002))
    assert info.value.render().count("error[E101]") == 2000
