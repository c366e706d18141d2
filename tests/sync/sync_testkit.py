"""Helpers for the weight-sync tests: deterministic weights, bit-exact comparison, process helpers.

Functions that run in spawned processes live here (not in test files) so the
children can import them by module name.
"""

from __future__ import annotations

import multiprocessing
import traceback
import zlib

import torch


def model_weights(version: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A tiny model's weights at ``version``: mixed dtypes and shapes; only some tensors change per version.

    Tensors ``layers.0.*`` change every version, ``layers.1.*`` only on even
    versions, and ``embed`` / ``norm`` / ``steps`` never (so a delta has something to skip).
    """

    def randn(name: str, shape, v: int, dtype=torch.float32) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()) + 7919 * v)
        return torch.randn(*shape, generator=g).to(dtype)

    even = version - version % 2
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 3.0])
    return [
        ("embed.weight", randn("embed", (64, 16), 0)),
        ("layers.0.q.weight", randn("q0", (16, 16), version, torch.bfloat16)),
        ("layers.0.mlp.weight", randn("mlp0", (48, 16), version)),
        ("layers.0.special", special.to(torch.float16) * (version + 1)),
        ("layers.1.q.weight", randn("q1", (16, 16), even, torch.bfloat16)),
        ("layers.1.mlp.weight", randn("mlp1", (48, 16), even).t()),  # non-contiguous
        ("norm.weight", torch.ones(16)),
        ("steps", torch.arange(5, dtype=torch.int64)),
        ("scale", torch.tensor(0.5)),
        ("mask", torch.tensor([True, False, True])),
    ]


def raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes (bit-exact comparison covers NaN payloads and -0.0)."""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def digest(pairs) -> list[tuple[str, str, tuple[int, ...], int]]:
    """``(name, dtype, shape, crc32 of the bytes)`` per tensor: what a child sends back to compare."""
    return [(n, str(t.dtype), tuple(t.shape), zlib.crc32(raw(t))) for n, t in pairs]


def start_children(target, args_per_child: list[tuple]):
    """Start one spawned process per args tuple, running ``target(*args)``; returns ``(processes, queue)``.

    Pass both to :func:`collect`, which returns each child's return value in order.
    """
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_guard, args=(target, q, i, args)) for i, args in enumerate(args_per_child)]
    for p in procs:
        p.start()
    return procs, q


def collect(procs, q, timeout: float = 120.0) -> list:
    """Wait for the children of :func:`start_children`; raise with the child's traceback if one failed."""
    results = {}
    for _ in procs:
        index, ok, value = q.get(timeout=timeout)
        if not ok:
            raise AssertionError(f"child {index} failed:\n{value}")
        results[index] = value
    for p in procs:
        p.join(timeout=timeout)
    return [results[i] for i in range(len(procs))]


def _guard(target, q, index, args) -> None:
    torch.set_num_threads(1)  # the test machine has 2 cores and other tests run beside these
    try:
        q.put((index, True, target(*args)))
    except BaseException:
        q.put((index, False, traceback.format_exc()))


