"""What a train engine achieves on this machine: the cost model's ``mfu_forward``, ``mfu_train`` and
``micro_overhead_s`` of the ``cpu`` profile, timed on the real torch engine.

A matmul shows the machine's peak; a tiny model's passes reach a fraction of it that depends on
the machine (its caches, its vector units, Python's speed), so these three figures are measured
rather than kept from another machine. :func:`engine_rates` builds the default tiny model (the
``arith`` task's shape, random weights) in a temporary folder, loads it in a
:class:`~flowrl.engines.torch_train.TorchTrainEngine` at the threads an engine gets when a trainer
and a rollout engine share this machine (half its cores: :data:`ENGINES_PER_NODE`, as
``flowrl.runtime.workers`` divides them), and times, for :data:`ROWS` rows of :data:`WIDTH` tokens:

* a log-prob pass (``forward``): the seconds per token give ``mfu_forward``
  (``2 P`` FLOPs a token over the matmul peak);
* an update of one micro-batch (``train_step`` with an update's default loss, the PPO clipped
  surrogate, entropy computed, as the default flow's): per token, ``mfu_train`` (``6 P`` FLOPs a token); at zero tokens, the fixed
  cost of a micro-batch (``micro_overhead_s``; it includes the optimiser step).

Each the median of ``repeat`` runs after a warm-up; ~1 s of timing on 2 cores, and ~3 s of imports.
It imports torch and transformers: only the profile's child process calls it
(:mod:`flowrl.cost.autoprofile`), and ``flowrl profile``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from flowrl.catalog.models import tiny_facts, tiny_shape
from flowrl.catalog.ops import OPS, OpKind

ROWS = (16, 128)
"""Rows of the two batches timed: a small one, and the default flow's micro-batch (128 rows; the
seconds per token grow with the batch once its activations leave the core's cache, so the
figures are those of the batch size flows run)."""
WIDTH = 12
"""Tokens per row: an arith prompt and its answer (7 + 5)."""
RESPONSE = 4
"""Of which the response (the loss's tokens)."""
ENGINES_PER_NODE = 2
"""Engines taken to share this machine's cores (a colocated trainer and rollout engine)."""
TASK = "arith"


def engine_threads(cores: int | None = None) -> int:
    """The torch threads one engine gets: the cores divided among :data:`ENGINES_PER_NODE` engines."""
    return max(1, (cores or os.cpu_count() or 1) // ENGINES_PER_NODE)


def engine_rates(peak_tflops: float, *, threads: int | None = None, repeat: int = 7) -> dict[str, float]:
    """``{"mfu_forward", "mfu_train", "micro_overhead_s"}`` of this machine, against ``peak_tflops``
    (its measured matmul), timed at ``threads`` torch threads (:func:`engine_threads` by default)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or engine_threads())
    try:
        forward, train = _time_passes(repeat)
    finally:
        torch.set_num_threads(before)
    return rates(forward, train, tiny_facts({"task": TASK}).active_params, peak_tflops)


def _time_passes(repeat: int) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of a log-prob pass and of a one-micro-batch update at each of :data:`ROWS`."""
    from transformers.utils import logging as hf_logging

    from flowrl.engines.torch_train import TorchTrainEngine
    from flowrl.models.tiny import build_tiny_model
    from flowrl.runtime.losses import make_loss_fn
    from flowrl.tasks import get_task

    shape = tiny_shape({"task": TASK})
    update = next(spec for spec in OPS.values() if spec.kind == OpKind.UPDATE)
    loss = make_loss_fn({"name": update.kwargs["loss"].default})  # an update's default loss
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # saving and loading the model would draw two
    try:
        with tempfile.TemporaryDirectory(prefix="flowrl-trainbench-") as folder:
            build_tiny_model(folder, chars=get_task(TASK).chars, **shape)
            engine = TorchTrainEngine(folder, device="cpu")  # the `cpu` profile: the CPU, GPU or not
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    forward, train = {}, {}
    for rows in ROWS:
        batch = _batch(rows, len(get_task(TASK).chars) + 4)
        forward[rows] = _median(lambda: engine.forward(batch), repeat)
        train[rows] = _median(lambda: engine.train_step(batch, loss, micro_batch_size=rows), repeat)
    return forward, train


def rates(forward: dict[int, float], train: dict[int, float], params: int, peak_tflops: float) -> dict[str, float]:
    """The profile's figures from the seconds of a forward and of an update (one micro-batch) at two row
    counts of :data:`WIDTH` tokens, for a model of ``params`` parameters, against ``peak_tflops``.

    >>> rates({16: 0.004, 128: 0.025}, {16: 0.012, 128: 0.060}, 300_000, 0.2)
    {'mfu_forward': 0.192, 'mfu_train': 0.252, 'micro_overhead_s': 0.005143}
    """
    per_forward, _ = _line(forward)
    per_train, fixed = _line(train)
    peak = peak_tflops * 1e12
    return {"mfu_forward": round(min(2 * params / per_forward / peak, 1.0), 4),
            "mfu_train": round(min(6 * params / per_train / peak, 1.0), 4),
            "micro_overhead_s": round(max(fixed, 0.0), 6)}


def _line(seconds: dict[int, float]) -> tuple[float, float]:
    """The line through the two sizes' seconds against tokens (rows x :data:`WIDTH`): (seconds per
    token, seconds at zero tokens)."""
    (small, t_small), (large, t_large) = sorted(seconds.items())
    slope = max((t_large - t_small) / ((large - small) * WIDTH), 1e-12)
    return slope, t_small - slope * small * WIDTH


def _batch(rows: int, vocab: int):
    """``rows`` rows of random tokens, the last :data:`RESPONSE` of each the response, with the
    extras the PPO loss reads (advantages, the old log-probs)."""
    import torch

    from flowrl.engines.types import TokenBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (rows, WIDTH), generator=g)
    ids[:, 0] = 1  # <bos>
    response = torch.zeros(rows, WIDTH, dtype=torch.long)
    response[:, WIDTH - RESPONSE:] = 1
    extras = {"advantages": torch.randn(rows, WIDTH, generator=g) * response,
              "old_logprobs": torch.full((rows, WIDTH), -2.0) * response}
    return TokenBatch(ids, torch.ones(rows, WIDTH, dtype=torch.long), response, extras)


def _median(fn, repeat: int) -> float:
    """The median of ``repeat`` runs after a warm-up (a run's passes meet a busy machine too: not the best)."""
    fn()  # warm up (allocator, thread pool)
    times = []
    for _ in range(max(repeat, 1)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


__all__ = ["engine_rates", "engine_threads", "rates", "ROWS", "WIDTH", "ENGINES_PER_NODE"]
