"""The catalogue of weight-sync protocols: ``resync MODEL via NAME(...)``.

One record per protocol: its options, what carries the bytes on each platform, which
placements it can connect (``local``: the rollout engine on the trainer's GPUs;
``intra-node``; ``inter-node``), whether it streams (``overlap``), whether its ends run as a
collective, how the cost model charges it, and the runtime class that implements it
(``module:Class``, never imported here). The compiler's protocol selection and checks, the
cost model, ``schedule auto``, the runtime and the docs read these records; a test pairs
them with the runtime's classes.

>>> PROTOCOLS["inplace"].routes
frozenset({'local'})
>>> PROTOCOLS["nccl"].transport["cpu"]
'gloo'
>>> PROTOCOLS["nccl"].transport_on("cuda"), PROTOCOLS["ipc"].transport_on("cuda")
('nccl', None)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.catalog.platforms import TRANSPORTS
from flowrl.catalog.spec import RUNS, KwSpec, Support, unsupported

ROUTES = ("local", "intra-node", "inter-node")
"""How far weights travel: the rollout engine on the trainer's GPUs, on the same node(s), across nodes."""


@dataclass(frozen=True)
class ProtocolSpec:
    name: str
    options: dict[str, KwSpec]
    doc: str
    runtime: str
    """The runtime class implementing both ends, ``module:Class``."""
    transport: dict
    """Platform -> what moves the bytes there (``nccl``, ``gloo``, ``ray``, ``disk``...): the
    torch.distributed backend of a broadcast, the store of a hand-off. It must be one of the
    platform's :data:`~flowrl.catalog.platforms.TRANSPORTS` (else the compiler refuses the protocol
    there, E445); the plan records it, and the runtime opens it (and refuses it on a machine whose
    platform lacks it). ``nccl`` is gloo on a CPU cluster: the same flow runs on CPU and on GPUs."""
    routes: frozenset[str]
    """The placements it can connect (:data:`ROUTES`)."""
    cost: str
    """How the cost model charges it: ``link`` (bytes over the route's link), ``disk`` (written
    then read through a shared disk), ``changed`` (the fraction of the weights an RL step
    changes, over the link)."""
    streaming: bool = False
    """Takes ``overlap``: packing and sending overlap generation (separate GPUs only)."""
    collective: bool = False
    """Sender and receivers run together in one process group (else the sender hands off)."""
    shared_dir_across_nodes: bool = False
    """Across nodes it needs a directory every node sees (its ``dir`` option)."""
    platforms: dict = field(default_factory=dict)
    """Platform -> :class:`Support`; absent: not supported."""
    chosen_for: tuple = ()
    """``(route, platform kind)`` pairs for which the compiler picks it when the schedule writes no
    protocol; platform kind ``cpu`` or ``gpu``."""
    searched: bool = False
    """``schedule auto`` tries it as an alternative to the protocol it would choose."""
    carries_delta: bool = False
    """It carries the changed tensors of a ``delta`` whose planned transport is one of its
    transports (the runtime picks the first such record, in catalogue order)."""

    def support(self, platform: str) -> Support:
        return self.platforms.get(platform, Support(False, {}, f"`{self.name}` does not run on {platform}"))

    def transport_on(self, platform: str) -> str | None:
        """What moves its bytes on ``platform``, or None when that platform lacks it
        (:data:`~flowrl.catalog.platforms.TRANSPORTS`)."""
        t = self.transport.get(platform)
        return t if t in TRANSPORTS.get(platform, ()) else None


_BUCKET = "bytes per packed message"
_ALL = frozenset(ROUTES)

