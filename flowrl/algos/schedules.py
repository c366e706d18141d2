"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

A schedule is a multiplier of the peak learning rate (``update(lr = ...)``) at each
optimizer step, which every train engine applies through one function
(:func:`lr_factor`), so torch, FSDP and Megatron ranks follow the same curve. Steps are
optimizer steps (a ``minibatches = 2`` update makes two per RL step), counted from 0.

>>> [round(lr_factor(s, schedule="cosine", warmup=2, total=6), 3) for s in range(7)]
[0.5, 1.0, 1.0, 0.854, 0.5, 0.146, 0.0]
"""

from __future__ import annotations

import math
from typing import Callable

from flowrl.algos.advantages import AlgoError


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return 1.0 - progress


def _cosine(progress: float) -> float:
    # Loshchilov & Hutter 2017 (SGDR), one half cosine period without restarts.
    return 0.5 * (1.0 + math.cos(math.pi * progress))


LR_SCHEDULES: dict[str, Callable[[float], float]] = {"constant": _constant, "linear": _linear, "cosine": _cosine}
"""Schedule name -> decay shape ``f(progress in [0, 1]) -> [0, 1]``; the names of the catalogue's
:data:`flowrl.catalog.ops.LR_SCHEDULES` (``update(lr_schedule = ...)``), paired by a test."""


def lr_factor(step: int, *, schedule: str = "constant", warmup: int = 0, total: int = 0,
              min_ratio: float = 0.0) -> float:
    """The multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Warm-up: ``(step + 1) / warmup`` for the first ``warmup`` steps (the first step already
    moves, unlike transformers' ``step / warmup``). Afterwards, with
    ``progress = (step - warmup) / (total - warmup)`` capped at 1,
    ``min_ratio + (1 - min_ratio) * f(progress)`` where ``f`` is 1 (constant), ``1 - progress``
    (linear) or ``(1 + cos(pi * progress)) / 2`` (cosine): transformers'
    ``get_{linear,cosine}_schedule_with_warmup`` (``min_ratio = 0``) and
    ``get_cosine_with_min_lr_schedule_with_warmup`` (``min_lr_rate``) after the warm-up.

    Args:
        step: optimizer steps taken so far.
        schedule: one of :data:`LR_SCHEDULES`.
        warmup: warm-up steps (0: none).
        total: steps the schedule spans, warm-up included; the decay ends there and the
            rate stays at ``min_ratio`` after it (from the end of the warm-up when
            ``total <= warmup``).
        min_ratio: the final rate as a fraction of the peak, in ``[0, 1]``.
    """
    shape = LR_SCHEDULES.get(schedule)
    if shape is None:
        raise AlgoError(f"lr_factor: unknown schedule {schedule!r}; hint: use one of {list(LR_SCHEDULES)}")
    if warmup < 0 or not 0.0 <= min_ratio <= 1.0:
        raise AlgoError(f"lr_factor: warmup={warmup}, min_ratio={min_ratio}; hint: warmup >= 0, 0 <= min_ratio <= 1")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    # A schedule no longer than its warm-up has decayed completely when the warm-up ends.
    progress = min(1.0, (step - warmup) / (total - warmup)) if total > warmup else 1.0
    return min_ratio + (1.0 - min_ratio) * shape(progress)


__all__ = ["LR_SCHEDULES", "lr_factor"]
