"""Ranks as Ray actors: one actor per rank of a train engine, each in its own placement-group bundle.

Under the Ray runtime an engine's ranks must run where the plan put them: rank ``r`` on the GPU
(bundle) and node its layout gave it, so ``megatron(tp = 2, dp = 2)`` over two nodes runs two ranks
on each. :class:`ActorRanks` starts one :class:`RankActor` per rank with
``PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)`` (from a
:class:`~flowrl.engines.ranks.RankPlacement`); the ranks meet through ``torch.distributed`` at rank
0's node IP on a port free there (gloo on CPU, NCCL on CUDA), and each uses the accelerator Ray gave
its actor (``cuda:0`` inside it: Ray sets ``CUDA_VISIBLE_DEVICES``).

It is a :class:`~flowrl.engines.ranks.RankGroup` like the forked one: every call goes to all ranks
and the answers come back in rank order; a rank that raises or whose actor dies (``kill -9``, its
node lost) stops every rank, and a dead one is named, with its Ray node, in a
:class:`~flowrl.engines.ranks.RankProcessError`'s ``dead_ranks`` (the runtime's ``EngineDied``, which
``--restarts`` restarts). The actors belong to the process that started them (the engine's Ray
actor): they end with it, and :meth:`ActorRanks.shutdown` / :meth:`ActorRanks.kill` end them and
wait until Ray says they are gone.
"""

from __future__ import annotations

import os
import time
from typing import Any

from flowrl.engines.base import EngineError
from flowrl.engines.ranks import (LOCAL_RANK_ENV, RankPlacement, RankProcessError, cloudpickle_module, free_port,
                                  rank_failure, run_answering, unpickled)

KILL_WAIT_S = 10.0
"""How long :meth:`ActorRanks.kill` waits for Ray to report each killed rank actor dead."""


