"""LoRA in the engines: PEFT in the torch trainer, adapter tensors on the wire, vLLM serving them as an
adapter and transformers generate getting them merged; log-probs after a resync equal the trainer's.
"""

from __future__ import annotations

import pytest
import torch
from engine_testkit import PROMPTS, completions_batch, encode, make_trainer, random_batch, sft_loss, train_a_few_steps

from flowrl.catalog.adapters import lora_params
from flowrl.catalog.models import from_config
from flowrl.engines.base import EngineConfigError
from flowrl.engines.lora import Merger, split_name
from flowrl.engines.types import SamplingSpec

LORA = {"r": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "v_proj", "down_proj"]}
TOL = 1e-4
"""fp32 log-probs of the rollout engine after a resync against the trainer's (nats)."""


def test_trainer_trains_adapters_only(tiny_model_dir):
    eng = make_trainer(tiny_model_dir, lora=LORA)
    trainable = [n for n, p in eng.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for g in eng.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in eng.model.parameters() if p.requires_grad}
    # the adapters count is the catalogue's (the memory model reads it)
    facts = from_config(tiny_model_dir)
    assert sum(p.numel() for p in eng.model.parameters() if p.requires_grad) == lora_params(facts, 8, LORA["targets"])
    frozen = {n: p.detach().clone() for n, p in eng.model.named_parameters() if not p.requires_grad}
    train_a_few_steps(eng, 2)
    assert all(torch.equal(p, frozen[n]) for n, p in eng.model.named_parameters() if not p.requires_grad)
    assert sum(len(eng.optimizer.state[p]) for g in eng.optimizer.param_groups for p in g["params"]) > 0


def test_resync_sends_adapter_tensors_only(tiny_model_dir):
    eng = make_trainer(tiny_model_dir, lora=LORA)
    sent = list(eng.named_weights())
    layers = from_config(tiny_model_dir).layers
    assert len(sent) == layers * len(LORA["targets"]) * 2  # A and B of each targeted module of each layer
    assert all(split_name(name)[0].split(".")[-1] in LORA["targets"] for name, _ in sent)
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in sent)
    full = make_trainer(tiny_model_dir)
    full_bytes = sum(t.numel() * t.element_size() for _, t in full.named_weights())
    assert adapter_bytes * 20 < full_bytes, (adapter_bytes, full_bytes)


def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    a = make_trainer(tiny_model_dir, lora=LORA)
    train_a_few_steps(a, 2)
    a.save(str(tmp_path))
    b = make_trainer(tiny_model_dir, lora=LORA, seed=5)  # another init: load must replace it
    b.load(str(tmp_path))
    batch = random_batch(8, seed=7)
    ma, mb = (e.train_step(batch, sft_loss, micro_batch_size=4) for e in (a, b))
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights()))


def test_unknown_target_is_refused(tiny_model_dir):
    with pytest.raises(EngineConfigError, match="q_proj, k_proj"):
        make_trainer(tiny_model_dir, lora={**LORA, "targets": ["qkv"]})


def _trained(model_dir: str):
    """A LoRA trainer a few steps away from the base (B no longer zero)."""
    eng = make_trainer(model_dir, lora=LORA, temperature=0.7)
    train_a_few_steps(eng, 3)
    assert any(float(t.abs().max()) > 0 for n, t in eng.named_weights() if ".lora_B." in n)
    return eng


def test_merger_equals_peft_merge(tiny_model_dir):
    eng = _trained(tiny_model_dir)
    merged = dict(Merger(tiny_model_dir, eng.lora).merged(eng.named_weights()))
    import copy

    reference = copy.deepcopy(eng.model).merge_and_unload().state_dict()
    # q and v merged, k sent along (fused qkv), down merged; gate/up untargeted and unsent
    assert {n.split(".")[-2] for n in merged} == {"q_proj", "k_proj", "v_proj", "down_proj"}
    for name, tensor in merged.items():
        assert torch.allclose(tensor, reference[name], atol=1e-6), name


def _prompts() -> list[list[int]]:
    return [encode(p) for p in PROMPTS]


def _gap(groups, trainer) -> float:
    batch = completions_batch(groups)
    logprobs = trainer.forward(batch)["logprobs"]
    gap = 0.0
    for row, c in enumerate(c for g in groups for c in g):
        p = len(c.prompt_ids)
        mine = logprobs[row, p: p + len(c.response_ids)]
        gap = max(gap, float((mine - torch.tensor(c.logprobs)).abs().max()))
    return gap


def test_rollout_worker_merges_for_hf_generate(tiny_model_dir):
    """hf_generate's record says `merged`: its worker merges each resync's adapters into the base."""
    from types import SimpleNamespace

    from flowrl.runtime.workers import RolloutWorker

    eng = _trained(tiny_model_dir)
    plan = SimpleNamespace(kind="hf_generate", tp=1, pp=1, dp=1, cp=1, options={})
    worker = RolloutWorker(plan, tiny_model_dir, seed=0, threads=1, lora=LORA)
    spec = SamplingSpec(n=2, temperature=0.7, max_tokens=10, seed=1)
    base = worker.engine.generate(_prompts(), spec)
    worker._load(eng.named_weights())
    groups = worker.engine.generate(_prompts(), spec)
    assert _gap(groups, eng) < TOL
    assert _gap(base, eng) > 100 * TOL  # before the resync it served the base: the check can fail
    # A `delta` resync sends only the tensors that changed: after a fresh adapter's first update, the B's
    # (A's gradient is zero while B is); the worker merges them with the A's it holds.
    fresh = make_trainer(tiny_model_dir, lora=LORA, temperature=0.7)
    first = {n: t.clone() for n, t in fresh.named_weights()}
    worker._load(first.items())  # a delta's first sync: everything
    train_a_few_steps(fresh, 1)
    changed = [(n, t) for n, t in fresh.named_weights() if not torch.equal(t, first[n])]
    assert changed and all(".lora_B." in n for n, _ in changed)
    worker._load(changed)
    assert _gap(worker.engine.generate(_prompts(), spec), fresh) < TOL


