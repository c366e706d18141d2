"""Ray actors that host engines, and worker groups that split calls by data-parallel rank.

A worker is a thin shell: it builds its engine from the plan's engine record through
the registry table and forwards calls. Tensors cross Ray as numpy arrays (5-8x faster
than pickled torch tensors); weights cross by the resync's protocol
(:mod:`flowrl.runtime.sync`: one end per worker, opened by the driver).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from pathlib import Path


def batch_to_numpy(batch) -> dict:
    """TokenBatch -> dict of numpy arrays (for Ray)."""
    out = {"input_ids": batch.input_ids.numpy(), "attention_mask": batch.attention_mask.numpy(),
           "response_mask": batch.response_mask.numpy()}
    out.update({f"x:{k}": v.detach().numpy() for k, v in batch.extras.items()})
    return out


def batch_from_numpy(d: dict):
    import torch

    from flowrl.engines.types import TokenBatch

    return TokenBatch(torch.from_numpy(np.array(d["input_ids"])), torch.from_numpy(np.array(d["attention_mask"])),
                      torch.from_numpy(np.array(d["response_mask"])),
                      {k[2:]: torch.from_numpy(np.array(v)) for k, v in d.items() if k.startswith("x:")})


def _threads(n: int | None, share: int = 1) -> int:
    """Set this process's torch threads: ``n``, else $FLOWRL_THREADS, else the node's cores / ``share``.

    ``share`` is how many engine processes the plan puts on this node. Each one taking
    every core oversubscribes the CPU (idle OpenMP threads spin): on 2 cores, three
    colocated engines with 2 threads each ran the default flow's step ~3-4x slower than
    with 1 thread each. Returns the count set.
    """
    import torch

    n = n or int(os.environ.get("FLOWRL_THREADS") or 0) or (os.cpu_count() or 1) // max(1, share)
    torch.set_num_threads(max(1, n))
    return max(1, n)


def _max_positions(model_path: str) -> int:
    """The checkpoint's context length (vLLM refuses a longer max_model_len)."""
    import json

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(min(cfg.get("max_position_embeddings", 2048), 4096))


def rollout_engine_args(kind: str, options: dict, seed: int) -> tuple[str, dict]:
    """The schedule's engine record -> (registry name, adapter keyword arguments)."""
    if kind == "vllm":
        kw = {"seed": seed, "dtype": options.get("dtype", "float32"),
              "tensor_parallel_size": int(options.get("tp", 1)),
              "max_model_len": int(options.get("max_model_len", 512)),
              "gpu_memory_utilization": float(options.get("gpu_memory_utilization", 0.5))}
        return "vllm", kw
    if kind == "sglang":  # dp is the worker group's replica count, as for vLLM
        kw = {"seed": seed, "dtype": options.get("dtype", "float32"),
              "tensor_parallel_size": int(options.get("tp", 1)),
              "max_model_len": int(options.get("max_model_len", 512)),
              "mem_fraction_static": float(options.get("mem_fraction", 0.5))}
        return "sglang", kw
    if kind in ("hf_generate", "torch"):
        return "torch", {"seed": seed, "dtype": options.get("dtype", "float32")}
    return kind, {"seed": seed, **options}


MULTI_RANK_TRAIN = frozenset({"megatron", "fsdp"})
"""Train engines that run tp*pp*dp ranks themselves (a process group started by the engine)."""


def train_engine_kind(kind: str, dp: int) -> str:
    """The registered train engine that runs a schedule's ``kind`` at data-parallel size ``dp``.

    ``torch(dp = N > 1)`` runs on the ``fsdp`` engine's N rank processes: data parallel
    with the global loss normalisation and summed gradients of one big batch, so the
    same numbers as DDP; the parameters are sharded as well, which only lowers memory.
    """
    return "fsdp" if kind == "torch" and dp > 1 else kind


