"""Per-op time and memory estimates from model size, tokens, layout and a hardware profile.

Units: seconds, bytes (memory records report GB = 1e9 bytes), tokens. ``P`` is the
parameter count, ``wb`` the bytes per weight the engines hold (``Profile.weight_bytes``).

Time
  * **generate**: memory-bandwidth-bound decode: one iteration reads the weights shard
    (``P wb / tp``) and the KV cache of every active sequence, at ``bw_eff`` of HBM peak,
    or is compute-bound (``2 P b / tp`` FLOPs) at large batches; tensor parallelism adds
    two all-reduces of ``b h wb`` bytes per layer. Prefill is compute:
    ``2 P tokens / (tp peak mfu_forward)``.
  * **train** (update): ``6 P tokens`` FLOPs per epoch at ``mfu_train`` over the engine's
    GPUs, stretched by the pipeline bubble ``(pp - 1) / micro-batches``, plus the
    data-parallel gradient all-reduce (ring: ``2 (dp-1)/dp`` of the gradient shard).
  * **logprobs / values**: ``2 P tokens`` FLOPs at ``mfu_forward``.
  * **resync**: bytes over the link the placement implies (same GPU: HBM copy; same node:
    NVLink; across nodes: InfiniBand), the shared disk twice for protocols that go through
    one, a fraction of the bytes for protocols sending what changed (the protocol's record
    says which: ``ProtocolSpec.cost``), plus a fixed latency per bucket, plus the
    trainer-side gather of tensor/pipeline shards.

Memory per GPU, by the engine's memory model (:class:`~flowrl.catalog.engines.MemoryModel`, its
record's ``memory``) and the bytes per parameter of the model's ``dtype`` and ``precision``
(:func:`~flowrl.catalog.precision.train_bytes`: float32 4 + 4 + 8 for weights, gradients and Adam's
moments; mixed bf16 2 + 4 (fp32 master) + 4 + 8; pure bf16 2 + 2 + 4; a flow that names no dtype:
mixed bf16 on GPUs, float32 on the ``cpu`` profile, the profile's ``weight_bytes``)
  * train engines: weights + gradients + optimizer states, sharded by the layout's axes the
    model names (Megatron: weights and gradients by ``tp pp``, optimizer states also by
    ``dp``, the distributed optimizer; FSDP: everything by ``dp``, its ``offload`` option
    moving gradients and optimizer states to the host; plain torch: replicated), +
    activations of one micro-batch (Megatron: selective recompute, ``34 s b h`` bytes per
    layer; FSDP/torch: full activation checkpointing) + fp32 logits of one micro-batch;
  * rollout engines: vLLM/SGLang reserve a fraction of the GPU; within it, the weight
    shard, a workspace, and the KV cache (what is left), which bounds concurrency;
    ``hf_generate`` allocates the KV cache of its batch.

>>> from flowrl.catalog.models import PRESETS
>>> from flowrl.cost.profiles import get_profile
>>> f, h100 = PRESETS["qwen/qwen2.5-7b"], get_profile("H100")
>>> round(train_memory(f, h100, "megatron", tp=2, pp=1, dp=4, micro_batch=1, seq_len=4096).weights_gb, 2)
7.62
"""

from __future__ import annotations

import math

from flowrl.catalog.adapters import ADAPTER_BYTES
from flowrl.catalog.engines import ENGINES, MemoryModel
from flowrl.catalog.models import ModelFacts
from flowrl.catalog.precision import ParamBytes, train_bytes
from flowrl.catalog.protocols import PROTOCOLS
from flowrl.cost.profiles import Profile
from flowrl.plan import Memory

