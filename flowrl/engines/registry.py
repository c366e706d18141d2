"""Engines built from their catalogue records: the one place an engine name becomes an adapter.

Each :class:`~flowrl.catalog.engines.EngineSpec` names its adapter as ``module:Class`` and
maps the layout options a schedule writes to the adapter's keyword arguments
(``adapter_options``). This module imports the adapter, translates the options and adds
the *context* every adapter of a role takes (:data:`CONTEXT`: the model directory, the
seed, ...). Adapter modules import their backend lazily, so naming an engine whose package
is absent fails only when it is built, with an install hint
(:class:`~flowrl.engines.base.EngineNotInstalledError`).

There is no table of names here: :data:`ROLLOUT_ENGINES` and :data:`TRAIN_ENGINES` are
views of the catalogue, and an unknown name is an :class:`UnknownEngineError`.

>>> sorted(ROLLOUT_ENGINES), sorted(TRAIN_ENGINES)
(['hf_generate', 'sglang', 'vllm'], ['fsdp', 'megatron', 'torch'])
>>> adapter_kwargs(engine_record("vllm"), {"tp": 2, "dp": 4, "max_model_len": 256})
{'tensor_parallel_size': 2, 'max_model_len': 256}
>>> runs_on("torch", world_size=2).name
'fsdp'
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
from typing import Any

from flowrl.catalog.engines import ENGINES, EngineSpec
from flowrl.engines.base import EngineConfigError, EngineError

CONTEXT: dict[str, tuple[str, ...]] = {
    "rollout": ("model_path", "seed", "dtype", "max_model_len"),
    "train": ("model_path", "role", "optim", "temperature", "seed", "dtype", "precision"),
}
"""What the runtime gives every adapter of a role, besides the layout's options: the model
directory, the seed, the parameter dtype; a rollout engine the longest prompt + completion
(``max_model_len``, from the checkpoint unless the layout sets it); a train engine its role
(``actor``/``critic``), AdamW settings (:class:`~flowrl.engines.torch_train.OptimConfig`) and
the sampling temperature its log-probs must use, and how a 16-bit ``dtype`` trains (``precision``:
:mod:`flowrl.catalog.precision`)."""

ROLLOUT_ENGINES: dict[str, EngineSpec] = {k: e for k, e in ENGINES.items() if e.serves == "rollout"}
"""The catalogue's rollout engines (a view, by name)."""

TRAIN_ENGINES: dict[str, EngineSpec] = {k: e for k, e in ENGINES.items() if e.serves == "train"}
"""The catalogue's train engines (a view, by name)."""


class UnknownEngineError(EngineError):
    """An engine name the catalogue has no record of, or one that serves the other role."""


def missing_engine_error(name: str, role: str = "rollout") -> str:
    """One line for an engine name with no ``role`` record.

    >>> missing_engine_error("vlm")
    "unknown rollout engine 'vlm'; rollout engines: hf_generate, sglang, vllm (did you mean 'vllm'?)"
    >>> missing_engine_error("vllm", "train")
    "'vllm' is a rollout engine, not a train engine; train engines: fsdp, megatron, torch"
    """
    available = sorted(k for k, e in ENGINES.items() if e.serves == role)
    listing = f"{role} engines: {', '.join(available)}"
    if name in ENGINES:
        return f"{name!r} is a {ENGINES[name].serves} engine, not a {role} engine; {listing}"
    close = difflib.get_close_matches(str(name), available, n=1)
    return f"unknown {role} engine {name!r}; {listing}" + (f" (did you mean {close[0]!r}?)" if close else "")


def engine_record(name: str, role: str | None = None) -> EngineSpec:
    """The catalogue record of engine ``name`` (serving ``role`` if given), else :class:`UnknownEngineError`."""
    spec = ENGINES.get(name)
    if spec is None or (role is not None and spec.serves != role):
        raise UnknownEngineError(missing_engine_error(name, role or "rollout"))
    return spec


def runs_on(name: str, world_size: int = 1) -> EngineSpec:
    """The record whose adapter runs engine ``name`` over ``world_size`` ranks.

    A ``single``-rank engine with more ranks runs on its ``multi_rank_as`` engine
    (``torch(dp = 2)`` on ``fsdp``'s ranks); one without that has no way to run them.
    """
    spec = engine_record(name)
    if world_size > 1 and spec.ranks == "single":
        if spec.multi_rank_as is None:
            raise EngineConfigError(f"the `{name}` engine runs on one rank; a layout of {world_size} ranks needs an "
                                    "engine with ranks (its record's `multi_rank_as`)")
        return engine_record(spec.multi_rank_as, spec.serves)
    return spec