class TrainWorker:
    """Hosts a TrainEngine (one rank). Methods return plain data."""

    def __init__(self, kind: str, model_path: str, *, role: str, optim: dict, temperature: float, seed: int,
                 layout: dict | None = None, threads: int | None = None, share: int = 1):
        _threads(threads, share)
        import torch

        from flowrl.engines.registry import make_train_engine
        from flowrl.engines.torch_train import OptimConfig

        torch.manual_seed(seed)
        cfg = OptimConfig(lr=optim.get("lr", 1e-5), weight_decay=optim.get("weight_decay", 0.0),
                          betas=(float(optim.get("beta1", 0.9)), float(optim.get("beta2", 0.999))),
                          max_grad_norm=optim.get("grad_clip", 1.0) or None)
        extra = dict(layout or {}) if kind in MULTI_RANK_TRAIN else {}  # the engine spawns its own ranks
        self.engine = make_train_engine(kind, model_path=model_path, role=role, optim=cfg,
                                        temperature=temperature, seed=seed, **extra)

    def ready(self) -> bool:
        return True

    def forward(self, batch: dict, entropy: bool = False, values: bool = False) -> tuple[dict, float, float]:
        t0 = time.time()
        out = self.engine.forward(batch_from_numpy(batch), entropy=entropy, values=values)
        return {k: v.numpy() for k, v in out.items()}, t0, time.time()

    def train(self, batch: dict, loss_spec: dict, micro_batch: int, minibatches: int, epochs: int,
              seed: int) -> tuple[list[dict], float, float]:
        import torch

        from flowrl.runtime.losses import make_loss_fn

        t0 = time.time()
        full = batch_from_numpy(batch)
        loss_fn = make_loss_fn(loss_spec)
        g = torch.Generator().manual_seed(seed)
        stats = []
        for _ in range(epochs):
            order = torch.randperm(full.size, generator=g) if minibatches > 1 else torch.arange(full.size)
            for chunk in torch.tensor_split(order, minibatches):
                if len(chunk):
                    stats.append(self.engine.train_step(full.select(chunk), loss_fn, micro_batch_size=micro_batch))
        return stats, t0, time.time()

    def open_sync(self, protocol: str, role: str, options: dict):
        """Open this trainer's end (``role="sender"``) of weight-sync ``protocol``.

        Returns the :class:`~flowrl.runtime.sync.Rendezvous` the receivers need for a
        collective protocol (``broadcast``), else None.
        """
        from flowrl.runtime.sync.endpoint import open_end

        self.sync, rendezvous = open_end(protocol, role, options)
        return rendezvous

    def sync_send(self, version: int, corrupt: bool = False) -> tuple[tuple[dict, float, float], Any]:
        """Send the current weights as ``version``; call with ``.options(num_returns=2)``.

        Returns ``((ProtocolStats as a dict, t0, t1), handoff)``: times are ``time.time()``
        seconds; the handoff (None for collectives) goes to every receiver as an object
        ref, never through the driver. ``corrupt`` injects a one-byte fault (tests).
        """
        from flowrl.runtime.sync.endpoint import send_weights

        t0 = time.time()
        stats, handoff = send_weights(self.sync, self.engine.named_weights(), version, corrupt)
        return (stats, t0, time.time()), handoff

    def close_sync(self) -> None:
        """Release the protocol's transport (process group, store)."""
        sync, self.sync = getattr(self, "sync", None), None
        if sync is not None:
            sync.close()

    def save(self, path: str) -> None:
        self.engine.save(path)

    def load(self, path: str) -> None:
        self.engine.load(path)


class RolloutWorker:
    """Hosts a RolloutEngine (one data-parallel replica)."""

    def __init__(self, kind: str, model_path: str, *, options: dict, seed: int, threads: int | None = None,
                 share: int = 1):
        _threads(threads, share)
        from flowrl.engines.registry import make_rollout_engine

        options = dict(options)
        options.setdefault("max_model_len", _max_positions(model_path))
        name, kwargs = rollout_engine_args(kind, options, seed)
        self.engine = make_rollout_engine(name, model_path=model_path, **kwargs)

    def ready(self) -> bool:
        return True

    def generate(self, prompts: list[list[int]], spec) -> tuple[list, float, float]:
        t0 = time.time()
        return self.engine.generate(prompts, spec), t0, time.time()

    def open_sync(self, protocol: str, role: str, options: dict) -> None:
        """Open this replica's end (``role="receiver"``) of weight-sync ``protocol``.

        ``options`` of a collective carry the sender's ``rendezvous`` and this replica's ``rank``.
        """
        from flowrl.runtime.sync.endpoint import open_end

        self.sync, _ = open_end(protocol, role, options)

    def sync_receive(self, handoff: Any = None) -> tuple[dict, float, float]:
        """Receive one resync, verify every checksum, then load the weights in place.

        ``handoff``: the sender's record (None for collectives, which run concurrently
        with the sender). Returns (ProtocolStats as a dict, t0, t1 in ``time.time()``
        seconds). Raises WeightSyncError naming a corrupted tensor before loading anything.
        """
        from flowrl.runtime.sync.endpoint import receive_weights

        t0 = time.time()
        pairs, stats = receive_weights(self.sync, handoff)
        self.engine.update_weights(pairs)
        return stats, t0, time.time()

    def close_sync(self) -> None:
        """Release the protocol's transport (process group, store)."""
        sync, self.sync = getattr(self, "sync", None), None
        if sync is not None:
            sync.close()

    def shutdown(self) -> None:
        self.engine.shutdown()


class WorkerGroup:
    """The Ray actors of one engine; calls are split across data-parallel ranks and gathered."""

    def __init__(self, name: str, actors: list[Any]):
        self.name = name
        self.actors = actors

    @property
    def dp(self) -> int:
        return len(self.actors)

    def split(self, items: list) -> list[list]:
        """Contiguous, balanced chunks, one per rank (rank order kept, so gathering is concatenation)."""
        n, k = len(items), self.dp
        bounds = [round(i * n / k) for i in range(k + 1)]
        return [items[bounds[i]: bounds[i + 1]] for i in range(k)]