GB = 1e9
ROLLOUT_WORKSPACE_GB = {"gpu": 1.5, "cpu": 0.05}
"""Activation workspace of a rollout engine (vLLM profiles ~1-2 GB on GPUs)."""
SCORE_CALL_S = 5e-4
"""The driver's fixed cost of a score op: handing the batch to its reward worker processes and
back (measured on 2 cores: 0.9 ms for 64 completions)."""
SCORE_S_PER_SAMPLE = 8e-6
"""The driver's cost per scored completion besides the reward's own (its text and answer to a
worker and back, the result's tensor): measured on 2 cores, 3.9-5.6 ms for 512 completions."""
ENV_S_PER_CALL = 5e-3
"""CPU seconds per environment step of one conversation."""
DRIVER_S_PER_SAMPLE = 2e-6
"""Driver-side math (advantages) per sample."""
DELTA_FRACTION = 0.5
"""Bytes a resync sending what changed (``ProtocolSpec.cost == "changed"``) sends, as a fraction of the full weights: RL updates leave most bf16
weights unchanged from one step to the next (70-95% in published measurements); indices
plus values of the changed ones come to about half of a dense copy."""
ACT_BYTES_PER_LAYER = 34
"""Activation bytes per token per hidden unit per layer with bf16 activations (Korthikanti et
al. 2022, selective recompute with sequence parallelism)."""


# ---- memory -------------------------------------------------------------------------------------


def _shards(axes: tuple[str, ...], sizes: dict[str, int]) -> int:
    return math.prod(sizes[a] for a in axes)


def train_memory(f: ModelFacts, hw: Profile, kind: str, *, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1,
                 ep: int = 1, trainable: bool = True, micro_batch: int = 1, seq_len: int = 1024, offload: bool = False,
                 n_micro: int | None = None, trained_params: int | None = None,
                 param_bytes: ParamBytes | None = None) -> Memory:
    """Memory per GPU of a train engine ``kind`` (an engine name; its record's memory model).

    ``micro_batch`` is sequences per micro-batch, ``seq_len`` tokens per sequence (prompt +
    response), ``n_micro`` the micro-batches per step (for the pipeline's in-flight count),
    ``offload`` the engine's option keeping gradients and optimizer states in host memory.
    A frozen model (``trainable=False``) holds weights and one layer of activations only.
    A mixture of experts' expert weights are divided by the memory model's ``experts_by`` axes
    (Megatron: pp x ``ep``, each rank holding experts / ep whole experts) when it names them.
    ``trained_params``: the parameters that train when not all do (LoRA adapters,
    :func:`~flowrl.catalog.adapters.lora_params`): only they have gradients and Adam states, and they
    are fp32 themselves (:data:`~flowrl.catalog.adapters.ADAPTER_BYTES`: no master copy); the frozen
    base weights are held as weights only.
    ``param_bytes``: bytes per parameter of the model's dtype and precision
    (:func:`~flowrl.catalog.precision.train_bytes`); None: the profile's (mixed precision where its
    ``weight_bytes`` is 2, float32 where it is 4). The fp32 master weights count with the optimizer
    states, except where the memory model's ``sharded_masters`` says the sharded parameters are the
    masters (FSDP2's mixed precision: fp32 shards, layers gathered in the 16-bit dtype).
    """
    mm: MemoryModel = ENGINES[kind].memory_model
    pb = param_bytes or train_bytes("float32" if hw.weight_bytes >= 4 else "bfloat16")
    P, wb = f.params, pb.weights
    held_bytes, master = wb, pb.master  # bytes of each held parameter; of each master in the optimizer
    if mm.sharded_masters and master and trainable:  # a frozen model keeps no masters
        held_bytes, master = master, 0
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
    w_shard, o_shard = _shards(mm.weights_by, sizes), _shards(mm.optimizer_by, sizes)
    # parameters held per rank, as if unsharded (x 1/w_shard) and in the optimizer (x 1/o_shard)
    held, optimized = float(P), float(P)
    if f.expert_params and mm.experts_by is not None:
        E = f.expert_params
        held = P - E + E * w_shard / _shards(mm.experts_by, sizes)
        optimized = P - E + E * o_shard / _shards(mm.expert_optimizer_by or mm.optimizer_by, sizes)
    weights = held * held_bytes / w_shard
    if mm.gathered_layers and w_shard > 1:
        weights += mm.gathered_layers * f.layer_params * wb  # layers gathered whole at a time (prefetch)
    grads = optim = 0.0
    if trainable:
        if trained_params is None:
            grads = held * pb.grads / w_shard
            optim = optimized * (pb.states + master) / o_shard
        else:  # adapters: fp32 weights beside the frozen base's, fp32 gradients, Adam's two moments
            weights += trained_params * ADAPTER_BYTES / w_shard
            grads = trained_params * 4 / w_shard
            optim = trained_params * 8 / o_shard
        if mm.offload_option and offload:
            grads = optim = 0.0
    s, b, h = seq_len, micro_batch, f.hidden
    per_layer = ACT_BYTES_PER_LAYER * s * b * h * (wb / 2)
    if not trainable:
        act = per_layer / (tp * cp)
    elif mm.activations == "selective":
        in_flight = min(pp, n_micro or pp)
        act = per_layer * (f.layers / pp) * in_flight / (tp * cp)
    else:  # full activation checkpointing: each layer's input, plus one layer recomputed
        act = (2 * s * b * h * (wb / 2) * f.layers + per_layer) / cp
    logits = s * b * f.vocab * 4 / tp * (2 if trainable else 1)
    return Memory(weights / GB, grads / GB, optim / GB, act / GB, other_gb=(logits / GB + hw.context_gb))


