"""Golden tests of the front end: exact diagnostics of invalid programs, exact IR of valid ones.

Layout (all paths relative to the repository root, which is the working directory here):

* ``tests/golden/invalid/NAME.flow`` -> ``NAME.expected``: the rendered ``FlowError`` of
  ``check_file(path)``, byte for byte (helper files for imports live in ``invalid/lib/``);
* ``tests/golden/valid/NAME.flow`` -> ``NAME.ir``: ``print_graph`` of the entry flow after
  every pass (linted after each pass);
* ``tests/golden/warnings/NAME.flow`` -> ``NAME.expected`` and ``NAME.ir``: programs that
  compile with warnings: the rendered warnings of ``check_file`` and the IR (what the
  dead-code pass removed is gone from it);
* ``tests/golden/generated/NAME.expected``: diagnostics of inputs built by the tests
  (a file too large to commit).

A first line ``# golden: KEY=VALUE`` changes what is run: ``flow=NAME`` compiles that flow
(``compile_file(path, flow=NAME)``), ``entry`` compiles the entry flow, ``check=PATH``
checks another path (a missing file, a directory), ``set=NAME=VALUE`` overrides a
parameter of the entry flow as ``flowrl run --set`` does.

The standard library is ``tests/golden/stdlib/`` (``$FLOWRL_STDLIB``), so the goldens do
not move when the real ``stdlib/`` changes. Regenerate every expected file with
``FLOWRL_REGEN=1 pytest tests/golden`` and read the diff as a user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.compiler.pipeline import check_file, compile_file
from flowrl.diagnostics import FlowError, in_source_order, render_all
from flowrl.ir.printer import print_graph

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
INVALID = sorted(p for p in (HERE / "invalid").glob("*.flow"))
VALID = sorted(p for p in (HERE / "valid").glob("*.flow"))
WARNING = sorted(p for p in (HERE / "warnings").glob("*.flow"))
REGEN = os.environ.get("FLOWRL_REGEN") == "1"

_DIRECTIVE = re.compile(rb"^# golden: (\w+)(?:=(.*))?$")


@pytest.fixture(autouse=True)
def _golden_env(monkeypatch):
    """Run from the repository root (paths in diagnostics are relative to it), fixed stdlib."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("FLOWRL_STDLIB", str(HERE / "stdlib"))


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _directive(path: Path) -> tuple[str, str | None]:
    first = path.read_bytes().split(b"\n", 1)[0].rstrip(b"\r")
    m = _DIRECTIVE.match(first)
    if not m:
        return "check", None
    return m.group(1).decode(), m.group(2).decode() if m.group(2) is not None else None


def _run(path: Path):
    """Compile ``path`` as its directive says; return the graphs (or raise FlowError)."""
    key, value = _directive(path)
    rel = _rel(path)
    if key == "check":
        return check_file(value or rel)
    if key == "flow":
        return compile_file(rel, flow=value, lint_each=True).graph
    if key == "entry":
        return compile_file(rel, lint_each=True).graph
    if key == "set":
        name, _, text = value.partition("=")
        return compile_file(rel, options={"overrides": {name: text}}).graph
    raise AssertionError(f"{rel}: unknown golden directive {key!r}")


def _compare(actual: str, expected_path: Path) -> None:
    if REGEN:
        expected_path.parent.mkdir(exist_ok=True)
        expected_path.write_text(actual, encoding="utf-8")
        return
    assert expected_path.exists(), f"missing {_rel(expected_path)}: run with FLOWRL_REGEN=1"
    assert actual == expected_path.read_text(encoding="utf-8")


def _diagnostics_of(path: Path) -> FlowError:
    with pytest.raises(FlowError) as info:
        _run(path)
    return info.value


