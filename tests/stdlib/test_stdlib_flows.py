"""Every shipped ``.flow`` file (``stdlib/`` and ``flows/``) compiles, and its IR has the shape
its algorithm promises: the right ops, one resync per trained-and-generated model, the
loop-carried weight edge of distance 1, a TURN edge in multi-turn loops, schedules as written.

The headers are checked too: each stdlib parameter is documented with its real default, and
each example says how to check and run it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.compiler.pipeline import check_file, compile_file, compile_text
from flowrl.diagnostics import FlowError
from flowrl.ir.graph import Config, Const, EdgeKind, FlowGraph
from flowrl.catalog.ops import OpKind, SCALAR_TYPES
from flowrl.ir.printer import print_graph
from flowrl.syntax import ast
from flowrl.syntax.parser import parse

ROOT = Path(__file__).resolve().parents[2]
STDLIB = sorted((ROOT / "stdlib").glob("*.flow"))
FLOWS = sorted((ROOT / "flows").glob("*.flow"))
ALL = STDLIB + FLOWS
REFUSED: dict[str, str] = {}
"""Shipped files ``check`` refuses (E444, at the op), and the op the catalogue says runs on no
platform yet: what is not built is refused by ``check`` with the reason (issue 9). Their graphs
are still checked up to ``check_schedule``, before the platform check."""
BEFORE_PLATFORM = "check_schedule"


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _params(paths):
    return [pytest.param(p, id=_rel(p)) for p in paths]


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    """Compile with repo-relative paths, as `flowrl check stdlib/*.flow flows/*.flow` does."""
    monkeypatch.chdir(ROOT)


def graph_of(name: str, until: str | None = None) -> FlowGraph:
    return compile_file(name, until=until).graph


def nodes(g: FlowGraph, kind: OpKind) -> list:
    return [n for n in g.nodes() if n.kind == kind]


def only(g: FlowGraph, kind: OpKind):
    found = nodes(g, kind)
    assert len(found) == 1, f"expected one {kind.value} node, got {[n.id for n in found]}"
    return found[0]


def weight_edges(g: FlowGraph) -> list[tuple[str, str, int]]:
    return sorted((u, v, e.distance) for u, v, e in g.edges() if e.kind == EdgeKind.WEIGHTS)


def loop_distance(g: FlowGraph, src: str, dst: str) -> int | None:
    """Smallest total distance of a path of WEIGHTS edges src -> ... -> dst (None: no path)."""
    best = {src: 0}
    frontier = [src]
    while frontier:
        u = frontier.pop()
        for v, e in g.out_edges(u):
            if e.kind != EdgeKind.WEIGHTS:
                continue
            d = best[u] + e.distance
            if d < best.get(v, 1 << 30):
                best[v] = d
                frontier.append(v)
    return best.get(dst)


def attr(node, key):
    v = node.attr(key)
    return v.value if isinstance(v, Const) else v


# ---- every file checks clean ---------------------------------------------------------------


def test_the_library_and_examples_exist():
    assert {p.stem for p in STDLIB} >= {"grpo", "ppo", "rloo", "reinforce_pp", "agentic", "dapo", "gspo", "cispo",
                                        "reinforce_pp_baseline"}
    assert {p.stem for p in FLOWS} >= {"arith_grpo", "arith_ppo", "arith_rloo", "arith_reinforce_pp",
                                       "agentic_calc", "grpo_megatron_8gpu", "grpo_disaggregated",
                                       "grpo_auto", "grpo_partial_rollout"}


def _refused(path: Path) -> bool:
    """A file of :data:`REFUSED` is refused by ``check`` with E444 at its unbuilt op, and nothing else."""
    op = REFUSED.get(_rel(path))
    if op is None:
        return False
    with pytest.raises(FlowError) as info:
        check_file(_rel(path))
    assert {d.code for d in info.value.diagnostics} == {"E444"}
    assert all(f"`{op}`" in d.message and "not built yet" in d.hint for d in info.value.diagnostics)
    return True


@pytest.mark.parametrize("path", _params(ALL))
def test_file_checks_clean(path):
    if _refused(path):
        return
    graphs = check_file(_rel(path))
    assert graphs, "a shipped file defines at least one flow"
    for g in graphs.values():
        assert nodes(g, OpKind.UPDATE), f"{g.name}: an RL flow updates a model"


@pytest.mark.parametrize("path", _params(ALL))
def test_file_lints_after_every_pass(path):
    g = compile_file(_rel(path), lint_each=True, until=BEFORE_PLATFORM if _rel(path) in REFUSED else None).graph
    assert not nodes(g, OpKind.CALL)


@pytest.mark.parametrize("path", _params(FLOWS))
def test_example_runs_main_on_its_schedule(path):
    g = graph_of(_rel(path), until=BEFORE_PLATFORM if _rel(path) in REFUSED else None)
    assert g.name == "main"
    assert g.schedule is not None and g.schedule.flow == "main"
    # the stdlib flow was inlined: its nodes carry its name as prefix
    inlined = [n for n in g.nodes() if n.scope]
    assert inlined and all("." in n.id for n in inlined)


# ---- headers -----------------------------------------------------------------------------------


def _header(path: Path) -> str:
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#"), f"{_rel(path)} must start with a header comment"
    head = []
    for line in lines:
        if not line.startswith("#"):
            break
        head.append(line)
    return "\n".join(head)


def _flows(path: Path) -> list[ast.FlowDef]:
    return [i for i in parse(path.read_text(), _rel(path)).items if isinstance(i, ast.FlowDef)]


@pytest.mark.parametrize("path", _params(STDLIB))
def test_stdlib_header_documents_every_parameter_with_its_default(path):
    head = _header(path)
    for key in ("Parameters", "Reads:", "Writes:", "Usage:", f"flowrl check {_rel(path)}"):
        assert key in head, f"{_rel(path)}: header lacks {key!r}"
    for flow in _flows(path):
        for p in flow.params:
            doc = f"#   {p.name}: {p.type}"
            if p.default is not None:
                doc += f" = {p.default.text}"
            assert doc in head, f"{_rel(path)}: header does not document `{doc[4:]}`"


@pytest.mark.parametrize("path", _params(STDLIB))
def test_stdlib_scalars_have_defaults_and_are_all_used(path):
    for flow in _flows(path):
        used = _names_used(flow.body)
        for p in flow.params:
            if p.type in SCALAR_TYPES:
                assert p.default is not None, f"{flow.name}: scalar parameter `{p.name}` has no default"
            assert p.name in used, f"{flow.name}: parameter `{p.name}` is never used"


def _names_used(body) -> set[str]:
    out: set[str] = set()

    def expr(e):
        if isinstance(e, ast.Name):
            out.add(e.id)
        elif isinstance(e, ast.Call):
            out.add(e.func)
            for a in e.args:
                expr(a)
            for k in e.kwargs:
                expr(k.value)
        elif isinstance(e, ast.ListExpr):
            for i in e.items:
                expr(i)

    for st in body:
        if isinstance(st, (ast.Binding, ast.Return)):
            expr(st.value)
        elif isinstance(st, ast.CallStmt):
            expr(st.call)
        elif isinstance(st, ast.Repeat):
            expr(st.count)
            out |= _names_used(st.body)
    return out


@pytest.mark.parametrize("path", _params(FLOWS))
def test_example_header_says_what_and_how_to_run(path):
    head = _header(path)
    assert "What it shows" in head
    assert f"flowrl check {_rel(path)}" in head
    assert f"flowrl run {_rel(path)}" in head


# ---- every scalar parameter of a stdlib flow reaches the graph ----------------------------------

_DECLS = """
model policy = tiny(task = "arith")
dataset data = jsonl("data/arith/train.jsonl")
reward r = verifier("math")
env tools = python_env("flowrl.envs.calculator:Calculator")
"""

_STR_ALTERNATIVES = {"k1": "k2", "k2": "k3", "k3": "k1", "token-mean": "seq-mean-token-mean",
                     "seq-mean-token-mean": "token-mean", "constant": "cosine", "token": "sequence",
                     "geometric": "token", "skip": "stop", "native": "replay"}


def _other_value(p: ast.Param) -> str:
    """A valid value different from the parameter's default, as flow source text."""
    d = p.default.value
    if p.type == "bool":
        return "false" if d else "true"
    if p.type == "int":
        return str(d + 1)
    if p.type == "float":
        return repr(d / 2) if d else "0.1"
    if p.type == "str":
        return f'"{_STR_ALTERNATIVES[d]}"'
    raise AssertionError(f"no alternative value for {p.type}")