def rollout_memory(f: ModelFacts, hw: Profile, kind: str, *, tp: int = 1, options: dict | None = None,
                   seq_len: int = 1024, batch: int = 1) -> Memory:
    """Memory per GPU of a rollout engine ``kind``: its reservation, weight shard, workspace, KV cache.

    An engine that reserves memory (vLLM: ``gpu_memory_utilization`` x memory, SGLang:
    ``mem_fraction``; its record's ``memory_option``) holds as KV cache what weights and
    workspace leave, except on the ``cpu`` platform where its record fixes the KV cache
    (``cpu_kv_cache_gib``: vLLM's ``VLLM_CPU_KVCACHE_SPACE``); one allocating on demand (``hf_generate``) needs the KV of its whole
    ``batch`` at ``seq_len`` tokens.
    """
    spec = ENGINES[kind]
    opts = options or {}
    weights = f.params * hw.weight_bytes / tp / GB
    work = ROLLOUT_WORKSPACE_GB[hw.kind] + hw.context_gb
    kv_tok = kv_bytes_per_token_per_gpu(f, hw, tp)
    if spec.memory_model.kv_cache != "reserved":
        kv = kv_tok * seq_len * batch / GB
        return Memory(weights, kv_cache_gb=kv, other_gb=work, kv_tokens=seq_len * batch)
    if hw.platform == "cpu" and spec.cpu_kv_cache_gib is not None:  # a fixed KV cache in host memory
        kv = spec.cpu_kv_cache_gib * 2**30 / GB
        return Memory(weights, kv_cache_gb=kv, other_gb=work, reserved_gb=weights + work + kv,
                      kv_tokens=int(kv * GB / kv_tok))
    knob = spec.memory_option
    util = float(opts.get(knob, spec.options[knob].default))
    reserved = util * hw.hbm_gb
    kv = max(reserved - weights - work, 0.0)
    return Memory(weights, kv_cache_gb=kv, other_gb=work, reserved_gb=reserved, kv_tokens=int(kv * GB / kv_tok))


def kv_bytes_per_token_per_gpu(f: ModelFacts, hw: Profile, tp: int) -> float:
    """KV bytes one token takes on one GPU: KV heads are split by tp (replicated when tp > heads)."""
    heads_here = max(f.kv_heads / tp, 1.0)
    return 2 * f.layers * heads_here * f.hd * hw.weight_bytes


