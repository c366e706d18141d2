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
                       backend: str = "gloo"):
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
                         timeout_s=60)
    outcomes = []
    for _ in range(syncs):
        try:
            pairs = list(sync.receive())
            outcomes.append(("ok", sync.version, digest(pairs), sync.stats.buckets))
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


# ---- resharding: independent, loop-based references for each layout ----------------------------------
def canonical_llama(dims, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random transformers-named weights of a Llama-style model with ``dims`` (a LlamaDims)."""
    from flowrl.runtime.reshard import Layout, plan_reshard

    g = torch.Generator().manual_seed(seed)
    shapes = {}
    for move in plan_reshard(dims, Layout("hf", 1), Layout("hf", 1)).moves:
        for s in move.sources:
            shapes[s.name] = s.shard_shape
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t.narrow(0, start, count)


def reference_shards(hf: dict[str, torch.Tensor], dims, style: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of a ``style`` engine at tensor-parallel ``tp`` holds, written out head by head."""
    hd, qpg = dims.head_dim, dims.heads // dims.kv_heads
    out = {}

    def chunk(t, dim):
        size = t.shape[dim] // tp
        return t.narrow(dim, rank * size, size).clone()

    for name, t in hf.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias",
                          "v_proj.bias", "gate_proj.weight", "up_proj.weight")) and style != "hf":
            continue  # fused below
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        part = t.clone() if "norm" in name else chunk(t, dim)
        out[_rename(name, style)] = part
    if style == "hf":
        return out
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if dims.attention_bias else ("weight",):
            q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
            if style == "vllm":
                heads, groups = dims.heads // tp, dims.kv_heads // tp
                fused = torch.cat([_rows(q, rank * heads * hd, heads * hd), _rows(k, rank * groups * hd, groups * hd),
                                   _rows(v, rank * groups * hd, groups * hd)])
                out[f"{p}self_attn.qkv_proj.{kind}"] = fused
            else:  # megatron: for each query group of this rank, its q heads then its k head then its v head
                blocks = []
                for grp in range(rank * dims.kv_heads // tp, (rank + 1) * dims.kv_heads // tp):
                    blocks += [_rows(q, grp * qpg * hd, qpg * hd), _rows(k, grp * hd, hd), _rows(v, grp * hd, hd)]
                out[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = torch.cat(blocks)
        gate, up = hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]
        name = f"{p}mlp.gate_up_proj.weight" if style == "vllm" else f"decoder.layers.{i}.mlp.linear_fc1.weight"
        out[name] = torch.cat([chunk(gate, 0), chunk(up, 0)])
    return out


_MEGATRON = [("model.embed_tokens.", "embedding.word_embeddings."), ("model.norm.", "decoder.final_layernorm."),
             ("lm_head.", "output_layer."), ("model.layers.", "decoder.layers."),
             ("self_attn.o_proj.", "self_attention.linear_proj."), ("mlp.down_proj.", "mlp.linear_fc2."),
             ("post_attention_layernorm.", "pre_mlp_layernorm.")]


def _rename(name: str, style: str) -> str:
    if style != "megatron":
        return name
    for a, b in _MEGATRON:
        name = name.replace(a, b)
    return name


def reshard_worker(rank: int, world: int, init_file: str, dims, cases: list[tuple]) -> list[tuple]:
    """Run ``execute_reshard`` for each ``(src style, src tp, dst style, dst tp)`` and back again.

    Returns per case ``(matches the reference of dst, round trip equals the source)`` for this rank.
    """
    import torch.distributed as dist

    from flowrl.runtime.reshard import Layout, execute_reshard, plan_reshard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    hf = canonical_llama(dims)
    results = []
    for s_style, s_tp, d_style, d_tp in cases:
        src = reference_shards(hf, dims, s_style, s_tp, rank) if rank < s_tp else {}
        out = execute_reshard(plan_reshard(dims, Layout(s_style, s_tp), Layout(d_style, d_tp)), src)
        expected = reference_shards(hf, dims, d_style, d_tp, rank) if rank < d_tp else {}
        back = execute_reshard(plan_reshard(dims, Layout(d_style, d_tp), Layout(s_style, s_tp)), out)
        results.append((_equal(out, expected), _equal(back, src)))
    dist.destroy_process_group()
    return results


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