def _call_text(flow: ast.FlowDef, override: str = "") -> str:
    resources = {"model": "policy", "dataset": "data", "reward": "r", "env": "tools"}
    args = [resources[p.type] for p in flow.params if p.default is None]
    if override:
        args.append(override)
    return f"import stdlib.{flow.name} as lib\n{_DECLS}\nflow main() {{ lib.{flow.name}({', '.join(args)}) }}\n"


STDLIB_PARAMS = [pytest.param(path.stem, p.name, id=f"{path.stem}.{p.name}")
                 for path in STDLIB for f in _flows(path) for p in f.params if p.default is not None]


@pytest.mark.parametrize("flow_name,param", STDLIB_PARAMS)
def test_overriding_a_parameter_changes_the_graph(flow_name, param):
    flow = next(f for f in _flows(ROOT / "stdlib" / f"{flow_name}.flow") if f.name == flow_name)
    p = next(x for x in flow.params if x.name == param)
    # until resolve_names: parameter values are substituted there, before any check could
    # reject a value (so every override shows up, even one a later pass would refuse)
    base = print_graph(compile_text(_call_text(flow), "main.flow", until="resolve_names"))
    changed = print_graph(compile_text(_call_text(flow, f"{param} = {_other_value(p)}"), "main.flow",
                                       until="resolve_names"))
    assert base != changed, f"`{param}` of {flow_name} does not reach the graph"