# ---- children --------------------------------------------------------------------------------------
def broadcast_receiver(rendezvous, rank: int, syncs: int, overlap: bool, default_group_dir: str | None,
                       backend: str = "gloo", frames: str = "auto"):
    """Receive ``syncs`` broadcast syncs; per sync ``("ok", version, digest, buckets)`` or ``("error", message)``.

    With ``default_group_dir`` the process first creates a default gloo group of one
    rank, as vLLM does in-process, to prove the standalone sync group coexists with it.
    Returns ``(outcomes, default group still usable)``.
    """
    import torch.distributed as dist

    from flowrl.runtime.sync import BroadcastSync, WeightSyncError

    if default_group_dir:
        dist.init_process_group("gloo", init_method=f"file://{default_group_dir}/store", rank=0, world_size=1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU per rank
    sync = BroadcastSync("receiver", rendezvous=rendezvous, rank=rank, overlap=overlap, backend=backend,
                         timeout_s=60, frames=frames)
    outcomes = []
    for _ in range(syncs):
        try:
            pairs = list(sync.receive())
            outcomes.append(("ok", sync.version, digest(pairs), sync.stats.buckets))
            if sync.on_device:  # device frames: each tensor arrives on the wire's device
                assert {t.device for _, t in pairs} == {sync.wire_device}
        except WeightSyncError as error:
            outcomes.append(("error", str(error)))
    sync.close()
    alive = False
    if default_group_dir:
        t = torch.ones(1)
        dist.all_reduce(t)
        alive = dist.is_initialized() and t.item() == 1.0
        dist.destroy_process_group()
    return outcomes, alive


def broadcast_receiver_that_breaks(rendezvous, rank: int, breaks: str | None, timeout_s: float):
    """Receive sync 1, then sync 2 breaking the group first when ``breaks`` says how (``kill``: this
    process dies; ``close``: it closes its end); returns ``(outcome of sync 2, seconds it took)``,
    where an outcome is ``("ok", version)`` or ``(error class name, message)``."""
    import time

    from flowrl.runtime.sync import BroadcastSync
    from flowrl.runtime.sync.endpoint import receive_weights

    sync = BroadcastSync("receiver", rendezvous=rendezvous, rank=rank, timeout_s=timeout_s)
    receive_weights(sync)
    t0 = time.monotonic()
    try:
        receive_weights(sync, breaks=breaks)
        outcome = ("ok", sync.version)
    except Exception as error:  # noqa: BLE001 - the class and message go back to the test
        outcome = (type(error).__name__, str(error))
    sync.close()
    return outcome, time.monotonic() - t0


def checkpoint_receiver(directory: str, handoffs: list):
    """Read one checkpoint sync per handoff (None = LATEST); ``("ok", version, digest)`` or ``("error", msg)``."""
    from flowrl.runtime.sync import CheckpointSync, WeightSyncError

    sync = CheckpointSync("receiver", directory=directory)
    outcomes = []
    for handoff in handoffs:
        try:
            pairs = list(sync.receive(handoff))
            outcomes.append(("ok", sync.version, digest(pairs)))
        except WeightSyncError as error:
            outcomes.append(("error", str(error)))
    return outcomes


def checkpoint_sender_stuck_in_v2(directory: str, stuck) -> None:
    """Publish v1, then start v2 and block forever after its first file is on disk (the test kills us)."""
    import time

    from flowrl.runtime.sync import CheckpointSync

    sync = CheckpointSync("sender", directory=directory, bucket_bytes=256)
    sync.send(model_weights(1), 1)

    def v2():
        for i, pair in enumerate(model_weights(2)):
            if i == 3:  # files for the first tensors are written by now
                stuck.set()
                while True:
                    time.sleep(1)
            yield pair

    sync.send(v2(), 2)


def delta_broadcast_receiver(rendezvous, syncs: int):
    """Receive ``syncs`` delta syncs over broadcast; per sync ``(version, names received, digest of state)``."""
    from flowrl.runtime.sync import make_sync

    sync = make_sync("delta", "receiver", inner="broadcast", rendezvous=rendezvous, rank=1, timeout_s=60)
    out = []
    for _ in range(syncs):
        names = [n for n, _ in sync.receive()]
        out.append((sync.version, names, digest(sorted(sync.state.items())), sync.stats.skipped))
    sync.close()
    return out


class SyncHost:
    """Stands in for a train or rollout worker (a Ray actor): hosts protocol ends by key, as the driver would."""

    def __init__(self):
        self.syncs = {}
        self.loaded: dict[str, torch.Tensor] = {}

    def open(self, key: str, name: str, role: str, options: dict):
        """Build one end; returns the sender's rendezvous (broadcast) for the driver to forward."""
        from flowrl.runtime.sync import make_sync

        self.syncs[key] = make_sync(name, role, **options)
        return getattr(self.syncs[key], "rendezvous", None) if role == "sender" else None

    def send(self, key: str, version: int):
        from dataclasses import asdict

        sync = self.syncs[key]
        stats = sync.send(model_weights(version), version)
        return sync.handoff(), asdict(stats)

    def receive(self, key: str, handoff):
        """Load the sync's tensors (as an engine's update_weights would); returns the receiver's stats."""
        from dataclasses import asdict

        sync = self.syncs[key]
        for name, tensor in sync.receive(handoff):
            self.loaded[name] = tensor.clone()
        return asdict(sync.stats)

    def digest(self):
        return digest([(n, self.loaded[n]) for n, _ in model_weights(0)])

    def close(self, key: str) -> None:
        self.syncs.pop(key).close()


def broadcast_receiver_thread(rendezvous, times: int) -> tuple:
    """A broadcast receiver (rank 1, gloo) in a thread taking ``times`` sends: ``(thread, out)``, where
    ``out[i]`` becomes ``(digest, version)`` of the i-th send, or the WeightSyncError it raised."""
    import threading

    from flowrl.runtime.sync import WeightSyncError
    from flowrl.runtime.sync.endpoint import open_end, receive_weights

    out: dict = {}

    def receive() -> None:
        receiver, _ = open_end("broadcast", "receiver", {"rendezvous": rendezvous, "rank": 1, "backend": "gloo"})
        for i in range(times):
            try:
                pairs, stats = receive_weights(receiver)
                out[i] = (digest(pairs), stats["version"])
            except WeightSyncError as error:
                out[i] = error
        receiver.close()

    thread = threading.Thread(target=receive)
    thread.start()
    return thread, out


def ipc_receiver(handoff, device: str | None = None):
    """A ``cuda_ipc`` receiver in another process: map the sender's buffers, verify, return :func:`digest`."""
    from flowrl.runtime.sync.cuda_ipc import CudaIpcSync

    if device == "cuda":
        torch.cuda.set_device(0)
    receiver = CudaIpcSync("receiver")
    pairs = list(receiver.receive(handoff))
    return digest([(n, t.cpu()) for n, t in pairs]), {t.device.type for _n, t in pairs}, receiver.stats.bytes
