"""No number in a flow makes the compiler slow or large (issue 32, "bounded compiler").

Hypothesis puts random large values (counts past 2^40, 30-digit and 5000-digit literals,
1e308, tiny and negative numbers) in the numeric slots of shipped flows (``flows/``,
``stdlib/``) and in ``--set``; every compiler verb (check, plan, fmt, ir, graph) runs
in-process through the CLI on each, and must

* finish within 2 s of CPU time (a hang detector, not a timing comparison: the normal cost is
  tens of milliseconds; CPU time, so a busy machine does not trip it),
* stay within 300 MB more memory (``RLIMIT_DATA`` is lowered to what the process holds plus
  300 MB while the verb runs, so an allocation past it fails the example with MemoryError),
* and give a result or diagnostics with a code and a position, never a traceback or an
  internal error.
"""

from __future__ import annotations

import contextlib
import io
import re
import resource
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowrl.cli import main

REPO = Path(__file__).resolve().parents[2]
FLOWS = ("flows/arith_grpo.flow", "flows/grpo_auto.flow", "flows/grpo_megatron_8gpu.flow",
         "flows/grpo_partial_rollout.flow", "flows/agentic_calc.flow", "flows/family_qwen3_moe_megatron.flow",
         "stdlib/grpo.flow", "stdlib/agentic.flow", "stdlib/ppo.flow")
VERBS = (["check"], ["plan", "--explain"], ["ir"], ["graph"], ["fmt"])
CPU_S = 2.0
MEMORY = 300 << 20

NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?:[KMGT]i?B)?(?![\w.])")

HUGE = st.sampled_from([
    "100000000", "1099511627776", "1099511627777", "4611686018427387904", "9" * 30, "9" * 5000,
    "1e308", "1.7976931348623157e308", "1e-308", "0", "1", "-1", "-" + "9" * 30, "2147483648", "65536",
    "1e12", "1000000000", "4.5e15", "0.0", "123456789012345678901234567890.5", "1e18", "129", "1000", "16384",
    "131073"])


def numeric_slots(text: str) -> list[tuple[int, int]]:
    """(start, end) of each number literal outside comments and strings."""
    out, pos = [], 0
    for line in text.splitlines(keepends=True):
        code, in_str = [], False
        for i, ch in enumerate(line):
            if ch == '"':
                in_str = not in_str
            if ch == "#" and not in_str:
                break
            code.append(" " if in_str or ch == '"' else ch)
        for m in NUMBER.finditer("".join(code)):
            out.append((pos + m.start(), pos + m.end()))
        pos += len(line)
    return out


def _mutated(text: str, picks: list[tuple[int, str]]) -> str:
    slots = numeric_slots(text)
    chosen = {slots[i % len(slots)]: value for i, value in picks}
    for (a, b), value in sorted(chosen.items(), reverse=True):
        text = text[:a] + value + text[b:]
    return text


def _data_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1])
    raise AssertionError("no VmData in /proc/self/status")


@contextlib.contextmanager
def _bounded_memory(extra: int):
    """Allocations past the process's data now plus ``extra`` bytes fail (MemoryError) inside."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _data_kb() * 1024 + extra
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def run_verb(argv: list[str]) -> tuple[int, str, float]:
    """``flowrl ARGV`` in-process: (exit code, stderr, CPU seconds), within the memory bound."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.process_time()
    with _bounded_memory(MEMORY), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue(), time.process_time() - t0