# ---- invalid programs: exact rendered diagnostics ----------------------------------------


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_program_diagnostics(path: Path):
    err = _diagnostics_of(path)
    _compare(err.render(), path.with_suffix(".expected"))


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_every_diagnostic_points_into_its_file(path: Path):
    """A position in the file the diagnostic is about: an existing line, a column on it."""
    err = _diagnostics_of(path)
    assert err.diagnostics
    for d in err.diagnostics:
        s = d.span
        assert s.line >= 1 and s.column >= 1, d
        assert (s.end_line, s.end_column) >= (s.line, s.column), d
        target = REPO / s.path
        if d.code == "E124":  # the file that cannot be read is the subject
            assert not target.is_file()
            continue
        lines = target.read_bytes().decode("utf-8", errors="replace").split("\n")
        assert s.line <= len(lines), d
        assert s.column <= len(lines[s.line - 1]) + 1, d
        assert d.message and "\n" not in d.message, d
        for _, note_span in d.notes:
            assert (REPO / note_span.path).is_file() and note_span.line >= 1 and note_span.column >= 1


# The front end: everything ``check_file`` runs. (Lowering to a plan, flowrl/compiler/lower.py,
# has its own codes, E5xx, and its own tests.)
FRONT_END = ("flowrl/syntax", "flowrl/compiler/passes", "flowrl/compiler/pipeline.py",
             "flowrl/compiler/unit.py", "flowrl/compiler/kwargs.py", "flowrl/ir", "flowrl/diagnostics.py")


NO_GOLDEN = {"E444": "every shipped record runs on every platform: tests/compiler/test_check_platform.py "
                     "refuses records it makes platform-limited",
             "E640": "every environment library is installed by `make`: tests/envs/test_libraries.py "
                     "hides one from the check",
             "E642": "the message names the installed game's file and this Python's version (not portable): "
                     "tests/envs/test_libraries.py checks a TextArena game that needs Python 3.12"}
"""Codes no program can raise with the shipped catalogue, and the test that raises each."""


def test_every_diagnostic_code_has_a_golden():
    """Each code the front end can raise appears in at least one expected file (or in :data:`NO_GOLDEN`,
    whose test must raise it)."""
    in_use = set()
    for part in FRONT_END:
        root = REPO / part
        for src in ([root] if root.is_file() else root.rglob("*.py")):
            in_use |= set(re.findall(r'"([EW]\d{3})"', src.read_text()))
    expected = set()
    for exp in [*(HERE / "invalid").glob("*.expected"), *(HERE / "generated").glob("*.expected"),
                *(HERE / "warnings").glob("*.expected")]:
        expected |= set(re.findall(r"(?:error|warning)\[([EW]\d{3})\]", exp.read_text(encoding="utf-8")))
    for code, why in NO_GOLDEN.items():  # still raised by the front end, and by the test named
        test = REPO / why.split(": ")[1].split()[0]
        assert code in in_use and code in test.read_text(), (code, why)
    missing = sorted(in_use - expected - set(NO_GOLDEN))
    assert not missing, f"no golden program produces {', '.join(missing)}: add one to tests/golden/invalid/"
    assert len(INVALID) >= 50


def test_no_stale_expected_files():
    flows = {p.stem for p in INVALID}
    stale = [p.name for p in (HERE / "invalid").glob("*.expected") if p.stem not in flows]
    warned = {p.stem for p in WARNING}
    stale += [p.name for p in (HERE / "warnings").glob("*.*") if p.suffix != ".flow" and p.stem not in warned]
    assert not stale, f"expected files without a program: {stale}"


# ---- programs that compile with warnings -------------------------------------------------


@pytest.mark.parametrize("path", WARNING, ids=lambda p: p.stem)
def test_warning_diagnostics_and_ir(path: Path):
    """``check_file`` accepts the program; its warnings (deduplicated over the file's flows)
    and the IR without the dead ops are exact."""
    graphs = check_file(_rel(path))
    warnings = in_source_order(dict.fromkeys(w for g in graphs.values() for w in g.warnings))
    assert warnings and all(w.severity == "warning" and w.code.startswith("W") for w in warnings)
    sources = next(iter(graphs.values())).sources
    _compare(render_all(warnings, sources), path.with_suffix(".expected"))
    graph = compile_file(_rel(path), lint_each=True).graph
    _compare(print_graph(graph), path.with_suffix(".ir"))