# ---- GRPO ----------------------------------------------------------------------------------------


def test_grpo_shape():
    g = graph_of("stdlib/grpo.flow")
    ops = sorted(n.op for n in g.nodes() if n.kind not in (OpKind.MODEL, OpKind.DATASET, OpKind.REWARD_FN))
    assert ops == ["generate", "group_advantage", "logprobs", "logprobs", "resync", "sample", "score", "update"]
    resync, update, gen = only(g, OpKind.RESYNC), only(g, OpKind.UPDATE), only(g, OpKind.GENERATE)
    assert resync.model == "policy" and update.model == "policy" and gen.model == "policy"
    assert nodes(g, OpKind.VALUES) == []  # no critic
    assert weight_edges(g) == [("resync.policy", "rollouts", 1), ("update", "old_lp", 1),
                               ("update", "resync.policy", 0)]
    assert loop_distance(g, update.id, gen.id) == 1
    # group advantage over generate's n; KL to the frozen reference is in the loss
    assert attr(g.node("adv"), "group") == attr(gen, "n") == 8
    assert g.node("ref").role == "frozen"
    assert update.args[4].target == "ref_lp" and g.node("ref_lp").model == "ref"
    assert attr(update, "kl") == 0.001 and attr(update, "kl_kind") == "k3"
    loss = update.attr("loss")
    assert isinstance(loss, Config) and loss.name == "ppo_clip" and loss.get("clip") == 0.2
    assert nodes(g, OpKind.ADVANTAGE) == [g.node("adv")]  # no KL in the reward


