"""SGLangRolloutEngine (real SGLang on CPU: torch_native attention, pytorch sampling) against the rollout contract.

One engine for the whole module (a start costs 10-30 s here). Tests that change its
weights put the original ones back. The unit tests at the top need no SGLang.

The contract's ``check_seeding`` is not run: SGLang honours per-request seeds only in
its deterministic-inference mode, which refuses the CPU attention backend
(``torch_native``); see the module docstring of flowrl/engines/sglang_engine.py.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import rollout_contract as contract
import torch
from engine_testkit import encode, make_trainer

from flowrl.engines.base import EngineConfigError, EngineNotInstalledError
from flowrl.engines.sglang_engine import TopKTopPProcessor, _cut_at_stop, _overlaps_any
from flowrl.engines.types import Completion, SamplingSpec

MAX_MODEL_LEN = 96

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="sglang is not installed (`make test` installs it; see the Makefile's sglang line)",
)


# ---- no engine needed -------------------------------------------------------------------------------

def test_processor_keeps_vllms_top_k_then_nucleus():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 43, generator=gen) * 3
    params = [{"temperature": 0.8, "top_k": -1, "top_p": 0.6}, {"temperature": 1.0, "top_k": 5, "top_p": 1.0},
              {"temperature": 1.0, "top_k": 1, "top_p": 1.0}, {"temperature": 0.5, "top_k": 7, "top_p": 0.5}]
    out = TopKTopPProcessor()(logits.clone(), params)
    kept = ~out.isinf()
    # row 0: the contract's nucleus of softmax(logits / 0.8)
    nucleus = contract._nucleus(logits[0] / 0.8, 0.6)
    assert kept[0].sum() == len(nucleus) and (logits[0][kept[0]] / 0.8).sort().values.equal(nucleus)
    assert kept[1].sum() == 5 and set(kept[1].nonzero().flatten().tolist()) == set(logits[1].topk(5).indices.tolist())
    assert kept[2].nonzero().flatten().tolist() == [int(logits[2].argmax())]
    # row 3: nucleus taken over the top-7 renormalised distribution
    top7 = (logits[3] / 0.5).topk(7).values
    assert kept[3].sum() == len(contract._nucleus(top7, 0.5))
    assert out[kept].equal(logits[kept])  # kept logits are untouched (SGLang divides by T itself)


def test_stop_overlap_and_cut():
    assert _overlaps_any(("a", "e"), ("</s>", "<pad>", "<s>"))  # "a" is inside "<pad>"
    assert not _overlaps_any(("7", "\n"), ("</s>", "<pad>", "<s>"))
    c = Completion((1,), (20, 17, 21, 2), (-1.0, -2.0, -3.0, -4.0), "length", "dae")
    cut = _cut_at_stop(c, ("a", "e"), lambda ids: "".join("xxx0123456789 +-=abcdefghijklmnopqrstuvwxyz"[i] for i in ids))
    assert cut.response_ids == (20, 17) and cut.logprobs == (-1.0, -2.0)
    assert cut.finish_reason == "stop" and cut.text == "d"


def test_missing_package_names_the_install(monkeypatch, tmp_path):
    from flowrl.engines.registry import make_rollout_engine

    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(EngineNotInstalledError, match="sglang==0.5.23"):
        make_rollout_engine("sglang", model_path=str(tmp_path))


def test_tensor_parallel_ranks_on_cpu_get_cores_of_their_own():
    """SGLang gives each CPU rank a NUMA node and refuses more ranks than nodes unless told each
    rank's cores: the adapter tells it when the machine has fewer nodes than ranks."""
    from flowrl.engines.sglang_engine import cpu_rank_binding

    assert cpu_rank_binding(2, 1, [0, 1]) == "0|1"
    assert cpu_rank_binding(2, 1, list(range(8))) == "0-3|4-7"
    assert cpu_rank_binding(3, 1, [0, 1, 2, 3, 4, 5, 6]) == "0-1|2-3|4-5"   # the spare core idles
    assert cpu_rank_binding(4, 1, [2, 3]) == "2|3|2|3"                    # fewer cores than ranks: shared
    assert cpu_rank_binding(2, 1, [0, 1, 4, 5]) == "0-1|4-5"
    assert cpu_rank_binding(1, 1, [0, 1]) is None and cpu_rank_binding(2, 2, [0, 1]) is None  # SGLang's own


@needs_sglang
@pytest.mark.long
def test_tensor_parallel_engine_runs_on_a_one_node_cpu_machine(tiny_model_dir, monkeypatch):
    """sglang(tp = 2) on CPU: before the adapter bound the ranks, SGLang refused to start on a machine
    with one NUMA node (measured: AssertionError from sglang's init_threads_binding)."""
    from flowrl.engines.sglang_engine import SGLangRolloutEngine

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    eng = SGLangRolloutEngine(tiny_model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2,
                              threads=1)
    try:
        contract.check_logprobs_match_trainer(eng, tiny_model_dir)  # the two ranks' shards make the model
    finally:
        eng.shutdown()