def test_warnings_travel_with_later_errors(tmp_path, monkeypatch):
    """A later pass's errors come with the warnings found before them, in source order."""
    (tmp_path / "w.flow").write_text(
        'model policy = tiny(task = "arith")\ndataset arith = jsonl("data/arith/train.jsonl")\n'
        "flow main() {\n  r = generate(policy, sample(arith))\n}\n"
        "schedule main on cluster(gpus_per_node = 2) {\n  staleness 0\n}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FlowError) as info:
        check_file("w.flow")
    assert [(d.code, d.severity) for d in info.value.diagnostics] == [("W001", "warning"), ("E408", "error")]
    assert [d.code for d in info.value.errors] == ["E408"] and [d.code for d in info.value.warnings] == ["W001"]


# ---- inputs generated here -----------------------------------------------------------------


def test_huge_file_is_rejected_before_parsing(tmp_path, monkeypatch):
    """A 5 MB file (over the 4 MB limit): one E003 at 1:1, no parse attempted."""
    statement = '  b = sample(arith, size = 8)  # padding to make the file large\n'
    body = statement * (5 * 1024 * 1024 // len(statement) + 1)
    (tmp_path / "huge.flow").write_text("flow main() {\n" + body + "}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FlowError) as info:
        check_file("huge.flow")
    _compare(info.value.render(), HERE / "generated" / "e003_huge_file.expected")


def test_many_errors_are_all_reported(tmp_path, monkeypatch):
    """200 independent mistakes in one flow: 200 diagnostics, in source order."""
    lines = ['dataset arith = jsonl("data/arith/train.jsonl")', "flow main() {"]
    lines += [f"  b{i} = sample(arith, size = {-i})" for i in range(200)]
    lines.append("}")
    (tmp_path / "many.flow").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FlowError) as info:
        check_file("many.flow")
    diags = info.value.diagnostics
    assert [d.code for d in diags] == ["E208"] * 200
    assert [d.span.line for d in diags] == list(range(3, 203))
    assert diags[57].message == "option `size` of `sample` must be >= 1, got -57"


# ---- valid programs: exact IR, deterministic -------------------------------------------------


def _ir(path: Path) -> str:
    graph = _run(path) if _directive(path)[0] != "check" else compile_file(_rel(path), lint_each=True).graph
    return print_graph(graph)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_valid_program_ir(path: Path):
    _compare(_ir(path), path.with_suffix(".ir"))


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_valid_program_checks_clean(path: Path):
    """``check_file`` (every flow of the file, not only the entry) accepts it too."""
    graphs = check_file(_rel(path))
    assert graphs and all(g.name == name for name, g in graphs.items())


def test_ir_is_deterministic_within_a_process():
    first = [_ir(p) for p in VALID]
    second = [_ir(p) for p in VALID]
    assert first == second


def test_ir_is_deterministic_across_hash_seeds():
    """Set and dict iteration must not leak into the IR text: another PYTHONHASHSEED, same text."""
    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "from test_golden import VALID, _ir\n"
        "sys.stdout.write('\\x00'.join(_ir(p) for p in VALID))\n" % str(HERE)
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", FLOWRL_STDLIB=str(HERE / "stdlib"))
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.split("\x00") == [_ir(p) for p in VALID]


def test_golden_set_covers_the_brief():
    """The valid set keeps its required shapes (a guard against deleting one by accident)."""
    names = {p.stem for p in VALID}
    assert {"grpo", "ppo_critic", "rloo", "multi_turn", "nested_flows", "import_alias",
            "schedule_all", "user_call"} <= names
    assert "distance=1" in (HERE / "valid" / "multi_turn.ir").read_text()
    assert "turn:" in (HERE / "valid" / "multi_turn.ir").read_text()


def test_file_larger_than_any_encoding_allows_is_not_read_whole(tmp_path, monkeypatch):
    """Over 4 bytes per allowed character: rejected (E003) after a bounded read."""
    (tmp_path / "giant.flow").write_bytes(b"#" * (16 * 1024 * 1024 + 2))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FlowError) as info:
        check_file("giant.flow")
    _compare(info.value.render(), HERE / "generated" / "e003_giant_file.expected")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_named_pipe_is_rejected_without_blocking(tmp_path, monkeypatch):
    """Reading a FIFO would block forever; it is not a regular file, so it is refused (E124)."""
    os.mkfifo(tmp_path / "pipe.flow")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FlowError) as info:
        check_file("pipe.flow")
    _compare(info.value.render(), HERE / "generated" / "e124_named_pipe.expected")
