"""The engines of a run: one :class:`ModelEngines` record per model, on Ray where the plan placed them.

:class:`Fleet` starts Ray (or joins a cluster), reserves one placement group per node,
starts every engine's actors in the bundles the plan names (a train engine is one actor, which
for an engine with several ranks coordinates one rank actor per rank, each in its own bundle
on its planned node; a rollout engine one actor per data-parallel replica), opens every resync's weight-sync
protocol, and then serves the handlers' engine calls (it is the run's
:class:`~flowrl.runtime.step.EngineService`): ``generate`` split over the replicas,
``forward`` and ``train`` on the train engine, ``resync``. Policy versions live in the
model's record: ``train_version`` counts updates, ``rollout_version`` names the weights the
rollout engine holds. Every wait on an engine call has the watchdog's deadline
(:mod:`flowrl.runtime.watchdog`), and a resync a replica received damaged is sent once more.

Engines that share GPUs take turns where the plan says so (:class:`MemoryTurns`, reading
:attr:`flowrl.plan.EnginePlan.releases`): before a generation the colocated trainers offload
their state and the rollout engine wakes; before a train-engine call the rollout engines
sleep and the trainer reloads. On the ``cpu`` platform the plan releases nothing and every
engine stays resident.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from flowrl.catalog.precision import DEFAULT_PRECISION
from flowrl.engines.base import DEVICE_ENV
from flowrl.plan import ExecutionPlan, ModelPlan, OpPlan
from flowrl.runtime.checkpoints import complete_checkpoints, step_of
from flowrl.runtime.environment import ACTOR_ENV, keeps, local_ray_pids, local_ray_processes, stop_processes
from flowrl.runtime.errors import ModelLoadError, RuntimeFlowError, user_error
from flowrl.runtime.observe import SETUP_STEP
from flowrl.runtime.placement import (COORDINATOR_SHARE, actor_location, check_cluster_fits, no_gpu_warning, node_of,
                                      node_targets, on_gpus, processes_per_node, rank_actors, rank_placement,
                                      slot_resource, wait_placed)
from flowrl.runtime.rundir import own, own_inside
from flowrl.runtime.step import op_seed
from flowrl.runtime.watchdog import EngineDied, EngineHung, SyncBroken, Watchdog, WatchdogSettings, actor_died, \
    died_cause

def actor_env(plan: ExecutionPlan) -> dict[str, str]:
    """What a run's engine actors get in their ``runtime_env`` (their rank actors inherit it) on top of
    the scrubbed environment of Ray's processes (:mod:`flowrl.runtime.environment`, the one policy): this
    process's :data:`~flowrl.runtime.environment.ACTOR_ENV` (never a secret), and for a plan not on GPUs
    :data:`~flowrl.engines.base.DEVICE_ENV` = ``cpu``, so that on a machine with GPUs the engines compute
    on the CPU the plan was made for (Ray gives each a logical GPU slot whose id names a real GPU)."""
    env = {k: os.environ[k] for k in ACTOR_ENV if k in os.environ and keeps(k)}
    if not on_gpus(plan):
        env[DEVICE_ENV] = "cpu"
    return env


@dataclass
class Faults:
    """Failures a test can inject to prove they are caught."""

    corrupt_bucket_at_step: int | None = None
    """Flip one byte of the first weight bucket sent after this step's update."""
    corrupt_sends: int | None = None
    """How many sends of that step's resync are corrupted: None, every one (the resend too, so the
    run stops); 1, only the first (the resend delivers intact weights and the run goes on)."""
    lose_bucket_at_step: int | None = None
    """Lose one bucket (``inplace``: the handoff's last; ``checkpoint``: the first file) of the resync
    sent after this step's update, on the first send only: the resend delivers it."""
    break_sync_at_step: int | None = None
    """Break the group of the collective resync (``broadcast``) sent after this step's update, from rollout
    replica 0 as the sync starts, on the first send only; how: :attr:`break_sync_by`."""
    break_sync_by: str = "kill"
    """``kill``: replica 0's process SIGKILLs itself (an engine killed mid-broadcast); ``close``: it shuts its
    end of the group down and stays alive (a connection that drops)."""
    hang_at_step: int | None = None
    """Every rollout replica's ``generate`` sleeps :data:`HANG_S` at this step: a hung engine (the watchdog's case)."""
    stop_after_step: int | None = None
    """Exit (as if killed) right after this step finished and was checkpointed."""
    sigterm_after_step: int | None = None
    """Send this process SIGTERM (a scheduler's preemption) right after this step's metrics are logged."""
    kill_at_step: int | None = None
    """SIGKILL (``kill -9``) the first actor of :attr:`kill_engine` while its call of this step runs."""
    kill_engine: str = "policy.rollout"
    """The engine (``model.rollout`` or ``model.train``) :attr:`kill_at_step` kills."""
    kill_rank: int | None = None
    """With :attr:`kill_at_step` and a train engine with rank actors (``fsdp``, ``megatron``, ``torch``
    with dp > 1): SIGKILL this rank's actor process instead of the engine's (coordinating) actor."""
    nan_at_step: int | None = None
    """The floating-point inputs of this step's updates (advantages, old and reference log-probs) carry a NaN, as
    a diverged reward or value would make them: the train engine finds a non-finite loss (``on_nan``)."""
    in_checkpoint: Callable[[int, Path], None] | None = None
    """Called with a checkpoint's step and its temporary directory once its files are written, before its
    manifest: a harness's own fault (``bench/chaos.py`` kills the process there, or raises ENOSPC)."""
    at_generate: Callable[[int], None] | None = None
    """Called with the step right after each generate is sent: a harness's own fault (``bench/chaos.py``
    removes a Ray node there)."""