def test_grpo_defaults():
    g = graph_of("stdlib/grpo.flow")
    gen = only(g, OpKind.GENERATE)
    assert (attr(gen, "temperature"), attr(gen, "max_tokens"), attr(gen, "n")) == (1.0, 256, 8)
    assert attr(only(g, OpKind.SAMPLE), "size") == 64
    assert attr(only(g, OpKind.UPDATE), "lr") == 1e-6


# ---- PPO ------------------------------------------------------------------------------------------


def test_ppo_has_actor_and_critic_updates_and_one_resync():
    g = graph_of("stdlib/ppo.flow")
    updates = {n.model: n for n in nodes(g, OpKind.UPDATE)}
    assert sorted(updates) == ["critic", "policy"]
    assert g.node("critic").role == "critic" and g.node("ref").role == "frozen"
    assert updates["policy"].attr("loss").name == "ppo_clip"
    assert updates["critic"].attr("loss").name == "value_clip"
    # only the policy is read by a rollout engine: one resync, none for the critic
    assert [n.model for n in nodes(g, OpKind.RESYNC)] == ["policy"]
    crit = updates["critic"].id
    assert [(v, e.distance) for v, e in g.out_edges(crit) if e.kind == EdgeKind.WEIGHTS] == [("old_values", 1)]
    assert loop_distance(g, updates["policy"].id, only(g, OpKind.GENERATE).id) == 1
    assert loop_distance(g, crit, only(g, OpKind.GENERATE).id) is None


def test_ppo_reward_is_kl_shaped_then_gae():
    g = graph_of("stdlib/ppo.flow")
    shaped, adv = g.node("shaped"), g.node("adv")
    assert shaped.op == "kl_penalty" and attr(shaped, "kind") == "k1" and attr(shaped, "coef") == 0.05
    assert [a.target for a in shaped.args] == ["scores", "old_lp", "ref_lp", "rollouts"]
    assert adv.op == "gae" and [a.target for a in adv.args] == ["shaped", "old_values", "rollouts"]
    assert {"advantages", "returns"} <= adv.fields
    # the critic learns the returns, the actor the advantages
    targets = {v: e.fields for _, v, e in g.edges() if e.arg == "targets"}
    assert targets == {"actor_update": frozenset({"advantages"}), "critic_update": frozenset({"returns"})}
    assert attr(g.node("actor_update"), "kl") == 0.0  # PPO's KL is in the reward, not the loss


# ---- RLOO / REINFORCE++ ------------------------------------------------------------------------------


def test_rloo_shape():
    g = graph_of("stdlib/rloo.flow")
    adv, gen = g.node("adv"), only(g, OpKind.GENERATE)
    assert adv.op == "rloo" and adv.args[0].target == "shaped" and g.node("shaped").op == "kl_penalty"
    assert attr(adv, "group") == attr(gen, "n") == 4
    assert [n.model for n in nodes(g, OpKind.RESYNC)] == ["policy"]
    assert loop_distance(g, only(g, OpKind.UPDATE).id, gen.id) == 1


def test_reinforce_pp_shape():
    g = graph_of("stdlib/reinforce_pp.flow")
    adv = g.node("adv")
    assert adv.op == "reinforce_pp" and attr(adv, "whiten") is True and attr(adv, "gamma") == 1.0
    assert [a.target for a in adv.args] == ["shaped", "rollouts"]
    assert attr(g.node("shaped"), "coef") == 0.01
    assert [n.model for n in nodes(g, OpKind.RESYNC)] == ["policy"]
    assert loop_distance(g, only(g, OpKind.UPDATE).id, only(g, OpKind.GENERATE).id) == 1


# ---- agentic (multi-turn) ------------------------------------------------------------------------------