def assert_bounded(argv: list[str]) -> None:
    code, err, cpu = run_verb(argv)
    assert cpu < CPU_S, f"flowrl {' '.join(argv)} took {cpu:.1f} s of CPU"
    assert "internal error" not in err and "Traceback" not in err, err[-3000:]
    if code != 0:
        assert re.search(r"^\S+:\d+:\d+: error\[E\d{3}\]", err, flags=re.M) or err.startswith("flowrl: error:"), \
            err[-3000:]
        assert "= hint:" in err or err.startswith("flowrl: error:"), err[-3000:]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The shipped flows beside copies of what they name (data, stdlib), so relative paths resolve."""
    root = tmp_path_factory.mktemp("bounded")
    (root / "flows").mkdir()
    (root / "stdlib").mkdir()
    for f in FLOWS:
        shutil.copy(REPO / f, root / f)
    (root / "data").symlink_to(REPO / "data")
    for f in FLOWS + ("flows/arith_grpo.flow",):
        assert_bounded(["check", str(root / f)])  # warm: imports and caches before anything is measured
    return root


@pytest.mark.parametrize("verb", VERBS, ids=lambda v: v[0])
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_verb_is_bounded_whatever_the_numbers(copies, verb, data):
    name = data.draw(st.sampled_from(FLOWS))
    text = (REPO / name).read_text()
    picks = data.draw(st.lists(st.tuples(st.integers(0, 10_000), HUGE), min_size=1, max_size=6))
    target = copies / name.replace(".flow", "_x.flow")
    target.write_text(_mutated(text, picks))
    assert_bounded([*verb, str(target)])


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(key=st.sampled_from(["batch", "group", "max_tokens", "steps", "lr", "micro_batch", "minibatches", "seed",
                            "eval_every", "kl", "temperature", "max_turns"]),
       value=HUGE, flow=st.sampled_from(["flows/arith_grpo.flow", "flows/agentic_calc.flow", "flows/grpo_auto.flow"]))
def test_plan_is_bounded_whatever_set_gives(copies, key, value, flow):
    assert_bounded(["plan", "--json", str(copies / flow), "--set", f"{key}={value}"])


def test_the_examples_of_the_issue_are_refused_or_planned_quickly(copies):
    text = (REPO / "flows/arith_grpo.flow").read_text()
    for batch in ("100000000", "9" * 30):
        target = copies / "flows" / "issue.flow"
        target.write_text(text.replace("batch: int = 64", f"batch: int = {batch}"))
        assert_bounded(["check", str(target)])
    target.write_text(text.replace("batch: int = 64", "batch: int = 1099511627776"))  # the largest count planned
    assert_bounded(["plan", str(target), "--gantt", str(copies / "gantt.png"), "--gantt-steps", "20"])
    code, err, _ = run_verb(["plan", str(target), "--gantt", str(copies / "gantt2.png"), "--gantt-steps", "1000000000"])
    assert code == 1 and "--gantt-steps 1000000000: draw 1 to 20 steps" in err, err
    target.write_text(text.replace("nodes = 1, gpus_per_node = 1", "nodes = 1000000000, gpus_per_node = 1000000000"))
    code, err, _ = run_verb(["check", str(target)])
    assert code == 1 and "error[E" in err and "1000000000" in err


def test_clusters_are_planned_up_to_the_largest_and_searched_up_to_the_auto_limit(copies):
    """A manual schedule plans a 131,072-GPU cluster within the bounds; past it, and an auto schedule
    past the clusters it searches, are refused at the cluster with the number."""
    from flowrl.catalog.schedule import AUTO_MAX_GPUS, MAX_GPUS

    manual = (REPO / "flows/arith_grpo.flow").read_text().replace("policy.train = torch(dp = 1)", "policy.train = torch()")
    target = copies / "flows" / "cluster.flow"
    for nodes, ok in ((MAX_GPUS // 8, True), (MAX_GPUS // 8 + 1, False)):
        target.write_text(manual.replace("nodes = 1, gpus_per_node = 1", f"nodes = {nodes}, gpus_per_node = 8"))
        for verb in (["check"], ["plan", "--explain"]):
            assert_bounded([*verb, str(target)])
            code, err, _ = run_verb([*verb, str(target)])
            assert (code == 0) == ok and (ok or f"{nodes * 8}" in err), err
    auto = (REPO / "flows/grpo_auto.flow").read_text()
    for nodes, ok in ((AUTO_MAX_GPUS // 8, True), (AUTO_MAX_GPUS // 8 + 1, False)):
        target.write_text(auto.replace("nodes = 8, gpus_per_node = 8", f"nodes = {nodes}, gpus_per_node = 8"))
        assert_bounded(["plan", str(target)])
        code, err, _ = run_verb(["check", str(target)])
        assert (code == 0) == ok and (ok or "error[E446]" in err), err


def test_a_literal_of_a_million_digits_is_refused_quickly(copies):
    """Python's int-from-text limit (4300 digits) and the scan for nesting: refused at the literal, fast."""
    digits = "9" * 1_000_000
    text = (REPO / "flows/arith_grpo.flow").read_text()
    target = copies / "flows" / "digits.flow"
    target.write_text(text.replace("batch: int = 64", f"batch: int = {digits}").replace("lr: float = 5e-4",
                                                                                        f"lr: float = 1.{digits}"))
    for verb in VERBS:
        assert_bounded([*verb, str(target)])
        code, err, _ = run_verb([*verb, str(target)])
        assert code == 1 and "error[E021]" in err and len(err) < 5000, err[:3000]
    code, err, _ = run_verb(["plan", str(REPO / "flows/arith_grpo.flow"), "--set", f"batch={digits}"])
    assert code == 1 and "error[E126]" in err and len(err) < 5000, err[:3000]
