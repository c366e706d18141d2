"""Engines behind small Protocols: rollout (vLLM, transformers) and training (transformers).

Importing this package loads torch but no backend: transformers models and vLLM load
only when an engine is built from its catalogue record, through :mod:`flowrl.engines.registry`.
"""

from flowrl.engines.base import (
    EngineConfigError,
    EngineError,
    EngineNotInstalledError,
    LossFn,
    RolloutEngine,
    TrainEngine,
)
from flowrl.engines.registry import (
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    UnknownEngineError,
    make_rollout_engine,
    make_train_engine,
    missing_engine_error,
)
from flowrl.engines.torch_train import OptimConfig
from flowrl.engines.types import Completion, SamplingSpec, TokenBatch
from flowrl.engines.vllm_engine import VLLMOptions

__all__ = [
    "Completion",
    "EngineConfigError",
    "EngineError",
    "EngineNotInstalledError",
    "LossFn",
    "OptimConfig",
    "ROLLOUT_ENGINES",
    "RolloutEngine",
    "SamplingSpec",
    "TRAIN_ENGINES",
    "TokenBatch",
    "TrainEngine",
    "UnknownEngineError",
    "VLLMOptions",
    "make_rollout_engine",
    "make_train_engine",
    "missing_engine_error",
]
