"""The megatron engine's memory turn: every rank's parameters, gradient buffers (``main_grad``) and
distributed-optimizer shards go to host memory and come back bit-identical, and training continues
exactly as without the round trip (tp = 2, dp = 2 on gloo: 4 rank processes)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from mcore_cases import OPTIM, make_batch, pg_loss  # noqa: E402

from flowrl.engines.megatron.engine import MegatronTrainEngine  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.mark.long  # make test-long, 54 s; in make test: the FSDP engine's offload round trip (tests/engines/test_offload.py)
def test_offload_round_trip_is_bit_identical_and_training_continues_exactly(tiny_dir):
    batch, later = make_batch(seed=1), make_batch(seed=2)
    engine = MegatronTrainEngine(tiny_dir, optim=OPTIM, tp=2, dp=2, threads=1)
    try:
        engine.train_step(batch, pg_loss, micro_batch_size=2)
        dict(engine.named_weights())  # a resync first, as in a colocated step (it once left the ranks' params shared)
        before = engine.state_checksums()
        assert len(before) == 4 and all(any(k.split("/", 1)[1].startswith("grad:") for k in rank) for rank in before)
        moved = engine.offload()
        assert moved > 0 and engine.reload() == moved
        assert engine.state_checksums() == before
        engine.train_step(later, pg_loss, micro_batch_size=2)
        offloaded = dict(engine.named_weights())
    finally:
        engine.shutdown()
    twin = MegatronTrainEngine(tiny_dir, optim=OPTIM, tp=2, dp=2, threads=1)
    try:
        twin.train_step(batch, pg_loss, micro_batch_size=2)
        twin.train_step(later, pg_loss, micro_batch_size=2)
        for name, tensor in twin.named_weights():
            assert torch.equal(offloaded[name], tensor), name
    finally:
        twin.shutdown()
