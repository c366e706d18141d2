"""Hardware profiles: what one accelerator (and its links) can do, in public or measured figures.

``H100``, ``H200`` and ``A100`` come from NVIDIA's data sheets (SXM parts, dense bf16
tensor-core TFLOP/s without sparsity, HBM capacity and bandwidth, NVLink per GPU in one
direction, one InfiniBand NIC per GPU). ``cpu`` is this machine, measured by
``flowrl profile`` (:func:`measure`) and read from ``$FLOWRL_PROFILE`` or
``$FLOWRL_CACHE/profile.json`` (default ``~/.cache/flowrl/profile.json``); until it is
measured, conservative figures for a 2-core x86 machine stand in (``source`` says so).

Efficiency factors turn peak figures into achievable ones (a training step reaches 35-45%
MFU on Megatron at scale; decode reads weights at about 70% of HBM peak); they live
here, with the hardware they describe, so that the cost model has no magic numbers.

>>> p = get_profile("H100")
>>> p.tflops, p.hbm_gb, p.hbm_gbs
(989.0, 80.0, 3350.0)
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class Profile:
    """One device kind. Units: TFLOP/s, GB (1e9 bytes), GB/s (1e9 bytes per second)."""

    name: str
    kind: str
    """``gpu`` or ``cpu`` (a logical GPU on a CPU machine)."""
    tflops: float
    """Peak dense matmul throughput (bf16 on GPUs, fp32 on CPU), TFLOP/s."""
    hbm_gb: float
    """Device memory per GPU (for ``cpu``: the machine's RAM divided among its logical GPUs)."""
    hbm_gbs: float
    """Memory bandwidth (for ``cpu``: measured memcpy)."""
    nvlink_gbs: float
    """GPU-to-GPU bandwidth inside a node, per GPU, one direction (``cpu``: gloo allreduce)."""
    ib_gbs: float
    """GPU-to-GPU bandwidth across nodes, per GPU (one NIC per GPU)."""
    pcie_gbs: float
    """Host <-> device bandwidth (offload, checkpoint reload)."""
    weight_bytes: int = 2
    """Bytes per weight the engines hold: bf16 on GPUs; fp32 on CPU (vLLM CPU runs fp32 here)."""
    mfu_train: float = 0.40
    """Achieved fraction of peak in forward+backward (Megatron reports 38-47% at scale)."""
    mfu_forward: float = 0.50
    """Achieved fraction of peak in forward-only passes (log-probs, prefill)."""
    bw_eff: float = 0.70
    """Achieved fraction of HBM bandwidth when decoding (weights + KV cache reads)."""
    link_eff: float = 0.80
    """Achieved fraction of link bandwidth in collectives (NCCL bus bandwidth)."""
    latency_s: float = 30e-6
    """Fixed cost per collective call / bucket (launch + handshake)."""
    context_gb: float = 0.5
    """Memory each engine process pins on a GPU (CUDA context, NCCL buffers)."""
    disk_gbs: float = 2.0
    """Shared-filesystem bandwidth per node (checkpoint protocol)."""
    max_num_seqs: int = 256
    """The rollout engine's cap on concurrent sequences per replica (vLLM's default)."""
    op_overhead_s: float = 0.0
    """Fixed cost of dispatching one op to an engine (Ray round trip, Python, kernel launches)."""
    iter_overhead_s: float = 0.0015
    """Fixed cost of one decode iteration of a rollout engine (scheduler, sampler, launches;
    vLLM with CUDA graphs spends 1-2 ms per iteration outside the model)."""
    micro_overhead_s: float = 0.0
    """Fixed cost of one micro-batch of a training pass (forward + backward launches, Python in
    the engine), whatever its size: ~0 against the FLOPs of a real model on GPUs; on CPU with a
    tiny model about as large as the FLOPs (measured here: ~20 ms per micro-batch)."""
    seq_overhead_s: float = 0.0
    """Cost per active sequence per decode iteration outside the model's FLOPs and bytes
    (sampling, output processing, per-sequence attention calls): ~0 on GPUs, where a
    batch is one kernel; on CPU vLLM it dominates a decode iteration of a tiny model (measured
    here: 14 ms per iteration at 128 sequences, 29 ms at 256), so ``flowrl profile
    --calibrate`` measures it."""
    request_overhead_s: float = 0.0
    """Serial cost per request in a rollout replica outside the model (input processing,
    detokenisation, building the output): ~0 against a GPU's decode; on CPU vLLM with a tiny
    model about twice a decoded token's cost (measured here: 0.19 ms per request, 0.11 ms per
    sequence per iteration)."""
    memory_total_gb: float = 0.0
    """``cpu``: the whole machine's RAM (shared by its logical GPUs); 0 for GPUs."""
    source: str = "public data sheet"
    """Where the figures come from."""

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("A100", "gpu", tflops=312.0, hbm_gb=80.0, hbm_gbs=2039.0, nvlink_gbs=300.0, ib_gbs=25.0,
            pcie_gbs=32.0, source="NVIDIA A100 80GB SXM data sheet (bf16 dense 312 TFLOP/s, HBM2e 2.0 TB/s, "
                                  "NVLink3 600 GB/s bidirectional, HDR 200 Gb/s)"),
    Profile("H100", "gpu", tflops=989.0, hbm_gb=80.0, hbm_gbs=3350.0, nvlink_gbs=450.0, ib_gbs=50.0,
            pcie_gbs=64.0, source="NVIDIA H100 SXM data sheet (bf16 dense 989 TFLOP/s, HBM3 3.35 TB/s, "
                                  "NVLink4 900 GB/s bidirectional, NDR 400 Gb/s)"),
    Profile("H200", "gpu", tflops=989.0, hbm_gb=141.0, hbm_gbs=4800.0, nvlink_gbs=450.0, ib_gbs=50.0,
            pcie_gbs=64.0, source="NVIDIA H200 SXM data sheet (bf16 dense 989 TFLOP/s, HBM3e 141 GB 4.8 TB/s, "
                                  "NVLink4 900 GB/s bidirectional, NDR 400 Gb/s)"),
)}

