"""Hardware profiles by name, and measuring this machine's (``flowrl profile``).

The profiles themselves (data-sheet figures of every GPU kind, the CPU fallback) are
catalogue data: :mod:`flowrl.catalog.hardware`.

``cpu`` is this machine, measured by
``flowrl profile`` (:func:`measure`) and read from ``$FLOWRL_PROFILE`` or
``$FLOWRL_CACHE/profile.json`` (default ``~/.cache/flowrl/profile.json``); until it is
measured, conservative figures for a 2-core x86 machine stand in (``source`` says so).

>>> p = get_profile("H100")
>>> p.tflops, p.hbm_gb, p.hbm_gbs
(989.0, 80.0, 3350.0)
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import time
from dataclasses import fields, replace
from pathlib import Path

from flowrl.cache import cache_root
from flowrl.catalog.hardware import CPU_FALLBACK, PROFILES, Profile
from flowrl.cost.trainbench import engine_rates


MEASURES_WITH = "torch"
"""The package every measurement of this machine imports (the compiler alone runs without it)."""


def can_measure() -> bool:
    """Whether this machine can be measured here: :data:`MEASURES_WITH` is installed."""
    return importlib.util.find_spec(MEASURES_WITH) is not None


class ProfileError(ValueError):
    """An unknown profile name or an unreadable profile file."""


def profile_path() -> Path:
    """``$FLOWRL_PROFILE``, else ``$FLOWRL_CACHE/profile.json``, else ``~/.cache/flowrl/profile.json``."""
    if os.environ.get("FLOWRL_PROFILE"):
        return Path(os.environ["FLOWRL_PROFILE"])
    return cache_root() / "profile.json"


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
    # a profile file written before profiles had a platform reads as the default (cuda): `cpu` is cpu
    return replace(base, hbm_gb=round(total / max(gpus_per_node, 1), 3), kind="cpu", platform="cpu")


def get_profile(name: str, gpus_per_node: int = 1) -> Profile:
    """The profile of a cluster's ``gpu`` option: a GPU kind of :data:`PROFILES`, or ``cpu``."""
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
            with_allreduce: bool = True, with_engine: bool = True) -> Profile:
    """Measure this machine: fp32 matmul TFLOP/s, memcpy GB/s, gloo allreduce GB/s (2 processes), and
    what a train engine achieves of that matmul (:func:`~flowrl.cost.trainbench.engine_rates`).

    Imports torch (only here: the compiler never calls this). Shapes: matmul ``[n, n] @ [n, n]``
    (``2 n^3`` FLOPs); copy of a ``copy_mb`` MB float32 tensor (read + write counted once, as
    memcpy bandwidth is quoted); allreduce of ``allreduce_mb`` MB over a 2-rank gloo group on
    this host (algorithm bandwidth: bytes / seconds). Best of ``repeat``. Without ``with_engine``,
    the engine's figures are :data:`CPU_FALLBACK`'s.
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
    engine = engine_rates(tflops) if with_engine else {}
    return replace(CPU_FALLBACK, **engine, tflops=round(tflops, 5), hbm_gbs=round(memcpy, 3),
                   nvlink_gbs=round(link, 3), ib_gbs=round(link, 3), pcie_gbs=round(memcpy, 3), hbm_gb=round(ram, 2),
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
    from flowrl.runtime.environment import environ_for

    with environ_for("tool"):  # the scrubbed environment: no secret reaches the benchmark's workers
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
           "save_profile", "profile_path", "measure", "MEASURES_WITH", "can_measure"]
