"""The catalogue and the runtime pair up: every record has its runtime counterpart, and every runtime
table entry its record; an unknown name anywhere in the runtime is a clear error, never a default.

* engines: the adapter a record names imports, implements ``RolloutEngine`` / ``TrainEngine``
  (and ``SleepingEngine`` / ``OffloadingEngine`` when the record frees memory), and takes the
  record's ``adapter_options`` and the role's context as constructor parameters;
* ops: every step op supported on some platform has the handler its record names (a function of
  that name), every resource op a builder in its kind's table; ops no platform runs
  (none today) would be refused by ``check`` through their records;
* losses: every record's ``fn`` is a function of :data:`~flowrl.runtime.losses.LOSS_FUNCTIONS`;
* protocols: every record's ``runtime`` class implements ``WeightSync`` and is the class the
  runtime dispatches to.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
from pathlib import Path

import pytest

import flowrl.engines
import flowrl.runtime.sync
from flowrl.catalog.engines import ENGINES
from flowrl.catalog.losses import LOSSES
from flowrl.catalog.ops import FIELDS, OPS, RESOURCE_KINDS, OpKind
from flowrl.catalog.platforms import PLATFORMS
from flowrl.catalog.protocols import PROTOCOLS as PROTOCOL_RECORDS
from flowrl.engines.base import OffloadingEngine, RolloutEngine, SleepingEngine, TrainEngine
from flowrl.engines.registry import (CONTEXT, UnknownEngineError, adapter_class, adapter_parameters, engine_record,
                                     runs_on)
from flowrl.plan import DatasetPlan, EnvPlan, ModelPlan, OpPlan, RewardPlan
from flowrl.runtime.data import DATASET_FORMATS, reader_of
from flowrl.runtime.env_pool import ENV_KINDS, env_builder_of
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.handlers import HANDLERS, handler_of
from flowrl.runtime.losses import LOSS_FUNCTIONS, UnknownLossError, make_loss_fn
from flowrl.runtime.materialize import MODEL_SOURCES, source_of
from flowrl.runtime.rewards import REWARD_KINDS, builder_of
from flowrl.runtime.step import StepValue, UndeclaredFieldError, check_fields
from flowrl.runtime.sync import PROTOCOLS, WeightSync, WeightSyncError, make_sync
from flowrl.runtime.sync.registry import delta_carrier

ROOT = Path(__file__).resolve().parents[2]

RESOURCE_TABLES = {OpKind.MODEL: MODEL_SOURCES, OpKind.DATASET: DATASET_FORMATS, OpKind.REWARD_FN: REWARD_KINDS,
                   OpKind.ENV: ENV_KINDS}
"""Resource kind -> the runtime's table of builders, keyed by ``OpSpec.handler``."""


