"""`flowrl fmt`: stdout, --check, --diff, --write (only when changed; never on errors), stdin."""

from __future__ import annotations

import io
import os

from cli_flows import FORMATTED, MESSY, SYNTAX_ERROR
from flowrl.cli import main


def test_fmt_prints_canonical_text(write_flow, capsys):
    path = write_flow("m.flow", MESSY)
    assert main(["fmt", str(path)]) == 0
    assert capsys.readouterr() == (FORMATTED, "")
    assert path.read_text() == MESSY  # printing never writes


def test_fmt_check_lists_files_that_would_change(write_flow, capsys):
    messy, clean = write_flow("messy.flow", MESSY), write_flow("clean.flow", FORMATTED)
    assert main(["fmt", "--check", str(messy), str(clean)]) == 1
    assert capsys.readouterr().out == f"would reformat: {messy}\n"
    assert messy.read_text() == MESSY
    assert main(["fmt", "--check", str(clean)]) == 0
    assert capsys.readouterr() == ("", "")


def test_fmt_diff_is_a_unified_diff(write_flow, capsys):
    path = write_flow("m.flow", MESSY)
    assert main(["fmt", "--diff", str(path)]) == 0  # like black: --diff alone does not fail
    out = capsys.readouterr().out
    assert out.startswith(f"--- a/{path}\n+++ b/{path}\n@@ ")
    assert "-r=generate(m,b)}\n" in out
    assert "+  r = generate(m, b)\n" in out
    assert path.read_text() == MESSY
    assert main(["fmt", "--diff", "--check", str(path)]) == 1


def test_fmt_write_rewrites_only_changed_files(write_flow, capsys):
    messy, clean = write_flow("messy.flow", MESSY), write_flow("clean.flow", FORMATTED)
    os.chmod(messy, 0o640)
    old = 1_000_000_000
    os.utime(clean, ns=(old, old))
    assert main(["fmt", "-w", str(messy), str(clean)]) == 0
    out, err = capsys.readouterr()
    assert err == f"reformatted: {messy}\n" and out == ""
    assert messy.read_text() == FORMATTED
    assert (messy.stat().st_mode & 0o777) == 0o640  # permissions kept
    assert clean.stat().st_mtime_ns == old  # untouched: not even rewritten with the same text
    assert sorted(p.name for p in messy.parent.iterdir()) == ["clean.flow", "messy.flow"]  # no temp files
    assert main(["fmt", "--write", "--quiet", str(messy)]) == 0
    assert capsys.readouterr() == ("", "")


def test_fmt_write_leaves_a_file_with_errors_untouched(write_flow, capsys):
    bad, messy = write_flow("bad.flow", SYNTAX_ERROR), write_flow("messy.flow", MESSY)
    assert main(["fmt", "--write", str(bad), str(messy)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "error[E0" in err
    assert bad.read_bytes() == SYNTAX_ERROR.encode()
    assert messy.read_text() == FORMATTED  # the good file is still formatted


def test_fmt_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(MESSY))
    assert main(["fmt", "-"]) == 0
    assert capsys.readouterr().out == FORMATTED


def test_fmt_usage_errors(write_flow, capsys):
    a, b = write_flow("a.flow", MESSY), write_flow("b.flow", MESSY)
    assert main(["fmt", str(a), str(b)]) == 2
    assert "use --write, --check or --diff for several files" in capsys.readouterr().err
    assert main(["fmt", "--write", "--check", str(a)]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["fmt", "--write", "-"]) == 2
    assert "cannot --write standard input" in capsys.readouterr().err
    assert a.read_text() == MESSY


def test_fmt_write_failure_is_one_line_and_other_files_go_on(write_flow, capsys, monkeypatch):
    import errno
    import tempfile

    first, second = write_flow("a.flow", MESSY), write_flow("b.flow", MESSY)
    real = tempfile.mkstemp

    def mkstemp(prefix="", suffix="", dir=None):  # the disk is full while writing a.flow
        if prefix.startswith(".a.flow"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(prefix=prefix, suffix=suffix, dir=dir)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    assert main(["fmt", "--write", str(first), str(second)]) == 1
    err = capsys.readouterr().err
    assert err == (f"flowrl: error: cannot write {first}: No space left on device\n"
                   f"reformatted: {second}\n")
    assert first.read_text() == MESSY and second.read_text() == FORMATTED
