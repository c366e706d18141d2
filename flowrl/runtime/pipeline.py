"""Steps as a modulo schedule: staleness is how many steps of rollouts are in flight.

The compiler's dependency distance ``s`` on the weight edge (``staleness s``) says that
generation at step k may use weights from update k-s. The step's ops split in two
stages:

* the **producer** stage — ``sample``, ``generate``, ``score`` and whatever depends only
  on them — reads the rollout engine's weights;
* the **consumer** stage — log-probs, advantages that need them, ``update``, ``resync`` —
  reads and writes the trainer's.

With depth ``s`` the driver keeps ``s`` producer stages queued on one background thread
(in step order, so sampling stays deterministic) while the main thread runs consumers:
``s = 1`` is the synchronous loop; ``s = 2`` overlaps generation of step k+1 with the
update of step k (one-step-off). Every sample carries the rollout version that produced
it; the consumer drops (masks out) samples more than ``s - 1`` versions behind and records
the staleness histogram. A ``resync`` waits for the queued producer stages, so producer
j always reads the weights of update ``j - s`` exactly (versions do not depend on
timing). Completed producer stages are part of a checkpoint, so a resumed
run continues with the same samples.

With ``partial_rollout(recycle = true)`` the depth is ``s - 1``
(:func:`flowrl.runtime.partial.producer_depth`): groups the generate handler carries into
the next step are one step older than fresh ones, so recycling spends one version of the
budget and the bound ``s - 1`` still holds. The carried groups live in the runtime's
:class:`~flowrl.runtime.partial.PartialRollout` buffers, which checkpoints save beside the
in-flight contexts.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from flowrl.catalog.ops import PRODUCER_KINDS, OpKind
from flowrl.plan import ExecutionPlan, OpPlan
from flowrl.runtime.episodes import run_region, units
from flowrl.runtime.errors import EngineFault
from flowrl.runtime.handlers import handler_of
from flowrl.runtime.step import StepContext, check_fields


def split_stages(plan: ExecutionPlan) -> tuple[list[OpPlan], list[OpPlan]]:
    """(producer ops, consumer ops), each in plan order."""
    producer: set[str] = set()
    for op in plan.ops:
        if op.kind in PRODUCER_KINDS and all(src in producer or _is_resource(plan, src) for src in op.inputs.values()):
            producer.add(op.id)
    for op in plan.ops:  # a `repeat` loop runs as one unit: wholly in the consumer stage unless wholly a producer
        if op.region is not None and any(o.region == op.region and o.id not in producer for o in plan.ops):
            producer.discard(op.id)
    return [op for op in plan.ops if op.id in producer], [op for op in plan.ops if op.id not in producer]


def _is_resource(plan: ExecutionPlan, node_id: str) -> bool:
    return not any(op.id == node_id for op in plan.ops)


def run_ops(ops: list[OpPlan], ctx: StepContext) -> None:
    """Run each op's handler (its catalogue record's) in order, the ops of a ``repeat`` region as its
    loop (:func:`~flowrl.runtime.episodes.run_region`); every value a handler returns is checked
    against the declared fields (:func:`~flowrl.runtime.step.check_fields`)."""
    for unit in units(ops):
        if unit[0].region is None:
            _run_op(unit[0], ctx)
        else:
            run_region(unit, ctx, lambda op: _run_op(op, ctx))


def _run_op(op: OpPlan, ctx: StepContext) -> None:
    handler = handler_of(op)
    t = time.time()
    with ctx.services.timeline.span(op.id, op.engine or "driver", ctx.step):
        try:
            value = handler(op, ctx)
        except EngineFault as fault:  # the engines know the call, not the op that made it
            raise fault.during(op) from None
    check_fields(op, value)
    ctx.values[op.id] = value
    key = f"time/{op.id}"
    ctx.metrics[key] = ctx.metrics.get(key, 0.0) + time.time() - t  # summed over a loop's turns


class StepPipeline:
    """Runs steps with ``depth`` producer stages in flight (``depth`` = the plan's staleness)."""

    def __init__(self, plan: ExecutionPlan, make_ctx: Callable[[int], StepContext], depth: int):
        self.plan = plan
        self.make_ctx = make_ctx
        self.depth = max(1, depth)
        self.producer, self.consumer = split_stages(plan)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-producer")
        self.inflight: deque[tuple[int, Future]] = deque()
        self.next_step = 0

    def start(self, step: int, restored: list | None = None) -> None:
        """Begin at ``step``; ``restored`` holds producer contexts saved by a checkpoint."""
        self.next_step = step
        for ctx in restored or ():
            fut: Future = Future()
            fut.set_result(ctx)
            self.inflight.append((ctx.step, fut))
            self.next_step = ctx.step + 1

    def _produce(self, step: int):
        ctx = self.make_ctx(step)
        t0 = time.time()
        run_ops(self.producer, ctx)
        ctx.metrics["pipeline/producer_s"] = time.time() - t0
        return ctx

    def _fill(self, last_step: int) -> None:
        while len(self.inflight) < self.depth and self.next_step < last_step:
            step = self.next_step
            self.inflight.append((step, self.pool.submit(self._produce, step)))
            self.next_step += 1

    def step(self, step: int, last_step: int):
        """Run step ``step``'s consumer stage on its (possibly earlier) produced samples.

        Steps step..step+depth-1 are queued before this step trains, so while it trains,
        generation runs ahead by at most depth-1 steps: every sample is at most depth-1
        versions behind the weights it is trained on.
        """
        self._fill(last_step)
        queued, fut = self.inflight.popleft()
        assert queued == step, f"pipeline out of order: {queued} != {step}"  # a driver bug, not user input
        t0 = time.time()
        ctx = fut.result()
        ctx.metrics["pipeline/wait_rollout_s"] = time.time() - t0
        t1 = time.time()
        for unit in units(self.consumer):
            if unit[0].kind == OpKind.RESYNC:
                self._drain(ctx)
            run_ops(unit, ctx)
        ctx.metrics["pipeline/consumer_s"] = time.time() - t1
        return ctx

    def _drain(self, ctx) -> None:
        """Wait for every queued producer stage before new weights go out.

        Producer j is queued before consumer j - depth + 1 runs, so it must read the weights
        of that step, not newer ones: without this wait a slow producer could see weights
        pushed meanwhile, and which version a sample has would depend on timing (a resumed
        run would then differ). Training still overlaps generation; only the push waits.
        """
        t0 = time.time()
        for _, fut in self.inflight:
            fut.result()
        ctx.metrics["pipeline/drain_s"] = ctx.metrics.get("pipeline/drain_s", 0.0) + time.time() - t0

    def completed_inflight(self) -> list:
        """Producer contexts already queued beyond the current step (waited for), for a checkpoint."""
        return [fut.result() for _, fut in self.inflight]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
