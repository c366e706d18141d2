"""Train engines give their memory back between phases and get it back bit-identical.

On CPU ``offload`` really frees the storages behind parameters, gradients and AdamW states (0 bytes
left) and ``reload`` restores them in place: the state's checksums are unchanged and the next
training step is bit for bit the one of an engine that never offloaded. The GPU figures (device
memory freed by the trainer and by a sleeping vLLM) are ``gpu``-marked.
"""

from __future__ import annotations

import pytest
import torch
from engine_testkit import random_batch, sft_loss, train_a_few_steps

from flowrl.engines.base import EngineError, OffloadingEngine
from flowrl.engines.fsdp import FsdpTrainEngine
from flowrl.engines.offload import HostStash
from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine

OPTIM = OptimConfig(lr=1e-2, max_grad_norm=1.0)


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.named_weights()}


def test_stash_round_trip_frees_and_restores_shared_storages():
    buffer = torch.arange(12.0)
    views = [buffer[:6].view(2, 3), buffer[6:]]  # one storage behind two tensors: copied once
    stash = HostStash()
    assert stash.offload(views + [buffer]) == 48 and buffer.untyped_storage().nbytes() == 0
    with pytest.raises(EngineError, match="already in host memory"):
        stash.offload(views)
    assert stash.reload() == 48
    assert views[0].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and views[1].tolist() == [6.0, 7.0, 8.0, 9.0,
                                                                                            10.0, 11.0]


def test_torch_engine_offload_round_trip_is_bit_identical(tiny_model_dir):
    engine, twin = (TorchTrainEngine(tiny_model_dir, optim=OPTIM) for _ in range(2))
    assert isinstance(engine, OffloadingEngine)
    for e in (engine, twin):
        train_a_few_steps(e)  # gradients and AdamW moments exist
    before = engine.state_checksums()
    assert any(k.startswith("grad:") for k in before) and any(k.startswith("optim:") for k in before)
    moved = engine.offload()
    # every parameter, gradient and moment: 4 bytes x (params + grads + 2 moments), plus buffers and steps
    params = sum(p.numel() for p in engine.model.parameters())
    assert moved >= 4 * 4 * params
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    assert engine.reload() == moved
    assert engine.state_checksums() == before
    batch = random_batch(seed=3)
    engine.train_step(batch, sft_loss, micro_batch_size=4)
    twin.train_step(batch, sft_loss, micro_batch_size=4)
    after, expected = _weights(engine), _weights(twin)
    assert all(torch.equal(after[k], expected[k]) for k in expected)


def test_fsdp_engine_offload_round_trip_is_bit_identical(tiny_model_dir):
    engine = FsdpTrainEngine(tiny_model_dir, optim=OPTIM, dp=2, threads=1)
    try:
        batch = random_batch(seed=1)
        engine.train_step(batch, sft_loss, micro_batch_size=2)
        before = engine.state_checksums()  # per rank: its parameter, gradient and AdamW shards
        assert len(before) == 2 and all(any(k.startswith("optim:") for k in rank) for rank in before)
        moved = engine.offload()
        assert moved > 0 and engine.reload() == moved
        assert engine.state_checksums() == before
        reference = _weights(engine)
        engine.offload()
        engine.reload()
        assert all(torch.equal(v, reference[k]) for k, v in _weights(engine).items())
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_torch_engine_offload_frees_gpu_memory(tiny_model_dir):
    engine = TorchTrainEngine(tiny_model_dir, optim=OPTIM, device="cuda")
    train_a_few_steps(engine)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = engine.offload()
    # the state left the device (the caching allocator returned its blocks: empty_cache)
    assert torch.cuda.memory_allocated() <= held - moved + (1 << 20)
    engine.reload()
    assert torch.cuda.memory_allocated() >= held - (1 << 20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_vllm_sleep_frees_gpu_memory_and_wakes_with_its_weights(tiny_model_dir):
    pytest.importorskip("vllm")
    import rollout_contract as contract

    from flowrl.engines.base import SleepingEngine
    from flowrl.engines.types import SamplingSpec
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(tiny_model_dir, dtype="float32", max_model_len=64, gpu_memory_utilization=0.3)
    try:
        assert isinstance(engine, SleepingEngine)
        spec = SamplingSpec(temperature=0.0, max_tokens=8)
        before = engine.generate(contract.prompts(), spec)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        free_asleep = torch.cuda.mem_get_info()[0]
        # the KV cache (most of the 30% reserved) and the weights left the device
        assert free_asleep - free_awake > 0.2 * torch.cuda.mem_get_info()[1]
        engine.wake_up(["weights"])
        engine.wake_up(["kv_cache"])
        assert [g[0].response_ids for g in engine.generate(contract.prompts(), spec)] == \
            [g[0].response_ids for g in before]
    finally:
        engine.shutdown()
