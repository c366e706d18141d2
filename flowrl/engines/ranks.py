"""Rank processes for multi-process train engines (``megatron``, ``fsdp``).

A :class:`RankGroup` is ``world`` processes, each hosting one *rank worker* (an object built as
``worker_cls(rank, world, init_method, options)`` that joins a ``torch.distributed`` group at
``init_method``). The engine broadcasts every Protocol call as ``(method, kwargs)`` to all ranks
and collects one answer per rank. A rank that raises or dies stops the whole group (ranks blocked
in a collective with a failed peer would never return), and the error reaches the caller as the
rank's own :class:`~flowrl.engines.base.EngineError` or as a :class:`RankProcessError` carrying
the remote traceback (and, for a rank that died, its name).

Two kinds of group, chosen by the engine's ``placement`` argument
(:func:`~flowrl.engines.rank_hosts.start_ranks`):

* no placement (an engine built outside Ray: tests, notebooks): :class:`ForkedRanks`, processes
  forked on this machine through a fork server, one inbox each and a shared outbox;
* a :class:`RankPlacement` (an engine under the Ray runtime): one Ray actor per rank, each in
  the placement-group bundle the plan gave its rank, on that bundle's node
  (:class:`~flowrl.engines.rank_actors.ActorRanks`).

A rank worker picks its accelerator with :func:`local_device_index` (the host says which).

Rank workers must expose ``coords`` (a dict, returned by the start call) and
``shutdown()``. A ``loss_fn`` keyword travels as cloudpickle bytes (closures and
lambdas by value) and is unpickled in the rank.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from flowrl.engines.base import EngineConfigError, EngineError, accelerator


class RankProcessError(EngineError):
    """A rank process raised or died; the engine's processes have been stopped.

    ``remote_traceback`` holds the rank's traceback text; ``dead_ranks`` the names of the rank
    processes that died (killed, out of memory, crashed): an engine fault, which the runtime
    names and ``flowrl run --restarts N`` restarts (:class:`~flowrl.runtime.watchdog.EngineDied`).
    """

    def __init__(self, message: str, remote_traceback: str = "", dead_ranks: tuple[str, ...] = ()):
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.dead_ranks = tuple(dead_ranks)

    def __reduce__(self):  # Ray pickles it across processes: keep every field
        return type(self), (str(self), self.remote_traceback, self.dead_ranks)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (an address of this machine) that is free right now (for the rendezvous URL)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


LOCAL_RANK_ENV = "LOCAL_RANK"
"""torch's name for a rank's index among the accelerators its process sees; set by the rank's host."""


def local_device_index() -> int:
    """The CUDA device index this rank uses: what its host put in ``LOCAL_RANK`` (a forked rank: its
    rank, all ranks sharing this node's GPUs; a rank actor: 0, the GPU Ray gave it), modulo the devices
    it sees."""
    import torch

    value = os.environ.get(LOCAL_RANK_ENV)
    if value is None:
        raise EngineError(f"{LOCAL_RANK_ENV} is not set: a rank worker runs under ForkedRanks or ActorRanks, "
                          "which set it")
    return int(value) % max(1, torch.cuda.device_count())


@dataclass(frozen=True)
class RankPlacement:
    """Where each rank of an engine runs under Ray: rank ``r`` is an actor in bundle ``bundles[r]`` of
    placement group ``groups[r]``, taking ``shares[r]`` of that bundle's ``resource`` (``"GPU"``, or
    ``"CPU"`` on a CPU-only cluster: :func:`~flowrl.runtime.placement.slot_resource`)."""

    groups: tuple
    """Per rank: its Ray ``PlacementGroup`` (one per plan node)."""
    bundles: tuple[int, ...]
    """Per rank: its bundle index in that group (its GPU on that node)."""
    shares: tuple[float, ...]
    """Per rank: the part of its bundle's resource it takes."""
    resource: str = "GPU"
    nodes: tuple[int, ...] = ()
    """Per rank: its plan node (error messages and placement records)."""

    def __post_init__(self):
        n = len(self.groups)
        if not (len(self.bundles) == len(self.shares) == n) or (self.nodes and len(self.nodes) != n):
            raise EngineConfigError(f"RankPlacement: {n} groups, {len(self.bundles)} bundles, {len(self.shares)} "
                                    f"shares, {len(self.nodes)} nodes: one of each per rank")
        if self.resource not in ("GPU", "CPU"):
            raise EngineConfigError(f"RankPlacement: resource={self.resource!r}; use 'GPU' or 'CPU'")


def cloudpickle_module() -> Any:
    """cloudpickle (pickles closures and lambdas by value); Ray's vendored copy if the package is absent."""
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - cloudpickle comes with vLLM; Ray vendors it
        from ray import cloudpickle
    return cloudpickle