PROTOCOLS: dict[str, ProtocolSpec] = {p.name: p for p in (
    ProtocolSpec(
        "inplace", {"bucket": KwSpec("size", 256 * 2**20, min=1, doc=_BUCKET)},
        "the trainer's weights loaded into the colocated rollout engine, through Ray's shared-memory object store",
        runtime="flowrl.runtime.sync.inplace:InPlaceSync",
        transport={"cpu": "ray", "cuda": "ray", "rocm": "ray"}, routes=frozenset({"local"}), cost="link",
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS},
        chosen_for=(("local", "cpu"), ("local", "gpu")), carries_delta=True),
    ProtocolSpec(
        "ipc", {"bucket": KwSpec("size", 256 * 2**20, min=1, doc=_BUCKET)},
        "shared-memory handles between engines on one node",
        runtime="flowrl.runtime.sync.inplace:InPlaceSync",
        transport={"cpu": "shm"}, routes=frozenset({"local", "intra-node"}), cost="link",
        platforms={"cpu": RUNS,
                   "cuda": unsupported("`ipc` is host shared memory; on NVIDIA GPUs use `cuda_ipc` for colocated "
                                       "engines or `nccl` between pools"),
                   "rocm": unsupported("HIP IPC handles are not built; use `inplace` or `nccl`")}),
    ProtocolSpec(
        "cuda_ipc", {"bucket": KwSpec("size", 256 * 2**20, min=1, doc=_BUCKET)},
        "device buffers shared with the colocated rollout engine through CUDA IPC handles, checksummed on the GPU",
        runtime="flowrl.runtime.sync.cuda_ipc:CudaIpcSync",
        transport={"cuda": "cuda_ipc"}, routes=frozenset({"local"}), cost="link",
        platforms={"cpu": unsupported("CUDA IPC needs NVIDIA GPUs; colocated engines on CPU use `inplace`"),
                   "cuda": RUNS,
                   "rocm": unsupported("HIP IPC handles are not built; use `inplace` or `nccl`")}),
    ProtocolSpec(
        "nccl", {"bucket": KwSpec("size", 512 * 2**20, min=1, doc=_BUCKET),
                 "overlap": KwSpec("bool", True, doc="pack and send while the rollout engine generates")},
        "packed bucket broadcast over an NCCL group (gloo on a CPU cluster)",
        runtime="flowrl.runtime.sync.broadcast:BroadcastSync",
        transport={"cpu": "gloo", "cuda": "nccl", "rocm": "nccl"}, routes=_ALL, cost="link",
        streaming=True, collective=True, platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS},
        chosen_for=(("intra-node", "gpu"), ("inter-node", "gpu"))),
    ProtocolSpec(
        "gloo", {"bucket": KwSpec("size", 512 * 2**20, min=1, doc=_BUCKET),
                 "overlap": KwSpec("bool", True, doc="pack and send while the rollout engine generates")},
        "packed bucket broadcast over a gloo group (host memory)",
        runtime="flowrl.runtime.sync.broadcast:BroadcastSync",
        transport={"cpu": "gloo", "cuda": "gloo", "rocm": "gloo"}, routes=_ALL, cost="link",
        streaming=True, collective=True, platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS},
        chosen_for=(("intra-node", "cpu"), ("inter-node", "cpu"))),
    ProtocolSpec(
        "broadcast", {"bucket": KwSpec("size", 512 * 2**20, min=1, doc=_BUCKET),
                      "overlap": KwSpec("bool", True, doc="pack and send while the rollout engine generates")},
        "packed bucket broadcast over the platform's collective backend (NCCL on GPUs, gloo on CPU)",
        runtime="flowrl.runtime.sync.broadcast:BroadcastSync",
        transport={"cpu": "gloo", "cuda": "nccl", "rocm": "nccl"}, routes=_ALL, cost="link",
        streaming=True, collective=True, platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}, carries_delta=True),
    ProtocolSpec(
        "checkpoint", {"dir": KwSpec("str", "", doc="a directory every node sees (default: the run directory)"),
                       "keep": KwSpec("int", 1, min=1, doc="published versions kept on disk")},
        "safetensors files and a manifest published atomically on a shared disk",
        runtime="flowrl.runtime.sync.checkpoint:CheckpointSync",
        transport={"cpu": "disk", "cuda": "disk", "rocm": "disk"}, routes=_ALL, cost="disk",
        shared_dir_across_nodes=True, platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}, searched=True,
        carries_delta=True),
    ProtocolSpec(
        "delta", {"bucket": KwSpec("size", 256 * 2**20, min=1, doc=_BUCKET),
                  "threshold": KwSpec("float", 0.0, min=0.0, doc="changes at most this large are not sent")},
        "only the tensors that changed since the last resync, over the placement's transport",
        runtime="flowrl.runtime.sync.delta:DeltaSync",
        transport={"cpu": "gloo", "cuda": "nccl", "rocm": "nccl"}, routes=_ALL, cost="changed",
        platforms={"cpu": RUNS, "cuda": RUNS, "rocm": RUNS}, searched=True),
)}


def protocol(name: str) -> ProtocolSpec:
    if name not in PROTOCOLS:
        raise KeyError(f"unknown weight-sync protocol {name!r}; protocols: {', '.join(sorted(PROTOCOLS))}")
    return PROTOCOLS[name]


def chosen_protocol(route: str, platform_kind: str) -> ProtocolSpec:
    """The protocol the compiler picks for a route on a ``cpu`` or ``gpu`` cluster."""
    return next(p for p in PROTOCOLS.values() if (route, platform_kind) in p.chosen_for)


__all__ = ["ProtocolSpec", "PROTOCOLS", "ROUTES", "protocol", "chosen_protocol"]
