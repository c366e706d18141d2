"""Checks of the ops that need a procedural library (:attr:`~flowrl.catalog.ops.OpSpec.library`), without
generating a split: ``check_datasets`` runs them on a library's datasets before it reads their first rows,
``check_resources`` on the other ops (a reward that scores with the library).

``reasoning_gym``: the package installed (E672); a dataset's task registered (E670, the nearest names as
the hint, at the task's name); its config (the options beyond the record's own) accepted by the task's
config class: known names, values of the default's type, its ``validate()`` and its generator (E671, at
the option) (:func:`flowrl.data.reasoning_gym.spec_problems`).
"""

from __future__ import annotations

from typing import Callable

from flowrl.catalog.ops import OpKind, OpSpec
from flowrl.diagnostics import Collector
from flowrl.ir.graph import Const, Node, plain


def _check_reasoning_gym(node: Node, spec: OpSpec, errors: Collector) -> None:
    """E672: the reasoning_gym package is missing; a dataset's task unknown (E670, the nearest names as a
    hint) or its config refused (E671: an option its config class lacks, a value of another type, one its
    ``validate()`` or its generator refuses), from :func:`flowrl.data.reasoning_gym.spec_problems`."""
    from flowrl.data.reasoning_gym import spec_problems

    task = node.args[0] if node.args and node.kind == OpKind.DATASET else None
    if task is not None and not (isinstance(task, Const) and isinstance(task.value, str)):
        return  # a parameter without a value (a library flow checked alone): E203 says what is wrong otherwise
    config = {k: plain(v) for k, v in node.attrs if k not in spec.kwargs}
    if any(v is None for v in config.values()):
        return  # a config value from a parameter without a value
    spans = dict(node.key_spans)
    problems = spec_problems(task.value, config) if task is not None else [
        p for p in spec_problems("", {}) if p.kind == "missing"]
    for p in problems:
        if p.kind == "missing":
            errors.error("E672", f"`{node.op}` needs the reasoning_gym package: {p.message}", node.span, p.hint)
        elif p.option == "task":
            errors.error("E670" if p.kind == "task" else "E671", p.message, task.span, p.hint)
        else:
            value = node.attr(p.option)
            errors.error("E671", p.message, spans.get(p.option) or getattr(value, "span", None) or node.span, p.hint)


LIBRARY_CHECKS: dict[str, Callable[[Node, OpSpec, Collector], None]] = {"reasoning_gym": _check_reasoning_gym}
"""``OpSpec.library`` -> the check of an op needing that library (tests pair it with the catalogue)."""


def check_library(node: Node, spec: OpSpec, errors: Collector) -> bool:
    """Check ``node`` (an op whose record names a ``library``) through its library's entry; whether it passed."""
    before = len(errors.items)
    LIBRARY_CHECKS[spec.library](node, spec, errors)
    return len(errors.items) == before


__all__ = ["LIBRARY_CHECKS", "check_library"]
