"""One end of a weight sync inside a worker: open it, send or receive one resync, inject a fault.

The train and rollout workers (:mod:`flowrl.runtime.workers`) call these functions so
their own methods stay three lines long; the driver never touches a protocol object,
only the plain data these functions return (stats as dicts, the handoff record, the
rendezvous).

Fault injection (``corrupt=True`` in :func:`send_weights`) damages one byte of what
the sender ships *after* it was checksummed, wherever the protocol's bytes travel:
a bucket of the handoff (``inplace``), a bucket on the wire (``broadcast``), the
first published file (``checkpoint``), the first shared buffer (``cuda_ipc``), or the inner
protocol's bytes (``delta``). The
receiver must then stop the run naming the damaged tensor. ``lose=True`` drops one bucket of
the handoff (``inplace``, ``cuda_ipc``) or deletes the first published file (``checkpoint``): the receiver
must find it missing (``LostWeights``) and load nothing. ``breaks=...`` in :func:`receive_weights`
breaks a collective's group as the sync starts, from a receiver: ``"kill"`` SIGKILLs its process
(a replica killed mid-broadcast), ``"close"`` shuts its end of the group down (a connection that
drops): the sender must fail with ``TransportBroken`` instead of hanging.
"""

from __future__ import annotations

import os
import signal
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import torch

from flowrl.runtime.sync import make_sync
from flowrl.runtime.sync.base import WeightSync
from flowrl.runtime.sync.broadcast import BroadcastSync, Rendezvous
from flowrl.runtime.sync.checkpoint import CheckpointSync
from flowrl.runtime.sync.cuda_ipc import CudaIpcSync
from flowrl.runtime.sync.inplace import InPlaceSync
from flowrl.runtime.weight_sync import Bucket, WeightSyncError


def open_end(protocol: str, role: str, options: dict) -> tuple[WeightSync, Rendezvous | None]:
    """Build ``role``'s end of ``protocol``; return it and the rendezvous receivers need (collectives only).

    A collective sender without a ``host`` listens on this node's address (Ray's view
    of it), so receivers on other nodes can reach it.
    """
    options = dict(options)
    if role == "sender" and "world_size" in options and "host" not in options:
        options["host"] = _node_address()
    sync = make_sync(protocol, role, **options)
    return sync, rendezvous_of(sync) if role == "sender" else None


def home_weights(sync: WeightSync, engine: Any) -> int:
    """Let a sender's engine keep its weights where the protocol sends them from (:data:`HOMES`: a
    ``broadcast`` lays them out as its messages); returns how many weights moved there (0 for a
    protocol that packs copies, or an engine whose weights cannot move)."""
    home = HOMES.get(type(sync))
    if home is None:
        return 0
    moved = engine.adopt_weights(lambda weights: home(sync, weights))
    if not moved:
        home(sync, [])  # nothing lives there: give the memory back, pack copies as before
    return moved