def adapter_class(spec: EngineSpec) -> type:
    """Import the adapter class the record names (``module:Class``)."""
    module, _, attr = spec.adapter.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise UnknownEngineError(f"engine `{spec.name}`: its adapter {spec.adapter!r} cannot be imported ({err}); "
                                 "hint: the catalogue record's `adapter` must name an importable class") from err


def adapter_parameters(cls: type) -> frozenset[str]:
    """Keyword arguments the adapter's constructor takes: its named parameters, and the fields of its
    ``Options`` dataclass when it takes options as ``**overrides`` (vLLM, SGLang)."""
    params = inspect.signature(cls.__init__).parameters
    names = {p for p, v in params.items() if p != "self" and v.kind is not v.VAR_KEYWORD}
    options = getattr(cls, "Options", None)
    if options is not None and any(v.kind is v.VAR_KEYWORD for v in params.values()):
        names |= {f.name for f in dataclasses.fields(options)}
    return frozenset(names)


def adapter_kwargs(spec: EngineSpec, layout: dict[str, Any]) -> dict[str, Any]:
    """The layout's options (axes included) the adapter takes, under the adapter's names; the
    others (``dp`` of a replicated engine, placement) stay with the runtime."""
    return {spec.adapter_options[k]: v for k, v in layout.items() if k in spec.adapter_options}


def missing_package(spec: EngineSpec) -> str | None:
    """Why engine ``spec`` cannot be built on this machine (its package is not installed), or None."""
    if spec.package is None:
        return None
    try:
        found = importlib.util.find_spec(spec.package) is not None
    except ImportError:  # a dotted name whose parent package is absent
        found = False
    if found:
        return None
    return f"the `{spec.name}` engine needs the `{spec.package}` package, which is not installed: {spec.install}"


LORA_KWARG: dict[str, bool] = {"train": True, "adapters": True, "merged": False}
"""An engine's :attr:`~flowrl.catalog.engines.EngineSpec.lora` mode -> whether its adapter takes the
plan's LoRA as ``lora=`` (it trains or loads adapters itself); ``merged`` engines get merged weights
from their worker (:class:`flowrl.engines.lora.Merger`) and never see the adapter."""


def build_engine(spec: EngineSpec, layout: dict[str, Any], *, lora: dict | None = None, placement: Any = None,
                 **context: Any) -> Any:
    """Build ``spec``'s adapter with the role's :data:`CONTEXT` and the layout's options.

    ``context`` must hold exactly the role's context names; layout options the adapter takes
    override a context value of the same name (``max_model_len``). ``lora``: the model trains LoRA
    adapters (the plan's options), passed to an adapter whose record's mode takes them
    (:data:`LORA_KWARG`); an engine whose record has no mode refuses it. ``placement`` (a
    :class:`~flowrl.engines.ranks.RankPlacement`): where each rank actor of an engine whose record
    says ``ranks = "actors"`` runs under Ray; None: its ranks are forked here.
    """
    expected = set(CONTEXT[spec.serves])
    if set(context) != expected:
        raise EngineConfigError(f"building `{spec.name}`: the runtime passed {sorted(context)}, a {spec.serves} "
                                f"engine takes {sorted(expected)}")
    extra = {}
    if lora is not None:
        if spec.lora not in LORA_KWARG:
            raise EngineConfigError(f"the `{spec.name}` engine cannot take a LoRA model (its record's `lora` is "
                                    f"{spec.lora!r}); `flowrl check` refuses this (E613)")
        if LORA_KWARG[spec.lora]:
            extra["lora"] = lora
    if placement is not None:
        if spec.ranks != "actors":
            raise EngineConfigError(f"building `{spec.name}`: a rank placement was passed, but its record says "
                                    f"ranks = {spec.ranks!r}; only engines with rank actors take one")
        extra["placement"] = placement
    return adapter_class(spec)(**{**context, **adapter_kwargs(spec, layout), **extra})


def make_rollout_engine(name: str, **kwargs: Any) -> Any:
    """Build rollout engine ``name``'s adapter with its own keyword arguments
    (``make_rollout_engine("vllm", model_path=dir)``)."""
    return adapter_class(engine_record(name, "rollout"))(**kwargs)


def make_train_engine(name: str, **kwargs: Any) -> Any:
    """Build train engine ``name``'s adapter with its own keyword arguments
    (``make_train_engine("torch", model_path=dir, role="critic")``)."""
    return adapter_class(engine_record(name, "train"))(**kwargs)


__all__ = ["CONTEXT", "ROLLOUT_ENGINES", "TRAIN_ENGINES", "UnknownEngineError", "missing_engine_error",
           "engine_record", "runs_on", "adapter_class", "adapter_parameters", "adapter_kwargs", "missing_package",
           "LORA_KWARG", "build_engine", "make_rollout_engine", "make_train_engine"]
