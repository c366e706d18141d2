"""Every flow of ``stdlib/`` and ``flows/``, written again with the Python builder
(:func:`builder_kit.replay`: the builder calls a user would write, generated from the file), compiles
to the IR of the parsed file: the raw graph, the graph after each pass, and the final dump, or
the same diagnostics where ``check`` refuses the file (e.g. E444 for an op not built on the
schedule's platform yet)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flowrl.compiler.pipeline import PASS_NAMES, compile_file
from flowrl.compiler.unit import stdlib_dir
from flowrl.diagnostics import FlowError
from flowrl.ir.graph import EdgeKind
from flowrl.builder import _float_text
from flowrl.syntax import ast
from flowrl.syntax.fmt import format_module
from flowrl.syntax.parser import parse

from builder_kit import assert_same_graph, nospan, replay

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(stdlib_dir().glob("*.flow")) + sorted((ROOT / "flows").glob("*.flow"))
NO_FILES = {"resources": False}
"""The mirror's Python file sits elsewhere than the flow file, so relative paths would name other files;
the resources are checked by tests/compiler (files) and test_builder (builder flows)."""


BEFORE_PLATFORM = PASS_NAMES[PASS_NAMES.index("check_platform") - 1]


def outcome(compile_):
    """(result, None) or (None, the sorted codes of the errors)."""
    try:
        return compile_(), None
    except FlowError as e:
        return None, sorted(d.code for d in e.errors)


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_builder_mirror_compiles_to_the_parsed_files_ir(path):
    f = replay(path)
    parsed = compile_file(path, until="build", dump_after=("build",))
    assert_same_graph(f.graph(), parsed.graph, raw=True)
    # the program is the file's, statement for statement (comments and layout aside)
    text_items = [nospan(i) for i in parse(path.read_text(), str(path)).items]
    assert [nospan(i) for i in f.to_module().items] == text_items
    built, built_err = outcome(lambda: f.compiled(options=NO_FILES, dump_after=PASS_NAMES))
    text, text_err = outcome(lambda: compile_file(path, options=NO_FILES, dump_after=PASS_NAMES))
    assert built_err == text_err
    if text_err:  # refused (E444: an op not built on the platform yet): the IR before the platform check
        built = f.compiled(until=BEFORE_PLATFORM, options=NO_FILES, dump_after=PASS_NAMES)
        text = compile_file(path, until=BEFORE_PLATFORM, options=NO_FILES, dump_after=PASS_NAMES)
    assert set(built.dumps) == set(text.dumps) and len(text.dumps) >= PASS_NAMES.index(BEFORE_PLATFORM) + 1
    for name in text.dumps:
        assert_same_graph(built.dumps[name], text.dumps[name])

def _float_texts(x):
    """An AST with each float written as the builder writes it (``3e-4`` and ``0.0003`` are one value)."""
    if isinstance(x, ast.Literal) and x.kind == "float":
        return dataclasses.replace(x, text=_float_text(x.value))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _float_texts(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, tuple):
        return tuple(_float_texts(i) for i in x)
    return x


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_text_to_builder_to_text_round_trips(path):
    """A file's program, written with the builder and printed by ``to_flow_text()``, is the file as
    ``flowrl fmt`` prints it, comments aside."""
    module = parse(path.read_text(), str(path))
    assert replay(path).to_flow_text() == format_module(_float_texts(dataclasses.replace(module, comments=())))


def test_mirrors_are_not_empty():
    """Guards the comparison above from comparing two empty graphs."""
    by_name = {p.stem: p for p in FILES}
    grpo = replay(by_name["grpo"]).compile(until="check_roles", options=NO_FILES)
    assert [n.id for n in grpo.nodes()][:11] == ["policy", "prompts", "reward", "ref", "prompt_batch", "rollouts",
                                                 "scores", "old_lp", "ref_lp", "adv", "update"]
    assert grpo.node("scores").op == "score" and grpo.node("adv").attr("group").value == 8
    ppo = replay(by_name["ppo"]).compile(until="check_roles", options=NO_FILES)
    assert {n.id for n in ppo.nodes() if n.op == "update"} == {"actor_update", "critic_update"}
    agentic = replay(by_name["agentic"]).compile(until="check_roles", options=NO_FILES)
    assert [(u, v) for u, v, e in agentic.edges() if e.kind == EdgeKind.TURN] == [("convo#2", "obs")]
    disagg = replay(by_name["grpo_disaggregated"])
    (sched,) = [i for i in disagg.to_module().items if isinstance(i, ast.ScheduleDef)]
    assert [type(s).__name__ for s in sched.body] == ["Pool", "Pool", "Place", "Colocate", "Layout", "Layout",
                                                      "Staleness", "Resync"]
    assert dataclasses.replace(sched.body[-1].protocol.kwargs[0].value, span=None).text == "512MB"


@pytest.mark.parametrize("name", ["grpo_disaggregated", "arith_grpo"])
def test_builder_mirror_plans_like_the_file(name):
    """``Flow.plan`` is ``flowrl plan``'s lowering: the same plan, the source path aside. Neither side
    reads the datasets (the mirror's relative paths do not resolve from this folder, and the estimate's
    prompt lengths come from the files where they are read: flowrl.compiler.data_workload)."""
    from flowrl.compiler.pipeline import compile_file
    from flowrl.launch import lower_compiled

    path = ROOT / "flows" / f"{name}.flow"
    f = replay(path)
    text_plan = lower_compiled(compile_file(str(path), options=NO_FILES).graph).to_dict()
    built_plan = f.plan(options=NO_FILES).to_dict()
    assert _strip(built_plan) == _strip(text_plan)


def _strip(d):
    """A plan dict without the things that name where it was written (paths, positions)."""
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k not in ("origin", "path", "eval_path")}
    if isinstance(d, (list, tuple)):
        return [_strip(v) for v in d]
    if isinstance(d, str) and d.endswith((".flow", ".py")):
        return "<source>"
    return d
