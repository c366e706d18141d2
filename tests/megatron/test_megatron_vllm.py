"""Resync megatron(tp=2) -> vLLM: after one training step, the exported (TP-gathered, HF-named)
weights loaded into vLLM in place give the same per-token log-probabilities as the Megatron
engine, on tokens vLLM sampled (to 1e-4, fp32)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("vllm")

from mcore_cases import OPTIM, make_batch, pg_loss  # noqa: E402

from flowrl.engines.megatron import MegatronTrainEngine  # noqa: E402
from flowrl.engines.types import SamplingSpec, TokenBatch  # noqa: E402
from flowrl.engines.vllm_engine import VLLMRolloutEngine  # noqa: E402


def test_vllm_logprobs_match_megatron_after_resync(tiny_dir):
    prompts = [[1, 5 + i, 6, 7 + i % 3] for i in range(6)]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=10, seed=11)
    with MegatronTrainEngine(tiny_dir, optim=OPTIM, tp=2) as trainer:
        trainer.train_step(make_batch(), pg_loss, micro_batch_size=4)  # weights now differ from the checkpoint
        rollout = VLLMRolloutEngine(tiny_dir, dtype="float32", max_model_len=64)
        try:
            before = [c for group in rollout.generate(prompts, spec) for c in group]
            rollout.update_weights(trainer.named_weights())
            after = [c for group in rollout.generate(prompts, spec) for c in group]
        finally:
            rollout.shutdown()
        batch = TokenBatch.from_completions(after, pad_id=0)
        ours = trainer.forward(batch)["logprobs"]
        stale = trainer.forward(TokenBatch.from_completions(before, pad_id=0))["logprobs"]
    mask = batch.response_mask.bool()
    assert int(mask.sum()) > 50
    diff = (ours - batch.extras["rollout_logprobs"])[mask].abs().max()
    assert float(diff) <= 1e-4, float(diff)
    # The check has teeth: vLLM's pre-resync logprobs (the checkpoint's weights) do not match.
    old = TokenBatch.from_completions(before, pad_id=0)
    stale_diff = (stale - old.extras["rollout_logprobs"])[old.response_mask.bool()].abs().max()
    assert float(stale_diff) > 1e-3
