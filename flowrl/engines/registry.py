"""Engine names -> factories: the one place that maps a plan's engine choice to an adapter.

Factories import their backend lazily, so naming an engine whose package is
absent fails only when it is built, with an install hint
(:class:`~flowrl.engines.base.EngineNotInstalledError`).

>>> sorted(ROLLOUT_ENGINES), sorted(TRAIN_ENGINES)
(['sglang', 'torch', 'vllm'], ['fsdp', 'megatron', 'torch'])
"""

from __future__ import annotations

from typing import Any, Callable

from flowrl.engines.base import EngineError, RolloutEngine, TrainEngine


class UnknownEngineError(EngineError):
    """An engine name that no factory is registered for."""


def _vllm_rollout(**kwargs: Any) -> RolloutEngine:
    from flowrl.engines.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(**kwargs)


def _sglang_rollout(**kwargs: Any) -> RolloutEngine:
    from flowrl.engines.sglang_engine import SGLangRolloutEngine

    return SGLangRolloutEngine(**kwargs)


def _torch_rollout(**kwargs: Any) -> RolloutEngine:
    from flowrl.engines.torch_rollout import TorchRolloutEngine

    return TorchRolloutEngine(**kwargs)


def _torch_train(**kwargs: Any) -> TrainEngine:
    from flowrl.engines.torch_train import TorchTrainEngine

    return TorchTrainEngine(**kwargs)


def _fsdp_train(**kwargs: Any) -> TrainEngine:
    from flowrl.engines.fsdp import FsdpTrainEngine

    return FsdpTrainEngine(**kwargs)


def _megatron_train(**kwargs: Any) -> TrainEngine:
    from flowrl.engines.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(**kwargs)


ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {
    "vllm": _vllm_rollout,
    "sglang": _sglang_rollout,
    "torch": _torch_rollout,
}
"""Rollout engine name -> factory(**options)."""

TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {
    "torch": _torch_train,
    "megatron": _megatron_train,
    "fsdp": _fsdp_train,
}
"""Train engine name -> factory(**options)."""

_TABLES = {"rollout": ROLLOUT_ENGINES, "train": TRAIN_ENGINES}

PLANNED_ENGINES: dict[str, str] = {}
"""Names the language accepts whose adapters are not registered yet, with what they will be."""


def _table(kind: str) -> dict[str, Callable[..., Any]]:
    if kind not in _TABLES:
        raise ValueError(f"engine kind {kind!r} is not one of {sorted(_TABLES)}")
    return _TABLES[kind]


def missing_engine_error(name: str, kind: str = "rollout") -> str:
    """One-line message for an engine name with no registered factory of ``kind``.

    >>> missing_engine_error("vlm")
    "unknown rollout engine 'vlm'; available: sglang, torch, vllm (did you mean 'vllm'?)"
    """
    import difflib

    available = sorted(_table(kind))
    listing = ", ".join(available)
    if name in PLANNED_ENGINES:
        return f"{kind} engine {name!r} is not available: {PLANNED_ENGINES[name]}; available: {listing}"
    other = "train" if kind == "rollout" else "rollout"
    if name in _table(other):
        return f"{name!r} is a {other} engine, not a {kind} engine; {kind} engines: {listing}"
    close = difflib.get_close_matches(name, available, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {kind} engine {name!r}; available: {listing}{hint}"


def register_engine(kind: str, name: str, factory: Callable[..., Any]) -> None:
    """Add (or replace) the factory of engine ``name`` of ``kind`` ("rollout" or "train")."""
    _table(kind)[name] = factory


def make_rollout_engine(name: str, **options: Any) -> RolloutEngine:
    """Build rollout engine ``name`` (e.g. ``make_rollout_engine("vllm", model_path=dir)``)."""
    if name not in ROLLOUT_ENGINES:
        raise UnknownEngineError(missing_engine_error(name, "rollout"))
    return ROLLOUT_ENGINES[name](**options)


def make_train_engine(name: str, **options: Any) -> TrainEngine:
    """Build train engine ``name`` (e.g. ``make_train_engine("torch", model_path=dir, role="critic")``)."""
    if name not in TRAIN_ENGINES:
        raise UnknownEngineError(missing_engine_error(name, "train"))
    return TRAIN_ENGINES[name](**options)