def test_agentic_has_a_region_with_a_turn_edge():
    g = graph_of("stdlib/agentic.flow", until="resolve_names")
    assert list(g.regions) == ["repeat1"]
    region = g.regions["repeat1"]
    assert region.until == "done" and region.count.value == 4
    in_loop = sorted(n.op for n in g.nodes() if n.region == "repeat1")
    assert in_loop == ["env_step", "generate"]
    turns = [(u, v, e.arg, e.distance) for u, v, e in g.edges() if e.kind == EdgeKind.TURN]
    assert turns == [("convo#2", "obs", "rollouts", 1)]
    # after the loop, the last turn's conversation is scored and trained on
    assert g.node("scores").args[1].target == "convo#2"
    assert g.node("update").args[1].target == "convo#2"


def test_agentic_resync_feeds_both_generates():
    g = graph_of("stdlib/agentic.flow", until=BEFORE_PLATFORM)
    resync = only(g, OpKind.RESYNC)
    assert sorted((v, e.distance) for v, e in g.out_edges(resync.id) if e.kind == EdgeKind.WEIGHTS) == \
        [("convo", 1), ("convo#2", 1)]
    # groups are made by the first turn (n = group); later turns continue each conversation
    assert attr(g.node("convo"), "n") == attr(g.node("adv"), "group") == 8
    assert attr(g.node("convo#2"), "n") == 1
    assert {"done", "observations", "group_ids"} <= g.node("convo#2").fields


# ---- examples and their schedules -------------------------------------------------------------------------


def _stmts(g: FlowGraph, cls) -> list:
    return [s for s in g.schedule.body if isinstance(s, cls)]


def test_arith_grpo_is_the_default_program():
    g = graph_of("flows/arith_grpo.flow")
    assert g.node("policy").op == "tiny" and attr(g.node("policy"), "task") == "arith"
    data = g.node("arith")
    assert data.op == "jsonl" and data.args[0].value == "../data/arith/train.jsonl"
    assert attr(data, "eval") == "../data/arith/test.jsonl"
    assert g.node("exact").op == "verifier" and g.node("exact").args[0].value == "math"
    # main's parameter defaults flow into the inlined GRPO
    assert attr(g.node("grpo.prompt_batch"), "size") == 64
    assert attr(g.node("grpo.rollouts"), "n") == attr(g.node("grpo.adv"), "group") == 8
    assert attr(g.node("grpo.rollouts"), "max_tokens") == 5
    assert attr(g.node("grpo.update"), "kl") == 0.0
    assert [n.id for n in nodes(g, OpKind.RESYNC)] == ["resync.policy"]
    assert loop_distance(g, "grpo.update", "grpo.rollouts") == 1
    s = g.schedule
    assert not s.auto and {k.name: k.value.value for k in s.cluster.kwargs} == {"nodes": 1, "gpus_per_node": 1}
    (co,) = _stmts(g, ast.Colocate)
    assert [str(t) for t in co.targets] == ["policy.train", "policy.rollout", "ref"] and co.pool == "all"
    assert {str(l.target): l.engine.func for l in _stmts(g, ast.Layout)} == \
        {"policy.train": "torch", "policy.rollout": "vllm"}
    assert [(x.value, x.bound_only) for x in _stmts(g, ast.Staleness)] == [(1, False)]
    (rs,) = _stmts(g, ast.Resync)
    assert (rs.model, rs.protocol.func, rs.every) == ("policy", "inplace", 1)


def test_arith_grpo_main_parameters_are_tunable():
    text = (ROOT / "flows/arith_grpo.flow").read_text()
    g = compile_text(text.replace("group: int = 8", "group: int = 4").replace("lr: float = 5e-4", "lr: float = 3e-4"),
                     "flows/arith_grpo.flow")
    assert attr(g.node("grpo.rollouts"), "n") == attr(g.node("grpo.adv"), "group") == 4
    assert attr(g.node("grpo.update"), "lr") == 3e-4


