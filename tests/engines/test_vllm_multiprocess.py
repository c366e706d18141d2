"""VLLMRolloutEngine with the engine core in its own process (vLLM's default on GPUs).

RPC arguments are serialised there, so weight updates travel as one safetensors
blob to FlowrlWorkerExtension instead of as tensors.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import rollout_contract as contract  # noqa: E402
from engine_testkit import completions_batch, make_trainer, max_logprob_gap, train_a_few_steps  # noqa: E402

from flowrl.engines.types import SamplingSpec  # noqa: E402
from flowrl.engines.vllm_engine import VLLMRolloutEngine  # noqa: E402


def test_weight_update_through_a_separate_engine_process(tiny_model_dir):
    engine = VLLMRolloutEngine(tiny_model_dir, dtype="float32", max_model_len=64, in_process=False)
    try:
        assert not engine._direct_weights
        assert type(engine.llm.llm_engine.engine_core).__name__ != "InprocClient"
        spec = SamplingSpec(temperature=0.0, max_tokens=10)
        before = engine.generate(contract.prompts(), spec)
        batch = completions_batch(before)
        assert max_logprob_gap(before, make_trainer(tiny_model_dir).forward(batch)["logprobs"], batch) < contract.TOL

        trainer = make_trainer(tiny_model_dir)
        train_a_few_steps(trainer)
        engine.update_weights(trainer.named_weights())
        after = engine.generate(contract.prompts(), spec)
        batch = completions_batch(after)
        assert max_logprob_gap(after, trainer.forward(batch)["logprobs"], batch) < contract.TOL
        assert [g[0].response_ids for g in after] != [g[0].response_ids for g in before]
    finally:
        engine.shutdown()