def ray_death(error: BaseException) -> str:
    """Ray's words for an actor's death, on one line, without its list of common causes, at most 200 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith("\t")]
    text = (lines[-1] if lines else type(error).__name__).split(" Some common causes", 1)[0].rstrip(".")
    return text if len(text) <= 200 else text[:197] + "..."


class RankActor:
    """One rank's Ray actor: builds the rank worker, then runs the calls the engine sends it."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.worker: Any = None
        # The one accelerator Ray gave this actor is its device 0 (CUDA_VISIBLE_DEVICES names only it).
        os.environ[LOCAL_RANK_ENV] = "0"
        self.cloudpickle = cloudpickle_module()

    def where(self) -> dict:
        """This rank's process id, Ray node id and IP, and the GPU ids Ray gave it."""
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]}

    def rendezvous(self) -> str:
        """Rank 0 only: the ``torch.distributed`` URL every rank joins (this node's IP, a port free on it)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{free_port(ip)}"

    def start(self, worker_cls: type, options: Any, init_method: str) -> tuple[bool, Any]:
        """Build ``worker_cls(rank, world, init_method, options)``; its ``coords``, as an answer."""
        def build() -> Any:
            self.worker = worker_cls(self.rank, self.world, init_method, options)
            return self.worker.coords

        return run_answering(build)

    def call(self, method: str, kwargs: dict) -> tuple[bool, Any]:
        """``worker.method(**kwargs)`` as an answer (``shutdown`` included)."""
        return run_answering(lambda: getattr(self.worker, method)(**unpickled(kwargs, self.cloudpickle)))


class ActorRanks:
    """``len(placement.groups)`` :class:`RankActor`\\ s where ``placement`` says (see the module docstring).

    Args:
        worker_cls: importable class built in each rank as ``worker_cls(rank, world, init_method, options)``.
        options: picklable plain data handed to every rank.
        placement: each rank's placement group, bundle and share of the bundle.
        start_timeout_s: longest wait for every rank to be placed and built.
        name: engine name used in error messages (``"megatron"``, ``"fsdp"``).
        error_cls: :class:`RankProcessError` subclass raised for failures that are not ``EngineError``.
    """

    def __init__(self, worker_cls: type, options: Any, placement: RankPlacement, start_timeout_s: float, *,
                 name: str = "engine", error_cls: type[RankProcessError] = RankProcessError):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world = len(placement.groups)
        self.name = name
        self.error_cls = error_cls
        self.placement = placement
        self.places: list[dict] = [{} for _ in range(self.world)]
        remote = ray.remote(RankActor)
        gpu = placement.resource == "GPU"
        self.actors = [
            remote.options(num_cpus=0 if gpu else share, num_gpus=share if gpu else 0, max_restarts=0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               group, placement_group_bundle_index=bundle))
            .remote(r, self.world)
            for r, (group, bundle, share) in enumerate(zip(placement.groups, placement.bundles, placement.shares))
        ]
        deadline = time.monotonic() + start_timeout_s
        try:
            self.places = self._collect("start", [a.where.remote() for a in self.actors], start_timeout_s,
                                        answers=False)
            init_method = self._collect("start", [self.actors[0].rendezvous.remote()],
                                        max(1.0, deadline - time.monotonic()), answers=False, ranks=[0])[0]
            self.coords: list[Any] = self._collect(
                "start", [a.start.remote(worker_cls, options, init_method) for a in self.actors],
                max(1.0, deadline - time.monotonic()))
        except BaseException:  # no engine comes of it: none of its ranks may stay
            self.kill()
            raise

    def call(self, method: str, timeout_s: float, **kwargs: Any) -> list[Any]:
        """Run ``method(**kwargs)`` on every rank; the answers in rank order."""
        return self._collect(method, [a.call.remote(method, kwargs) for a in self.actors], timeout_s)

    def locations(self) -> list[dict]:
        return [{"pid": p.get("pid"), "node_id": p.get("node_id"), "gpu_ids": p.get("gpu_ids")} for p in self.places]

    def _collect(self, method: str, refs: list, timeout_s: float, grace_s: float = 5.0, *,
                 answers: bool = True, ranks: list[int] | None = None) -> list[Any]:
        """Every rank's result of ``refs`` (one per rank, or per rank of ``ranks``), in rank order.

        ``answers``: each result is a :func:`~flowrl.engines.ranks.run_answering` pair. A rank whose actor
        died, a rank error left unanswered by its peers for ``grace_s``, or ``timeout_s`` passing stops
        every rank and raises; so does a rank's error once every rank has answered, but the ranks stay.
        """
        import ray

        ranks = list(range(self.world)) if ranks is None else ranks
        pending = {ref: rank for rank, ref in zip(ranks, refs)}
        results: dict[int, Any] = {}
        errors: dict[int, Any] = {}
        dead: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        first_error = None
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.2)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayActorError as error:  # killed, out of memory, its node lost
                    dead[rank] = ray_death(error)
                    continue
                except ray.exceptions.RayError as error:  # its answer could not travel (not picklable...)
                    ok, value = False, (f"{type(error).__name__}: {error}", "")
                else:
                    ok, value = value if answers else (True, value)
                (results if ok else errors)[rank] = value
                if not ok and first_error is None:
                    first_error = time.monotonic()
            now = time.monotonic()
            if pending and (dead or now > deadline or (first_error is not None and now - first_error > grace_s)):
                # Ranks blocked in a collective with a failed peer never return: stop them all.
                self.kill()
                raise self._failure(method, errors, dead)
        if dead:
            self.kill()
        if dead or errors:  # every rank answered an error: they are alive and in step (the engine stays usable)
            raise self._failure(method, errors, dead)
        return [results[r] for r in ranks]

    def _rank_name(self, rank: int) -> str:
        """``megatron-rank1 (plan node 1, Ray node 3f2a1c0d)``."""
        node_id = self.places[rank].get("node_id") if rank < len(self.places) else None
        where = [f"plan node {self.placement.nodes[rank]}"] if self.placement.nodes else []
        where += [f"Ray node {node_id[:8]}"] if node_id else []
        return f"{self.name}-rank{rank}" + (f" ({', '.join(where)})" if where else "")

    def _failure(self, method: str, errors: dict[int, Any], dead: dict[int, str]) -> Exception:
        return rank_failure(self.error_cls, self.name, method, errors,
                            {self._rank_name(r): dead[r] for r in sorted(dead)})

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to shut down (its worker leaves its process group), then end the actors."""
        if not self.actors:
            return
        try:
            self.call("shutdown", timeout_s)
        except EngineError:
            pass
        self.kill()

    def kill(self) -> None:
        """End every rank actor now and wait (up to :data:`KILL_WAIT_S`) until Ray reports each dead."""
        import ray

        actors, self.actors = self.actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + KILL_WAIT_S
        for actor in actors:
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.where.remote(), timeout=max(0.1, deadline - time.monotonic()))
                except ray.exceptions.RayActorError:
                    break
                except ray.exceptions.GetTimeoutError:
                    break
                time.sleep(0.1)


__all__ = ["RankActor", "ActorRanks", "KILL_WAIT_S", "ray_death"]