@pytest.mark.long
def test_vllm_serves_the_adapter_after_a_resync(tiny_model_dir):
    """vLLM's processed log-probs after each of two adapter loads equal the trainer's (and the base's do not).
    `make test` runs the same path through Ray in tests/families/test_family_lora.py; this one, with its own
    vLLM start, runs in `make test-long`."""
    pytest.importorskip("vllm")
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    eng = make_trainer(tiny_model_dir, lora=LORA, temperature=0.7)
    rollout = VLLMRolloutEngine(tiny_model_dir, dtype="float32", max_model_len=96, lora=LORA)
    try:
        spec = SamplingSpec(n=2, temperature=0.7, max_tokens=10, seed=1)
        base = rollout.generate(_prompts(), spec)  # before any resync: the base, which B = 0 makes the policy
        assert _gap(base, eng) < TOL
        for version in (1, 2):  # two resyncs: the second adapter replaces the first
            train_a_few_steps(eng, 2)
            rollout.load_adapter(eng.named_weights())
            groups = rollout.generate(_prompts(), spec)
            gap = _gap(groups, eng)
            assert gap < TOL, (version, gap)
        assert rollout._lora_request.lora_int_id == 2
        assert _gap(base, eng) > 100 * TOL  # the base's log-probs are not the trained policy's: the check can fail
        assert [c.response_ids for g in groups for c in g] != [c.response_ids for g in base for c in g]
    finally:
        rollout.shutdown()


def test_engine_records_pair_with_their_adapters():
    """Each record's `lora` mode is what its adapter does: `train` and `adapters` adapters take `lora=`,
    `adapters` ones load adapters, `merged` ones take weights in place; every mode is a runtime loader's."""
    from flowrl.catalog.adapters import LORA_MODES
    from flowrl.catalog.engines import ENGINES
    from flowrl.engines.registry import LORA_KWARG, adapter_class, adapter_parameters
    from flowrl.runtime.workers import _LOAD_WEIGHTS

    assert set(LORA_KWARG) == set(LORA_MODES) and set(_LOAD_WEIGHTS) == {"", "adapters", "merged"}
    assert {k for k, e in ENGINES.items() if e.lora} == {"torch", "fsdp", "vllm", "sglang", "hf_generate"}
    for spec in ENGINES.values():
        if not spec.lora:
            continue
        assert spec.lora in (("train",) if spec.serves == "train" else ("adapters", "merged")), spec.name
        cls = adapter_class(spec)
        assert ("lora" in adapter_parameters(cls)) == LORA_KWARG[spec.lora], spec.name
        assert hasattr(cls, "load_adapter" if spec.lora == "adapters" else
                       "update_weights" if spec.lora == "merged" else "named_weights"), spec.name


def test_a_mixture_of_experts_trains_attention_adapters_served_merged(tmp_path):
    """A tiny Qwen3-MoE: "all-linear" is its attention projections (its experts are fused tensors); PEFT
    trains them, the base with the adapters disabled is the checkpoint's model exactly, and hf_generate
    serves the adapters merged in with the trainer's log-probs."""
    import json
    from types import SimpleNamespace

    from flowrl.models.tiny import build_tiny_model
    from flowrl.runtime.workers import RolloutWorker

    path = str(build_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=3))
    assert from_config(path).experts
    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": "all-linear"}
    eng = make_trainer(path, lora=lora, temperature=0.7)
    assert eng.lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    vocab = json.loads((tmp_path / "moe" / "config.json").read_text())["vocab_size"]
    batch = random_batch(8, seed=5, vocab=vocab)
    base = make_trainer(path, temperature=0.7).forward(batch)["logprobs"]
    assert torch.equal(eng.forward(batch, adapters=False)["logprobs"], base)
    for _ in range(3):
        eng.train_step(batch, sft_loss, micro_batch_size=4)
    assert torch.equal(eng.forward(batch, adapters=False)["logprobs"], base)  # the base never moves
    assert float((eng.forward(batch)["logprobs"] - base).abs().max()) > 1e-3
    plan = SimpleNamespace(kind="hf_generate", tp=1, pp=1, dp=1, cp=1, options={})
    worker = RolloutWorker(plan, path, seed=0, threads=1, lora=lora)
    worker._load(eng.named_weights())
    prompts = [[1, 4, 5, 6], [1, 7, 8], [1, 9, 4, 10, 11]]
    groups = worker.engine.generate(prompts, SamplingSpec(n=2, temperature=0.7, max_tokens=8, seed=1))
    assert _gap(groups, eng) < TOL


def test_merged_state_equals_peft_merge_and_unload(tiny_model_dir):
    """What fsdp's save_pretrained writes of a LoRA engine (the gathered PEFT state, merged): PEFT's own merge."""
    import copy

    from flowrl.engines.lora import merged_state

    eng = _trained(tiny_model_dir)
    merged = merged_state(eng.model.state_dict(), eng.lora)
    reference = copy.deepcopy(eng.model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, t in reference.items():
        torch.testing.assert_close(merged[name], t, rtol=1e-6, atol=1e-6, msg=name)
