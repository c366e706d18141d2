"""The ``code`` verifier: run a completion's program against its dataset row's tests, in the sandbox.

A completion's program is its last fenced code block tagged ``python`` / ``py`` /
``python3`` (else its last fenced block of any tag, else the whole completion; a final
block cut off by the token limit counts up to the end). The row's ``tests`` field holds
the tests, in one of these forms:

* a list of input/output cases ``{"stdin": "1 2\\n", "stdout": "3\\n"}`` (``input`` /
  ``output`` are accepted as key names too): the program is run once per case with the
  input on stdin, and passes the case when it exits with 0 and prints the expected output
  (compared line by line with trailing whitespace and trailing blank lines ignored);
* a list of assert statements ``["assert add(1, 2) == 3", ...]``: they are appended to the
  program, followed by a line printing a fresh random token; the program is run once and
  passes when it exits with 0 and the token is its last line of output (so exiting early
  with status 0 does not pass);
* a dict ``{"inputs": [...], "outputs": [...]}`` (the APPS / TACO layout) of input/output cases;
* a dict ``{"fn_name": "f", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}`` (APPS / TACO
  call-based tests): each input is the argument list of one call of the program's function
  ``f`` (or of the method ``f`` of its class ``Solution``, LeetCode style), whose return value
  must equal the output as a value (JSON's: tuples are lists; floats to a relative 1e-6; an
  output wrapped in a one-item list, as APPS writes them, matches too). All calls run in one
  sandboxed program: a harness reads the cases from stdin before the program's own code runs,
  then calls the function and prints a fresh random token and the verdict as its last line
  (what the program itself prints does not count);
* any of these JSON-encoded in a string, or a string of assert statements.

Lists may mix cases and asserts. The reward is 1.0 when every test passes, else 0.0 (a
sample stops at its first failing case). Every run goes through :mod:`flowrl.sandbox`
(``CASE_TIMEOUT_S`` and ``CASE_MEMORY_MB`` per run); samples run concurrently on its pool.
A row without tests, or tests in none of these forms, is an error for that sample (it gets
the reward's ``on_error`` value), never a silent 0.

>>> extract_code("Here:\\n```python\\nprint(1)\\n```\\nand ```py\\nprint(2)\\n```")
'print(2)\\n'
>>> parse_tests({"inputs": ["1\\n"], "outputs": ["2\\n"]})
[IOCase(stdin='1\\n', stdout='2\\n')]
"""

from __future__ import annotations

import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

TESTS_FIELD = "tests"
"""The dataset field that holds a row's tests."""
CASE_TIMEOUT_S = 5.0
"""Wall-clock limit of one run of a completion's program (s)."""
CASE_MEMORY_MB = 256
"""Address-space limit of one run (MiB)."""

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


class TestsFormatError(ValueError):
    """A row's ``tests`` value in none of the accepted forms; the message shows it."""


@dataclass(frozen=True)
class IOCase:
    """Run the program with ``stdin``; it must print ``stdout``."""

    stdin: str
    stdout: str


@dataclass(frozen=True)
class AssertCase:
    """Statements appended to the program; it must then exit with 0."""

    code: str


@dataclass(frozen=True)
class CallCase:
    """Call the program's function ``fn_name`` with ``args``; it must return ``expected`` (as a value)."""

    fn_name: str
    args: tuple
    expected: object


def extract_code(completion: str) -> str:
    """The program in a completion (see the module docstring for the rule)."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(completion)]
    tagged = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    if tagged:
        return tagged[-1]
    return blocks[-1][1] if blocks else completion


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:119] + "…"


_FORMS = ("a list of {'stdin': ..., 'stdout': ...} cases and/or assert strings, "
          "{'inputs': [...], 'outputs': [...]}, {'fn_name': 'f', 'inputs': [[args], ...], 'outputs': [...]}, "
          "or any of these as a JSON string")


def _case(item, where: str) -> IOCase | AssertCase:
    if isinstance(item, str):
        return AssertCase(item)
    if isinstance(item, dict):
        stdin = item.get("stdin", item.get("input"))
        stdout = item.get("stdout", item.get("output"))
        if isinstance(stdin, str) and isinstance(stdout, str):
            return IOCase(stdin, stdout)
    raise TestsFormatError(f"{where}: test {_show(item)} is neither an assert string nor a case with string "
                           f"'stdin' and 'stdout'; hint: give {_FORMS}")


def parse_tests(value, where: str = "tests") -> list[IOCase | AssertCase | CallCase]:
    """The test cases a ``tests`` value holds; ``where`` names it in errors."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            decoded = None
        if isinstance(decoded, (list, dict)):
            return parse_tests(decoded, where)
        if value.strip():
            return [AssertCase(value)]
    elif isinstance(value, dict) and "inputs" in value and "outputs" in value:
        ins, outs = value["inputs"], value["outputs"]
        if "fn_name" in value:
            return _calls(value["fn_name"], ins, outs, where)
        if isinstance(ins, list) and isinstance(outs, list) and len(ins) == len(outs) and ins:
            return [_case({"stdin": i, "stdout": o}, where) for i, o in zip(ins, outs)]
    elif isinstance(value, list) and value:
        return [_case(item, where) for item in value]
    raise TestsFormatError(f"{where}: no tests in {_show(value)}; hint: give {_FORMS}")


