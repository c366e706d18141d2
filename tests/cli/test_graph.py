"""`flowrl graph` and flowrl.views: DOT / Mermaid content, Graphviz rendering, errors."""

from __future__ import annotations

import re
import shutil

import pytest

from cli_flows import GRPO, PPO_TURNS, TWO_CALLS, UNKNOWN_NAME
from flowrl import views
from flowrl.cli import graph_format, main
from flowrl.compiler.pipeline import compile_file

needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="Graphviz `dot` not installed (apt-get install graphviz)")


def _dot(write_flow, text: str) -> str:
    return views.to_dot(compile_file(write_flow("g.flow", text)).graph)


def _line(text: str, start: str) -> str:
    """The one line of ``text`` that starts (after indentation) with ``start``."""
    found = [l.strip() for l in text.splitlines() if l.strip().startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


def test_dot_loop_carried_weights_are_dashed_with_distance(write_flow):
    dot = _dot(write_flow, GRPO)
    loop = _line(dot, '"resync.policy" -> "grpo.rollouts"')
    assert 'label="weights d=1"' in loop and 'style="dashed"' in loop and 'constraint="false"' in loop
    assert 'label="weights d=1"' in _line(dot, '"grpo.update" -> "grpo.old_lp"')
    same_step = _line(dot, '"grpo.update" -> "resync.policy"')  # distance 0: solid, plain label
    assert 'label="weights"' in same_step and "dashed" not in same_step


def test_dot_resync_frozen_and_model_colours(write_flow):
    dot = _dot(write_flow, GRPO)
    resync = _line(dot, '"resync.policy" [')
    assert 'shape="doubleoctagon"' in resync and f'color="{views.RESYNC_RED}"' in resync
    assert "bold" in resync
    policy_fill = views.model_colours(compile_file(write_flow("g.flow", GRPO)).graph)["policy"]
    assert policy_fill in views.PALETTE
    for nid in ("policy", "grpo.rollouts", "grpo.update"):
        assert f'fillcolor="{policy_fill}"' in _line(dot, f'"{nid}" [')
    # one update on the batch: the old log-probs come from its own forward, so that pass never runs
    old_lp = _line(dot, '"grpo.old_lp" [')
    assert "dotted" in old_lp and f'color="{views.ELIDED_GREY}"' in old_lp and "(elided: the update" in old_lp
    assert "never runs (elided by the compiler)" in dot
    assert "protocol=inplace" in resync  # the protocol the schedule passes chose, not `auto`
    for nid in ("grpo.ref", "grpo.ref_lp"):  # the frozen reference and the op on it are grey
        assert f'fillcolor="{views.FROZEN_FILL}"' in _line(dot, f'"{nid}" [')
    assert 'shape="cylinder"' in _line(dot, '"policy" [')
    assert 'shape="folder"' in _line(dot, '"arith" [')
    assert 'shape="note"' in _line(dot, '"exact" [')
    assert f'fillcolor="{views.DRIVER_FILL}"' in _line(dot, '"grpo.adv" [')


def test_dot_edges_carry_fields_and_resources_are_thin_grey(write_flow):
    dot = _dot(write_flow, GRPO)
    assert 'label="prompt_ids,\\nresponse_ids,\\nresponse_mask"' in _line(dot, '"grpo.rollouts" -> "grpo.old_lp"')
    assert 'label="rewards"' in _line(dot, '"grpo.scores" -> "grpo.adv"')
    assert 'label="advantages"' in _line(dot, '"grpo.adv" -> "grpo.update"')
    resource = _line(dot, '"arith" -> "grpo.b"')
    assert f'color="{views.RESOURCE_GREY}"' in resource and 'penwidth="0.6"' in resource
    assert "label=" not in resource


def test_dot_clusters_inlined_calls_and_has_a_legend(write_flow):
    dot = _dot(write_flow, GRPO)
    cluster = dot[dot.index('subgraph "cluster_1"'):]
    assert cluster.splitlines()[1].strip().startswith('label="flow grpo"')
    body = cluster[: cluster.index("\n  }\n")]
    assert '"grpo.rollouts" [' in body and '"resync.policy" [' in body and '"policy" [' not in body
    assert "<B>legend</B>" in dot and "runs on policy" in dot and "weights d=N: read N steps later" in dot
    assert "frozen model (read-only)" in dot and "weights to the rollout engine" in dot


def test_dot_two_calls_of_one_flow_get_two_clusters(write_flow):
    dot = _dot(write_flow, TWO_CALLS)
    assert re.findall(r'label="(flow [^"]+)"; fontsize', dot) == ["flow inner", "flow inner#2"]


def test_dot_critic_and_turn_edges(write_flow, env_step_allowed):
    dot = _dot(write_flow, PPO_TURNS)
    critic = _line(dot, '"critic" [')
    assert 'peripheries="2"' in critic and f'color="{views.CRITIC_BORDER}"' in critic
    turn = _line(dot, '"convo#2" -> "obs"')
    assert 'xlabel="turn"' in turn and 'style="dashed"' in turn  # placed clear of other labels
    assert 'label="repeat 3 until done"' in dot
    colours = views.model_colours(compile_file(write_flow("p.flow", PPO_TURNS)).graph)
    assert sorted(colours) == ["critic", "policy"] and colours["critic"] != colours["policy"]
    assert f'fillcolor="{colours["critic"]}"' in _line(dot, '"vals" [')
    assert 'xlabel="weights d=1"' in _line(dot, '"update#2" -> "vals"')


def test_views_are_deterministic(write_flow, env_step_allowed):
    a = compile_file(write_flow("a.flow", PPO_TURNS)).graph
    b = compile_file(write_flow("a.flow", PPO_TURNS)).graph
    assert views.to_dot(a) == views.to_dot(b)
    assert views.to_mermaid(a) == views.to_mermaid(b)


def test_model_colours_are_keyed_by_id_and_distinct():
    from flowrl.ir.graph import FlowGraph, Node
    from flowrl.diagnostics import Span
    from flowrl.catalog.ops import OpKind

    span = Span.point("x", 1, 1)

    def graph(ids):
        g = FlowGraph("f", span)
        for i in ids:
            g.add(Node(i, OpKind.MODEL, "tiny", (), (), span, role="trainable"))
        return g

    many = views.model_colours(graph([f"m{i}" for i in range(len(views.PALETTE))]))
    assert len(set(many.values())) == len(views.PALETTE)  # no two models share a colour
    alone = views.model_colours(graph(["policy"]))["policy"]
    assert alone == views.model_colours(graph(["policy"]))["policy"]
    assert alone == views.PALETTE[__import__("zlib").crc32(b"policy") % len(views.PALETTE)]


def test_mermaid_content(write_flow):
    text = views.to_mermaid(compile_file(write_flow("g.flow", GRPO)).graph)
    assert text.startswith("%% flowrl graph of flow `main`\nflowchart TB\n")
    assert 'n_resync_policy -.->|"weights d=1"| n_grpo_rollouts' in text
    assert 'n_grpo_update -->|"weights"| n_resync_policy' in text
    assert 'n_grpo_b -->|"prompt_ids"| n_grpo_rollouts' in text
    assert 'n_grpo_rollouts -->|"prompt_ids, response_ids, response_mask"| n_grpo_old_lp' in text
    assert 'n_resync_policy{{"resync.policy<br/>resync protocol=inplace"}}' in text
    assert re.search(r"class [a-z_,]*n_grpo_old_lp[a-z_,]* elided", text)
    assert 'n_policy[("policy<br/>tiny [trainable]")]' in text
    assert f"classDef m_policy_resync fill:" in text and f"stroke:{views.RESYNC_RED},stroke-width:3px" in text
    assert 'subgraph cluster_1["flow grpo"]' in text
    assert re.search(r"class [a-z_,]*n_grpo_ref_lp[a-z_,]* frozen", text)
    # every resource edge is thin and grey, by its index among the edges; edges of the elided
    # old-logprob pass are grey and dashed
    edges = [l for l in text.splitlines() if re.match(r"  n_\w+ -", l)]
    thin = {int(m) for m in re.findall(rf"linkStyle (\d+) stroke:{views.RESOURCE_GREY},stroke-width:1px", text)}
    dashed = {int(m) for m in re.findall(rf"linkStyle (\d+) stroke:{views.ELIDED_GREY},stroke-dasharray", text)}
    assert dashed == {i for i, l in enumerate(edges) if "n_grpo_old_lp" in l}
    assert thin == {i for i, l in enumerate(edges) if l.startswith(("  n_policy ", "  n_arith ", "  n_exact ",
                                                                     "  n_grpo_ref ")) and i not in dashed}


def test_mermaid_turn_and_ids_are_safe(write_flow, env_step_allowed):
    text = views.to_mermaid(compile_file(write_flow("p.flow", PPO_TURNS)).graph)
    assert 'n_convo_2 -.->|"turn"| n_obs' in text
    assert 'n_convo_2["convo#35;2<br/>generate n=1"]' in text  # `#` is an entity in Mermaid
    assert views.mermaid_ids(["a.b", "a_b", "a#b"]) == {"a.b": "n_a_b", "a_b": "n_a_b_2", "a#b": "n_a_b_3"}


def test_graph_command_dot_and_mermaid(write_flow, capsys, tmp_path):
    path = write_flow("g.flow", GRPO)
    graph = compile_file(path).graph
    assert main(["graph", str(path)]) == 0
    assert capsys.readouterr().out == views.to_dot(graph)
    assert main(["graph", str(path), "--format", "mermaid"]) == 0
    assert capsys.readouterr().out == views.to_mermaid(graph)
    out = tmp_path / "g.mmd"
    assert main(["graph", str(path), "-o", str(out)]) == 0  # format from the suffix
    assert out.read_text() == views.to_mermaid(graph)
    assert main(["graph", str(path), "--flow", "grpo", "--format", "dot"]) == 0
    assert capsys.readouterr().out.startswith('// flowrl graph of flow `grpo`')


@pytest.mark.parametrize("fmt,output,expected", [
    (None, None, "dot"), (None, "x.SVG", "svg"), (None, "x.png", "png"), (None, "x.gv", "dot"),
    (None, "x.mermaid", "mermaid"), (None, "x.txt", "dot"), ("mermaid", "x.svg", "mermaid")])
def test_graph_format_choice(fmt, output, expected):
    assert graph_format(fmt, output) == expected


@needs_dot
def test_graph_svg_and_png_via_graphviz(write_flow, tmp_path, capsys):
    path = write_flow("g.flow", GRPO)
    svg = tmp_path / "g.svg"
    assert main(["graph", str(path), "-o", str(svg)]) == 0
    text = svg.read_text()
    assert "<svg" in text and "resync.policy" in text and "weights d=1" in text
    assert main(["graph", str(path), "--format", "svg"]) == 0
    assert capsys.readouterr().out == text  # same bytes to stdout
    png = tmp_path / "g.png"
    assert main(["graph", str(path), "--format", "png", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_graph_without_graphviz_is_one_line(write_flow, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    path = write_flow("g.flow", GRPO)
    assert main(["graph", str(path), "--format", "svg"]) == 1
    assert capsys.readouterr().err == \
        "flowrl: error: Graphviz `dot` not found; install it (apt-get install graphviz)\n"
    assert main(["graph", str(path)]) == 0  # DOT text needs no Graphviz


def test_graph_output_errors_and_diagnostics(write_flow, capsys, tmp_path):
    path = write_flow("g.flow", GRPO)
    target = tmp_path / "no-such-dir" / "g.dot"
    assert main(["graph", str(path), "-o", str(target)]) == 1
    assert capsys.readouterr().err == f"flowrl: error: cannot write {target}: No such file or directory\n"
    bad = write_flow("bad.flow", UNKNOWN_NAME)
    assert main(["graph", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "error[E101]" in err
    assert main(["graph", str(path), "--format", "pdf"]) == 2
    assert "invalid choice: 'pdf'" in capsys.readouterr().err


def test_graph_refuses_png_on_a_terminal(write_flow, capsys, monkeypatch):
    path = write_flow("g.flow", GRPO)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert main(["graph", str(path), "--format", "png"]) == 2
    assert "refusing to write PNG bytes to a terminal; use -o FILE.png" in capsys.readouterr().err


def test_elided_ops_sit_outside_pools_and_a_repeat_loop_stays_whole(write_flow, env_step_allowed):
    """The elided old-logprob pass never runs, so no pool holds it; the repeat loop (generate on
    the rollout engine, env_step on the driver) is one box, inside the rollout engine's pool."""
    text = PPO_TURNS.replace("flow main() {", "flow main() {") + """
schedule main on cluster(nodes = 1, gpus_per_node = 2) {
  pool gen = gpus(gpus = 1)
  pool train = gpus(gpus = 1)
  place policy.rollout on gen
  colocate policy.train, critic on train
}
"""
    graph = compile_file(write_flow("s.flow", text)).graph
    pool_of, _ = views.pool_of_nodes(graph)
    assert pool_of["convo#2"] == pool_of["obs"] == pool_of["convo"] == "gen"  # env_step joins its loop
    dot = views.to_dot(graph)
    assert dot.count('label="repeat 3 until done"') == 1
