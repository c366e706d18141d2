"""Weight-sync benchmark: each protocol's bytes/s against the raw transport, measured in one run.

A synthetic Llama-shaped model (about ``--mb`` MB of weights in ``--dtype``, ~9
tensors per layer plus embeddings) is synced from a sender (this process, rank 0)
to ``--receivers`` spawned processes. Every measurement is the time from a common
barrier until the last rank is done (median of ``--reps`` after one warm-up). The rows run in
rounds, each row once per round, so that a row and the raw broadcast it is compared with meet the
same load; the headline ratio is the median over rounds of raw / packed time:

| row | what moves |
|---|---|
| ``raw broadcast`` | one broadcast of a single buffer of the model's bytes over the same gloo/NCCL group kind: the transport's bandwidth, the 100% line |
| ``per-tensor broadcast`` | one broadcast per tensor (shapes known in advance), no checksums: the naive way |
| ``broadcast packed+overlap`` | :class:`BroadcastSync` from weights homed in its messages (``BroadcastSync.home``, as a CPU torch trainer's are): each bucket checksummed and sent where the weights live, bucket i+1 checksummed while i is sent, verified on arrival |
| ``broadcast packed+overlap, copied`` | the same from weights that are not homed (a gathered FSDP or Megatron model, a GPU trainer): copied into buckets first |
| ``broadcast packed, serial`` | the copied one without the background threads |
| ``delta (10% changed)`` | :class:`DeltaSync` over broadcast after a tenth of the tensors changed (effective: full model bytes / time) |
| ``raw file write+read`` | one file of the model's bytes written by the sender and read by the receivers (tmpfs if present) |
| ``checkpoint`` | :class:`CheckpointSync`: safetensors + manifest, atomic publish, each tensor verified on read |
| ``raw object store`` / ``inplace`` | with Ray: one numpy buffer, then :class:`InPlaceSync` buckets, trainer actor -> object store -> replica actors (the ref passes through the driver, the bytes do not) |

``bytes/s`` is the model's bytes divided by the time; ``vs raw broadcast`` compares it
with the first row; ``vs own transport`` compares checkpoint with the raw file row and
inplace with the raw object-store row. ``CPU s`` is the CPU time of every rank's process
(all threads) per sync, median over reps, and ``raw CPU / CPU`` the raw broadcast's over the
row's: on a machine whose cores other work keeps busy the wall times follow the load, the
CPU seconds much less. Prints a table and writes
``bench/results/weight_sync.json``.

Usage::

    .venv/bin/python bench/weight_sync.py [--mb 256] [--bucket-mb 32] [--receivers 1] [--reps 7] [--no-ray]

Acceptance target: packed broadcast >= 80% of the raw broadcast's bytes/s.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flowrl.runtime.sync import BroadcastSync, CheckpointSync, DeltaSync, InPlaceSync  # noqa: E402
from flowrl.runtime.sync.broadcast import BACKENDS, default_backend  # noqa: E402

ROWS = ["raw broadcast", "per-tensor broadcast", "broadcast packed+overlap", "broadcast packed+overlap, copied",
        "broadcast packed, serial", "delta (10% changed)", "raw file write+read", "checkpoint"]
"""Measurements made over the process group, in the order every rank runs them."""

CHANGED_EVERY = 10
"""Delta row: every 10th tensor changes between syncs."""


# ---- the model --------------------------------------------------------------------------------------
def model_shapes(mb: float, dtype: torch.dtype, hidden: int = 512) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama-like model of about ``mb`` MB: GQA attention (4 KV groups), SwiGLU MLP."""
    inter, vocab, kv = hidden * 11 // 4, 8192, hidden // 4
    size = torch.tensor([], dtype=dtype).element_size()
    layer = [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
             ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
             ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
             ("mlp.down_proj.weight", (hidden, inter)), ("input_layernorm.weight", (hidden,)),
             ("post_attention_layernorm.weight", (hidden,))]
    per_layer = sum(int(np.prod(s)) for _, s in layer) * size
    fixed = 2 * vocab * hidden * size + hidden * size
    layers = max(1, round((mb * 2**20 - fixed) / per_layer))
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    shapes += [(f"model.layers.{i}.{n}", s) for i in range(layers) for n, s in layer]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def make_model(shapes, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(n, torch.randn(*s, generator=g).to(dtype)) for n, s in shapes]


def nbytes(model) -> int:
    return sum(t.numel() * t.element_size() for _, t in model)