def concurrency(mem: Memory, seq_len: int, hw: Profile) -> int:
    """Sequences a rollout replica can run at once: KV capacity / sequence length, capped."""
    if seq_len <= 0:
        return hw.max_num_seqs
    return int(min(hw.max_num_seqs, mem.kv_tokens // seq_len))


# ---- time ---------------------------------------------------------------------------------------


def decode_iter_s(f: ModelFacts, hw: Profile, *, tp: int, batch: int, context: float) -> float:
    """Seconds of one decode iteration of a replica with ``batch`` active sequences of
    ``context`` tokens on average: max(memory time, compute time) + tensor-parallel
    all-reduces + the engine's overhead per iteration (fixed, and per active sequence)."""
    batch = max(batch, 1)
    weight_bytes = f.params * hw.weight_bytes / tp
    kv_bytes = batch * context * kv_bytes_per_token_per_gpu(f, hw, tp)
    t_mem = (weight_bytes + kv_bytes) / (hw.hbm_gbs * GB * hw.bw_eff)
    t_flops = 2 * f.active_params * batch / (tp * hw.tflops * 1e12 * hw.mfu_forward)
    t_comm = 0.0
    if tp > 1:
        per_layer = batch * f.hidden * hw.weight_bytes * 2 * (tp - 1) / tp
        t_comm = 2 * f.layers * (per_layer / (hw.nvlink_gbs * GB * hw.link_eff) + hw.latency_s)
    return max(t_mem, t_flops) + t_comm + hw.iter_overhead_s + hw.seq_overhead_s * batch


def decode_iter_parts(f: ModelFacts, hw: Profile, *, tp: int, batch: int, context: float) -> tuple[float, float]:
    """``(fixed, per sequence)`` seconds of a decode iteration: :func:`decode_iter_s` as a line
    through batch 1 and ``batch`` (exact where one of memory or compute time dominates), so the
    simulator can charge an iteration for the sequences actually running in it."""
    one = decode_iter_s(f, hw, tp=tp, batch=1, context=context)
    if batch <= 1:
        return one - hw.seq_overhead_s, hw.seq_overhead_s
    per = (decode_iter_s(f, hw, tp=tp, batch=batch, context=context) - one) / (batch - 1)
    return one - per, per


def prefill_s(f: ModelFacts, hw: Profile, *, tp: int, tokens: float) -> float:
    """Seconds to prefill ``tokens`` prompt tokens on one replica (compute-bound; a mixture of
    experts' token multiplies by the experts it is routed to: ``active_params``)."""
    return 2 * f.active_params * tokens / (tp * hw.tflops * 1e12 * hw.mfu_forward)


def pipeline_bubble(pp: int, n_micro: int) -> float:
    """1F1B pipeline stretch factor: ``1 + (pp - 1) / micro-batches``."""
    return 1.0 + (pp - 1) / max(n_micro, 1)


def forward_s(f: ModelFacts, hw: Profile, *, world: int, tokens: float, pp: int = 1, n_micro: int = 1) -> float:
    """Seconds of a forward pass over ``tokens`` tokens on ``world`` GPUs (log-probs, values)."""
    t = 2 * f.active_params * tokens / (world * hw.tflops * 1e12 * hw.mfu_forward)
    return t * pipeline_bubble(pp, n_micro) + hw.op_overhead_s


def train_s(f: ModelFacts, hw: Profile, *, kind: str, tp: int, pp: int, dp: int, cp: int, tokens: float,
            epochs: int = 1, n_micro: int = 1, dp_inter_node: bool = False) -> float:
    """Seconds of one update (``epochs`` passes of forward+backward+optimizer over ``tokens``,
    in ``n_micro`` micro-batches per pass, each with the profile's fixed ``micro_overhead_s``)."""
    world = tp * pp * dp * cp
    t = 6 * f.active_params * tokens * epochs / (world * hw.tflops * 1e12 * hw.mfu_train)
    t *= pipeline_bubble(pp, n_micro)
    if dp > 1:  # gradient all-reduce (ring) of each rank's gradient shard, once per step
        shard = f.params * (2 if hw.kind == "gpu" else 4) / (tp * pp)
        link = hw.ib_gbs if dp_inter_node else hw.nvlink_gbs
        t += 2 * (dp - 1) / dp * shard / (link * GB * hw.link_eff) + 2 * hw.latency_s
    return t + hw.op_overhead_s + hw.micro_overhead_s * max(n_micro, 1) * epochs


def gather_s(f: ModelFacts, hw: Profile, *, shards: int, inter_node: bool = False) -> float:
    """Seconds to all-gather weights held in ``shards`` tensor/pipeline shards (before a resync)."""
    if shards <= 1:
        return 0.0
    link = hw.ib_gbs if inter_node else hw.nvlink_gbs
    return f.params * hw.weight_bytes * (shards - 1) / shards / (link * GB * hw.link_eff)


ROUTE_LINK = {"local": "hbm_gbs", "intra-node": "nvlink_gbs", "inter-node": "ib_gbs"}
"""Which profile figure bounds a transfer along each route."""


def transfer_s(nbytes: float, hw: Profile, *, protocol: str, route: str, buckets: int) -> float:
    """Seconds to move ``nbytes`` of weights trainer -> rollout engine (after any gather), as
    ``protocol``'s record says it moves them (``ProtocolSpec.cost``): ``link`` streams over the
    route's link (a copy on the device for ``local``); ``disk`` writes then reads the shared
    disk; ``changed`` sends :data:`DELTA_FRACTION` of the bytes over the link.
    """
    cost = PROTOCOLS[protocol].cost
    # Two engine calls whatever the protocol, export/pack on the trainer and load on the replicas,
    # but submitted together (``Fleet.push_weights``): their dispatches overlap and the driver waits
    # once, so the resync pays one call's ``op_overhead_s`` (0 on GPU profiles, a Ray round trip with
    # its payload on CPU). Measured on CPU: resyncs of 20-31 ms where two calls' overhead alone was 40.
    calls = hw.op_overhead_s
    if cost == "disk":
        return 2 * nbytes / (hw.disk_gbs * GB) + buckets * hw.latency_s + calls
    bw = getattr(hw, ROUTE_LINK.get(route, "ib_gbs"))
    eff = hw.bw_eff if route == "local" else hw.link_eff
    if cost == "changed":
        nbytes = nbytes * DELTA_FRACTION  # diffing against the last sent copy is on-device: negligible
    return nbytes / (bw * GB * eff) + buckets * hw.latency_s + calls


def offload_s(gb: float, hw: Profile) -> float:
    """Seconds to move ``gb`` between device and host (colocated engines sleeping / waking)."""
    return gb * GB / (hw.pcie_gbs * GB) if gb > 0 else 0.0


def reward_s(per_sample_s: float, samples: int, workers: int = 2) -> float:
    """CPU seconds to score ``samples`` completions at ``per_sample_s`` each (the reward op's
    ``seconds_per_item``, 0 for a reward served by a model's engine, costed on that engine) with
    ``workers`` processes."""
    return per_sample_s * samples / max(workers, 1)


def score_call_s(samples: int, dispatch_s: float = 0.0) -> float:
    """The driver's seconds around a score op's rewards (:data:`SCORE_CALL_S`, :data:`SCORE_S_PER_SAMPLE`),
    plus ``dispatch_s`` where a model's engine serves the reward (a reward model, a judge: the
    profile's ``op_overhead_s``); a verifier's worker processes are not engines."""
    return SCORE_CALL_S + SCORE_S_PER_SAMPLE * samples + dispatch_s


def ceil_div(a: int, b: int) -> int:
    return -(-a // max(b, 1))


def lognormal_mean(median: float, sigma: float) -> float:
    """Mean of a lognormal with this median and log-space sigma."""
    return median * math.exp(sigma * sigma / 2)


__all__ = ["Memory", "train_memory", "rollout_memory", "concurrency", "decode_iter_s", "decode_iter_parts", "prefill_s",
           "forward_s", "train_s", "gather_s", "transfer_s", "offload_s", "reward_s", "pipeline_bubble",
           "kv_bytes_per_token_per_gpu", "GB"]