OWNER_CHECK_S = 1.0
"""How often a rank process checks that the process owning its engine still runs."""


def exit_with_owner(owner_pid: int, every_s: float = OWNER_CHECK_S) -> None:
    """Start a daemon thread that ends this process as soon as process ``owner_pid`` is gone.

    A rank waits on its inbox, whose pipe it holds both ends of, or in a collective: neither returns
    when the engine's process is killed (``kill -9`` of its Ray actor, an OOM kill), so without this
    its ranks live on as orphans holding their memory. Collectives release the GIL, so the check runs
    while a rank is blocked in one.
    """
    import threading

    def started(pid: int) -> str | None:
        """The process's start time (``/proc/PID/stat`` field 22): a reused pid has another; None: gone."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            return None

    birth = started(owner_pid)

    def watch() -> None:
        while True:
            time.sleep(every_s)
            try:
                os.kill(owner_pid, 0)
            except OSError:  # no such process (or, reused, another user's)
                os._exit(1)
            if birth is not None and started(owner_pid) != birth:  # the pid was reused
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-owner", daemon=True).start()


def rank_main(rank: int, world: int, init_method: str, worker_cls: type, options: Any, inbox: Any,
              outbox: Any, owner_pid: int | None = None) -> None:
    """Body of a rank process: build ``worker_cls``, then serve ``(method, kwargs)`` until ``shutdown``;
    the process ends by itself if ``owner_pid`` (the engine's process) dies (:func:`exit_with_owner`)."""
    if owner_pid is not None:
        exit_with_owner(owner_pid)
    os.environ[LOCAL_RANK_ENV] = str(rank)  # every rank on this machine: they share its GPUs in rank order
    cloudpickle = cloudpickle_module()

    def answer(call: Any) -> None:
        outbox.put((rank, *run_answering(call)))

    holder: dict[str, Any] = {}
    answer(lambda: holder.setdefault("rank", worker_cls(rank, world, init_method, options)).coords)
    if "rank" not in holder:
        return
    worker = holder["rank"]
    while True:
        method, kwargs = inbox.get()
        if method == "shutdown":
            worker.shutdown()
            outbox.put((rank, True, None))
            return
        answer(lambda: getattr(worker, method)(**unpickled(kwargs, cloudpickle)))


def run_answering(call: Any) -> tuple[bool, Any]:
    """``(True, call())``, or ``(False, (error, traceback text))`` if it raised: an
    :class:`~flowrl.engines.base.EngineError` as is (its type and message), anything else as its text."""
    try:
        return True, call()
    except EngineError as exc:
        return False, (exc, traceback.format_exc())
    except BaseException as exc:
        return False, (f"{type(exc).__name__}: {exc}", traceback.format_exc())


def unpickled(kwargs: dict, cloudpickle: Any) -> dict:
    """A call's keyword arguments with its ``loss_fn`` (cloudpickle bytes: closures travel by value) loaded."""
    return {**kwargs, "loss_fn": cloudpickle.loads(kwargs["loss_fn"])} if "loss_fn" in kwargs else kwargs


_MAIN_ENV = "_FLOWRL_FORKSERVER_MAIN"


def server_preload(preload: tuple[str, ...]) -> list[str]:
    """What the fork server imports: this module and ``preload``, or only this module where this
    process sees a GPU. A fork server must never initialise CUDA (a forked child cannot use it
    then), and importing Megatron-core does (seen on an H200: every rank failed with "Cannot
    re-initialize CUDA in forked subprocess"); there the ranks import their modules after the fork."""
    return ["flowrl.engines.ranks", *(() if accelerator() == "cuda" else preload)]


def mp_context(preload: tuple[str, ...]) -> Any:
    """The ``forkserver`` multiprocessing context preloading ``preload`` (:func:`server_preload`;
    ``spawn`` where unavailable).

    Ranks are forked from a clean server process that has imported modules but never run
    a torch op (so no OpenMP/thread pool is forked mid-flight); the server outlives one
    engine, so later engines of the same driver start in about a second. The preload list
    only takes effect for the first engine that starts the server; later ones import
    what they miss after the fork.
    """
    import multiprocessing.forkserver as forkserver

    import torch.multiprocessing as mp

    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(server_preload(preload))
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if main_file:
        # Python 3.11's fork server never imports the parent's main script, so every child
        # re-runs it (multiprocessing.spawn._fixup_main_from_path) - seconds per rank when it
        # imports transformers or pytest. The server records the path instead (see
        # _adopt_parent_main); ranks need nothing from __main__ (loss functions travel
        # by value through cloudpickle).
        os.environ[_MAIN_ENV] = os.path.normpath(os.path.abspath(main_file))
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop(_MAIN_ENV, None)
    return ctx


def _adopt_parent_main() -> None:
    """In the fork server only: make ``__main__`` claim the parent's main file, so forked ranks skip re-running it."""
    path = os.environ.get(_MAIN_ENV)
    main = sys.modules.get("__main__")
    if path and main is not None and getattr(main, "__file__", None) is None:
        main.__file__ = path


_adopt_parent_main()


def rank_failure(error_cls, name: str, method: str, errors: dict[int, Any], dead: dict[str, str]) -> Exception:
    """The one error an engine's ranks report for ``method``: a rank that died first (``dead``: its
    name -> why; its peers' errors, a collective whose connection was reset, follow from it), else
    the lowest rank's error, else a timeout."""
    if dead:
        why = "; ".join(f"{n}: {w}" for n, w in dead.items())
        return error_cls(f"{name} rank process died during {method} ({why}); the engine was stopped", "",
                         tuple(dead))
    if errors:
        rank = min(errors)
        exc, tb = errors[rank]
        if isinstance(exc, EngineError):
            return exc
        return error_cls(f"{name} rank {rank} failed in {method}: {exc}", tb)
    return error_cls(f"{name} ranks did not answer {method} in time; the engine was stopped")


class RankGroup(Protocol):
    """What an engine asks of its ranks, however they run (:class:`ForkedRanks`, ``ActorRanks``)."""

    world: int
    coords: list
    """Per rank: what its worker's ``coords`` said at start."""

    def call(self, method: str, timeout_s: float, **kwargs: Any) -> list[Any]:
        """Run ``method(**kwargs)`` on every rank; the answers in rank order. A rank that dies, or a rank error
        its peers do not answer within a grace period (they wait in a collective), stops every rank."""

    def locations(self) -> list[dict]:
        """Per rank: ``{"pid": ..., "node_id": ..., "gpu_ids": [...]}`` (node and GPUs: Ray's, None outside Ray)."""

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to shut down, then stop any still running."""

    def kill(self) -> None:
        """Stop every rank now."""


class ForkedRanks:
    """``world`` rank processes forked on this machine and their queues (one inbox each, one shared outbox).

    Args:
        worker_cls: importable class built in each rank as ``worker_cls(rank, world, init_method, options)``.
        options: picklable plain data handed to every rank.
        world: number of rank processes.
        start_timeout_s: longest wait for every rank to be built.
        name: engine name used in process names and error messages (``"megatron"``, ``"fsdp"``).
        preload: modules the fork server imports once (see :func:`mp_context`).
        error_cls: :class:`RankProcessError` subclass raised for failures that are not ``EngineError``.
    """

    def __init__(self, worker_cls: type, options: Any, world: int, start_timeout_s: float, *, name: str = "engine",
                 preload: tuple[str, ...] = (), error_cls: type[RankProcessError] = RankProcessError):
        ctx = mp_context(preload)
        self.world = world
        self.name = name
        self.error_cls = error_cls
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs = [
            ctx.Process(target=rank_main,
                        args=(r, world, init_method, worker_cls, options, self.inboxes[r], self.outbox, os.getpid()),
                        daemon=True, name=f"{name}-rank{r}")
            for r in range(world)
        ]
        for proc in self.procs:
            proc.start()
        self.coords: list[Any] = self._collect("start", start_timeout_s)

    def call(self, method: str, timeout_s: float, **kwargs: Any) -> list[Any]:
        """Run ``method(**kwargs)`` on every rank; the answers in rank order."""
        for box in self.inboxes:
            box.put((method, kwargs))
        return self._collect(method, timeout_s)

    def _collect(self, method: str, timeout_s: float, grace_s: float = 5.0) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        first_error = None
        while len(results) + len(errors) < self.world:
            try:
                rank, ok, value = self.outbox.get(timeout=0.2)
                (results if ok else errors)[rank] = value
                if not ok and first_error is None:
                    first_error = time.monotonic()
                continue
            except Exception:  # queue.Empty: check on the processes
                pass
            dead = [p for p in self.procs if p.exitcode is not None]
            now = time.monotonic()
            if dead or now > deadline or (first_error is not None and now - first_error > grace_s):
                # Ranks blocked in a collective with a failed peer never return: stop them all.
                self.kill()
                raise self._failure(method, errors, dead)
        if errors:
            raise self._failure(method, errors, [])
        return [results[r] for r in range(self.world)]

    def locations(self) -> list[dict]:
        return [{"pid": p.pid, "node_id": None, "gpu_ids": None} for p in self.procs]

    def _failure(self, method: str, errors: dict[int, Any], dead: list[Any]) -> Exception:
        return rank_failure(self.error_cls, self.name, method, errors,
                            {p.name: f"exit code {p.exitcode}" for p in dead})

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to shut down, then stop any process still alive."""
        if not any(p.is_alive() for p in self.procs):
            return
        try:
            self.call("shutdown", timeout_s)
        except EngineError:
            pass
        self.kill()

    def kill(self) -> None:
        """Terminate every live rank process and reap it."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=10)


def dp_slices(rows: int, dp: int) -> list[slice]:
    """Contiguous balanced row ranges, one per data-parallel rank (rank order kept).

    >>> dp_slices(5, 2)
    [slice(0, 2, None), slice(2, 5, None)]
    """
    bounds = [round(i * rows / dp) for i in range(dp + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(dp)]


class RankedTrainEngine:
    """What a train engine driving a :class:`RankGroup` shares: its lifecycle (the ranks stop on
    :meth:`shutdown`, on ``with`` exit, or when the engine is dropped), sharded checkpoints and
    the transformers export.

    A subclass sets :attr:`meta_file`, :attr:`engine_name` and :attr:`sharding_key` (the name of
    its attribute that fixes how its state is split over ranks: ``dp`` for fsdp, ``layout`` for
    megatron; a checkpoint of another sharding is refused before any rank reads it), holds
    ``role``, ``step``, ``timeout_s`` and ``options.model_path``, and calls :meth:`_start` with
    its group.
    """

    meta_file: str
    engine_name: str
    sharding_key: str

    def _start(self, group: "RankGroup") -> None:
        self._group = group
        # Stop the rank processes if the engine is dropped without shutdown().
        self._finalizer = weakref.finalize(self, type(group).kill, group)

    def save(self, path: str) -> None:
        """Every rank writes its part (model and optimizer shards, RNG) into directory ``path``; then
        :attr:`meta_file` (sharding, role, step)."""
        import json
        from pathlib import Path

        os.makedirs(path, exist_ok=True)
        self._group.call("save", self.timeout_s, path=str(path))
        meta = {self.sharding_key: getattr(self, self.sharding_key), "role": self.role, "step": self.step,
                "model_path": self.options.model_path}
        Path(path, self.meta_file).write_text(json.dumps(meta, indent=1))

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote; its sharding and role must be this engine's."""
        import json
        from pathlib import Path

        file, key = Path(path, self.meta_file), self.sharding_key
        value = getattr(self, key)
        if not file.is_file():
            raise EngineError(f"no {self.engine_name} engine checkpoint at {str(path)!r} ({self.meta_file} missing)")
        meta = json.loads(file.read_text())
        if meta[key] != value or meta["role"] != self.role:
            raise EngineConfigError(
                f"checkpoint {str(path)!r} holds role={meta['role']!r} with {key} {meta[key]}; this engine has "
                f"role={self.role!r} with {key} {value}; build the engine with the checkpoint's {key} to load it")
        self._group.call("load", self.timeout_s, path=str(path))
        self.step = int(meta["step"])

    def save_pretrained(self, path: str) -> None:
        """Write the actor as a transformers checkpoint dir (config, tokenizer files, model.safetensors)."""
        import json
        from pathlib import Path

        from flowrl.engines.hf_export import write_hf_checkpoint

        if self.role != "actor":
            raise EngineConfigError("save_pretrained exports actors only; a critic has no LM head to serve")
        config = json.loads(Path(self.options.model_path, "config.json").read_text())
        write_hf_checkpoint(self.options.model_path, path, self.named_weights(),
                            tied=bool(config.get("tie_word_embeddings", False)))

    def adopt_weights(self, home: Any) -> int:
        """Nothing moves (0; ``home`` is not called): the weights live sharded in the rank processes, and
        :meth:`named_weights` yields tensors gathered from them, copies a weight sync packs as such."""
        return 0

    def offload(self) -> int:
        """Every rank's parameters, gradients and optimizer states to host memory (a colocated rollout
        engine generates meanwhile); the bytes moved over all ranks. :meth:`reload` before the next call."""
        return sum(self._group.call("offload", self.timeout_s))

    def reload(self) -> int:
        """Bring back what :meth:`offload` moved, in place (bit-identical); the bytes moved."""
        return sum(self._group.call("reload", self.timeout_s))

    def rank_locations(self) -> list[dict]:
        """Per rank: its process id, and under Ray its node id and GPU ids (:meth:`RankGroup.locations`)."""
        return self._group.locations()

    def state_checksums(self) -> list[dict[str, int]]:
        """Per rank: CRC-32 of every parameter, gradient and optimizer-state tensor it holds."""
        return self._group.call("state_checksums", self.timeout_s)

    def shutdown(self) -> None:
        """Stop the rank processes (the engine is unusable afterwards)."""
        self._group.shutdown()
        self._finalizer.detach()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
