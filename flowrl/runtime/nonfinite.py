"""What a non-finite loss or gradient does to a run: ``update(on_nan = "skip" | "stop")``.

Every train engine already refuses to step its optimizer on a non-finite loss or gradient
norm (the update is dropped, AdamW's moments stay clean) and says so in its per-optimizer-step
statistics (``skipped`` = 1.0). :func:`apply_nan_policy` turns those statistics into the
policy the flow chose (:data:`flowrl.catalog.ops.NAN_POLICIES`): ``skip`` counts the dropped
optimizer steps in ``faults/nan_skipped``; ``stop`` raises, naming the op, its source position
and the step. Either way no NaN reaches the weights.

>>> class Op: id, model, origin, options = "update_1", "policy", "grpo.flow:9:3", {"on_nan": "skip"}
>>> apply_nan_policy(Op, 4, [{"loss": float("nan"), "grad_norm": float("nan"), "skipped": 1.0},
...                           {"loss": 0.1, "grad_norm": 0.5, "skipped": 0.0}])
{'faults/nan_skipped': 1}
>>> Op.options = {"on_nan": "stop"}
>>> apply_nan_policy(Op, 4, [{"loss": float("inf"), "grad_norm": 2.0, "skipped": 1.0}])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
flowrl.runtime.errors.RuntimeFlowError: grpo.flow:9:3: step 5: `update_1` (model `policy`) got a non-finite loss...
"""

from __future__ import annotations

from flowrl.catalog.ops import NAN_POLICIES
from flowrl.runtime.errors import RuntimeFlowError


def apply_nan_policy(op, step: int, stats: list[dict]) -> dict[str, int]:
    """``{"faults/nan_skipped": n}`` for the ``n`` optimizer steps of ``stats`` a non-finite loss or
    gradient skipped (``op.options["on_nan"] == "skip"``); RuntimeFlowError naming ``op`` and step
    ``step + 1`` when the policy is ``stop`` and one was skipped. ``step`` is 0-based."""
    policy = op.options.get("on_nan", "skip")
    if policy not in NAN_POLICIES:  # the compiler checks the choice; a plan written by hand may not
        raise RuntimeFlowError(f"{op.origin}: on_nan = {policy!r}; choose one of {', '.join(NAN_POLICIES)}")
    bad = [s for s in stats if float(s.get("skipped", 0.0))]
    if bad and policy == "stop":
        first = bad[0]
        raise RuntimeFlowError(
            f"{op.origin}: step {step + 1}: `{op.id}` (model `{op.model}`) got a non-finite loss or gradient "
            f"(loss={_number(first, 'loss')}, grad_norm={_number(first, 'grad_norm')}) "
            f"in {len(bad)} of {len(stats)} optimizer step(s), which were not applied: no NaN reached the weights; "
            f"hint: lower lr, keep grad_clip on, check the rewards and advantages for inf/NaN, "
            f"or set `on_nan = \"skip\"` to skip such steps and count them")
    return {"faults/nan_skipped": len(bad)}


def _number(stats: dict, key: str) -> str:
    return f"{float(stats.get(key, float('nan'))):g}"


__all__ = ["apply_nan_policy"]