# ---- a real SGLang engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from flowrl.engines.sglang_engine import SGLangRolloutEngine

    eng = SGLangRolloutEngine(tiny_model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield eng
    eng.shutdown()



@needs_sglang
def test_engine_runs_sglangs_cpu_paths(engine):
    import psutil

    info = engine.engine.get_server_info()
    assert info["attention_backend"] == "torch_native" and info["sampling_backend"] == "pytorch"
    assert info["enable_custom_logit_processor"] and info["max_total_tokens"] == 32768
    assert all(psutil.pid_exists(pid) for pid in engine._children) and engine._children


@needs_sglang
def test_grouped_completions(engine):
    contract.check_grouped_completions(engine)


@needs_sglang
def test_logprobs_match_trainer(engine, tiny_model_dir):
    contract.check_logprobs_match_trainer(engine, tiny_model_dir)


@needs_sglang
def test_top_k(engine, tiny_model_dir):
    contract.check_top_k(engine, tiny_model_dir)


@needs_sglang
def test_top_p(engine, tiny_model_dir):
    contract.check_top_p(engine, tiny_model_dir)


@needs_sglang
def test_stop_strings(engine):
    contract.check_stop_strings(engine)


@needs_sglang
def test_update_weights(engine, tiny_model_dir):
    contract.check_update_weights(engine, tiny_model_dir)


@needs_sglang
def test_bad_requests(engine):
    contract.check_bad_requests(engine)


@needs_sglang
def test_matches_torch_rollout_engine_greedily(engine, tiny_model_dir):
    from flowrl.engines.torch_rollout import TorchRolloutEngine

    spec = SamplingSpec(temperature=0.0, max_tokens=12)
    ours = engine.generate(contract.prompts(), spec)
    theirs = TorchRolloutEngine(tiny_model_dir).generate(contract.prompts(), spec)
    assert [g[0].response_ids for g in ours] == [g[0].response_ids for g in theirs]


@needs_sglang
def test_greedy_logprobs_equal_transformers_closely(engine, tiny_model_dir):
    groups = engine.generate(contract.prompts(), SamplingSpec(temperature=0.0, max_tokens=12))
    trainer = make_trainer(tiny_model_dir)
    for group in groups:
        c = group[0]
        ids = torch.tensor([list(c.prompt_ids) + list(c.response_ids)])
        with torch.no_grad():
            logp = trainer.model(input_ids=ids).logits[0].float().log_softmax(-1)
        p = len(c.prompt_ids)
        expected = logp[p - 1: -1].gather(1, torch.tensor(c.response_ids).unsqueeze(1)).squeeze(1)
        assert (torch.tensor(c.logprobs) - expected).abs().max() < 1e-5


@needs_sglang
def test_too_long_request_names_the_limit(engine):
    with pytest.raises(EngineConfigError, match=f"max_model_len={MAX_MODEL_LEN}"):
        engine.generate([encode("1+1=")], SamplingSpec(max_tokens=MAX_MODEL_LEN))


@needs_sglang
def test_unknown_option_is_rejected(tiny_model_dir):
    from flowrl.engines.sglang_engine import SGLangRolloutEngine

    with pytest.raises(EngineConfigError, match="unknown SGLang option 'mem_fraction'"):
        SGLangRolloutEngine(tiny_model_dir, mem_fraction=0.5)


@needs_sglang
def test_lora_adapters_merged_into_sglang(engine, tiny_model_dir):
    """SGLang's record says `merged`: a LoRA's resync reaches it as the base weights with the adapters merged
    (flowrl.engines.lora.Merger, k sent along with q and v for the fused qkv); its log-probs are the trainer's."""
    from engine_testkit import completions_batch, max_logprob_gap, train_a_few_steps

    from flowrl.engines.lora import Merger

    lora = {"r": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "v_proj", "down_proj"]}
    trainer = make_trainer(tiny_model_dir, lora=lora, temperature=0.7)
    train_a_few_steps(trainer, 3)
    merger = Merger(tiny_model_dir, trainer.lora)
    spec = SamplingSpec(n=2, temperature=0.7, max_tokens=10, seed=1)
    prompts = [encode(p) for p in ("12+3=", "hello world", "7-2=")]
    engine.update_weights(merger.merged(trainer.named_weights()))
    try:
        groups = engine.generate(prompts, spec)
        batch = completions_batch(groups)
        assert max_logprob_gap(groups, trainer.forward(batch)["logprobs"], batch) < 1e-4
    finally:  # the module's engine goes back to the base weights
        engine.update_weights([(f"{module}.weight", w) for module, w in merger.base.items()])