# ---- the raw transport ------------------------------------------------------------------------------
class RawGroup:
    """A standalone group of the same kind BroadcastSync builds: the transport without our protocol."""

    def __init__(self, rank: int, world: int, backend: str, port: int = 0):
        timeout = datetime.timedelta(seconds=600)
        self.rank = rank
        self.store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout, wait_for_workers=False)
        self.port = int(self.store.port)
        self.world, self.backend, self.timeout = world, backend, timeout
        self.pg = None

    def connect(self) -> None:
        self.pg, self.device = BACKENDS[self.backend](dist.PrefixStore("raw", self.store), self.rank, self.world,
                                                      self.timeout)

    def bcast(self, t: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([t], options).wait()

    def barrier(self) -> None:
        self.bcast(torch.zeros(1, device=self.device))  # a tiny broadcast is a barrier for rank 0 -> others


# ---- one rank's part of each row --------------------------------------------------------------------
def run_rows(rank: int, raw: RawGroup, syncs: dict, model, ckpt_dir: Path, reps: int, out: dict) -> None:
    """Every rank runs the same rows in the same order; ``out[row]`` gets this rank's seconds per rep."""
    total = nbytes(model)
    flat = torch.empty(total, dtype=torch.uint8, device=raw.device)
    if rank == 0:
        flat.copy_(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in model]))
    raw_file = ckpt_dir / "raw.bin"
    actions = {
        "raw broadcast": lambda rep: raw.bcast(flat),
        "per-tensor broadcast": lambda rep: per_tensor(rank, raw, model),
        "broadcast packed+overlap": lambda rep: transfer(rank, syncs["overlap"], model, rep),
        "broadcast packed+overlap, copied": lambda rep: transfer(rank, syncs["copied"], model, rep),
        "broadcast packed, serial": lambda rep: transfer(rank, syncs["serial"], model, rep),
        "delta (10% changed)": lambda rep: delta(rank, syncs["delta"], model, rep),
        "raw file write+read": lambda rep: file_row(rank, raw, flat, raw_file),
        "checkpoint": lambda rep: checkpoint_row(rank, raw, syncs["checkpoint"], model, rep),
    }
    for row in ROWS:
        out[row], out[CPU + row] = [], []
    for rep in range(reps + 1):  # round 0 warms up (group connection, first full delta)
        for row in ROWS:  # every row once per round: a row and the raw one see the same load
            raw.barrier()
            c0, t0 = cpu_seconds(), time.perf_counter()
            actions[row](rep)
            if raw.device.type == "cuda":
                torch.cuda.synchronize()
            if rep:
                out[row].append(time.perf_counter() - t0)
                out[CPU + row].append(cpu_seconds() - c0)


