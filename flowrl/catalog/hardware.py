"""Hardware profiles: what one accelerator (and its links) can do, in public figures.

One record per device kind a schedule's ``cluster(gpu = NAME)`` names, from the vendors' data
sheets (SXM/OAM parts where there are several; dense bf16 tensor TFLOP/s without sparsity;
device memory and its bandwidth; GPU-to-GPU bandwidth inside a node per GPU in one direction
(PCIe where a part has no NVLink); one network NIC per GPU). ``cpu`` is measured on the
machine by ``flowrl profile`` (:mod:`flowrl.cost.profiles`); :data:`CPU_FALLBACK` stands in
until then. Efficiency factors turn peaks into achievable figures; they live here, with the
hardware they describe, so that the cost model has no magic numbers.

>>> PROFILES["H100"].tflops, PROFILES["MI300X"].platform
(989.0, 'rocm')
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    platform: str = "cuda"
    """What runs on it (:data:`~flowrl.catalog.platforms.PLATFORMS`): ``cpu``, ``cuda`` or ``rocm``."""

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
    Profile("A800", "gpu", tflops=312.0, hbm_gb=80.0, hbm_gbs=2039.0, nvlink_gbs=200.0, ib_gbs=25.0,
            pcie_gbs=32.0, source="NVIDIA A800 80GB SXM data sheet (A100 compute and HBM2e 2.0 TB/s, "
                                  "NVLink 400 GB/s bidirectional)"),
    Profile("H800", "gpu", tflops=989.0, hbm_gb=80.0, hbm_gbs=3350.0, nvlink_gbs=200.0, ib_gbs=50.0,
            pcie_gbs=64.0, source="NVIDIA H800 SXM (H100 compute and HBM3 3.35 TB/s, NVLink 400 GB/s "
                                  "bidirectional, NDR 400 Gb/s)"),
    Profile("H20", "gpu", tflops=148.0, hbm_gb=96.0, hbm_gbs=4000.0, nvlink_gbs=450.0, ib_gbs=50.0,
            pcie_gbs=64.0, source="NVIDIA H20 data sheet (bf16 dense 148 TFLOP/s, HBM3 96 GB 4.0 TB/s, "
                                  "NVLink 900 GB/s bidirectional)"),
    Profile("B200", "gpu", tflops=2250.0, hbm_gb=180.0, hbm_gbs=8000.0, nvlink_gbs=900.0, ib_gbs=50.0,
            pcie_gbs=64.0, source="NVIDIA DGX/HGX B200 data sheet (bf16 dense 2.25 PFLOP/s per GPU, HBM3e 180 GB "
                                  "8 TB/s, NVLink5 1.8 TB/s bidirectional, ConnectX-7 400 Gb/s)"),
    Profile("L4", "gpu", tflops=121.0, hbm_gb=24.0, hbm_gbs=300.0, nvlink_gbs=32.0, ib_gbs=12.5,
            pcie_gbs=32.0, max_num_seqs=128,
            source="NVIDIA L4 data sheet (bf16 dense 121 TFLOP/s, GDDR6 24 GB 300 GB/s, PCIe Gen4 x16, no NVLink; "
                   "GPU-to-GPU over PCIe; 100 Gb/s networking assumed)"),
    Profile("L40S", "gpu", tflops=362.0, hbm_gb=48.0, hbm_gbs=864.0, nvlink_gbs=32.0, ib_gbs=25.0,
            pcie_gbs=32.0, source="NVIDIA L40S data sheet (bf16 dense 362 TFLOP/s, GDDR6 48 GB 864 GB/s, "
                                  "PCIe Gen4 x16, no NVLink; 200 Gb/s networking assumed)"),
    Profile("A10G", "gpu", tflops=125.0, hbm_gb=24.0, hbm_gbs=600.0, nvlink_gbs=32.0, ib_gbs=12.5,
            pcie_gbs=32.0, max_num_seqs=128,
            source="NVIDIA A10 data sheet (A10G is its cloud variant: bf16 dense 125 TFLOP/s, GDDR6 24 GB 600 GB/s, "
                   "PCIe Gen4, no NVLink; 100 Gb/s networking assumed)"),
    Profile("RTX4090", "gpu", tflops=165.0, hbm_gb=24.0, hbm_gbs=1008.0, nvlink_gbs=25.0, ib_gbs=3.0,
            pcie_gbs=32.0, max_num_seqs=128,
            source="NVIDIA Ada whitepaper, GeForce RTX 4090 (bf16 dense with fp32 accumulate 165 TFLOP/s, "
                   "GDDR6X 24 GB 1008 GB/s, PCIe Gen4, no NVLink or P2P; 25 Gb/s Ethernet assumed)"),
    Profile("MI300X", "gpu", tflops=1307.0, hbm_gb=192.0, hbm_gbs=5300.0, nvlink_gbs=448.0, ib_gbs=50.0,
            pcie_gbs=64.0, platform="rocm",
            source="AMD Instinct MI300X data sheet (bf16 dense 1307 TFLOP/s, HBM3 192 GB 5.3 TB/s, Infinity Fabric "
                   "896 GB/s aggregate bidirectional, 400 Gb/s NIC)"),
)}

CPU_FALLBACK = Profile(
    "cpu", "cpu", tflops=0.05, hbm_gb=8.0, hbm_gbs=5.0, nvlink_gbs=1.0, ib_gbs=0.5, pcie_gbs=5.0,
    weight_bytes=4, platform="cpu", mfu_train=0.3, mfu_forward=0.4, bw_eff=0.5, link_eff=0.8, latency_s=1e-3,
    context_gb=0.0, disk_gbs=0.5, max_num_seqs=256, op_overhead_s=0.02, iter_overhead_s=2e-3, seq_overhead_s=1e-4,
    request_overhead_s=1e-4, memory_total_gb=16.0,
    source="default figures for a small x86 machine: run `flowrl profile` to measure this one")
"""Used for ``gpu = "cpu"`` until ``flowrl profile`` has measured the machine; the automatic profile
(:mod:`flowrl.cost.autoprofile`) measures its matmul and memcpy and what the train engine reaches of that
matmul (``mfu_forward``, ``mfu_train``, ``micro_overhead_s``: :mod:`flowrl.cost.trainbench`), and keeps
the rest. The overheads are Python's and were measured on a 2-core x86 machine (2026-12-04), where they
dominate a tiny model's ops:

* ``op_overhead_s`` 20 ms: a Ray round trip and the driver's handling (the driver's span of an engine
  op less the engine's: 6-9 ms) plus the engine's work outside the model (its span less the model's
  forward at the same batch: ~10 ms, rebuilding the batch's tensors and returning results);
* ``seq_overhead_s`` 100 us per sequence per decode iteration of vLLM on CPU (sampling, log-probs,
  detokenising, scheduling; 92 us timed on the engine alone from 64 to 512 sequences, 101 us fitted from
  runs), ``iter_overhead_s`` 2 ms and ``request_overhead_s`` 100 us (each 0.1-5 ms and 0-250 us in
  the same fits: small next to the per-sequence cost)."""


__all__ = ["Profile", "PROFILES", "CPU_FALLBACK"]
