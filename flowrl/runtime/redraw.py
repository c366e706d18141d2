"""What an op that draws again needs (DAPO's dynamic sampling): the ops it replays, and rows of
step values taken from several draws and put together as one batch.

An op whose catalogue record has a ``redraw`` (:attr:`flowrl.catalog.ops.OpSpec.redraw`:
``filter_groups``) keeps some groups of the step's completions and, while it has too few,
re-runs the ops it depends on (``sample``, ``generate``, ``score``) with fresh prompts
(:func:`replay_ops`). The rows it keeps from each draw are then one value
(:func:`gather_rows`): per-row fields (lists of ``B`` items, tensors ``[B, ...]``) are taken
and concatenated, ``[B, T]`` tensors right-padded to the widest draw (the rows are
right-padded already, so padding more columns changes no row), and so is the
:class:`~flowrl.runtime.step.Rollouts` record's token batch.

>>> import torch
>>> a = StepValue({"rewards": torch.tensor([1., 0., 0., 0.]), "answers": ["a", "a", "b", "b"],
...                "response_mask": torch.ones(4, 2)})
>>> b = StepValue({"rewards": torch.tensor([1., 1., 0., 1.]), "answers": ["c", "c", "d", "d"],
...                "response_mask": torch.ones(4, 3)})
>>> v = gather_rows([(a, torch.tensor([0, 1])), (b, torch.tensor([2, 3]))], pad_id=0)
>>> v["rewards"].tolist(), v["answers"], v["response_mask"].tolist()
([1.0, 0.0, 0.0, 1.0], ['a', 'a', 'd', 'd'], [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.catalog.ops import ROUTES
from flowrl.engines.types import TokenBatch
from flowrl.plan import ExecutionPlan, OpPlan
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.step import Rollouts, StepValue


def replay_ops(plan: ExecutionPlan, op: OpPlan) -> list[OpPlan]:
    """The step ops ``op`` depends on (directly or not), in plan order: what a new draw re-runs."""
    by_id = {p.id: p for p in plan.ops}
    need: set[str] = set()
    todo = [src for src in op.inputs.values() if src in by_id]
    while todo:
        cur = todo.pop()
        if cur not in need:
            need.add(cur)
            todo.extend(src for src in by_id[cur].inputs.values() if src in by_id)
    return [p for p in plan.ops if p.id in need]


def _rows_of(value: StepValue) -> int:
    """The row count of ``value``: its rollouts' batch size, else its first per-row field's length."""
    if value.rollouts is not None:
        return value.rollouts.batch.size
    for v in value.fields.values():
        if isinstance(v, (list, torch.Tensor)) and len(v):
            return len(v)
    return 0


def _take(x: Any, rows: torch.Tensor, count: int) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == count:
        return x[rows]
    if isinstance(x, (list, tuple)) and len(x) == count:
        return [x[i] for i in rows.tolist()]
    raise RuntimeFlowError(f"a redrawn value's field is not one item per row ({type(x).__name__} of "
                           f"{len(x) if hasattr(x, '__len__') else '?'} for {count} rows): it cannot be filtered")


def _cat(parts: list, fill: float) -> Any:
    """Concatenate per-row parts: lists joined, tensors catenated (``[B, T, ...]`` right-padded along T
    with ``fill``)."""
    if not isinstance(parts[0], torch.Tensor):
        return [x for p in parts for x in p]
    if parts[0].dim() >= 2:
        width = max(p.shape[1] for p in parts)
        # F.pad's pairs run from the last dimension back: pad only T (dimension 1)
        parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]), value=fill)
                 if p.shape[1] < width else p for p in parts]
    return torch.cat(parts)


def _batch(parts: list[tuple[TokenBatch, torch.Tensor]], pad_id: int) -> TokenBatch:
    batches = [b.select(rows) for b, rows in parts]
    return TokenBatch(_cat([b.input_ids for b in batches], pad_id),
                      _cat([b.attention_mask for b in batches], 0),
                      _cat([b.response_mask for b in batches], 0.0),
                      {k: _cat([b.extras[k] for b in batches], -1 if k == ROUTES else 0.0)  # -1: no route
                       for k in batches[0].extras})


def gather_rows(parts: list[tuple[StepValue, torch.Tensor]], pad_id: int) -> StepValue:
    """One value of the rows ``rows`` (``[k]`` int64) of each ``(value, rows)``, in order.

    Every field must be per row; ``[B, T]`` tensors (and the rollouts' token batch) are right-padded
    to the widest part, token ids with ``pad_id``, everything else with 0.
    """
    counts = [_rows_of(v) for v, _ in parts]
    fields = {key: _cat([_take(v[key], rows, n) for (v, rows), n in zip(parts, counts)], -1 if key == ROUTES else 0.0)
              for key in parts[0][0].fields}
    first = parts[0][0].rollouts
    if first is None:
        return StepValue(fields)
    batch = _batch([(v.rollouts.batch, rows) for v, rows in parts], pad_id)
    texts = tuple(t for v, rows in parts for t in _take(list(v.rollouts.texts), rows, v.rollouts.batch.size))
    # the fields that alias the batch's tensors keep aliasing them
    if "response_mask" in fields:
        fields["response_mask"] = batch.response_mask
    for key in batch.extras:
        if key in fields:
            fields[key] = batch.extras[key]
    return StepValue(fields, Rollouts(first.model, batch, texts))


__all__ = ["replay_ops", "gather_rows"]
