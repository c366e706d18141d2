"""Engines behind small Protocols: rollout (vLLM, transformers) and training (transformers).

Importing this package is cheap: backends (torch models, vLLM) load only when an
engine is built, through :mod:`flowrl.engines.registry`.
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
    register_engine,
)
from flowrl.engines.types import Completion, SamplingSpec, TokenBatch

__all__ = [
    "Completion",
    "EngineConfigError",
    "EngineError",
    "EngineNotInstalledError",
    "LossFn",
    "ROLLOUT_ENGINES",
    "RolloutEngine",
    "SamplingSpec",
    "TRAIN_ENGINES",
    "TokenBatch",
    "TrainEngine",
    "UnknownEngineError",
    "make_rollout_engine",
    "make_train_engine",
    "missing_engine_error",
    "register_engine",
]