CPU = "cpu:"
"""``out[CPU + row]``: this rank's CPU seconds per rep of ``row``."""


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process so far, every thread (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def per_tensor(rank: int, raw: RawGroup, model) -> None:
    for _, t in model:
        buf = t.view(-1).view(torch.uint8) if rank == 0 else torch.empty(t.numel() * t.element_size(),
                                                                          dtype=torch.uint8)
        raw.bcast(buf.to(raw.device))


def transfer(rank: int, sync, model, rep: int) -> None:
    if rank == 0:
        sync.send(model, rep + 1)
    else:
        for _ in sync.receive():  # verified views; loading into an engine is not part of the transfer
            pass


def delta(rank: int, sync: DeltaSync, model, rep: int) -> None:
    if rank == 0:
        if rep:  # after the full first sync, a tenth of the tensors change
            with torch.no_grad():
                for _, t in model[::CHANGED_EVERY]:
                    t.view(-1)[0] += 1
        sync.send(model, rep + 1)
    else:
        for _ in sync.receive():
            pass


def file_row(rank: int, raw: RawGroup, flat: torch.Tensor, path: Path) -> None:
    if rank == 0:
        flat.cpu().numpy().tofile(path)
    raw.barrier()
    if rank != 0:
        np.fromfile(path, dtype=np.uint8)


def checkpoint_row(rank: int, raw: RawGroup, sync: CheckpointSync, model, rep: int) -> None:
    if rank == 0:
        sync.send(model, rep + 1)
    raw.barrier()  # the driver hands the version over only after the sender returned
    if rank != 0:
        for _ in sync.receive():
            pass


def build_syncs(rank: int, world: int, cfg: dict, rendezvous: dict | None, ckpt_dir: Path) -> dict:
    """The protocol ends this rank holds; the sender's rendezvous records go to the receivers."""
    role = "sender" if rank == 0 else "receiver"
    common = {"backend": cfg["backend"], "timeout_s": 600}
    if rank == 0:
        make = {k: dict(world_size=world, bucket_bytes=cfg["bucket"], **common) for k in ("overlap", "copied", "serial", "delta")}
    else:
        make = {k: dict(rendezvous=rendezvous[k], rank=rank, **common) for k in ("overlap", "copied", "serial", "delta")}
    syncs = {"overlap": BroadcastSync(role, overlap=True, **make["overlap"]),
             "copied": BroadcastSync(role, overlap=True, **make["copied"]),
             "serial": BroadcastSync(role, overlap=False, **make["serial"]),
             "delta": DeltaSync(role, inner=BroadcastSync(role, overlap=True, **make["delta"])),
             "checkpoint": CheckpointSync(role, directory=ckpt_dir / "ckpt", bucket_bytes=cfg["bucket"])}
    return syncs


def receiver_main(rank: int, world: int, cfg: dict, raw_port: int, rendezvous: dict, ckpt_dir: str, q) -> None:
    faulthandler.dump_traceback_later(cfg["watchdog"], exit=True)
    torch.set_num_threads(1)
    if cfg["backend"] == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    raw = RawGroup(rank, world, cfg["backend"], raw_port)
    raw.connect()
    model = [(n, torch.empty(s, dtype=getattr(torch, cfg["dtype"]))) for n, s in cfg["shapes"]]  # shapes only
    syncs = build_syncs(rank, world, cfg, rendezvous, Path(ckpt_dir))
    out: dict = {}
    run_rows(rank, raw, syncs, model, Path(ckpt_dir), cfg["reps"], out)
    for s in syncs.values():
        s.close()
    q.put((rank, out))


# ---- the object store (Ray) -------------------------------------------------------------------------
class _Trainer:
    def __init__(self, shapes, dtype: str, bucket: int):
        self.model = make_model(shapes, getattr(torch, dtype))
        self.sync = InPlaceSync("sender", bucket_bytes=bucket)

    def raw(self):
        return np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for _, t in self.model])

    def send(self, version: int):
        self.sync.send(self.model, version)
        return self.sync.handoff()


class _Replica:
    def __init__(self):
        self.sync = InPlaceSync("receiver")

    def raw(self, buf) -> int:
        return int(buf.nbytes)

    def receive(self, handoff) -> int:
        return sum(1 for _ in self.sync.receive(handoff))


