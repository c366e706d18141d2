"""flowrl.sandbox: run_code's results, arguments and errors; the pool under concurrent callers."""

from __future__ import annotations

import signal
import threading

import pytest

from flowrl.sandbox import LANGUAGES, Limits, SandboxError, SandboxPool, run_code
from flowrl.sandbox.seccomp import DENIED, build_filter


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(2, limits=Limits(timeout_s=3.0)) as p:
        yield p


def test_run_code_default_pool():
    res = run_code("import sys\nprint(sys.stdin.read()[::-1])\nprint('warn', file=sys.stderr)", stdin="abc")
    assert (res.stdout, res.stderr, res.exit_code, res.ok) == ("cba\n", "warn\n", 0, True)
    assert not res.timed_out and not res.memory_exceeded and res.killed_signal is None and res.wall_s > 0


def test_exit_codes_and_signals(pool):
    res = pool.run("import sys; sys.exit(3)")
    assert res.exit_code == 3 and res.killed_signal is None and not res.ok
    res = pool.run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert res.exit_code == -signal.SIGSEGV and res.killed_signal == signal.SIGSEGV and not res.timed_out
    res = pool.run("raise ValueError('nope')")
    assert res.exit_code == 1 and res.stderr.rstrip().endswith("ValueError: nope")


def test_files_are_in_the_working_directory(pool):
    files = {"helper.py": "def f(x):\n    return 2 * x\n", "pkg/__init__.py": "", "pkg/data.txt": b"\x00\x01"}
    res = pool.run("from helper import f\nprint(f(21), len(open('pkg/data.txt', 'rb').read()))", files=files)
    assert res.stdout == "42 2\n", res


def test_bash_language(pool):
    assert set(LANGUAGES) == {"python", "bash"}
    res = pool.run("read x; echo \"got $x\"; exit 4", language="bash", stdin="7\n")
    assert (res.stdout, res.exit_code) == ("got 7\n", 4)


def test_large_stdin_and_output(pool):
    data = "x" * 300_000 + "\n"  # more than a pipe buffer each way
    res = pool.run("import sys\nsys.stdout.write(sys.stdin.read())", stdin=data)
    assert res.stdout == data and not res.truncated


def test_program_that_ignores_stdin(pool):
    res = pool.run("print('done')", stdin="y\n" * 200_000)
    assert res.stdout == "done\n" and res.exit_code == 0


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"language": "cobol"}, r"unknown sandbox language 'cobol'; known: \['bash', 'python'\]"),
        ({"files": {"../x.py": ""}}, r"sandbox file name '../x.py': give a relative path"),
        ({"files": {"/etc/x": ""}}, r"sandbox file name '/etc/x'"),
        ({"files": {"main.py": ""}}, r"not 'main.py'"),
        ({"timeout_s": 0}, r"sandbox limit timeout_s=0 is out of range"),
        ({"memory_mb": 4}, r"sandbox limit memory_mb=4 is out of range"),
        ({"stdin": 3}, r"sandbox stdin must be str or bytes, got int"),
    ],
)
def test_bad_arguments_are_caller_errors(pool, kwargs, pattern):
    with pytest.raises(SandboxError, match=pattern):
        pool.submit("print(1)", **kwargs)


def test_concurrent_callers_get_their_own_results(pool):
    results, errors = {}, []

    def call(i: int) -> None:
        try:
            results[i] = pool.run(f"print({i} * {i})").stdout
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == {i: f"{i * i}\n" for i in range(24)}


def test_closed_pool_refuses_work():
    p = SandboxPool(1)
    p.close()
    with pytest.raises(SandboxError, match="closed"):
        p.submit("print(1)")


def test_seccomp_filter_compiles():
    bpf = build_filter()
    assert len(bpf) % 8 == 0 and len(bpf) // 8 > len(DENIED)  # one jump per denied call at least