SYNC_SETTLE_S = 10.0
"""How long the driver waits, once a collective sync's transport broke, for the other ends' calls to end
(a receiver that died ends at once; one still waiting on the broken group ends at its transport's timeout,
and is not waited for past this)."""

SETTLE_S = 60.0
"""How long the driver asks Ray about an actor it called unavailable before naming it with that word
(Ray marks a node dead after its health checks fail: seconds)."""


def _alive(actor_self) -> bool:
    """Run inside an actor (``__ray_call__``): it answers."""
    return True


HANG_S = 3600.0
"""How long :attr:`Faults.hang_at_step` makes a generate sleep, seconds (far past any test's deadline)."""


@dataclass
class SyncEnds:
    """The Ray actors holding both ends of one model's weight sync."""

    protocol: str
    """The plan's protocol name (``inplace``, ``broadcast``, ``checkpoint``, ``delta``...)."""
    collective: bool
    """Sender and receivers run together (no handoff through the object store)."""
    sender: Any
    """The TrainWorker actor (rank 0 of a collective)."""
    receivers: list
    """The RolloutWorker actors, one per data-parallel replica (ranks 1..N)."""


@dataclass
class ModelEngines:
    """One model's engines: its train engine's actor, its rollout replicas, their versions, its weight sync."""

    plan: ModelPlan
    train: Any = None
    """The TrainWorker actor (None: the model is only generated from, or only a reference...)."""
    rollout: list = field(default_factory=list)
    """The RolloutWorker actors, one per data-parallel replica."""
    train_version: int = 0
    """Updates the train engine has taken."""
    rollout_version: int = 0
    """The train version whose weights the rollout engine holds."""
    sync: SyncEnds | None = None


# ---- memory turns -------------------------------------------------------------------------------


class MemoryTurns:
    """Which engines hold their GPU memory now, and the calls that hand shared GPUs from one phase to the other.

    ``call(engine, method, step, *args)`` runs ``method`` (``offload``, ``reload``, ``sleep``,
    ``wake_up``) on every actor of engine ``engine`` (``policy.train``, ``policy.rollout``) during
    ``step``.
    Only engines whose plan says they release memory are ever called; a rollout engine is
    woken in two halves around a resync (weights first, then the KV cache once the trainers
    offloaded), as veRL's hybrid engine does.
    """

    def __init__(self, plan: ExecutionPlan, call: Callable[..., None]):
        self.call = call
        self.engines: dict[str, Any] = {}
        for m in plan.models:
            for role, e in (("train", m.train_engine), ("rollout", m.rollout_engine)):
                if e is not None:
                    self.engines[f"{m.id}.{role}"] = e
        self.state = {name: "resident" for name in self.engines}
        """Engine -> ``resident`` | ``offloaded`` (train) | ``asleep`` | ``weights`` (rollout, weights only)."""
        self.lock = threading.Lock()

    def _sharing(self, name: str, role: str, how: str) -> list[str]:
        """Engines of ``role`` on ``name``'s GPUs that release memory by ``how``."""
        gpus = set(self.engines[name].gpus)
        return [other for other, e in self.engines.items()
                if other != name and other.endswith(f".{role}") and e.releases == how and gpus & set(e.gpus)]

    def _set(self, name: str, state: str, step: int, method: str, *args: Any) -> None:
        self.call(name, method, step, *args)
        self.state[name] = state

    def before_generate(self, model: str, step: int) -> None:
        """The trainers on the rollout engine's GPUs offload; the rollout engine wakes (its KV cache too)."""
        name = f"{model}.rollout"
        if name not in self.engines:
            return
        with self.lock:
            for trainer in self._sharing(name, "train", "offload"):
                if self.state[trainer] == "resident":
                    self._set(trainer, "offloaded", step, "offload")
            if self.state[name] == "asleep":
                self._set(name, "resident", step, "wake_up", None)
            elif self.state[name] == "weights":
                self._set(name, "resident", step, "wake_up", ["kv_cache"])

    def before_train(self, model: str, step: int) -> None:
        """The rollout engines on the train engine's GPUs sleep; the train engine reloads its state."""
        name = f"{model}.train"
        if name not in self.engines:
            return
        with self.lock:
            for rollout in self._sharing(name, "rollout", "sleep"):
                if self.state[rollout] != "asleep":
                    self._set(rollout, "asleep", step, "sleep")
            if self.state[name] == "offloaded":
                self._set(name, "resident", step, "reload")

    def before_resync(self, model: str, step: int) -> None:
        """The trainer holds its weights and the rollout engine its weights (not yet its KV cache)."""
        self.before_train(model, step)
        name = f"{model}.rollout"
        with self.lock:
            if self.state.get(name) == "asleep":
                self._set(name, "weights", step, "wake_up", ["weights"])


def served_roles(plan: ExecutionPlan) -> dict[str, str]:
    """Model id -> the train-engine role a resource serving it asks for (``reward_model(m)``: ``reward``),
    read from the resource op's record (``OpSpec.serves_model``)."""
    from flowrl.catalog.ops import OPS

    out = {}
    for r in plan.rewards:
        spec = OPS.get(r.kind)
        if (spec is not None and spec.serves_model and spec.serves_engine == "train"
                and isinstance(r.options.get("target"), str)):
            out[r.options["target"]] = spec.serves_model
    return out


# ---- the fleet ------------------------------------------------------------------------------------


