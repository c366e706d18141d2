"""Bad option values are refused the same way by every verb: a usage error (exit 2) naming the
option and the value, before anything is compiled, started or written.

The category is read from the parser itself: every option of every command that takes a number
or a path to write goes through one of `flowrl.cli`'s validators, and each is tried with the
values it must refuse.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from flowrl import cli
from flowrl.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "flows" / "arith_grpo.flow")
PATH_TYPES = (cli.out_dir, cli.out_file)


def typed_options():
    """(command, option string, type) of every option of every command that has a ``type``."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if action.option_strings and action.type is not None:
                yield name, action.option_strings[-1], action.type


def bad_values(kind, tmp_path: Path) -> list[str]:
    """Values the validator ``kind`` must refuse."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    if kind in PATH_TYPES:
        return [str(afile / "sub"), str(afile / "sub" / "deeper.png"), ""]
    if hasattr(kind, "above"):
        return ["nan", "inf", "-inf", "x"]
    least = kind.least
    return [str(least - 1), str(least - 5), "x", "1.5", ""]


def test_every_numeric_option_goes_through_a_validator():
    raw = [(c, o) for c, o, t in typed_options() if t in (int, float)]
    assert not raw, f"options typed with a bare int/float (give them flowrl.cli.count/real): {raw}"
    assert len(list(typed_options())) >= 20  # the category is really walked


@pytest.mark.parametrize("command, option, kind", list(typed_options()), ids=lambda v: getattr(v, "__qualname__", v))
def test_each_option_refuses_bad_values_naming_option_and_value(command, option, kind, tmp_path, capsys, monkeypatch):
    import flowrl.launch as launch

    monkeypatch.setattr(launch, "run_plan", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.chdir(tmp_path)
    for value in bad_values(kind, tmp_path):
        assert main([command, DEFAULT, f"{option}={value}"]) == 2, (command, option, value)
        err = capsys.readouterr().err
        assert f"argument {option}" in err or f"/{option}:" in err, err
        assert (value.strip() or "''") in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written


@pytest.mark.parametrize("argv, message", [
    (["run", DEFAULT, "--save-every", "-3"], "argument --save-every: -3 is less than 0"),
    (["run", DEFAULT, "--steps", "0"], "argument --steps: 0 is less than 1; give an integer >= 1 (a run trains"),
    (["plan", DEFAULT, "--steps", "-5"], "argument --steps: -5 is less than 1"),
    (["run", DEFAULT, "--restarts", "-1"], "argument --restarts: -1 is less than 0"),
    (["run", DEFAULT, "--log-samples", "-2"], "argument --log-samples: -2 is less than 0"),
    (["eval", DEFAULT, "--n", "-1"], "argument --n: -1 is less than 0"),
    (["eval", DEFAULT, "--k", "0"], "argument --k: '0': 0 is less than 1"),
    (["eval", DEFAULT, "--k", "1,x"], "argument --k: '1,x': 'x' is not a whole number"),
    (["run", DEFAULT, "--out", "afile/sub"], "argument --out: afile/sub:"),
])
def test_the_issue_examples(argv, message, tmp_path, capsys, monkeypatch):
    import flowrl.launch as launch

    monkeypatch.setattr(launch, "run_plan", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "internal error" not in err, err


def test_an_out_that_cannot_be_created_is_one_line_not_an_internal_error(tmp_path, capsys, monkeypatch):
    """Where the parser cannot tell (root may write anywhere, /proc refuses anyway), the run says so."""
    import flowrl.launch as launch

    monkeypatch.setattr(launch, "run_plan", lambda *a, **k: pytest.fail("a run started"))
    assert main(["run", DEFAULT, "--steps", "1", "--out", "/proc/flowrl-test/x"]) in (1, 2)
    err = capsys.readouterr().err
    assert "--out" in err and "/proc/flowrl-test/x" in err and "internal error" not in err, err


def test_library_callers_get_the_same_refusal():
    from flowrl.launch import RunError, build_plan

    with pytest.raises(RunError, match="--steps -5: a run trains at least one step"):
        build_plan(DEFAULT, steps=-5)
    with pytest.raises(RunError, match="--save-every -3: give a number of steps >= 0"):
        build_plan(DEFAULT, save_every=-3)


def test_an_output_file_that_exists_is_written_over(tmp_path):
    """`flowrl graph -o g.svg` or `plan --gantt g.png` a second time replaces the first file."""
    old = tmp_path / "g.png"
    old.write_text("the last chart")
    assert cli.out_file(str(old)) == str(old)
