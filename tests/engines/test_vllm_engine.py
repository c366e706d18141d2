"""VLLMRolloutEngine (real vLLM, in-process CPU mode) against the rollout contract.

One engine for the whole module: a vLLM start costs seconds. Tests that change its
weights put the original ones back.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import rollout_contract as contract  # noqa: E402
import torch  # noqa: E402
from engine_testkit import batch_of, encode, make_trainer  # noqa: E402

from flowrl.engines.base import EngineConfigError  # noqa: E402
from flowrl.engines.types import Completion, SamplingSpec  # noqa: E402
from flowrl.engines.vllm_engine import VLLMRolloutEngine  # noqa: E402

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # block_size 32 (CPU default 128) so the 45-token prompt fills a cacheable prefix block.
    eng = VLLMRolloutEngine(
        tiny_model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, engine_kwargs={"block_size": 32}
    )
    yield eng
    eng.shutdown()


def test_engine_runs_in_process_with_direct_weight_updates(engine):
    assert engine.in_process and engine._direct_weights
    assert engine.llm.llm_engine.model_config.logprobs_mode == "processed_logprobs"


def test_an_in_process_engine_leaves_torch_threads_settable(engine):
    # vLLM's CPU worker swaps torch.set_num_threads for a no-op; the engine puts it back, so a
    # trainer (or the warm start) in this process still sets its own thread count.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(before + 1)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


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


def test_vllm_detokenises_only_for_stop_strings(engine, monkeypatch):
    """Without stop strings vLLM is asked for tokens only and the adapter decodes each completion once;
    with them vLLM must detokenise as it decodes (it matches stop strings on text)."""
    sent = []
    generate = engine.llm.generate

    def spy(prompts, params, **kw):
        sent.extend(params)
        return generate(prompts, params, **kw)

    monkeypatch.setattr(engine.llm, "generate", spy)
    prompts = [encode("12+34="), encode("5+6=")]
    plain = engine.generate(prompts, SamplingSpec(n=2, max_tokens=6, seed=3))
    assert sent and not any(p.detokenize for p in sent)
    tokenizer = engine.llm.get_tokenizer()
    assert all(c.text == tokenizer.decode(list(c.response_ids), skip_special_tokens=True) for g in plain for c in g)
    sent.clear()
    engine.generate(prompts, SamplingSpec(n=2, max_tokens=6, seed=3, stop=("=",)))
    assert sent and all(p.detokenize for p in sent)


def test_vllm_on_cpu_compiles_nothing(engine, monkeypatch):
    """An eager engine on CPU calls vLLM with TorchDynamo off (its sampler would otherwise compile an
    op on first use: 2.4 s of every engine's first generate) and leaves the switch as it found it."""
    import torch._dynamo

    seen = []
    generate = engine.llm.generate

    def spy(prompts, params, **kw):
        seen.append(torch._dynamo.config.disable)
        return generate(prompts, params, **kw)

    monkeypatch.setattr(engine.llm, "generate", spy)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    engine.generate([encode("12+34=")], SamplingSpec(n=2, max_tokens=4, seed=1))
    engine.score([encode("12+3=15")])
    assert seen == [True, True]
    assert torch._dynamo.config.disable is False
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_the_workers_of_a_tp_engine_start_without_dynamo(monkeypatch):
    """What a tp > 1 engine's worker processes inherit while vLLM starts them: TorchDynamo off; the
    variable is gone again afterwards, and one the user set is left as it was."""
    import os

    from flowrl.engines.vllm_engine import _compile_disabled_in_children

    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    with _compile_disabled_in_children(True):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in os.environ
    with _compile_disabled_in_children(False):
        assert "TORCH_COMPILE_DISABLE" not in os.environ
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    with _compile_disabled_in_children(True):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "0"
    assert os.environ["TORCH_COMPILE_DISABLE"] == "0"


def test_update_weights(engine, tiny_model_dir):
    contract.check_update_weights(engine, tiny_model_dir)


def test_bad_requests(engine):
    contract.check_bad_requests(engine)


def test_matches_torch_rollout_engine_greedily(engine, tiny_model_dir):
    from flowrl.engines.torch_rollout import TorchRolloutEngine

    spec = SamplingSpec(temperature=0.0, max_tokens=12)
    ours = engine.generate(contract.prompts(), spec)
    theirs = TorchRolloutEngine(tiny_model_dir).generate(contract.prompts(), spec)
    assert [g[0].response_ids for g in ours] == [g[0].response_ids for g in theirs]


def test_score_matches_trainer(engine, tiny_model_dir):
    rows = [encode("12+3=15"), contract.LONG_PROMPT]
    scores = engine.score(rows)
    full = [Completion((row[0],), tuple(row[1:]), (0.0,) * (len(row) - 1), "length") for row in rows]
    expected = make_trainer(tiny_model_dir).forward(batch_of(full))["logprobs"]
    for i, row in enumerate(rows):
        assert len(scores[i]) == len(row) and scores[i][0] == 0.0
        assert (torch.tensor(scores[i]) - expected[i, : len(row)]).abs().max() < contract.TOL


def test_seeded_requests_above_one_steps_token_budget(engine):
    """300 prompts of 41 tokens, 2 samples each: more prompt tokens than one scheduler step takes
    (4096). With prefills split across steps, vLLM rewinds the seeded requests' generators, which
    fails on CPU; the engine keeps prefills whole there (``enable_chunked_prefill``)."""
    config = engine.llm.llm_engine.vllm_config.scheduler_config
    assert not config.enable_chunked_prefill
    prompts = [encode(f"{i:04d}+{i:04d}=" * 4) for i in range(300)]
    assert sum(len(p) for p in prompts) > config.max_num_batched_tokens
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=4, seed=3)
    groups = engine.generate(prompts, spec)
    assert [len(g) for g in groups] == [2] * 300
    assert [c.response_ids for g in groups for c in g] == [c.response_ids for g in engine.generate(prompts, spec) for c in g]


def test_too_long_request_names_the_limit(engine):
    with pytest.raises(EngineConfigError, match=f"max_model_len={MAX_MODEL_LEN}"):
        engine.generate([encode("1+1=")], SamplingSpec(max_tokens=MAX_MODEL_LEN))


def test_unknown_option_is_rejected(tiny_model_dir):
    with pytest.raises(EngineConfigError, match="unknown vLLM option 'max_len'"):
        VLLMRolloutEngine(tiny_model_dir, max_len=64)
