"""The Python builder (flowrl.builder.Flow): programs written with it mean what the same
program written as text means.

The builder writes an AST module and hands it to the compiler's one front end, so its graphs are
the text's by construction (test_mirror.py replays every stdlib/ and flows/ file). Here: what
the writer makes of Python's freedom (unnamed values, handles of re-bound names, loops), the
text round trip (``to_flow_text()`` compiles to the same IR), schedules, plans, and diagnostics
positioned at the Python lines.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from builder_kit import assert_same_graph, nospan
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flowrl import Flow
from flowrl.builder import BuilderError, ctor, size
from flowrl.compiler.pipeline import compile_text
from flowrl.diagnostics import FlowError
from flowrl.ir.graph import EdgeKind

HERE = str(Path(__file__))


def assert_round_trip(f: Flow, path: str = "<builder-text>") -> str:
    """``f.to_flow_text()`` parses and compiles to the IR ``f.compile()`` gives."""
    text = f.to_flow_text()
    assert_same_graph(f.compile(), compile_text(text, path, flow=f.name))
    return text


# ---- imports, declarations, flow calls -----------------------------------------------------------

MAIN_TEXT = """
import stdlib.grpo as g
model policy = tiny(task = "arith", hidden = 64, heads = 2)
dataset arith = jsonl("data/arith/train.jsonl", prompt = "prompt", answer = "answer")
reward exact = verifier("math")
flow main(group: int = 4, lr: float = 1e-4) {
  g.grpo(policy, arith, exact, group = group, max_tokens = 8, lr = lr)
}
"""


def build_main() -> Flow:
    f = Flow("main", params=[("group", "int", 4), ("lr", "float", 1e-4)])
    g = f.import_("stdlib.grpo", alias="g")
    policy = f.declare("model", "policy", "tiny", task="arith", hidden=64, heads=2)
    arith = f.declare("dataset", "arith", "jsonl", "data/arith/train.jsonl", prompt="prompt", answer="answer")
    exact = f.declare("reward", "exact", "verifier", "math")
    group, lr = f.params
    g.grpo(policy, arith, exact, group=group, max_tokens=8, lr=lr)
    return f


def test_imports_declarations_and_flow_calls_match_text():
    f = build_main()
    compiled = f.compile()
    assert_same_graph(compiled, compile_text(MAIN_TEXT, "<main>", flow="main"))
    assert compiled.node("grpo.rollouts").attr("n").value == 4  # inlined with ids prefixed `grpo.`
    assert_round_trip(f)


def test_call_flow_by_name_equals_the_import_handle():
    f = Flow("main", params=[("group", "int", 4), ("lr", "float", 1e-4)], imports=[("stdlib.grpo", "g")])
    policy = f.declare("model", "policy", "tiny", task="arith", hidden=64, heads=2)
    arith = f.declare("dataset", "arith", "jsonl", "data/arith/train.jsonl", prompt="prompt", answer="answer")
    exact = f.declare("reward", "exact", "verifier", "math")
    group, lr = f.params
    f.call_flow("g.grpo", policy, arith, exact, group=group, max_tokens=8, lr=lr)
    assert_same_graph(f.compile(), build_main().compile())
    assert_same_graph(f.graph(), build_main().graph(), raw=True)


def build_two_level() -> tuple[Flow, Flow]:
    inner = Flow("rollout", params=[("policy", "model"), ("prompts", "dataset"), ("n", "int", 2)])
    policy, prompts, n = inner.params
    batch = inner.sample(prompts, size=8, name="batch")
    inner.returns(inner.generate(policy, batch, n=n, max_tokens=size("16B").bytes))
    outer = Flow("main", params=[("policy", "model", ctor("tiny", task="arith")),
                                 ("prompts", "dataset", ctor("jsonl", "d.jsonl")), ("reward", "reward")])
    policy, prompts, reward = outer.params
    r = outer.call_flow(inner, policy, prompts, n=4, name="r")
    scores = reward(r, name="scores")
    outer.update(policy, r, outer.group_advantage(scores, group=4), loss=outer.pg())
    return inner, outer


TWO_LEVEL_TEXT = """
flow rollout(policy: model, prompts: dataset, n: int = 2) {
  batch = sample(prompts, size = 8)
  return generate(policy, batch, n = n, max_tokens = 16)
}
flow main(policy: model = tiny(task = "arith"), prompts: dataset = jsonl("d.jsonl"), reward: reward) {
  r = rollout(policy, prompts, n = 4)
  scores = reward(r)
  update(policy, r, group_advantage(scores, group = 4), loss = pg())
}
"""


def test_builder_flow_calling_a_builder_flow():
    inner, outer = build_two_level()
    compiled = outer.compile()
    assert_same_graph(compiled, compile_text(TWO_LEVEL_TEXT, "<two>", flow="main"))
    assert compiled.node("rollout.generate").attr("n").value == 4
    text = assert_round_trip(outer)
    assert text.index("flow rollout(") < text.index("flow main(")
    assert_same_graph(inner.compile(), compile_text(TWO_LEVEL_TEXT, "<two>", flow="rollout"))


def test_user_calls_lists_and_size_parameters_match_text():
    text = """flow f(prompts: dataset, buf: size = 512MB, tags: list = ["a", "b"]) {
      b = sample(prompts, size = 2)
      x = call("mod:fn", b, 3, produces = ["f", "g"])
      call("mod:log", x, produces = [])
    }"""
    f = Flow("f", params=[("prompts", "dataset"), ("buf", "size", size("512MB")), ("tags", "list", ["a", "b"])])
    prompts = f.params.prompts
    b = f.sample(prompts, size=2, name="b")
    x = f.call("mod:fn", b, 3, produces=["f", "g"], name="x")
    f.call("mod:log", x, produces=[])
    assert_same_graph(f.graph(), compile_text(text, "<t>", until="build"), raw=True)
    compiled = f.compile()
    assert_same_graph(compiled, compile_text(text, "<t>"))
    assert compiled.node("x").fields >= {"f", "g"}
    assert "buf: size = 512MB" in assert_round_trip(f)


def test_nested_calls_build_the_parsers_raw_graph():
    text = """flow f(policy: model, prompts: dataset) {
      r = generate(policy, sample(prompts, size = 4), n = 2)
      lp = logprobs(frozen(policy), r)
      update(policy, r, group_advantage(score(verifier("math"), r), group = 2), lp)
    }"""
    f = Flow("f", params=[("policy", "model"), ("prompts", "dataset")])
    policy, prompts = f.params
    r = f.generate(policy, f.sample(prompts, size=4), n=2, name="r")
    lp = f.logprobs(f.frozen(policy), r, name="lp")
    f.update(policy, r, f.group_advantage(f.verifier("math")(r), group=2), lp)
    assert_same_graph(f.graph(), compile_text(text, "<nested>", until="build"), raw=True)
    assert [n.id for n in f.graph().nodes()] == ["sample", "r", "frozen", "lp", "verifier", "score",
                                                 "group_advantage", "update"]
    assert_same_graph(f.compile(), compile_text(text, "<nested>"))
    text = assert_round_trip(f)
    assert "lp = logprobs(frozen(policy), r)" in text
    assert "group_advantage(score(verifier(\"math\"), r), group = 2)" in text


def test_bind_repeat_and_return():
    f = Flow("loop", params=[("policy", "model"), ("prompts", "dataset"), ("tools", "env"), ("turns", "int", 3)])
    policy, prompts, tools, turns = f.params
    convo = f.generate(policy, f.sample(prompts), n=2, name="convo")
    loss = f.bind("loss", f.ppo_clip(0.3))
    k = f.bind("k", turns)  # an alias of the parameter (`repeat k` would hit a resolve_names bug: E101)
    with f.repeat(turns, until="done"):
        obs = f.env_step(tools, convo, name="obs")
        convo = f.generate(policy, f.env_step(tools, obs), name="convo")
    f.update(policy, convo, f.group_advantage(f.score(f.verifier("exact"), convo), group=2),
             f.logprobs(policy, convo), loss=loss)
    f.returns(convo)
    text = assert_round_trip(f)
    raw = f.graph()
    assert set(raw.regions) == {"repeat1"} and raw.regions["repeat1"].count.target == "turns"
    compiled = f.compile()
    turns_edges = sorted((u, v) for u, v, e in compiled.edges() if e.kind == EdgeKind.TURN)
    assert turns_edges == [("convo#2", "obs")]
    assert compiled.node("convo#2").args[1].target == "env_step"  # nested, inside the loop
    assert compiled.node("env_step").region == "repeat1" and raw.returns.target == "convo"
    assert "repeat turns until done {" in text and "k = turns" in text and "return convo" in text
    assert k.type == "int" and compiled.node("update").attr("loss").get("clip") == 0.3


def test_nested_repeat_is_rejected_like_text():
    f = Flow("loop", params=[("policy", "model"), ("prompts", "dataset"), ("tools", "env")])
    policy, prompts, tools = f.params
    convo = f.generate(policy, f.sample(prompts), name="convo")
    with f.repeat(2, until="done"):
        with f.repeat(3):
            convo = f.generate(policy, f.env_step(tools, convo), name="convo")
    assert f.graph().regions["repeat2"].parent == "repeat1"
    with pytest.raises(FlowError) as built:
        f.compile()
    with pytest.raises(FlowError) as parsed:
        compile_text(f.to_flow_text(), "<t>", flow="loop")
    # the parser rejects the text already (E020); the pass that checks graphs says E217
    assert [d.code for d in parsed.value.diagnostics] == ["E020"]
    assert [d.code for d in built.value.diagnostics] == ["E217"]
    assert built.value.diagnostics[0].span.path == HERE


def test_return_is_the_value_handed_in_even_if_its_name_is_rebound():
    f = Flow("ret", params=[("prompts", "dataset")])
    (prompts,) = f.params
    first = f.sample(prompts, size=1, name="b")
    f.returns(first)
    f.sample(prompts, size=2, name="b")
    assert f.graph().returns.target == "b_1"          # `b` now names the second sample: an alias
    text = assert_round_trip(f)
    assert "b_1 = b" in text and "return b_1" in text
    g = Flow("ret", params=[("prompts", "dataset")])
    g.returns(g.sample(g.params.prompts, size=1, name="b"))
    assert g.graph().returns.target == "b"            # as `return b` in text
    outer = Flow("outer", params=[("prompts", "dataset")])
    x = outer.call_flow(f, outer.params.prompts, name="x")
    outer.bind("y", x)
    assert nospan(outer.compile(until="check_roles").node("ret.b").attr("size")).value == 1  # before dead code goes


def test_declarations_take_nested_constructors_and_other_declarations():
    f = Flow("main")
    policy = f.declare("model", "policy", "tiny", task="arith")
    rm = f.declare("reward", "rm", "reward_model", ctor("frozen", policy))
    data = f.declare("dataset", "d", "jsonl", "d.jsonl")
    r = f.generate(policy, f.sample(data, size=2), name="r")
    rm(r, name="s")
    text = assert_round_trip(f)
    assert "reward rm = reward_model(frozen(policy))" in text
    compiled = f.compile(until="check_roles")  # nothing reads `s`: the dead-code pass would remove it
    assert compiled.node("s").op == "score" and compiled.node("rm").op == "reward_model"
    with pytest.raises(BuilderError, match="a constructor takes constants"):
        f.declare("model", "m2", "frozen", r)


# ---- to_flow_text for values Python hands around freely ----------------------------------------------


def test_unnamed_values_used_twice_or_out_of_order_keep_their_ids():
    f = Flow("free", params=[("policy", "model"), ("prompts", "dataset"), ("reward", "reward")])
    policy, prompts, reward = f.params
    ref = f.frozen(policy)                        # used twice: bound to its op name
    batch = f.sample(prompts, size=4)             # used once, but not right before its consumer
    other = f.sample(prompts, size=2)
    rollouts = f.generate(policy, batch, name="rollouts")
    f.logprobs(ref, rollouts)
    f.logprobs(ref, f.generate(policy, other))
    text = assert_round_trip(f)
    assert "frozen = frozen(policy)" in text and "sample = sample(prompts, size = 4)" in text
    ids = [n.id for n in f.compile(until="check_roles").nodes()]  # before dead code goes
    assert ids[:8] == ["policy", "prompts", "reward", "frozen", "sample", "sample#2", "rollouts", "logprobs"]


def test_handles_of_rebound_names_go_through_an_alias():
    f = Flow("shadow", params=[("policy", "model"), ("prompts", "dataset")])
    policy, prompts = f.params
    first = f.sample(prompts, size=1, name="b")
    second = f.sample(prompts, size=2, name="b")
    f.generate(policy, second, name="g2")
    f.generate(policy, first, name="g1")          # `b` means the second sample by now
    text = assert_round_trip(f)
    assert "b_1 = b" in text and "generate(policy, b_1)" in text
    compiled = f.compile(until="check_roles")  # nothing reads g1, g2: before dead code goes
    assert compiled.node("g1").args[1].target == "b" and compiled.node("g2").args[1].target == "b#2"


def test_handles_inside_a_loop_follow_the_names_like_text():
    """A handle used in a loop while its name is current there is the previous turn's value
    (a TURN edge, as `env_step(tools, convo)` in text); used after the loop re-bound its name,
    the same handle means the value before the loop (text reaches it through an alias)."""
    f = Flow("carry", params=[("policy", "model"), ("prompts", "dataset"), ("tools", "env")])
    policy, prompts, tools = f.params
    first = f.generate(policy, f.sample(prompts), name="convo")
    with f.repeat(2, until="done"):
        f.generate(policy, f.env_step(tools, first), name="convo")
        f.env_step(tools, first, name="again")
    text = assert_round_trip(f)
    compiled = f.compile()
    assert [(u, v) for u, v, e in compiled.edges() if e.kind == EdgeKind.TURN] == [("convo#2", "env_step")]
    assert compiled.node("again").args[1].target == "convo"
    assert "convo_1 = convo" in text and "again = env_step(tools, convo_1)" in text


def test_unnamed_result_used_twice_whose_op_name_is_a_parameter():
    """An unnamed `reward(r)` used twice is bound to `reward` when nothing looks the parameter
    up afterwards (ids stay identical); when something does, it gets a fresh name, the one
    case where the text changes a node id (everything else stays the same)."""
    f = Flow("taken", params=[("policy", "model"), ("prompts", "dataset"), ("reward", "reward")])
    policy, prompts, reward = f.params
    r = f.generate(policy, f.sample(prompts), n=2, name="r")
    scores = reward(r)
    f.group_advantage(scores, group=2, name="a1")
    f.rloo(scores, group=2, name="a2")
    assert "reward = reward(r)" in assert_round_trip(f)

    reward(f.generate(policy, f.sample(prompts), n=2), name="later")  # `reward` is looked up again
    text = f.to_flow_text()
    assert "reward_1 = reward(r)" in text and "rloo(reward_1, group = 2)" in text
    a, b = f.compile(), compile_text(text, "<t>", flow="taken")
    rename = {"reward_1": "reward#2"}  # the builder's id (the parameter is node `reward`)
    assert [rename.get(n.id, n.id) for n in b.nodes()] == [n.id for n in a.nodes()]
    same = {n.id: nospan(dataclasses.replace(n, id="", args=())) for n in a.nodes()}
    assert all(nospan(dataclasses.replace(n, id="", args=())) == same[rename.get(n.id, n.id)] for n in b.nodes())


NAMES = [None, None, None, "a", "b", "convo"]


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_random_builder_programs_round_trip_through_text(data):
    """Random programs with named, unnamed, nested, re-bound and loop-carried values: every
    handle passed to an op is the value that op reads in the compiled graph (whatever name,
    nesting or alias the writer chose to spell it), and the text of each program compiles to
    the same IR (or fails with the same codes)."""
    f = Flow("rand", params=[("policy", "model"), ("prompts", "dataset"), ("reward", "reward"), ("tools", "env")])
    policy, prompts, reward, tools = f.params
    pools = {"model": [policy], "prompts": [], "rollouts": [], "reward": [reward], "data": []}
    draw = data.draw
    reads: list[tuple] = []  # (the op's handle, the handles passed as its positional arguments)

    def call(method, *args, **kwargs):
        v = method(*args, **kwargs)
        reads.append((v, args))
        return v

    def name(choices=NAMES):
        return draw(st.sampled_from(choices))

    def get(kind):
        if pools[kind] and draw(st.booleans()):
            return draw(st.sampled_from(pools[kind]))
        return make(kind)

    def make(kind):
        if kind == "model":
            v = call(f.frozen, policy, name=name())
        elif kind == "prompts":
            v = f.sample(prompts, size=draw(st.integers(1, 3)), name=name())
        elif kind == "reward":
            v = f.verifier("exact", name=name())
        else:
            v = call(f.generate, get("model"), get("prompts"), name=name())
            pools["prompts"].append(v)
        pools[kind].append(v)
        return v

    def score():
        r = get("reward")
        if r.name is not None:  # `r(x)` by name: named (unnamed and reused, it may change an id, see above)
            return r(get("rollouts"), name=name(["a", "b", "scores"]))
        return r(get("rollouts"), name=name())  # an unnamed verifier: score(verifier(...), x)

    def step():
        kind = draw(st.sampled_from(["model", "prompts", "rollouts", "score", "logprobs", "bind", "repeat",
                                     "return"]))
        if kind in ("model", "prompts", "rollouts"):
            make(kind)
        elif kind == "score":
            pools["data"].append(score())
        elif kind == "logprobs":
            pools["data"].append(call(f.logprobs, get("model"), get("rollouts"), name=name()))
        elif kind == "bind":
            src = draw(st.sampled_from(["model", "prompts", "rollouts"]))
            if pools[src]:
                pools[src].append(f.bind(name(["a", "b", "convo"]), draw(st.sampled_from(pools[src]))))
        elif kind == "return" and pools["rollouts"]:
            f.returns(draw(st.sampled_from(pools["rollouts"])))
        elif kind == "repeat" and f._region is None:
            with f.repeat(draw(st.integers(1, 3)), until="done"):
                for _ in range(draw(st.integers(1, 3))):
                    obs = call(f.env_step, tools, get("rollouts"), name=name([None, "obs", "a"]))
                    pools["prompts"].append(obs)
                    pools["rollouts"].append(call(f.generate, get("model"), obs, name=name()))

    for _ in range(draw(st.integers(1, 8))):
        step()
    if pools["rollouts"] and draw(st.booleans()):
        f.returns(draw(st.sampled_from(pools["rollouts"])))
    if draw(st.integers(0, 3)):  # mostly, an effect reads every value (the dead-code pass keeps them)
        f.call("mod:log", *pools["rollouts"], *pools["data"], produces=[])
    text = f.to_flow_text()
    for what, seen in [("alias", re.search(r"\b\w+_\d+ = \w+\n", text)), ("generated name", re.search(
            r"\b(frozen|sample|generate|verifier|score|logprobs|env_step) = ", text)),
            ("nested", re.search(r"\((\w+, )?(frozen|sample|generate|verifier|env_step)\(", text)),
            ("repeat", "repeat" in text)]:
        if seen:
            event(what)  # coverage of the writer's cases: pytest --hypothesis-show-statistics
    try:
        resolved = f.compile(until="check_roles")  # before the dead-code pass removes unread values
    except FlowError:
        resolved = None
    if resolved is not None:  # resolve_names drops aliases and may renumber ids (`a#2` -> `a`): match by order
        ops = [op.id for op in f._ops.values() if op.op != "="]
        nodes = [n.id for n in resolved.nodes() if n.id not in {p.name for p in f.params}]
        assert len(ops) == len(nodes)
        graph_id = dict(zip(ops, nodes))
        for v, args in reads:
            node = resolved.node(graph_id[v.node])
            for i, a in enumerate(args):
                assert node.args[i].target == graph_id.get(_denoted(a), _denoted(a)), (v, i, a)
    try:
        expected = f.compile()
    except FlowError as e:
        event("compile error")
        with pytest.raises(FlowError) as again:
            compile_text(text, "<rand>", flow="rand")
        # the same errors (in source order, which differs: Python lines vs text lines); warnings
        # may differ, as the text names values the builder leaves unnamed
        assert sorted(d.code for d in again.value.errors) == sorted(d.code for d in e.errors)
        return
    assert_same_graph(expected, compile_text(text, "<rand>", flow="rand"))
    if any(e.kind == EdgeKind.TURN for _, _, e in expected.edges()):
        event("loop-carried edge")
    if f.graph().returns is not None:  # what `return` resolves to shows only in a caller
        event("return")
        outer = Flow("outer", params=[("policy", "model"), ("prompts", "dataset"), ("reward", "reward"),
                                      ("tools", "env")])
        res = outer.call_flow(f, *outer.params, name="res")
        outer.logprobs(outer.params.policy, res, name="lp")
        assert_round_trip(outer)


def _denoted(v) -> str:
    """The graph node a handle stands for: its op's, or its parameter's (through ``bind`` aliases)."""
    while v.target is not None:
        v = v.target
    return v.node or v.name


# ---- diagnostics point at the Python line ---------------------------------------------------------


def _line() -> int:
    return sys._getframe(1).f_lineno


def _only(e: pytest.ExceptionInfo) -> object:
    assert len(e.value.diagnostics) == 1, e.value.render()
    return e.value.diagnostics[0]


def test_unknown_option_is_reported_at_the_python_keyword():
    f = Flow("bad", params=[("policy", "model"), ("prompts", "dataset")])
    policy, prompts = f.params
    line = _line() + 1
    f.sample(prompts, sise=4, name="b")
    with pytest.raises(FlowError) as e:
        f.compile()
    d = _only(e)
    assert (d.code, d.span.path, d.span.line) == ("E206", HERE, line)
    assert d.span.column == 23 and d.span.end_column == 27  # under `sise`, as text underlines the keyword
    rendered = e.value.render()
    assert rendered.startswith(f"{HERE}:{line}:23: error[E206]: `sample` has no option `sise`")
    assert 'f.sample(prompts, sise=4, name="b")' in rendered and "did you mean `size`?" in rendered


def test_unknown_op_and_loss_are_compiler_diagnostics_with_suggestions():
    f = Flow("bad", params=[("policy", "model"), ("prompts", "dataset")])
    policy, prompts = f.params
    line = _line() + 1
    b = f.op("sampel", prompts)
    f.update(policy, f.generate(policy, b), b, loss=f.loss("ppo_klip", 0.2))
    with pytest.raises(FlowError) as e:
        f.compile()
    got = sorted((d.code, d.span.line, d.message, d.hint) for d in e.value.diagnostics)
    assert got == [("E104", line, "unknown op or flow `sampel`", "did you mean `sample`?"),
                   ("E104", line + 1, "unknown op or flow `ppo_klip`", "did you mean `ppo_clip`?")]
    text = "flow bad(policy: model, prompts: dataset) {\n  b = sampel(prompts)\n" \
           "  update(policy, generate(policy, b), b, loss = ppo_klip(0.2))\n}\n"
    with pytest.raises(FlowError) as parsed:
        compile_text(text, "<bad>")
    assert sorted((d.code, d.message, d.hint) for d in parsed.value.diagnostics) == \
           sorted((c, m, h) for c, _, m, h in got)


def test_type_errors_of_the_flow_point_at_the_argument():
    f = Flow("bad", params=[("policy", "model"), ("prompts", "dataset")])
    policy, prompts = f.params
    line = _line() + 1
    f.generate(prompts,
               f.sample(prompts), n=2, name="r")
    with pytest.raises(FlowError) as e:
        f.compile()
    d = _only(e)
    assert (d.code, d.span.path, d.span.line, d.span.column) == ("E203", HERE, line, 16)
    assert "argument `model` of `generate` must be a model, but `prompts` is a dataset" in d.message


def test_parameter_errors_point_at_the_parameter_tuple():
    line = _line() + 2
    f = Flow("bad", params=[("policy", "model"),
                            ("group", "int", 1.5), ("prompts", "datset")])
    with pytest.raises(FlowError) as e:
        f.compile()
    got = sorted((d.code, d.span.line, d.span.column, d.span.end_column) for d in e.value.diagnostics)
    assert got == [("E114", line, 52, 73), ("E117", line, 29, 50)]
    assert "did you mean `dataset`?" in e.value.render()


def test_import_of_a_flow_file_by_path(tmp_path):
    lib = tmp_path / "lib.flow"
    lib.write_text("flow draw(prompts: dataset, k: int = 2) { b = sample(prompts, size = k)  return b }\n")
    f = Flow("main", params=[("policy", "model"), ("prompts", "dataset")])
    mylib = f.import_(str(lib), alias="lib")
    policy, prompts = f.params
    f.generate(policy, mylib.draw(prompts, k=3), name="r")
    compiled = f.compile(until="check_roles")  # nothing reads `r`: before dead code goes
    assert compiled.node("draw.b").attr("size").value == 3 and compiled.node("r").args[1].target == "draw.b"
    text = assert_round_trip(f)
    assert f'import "{lib}" as lib' in text and "r = generate(policy, lib.draw(prompts, k = 3))" in text


def test_group_mismatch_names_both_python_lines():
    f = Flow("bad", params=[("policy", "model"), ("prompts", "dataset"), ("reward", "reward")])
    policy, prompts, reward = f.params
    gen_line = _line() + 1
    r = f.generate(policy, f.sample(prompts), n=4, name="r")
    adv_line = _line() + 1
    f.group_advantage(reward(r, name="s"), group=8, name="adv")
    with pytest.raises(FlowError) as e:
        f.compile()
    d = _only(e)
    assert (d.code, d.span.line) == ("E213", adv_line)
    assert [(text, span.line) for text, span in d.notes] == [("generate is", gen_line)]


def test_errors_inside_a_called_builder_flow_point_at_its_line():
    inner = Flow("inner", params=[("policy", "model"), ("prompts", "dataset")])
    line = _line() + 1
    inner.returns(inner.generate(inner.params.policy, inner.sample(inner.params.prompts), temprature=0.5))
    outer = Flow("outer", params=[("policy", "model"), ("prompts", "dataset")])
    outer.call_flow(inner, *outer.params)
    with pytest.raises(FlowError) as e:
        outer.compile()
    d = _only(e)
    assert (d.code, d.span.path, d.span.line, d.hint) == ("E206", HERE, line, "did you mean `temperature`?")


# ---- Python-level misuse: BuilderError (a TypeError) at once ---------------------------------------


def test_python_misuse_raises_builder_error_at_the_call():
    f = Flow("f", params=[("policy", "model"), ("prompts", "dataset")])
    policy, prompts = f.params
    other = Flow("other", params=[("m", "model")])
    cases = [
        (lambda: f.generate("policy", prompts), "generate(): argument 1 (`model`) needs a model value"),
        (lambda: f.sample(prompts, size=None), "sample(): option `size`: cannot use NoneType None"),
        (lambda: f.sample(prompts, size=float("nan")), "cannot be written in a flow"),
        (lambda: f.frozen(other.params.m), "belongs to flow `other`, not `f`"),
        (lambda: f.sample(prompts, name="not a name"), "name= 'not a name' is not a flowrl name"),
        (lambda: f.sample(prompts, name="true"), "name= 'true' is not a flowrl name"),
        (lambda: f.call_flow("generate", policy), "`generate` is a built-in op, not a flow"),
        (lambda: prompts(policy), "is a dataset; only a reward can be called"),
        (lambda: f.sample(prompts, size=1, options={"size": 2}), "option `size` given both"),
        (lambda: Flow("g", params=["policy"]), "a parameter is (name, type) or (name, type, default)"),
        (lambda: Flow("g", params=[("x", "int"), ("x", "int")]), "two parameters named `x`"),
        (lambda: size("12 parsecs"), "is not a size literal"),
    ]
    for call, message in cases:
        with pytest.raises(BuilderError) as e:
            call()
        assert message in str(e.value), (message, str(e.value))
        assert isinstance(e.value, TypeError)
    assert f.graph().g.number_of_nodes() == 0  # nothing half-built was left behind


def test_unknown_attribute_suggests_the_op():
    f = Flow("f")
    with pytest.raises(AttributeError, match="did you mean `generate`"):
        f.genrate
    with pytest.raises(AttributeError, match="no parameter `grop`"):
        Flow("g", params=[("group", "int", 8)]).params.grop


def test_a_rebound_parameter_name_makes_its_old_handle_unusable():
    f = Flow("f", params=[("policy", "model"), ("prompts", "dataset")])
    policy, prompts = f.params
    f.sample(prompts, name="policy")
    with pytest.raises(BuilderError, match="`policy` was re-bound since"):
        f.frozen(policy)


def test_options_reach_keywords_python_reserves_and_methods_document_ops():
    f = Flow("f", params=[("policy", "model"), ("prompts", "dataset")])
    policy, prompts = f.params
    b = f.sample(prompts, options={"size": 3})
    assert f.graph().node(b.node).attr("size").value == 3
    assert "Sample n completions" in Flow.generate.__doc__ and "n: int = 1" in Flow.generate.__doc__
    assert "PPO clipped surrogate" in Flow.ppo_clip.__doc__


def test_reward_called_through_an_unnamed_reward_value_is_a_score():
    f = Flow("f", params=[("policy", "model"), ("prompts", "dataset")])
    policy, prompts = f.params
    r = f.generate(policy, f.sample(prompts), name="r")
    exact = f.verifier("exact")
    exact(r, name="s")
    g = Flow("f", params=[("policy", "model"), ("prompts", "dataset")])
    r2 = g.generate(g.params.policy, g.sample(g.params.prompts), name="r")
    g.score(g.verifier("exact"), r2, name="s")
    assert_same_graph(f.compile(), g.compile())


def test_importing_flowrl_does_not_import_the_builder():
    code = ("import sys, flowrl; assert 'flowrl.builder' not in sys.modules; "
            "from flowrl import Flow; assert Flow.__module__ == 'flowrl.builder'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


# ---- schedules, check, plan ------------------------------------------------------------------------


def build_arith_grpo(batch: int = 4, group: int = 2) -> Flow:
    """flows/arith_grpo.flow, tiny: relative paths are resolved against this file's folder (``data``
    here links to the repository's ``data/``), as a .flow file's against its own."""
    f = Flow("main", params=[("steps", "int", 2), ("eval_every", "int", 0), ("batch", "int", batch),
                             ("group", "int", group), ("max_tokens", "int", 5)], imports=["stdlib.grpo"])
    policy = f.declare("model", "policy", "tiny", task="arith")
    arith = f.declare("dataset", "arith", "jsonl", "data/arith/train.jsonl", prompt="prompt", answer="answer",
                      eval="data/arith/test.jsonl")
    exact = f.declare("reward", "exact", "verifier", "math")
    p = f.params
    f.call_flow("grpo", policy, arith, exact, batch=p.batch, group=p.group, max_tokens=p.max_tokens, lr=5e-4,
                micro_batch=8)
    s = f.schedule(nodes=1, gpus_per_node=1)
    s.colocate("policy.train", "policy.rollout", "ref", on="all")
    s.layout("policy.train", "torch", dp=1)
    s.layout("policy.rollout", "vllm", tp=1)
    s.staleness(1)
    s.resync("policy", "inplace", every=1)
    return f


SCHEDULE_TEXT = """
schedule main on cluster(nodes = 1, gpus_per_node = 1) {
  colocate policy.train, policy.rollout, ref on all
  policy.train = torch(dp = 1)
  policy.rollout = vllm(tp = 1)
  staleness 1
  resync policy via inplace() every 1
}
"""


def test_a_builder_flow_with_a_schedule_checks_plans_and_prints_as_text():
    f = build_arith_grpo()
    assert f.check() == []  # resources checked for real: data/arith/*.jsonl next to this file
    compiled = f.compile()
    assert compiled.node("grpo.rollouts").attr("n").value == 2
    text = f.to_flow_text()
    assert SCHEDULE_TEXT.strip() in text
    assert_same_graph(compiled, compile_text(text, "<text>", options={"resources": False}))
    plan = f.plan(steps=2)
    assert (plan.flow, plan.source, plan.run.steps, plan.staleness) == ("main", HERE, 2, 1)
    assert [m.id for m in plan.models] == ["policy", "grpo.ref"]
    assert plan.models[0].rollout_engine.origin.startswith(f"{HERE}:")  # the layout's Python line


def test_schedule_statements_reach_every_kind_of_the_language():
    f = Flow("main", params=[("policy", "model", ctor("tiny")), ("prompts", "dataset", ctor("jsonl", "d.jsonl")),
                             ("reward", "reward", ctor("verifier", "math"))], imports=["stdlib.grpo"])
    f.call_flow("grpo", *f.params, batch=8, group=2, max_tokens=4)
    s = f.schedule(nodes=1, gpus_per_node=8, gpu="H100")
    s.pool("gen", gpus=4).pool("train", "gpus", gpus=4)
    s.place("policy.rollout", on="gen").colocate("policy.train", "ref", on="train")
    s.layout("policy.train", "fsdp", dp=4).layout("policy.rollout", "vllm", tp=1, dp=4)
    s.staleness(2).resync("policy", "nccl", bucket=size("512MB"), overlap=True, every=1)
    s.partial_rollout(over_provision=1.5)
    text = assert_round_trip(f)
    for line in ["schedule main on cluster(nodes = 1, gpus_per_node = 8, gpu = \"H100\") {", "pool gen = gpus(gpus = 4)",
                 "place policy.rollout on gen", "colocate policy.train, ref on train", "policy.train = fsdp(dp = 4)",
                 "staleness 2", "resync policy via nccl(bucket = 512MB, overlap = true) every 1",
                 "partial_rollout(over_provision = 1.5)"]:
        assert line in text
    auto = Flow("main", params=[("policy", "model", ctor("tiny")), ("prompts", "dataset", ctor("jsonl", "d.jsonl")),
                                ("reward", "reward", ctor("verifier", "math"))], imports=["stdlib.grpo"])
    auto.call_flow("grpo", *auto.params, batch=8, group=2, max_tokens=4)
    auto.schedule(auto=True, nodes=2, gpus_per_node=8, gpu="H100").staleness(2, at_most=True)
    # compiled as a file beside this one, the text reads the datasets the builder's flow reads (`d.jsonl`
    # here), so `schedule auto` chooses from the same workload
    assert "schedule main auto on cluster(nodes = 2, gpus_per_node = 8, gpu = \"H100\") {\n  staleness <= 2\n}" \
        in assert_round_trip(auto, HERE)


def test_schedule_errors_point_at_the_python_line():
    f = build_arith_grpo()
    s = f.schedule(nodes=1, gpus_per_node=1)
    with pytest.raises(FlowError) as e:
        f.compile()
    assert [d.code for d in e.value.errors] == ["E421"]  # two schedules: as in text
    f = build_arith_grpo()
    f._schedules.clear()
    s = f.schedule(nodes=1, gpus_per_node=1)
    line = _line() + 1
    s.layout("policy.train", "torhc", dp=1)
    with pytest.raises(FlowError) as e:
        f.compile()
    d = _only(e)
    assert (d.span.path, d.span.line) == (HERE, line) and "torch" in (d.hint or "")
    with pytest.raises(BuilderError, match="write MODEL or MODEL.ROLE"):
        s.colocate("policy.train.x")
    with pytest.raises(BuilderError, match="the staleness is an int"):
        s.staleness(1.5)


def test_run_hands_the_builder_plan_to_flowrl_runs_driver(tmp_path, monkeypatch):
    """``Flow.run`` is ``flowrl run`` after the plan: launch.run_built (out directory, packages,
    loggers), then the driver's loop, here replaced by one that records the plan. (A real
    2-step run of this flow through the builder was checked by hand: it trains like
    flows/arith_grpo.flow; CI's budget has no room for another engine start-up.)"""
    import flowrl.launch as launch

    seen = {}

    def drive(plan, out, **kwargs):
        seen["plan"], seen["out"] = plan, out
        (out / launch.RUN_DIR_MARKER).write_text(plan.to_json())
        return "ran"

    monkeypatch.setattr(launch, "run_plan", drive)
    f = build_arith_grpo()
    assert f.run(out=tmp_path / "run", steps=2) == "ran"
    assert seen["out"] == tmp_path / "run" and seen["plan"] == f.plan(steps=2)
    with pytest.raises(launch.RunError, match="a run directory is already there"):
        f.run(out=tmp_path / "run", steps=2)