def _calls(fn_name, ins, outs, where: str) -> list[CallCase]:
    """The call-based cases of an APPS / TACO ``{"fn_name", "inputs", "outputs"}`` dict."""
    if not (isinstance(fn_name, str) and fn_name.isidentifier()):
        raise TestsFormatError(f"{where}: 'fn_name' {_show(fn_name)} is not a Python function name; "
                               "hint: give the name of the function the program defines, e.g. \"fn_name\": \"add\"")
    if not (isinstance(ins, list) and isinstance(outs, list) and len(ins) == len(outs) and ins):
        raise TestsFormatError(f"{where}: call-based tests of {fn_name!r} need 'inputs' and 'outputs' lists of the "
                               f"same length, one argument list and one return value per call; got inputs "
                               f"{_show(ins)} and outputs {_show(outs)}")
    return [CallCase(fn_name, tuple(i) if isinstance(i, list) else (i,), o) for i, o in zip(ins, outs)]


_HARNESS = r"""
import json, math, os, sys
_cases = json.loads(sys.stdin.read())  # before the program runs: it never sees the cases
sys.stdin = open(os.devnull)
_token = _cases.pop("token")


def _norm(v):
    return json.loads(json.dumps(v))


def _same(a, b):
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)             and not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _verdict():
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    with open("solution.py") as f:
        exec(compile(f.read(), "solution.py", "exec"), ns)
    fn = ns.get(_cases["fn_name"])
    if not callable(fn) and isinstance(ns.get("Solution"), type):
        fn = getattr(ns["Solution"](), _cases["fn_name"], None)
    if not callable(fn):
        return "no function " + _cases["fn_name"]
    for i, (args, expected) in enumerate(_cases["calls"]):
        got = fn(*args)
        try:
            got = _norm(got)
        except (TypeError, ValueError):
            return f"call {i}: the return value is not a JSON value"
        if not (_same(got, expected) or _same([got], expected)):
            return f"call {i}: wrong value"
    return "pass"


try:
    _v = _verdict()
except BaseException as e:  # noqa: BLE001 - the program's own exception (or SystemExit) fails it
    _v = f"raised {type(e).__name__}"
sys.stdout.flush()
print()
print(_token, _v)
"""
"""The program that runs a completion's program (``solution.py``) against call-based cases."""


def _calls_pass(program: str, calls: list[CallCase], pool, limits: dict) -> bool:
    """Whether ``program``'s function returns each case's value (one sandboxed run for all of them)."""
    token = secrets.token_hex(16)
    stdin = json.dumps({"token": token, "fn_name": calls[0].fn_name,
                        "calls": [[list(c.args), c.expected] for c in calls]})
    res = pool.run(_HARNESS, stdin=stdin, files={"solution.py": program}, **limits)
    return res.ok and res.stdout.rstrip("\n").rsplit("\n", 1)[-1] == f"{token} pass"


def outputs_match(got: str, expected: str) -> bool:
    """Equal line by line, ignoring trailing whitespace on lines and trailing blank lines."""
    def norm(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


def passes(program: str, cases: list[IOCase | AssertCase | CallCase], pool, timeout_s: float | None = None) -> bool:
    """Whether ``program`` passes every case, run in ``pool`` (a :class:`~flowrl.sandbox.SandboxPool`),
    each run under ``timeout_s`` (default ``CASE_TIMEOUT_S``)."""
    asserts = [c.code for c in cases if isinstance(c, AssertCase)]
    limits = {"timeout_s": CASE_TIMEOUT_S if timeout_s is None else timeout_s, "memory_mb": CASE_MEMORY_MB}
    if asserts:
        # A program that exits early (sys.exit(0), os._exit(0)) must not pass: the asserts
        # count only if the line after them ran, which prints a fresh random token.
        token = secrets.token_hex(16)
        res = pool.run(f"{program}\n\n" + "\n".join(asserts) + f"\nprint({token!r})\n", **limits)
        if not (res.ok and res.stdout.rstrip("\n").rsplit("\n", 1)[-1] == token):
            return False
    by_name: dict[str, list[CallCase]] = {}
    for case in cases:
        if isinstance(case, CallCase):
            by_name.setdefault(case.fn_name, []).append(case)
    for calls in by_name.values():
        if not _calls_pass(program, calls, pool, limits):
            return False
    for case in cases:
        if isinstance(case, IOCase):
            res = pool.run(program, stdin=case.stdin, **limits)
            if not (res.ok and outputs_match(res.stdout, case.stdout)):
                return False
    return True


def code_tests(completions: list[str], answers: list[str], *, rows: list[dict] | None = None,
               timeout_s: float | None = None) -> list[float]:
    """1.0 where the completion's program passes every test of its row's ``tests`` field, else 0.0.
    ``timeout_s``: each run's deadline (a flow's ``verifier("code", timeout = S)``; default ``CASE_TIMEOUT_S``).

    Shapes: ``[N]`` completions and answers (answers are not used), ``[N]`` rows. Raises
    ValueError for missing rows or tests (the reward pool pins it to the sample).
    """
    if rows is None:
        raise ValueError("verifier 'code' scores each completion against its dataset row's "
                         f"{TESTS_FIELD!r} field, but no rows were passed; hint: call score(..., rows=[...])")
    if len(rows) != len(completions):
        raise ValueError(f"verifier 'code': {len(completions)} completions but {len(rows)} rows")
    cases = []
    for row in rows:  # no index in messages: the reward pool reports the sample's batch index
        if TESTS_FIELD not in row:
            raise ValueError(f"verifier 'code': the dataset row has no {TESTS_FIELD!r} field (it has "
                             f"{sorted(row)}); hint: add the tests to each row of the dataset")
        cases.append(parse_tests(row[TESTS_FIELD], f"verifier 'code': field {TESTS_FIELD!r}"))
    from flowrl.sandbox import default_pool  # starts the sandbox workers on first use only

    pool = default_pool()
    with ThreadPoolExecutor(max(1, 2 * len(pool.worker_pids()))) as ex:
        ok = list(ex.map(lambda c: passes(extract_code(c[0]), c[1], pool, timeout_s), zip(completions, cases)))
    return [float(x) for x in ok]
