"""A hint that suggests a value suggests one that works: substituted, the program compiles.

Each program below has one mistake. Its diagnostics' hints name values as
``key = value`` in backticks; the test writes each suggested value where the hint means
it (the option at the diagnostic's span, else the same option in the call a note points
at, else a new option of the call at the span) and compiles the result: it must compile
without errors. This is what a user who follows the hint does.
"""

from __future__ import annotations

import re

import pytest

from flowrl.compiler.pipeline import compile_text
from flowrl.diagnostics import FlowError, Span

PRELUDE = ('model policy = tiny(task = "arith")\n'
           'dataset arith = jsonl("data/arith/train.jsonl")\n'
           'reward exact = verifier("math")\n')


def _train(generate_opts: str, adv: str) -> str:
    return (PRELUDE + "flow main() {\n"
            f"  r = generate(policy, sample(arith, size = 8){generate_opts})\n"
            f"  update(policy, r, {adv}, loss = pg())\n"
            "}\n")


def _schedule(cluster: str, body: str = "") -> str:
    return (_train(", n = 4", "group_advantage(exact(r), group = 4)")
            + f"schedule main on cluster({cluster}) {{\n{body}}}\n")


CASES = {
    # E208: out of range -> the default, or the bound
    "E208 temperature": _train(", n = 4, temperature = -0.5", "group_advantage(exact(r), group = 4)"),
    "E208 top_p": _train(", n = 4, top_p = 1.5", "group_advantage(exact(r), group = 4)"),
    "E208 size": PRELUDE + "flow main() {\n  b = sample(arith, size = 0)\n  return b\n}\n",
    "E208 rloo group": _train(", n = 2", "rloo(exact(r), group = 1)"),
    # E209: not one of the choices -> the same name in its case, a close one, or the default
    "E209 gpu case": _schedule('gpus_per_node = 8, gpu = "h100"'),
    "E209 gpu unknown": _schedule('gpu = "RTX 5090"'),
    "E209 kl_kind": _train(", n = 4", "group_advantage(exact(r), group = 4)").replace(
        "loss = pg()", 'loss = pg(), kl_kind = "k4"'),
    # E207: a bare word where a string belongs
    "E207 gpu name": _schedule("gpu = H100"),
    # E213: group != n -> n, or (n = 1) a new n for the generate
    "E213 group": _train(", n = 4", "group_advantage(exact(r), group = 8)"),
    "E213 n of one": _train(", n = 1", "rloo(exact(r), group = 4)"),
    "E213 n default": _train("", "group_advantage(exact(r), group = 4)"),
    # E218: groups of one -> the generate's n, or n and group both
    "E218 n known": _train(", n = 4", "group_advantage(exact(r), group = 1)"),
    "E218 n of one": _train(", n = 1", "group_advantage(exact(r), group = 1)"),
    # E210: a required option -> an example of its type in range
    "E210 group": _train(", n = 8", "group_advantage(exact(r))"),
    # E023: arithmetic -> its value
    "E023 lr": _train(", n = 4", "group_advantage(exact(r), group = 4)").replace(
        "loss = pg()", "loss = pg(), lr = 1e-4 * 2"),
    "E023 size": _schedule("gpus_per_node = 2", "  resync policy via nccl(bucket = 256MB * 2)\n"),
}

_SUGGESTION = re.compile(r"`(\w+) = ([^`]+)`")


def _offset(text: str, line: int, column: int) -> int:
    lines = text.split("\n")
    return sum(len(x) + 1 for x in lines[: line - 1]) + column - 1


def _slice(text: str, span: Span) -> tuple[int, int]:
    return _offset(text, span.line, span.column), _offset(text, span.end_line, span.end_column)


def _apply(text: str, diag, key: str, value: str) -> str:
    """Write ``key = value`` where the hint means it (see the module docstring)."""
    start, end = _slice(text, diag.span)
    before = text[:start]
    if re.search(rf"\b{key}\s*=\s*$", before):  # the span is the option's value
        return before + value + text[end:]
    for region in [diag.span] + [s for _, s in diag.notes]:
        a, b = _slice(text, region)
        call = text[a:b]
        m = re.search(rf"\b{key}\s*=\s*([^,)]+)", call)
        if m:
            return text[: a + m.start(1)] + value + text[a + m.end(1):]
        if call.endswith(")") and "(" in call:
            if region is not diag.span:  # the note's call (the generate) lacks the option: add it
                return text[: b - 1] + f", {key} = {value}" + text[b - 1:]
    a, b = _slice(text, diag.span)
    return text[: b - 1] + f", {key} = {value}" + text[b - 1:]


def _diagnostics(text: str):
    try:
        compile_text(text, "hint.flow")
    except FlowError as e:
        return e.errors
    return []


@pytest.mark.parametrize("name", sorted(CASES))
def test_following_the_hint_compiles(name):
    text = CASES[name]
    code = name.split()[0]
    errors = _diagnostics(text)
    assert [d.code for d in errors] == [code], [str(d.message) for d in errors]
    diag = errors[0]
    suggestions = _SUGGESTION.findall(diag.hint or "")
    assert suggestions, f"the {code} hint suggests no value: {diag.hint!r}"
    # several suggestions (`n = 8` in generate and `group = 8` here): the later in the text first
    for key, value in suggestions:
        text = _apply(text, diag, key, value)
    assert _diagnostics(text) == [], f"after following {diag.hint!r}:\n{text}"


def test_hints_of_group_errors_never_suggest_a_group_of_one():
    for name, text in CASES.items():
        for d in _diagnostics(text):
            if d.code in ("E213", "E218"):
                assert not re.search(r"`group = 1`", d.hint or ""), (name, d.hint)