HOMES: dict[type, Callable[[Any, Iterable[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]] = {
    BroadcastSync: BroadcastSync.home,
}
"""Protocol class -> how its sender lays an engine's weights out to send them without copying.
A protocol not here packs copies of the weights (``inplace``'s buckets go into Ray's object store,
``checkpoint`` writes files, ``delta`` sends a varying subset)."""


def rendezvous_of(sync: WeightSync) -> Rendezvous | None:
    """The sender's :class:`Rendezvous` (a ``delta`` forwards its inner protocol's), or None."""
    return getattr(sync, "rendezvous", None) or getattr(getattr(sync, "inner", None), "rendezvous", None)


def _node_address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # outside Ray (tests, benchmarks): loopback is every peer's address
        pass
    return "127.0.0.1"


# ---- sending ---------------------------------------------------------------------------------------
def send_weights(sync: WeightSync, weights: Iterable[tuple[str, torch.Tensor]], version: int,
                 corrupt: bool = False, fresh: bool = False, lose: bool = False) -> tuple[dict, Any]:
    """Ship ``weights`` as ``version``; returns (the sender's ProtocolStats as a dict, the handoff).

    Args:
        sync: the sender end from :func:`open_end`.
        weights: ``(hf_name, tensor)`` pairs (any shape, CPU or GPU).
        version: policy version, an int >= 0.
        corrupt: flip one byte of the first bucket/file after checksumming (tests).
        lose: drop a bucket of the handoff, or the first published file (tests).
        fresh: forget what earlier syncs sent first (a ``delta`` sends every tensor, and its
            receivers accept the sync whatever they hold): the resend after a receiver found
            damage, whose delta history may be half updated.

    Returns:
        ``(stats, handoff)``: ``handoff`` is what the driver forwards to each
        receiver (None for collectives).
    """
    hooks = _fault_hooks(_transport(sync)) if corrupt else _NO_FAULT
    loss = _loss_hook(_transport(sync)) if lose else _same
    reset = getattr(sync, "reset", None)  # only protocols with a history have one (delta)
    if fresh and reset is not None:
        reset()
    undo = hooks.before(_transport(sync))
    try:
        stats = sync.send(weights, version)
    finally:
        undo()
    handoff = loss(_transport(sync), hooks.after(_transport(sync), sync.handoff()))
    return asdict(stats), handoff


def _fault_hooks(transport: WeightSync) -> "_Hooks":
    hooks = FAULTS.get(type(transport))
    if hooks is None:
        raise WeightSyncError(f"fault injection: no way to corrupt a {type(transport).__name__} sync; hint: "
                              f"Faults.corrupt_bucket_at_step works with {', '.join(c.name for c in FAULTS)}")
    return hooks


def _loss_hook(transport: WeightSync) -> Callable[[WeightSync, Any], Any]:
    hook = LOSSES.get(type(transport))
    if hook is None:
        raise WeightSyncError(f"fault injection: no way to lose part of a {type(transport).__name__} sync; hint: "
                              f"Faults.lose_bucket_at_step works with {', '.join(c.name for c in LOSSES)}")
    return hook


def _transport(sync: WeightSync) -> WeightSync:
    """The protocol object whose bytes travel (a ``delta``'s inner protocol)."""
    return getattr(sync, "inner", sync)


# ---- receiving -------------------------------------------------------------------------------------
def receive_weights(sync: WeightSync, handoff: Any = None, breaks: str | None = None
                    ) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """Receive and verify one resync; return (the pairs to load into the engine, the receiver's stats).
    ``breaks``: a key of :data:`BREAKS`, break the group first (tests; see the module docstring).

    Every bucket/file is verified before anything is returned, so a corrupted sync
    raises :class:`~flowrl.runtime.weight_sync.WeightSyncError` naming the tensor
    and the engine keeps its old weights. A ``delta`` returns its full local copy of
    the weights, not only the changed tensors: vLLM reloads a layer's fused tensors
    (q/k/v -> qkv_proj) together and leaves the parts not sent undefined.
    """
    if breaks is not None:
        _break_hook(_transport(sync), breaks)(_transport(sync))
    pairs = list(sync.receive(handoff))
    state = getattr(sync, "state", None)
    if state:
        pairs = list(state.items())
    return pairs, asdict(sync.stats)


# ---- fault injection -------------------------------------------------------------------------------
def flip_byte(bucket: Bucket) -> Bucket:
    """A copy of ``bucket`` with its middle byte inverted (its checksums left as they were)."""
    data = bucket.data.copy()
    data[len(data) // 2] ^= 0xFF
    return bucket._replace(data=data)


class _Hooks(NamedTuple):
    before: Callable[[WeightSync], Callable[[], None]]
    """Arm the fault before ``send``; returns the function that disarms it."""
    after: Callable[[WeightSync, Any], Any]
    """Damage what was sent; returns the handoff to forward."""


def _nothing(sync: WeightSync) -> Callable[[], None]:
    return lambda: None


def _same(sync: WeightSync, handoff: Any) -> Any:
    return handoff


def _arm_tamper(sync: BroadcastSync) -> Callable[[], None]:
    previous = sync.tamper
    sync.tamper = lambda b: flip_byte(b) if b.index == 0 else b  # ring buffers: flip_byte copies

    def undo() -> None:
        sync.tamper = previous
    return undo


def _damage_buckets(sync: InPlaceSync, handoff):
    return handoff._replace(buckets=[flip_byte(handoff.buckets[0]), *handoff.buckets[1:]])


def _damage_file(sync: CheckpointSync, handoff):
    """Flip the middle byte of the tensor data (past the safetensors header) of the version's first file."""
    first = sorted(Path(handoff.path).glob("*.safetensors"))[0]
    with open(first, "r+b") as f:
        header = struct.unpack("<Q", f.read(8))[0]
        start = 8 + header
        f.seek(0, 2)
        where = start + (f.tell() - start) // 2
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0xFF]))
    return handoff


def _damage_shared(sync: CudaIpcSync, handoff):
    """Flip a byte in the middle of the first shared buffer's first tensor, after it was checksummed
    (what a writer into the shared memory would do); receivers map that memory and must see it."""
    first = handoff.buckets[0].tensors[0]
    sync._held[0][first.offset + first.nbytes // 2] ^= 0xFF
    return handoff


_NO_FAULT = _Hooks(_nothing, _same)
FAULTS: dict[type, _Hooks] = {
    InPlaceSync: _Hooks(_nothing, _damage_buckets),
    BroadcastSync: _Hooks(_arm_tamper, _same),
    CheckpointSync: _Hooks(_nothing, _damage_file),
    CudaIpcSync: _Hooks(_nothing, _damage_shared),
}
"""Transport class -> how a test corrupts one sync of it (see the module docstring)."""


def _lose_bucket(sync: InPlaceSync, handoff):
    """The handoff without its last bucket (as a transport that dropped it would deliver it)."""
    return handoff._replace(buckets=handoff.buckets[:-1])


def _lose_file(sync: CheckpointSync, handoff):
    """The version's first published file deleted (as a shared directory that lost it would show it)."""
    sorted(Path(handoff.path).glob("*.safetensors"))[0].unlink()
    return handoff


LOSSES: dict[type, Callable[[WeightSync, Any], Any]] = {InPlaceSync: _lose_bucket, CheckpointSync: _lose_file,
                                                       CudaIpcSync: _lose_bucket}
"""Transport class -> how a test loses part of one sync of it (see the module docstring)."""


def _kill_self(sync: BroadcastSync) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _close_end(sync: BroadcastSync) -> None:
    sync.close()


BREAKS: dict[str, Callable[[BroadcastSync], None]] = {"kill": _kill_self, "close": _close_end}
"""How a test breaks a collective's group from a receiver as a sync starts (see the module docstring)."""


def _break_hook(transport: WeightSync, how: str) -> Callable[[BroadcastSync], None]:
    if not isinstance(transport, BroadcastSync):
        raise WeightSyncError(f"fault injection: a {type(transport).__name__} sync has no group to break; hint: "
                              "Faults.break_sync_at_step works with the collective protocols (broadcast, gloo, nccl)")
    if how not in BREAKS:
        raise WeightSyncError(f"fault injection: break_sync_by={how!r}; hint: one of {', '.join(BREAKS)}")
    return BREAKS[how]


__all__ = ["open_end", "home_weights", "HOMES", "rendezvous_of", "send_weights", "receive_weights", "flip_byte",
           "FAULTS", "LOSSES", "BREAKS"]