class Fleet:
    """Every model's engines on Ray (see the module docstring); the handlers' engine service."""

    def __init__(self, plan: ExecutionPlan, out: Path, *, timeline: Any, log: Callable[[str], None],
                 ray_address: str | None = None, faults: Faults | None = None):
        self.plan = plan
        self.out = out
        self.timeline = timeline
        self.log = log
        self.ray_address = ray_address
        self.faults = faults or Faults()
        self.models: dict[str, ModelEngines] = {m.id: ModelEngines(m) for m in plan.models}
        # Reading a rollout version and submitting work to that rollout engine happen together,
        # so every sample's version tag names the weights that produced it.
        self.rollout_lock = threading.Lock()
        self.turns = MemoryTurns(plan, self._call_engine)
        self.pgs: list = []
        self.slot = "GPU"  # the Ray resource a plan GPU takes (placement.slot_resource), set when Ray starts
        self.node_targets: list = []
        self.gpus_per_node = int(plan.cluster["gpus_per_node"])
        self.watchdog = Watchdog(WatchdogSettings.from_env())
        """Every wait on an engine call has a deadline (:mod:`flowrl.runtime.watchdog`)."""
        self.lost: set = set()
        """Actors that hung (a call passed its deadline) or died: shutdown does not wait on them."""
        self.placed: dict[int, dict] = {}
        """Each actor's row of ``placement.json`` (by ``id(actor)``): where an engine that died ran."""
        self.rank_pids: dict[str, list[int]] = {}
        """Engine (``policy.train``) -> its rank actors' process ids, in rank order (engines with rank actors)."""
        self.started_ray = False
        """This run called ``ray.init`` (shutdown disconnects again); a Ray session the caller had already
        started (a notebook's, a test's shared instance) is left running."""
        self.ray_pids: list[int] = []
        """The processes of the local Ray instance this run started (``gcs_server``, ``raylet``...): in a
        session of their own, so shutdown stops them by process id (whatever ``ray.shutdown`` left)."""

    # ---- start -------------------------------------------------------------------------------
    def start(self, model_paths: dict[str, Path]) -> None:
        """Ray, the placement groups, every engine's actors (ready), ``placement.json``, the weight syncs;
        each a ``start:*`` span of the trace (the actors' own start-up on their lanes)."""
        def span(name: str):
            return self.timeline.span(name, "driver", SETUP_STEP)

        with span("start:ray"):
            self._start_ray()
        with span("start:engines"):
            self._start_workers(model_paths)
        with span("start:placement"):
            self.record_placement()
        with span("start:syncs"):
            self._open_syncs()

    def _start_ray(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        address = self.ray_address or os.environ.get("RAY_ADDRESS")
        gpus = int(self.plan.cluster["nodes"]) * self.gpus_per_node
        if not ray.is_initialized():
            self.started_ray = True
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                # Logical GPUs: on a CPU machine Ray schedules by them exactly as on a GPU cluster.
                # address="local": a fresh instance of our own, even when `ray start` left one
                # running here (plain ray.init() would join it and then refuse num_gpus).
                # Ray's processes: the scrubbed environment, a session of their own (environment.py)
                with local_ray_processes():
                    ray.init(address="local", num_cpus=max(os.cpu_count() or 2, 2), num_gpus=gpus,
                             include_dashboard=False, log_to_driver=False, configure_logging=False)
                self.ray_pids = local_ray_pids()
        # One placement group per node, one bundle per GPU: an engine rank planned on global
        # GPU g runs in bundle g % gpus_per_node of node g // gpus_per_node's group, so pools
        # (colocated or disaggregated, on one node or several) land where the plan put them.
        per_node = self.gpus_per_node
        check_cluster_fits(self.plan, ray.nodes(), address)
        self.slot = slot_resource(self.plan, ray.nodes())
        # Plan nodes go to distinct Ray nodes when the cluster has enough of them (a node's
        # group pinned by Ray's node-id label); a logical cluster on one Ray node packs them.
        self.node_targets = node_targets(self.plan, ray.nodes())
        self.pgs = [placement_group([{self.slot: 1}] * per_node, strategy="STRICT_PACK",
                                    name=f"flowrl-{self.plan.flow}-node{k}",
                                    bundle_label_selector=[{"ray.io/node-id": t}] * per_node if t else None)
                    for k, t in enumerate(self.node_targets)]
        wait_placed(self.plan, self.pgs, address, self.slot)

    def _actor(self, cls, engine, rank: int, *args, fraction: float = 1.0, **kwargs):
        """An actor of ``cls`` in the bundle of ``engine``'s ``rank``, taking ``fraction`` of that rank's share."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = (engine.gpus or engine.bundles or (0,))[rank]  # the global GPU id the plan gave this rank
        pg = self.pgs[gpu // self.gpus_per_node]
        share = round(engine.gpus_per_rank * fraction, 4)  # Ray counts resources in 1e-4 units
        remote = ray.remote(cls).options(
            # a rank takes its share of its GPU slot: a GPU, or a core of a CPU-only cluster
            num_cpus=share if self.slot == "CPU" else 0,
            num_gpus=share if self.slot == "GPU" else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=gpu % self.gpus_per_node),
            runtime_env={"env_vars": actor_env(self.plan)})
        return remote.remote(*args, **kwargs)

    def _start_workers(self, model_paths: dict[str, Path]) -> None:
        from flowrl.runtime.workers import RolloutWorker, TrainWorker

        temps = sampling_temperatures(self.plan)
        share = processes_per_node(self.plan)
        served = served_roles(self.plan)
        pending = []  # (actor, ready ref, its name)
        for rec in self.models.values():
            m = rec.plan
            path = str(model_paths[m.id])
            dtype = str(m.args.get("dtype", "float32"))
            if m.train_engine is not None:
                e = m.train_engine
                role = served.get(m.id) or ("critic" if m.role == "critic" else "actor")
                # An engine with rank actors: this actor coordinates them from a sliver of rank 0's slot
                # (where the ranks' weights gather for a resync: on GPUs it sees rank 0's GPU).
                ranked = rank_actors(e)
                placement = rank_placement(self.plan, e, self.pgs, self.slot) if ranked else None
                rec.train = self._actor(TrainWorker, e, 0, e, path, role=role,
                                        optim=m.optim, temperature=temps.get(m.id, temps.get(m.base, 1.0)),
                                        seed=self.plan.run.seed, dtype=dtype, share=share[node_of(self.plan, e, 0)],
                                        precision=str(m.args.get("precision", DEFAULT_PRECISION)),
                                        lora=m.args.get("lora"), placement=placement,
                                        fraction=COORDINATOR_SHARE if ranked else 1.0)
                pending.append((rec.train, rec.train.ready.remote(), f"{m.id}.train"))
            if m.rollout_engine is not None:
                e = m.rollout_engine
                rec.rollout = [self._actor(RolloutWorker, e, r * e.tp, e, path, seed=self.plan.run.seed + r,
                                           dtype=dtype, share=share[node_of(self.plan, e, r * e.tp)],
                                           lora=m.args.get("lora"))
                               for r in range(e.dp)]
                pending += [(a, a.ready.remote(), f"{m.id}.rollout replica {r}") for r, a in enumerate(rec.rollout)]
        t0 = time.time()
        try:
            started = self._wait(pending, "every engine", "start", 0)
        except Exception as error:
            failed = self._load_failure(pending, model_paths, error)
            if failed is None:
                raise
            raise failed from error
        for (_, _, who), times in zip(pending, started):  # each actor's start-up (RolloutWorker.ready)
            lane = who.replace(" replica ", "")  # the lanes the steps' calls use: policy.train, policy.rollout0
            self.timeline.add("start:process", lane, SETUP_STEP, times["process"], max(times["process"], times["init"]))
            self.timeline.add("start:engine", lane, SETUP_STEP, times["init"], times["built"])
        self.log(f"engines ready in {time.time() - t0:.1f}s: "
                 + ", ".join(f"{m.id}({'/'.join(e.kind for e in (m.train_engine, m.rollout_engine) if e)})"
                             for m in self.plan.models if m.train_engine or m.rollout_engine))

    def _load_failure(self, pending: list, model_paths: dict[str, Path], error: BaseException) -> ModelLoadError | None:
        """An engine whose constructor raised at start-up (Ray: ``actor_init_failed``; it loads the model
        there) as a :class:`ModelLoadError` naming the model, its directory, the engine and the constructor's
        exception (Ray keeps only the text of its traceback); None for any other failure."""
        import ray

        if not getattr(error, "actor_init_failed", False) or user_error(error) is not None:
            return None
        for _, ref, who in pending:
            done, _ = ray.wait([ref], timeout=0)
            try:
                if done:
                    ray.get(done[0], timeout=0)
                    continue
            except Exception:  # noqa: BLE001 - this actor's constructor is the one that raised
                pass
            else:
                continue
            model = self.models[who.split(".")[0]].plan
            return ModelLoadError(model.origin, model.id, f"`{who}`", str(model_paths[model.id]), error)
        return None

    def record_placement(self) -> list[dict]:
        """Where every engine actor landed, next to where the plan put it; written to ``placement.json``.

        One row per actor: ``engine`` (``policy.rollout``), ``rank``, the plan's ``pool``, ``gpu``
        (global id) and ``node``; Ray's ``placement_group`` index and ``bundle``, the Ray node the
        bundle is on (``bundle_node_id``) and the one the actor reports (``node_id``), the
        logical GPU ids Ray gave it (``gpu_ids``) and the device its engine computes on (``device``: a
        plan on GPUs whose actors see none is warned about, :func:`no_gpu_warning`).
        """
        from ray.util.placement_group import placement_group_table

        bundle_nodes = [placement_group_table(pg)["bundles_to_node_id"] for pg in self.pgs]
        rows, calls = [], []
        for rec in self.models.values():
            m = rec.plan
            for engine, role, actors, step in ((m.train_engine, "train", [rec.train] if rec.train else [], 1),
                                               (m.rollout_engine, "rollout", rec.rollout,
                                                m.rollout_engine.tp if m.rollout_engine else 1)):
                for i, actor in enumerate(actors):
                    gpu = (engine.gpus or engine.bundles or (0,))[i * step]
                    node, bundle = divmod(gpu, self.gpus_per_node)
                    rows.append({"engine": f"{m.id}.{role}", "rank": i * step, "pool": engine.pool, "gpu": gpu,
                                 "node": node, "placement_group": node, "bundle": bundle,
                                 "target_node_id": self.node_targets[node],
                                 "bundle_node_id": bundle_nodes[node].get(bundle)})
                    calls.append((actor, actor.__ray_call__.remote(actor_location), f"{m.id}.{role} rank {i * step}"))
        for row, (node_id, gpu_ids, pid, device), (actor, _, _) in zip(
                rows, self._wait(calls, "every engine", "report its location", 0), calls):
            row.update(node_id=node_id, gpu_ids=gpu_ids, device=device)
            self.placed[id(actor)] = {**row, "pid": pid}
        warning = no_gpu_warning(self.plan, rows)
        if warning:
            self.log(warning)
        rows += self._rank_rows(bundle_nodes)
        own(self.out, "placement.json")
        (self.out / "placement.json").write_text(json.dumps(rows, indent=1))
        return rows

    def _rank_rows(self, bundle_nodes: list[dict]) -> list[dict]:
        """``placement.json``'s rows of the rank actors of engines that have them (``"actor": "rank"``; the
        engine's own row is its coordinator); their process ids go to :attr:`rank_pids`."""
        rows = []
        for rec in self.models.values():
            e = rec.plan.train_engine
            if rec.train is None or not rank_actors(e):
                continue
            name = f"{rec.plan.id}.train"
            where, = self._wait([(rec.train, rec.train.rank_locations.remote(), _who("train", 0))], name,
                                "report its ranks' locations", 0)
            self.rank_pids[name] = [w["pid"] for w in where]
            for rank, w in enumerate(where):
                gpu = (e.gpus or e.bundles)[rank]
                node, bundle = divmod(gpu, self.gpus_per_node)
                rows.append({"engine": name, "rank": rank, "actor": "rank", "pool": e.pool, "gpu": gpu, "node": node,
                             "placement_group": node, "bundle": bundle, "target_node_id": self.node_targets[node],
                             "bundle_node_id": bundle_nodes[node].get(bundle), "node_id": w["node_id"],
                             "gpu_ids": w["gpu_ids"]})
        return rows

    def _open_syncs(self) -> None:
        """Open both ends of every resync's protocol, once the workers are ready.

        The sender opens first: a collective (``broadcast``) sender listens on its node's
        address on a free port (port 0: race-free) for a world of 1 sender + the rollout
        replicas, and the driver forwards that rendezvous, with each replica's rank.
        """
        from flowrl.runtime.sync.from_plan import collective, sync_options

        for r in self.plan.resyncs:
            rec = self.models[r.model]
            sender, receivers = rec.train, rec.rollout
            options = sync_options(r, self.out)
            if options.get("directory"):  # `checkpoint` versions in the run directory: flowrl's (retention deletes them)
                own_inside(self.out, options["directory"])
            together = collective(r, options)
            world = {"world_size": 1 + len(receivers), "port": 0} if together else {}
            rendezvous, = self._wait([(sender, sender.open_sync.remote(r.protocol, "sender", {**options, **world}),
                                       "train actor (the sender)")], f"{r.model}.train", "open_sync", 0)
            per_rank = [{**options, **({"rendezvous": rendezvous, "rank": rank} if together else {})}
                        for rank in range(1, len(receivers) + 1)]  # rank 0 is the sender
            self._wait([(a, a.open_sync.remote(r.protocol, "receiver", opts), f"replica {i}")
                        for i, (a, opts) in enumerate(zip(receivers, per_rank))], f"{r.model}.rollout", "open_sync", 0)
            rec.sync = SyncEnds(r.protocol, together, sender, receivers)
            self.log(f"resync {r.model} via {r.protocol} ({r.transport or 'ray'}"
                     f"{', collective' if together else ''}), every {r.every} step(s)")

    # ---- waiting on engines (the watchdog) -----------------------------------------------------
    def _wait(self, calls: list[tuple[Any, Any, str]], engine: str, call: str, step: int) -> list:
        """The results of ``calls`` (``(actor, object ref, who)``, in order), within the watchdog's deadline
        for ``engine``'s ``call`` (:mod:`flowrl.runtime.watchdog`); ``step`` is 0-based. Past the deadline:
        :class:`~flowrl.runtime.watchdog.EngineHung`, and the actors count as hung."""
        try:
            return self.watchdog.wait([ref for _, ref, _ in calls], engine, call, step,
                                      [who for _, _, who in calls], self._resume_hint())
        except EngineHung:
            self.lost.update(id(actor) for actor, _, _ in calls)
            raise
        except EngineDied as died:
            dead = [actor for actor, _, who in calls if who in died.fields["who"].split(", ")]
            self.lost.update(id(actor) for actor in dead)
            cause = self._settled(dead[0], died.__cause__, died.fields["cause"]) if dead else died.fields["cause"]
            raise EngineDied(**{**died.fields, "cause": cause, "node": self._where(dead[0]) if dead else None}) \
                from died.__cause__

    def _settled(self, actor, error: BaseException | None, cause: str) -> str:
        """Ray's last word on an actor it called *unavailable* (a socket closed: its node may be going, and
        Ray decides within seconds): ping it until Ray says it died (and why), up to :data:`SETTLE_S`."""
        import ray

        if not isinstance(error, ray.exceptions.ActorUnavailableError):
            return cause
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            try:
                ray.get(actor.__ray_call__.remote(_alive), timeout=max(1.0, deadline - time.monotonic()))
                return f"{cause} (it answers again: the call was lost on the way)"
            except ray.exceptions.ActorUnavailableError:
                time.sleep(1.0)
            except ray.exceptions.RayActorError as final:
                return died_cause(final)
            except ray.exceptions.GetTimeoutError:
                break
        return cause

    def _kill_injected(self, engine: str, step: int, actors: list) -> None:
        """:attr:`Faults.kill_at_step`: ``kill -9`` of ``engine``'s first actor while its call of ``step`` runs."""
        if self.faults.kill_at_step == step and self.faults.kill_engine == engine and actors:
            pid = self.placed[id(actors[0])]["pid"]
            os.kill(pid if self.faults.kill_rank is None else self.rank_pids[engine][self.faults.kill_rank],
                    signal.SIGKILL)

    def _where(self, actor) -> str | None:
        """Where ``actor`` ran, in words, and which other engines ran on that Ray node (they are gone too
        when the node is): ``plan node 1 (Ray node 3f2a1c0d, also running policy.train rank 0)``."""
        row = self.placed.get(id(actor))
        if row is None:  # died before the engines reported their places
            return None
        others = [f"{r['engine']} rank {r['rank']}" for a, r in self.placed.items()
                  if a != id(actor) and r["node_id"] == row["node_id"]]
        return (f"plan node {row['node']} (Ray node {str(row['node_id'])[:8]}"
                + (f", also running {', '.join(others)})" if others else ")"))

    def _resume_hint(self) -> str:
        """What continues this run after it stopped: its last complete checkpoint stays."""
        ckpts = complete_checkpoints(self.out)
        if ckpts:
            return f"`flowrl run --resume {self.out}` continues from its checkpoint of step {step_of(ckpts[-1])}"
        return "no checkpoint was written yet (`--save-every N` writes them), so run it again"

    # ---- memory turns ------------------------------------------------------------------------
    def _call_engine(self, name: str, method: str, step: int, *args: Any) -> None:
        """Run ``method`` on every actor of engine ``name`` (``model.role``); timeline spans per actor."""
        model, role = name.rsplit(".", 1)
        rec = self.models[model]
        actors = [rec.train] if role == "train" else rec.rollout
        results = self._wait([(a, getattr(a, method).remote(*args), _who(role, i)) for i, a in enumerate(actors)],
                             name, method, step)
        for rank, result in enumerate(results):
            t0, t1 = result[-2], result[-1]
            self.timeline.add(f"{method}:{model}", f"{name}{rank if role == 'rollout' else ''}", step, t0, t1)

    # ---- engine calls (the handlers' EngineService) ----------------------------------------------
    def generate(self, model: str, prompts: list, spec, step: int) -> tuple[list, int]:
        """Completions grouped per prompt, and the rollout version (weights) that produced them."""
        from flowrl.runtime.workers import split

        rec = self.models[model]
        self.turns.before_generate(model, step)
        chunks = split(prompts, len(rec.rollout))
        stall = HANG_S if self.faults.hang_at_step == step else 0.0
        with self.rollout_lock:
            version = rec.rollout_version
            calls = [(a, a.generate.remote(chunk, spec, stall), _who("rollout", r))
                     for r, (a, chunk) in enumerate(zip(rec.rollout, chunks)) if chunk]
        self._kill_injected(f"{model}.rollout", step, rec.rollout)
        if self.faults.at_generate is not None:
            self.faults.at_generate(step)
        groups = []
        for rank, (result, t0, t1) in enumerate(self._wait(calls, f"{model}.rollout", "generate", step)):
            self.timeline.add(f"generate[{rank}]", f"{model}.rollout{rank}", step, t0, t1)
            groups += result
        return groups, version

    def forward(self, model: str, batch, step: int, *, entropy: bool = False, values: bool = False,
                adapters: bool = True) -> dict:
        import torch

        from flowrl.runtime.workers import batch_to_numpy

        self.turns.before_train(model, step)
        actor = self.models[model].train
        (out, t0, t1), = self._wait([(actor, actor.forward.remote(batch_to_numpy(batch), entropy, values, adapters),
                                      _who("train", 0))], f"{model}.train", "forward", step)
        self.timeline.add(f"forward:{model}", f"{model}.train", step, t0, t1)
        return {k: torch.from_numpy(np.array(v)) for k, v in out.items()}  # Ray hands back read-only arrays

    def train(self, model: str, batch, loss: dict, op: OpPlan, step: int) -> list:
        from flowrl.runtime.workers import batch_to_numpy

        rec = self.models[model]
        self.turns.before_train(model, step)
        o = op.options
        if self.faults.nan_at_step == step:
            batch = _poisoned(batch)
        ref = rec.train.train.remote(batch_to_numpy(batch), loss, int(o["micro_batch"]), int(o["minibatches"]),
                                     int(o["epochs"]), op_seed(self.plan.run.seed, step, op.id),
                                     int(o.get("micro_batch_tokens", 0)), bool(o.get("pack", False)))
        self._kill_injected(f"{model}.train", step, [rec.train])
        (stats, t0, t1), = self._wait([(rec.train, ref, _who("train", 0))], f"{model}.train", "train", step)
        self.timeline.add(f"train:{model}", f"{model}.train", step, t0, t1)
        rec.train_version += 1
        return stats

    def train_version(self, model: str) -> int:
        return self.models[model].train_version

    def resync(self, resync_id: str, step: int, metrics: dict) -> None:
        plan = next(r for r in self.plan.resyncs if r.id == resync_id)
        if (step + 1) % plan.every:
            return
        self.push_weights(plan.model, step, metrics)

    def push_weights(self, model: str, step: int, metrics: dict) -> None:
        """Trainer -> every rollout replica by the resync's protocol; each replica verifies what arrived.

        Sender and receivers are submitted together: a collective runs them concurrently;
        otherwise each receiver's call waits for the sender's handoff, which travels as an
        object ref (trainer -> object store -> replicas, never through this process).
        A receiver that finds damage (a CRC-32 or a size that differs: ``CorruptedWeights``) or
        a part missing (a bucket, a file: ``LostWeights``) loads nothing; the whole resync is then
        sent once more, afresh (a ``delta`` sends every tensor), counted in ``faults/sync_resent``;
        the same in the resend too stops the run naming the tensor, bucket and both CRCs (or
        what is missing). No generation is submitted meanwhile: the pipeline
        drained its producers before the resync.
        Records ``sync/*`` metrics (bytes, buckets, seconds, the protocol) and timeline spans.
        """
        from flowrl.runtime.sync.from_plan import sync_metrics

        rec = self.models[model]
        self.turns.before_resync(model, step)
        version = rec.train_version
        t0 = time.time()
        with self.rollout_lock:  # generations submitted after this point see the new weights
            sent = self._send(model, version, step, attempt=0)
            rec.rollout_version = version
        try:
            sent_stats, s0, s1, results = self._sent(model, step, *sent)
            resent = 0
        except Exception as error:
            if not _corrupted(error):
                raise
            self.log(f"warning: weight sync of `{model}` at step {step + 1}: "
                     f"{user_error(error) or type(error).__name__}; sending it once more (faults/sync_resent)")
            with self.rollout_lock:
                sent = self._send(model, version, step, attempt=1)
            try:
                sent_stats, s0, s1, results = self._sent(model, step, *sent)
            except Exception as again:
                if not _corrupted(again):
                    raise
                raise RuntimeFlowError(f"weight sync of `{model}` at step {step + 1} arrived damaged or incomplete "
                                       f"twice (sent once more after the first): {user_error(again)}") from again
            resent = 1
        ends = rec.sync
        t1 = time.time()
        self.timeline.add(f"resync:{model}", "sync", step, t0, t1, protocol=ends.protocol,
                          bytes=sent_stats["bytes"], buckets=sent_stats["buckets"])
        self.timeline.add(f"sync_send:{ends.protocol}", f"{model}.train", step, s0, s1)
        for rank, (_, r0, r1) in enumerate(results):
            self.timeline.add(f"sync_receive:{ends.protocol}", f"{model}.rollout{rank}", step, r0, r1)
        metrics.update(sync_metrics(ends.protocol, sent_stats, [r[0] for r in results], t1 - t0))
        metrics["faults/sync_resent"] = metrics.get("faults/sync_resent", 0) + resent

    def _send(self, model: str, version: int, step: int, attempt: int) -> tuple:
        """Submit one send of ``model``'s weights and every replica's receive; (sender ref, handoff ref,
        receiver refs).
        ``attempt`` 1 is the resend: afresh, so a ``delta`` sends every tensor."""
        ends, f = self.models[model].sync, self.faults
        corrupt = f.corrupt_bucket_at_step == step and (f.corrupt_sends is None or attempt < f.corrupt_sends)
        lose = f.lose_bucket_at_step == step and attempt == 0
        breaks = f.break_sync_by if f.break_sync_at_step == step and attempt == 0 else None
        sent, handoff = ends.sender.sync_send.options(num_returns=2).remote(version, corrupt, attempt > 0, lose)
        return sent, handoff, [a.sync_receive.remote(None if ends.collective else handoff, breaks if i == 0 else None)
                               for i, a in enumerate(ends.receivers)]

    def _sent(self, model: str, step: int, sent, handoff, pending: list) -> tuple:
        """Wait for a send (:meth:`_send`): (sender stats, t0, t1, every receiver's result). A collective's
        transport that broke is :meth:`_broken`'s to name."""
        import ray

        ends = self.models[model].sync
        receivers = [(a, ref, _who("rollout", i)) for i, (a, ref) in enumerate(zip(ends.receivers, pending))]
        try:  # the sender's error (an abort) first: the receivers only echo it
            (sent_stats, s0, s1), = self._wait([(ends.sender, sent, SENDER)], f"{model}.train", "sync_send", step)
        except Exception as error:
            if ends.collective:  # nobody reads a collective's handoff: its copy of the sender's error is read here,
                with contextlib.suppress(Exception):  # or Ray prints it as an "unhandled error" when the ref goes
                    ray.get(handoff, timeout=0)
            if _caused_by(error, _transport_broken()):
                self._broken(model, step, error, receivers)
            raise
        try:
            results = self._wait(receivers, f"{model}.rollout", "sync_receive", step)  # CorruptedWeights names the tensor
        except Exception as error:
            if _caused_by(error, _transport_broken()):
                self._broken(model, step, None, receivers)
            raise
        return sent_stats, s0, s1, results

    def _broken(self, model: str, step: int, sender_error: BaseException | None, receivers: list) -> None:
        """A collective sync's transport broke (the sender's error, or a receiver's): raise what broke it.

        A receiver whose actor died (``kill -9`` mid-broadcast, its node lost: the sender then finds the
        connection closed) is :class:`EngineDied`, named with its node; with every end alive it is
        :class:`SyncBroken`, with what each end said. Receivers still waiting on the broken group after
        :data:`SYNC_SETTLE_S` answer nothing until their transport's timeout: they count as lost (killed,
        not asked to close, when the run's engines stop).
        """
        import ray

        refs = [ref for _, ref, _ in receivers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=SYNC_SETTLE_S)
        dead = [call for call in receivers if call[1] in ready and actor_died(call[1])]
        if dead:
            self._wait(dead, f"{model}.rollout", "sync_receive", step)  # raises EngineDied, naming its node
        said = [f"the sender: {_reason(sender_error)}"] if sender_error else []
        for actor, ref, who in receivers:
            if ref not in ready:
                self.lost.add(id(actor))
                said.append(f"{who}: still waiting on the group")
                continue
            try:
                ray.get(ref)
                said.append(f"{who}: received the sync")
            except Exception as failed:  # noqa: BLE001 - each end's own words go into the one line
                said.append(f"{who}: {_reason(failed)}")
        raise SyncBroken(model, self.models[model].sync.protocol, step, "; ".join(said), self._resume_hint())

    # ---- checkpoints -------------------------------------------------------------------------
    def versions(self) -> dict:
        """``{"train_version": {model: n}, "rollout_version": {model: n}}`` (part of a checkpoint)."""
        return {"train_version": {k: r.train_version for k, r in self.models.items()},
                "rollout_version": {k: r.rollout_version for k, r in self.models.items()}}

    def save(self, directory: Path, step: int) -> None:
        """Every train engine's state into ``directory/<model>``."""
        trained = [rec for rec in self.models.values() if rec.train is not None]
        for rec in trained:
            self.turns.before_train(rec.plan.id, step)
        refs = [rec.train.save.remote(str(directory / rec.plan.id)) for rec in trained]
        for rec, ref in zip(trained, refs):  # submitted together, waited for in turn
            self._wait([(rec.train, ref, _who("train", 0))], f"{rec.plan.id}.train", "save", step)

    def restore(self, directory: Path, state: dict, step: int) -> None:
        """Load every train engine's state and versions, then give the rollout engines the restored weights."""
        trained = [rec for rec in self.models.values() if rec.train is not None]
        for rec in trained:
            self.turns.before_train(rec.plan.id, step)
        refs = [rec.train.load.remote(str(directory / rec.plan.id)) for rec in trained]
        for rec, ref in zip(trained, refs):
            self._wait([(rec.train, ref, _who("train", 0))], f"{rec.plan.id}.train", "load", step)
        for model, version in state["train_version"].items():
            self.models[model].train_version = int(version)
        for r in self.plan.resyncs:
            self.push_weights(r.model, step, {})
        for model, version in state["rollout_version"].items():
            self.models[model].rollout_version = int(version)

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the syncs (while the actors live), stop the actors, free the placement groups; a Ray
        session this run started is ended (a local instance stops; a cluster it joined goes on)."""
        import ray

        try:
            if ray.is_initialized():
                self._close_syncs()
                self._release_placement()
                if self.started_ray:
                    ray.shutdown()
        finally:  # even when a second Ctrl-C cut the above short: no Ray process of this run outlives it
            pids, self.ray_pids = self.ray_pids, []
            stop_processes(pids)

    def _close_syncs(self) -> None:
        """Close every protocol end (process groups, stores); a failing or hung end is only logged."""
        import ray

        for model, rec in self.models.items():
            ends, rec.sync = rec.sync, None
            if ends is None:
                continue
            if any(id(a) in self.lost for a in (ends.sender, *ends.receivers)):
                continue  # a hung or dead actor answers nothing: it is killed with the others, its transport too
            try:
                ray.get([a.close_sync.remote() for a in (ends.sender, *ends.receivers)], timeout=30)
            except Exception as error:  # shutting down after a failure: the run's own error matters more
                self.log(f"warning: closing the `{ends.protocol}` weight sync of `{model}` failed: "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")

    def _release_placement(self) -> None:
        """Stop this run's engine actors and free its placement groups.

        Needed on a Ray cluster that outlives the run (``ray_address``): its GPUs would stay
        reserved for the next run otherwise. A local Ray instance is shut down anyway.
        """
        import ray
        from ray.util.placement_group import remove_placement_group

        # Rollout engines stop their own processes and files first (vLLM's engine core and cache
        # directory, SGLang's scheduler): ray.kill ends an actor without running its clean-up.
        # Train engines with rank actors stop them (their process groups closed) and wait until Ray has
        # ended them, so none outlives the run on a cluster that does (Ray would end them with their
        # coordinator anyway, but later).
        live = [a for rec in self.models.values() for a in rec.rollout if id(a) not in self.lost]
        ranked = [rec.train for rec in self.models.values()
                  if rec.train is not None and id(rec.train) not in self.lost and rank_actors(rec.plan.train_engine)]
        try:
            ray.get([a.shutdown.remote() for a in live] + [a.stop_ranks.remote() for a in ranked], timeout=60)
        except Exception as error:  # shutting down after a failure: the run's own error matters more
            self.log(f"warning: stopping the engines failed: {type(error).__name__}: "
                     f"{str(error).splitlines()[0] if str(error) else ''}")
        for rec in self.models.values():
            for actor in ([rec.train] if rec.train else []) + rec.rollout:
                ray.kill(actor)
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []


def _poisoned(batch):
    """``batch`` with a NaN in every floating-point extra (:attr:`Faults.nan_at_step`)."""
    extras = {k: v.clone() for k, v in batch.extras.items()}
    for v in extras.values():
        if v.is_floating_point() and v.numel():
            v.view(-1)[0] = float("nan")
    return replace(batch, extras=extras)


def _corrupted(error: BaseException | None) -> bool:
    """Whether ``error`` (or the actor error Ray wrapped in it) is damage or a loss a resend may cure
    (``LostWeights`` is a ``CorruptedWeights``)."""
    from flowrl.runtime.weight_sync import CorruptedWeights

    return _caused_by(error, CorruptedWeights)


def _reason(error: BaseException) -> str:
    """What one end of a sync said, without its hint (the fault's own line says what to do)."""
    return (user_error(error) or type(error).__name__).split("; hint:", 1)[0]


def _transport_broken() -> type:
    from flowrl.runtime.weight_sync import TransportBroken

    return TransportBroken


def _caused_by(error: BaseException | None, kind: type) -> bool:
    """Whether ``error``, or an error it wraps (Ray's actor error, a ``raise ... from``), is a ``kind``."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, kind):
            return True
        error = getattr(error, "cause", None) or error.__cause__
    return False


SENDER = "train actor (the sender)"
"""The sender of a weight sync, in words."""


def _who(role: str, index: int) -> str:
    """The actor of engine role ``role`` (``train`` / ``rollout``) and index ``index``, in words."""
    return f"replica {index}" if role == "rollout" else "train actor"


def sampling_temperatures(plan: ExecutionPlan) -> dict[str, float]:
    """Each model's logprobs must use the temperature its rollouts were sampled at."""
    from flowrl.catalog.ops import OpKind

    temps = {}
    for op in plan.ops:
        if op.kind == OpKind.GENERATE and op.model:
            temps[op.model] = float(op.options.get("temperature", 1.0)) or 1.0
    for m in plan.models:
        if m.base in temps and m.id not in temps:
            temps[m.id] = temps[m.base]
    return temps


__all__ = ["Faults", "SyncEnds", "ModelEngines", "MemoryTurns", "Fleet", "sampling_temperatures", "ACTOR_ENV",
           "actor_env"]