@pytest.mark.parametrize("path", _params(FLOWS))
def test_example_lowers_to_the_shipped_dataset_and_run_settings(path):
    """Dataset paths are relative to the .flow file; `steps`/`eval_every`/`seed` are run settings."""
    from flowrl.compiler.lower import lower

    if _refused(path):
        return
    plan = lower(graph_of(_rel(path)))
    (data,) = plan.datasets
    if path.name.startswith("rg_"):  # a generated Reasoning Gym task: the settings its tiny model trained on
        from flowrl.tasks.rg import RG_TASKS

        rg = RG_TASKS[path.stem]
        assert (data.format, data.path) == ("reasoning_gym", "")
        assert data.options == {"task": rg.task, "size": rg.size, "seed": rg.seed, "eval_size": rg.eval_size,
                                "config": rg.config}
        assert (plan.run.steps, plan.run.eval_every, plan.run.seed) == (100, 25, 0)
        return
    task = Path(data.path).parent  # data/arith, or another shipped task's folder (data/guess)
    assert task.parent == ROOT / "data" and Path(data.path) == task / "train.jsonl"
    assert Path(data.eval_path) == task / "test.jsonl"
    # the default run is longer; the calculator flow learns its tool in fewer (bench/agentic.py)
    expected = {"arith_grpo.flow": (300, 50, 0), "agentic_calc.flow": (40, 10, 0), "agent_calc.flow": (40, 10, 0),
                "longtail_grpo.flow": (40, 10, 0),
                "arith_reward_model.flow": (100, 25, 0)}.get(path.name, (60, 10, 0))
    assert (plan.run.steps, plan.run.eval_every, plan.run.seed) == expected


def test_arith_variants_use_their_algorithm():
    assert {n.op for n in nodes(graph_of("flows/arith_ppo.flow"), OpKind.ADVANTAGE)} == {"kl_penalty", "gae"}
    assert {n.op for n in nodes(graph_of("flows/arith_rloo.flow"), OpKind.ADVANTAGE)} == {"kl_penalty", "rloo"}
    assert {n.op for n in nodes(graph_of("flows/arith_reinforce_pp.flow"), OpKind.ADVANTAGE)} == \
        {"kl_penalty", "reinforce_pp"}
    ppo = graph_of("flows/arith_ppo.flow")
    assert {str(l.target): l.engine.func for l in _stmts(ppo, ast.Layout)} == \
        {"policy.train": "torch", "critic": "torch", "policy.rollout": "vllm"}
    assert len(nodes(ppo, OpKind.UPDATE)) == 2 and len(nodes(ppo, OpKind.RESYNC)) == 1


def test_agentic_calc_region_and_env():
    g = graph_of("flows/agentic_calc.flow", until="resolve_names")
    calc = g.node("calc")
    assert calc.kind == OpKind.ENV and calc.args[0].value == "flowrl.envs.calculator:Calculator"
    assert g.regions["agentic.repeat1"].count.value == 2  # a call, then the answer
    assert [(u, v) for u, v, e in g.edges() if e.kind == EdgeKind.TURN] == [("agentic.convo#2", "agentic.obs")]
    assert g.node("agentic.obs").op == "env_step" and g.node("agentic.obs").region == "agentic.repeat1"


def test_megatron_8gpu_schedule():
    g = graph_of("flows/grpo_megatron_8gpu.flow")
    assert {k.name: k.value.value for k in g.schedule.cluster.kwargs} == {"nodes": 1, "gpus_per_node": 8}
    layouts = {str(l.target): (l.engine.func, {k.name: k.value.value for k in l.engine.kwargs})
               for l in _stmts(g, ast.Layout)}
    assert layouts == {"policy.train": ("megatron", {"tp": 2, "pp": 1, "dp": 4}),
                       "policy.rollout": ("vllm", {"tp": 1, "dp": 8})}
    assert [x.value for x in _stmts(g, ast.Staleness)] == [2]
    (rs,) = _stmts(g, ast.Resync)
    assert rs.protocol.func == "nccl" and rs.protocol.kwargs[0].value.value == 512 * 10**6


