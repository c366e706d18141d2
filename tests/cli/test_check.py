"""`flowrl check`, --version, --help and usage errors, run in-process through main()."""

from __future__ import annotations

import pytest

from cli_flows import GRPO, PPO_TURNS, SYNTAX_ERROR, TWO_CALLS, UNKNOWN_NAME
from flowrl import __version__
from flowrl.cli import COMMANDS, main


def test_check_ok_prints_one_line_per_file(write_flow, capsys, env_step_allowed):
    a, b = write_flow("a.flow", GRPO), write_flow("b.flow", PPO_TURNS)
    assert main(["check", str(a), str(b)]) == 0
    out, err = capsys.readouterr()
    assert out == f"ok: {a} (2 flows)\nok: {b} (1 flow)\n"
    assert err == ""


def test_check_failing_file_renders_diagnostic_and_exits_1(write_flow, capsys):
    bad, good = write_flow("bad.flow", UNKNOWN_NAME), write_flow("good.flow", TWO_CALLS)
    assert main(["check", str(bad), str(good)]) == 1
    out, err = capsys.readouterr()
    assert out == f"ok: {good} (2 flows)\n"  # the other file is still checked
    assert f"{bad}:4:13: error[E101]: unknown name `rolouts`" in err
    assert "4 |   s = score(rolouts)" in err
    assert "  |             ^^^^^^^" in err
    assert err.rstrip().endswith("flowrl: 1 error in 1 of 2 files")


def test_check_syntax_error(write_flow, capsys):
    bad = write_flow("syntax.flow", SYNTAX_ERROR)
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:1:" in err and "error[E0" in err


def test_check_quiet_prints_only_diagnostics(write_flow, capsys):
    good, bad = write_flow("good.flow", GRPO), write_flow("bad.flow", UNKNOWN_NAME)
    assert main(["check", "--quiet", str(good)]) == 0
    assert capsys.readouterr() == ("", "")
    assert main(["check", "-q", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "error[E101]" in err and "flowrl: 1 error" not in err


def test_check_directory_means_its_flow_files_sorted(write_flow, tmp_path, capsys):
    write_flow("d/z.flow", GRPO)
    write_flow("d/sub/a.flow", TWO_CALLS)
    write_flow("d/notes.txt", "not a flow")
    assert main(["check", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"ok: {tmp_path / 'd/sub/a.flow'} (2 flows)", f"ok: {tmp_path / 'd/z.flow'} (2 flows)"]


def test_check_empty_directory_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["check", str(tmp_path / "empty")]) == 1
    assert capsys.readouterr().err == f"flowrl: error: no .flow files under directory {tmp_path / 'empty'}\n"


def test_check_missing_file_is_a_diagnostic(tmp_path, capsys):
    missing = tmp_path / "nope.flow"
    assert main(["check", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"{missing}:1:1: error[E124]: no such file: {missing}" in err


@pytest.mark.parametrize("argv", [["check"], ["check", "--bogus", "x.flow"], ["frobnicate"], []])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage: flowrl" in capsys.readouterr().err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"flowrl {__version__}\n"


def test_help_lists_commands_and_each_command_has_examples(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    for name in ("check", "fmt", "ir", "graph"):
        assert name in top
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert f"usage: flowrl {name}" in text
        assert "examples:" in text and f"flowrl {name} " in text.split("examples:")[1]
    assert "exit codes: 0 ok, 1 diagnostics or failed check, 2 usage error" in top


def test_command_table_is_the_extension_point():
    assert list(COMMANDS)[:4] == ["check", "fmt", "ir", "graph"]
    for cmd in COMMANDS.values():
        assert cmd.help and cmd.examples and callable(cmd.add_args) and callable(cmd.handler)


def test_internal_error_is_one_line_unless_traceback(write_flow, capsys, monkeypatch):
    import flowrl.compiler.pipeline as pipeline

    def boom(path, unit=None):
        raise RuntimeError("simulated compiler bug")

    monkeypatch.setattr(pipeline, "check_file", boom)
    path = write_flow("a.flow", GRPO)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == ("flowrl: internal error: RuntimeError: simulated compiler bug "
                   "(rerun with --traceback and please report it)\n")
    with pytest.raises(RuntimeError, match="simulated compiler bug"):
        main(["--traceback", "check", str(path)])
