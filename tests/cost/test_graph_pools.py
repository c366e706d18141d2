"""`flowrl graph` clusters ops by the pool of GPUs their engine runs on."""

from __future__ import annotations

import re

from cost_cases import ROOT

from flowrl import views
from flowrl.cli import main
from flowrl.compiler.pipeline import compile_file

DISAGG = str(ROOT / "flows" / "grpo_disaggregated.flow")


def _block(dot: str, name: str) -> str:
    """The text of ``subgraph "name" { ... }`` (nested braces counted)."""
    start = dot.index(f'subgraph "{name}" {{')
    depth, i = 0, start
    while True:
        depth += {"{": 1, "}": -1}.get(dot[i], 0)
        if dot[i] == "}" and depth == 0:
            return dot[start:i + 1]
        i += 1


def test_dot_has_one_cluster_per_pool_with_its_ops_and_gpus():
    dot = views.to_dot(compile_file(DISAGG).graph)
    gen, train = _block(dot, "cluster_pool_gen"), _block(dot, "cluster_pool_train")
    assert 'label="pool gen: GPUs 0-3 (node 0)"' in gen
    assert 'label="pool train: GPUs 4-7 (node 0)"' in train
    assert '"grpo.rollouts" [' in gen and '"grpo.update" [' not in gen
    for op in ("grpo.ref_lp", "grpo.update", "resync.policy"):
        assert f'"{op}" [' in train
    assert '"grpo.old_lp" [' not in gen + train  # elided (one optimiser step): it runs on no engine
    for driver_op in ("grpo.prompt_batch", "grpo.scores", "grpo.adv"):  # driver-side: in no pool
        assert f'"{driver_op}" [' not in gen + train
    assert dot.count("flow grpo") == 3  # the call box, inside each pool and outside


def test_mermaid_has_pool_subgraphs():
    text = views.to_mermaid(compile_file(DISAGG).graph)
    assert 'subgraph pool_gen["pool gen: GPUs 0-3 (node 0)"]' in text
    body = text.split('subgraph pool_gen[')[1].split("\n  end\n")[0]
    assert "n_grpo_rollouts[" in body and "n_grpo_update" not in body
    assert f"style pool_train stroke:{views.POOL_BLUE}" in text


def test_colocated_engines_share_one_pool_box():
    graph = compile_file(str(ROOT / "flows" / "arith_grpo.flow")).graph
    pool_of, boxes = views.pool_of_nodes(graph)
    assert [b.label for b in boxes] == ["pool all: GPU 0 (node 0)"]
    assert {pool_of[n] for n in ("grpo.rollouts", "grpo.update")} == {"all"}
    assert "grpo.ref_lp" not in pool_of  # kl = 0: the reference pass is elided and its engine not placed
    assert "grpo.scores" not in pool_of


def test_no_schedule_no_pool_boxes(tmp_path):
    f = tmp_path / "plain.flow"
    f.write_text("model m = tiny()\nflow main(d: dataset) {\n  b = sample(d, size = 4)\n"
                 "  r = generate(m, b, n = 2)\n}\n")
    graph = compile_file(str(f)).graph
    assert views.pool_of_nodes(graph) == ({}, [])
    assert "cluster_pool" not in views.to_dot(graph)


def test_gpu_ranges():
    assert views._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert views._ranges([3]) == "3"


def test_graph_cli_shows_pools(capsys):
    assert main(["graph", DISAGG, "--format", "mermaid"]) == 0
    assert re.search(r'subgraph pool_train\["pool train: GPUs 4-7', capsys.readouterr().out)
