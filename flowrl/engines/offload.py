"""A train engine's state to host memory and back, in place: what colocated engines' turns need.

On GPUs shared by a train engine and a rollout engine, the trainer gives its memory to the
rollout engine while that one generates (:attr:`flowrl.plan.EnginePlan.releases`):
:class:`HostStash` copies every storage behind the parameters, gradients and optimizer
states into host memory (pinned when CUDA is there) and shrinks the storage to 0 bytes;
:meth:`HostStash.reload` grows each storage back and copies the bytes in. Tensors keep
their identity: views (FSDP2's sharded parameters, Megatron's gradient buffers), the
optimizer's references and ``requires_grad`` are untouched, so training continues
bit-identically. Between the two calls the state must not be used (reading a tensor whose
storage is empty raises).

Storages are deduplicated (a buffer several views share is copied once); a DTensor is
handled through its local shard.

>>> import torch
>>> w = torch.nn.Parameter(torch.arange(4.0))
>>> stash = HostStash()
>>> stash.offload([w]), w.untyped_storage().nbytes()
(16, 0)
>>> stash.reload(), w.tolist()
(16, [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from flowrl.engines.base import EngineError


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s bytes (a DTensor's local shard)."""
    return getattr(t, "_local_tensor", t)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor viewing ``storage`` (copies in and out go through it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostStash:
    """Storages offloaded to host memory, and how to bring them back (see the module docstring)."""

    def __init__(self) -> None:
        self._stored: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.kept_bytes = 0
        """Bytes the last :meth:`offload` could not move: storages shared with numpy (only CPU tensors
        are: a weight sync reads CPU weights through numpy views), which cannot be resized."""

    @property
    def offloaded(self) -> bool:
        """Whether state is in host memory now (and must be reloaded before use)."""
        return bool(self._stored)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move the storages behind ``tensors`` to host memory; returns the bytes moved."""
        if self._stored:
            raise EngineError("offload: the state is already in host memory; reload() it first")
        pin = torch.cuda.is_available()
        seen: set[int] = set()
        moved = 0
        self.kept_bytes = 0
        for t in tensors:
            storage = _local(t).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            if not storage.resizable():
                # Memory another owner shares (numpy took a view of a CPU tensor): it stays where it is.
                self.kept_bytes += storage.nbytes()
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin and storage.device.type == "cuda")
            host.copy_(_bytes_of(storage))
            self._stored.append((storage, host))
            moved += storage.nbytes()
        for storage, _ in self._stored:  # only once every copy is made: storages may overlap in views
            storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()  # give the freed blocks back, so another process can use them
        return moved

    def reload(self) -> int:
        """Restore every offloaded storage in place; returns the bytes moved back."""
        moved = 0
        for storage, host in self._stored:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host)
            moved += host.numel()
        if moved and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._stored = []
        return moved


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """The parameters a torch optimizer updates and every tensor of its state (AdamW's moments, step)."""
    for group in optimizer.param_groups:
        yield from group["params"]
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """A module's parameters, their gradients (``grad`` and Megatron's ``main_grad``) and its buffers."""
    for p in module.parameters():
        yield p
        for grad in (p.grad, getattr(p, "main_grad", None)):
            if isinstance(grad, torch.Tensor):
                yield grad
    yield from module.buffers()


def state_checksums(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """CRC-32 of every parameter, gradient and optimizer-state tensor, by name (what a round trip keeps).

    Names: ``param:<name>``, ``grad:<name>`` (``grad`` or ``main_grad``), ``optim:<i>:<key>`` for the
    i-th state entry of ``optimizer`` (its parameters' order).
    """
    def crc(t: torch.Tensor) -> int:
        # A copy: numpy() of the tensor itself would pin its storage (no longer resizable, so no offload).
        t = _local(t).detach().cpu().clone().reshape(-1)
        return zlib.crc32(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0

    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        out[f"param:{name}"] = crc(p)
        grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        if isinstance(grad, torch.Tensor):
            out[f"grad:{name}"] = crc(grad)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim:{i}:{key}"] = crc(value)
    return out


__all__ = ["HostStash", "optimizer_tensors", "module_tensors", "state_checksums"]
