"""Platforms a schedule can target, and which hardware profile belongs to which.

A schedule's ``cluster(gpu = NAME)`` names a hardware profile (:mod:`flowrl.cost.profiles`);
its platform decides which engines, protocols and options can run. ``cpu`` is a cluster of
logical GPUs on CPU machines (gloo, no CUDA); ``cuda`` NVIDIA GPUs; ``rocm`` AMD GPUs.

>>> PLATFORMS
('cpu', 'cuda', 'rocm')
>>> "nccl" in TRANSPORTS["cpu"]
False
"""

from __future__ import annotations

PLATFORMS = ("cpu", "cuda", "rocm")

PLATFORM_DOC = {
    "cpu": "logical GPUs on CPU machines (gloo collectives, no CUDA): what tests and laptops run",
    "cuda": "NVIDIA GPUs (NCCL collectives, CUDA IPC, vLLM/SGLang sleep mode)",
    "rocm": "AMD GPUs (RCCL through torch's nccl backend, HIP)",
}

TRANSPORTS: dict[str, frozenset[str]] = {
    "cpu": frozenset({"gloo", "ray", "shm", "disk"}),
    "cuda": frozenset({"nccl", "gloo", "ray", "shm", "disk", "cuda_ipc"}),
    "rocm": frozenset({"nccl", "gloo", "ray", "shm", "disk"}),
}
"""Platform -> what can move weight bytes there: torch.distributed backends (``nccl`` needs CUDA or
ROCm GPUs: RCCL answers to torch's ``nccl`` backend; ``gloo`` runs on host memory anywhere), Ray's
object store (``ray``), shared memory (``shm``), CUDA IPC handles to device memory (``cuda_ipc``)
and a shared disk (``disk``). A weight-sync
protocol's transport on a platform (:attr:`~flowrl.catalog.protocols.ProtocolSpec.transport`)
must be one of these: the compiler refuses one that is not (E445), and the runtime refuses a plan
whose transport the machine it runs on lacks (a plan for GPUs run on a CPU machine)."""

__all__ = ["PLATFORMS", "PLATFORM_DOC", "TRANSPORTS"]
