"""Every patch Megatron-core needs to run on a machine without CUDA, in one place.

Megatron-core 0.19 assumes a GPU in a handful of places: it asks ``torch.cuda`` for
the current device, stream and RNG state, and creates a few tensors with a literal
``device="cuda"``. On a CPU-only torch build each of those raises ("Torch not
compiled with CUDA enabled"). The shims below redirect exactly those calls to the
CPU; nothing else in flowrl knows about them.

Rules:

* :func:`apply_cpu_shims` does nothing when a GPU is visible (the GPU path runs
  Megatron unmodified) and is idempotent.
* The patches are applied only inside the Megatron rank processes that
  :mod:`flowrl.engines.megatron.engine` spawns, never in the driver's process, so no
  other library there sees a patched ``torch.cuda``.
* Each shim is one :class:`Shim` record of :data:`SHIMS` with the Megatron code path
  that needs it; ``tests/megatron/test_cpu_shims.py`` runs that code path with all
  shims but one and checks it fails, so a shim that stops being needed is noticed.
* :func:`remove_cpu_shims` restores every patched attribute (tests use it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Shim:
    """One CPU patch: its name, the Megatron code that needs it, and the function applying it."""

    name: str
    """Short identifier (used by :func:`apply_cpu_shims`'s ``skip``)."""
    why: str
    """The Megatron call site that fails on CPU without it."""
    apply: Callable[["_Patcher"], None]
    """Installs the patch through the patcher (which records the originals)."""


class _Patcher:
    """Sets attributes and remembers the originals so that they can be restored."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any, bool]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        had = hasattr(owner, name)
        self.saved.append((owner, name, getattr(owner, name, None), had))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, old, had in reversed(self.saved):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self.saved.clear()


# ----------------------------------------------------------------- torch.cuda API


class _NullStream:
    """Stands in for a CUDA stream on CPU, where every op is synchronous."""

    def wait_stream(self, other: Any) -> None:
        """No-op: CPU ops complete in program order."""

    def wait_event(self, event: Any) -> None:
        """No-op: CPU ops complete in program order."""

    def synchronize(self) -> None:
        """No-op."""


def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """torch.cuda.get_rng_state -> the CPU generator's state (ByteTensor)."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Megatron's ``_set_cuda_rng_state`` -> set the CPU generator's state."""
    torch.set_rng_state(new_state.cpu())


def _cpu_manual_seed(seed: int) -> None:
    """torch.cuda.manual_seed -> seed the CPU generator."""
    torch.manual_seed(int(seed))


def _shim_current_device(p: _Patcher) -> None:
    # Megatron moves buffers with .to(torch.cuda.current_device()) and allocates grad
    # buffers with device=torch.cuda.current_device(); the CPU device serves both.
    p.set(torch.cuda, "current_device", lambda: _CPU)


def _shim_current_stream(p: _Patcher) -> None:
    # DDP's bucket group waits on torch.cuda.current_stream() before reducing grads.
    p.set(torch.cuda, "current_stream", lambda device=None: _NullStream())


def _shim_synchronize(p: _Patcher) -> None:
    # Pipeline p2p calls torch.cuda.synchronize() after exchanging shapes/tensors; CPU
    # collectives on gloo have completed when they return, so there is nothing to wait for.
    p.set(torch.cuda, "synchronize", lambda device=None: None)


def _shim_rng(p: _Patcher) -> None:
    # model_parallel_cuda_manual_seed and CudaRNGStatesTracker keep per-TP-rank RNG
    # states through torch.cuda.{get_rng_state, manual_seed}; on CPU the CPU generator
    # plays that role (dropout on CPU draws from it anyway).
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    p.set(torch.cuda, "get_rng_state", _cpu_get_rng_state)
    p.set(torch.cuda, "manual_seed", _cpu_manual_seed)
    p.set(torch.cuda.random, "get_rng_state", _cpu_get_rng_state)
    # Megatron's own setter goes through torch.cuda.default_generators, which a CPU
    # build lacks; and torch.cuda._lazy_call would silently queue it forever.
    p.set(random, "_set_cuda_rng_state", _cpu_set_rng_state)


# ------------------------------------------------------- device="cuda" literals

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like")


def _to_cpu_device(device: Any) -> Any:
    """'cuda', 'cuda:0', torch.device('cuda') or a CUDA index -> the CPU device."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if device is not None and torch.device(device).type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _CpuTorch(types.ModuleType):
    """A view of the ``torch`` module whose tensor factories map ``device='cuda'`` to CPU.

    Installed as the ``torch`` global of the few Megatron modules that allocate with a
    literal ``device="cuda"``; every other attribute is torch's own.
    """

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CUDA_LITERAL_MODULES = {
    "cuda_literals_schedules": (
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_*: total_num_tokens = torch.zeros([], device='cuda')",
    ),
    "cuda_literals_optimizer": (
        "megatron.core.optimizer.optimizer",
        "MegatronOptimizer: found_inf / _scale tensors and the 'is local' flag on device='cuda'",
    ),
    "cuda_literals_clip_grads": (
        "megatron.core.optimizer.clip_grads",
        "get_grad_norm_fp32 / count_zeros_fp32: norm accumulators on device='cuda'",
    ),
    "cuda_literals_utils": (
        "megatron.core.utils",
        "local_multi_tensor_l2_norm (no Apex/TE): the norm tensor on device='cuda'",
    ),
}


def _shim_cuda_literals(module_name: str) -> Callable[[_Patcher], None]:
    def apply(p: _Patcher) -> None:
        p.set(importlib.import_module(module_name), "torch", _CpuTorch())

    return apply


# ------------------------------------------------ tensor type names (dist. optimizer)

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_type_names() -> Iterable[None]:
    """While active, ``tensor.type()`` names CPU float tensors like their CUDA twins."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _shim_dist_opt_type_check(p: _Patcher) -> None:
    # DistributedOptimizer._build_model_and_main_param_groups accepts only parameters
    # whose .type() is 'torch.cuda.{Float,Half,BFloat16}Tensor'. The patch is scoped to
    # that one classmethod call, so tensor.type() is untouched everywhere else.
    dist_opt = importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer
    original = dist_opt.__dict__["_build_model_and_main_param_groups"].__func__

    def build(cls: type, *args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return original(cls, *args, **kwargs)

    p.set(dist_opt, "_build_model_and_main_param_groups", classmethod(build))


def _shim_clip_type_check(p: _Patcher) -> None:
    # clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'. The
    # optimizers call it through megatron.core.optimizer.optimizer's module global, so
    # that reference is wrapped (scoped to the call, like the shim above).
    module = importlib.import_module("megatron.core.optimizer.optimizer")
    original = module.clip_grad_by_total_norm_fp32

    @functools.wraps(original)
    def clip(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return original(*args, **kwargs)

    p.set(module, "clip_grad_by_total_norm_fp32", clip)


# ------------------------------------------------------ context-parallel RoPE slice


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """``rope_utils.get_pos_emb_on_this_cp_rank`` with its chunk index on the embedding's device.

    Same math as Megatron's: ``2 * cp`` chunks along ``seq_dim``, keep chunks ``r`` and
    ``2 cp - 1 - r``. Megatron builds the index with ``pin_memory=True`` and ``.cuda()``.
    """
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    pos_emb = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:]).index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _shim_cp_pos_emb(p: _Patcher) -> None:
    # With cp > 1, RotaryEmbedding.forward slices its table per CP rank through the module
    # global get_pos_emb_on_this_cp_rank, whose index tensor is pinned and moved to CUDA.
    for name in ("megatron.core.models.common.embeddings.rotary_pos_embedding",
                 "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding"):
        p.set(importlib.import_module(name), "get_pos_emb_on_this_cp_rank", _cpu_pos_emb_on_this_cp_rank)


# ------------------------------------------------- MoE all-to-all token dispatcher


class _NullEventStream(_NullStream):
    """The all-to-all dispatcher's device-to-host stream on CPU: its ``record_event()`` is an event
    whose ``synchronize()`` returns at once (the copies it waits for are no copies on CPU)."""

    def record_event(self, event: Any = None) -> "_NullEventStream":
        return self


def _shim_moe_dtoh_stream(p: _Patcher) -> None:
    # MoEAlltoAllTokenDispatcher.__init__ creates its class-wide side stream with
    # torch.cuda.Stream() unless one is set: set a null one first.
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher").MoEAlltoAllTokenDispatcher
    p.set(dispatcher, "cuda_dtoh_stream", _NullEventStream())


def _host_splits(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU: Megatron converts the
    all-to-all split sizes to numpy only when it copies them from a GPU, and torch's
    ``all_to_all_single`` takes a sequence of ints, not a tensor."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor.cpu() if torch.is_tensor(tensor) else tensor


def _shim_moe_splits(p: _Patcher) -> None:
    # MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize calls the module global.
    p.set(importlib.import_module("megatron.core.transformer.moe.token_dispatcher"), "maybe_move_tensor_to_cpu",
          _host_splits)


# ------------------------------------------------------------------- the table

SHIMS: tuple[Shim, ...] = (
    Shim("current_device", "RotaryEmbedding.get_emb, ParamAndGradBuffer: torch.cuda.current_device()",
         _shim_current_device),
    Shim("current_stream", "_ParamAndGradBucketGroup.start_grad_sync: torch.cuda.current_stream()",
         _shim_current_stream),
    Shim("synchronize", "p2p_communication._communicate(_shapes): torch.cuda.synchronize()", _shim_synchronize),
    Shim("rng", "model_parallel_cuda_manual_seed / CudaRNGStatesTracker: torch.cuda RNG state", _shim_rng),
    *(Shim(name, why, _shim_cuda_literals(module)) for name, (module, why) in _CUDA_LITERAL_MODULES.items()),
    Shim("dist_opt_type_check", "DistributedOptimizer._build_model_and_main_param_groups: param.type() names",
         _shim_dist_opt_type_check),
    Shim("clip_type_check", "clip_grad_by_total_norm_fp32: assert grad.type() == 'torch.cuda.FloatTensor'",
         _shim_clip_type_check),
    Shim("cp_pos_emb", "RotaryEmbedding.forward with cp > 1: get_pos_emb_on_this_cp_rank(pin_memory=True, .cuda())",
         _shim_cp_pos_emb),
    Shim("moe_dtoh_stream", "MoEAlltoAllTokenDispatcher.__init__ (MoE models): torch.cuda.Stream()",
         _shim_moe_dtoh_stream),
    Shim("moe_splits", "MoEAlltoAllTokenDispatcher.token_dispatch with ep > 1: all_to_all_single(split sizes as "
         "a CPU tensor), which torch's binding refuses", _shim_moe_splits),
)
"""Every CPU shim, in application order."""

_PATCHER = _Patcher()
_APPLIED: list[str] = []


def needs_cpu_shims() -> bool:
    """True when no CUDA device is visible (the only case the shims are for)."""
    return not torch.cuda.is_available()


def apply_cpu_shims(skip: Iterable[str] = ()) -> tuple[str, ...]:
    """Apply every shim of :data:`SHIMS` not named in ``skip``; no-op with a GPU or when applied.

    Returns the names of the shims now active. Imports the Megatron modules it patches,
    so ``megatron-core`` must be installed.
    """
    if not needs_cpu_shims() or _APPLIED:
        return tuple(_APPLIED)
    unknown = sorted(set(skip) - {s.name for s in SHIMS})
    if unknown:
        raise ValueError(f"unknown CPU shim(s) {unknown}; known: {[s.name for s in SHIMS]}")
    for shim in SHIMS:
        if shim.name not in skip:
            shim.apply(_PATCHER)
            _APPLIED.append(shim.name)
    return tuple(_APPLIED)


def remove_cpu_shims() -> None:
    """Undo :func:`apply_cpu_shims` (restores every patched attribute)."""
    _PATCHER.restore()
    _APPLIED.clear()


def active_cpu_shims() -> tuple[str, ...]:
    """Names of the shims currently applied."""
    return tuple(_APPLIED)