def test_disaggregated_schedule_uses_two_pools():
    g = graph_of("flows/grpo_disaggregated.flow")
    pools = {p.name: p.value.kwargs[0].value.value for p in _stmts(g, ast.Pool)}
    assert pools == {"gen": 4, "train": 4}
    (place,) = _stmts(g, ast.Place)
    assert [str(t) for t in place.targets] == ["policy.rollout"] and place.pool == "gen"
    (co,) = _stmts(g, ast.Colocate)
    assert [str(t) for t in co.targets] == ["policy.train", "ref"] and co.pool == "train"


def test_auto_schedule_has_only_a_staleness_bound():
    g = graph_of("flows/grpo_auto.flow")
    assert g.schedule.auto
    assert {k.name: k.value.value for k in g.schedule.cluster.kwargs} == {"nodes": 8, "gpus_per_node": 8}
    assert [(s.value, s.bound_only) for s in g.schedule.body if isinstance(s, ast.Staleness)] == [(2, True)]
    assert len(g.schedule.body) == 1


def test_partial_rollout_schedule():
    g = graph_of("flows/grpo_partial_rollout.flow")
    (call,) = _stmts(g, ast.SchedCall)
    assert call.call.func == "partial_rollout"
    assert {k.name: k.value.value for k in call.call.kwargs} == {"over_provision": 1.5, "recycle": True}
    assert [x.value for x in _stmts(g, ast.Staleness)] == [3]


@pytest.mark.parametrize("path", _params(ALL))
def test_file_is_in_canonical_format(path):
    from flowrl.syntax.fmt import format_source

    text = path.read_text()
    assert format_source(text, _rel(path)) == text, \
        f"{_rel(path)} is not formatted: run `flowrl fmt -w {_rel(path)}`"


# ---- docs/language.md is true to the code ---------------------------------------------------------

DOC = ROOT / "docs" / "language.md"
NO_EXAMPLE = {"E002": "binary input", "E003": "a 4 MiB file", "E004": "65 nested brackets",
              "E124": "a missing file", "E125": "a --set flag", "E126": "a --set flag",
              "E607": "a checkpoint directory of an architecture Megatron does not convert",
              "E620": "a checkpoint directory without weights (tests/compiler/test_check_resources.py, "
                      "tests/golden/invalid/e620_hf_without_weights.flow)",
              "E622": "a dataset file without the field a verifier reads "
                      "(tests/golden/invalid/e622_code_verifier_without_tests.flow)",
              "E672": "the reasoning-gym package missing (tests/compiler/test_check_reasoning_gym.py)",
              "E662": "a dataset file whose rows lack a template's field (tests/compiler/test_check_datasets.py)",
              "E663": "a save_to_disk folder without the split named (tests/compiler/test_check_datasets.py)",
              "E441": "no engine record limits a layout on a platform today (tests/schedule/test_catalog_engines.py)",
              "E445": "no protocol record sends over a transport its platform lacks (tests/catalog/test_protocol_transports.py)",
              "E640": "an environment library that is not installed (tests/envs/test_libraries.py hides one)",
              "E643": "an MCP server's tools, listed when the run starts (tests/envs/test_libraries.py)",
              "E444": "every shipped op, loss and statement record runs on every platform "
                      "(tests/compiler/test_check_platform.py refuses records made for the test)"}
"""Codes the catalogue describes without a one-file example, and why."""


def _gen_ops_table():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_ops_table", ROOT / "docs" / "gen_ops_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_are_current():
    gen = _gen_ops_table()
    block = gen.current_block(DOC.read_text())
    assert block is not None, "docs/language.md lost its generated block markers"
    assert block == gen.generate(), "the catalogue (flowrl/catalog/) changed: run `python docs/gen_ops_table.py --write`"


