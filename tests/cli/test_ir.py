"""`flowrl ir`: the printed IR after every pass, --flow, --lint and bad pass names."""

from __future__ import annotations

import pytest

from cli_flows import GRPO, UNKNOWN_NAME
from flowrl.cli import main
from flowrl.compiler.pipeline import PASS_NAMES, compile_file
from flowrl.ir.printer import print_graph


def test_ir_default_is_the_graph_after_all_passes(write_flow, capsys):
    path = write_flow("g.flow", GRPO)
    assert main(["ir", str(path)]) == 0
    out = capsys.readouterr().out
    assert out == print_graph(compile_file(path).graph)
    assert out.startswith("flow main()\n")
    assert "%resync.policy -> %grpo.rollouts  weights:weights  loop distance=1" in out


@pytest.mark.parametrize("stage", ("build",) + PASS_NAMES)
def test_ir_dump_after_each_pass(stage, write_flow, capsys):
    path = write_flow("g.flow", GRPO)
    assert main(["ir", str(path), "--dump-after", stage]) == 0
    out = capsys.readouterr().out
    assert out == print_graph(compile_file(path, until=stage).graph)
    before_resync = stage in ("build",) + PASS_NAMES[: PASS_NAMES.index("insert_resyncs")]
    assert ("%resync.policy" in out) is not before_resync
    if stage == "build":  # the raw graph: one unresolved call, no edges yet
        assert "grpo(%policy, %arith, %exact, group=4)" in out
        assert out.rstrip().endswith("edges")
    else:  # inlined, with edges
        assert "%grpo.rollouts" in out and "%grpo.b -> %grpo.rollouts  data:prompts" in out


def test_ir_flow_option_and_lint(write_flow, capsys):
    path = write_flow("g.flow", GRPO)
    assert main(["ir", str(path), "--flow", "grpo", "--lint"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("flow grpo(policy: model, prompts: dataset, reward: reward, group: int = 8)\n")
    assert out == print_graph(compile_file(path, flow="grpo").graph)


def test_ir_unknown_pass_is_a_usage_error_listing_passes(write_flow, capsys):
    path = write_flow("g.flow", GRPO)
    assert main(["ir", str(path), "--dump-after", "resolve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: flowrl ir")
    assert f"choose from: build, {', '.join(PASS_NAMES)}" in err


def test_ir_unknown_flow_and_bad_file_are_diagnostics(write_flow, capsys):
    path = write_flow("g.flow", GRPO)
    assert main(["ir", str(path), "--flow", "grp"]) == 1
    assert "error[E121]: no flow `grp`" in capsys.readouterr().err
    bad = write_flow("bad.flow", UNKNOWN_NAME)
    assert main(["ir", str(bad)]) == 1
    assert f"{bad}:4:13: error[E101]" in capsys.readouterr().err


def test_ir_lint_failure_names_the_pass(write_flow, capsys, monkeypatch):
    import flowrl.compiler.pipeline as pipeline

    # Simulate a pass that breaks an IR invariant: lint reports one problem.
    monkeypatch.setattr(pipeline, "lint", lambda graph: ["node %x: simulated broken invariant"])
    path = write_flow("g.flow", GRPO)
    assert main(["ir", str(path), "--lint"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flowrl: error: internal compiler error (please report it): "
                          "IR invariant broken after pass `resolve_names` (passes run: resolve_names)")
    assert "simulated broken invariant" in err
