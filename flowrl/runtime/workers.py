"""Ray actors that host engines, and worker groups that split calls by data-parallel rank.

A worker is a thin shell: it builds its engine from the plan's :class:`~flowrl.plan.EnginePlan`
through the engine's catalogue record (:func:`flowrl.engines.registry.build_engine`: the
adapter the record names, the layout's options under the adapter's names) and forwards
calls. Tensors cross Ray as numpy arrays (5-8x faster than pickled torch tensors); weights
cross by the resync's protocol (:mod:`flowrl.runtime.sync`: one end per worker, opened by
the driver). Engines sharing GPUs take turns through :meth:`TrainWorker.offload` /
:meth:`TrainWorker.reload` and :meth:`RolloutWorker.sleep` / :meth:`RolloutWorker.wake_up`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from flowrl.catalog.models import checkpoint_context
from flowrl.catalog.precision import DEFAULT_PRECISION


def batch_to_numpy(batch) -> dict:
    """TokenBatch -> dict of numpy arrays (for Ray)."""
    out = {"input_ids": batch.input_ids.numpy(), "attention_mask": batch.attention_mask.numpy(),
           "response_mask": batch.response_mask.numpy()}
    out.update({f"x:{k}": v.detach().numpy() for k, v in batch.extras.items()})
    return out


def _token_batches(micro_batch_tokens: int, pack: bool) -> dict:
    """The train-step keywords of token-budget micro-batches and packing, only when asked for: an
    engine without them (Megatron's, refused by ``flowrl check``: E615) never sees them."""
    return {"micro_batch_tokens": micro_batch_tokens, "pack": pack} if micro_batch_tokens or pack else {}


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


def layout_of(engine) -> dict:
    """An :class:`~flowrl.plan.EnginePlan`'s layout as the registry reads it: its axes, then its options."""
    return {"tp": engine.tp, "pp": engine.pp, "dp": engine.dp, "cp": engine.cp, **engine.options}


def optim_config(optim: dict):
    """The train engines' :class:`~flowrl.engines.torch_train.OptimConfig` of a plan's ``ModelPlan.optim``
    (the update's options named by :data:`flowrl.catalog.ops.OPTIMIZER_OPTIONS`)."""
    from flowrl.engines.torch_train import OptimConfig

    return OptimConfig(lr=optim.get("lr", 1e-5), weight_decay=optim.get("weight_decay", 0.0),
                       betas=(float(optim.get("beta1", 0.9)), float(optim.get("beta2", 0.999))),
                       max_grad_norm=optim.get("grad_clip", 1.0) or None,
                       warmup_steps=int(optim.get("warmup", 0)), schedule=optim.get("lr_schedule", "constant"),
                       total_steps=int(optim.get("schedule_steps", 0)),
                       min_lr_ratio=float(optim.get("min_lr_ratio", 0.0)))


def process_started() -> float:
    """When this process started (``time.time()`` seconds): an actor's start-up begins before its ``__init__``
    (the Ray worker process, Python, Ray's own imports)."""
    import psutil

    return psutil.Process().create_time()


class TrainWorker:
    """Hosts a TrainEngine: its one rank, or the coordinator of its rank actors (``placement``: where
    each runs, :func:`~flowrl.runtime.placement.rank_placement`)."""

    def __init__(self, engine, model_path: str, *, role: str, optim: dict, temperature: float, seed: int,
                 dtype: str = "float32", threads: int | None = None, share: int = 1, lora: dict | None = None,
                 placement=None, precision: str = DEFAULT_PRECISION):
        self.started = {"process": process_started(), "init": time.time()}
        _threads(threads, share)
        import torch

        from flowrl.engines.registry import build_engine, runs_on

        torch.manual_seed(seed)
        cfg = optim_config(optim)
        self.engine = build_engine(runs_on(engine.kind, engine.world_size), layout_of(engine), model_path=model_path,
                                   role=role, optim=cfg, temperature=temperature, seed=seed, dtype=dtype,
                                   precision=precision, lora=lora, placement=placement)
        self.started["built"] = time.time()

    def ready(self) -> dict[str, float]:
        """Its start-up (``time.time()`` seconds): the process started, ``__init__`` began, the engine was built."""
        return self.started

    def rank_locations(self) -> list[dict]:
        """Per rank actor: its pid, Ray node id and GPU ids (an engine with rank actors only)."""
        return self.engine.rank_locations()

    def stop_ranks(self) -> None:
        """Shut the engine's rank actors down and wait until they are gone (an engine with rank actors only)."""
        self.engine.shutdown()

    def forward(self, batch: dict, entropy: bool = False, values: bool = False,
                adapters: bool = True) -> tuple[dict, float, float]:
        """Per-token outputs; ``adapters=False``: the base model's, the LoRA adapters disabled (asked only of
        an engine that trains adapters: the plan's ``adapters = "off"``)."""
        t0 = time.time()
        base = {} if adapters else {"adapters": False}
        out = self.engine.forward(batch_from_numpy(batch), entropy=entropy, values=values, **base)
        return {k: v.numpy() for k, v in out.items()}, t0, time.time()

    def train(self, batch: dict, loss_spec: dict, micro_batch: int, minibatches: int, epochs: int,
              seed: int, micro_batch_tokens: int = 0, pack: bool = False) -> tuple[list[dict], float, float]:
        """``epochs`` x ``minibatches`` optimizer steps; micro-batches of ``micro_batch`` rows, or of at
        most ``micro_batch_tokens`` real tokens, each packed into one row with ``pack``
        (:mod:`flowrl.engines.batching`)."""
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
                    stats.append(self.engine.train_step(full.select(chunk), loss_fn, micro_batch_size=micro_batch,
                                                        **_token_batches(micro_batch_tokens, pack)))
        return stats, t0, time.time()

    def offload(self) -> tuple[int, float, float]:
        """Parameters, gradients and optimizer states to host memory; (bytes moved, t0, t1). A weight sync
        holding device memory between syncs (``cuda_ipc``'s shared buffers, which every replica has
        loaded by now: the resync precedes the trainer's turn off the GPU) gives it back too."""
        t0 = time.time()
        release = getattr(getattr(self, "sync", None), "release", None)
        if release is not None:
            release()
        return self.engine.offload(), t0, time.time()

    def reload(self) -> tuple[int, float, float]:
        """Back from host memory, bit-identical; (bytes moved, t0, t1)."""
        t0 = time.time()
        return self.engine.reload(), t0, time.time()

    def open_sync(self, protocol: str, role: str, options: dict):
        """Open this trainer's end (``role="sender"``) of weight-sync ``protocol``.

        Returns the :class:`~flowrl.runtime.sync.Rendezvous` the receivers need for a
        collective protocol (``broadcast``), else None.
        """
        from flowrl.runtime.sync.endpoint import home_weights, open_end

        self.sync, rendezvous = open_end(protocol, role, options)
        home_weights(self.sync, self.engine)
        return rendezvous

    def sync_send(self, version: int, corrupt: bool = False, fresh: bool = False,
                  lose: bool = False) -> tuple[tuple[dict, float, float], Any]:
        """Send the current weights as ``version``; call with ``.options(num_returns=2)``.

        Returns ``((ProtocolStats as a dict, t0, t1), handoff)``: times are ``time.time()``
        seconds; the handoff (None for collectives) goes to every receiver as an object
        ref, never through the driver. ``corrupt`` injects a one-byte fault, ``lose`` a lost bucket
        (tests); ``fresh``:
        the resend after a receiver found damage (see :func:`~flowrl.runtime.sync.endpoint.send_weights`).
        """
        from flowrl.runtime.sync.endpoint import send_weights

        t0 = time.time()
        stats, handoff = send_weights(self.sync, self.engine.named_weights(), version, corrupt, fresh, lose)
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
    """Hosts a RolloutEngine (one data-parallel replica; its tp ranks are the engine's own processes)."""

    def __init__(self, engine, model_path: str, *, seed: int, dtype: str = "float32", threads: int | None = None,
                 share: int = 1, lora: dict | None = None):
        self.started = {"process": process_started(), "init": time.time()}
        n = _threads(threads, share)
        from flowrl.engines.registry import build_engine, engine_record

        if engine.tp > 1:
            # The engine's tp worker processes (vLLM's multiprocessing executor) start with this
            # environment: together they get this replica's share of the cores.
            os.environ["OMP_NUM_THREADS"] = str(max(1, n // engine.tp))
        record = engine_record(engine.kind, "rollout")
        self.engine = build_engine(record, layout_of(engine), model_path=model_path, seed=seed, dtype=dtype,
                                   max_model_len=checkpoint_context(model_path), lora=lora)
        self._load = _LOAD_WEIGHTS[record.lora if lora is not None else ""](self.engine, model_path, lora)
        self.started["built"] = time.time()

    def ready(self) -> dict[str, float]:
        """Its start-up (``time.time()`` seconds): the process started, ``__init__`` began, the engine was built."""
        return self.started

    def generate(self, prompts: list[list[int]], spec, stall: float = 0.0) -> tuple[list, float, float]:
        """Completions of ``prompts``, (t0, t1); ``stall`` > 0 first sleeps that long (seconds): a hung
        engine, injected by a test (``Faults.hang_at_step``) for the watchdog to catch."""
        t0 = time.time()
        if stall > 0:
            time.sleep(stall)
        return self.engine.generate(prompts, spec), t0, time.time()

    def sleep(self) -> tuple[float, float]:
        """Free the engine's GPU memory for a colocated trainer; (t0, t1)."""
        t0 = time.time()
        self.engine.sleep()
        return t0, time.time()

    def wake_up(self, tags: list[str] | None = None) -> tuple[float, float]:
        """Bring back what :meth:`sleep` freed (``tags``: ``weights``, ``kv_cache``; None: all); (t0, t1)."""
        t0 = time.time()
        self.engine.wake_up(tags)
        return t0, time.time()

    def open_sync(self, protocol: str, role: str, options: dict) -> None:
        """Open this replica's end (``role="receiver"``) of weight-sync ``protocol``.

        ``options`` of a collective carry the sender's ``rendezvous`` and this replica's ``rank``.
        """
        from flowrl.runtime.sync.endpoint import open_end

        self.sync, _ = open_end(protocol, role, options)

    def sync_receive(self, handoff: Any = None, breaks: str | None = None) -> tuple[dict, float, float]:
        """Receive one resync, verify every checksum, then load the weights in place.

        ``handoff``: the sender's record (None for collectives, which run concurrently
        with the sender). Returns (ProtocolStats as a dict, t0, t1 in ``time.time()``
        seconds). Raises WeightSyncError naming a corrupted tensor before loading anything.
        ``breaks``: break a collective's group first (tests: ``kill`` or ``close``).
        """
        from flowrl.runtime.sync.endpoint import receive_weights

        t0 = time.time()
        pairs, stats = receive_weights(self.sync, handoff, breaks)
        self._load(pairs)
        stats["rank_bytes"] = delivered_bytes(self.engine, stats)
        return stats, t0, time.time()

    def close_sync(self) -> None:
        """Release the protocol's transport (process group, store)."""
        sync, self.sync = getattr(self, "sync", None), None
        if sync is not None:
            sync.close()

    def shutdown(self) -> None:
        self.engine.shutdown()


def delivered_bytes(engine, stats: dict) -> list[int]:
    """Bytes a resync gave each of the engine's ranks: what a tensor-parallel engine reports for its last
    update (``delivered_bytes``: vLLM sends each tp worker only its shards), else the bytes this
    replica received, all its one rank's."""
    return list(getattr(engine, "delivered_bytes", None) or [int(stats["bytes"])])


def _full_weights(engine, model_path: str, lora: dict | None):
    """A resync's weights go to the engine as they are (a model trained in full)."""
    return engine.update_weights


class _HeldAdapters:
    """The LoRA adapter tensors a replica holds, each resync's laid over the last: a ``delta`` resync
    sends only the tensors that changed (after the first update only the ``lora_B`` ones: ``lora_A``'s
    gradient is zero while ``B`` is), and an adapter is loaded or merged whole."""

    def __init__(self, load):
        self.load = load
        self.held: dict = {}

    def __call__(self, pairs) -> None:
        self.held.update((name, tensor.detach().clone()) for name, tensor in pairs)  # pairs may view sync buffers
        self.load(list(self.held.items()))


def _adapter(engine, model_path: str, lora: dict | None):
    """A resync's LoRA adapter tensors are loaded by the engine as an adapter (vLLM)."""
    return _HeldAdapters(engine.load_adapter)


def _merged(engine, model_path: str, lora: dict | None):
    """A resync's LoRA adapter tensors are merged into the base weights here, which the engine then
    loads in place (:class:`flowrl.engines.lora.Merger`)."""
    from flowrl.engines.lora import Merger, config_of

    merger = Merger(model_path, config_of(lora, model_path))
    return _HeldAdapters(lambda pairs: engine.update_weights(merger.merged(pairs)))


_LOAD_WEIGHTS = {"": _full_weights, "adapters": _adapter, "merged": _merged}
"""How a rollout worker loads what a resync sends, by its engine's record's ``lora`` mode (``""``: the
model trains in full): ``load(pairs)``."""


def split(items: list, parts: int) -> list[list]:
    """Contiguous, balanced chunks, one per data-parallel rank (rank order kept, so gathering is concatenation).

    >>> split([1, 2, 3, 4, 5], 2)
    [[1, 2], [3, 4, 5]]
    """
    n = len(items)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [items[bounds[i]: bounds[i + 1]] for i in range(parts)]