def test_generated_tables_list_every_op_loss_and_engine():
    from flowrl.catalog.ops import LOSSES, OPS
    from flowrl.catalog.engines import ENGINES
    from flowrl.catalog.protocols import PROTOCOLS
    from flowrl.catalog.schedule import STATEMENTS

    block = _gen_ops_table().generate()
    for name in list(OPS) + list(LOSSES) + list(ENGINES) + list(PROTOCOLS) + list(STATEMENTS):
        assert f"| `{name}` |" in block, name
    # a platforms column for every kind of record that has platforms
    for header in ("| constructor | declares | platforms |", "| op | kind | runs on | platforms |",
                   "| loss | platforms |", "| engine | serves | platforms |", "| protocol (`resync M via P(...)`) | platforms |",
                   "| statement | written | in | platforms |"):
        assert header in block, header
    # a `|` inside a cell would split it: every table row has its header's column count
    for table in block.split("\n\n"):
        rows = [r for r in table.splitlines() if r.startswith("|")]
        if rows:
            widths = {r.replace("\\|", "").count("|") for r in rows}
            assert len(widths) == 1, rows[0]


def _catalogue() -> dict[str, str | None]:
    """code -> the first ```flow example of its `#### Ennn` section (None: no example)."""
    import re

    text = DOC.read_text()
    sections = re.split(r"^#### (E\d{3})\b.*$", text, flags=re.M)
    out = {}
    for code, body in zip(sections[1::2], sections[2::2]):
        body = body.split("\n### ", 1)[0].split("\n## ", 1)[0]
        m = re.search(r"```flow\n(.*?)```", body, flags=re.S)
        out[code] = m.group(1) if m else None
    return out


def _codes_in_compiler() -> set[str]:
    import re

    codes = set()
    for py in (ROOT / "flowrl").rglob("*.py"):
        codes |= set(re.findall(r'"(E\d{3})"', py.read_text()))
    return codes


def test_every_diagnostic_code_is_documented():
    documented = set(_catalogue())
    missing = sorted(_codes_in_compiler() - documented)
    assert not missing, f"codes used in flowrl/ but not in docs/language.md's catalogue: {missing}"
    stale = sorted(documented - _codes_in_compiler())
    assert not stale, f"docs/language.md documents codes nothing reports: {stale}"


CATALOGUE = sorted(_catalogue().items())


@pytest.mark.parametrize("code,example", [pytest.param(c, e, id=c) for c, e in CATALOGUE])
def test_catalogue_example_reports_its_code(code, example, tmp_path, monkeypatch):
    if example is None:
        assert code in NO_EXAMPLE, f"{code} has no ```flow example in docs/language.md"
        return
    from flowrl.compiler.lower import lower

    (tmp_path / "example.flow").write_text(example)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FlowError) as info:
        check_file("example.flow")
        lower(compile_file("example.flow").graph)  # E5xx: reported when lowering to a plan
    codes = [d.code for d in info.value.diagnostics]
    assert code in codes, f"the {code} example reports {codes}"


def test_reference_examples_compile():
    """The reference's complete program and its statements example are real programs."""
    import re

    text = DOC.read_text().split("## Diagnostics")[0]
    blocks = re.findall(r"```flow\n(.*?)```", text, flags=re.S)
    program = blocks[0]
    g = compile_text(program, str(ROOT / "flows" / "doc_example.flow"))
    assert g.name == "main" and [n.model for n in nodes(g, OpKind.RESYNC)] == ["policy"]
    (statements,) = [b for b in blocks if b.startswith("flow example(")]
    g = compile_text(statements, "doc.flow")
    assert [n.id for n in g.nodes() if n.kind not in (OpKind.MODEL, OpKind.DATASET, OpKind.REWARD_FN)] == \
        ["b", "rollouts", "reward#2", "adv", "update", "resync.policy"]
