"""TorchRolloutEngine (transformers generate) against the rollout contract."""

from __future__ import annotations

import pytest
import rollout_contract as contract
import torch

from flowrl.engines.base import EngineConfigError
from flowrl.engines.torch_rollout import TorchRolloutEngine
from flowrl.engines.types import SamplingSpec


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = TorchRolloutEngine(tiny_model_dir, seed=0)
    yield eng
    eng.shutdown()


def test_grouped_completions(engine):
    contract.check_grouped_completions(engine)


def test_logprobs_match_trainer(engine, tiny_model_dir):
    contract.check_logprobs_match_trainer(engine, tiny_model_dir)


def test_top_k(engine, tiny_model_dir):
    contract.check_top_k(engine, tiny_model_dir)


def test_top_p(engine, tiny_model_dir):
    contract.check_top_p(engine, tiny_model_dir)


def test_seeding(engine):
    contract.check_seeding(engine)


def test_stop_strings(engine):
    contract.check_stop_strings(engine)


def test_update_weights(engine, tiny_model_dir):
    contract.check_update_weights(engine, tiny_model_dir)


def test_bad_requests(engine):
    contract.check_bad_requests(engine)


def test_unseeded_calls_are_reproducible_per_engine_seed(tiny_model_dir):
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=8)
    a = TorchRolloutEngine(tiny_model_dir, seed=5).generate(contract.prompts(), spec)
    b = TorchRolloutEngine(tiny_model_dir, seed=5).generate(contract.prompts(), spec)
    c = TorchRolloutEngine(tiny_model_dir, seed=6).generate(contract.prompts(), spec)
    ids = lambda groups: [[x.response_ids for x in g] for g in groups]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_small_generation_batches_match_one_batch(tiny_model_dir):
    """Splitting rows into generate calls changes batching, not greedy results."""
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=8)
    whole = TorchRolloutEngine(tiny_model_dir).generate(contract.prompts(), spec)
    split = TorchRolloutEngine(tiny_model_dir, max_batch_rows=1).generate(contract.prompts(), spec)
    assert [[c.response_ids for c in g] for g in whole] == [[c.response_ids for c in g] for g in split]


def test_update_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(EngineConfigError, match="unknown weight 'model.nope'"):
        engine.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(EngineConfigError, match="shape"):
        engine.update_weights([("lm_head.weight", torch.zeros(2, 2))])
