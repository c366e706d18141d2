"""No test compares wall-clock times: a timed pass is slower on a busy machine, whatever the code does.

One did (``tests/cost/test_trainbench.py`` asserted that one timed pass took longer than another) and
``make test`` failed on a loaded machine. Tests assert what the code computes; speed is measured by the
benchmarks in ``bench/``. What this test finds, from the AST of every test module:

- an ``assert`` that reads a clock (``time.time()``, ``time.perf_counter()``, ``time.monotonic()``,
  ``process_time``, ``thread_time``, ``datetime.now()``), directly or through a variable the function
  assigned from one (``t0 = time.monotonic(); ... assert time.monotonic() - t0 < 30``);
- an ``assert`` that compares two measured durations of a run (metric fields such as ``time/...``,
  ``perf/...``, ``wall_s``, ``engine_s``, ``sync/seconds``) with each other.

The one exception is a hang detector: a clock read compared with a generous constant bound (10 s or
more) on a line that says ``# deadline``, or with a variable named ``deadline`` (a wait's limit): the
test would otherwise wait forever, and the bound is far from any real time.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = sorted((ROOT / "tests").rglob("*.py"))
CLOCKS = {"time", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time", "thread_time",
          "time_ns", "now", "utcnow"}
MEASURED = ("time/", "perf/", "wall_s", "engine_s", "process_s", "sync/seconds", "elapsed")
MIN_DEADLINE_S = 10.0
"""A deadline's bound: a hang detector waits at least this long."""


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in CLOCKS:
        base = f.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        return name in {"time", "datetime"}
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time", "now"}  # `from time import perf_counter`


def _clock_names(func: ast.AST) -> set[str]:
    """Names a function assigns from an expression that reads a clock (``t0 = time.monotonic()``)."""
    names = set()
    for node in ast.walk(func):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if any(_is_clock_call(n) for n in ast.walk(node.value)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _reads_clock(expr: ast.AST, clock_names: set[str]) -> bool:
    return any(_is_clock_call(n) or (isinstance(n, ast.Name) and n.id in clock_names) for n in ast.walk(expr))


def _measured(expr: ast.AST) -> bool:
    for n in ast.walk(expr):
        text = n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else \
            n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else ""
        if any(m in text for m in MEASURED):
            return True
    return False


def _constant_bound(node: ast.Compare) -> float | None:
    for side in (node.left, *node.comparators):
        if isinstance(side, ast.Constant) and isinstance(side.value, (int, float)):
            return float(side.value)
    return None


def timing_asserts(source: str, where: str) -> list[str]:
    """Every ``assert`` of ``source`` that compares wall-clock times (see the module docstring).

    >>> timing_asserts("import time\\ndef t():\\n    a = time.time()\\n    assert time.time() - a < 1\\n", "x")
    ['x:4: the assert reads a clock']
    >>> timing_asserts("def t(r):\\n    assert r['time/step'] > 0\\n", "x")
    []
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        clock_names = _clock_names(func)
        for node in ast.walk(func):
            if not isinstance(node, ast.Assert):
                continue
            line = lines[node.lineno - 1]
            for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                sides = [cmp.left, *cmp.comparators]
                if any(_reads_clock(s, clock_names) for s in sides):
                    bound = _constant_bound(cmp)
                    if "# deadline" in line and bound is not None and bound >= MIN_DEADLINE_S:
                        continue
                    if any(isinstance(n, ast.Name) and "deadline" in n.id for s in sides for n in ast.walk(s)):
                        continue  # `while ...: assert time.monotonic() < deadline` (a wait's limit)
                    found.append(f"{where}:{node.lineno}: the assert reads a clock")
                    break
                if sum(_measured(s) for s in sides) >= 2:
                    found.append(f"{where}:{node.lineno}: the assert compares two measured durations")
                    break
    return found


def test_no_test_compares_wall_clock_times():
    found = []
    for path in TESTS:
        found += timing_asserts(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, ("tests must not compare wall-clock times (they fail on a busy machine); assert what the "
                       "code computes and time things in bench/. A hang detector is a generous constant bound "
                       "on a line marked `# deadline`:\n" + "\n".join(found))


def test_the_rule_finds_the_kinds_it_names():
    two_passes = "import time\ndef t(f):\n    a = time.perf_counter(); f()\n    b = time.perf_counter() - a\n" \
                 "    assert b < 0.5\n"
    metrics = "def t(x, y):\n    assert x['time/step'] < y['time/step']\n"
    deadline = "import time\ndef t():\n    t0 = time.monotonic()\n    assert time.monotonic() - t0 < 60  # deadline\n"
    short = "import time\ndef t():\n    t0 = time.monotonic()\n    assert time.monotonic() - t0 < 1  # deadline\n"
    assert timing_asserts(two_passes, "a") == ["a:5: the assert reads a clock"]
    assert timing_asserts(metrics, "m") == ["m:2: the assert compares two measured durations"]
    assert timing_asserts(deadline, "d") == []
    assert timing_asserts(short, "s") == ["s:4: the assert reads a clock"]
    waiting = "import time\ndef t(up):\n    deadline = time.time() + 120\n    while not up():\n" \
              "        assert time.time() < deadline\n"
    assert timing_asserts(waiting, "w") == []