def _members(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def _implements(cls: type, protocol: type) -> bool:
    return all(callable(getattr(cls, name, None)) for name in _members(protocol))


def _runs_nowhere(spec) -> bool:
    return not any(spec.support(p).ok for p in PLATFORMS)


# ---- engines -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_record_has_an_adapter_taking_its_options(name):
    spec = ENGINES[name]
    cls = adapter_class(spec)
    assert _implements(cls, RolloutEngine if spec.serves == "rollout" else TrainEngine), cls
    params = adapter_parameters(cls)
    assert set(spec.adapter_options) <= set(spec.kwargs), (name, "maps options a layout cannot write")
    assert set(spec.adapter_options.values()) <= params, (name, set(spec.adapter_options.values()) - params)
    assert set(CONTEXT[spec.serves]) <= params, (name, set(CONTEXT[spec.serves]) - params)
    memory = {"sleep": SleepingEngine, "offload": OffloadingEngine}
    if spec.frees_memory is not None:
        assert _implements(cls, memory[spec.frees_memory]), (name, spec.frees_memory)
    if spec.multi_rank_as is not None:
        bigger = runs_on(name, world_size=2)
        assert bigger.serves == spec.serves and bigger.ranks != "single", name


def _adapters_in(package) -> dict[str, type]:
    out = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            protocol = getattr(cls, "_is_protocol", False)
            if cls.__module__ == module.__name__ and not protocol and (_implements(cls, RolloutEngine)
                                                                       or _implements(cls, TrainEngine)):
                out[f"{cls.__module__}:{cls.__name__}"] = cls
    return out


def test_every_engine_adapter_is_named_by_a_record():
    named = {spec.adapter for spec in ENGINES.values()}
    assert set(_adapters_in(flowrl.engines)) <= named, set(_adapters_in(flowrl.engines)) - named


def test_an_unknown_engine_is_an_error():
    with pytest.raises(UnknownEngineError, match="unknown rollout engine 'trtllm'; rollout engines: "):
        engine_record("trtllm", "rollout")
    with pytest.raises(UnknownEngineError, match="'megatron' is a train engine, not a rollout engine"):
        engine_record("megatron", "rollout")


# ---- ops -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(n for n, s in OPS.items() if s.kind not in RESOURCE_KINDS))
def test_every_step_op_has_its_handler(name):
    spec = OPS[name]
    if _runs_nowhere(spec):  # refused by `check` on every platform (its record says why)
        return
    assert spec.handler in HANDLERS, (name, spec.handler)
    assert HANDLERS[spec.handler].__name__ == spec.handler


def _read_only_by_ops_that_run_nowhere(kind: OpKind) -> bool:
    readers = [s for s in OPS.values() if any(a.type in _TYPE_OF.get(kind, ()) for a in s.args)]
    return bool(readers) and all(_runs_nowhere(s) for s in readers)


_TYPE_OF = {OpKind.MODEL: ("model",), OpKind.DATASET: ("dataset",), OpKind.REWARD_FN: ("reward",),
            OpKind.ENV: ("env",)}


@pytest.mark.parametrize("name", sorted(n for n, s in OPS.items() if s.kind in RESOURCE_KINDS))
def test_every_resource_op_has_a_builder(name):
    spec = OPS[name]
    if _runs_nowhere(spec) or _read_only_by_ops_that_run_nowhere(spec.kind):
        return  # refused by `check` on every platform (its record says why)
    table = RESOURCE_TABLES[spec.kind]
    assert spec.handler in table, (name, spec.handler)
    assert table[spec.handler].__name__ == spec.handler


def test_every_runtime_handler_and_builder_serves_a_record():
    handlers = {s.handler for s in OPS.values() if s.kind not in RESOURCE_KINDS}
    assert set(HANDLERS) <= handlers, set(HANDLERS) - handlers
    for kind, table in RESOURCE_TABLES.items():
        builders = {s.handler for s in OPS.values() if s.kind == kind}
        assert set(table) <= builders, (kind, set(table) - builders)


def test_every_field_an_op_needs_or_produces_is_declared():
    for name, spec in OPS.items():
        used = set(spec.produces) | {f for a in spec.args for f in a.needs}
        assert used <= set(FIELDS), (name, used - set(FIELDS))


def _op(op: str, kind: str) -> OpPlan:
    return OpPlan("x", kind, op, {}, {}, None, None, ("rewards",), "f.flow:7:3")


def test_an_op_without_a_handler_is_refused_with_its_position():
    with pytest.raises(RuntimeFlowError, match=r"f\.flow:7:3: `nosuch` is not an op of the catalogue"):
        handler_of(_op("nosuch", "advantage"))
    with pytest.raises(RuntimeFlowError, match=r"f\.flow:7:3: `reward_model` is served by the handler "
                                               "`reward_model`, which the runtime does not have"):
        handler_of(_op("reward_model", "reward_fn"))  # a resource, not a step op


def test_a_resource_without_a_builder_is_refused_with_its_position():
    with pytest.raises(RuntimeFlowError, match=r"d\.flow:1:1: `csv` is not a dataset format; formats: (\w+, )*jsonl, (\w+, )*parquet"):
        reader_of(DatasetPlan("d", "csv", "/x.csv", "prompt", "answer", "", "d.flow:1:1"))
    with pytest.raises(RuntimeFlowError, match=r"r\.flow:2:1: `jsonl` is not a reward kind; kinds: "):
        builder_of(RewardPlan("r", "jsonl", {}, "r.flow:2:1"))
    with pytest.raises(RuntimeFlowError, match=r"e\.flow:4:1: `jsonl` is not an environment kind; kinds: (\w+, )*python_env"):
        env_builder_of(EnvPlan("e", "jsonl", {}, "e.flow:4:1"))
    with pytest.raises(RuntimeFlowError, match=r"m\.flow:3:1: model source `gguf` cannot be materialized"):
        source_of(ModelPlan("m", "gguf", {}, "trainable", None, None, None, {}, "m.flow:3:1"))


def test_a_value_with_an_undeclared_field_is_refused():
    check_fields(_op("score", "score"), StepValue({"rewards": [1.0]}))
    with pytest.raises(UndeclaredFieldError, match="undeclared field '_batch'"):
        check_fields(_op("score", "score"), StepValue({"_batch": None}))


# ---- losses --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_has_its_function(name):
    fn = LOSSES[name].fn
    assert LOSS_FUNCTIONS[fn].__name__ == fn
    assert callable(make_loss_fn({"name": name}))


def test_every_loss_function_serves_a_record_and_unknown_losses_raise():
    assert set(LOSS_FUNCTIONS) <= {s.fn for s in LOSSES.values()}
    with pytest.raises(UnknownLossError, match="unknown loss 'ppo'; losses: "):
        make_loss_fn({"name": "ppo"})  # once, an unknown name silently ran vanilla PG


# ---- protocols -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROTOCOL_RECORDS))
def test_every_protocol_record_has_its_weight_sync_class(name):
    module, _, attr = PROTOCOL_RECORDS[name].runtime.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    assert PROTOCOLS[name] is cls
    assert _implements(cls, WeightSync) and hasattr(cls, "name") and hasattr(cls, "collective"), cls


def test_every_weight_sync_class_is_named_by_a_record_and_unknown_protocols_raise():
    named = {p.runtime for p in PROTOCOL_RECORDS.values()}
    for info in pkgutil.walk_packages(flowrl.runtime.sync.__path__, "flowrl.runtime.sync."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and _implements(cls, WeightSync) and not getattr(cls, "_is_protocol", False):
                assert f"{cls.__module__}:{cls.__name__}" in named, cls
    with pytest.raises(WeightSyncError, match="unknown weight-sync protocol 'rsync'"):
        make_sync("rsync", "sender")
    with pytest.raises(WeightSyncError, match="no protocol carries a delta over transport 'shm'"):
        delta_carrier("shm")


# ---- nothing accepted is left without a runtime path --------------------------------------------------


def test_no_cannot_run_in_this_build_message_is_left():
    found = subprocess.run(["grep", "-rn", "cannot run in this build", str(ROOT / "flowrl")],
                           capture_output=True, text=True).stdout
    assert found == "", found


def test_every_verifier_name_is_served_and_every_verifier_is_named():
    """``verifier(NAME)``'s names (checked by ``check``, E204) are exactly the runtime's verifiers."""
    from flowrl.catalog.ops import VERIFIER_NAMES
    from flowrl.rewards.verifiers import VERIFIERS

    assert sorted(VERIFIER_NAMES) == sorted(VERIFIERS)