def ray_rows(cfg: dict, receivers: int) -> dict:
    """``raw object store`` and ``inplace`` rows: the driver's path through Ray (median seconds per rep)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        trainer = ray.remote(num_cpus=0)(_Trainer).remote(cfg["shapes"], cfg["dtype"], cfg["bucket"])
        replicas = [ray.remote(num_cpus=0)(_Replica).remote() for _ in range(receivers)]
        ray.get([trainer.raw.remote()] + [r.raw.remote(np.zeros(1, np.uint8)) for r in replicas])  # started
        rows = {}
        for row, produce, consume in [("raw object store", lambda v: trainer.raw.remote(), "raw"),
                                      ("inplace", lambda v: trainer.send.remote(v), "receive")]:
            times = []
            for rep in range(cfg["reps"] + 1):
                t0 = time.perf_counter()
                ref = produce(rep + 1)  # as Runtime.push_weights: the trainer's ref goes straight to the replicas
                ray.get([getattr(r, consume).remote(ref) for r in replicas])
                times.append(time.perf_counter() - t0)
                del ref
            rows[row] = times[1:]
        return rows
    finally:
        ray.shutdown()


# ---- main ---------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=256, help="model size, MB")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--bucket-mb", type=float, default=32, help="bucket / safetensors file size, MB")
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    parser.add_argument("--no-ray", action="store_true", help="skip the object-store rows")
    parser.add_argument("--watchdog", type=float, default=1200,
                        help="seconds after which every process prints its stacks and exits (a hang is a bug)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "weight_sync.json"))
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    backend = args.backend or default_backend()
    shapes = model_shapes(args.mb, dtype)
    total = sum(int(np.prod(s)) for _, s in shapes) * torch.tensor([], dtype=dtype).element_size()
    world = 1 + args.receivers
    cfg = {"shapes": shapes, "dtype": args.dtype, "bucket": int(args.bucket_mb * 2**20), "reps": args.reps,
           "backend": backend, "watchdog": args.watchdog}
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    shm = Path("/dev/shm")
    ckpt_dir = Path(tempfile.mkdtemp(prefix="flowrl-sync-bench-", dir=shm if shm.is_dir() else None))
    print(f"model: {len(shapes)} tensors, {total / 2**20:.0f} MiB {args.dtype}; bucket {args.bucket_mb} MB; "
          f"{args.receivers} receiver(s); backend {backend}; files in {ckpt_dir}", flush=True)
    try:
        raw = RawGroup(0, world, backend)
        syncs = build_syncs(0, world, cfg, None, ckpt_dir)
        # As the torch trainer does when it opens a broadcast: its weights move into the sync's home
        # (the frames' layout); the other rows send the same tensors, copying them into buckets.
        model = list(syncs["overlap"].home(make_model(shapes, dtype)).items())
        rendezvous = {k: syncs[k].rendezvous for k in ("overlap", "copied", "serial")}
        rendezvous["delta"] = syncs["delta"].inner.rendezvous
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=receiver_main, args=(r, world, cfg, raw.port, rendezvous, str(ckpt_dir), q))
                 for r in range(1, world)]
        for p in procs:
            p.start()
        raw.connect()
        mine: dict = {}
        run_rows(0, raw, syncs, model, ckpt_dir, args.reps, mine)
        theirs = [q.get(timeout=1800)[1] for _ in procs]
        for p in procs:
            p.join()
        for s in syncs.values():
            s.close()
        delta_wire = syncs["delta"].stats.wire_bytes
        per_round = {row: [max(ts) for ts in zip(mine[row], *(t[row] for t in theirs))] for row in ROWS}
        seconds = {row: statistics.median(ts) for row, ts in per_round.items()}
        paired = statistics.median(r / p for r, p in zip(per_round["raw broadcast"],
                                                         per_round["broadcast packed+overlap"]))
        cpu = {row: statistics.median(sum(cs) for cs in zip(mine[CPU + row], *(t[CPU + row] for t in theirs)))
               for row in ROWS}
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if not args.no_ray:
        try:
            seconds.update({k: statistics.median(v) for k, v in ray_rows(cfg, args.receivers).items()})
        except ImportError:
            print("ray is not installed: object-store rows skipped")
    report(seconds, cpu, paired, total, delta_wire, args, backend, len(shapes))


def report(seconds: dict, cpu: dict, paired: float, total: int, delta_wire: int, args, backend: str, tensors: int) -> None:
    raw = total / seconds["raw broadcast"]
    own = {"checkpoint": "raw file write+read", "inplace": "raw object store"}
    rows = []
    print(f"\n{'row':28} {'seconds':>9} {'GB/s':>7} {'vs raw broadcast':>17} {'vs own transport':>17} "
          f"{'CPU s':>7} {'raw CPU / CPU':>14}")
    for row, s in seconds.items():
        rate = total / s
        vs_own = rate / (total / seconds[own[row]]) if row in own and own[row] in seconds else None
        rows.append({"row": row, "seconds": s, "bytes_per_s": rate, "vs_raw_broadcast": rate / raw,
                     "vs_own_transport": vs_own, "cpu_seconds": cpu.get(row),
                     "raw_cpu_ratio": cpu["raw broadcast"] / cpu[row] if row in cpu else None})
        own_text = f"{vs_own:16.0%}" if vs_own is not None else " " * 16
        cpu_text = f"{cpu[row]:7.3f} {cpu['raw broadcast'] / cpu[row]:14.0%}" if row in cpu else ""
        print(f"{row:28} {s:9.3f} {rate / 1e9:7.2f} {rate / raw:16.0%} {own_text} {cpu_text}")
    packed = total / seconds["broadcast packed+overlap"] / raw
    print(f"\npacked broadcast reaches {paired:.0%} of the raw broadcast in the same round (median of "
          f"{args.reps}; {packed:.0%} median against median; target >= 80%) and uses "
          f"{cpu['broadcast packed+overlap'] / cpu['raw broadcast']:.2f}x its CPU seconds (all ranks); "
          f"delta sent {delta_wire / 2**20:.1f} MiB of {total / 2**20:.0f} MiB; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    result = {"benchmark": "weight_sync", "python": platform.python_version(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0], "torch": torch.__version__, "backend": backend, "model_bytes": total,
              "tensors": tensors, "dtype": args.dtype, "bucket_bytes": int(args.bucket_mb * 2**20),
              "receivers": args.receivers, "reps": args.reps, "rows": rows,
              "packed_vs_raw": packed, "packed_vs_raw_paired": paired, "delta_wire_bytes": delta_wire,
              "delta_changed_fraction": 1 / CHANGED_EVERY}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