CPU_FALLBACK = Profile(
    "cpu", "cpu", tflops=0.05, hbm_gb=8.0, hbm_gbs=5.0, nvlink_gbs=1.0, ib_gbs=0.5, pcie_gbs=5.0,
    weight_bytes=4, mfu_train=0.3, mfu_forward=0.4, bw_eff=0.5, link_eff=0.8, latency_s=1e-3,
    context_gb=0.0, disk_gbs=0.5, max_num_seqs=256, op_overhead_s=0.05, iter_overhead_s=0.01, memory_total_gb=16.0,
    source="default figures for a small x86 machine: run `flowrl profile` to measure this one")
"""Used for ``gpu = "cpu"`` until ``flowrl profile`` has measured the machine."""


class ProfileError(ValueError):
    """An unknown profile name or an unreadable profile file."""


def profile_path() -> Path:
    """``$FLOWRL_PROFILE``, else ``$FLOWRL_CACHE/profile.json``, else ``~/.cache/flowrl/profile.json``."""
    if os.environ.get("FLOWRL_PROFILE"):
        return Path(os.environ["FLOWRL_PROFILE"])
    root = os.environ.get("FLOWRL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "flowrl") / "profile.json"


_CACHE: dict[str, tuple[float, Profile]] = {}


def load_profile(path: str | Path) -> Profile:
    """A profile from a JSON file written by :func:`save_profile` (unknown keys are ignored)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"cannot read profile {p}: {e}; rerun `flowrl profile`") from None
    known = {f.name for f in fields(Profile)}
    try:
        return Profile(**{k: v for k, v in data.items() if k in known})
    except TypeError as e:
        raise ProfileError(f"profile {p} is incomplete ({e}); rerun `flowrl profile`") from None


def cpu_profile(gpus_per_node: int = 1) -> Profile:
    """The measured CPU profile if there is one (else :data:`CPU_FALLBACK`), memory split per logical GPU."""
    path = profile_path()
    base = CPU_FALLBACK
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = None
    if mtime is not None:
        cached = _CACHE.get(str(path))
        if cached and cached[0] == mtime:
            base = cached[1]
        else:
            try:
                base = load_profile(path)
            except ProfileError:
                base = CPU_FALLBACK  # a broken file must not break `flowrl check`; plan shows the source
            _CACHE[str(path)] = (mtime, base)
    total = base.memory_total_gb or base.hbm_gb
    return replace(base, hbm_gb=round(total / max(gpus_per_node, 1), 3))


def get_profile(name: str, gpus_per_node: int = 1) -> Profile:
    """The profile of a cluster's ``gpu`` option: ``H100``, ``H200``, ``A100`` or ``cpu``."""
    if name == "cpu":
        return cpu_profile(gpus_per_node)
    try:
        return PROFILES[name]
    except KeyError:
        raise ProfileError(f"unknown GPU kind {name!r}; known: {', '.join(sorted(PROFILES) + ['cpu'])}") from None


def save_profile(profile: Profile, path: str | Path | None = None) -> Path:
    """Write ``profile`` as JSON (atomically) to ``path`` (default :func:`profile_path`)."""
    target = Path(path) if path else profile_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target


# ---- measuring this machine (flowrl profile) ----------------------------------------------------


def measure(matmul_n: int = 1024, copy_mb: int = 256, allreduce_mb: int = 64, repeat: int = 3,
            with_allreduce: bool = True) -> Profile:
    """Measure this machine: fp32 matmul TFLOP/s, memcpy GB/s, gloo allreduce GB/s (2 processes).

    Imports torch (only here: the compiler never calls this). Shapes: matmul ``[n, n] @ [n, n]``
    (``2 n^3`` FLOPs); copy of a ``copy_mb`` MB float32 tensor (read + write counted once, as
    memcpy bandwidth is quoted); allreduce of ``allreduce_mb`` MB over a 2-rank gloo group on
    this host (algorithm bandwidth: bytes / seconds). Best of ``repeat``.
    """
    import torch

    a = torch.randn(matmul_n, matmul_n)
    b = torch.randn(matmul_n, matmul_n)
    torch.matmul(a, b)  # warm up (thread pool, caches)
    t = _best(lambda: torch.matmul(a, b), repeat)
    tflops = 2 * matmul_n ** 3 / t / 1e12
    src = torch.empty(copy_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = _best(lambda: dst.copy_(src), repeat)
    memcpy = src.numel() * 4 / t / 1e9
    link = _gloo_allreduce_gbs(allreduce_mb, repeat) if with_allreduce else CPU_FALLBACK.nvlink_gbs
    ram = _ram_gb()
    return replace(CPU_FALLBACK, tflops=round(tflops, 5), hbm_gbs=round(memcpy, 3), nvlink_gbs=round(link, 3),
                   ib_gbs=round(link, 3), pcie_gbs=round(memcpy, 3), hbm_gb=round(ram, 2),
                   memory_total_gb=round(ram, 2),
                   source=f"measured by `flowrl profile` on {platform.node() or 'this host'} "
                          f"({os.cpu_count()} cores) at {time.strftime('%Y-%m-%d %H:%M:%S')}")


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(max(repeat, 1)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return CPU_FALLBACK.memory_total_gb


def _gloo_allreduce_gbs(mb: int, repeat: int) -> float:
    """Allreduce bandwidth of a 2-process gloo group on this host (spawned processes)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, 2, port, mb, repeat, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return result


def _allreduce_worker(rank: int, world: int, port: int, mb: int, repeat: int, queue) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.ones(mb * 2**20 // 4)
        dist.all_reduce(x)
        dist.barrier()
        t = _best(lambda: dist.all_reduce(x), repeat)
        if rank == 0:
            queue.put(x.numel() * 4 / t / 1e9)
    finally:
        dist.destroy_process_group()


__all__ = ["Profile", "PROFILES", "CPU_FALLBACK", "ProfileError", "get_profile", "cpu_profile", "load_profile",
           "save_profile", "profile_path", "measure"]
