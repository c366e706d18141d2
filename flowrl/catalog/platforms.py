"""Platforms a schedule can target, and which hardware profile belongs to which.

A schedule's ``cluster(gpu = NAME)`` names a hardware profile (:mod:`flowrl.cost.profiles`);
its platform decides which engines, protocols and options can run. ``cpu`` is a cluster of
logical GPUs on CPU machines (gloo, no CUDA); ``cuda`` NVIDIA GPUs; ``rocm`` AMD GPUs.

>>> PLATFORMS
('cpu', 'cuda', 'rocm')
"""

from __future__ import annotations

PLATFORMS = ("cpu", "cuda", "rocm")

PLATFORM_DOC = {
    "cpu": "logical GPUs on CPU machines (gloo collectives, no CUDA): what tests and laptops run",
    "cuda": "NVIDIA GPUs (NCCL collectives, CUDA IPC, vLLM/SGLang sleep mode)",
    "rocm": "AMD GPUs (RCCL through torch's nccl backend, HIP)",
}

__all__ = ["PLATFORMS", "PLATFORM_DOC"]
