"""Agent programs as environments: ``agent("my_agent:run")`` and the ``agent_rollout`` op.

An agent program is the user's function ``run(client, row)`` (``async def`` or plain ``def``): it
gets an ``openai.AsyncOpenAI`` client (``openai.OpenAI`` for a plain function) pointed at the rollout
endpoint (:mod:`flowrl.runtime.endpoint`) with its episode's key, and the dataset row; it may call
the model as often as it likes (up to ``max_turns`` calls), call tools, loop, and returns:

* a string: its answer, which the flow's reward scores (the episode's text);
* a number: the episode's reward itself (``rewards``; the text is the last completion's);
* ``None``: the last completion's text is the answer;
* a dict ``{"answer": str, "reward": float}``: both.

:class:`AgentPool` runs episodes in Ray actors (:class:`AgentWorker`, ``num_cpus = 0``, threaded: up
to ``ENV_CALLS_PER_WORKER`` episodes each), on the driver's node (the endpoint listens on
``127.0.0.1``). As with ``python_env``, a failure ends its episode only: the program raises, returns
something else, or runs past ``timeout`` seconds (its worker is killed and replaced; the other
episodes it hosted end with an error naming the timeout), or its worker dies (replaced; its episodes
end with an error: an agent's episode is not replayed, its model calls would differ).

:func:`agent_rollout` (the op's handler): ``n`` episodes per prompt, each one session of the
endpoint; while they run, the driver thread batches the waiting requests of all of them into the
rollout engine (:meth:`~flowrl.runtime.endpoint.RolloutEndpoint.pump`). Each episode's token row
is the endpoint's record (:class:`~flowrl.runtime.endpoint.Trajectory`): the ids the engine saw and
sampled, mask 1 exactly on the sampled ones. The value has what ``generate`` gives (one row per
episode, ``group_ids`` per prompt) plus ``rewards`` (what the programs returned; 0 where they
returned an answer), ``done`` and ``truncated``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import time
import zlib
from dataclasses import replace
from typing import Any

import torch

from flowrl.catalog.ops import ENV_CALLS_PER_WORKER
from flowrl.engines.types import SamplingSpec
from flowrl.plan import EnvPlan, ExecutionPlan, OpPlan
from flowrl.runtime.endpoint import RolloutEndpoint, Sampling
from flowrl.runtime.episodes import _batch, context_limit, response_length_name
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.step import Rollouts, StepContext, StepValue, op_seed

POLL_S = 0.05
"""How long the driver waits for a model request before looking at the episodes again."""


def _result(value: Any) -> tuple[str | None, float | None]:
    """(answer, reward) of what a program returned (see the module docstring)."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return value, None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(float(value)):
            raise ValueError(f"run() returned the reward {value}; rewards must be finite")
        return None, float(value)
    if isinstance(value, dict) and set(value) <= {"answer", "reward"}:
        answer, reward = value.get("answer"), value.get("reward")
        if (answer is None or isinstance(answer, str)) and (reward is None or isinstance(reward, (int, float))):
            return answer, None if reward is None else _result(float(reward))[1]
    raise TypeError(f"run() returned {type(value).__name__} {str(value)[:80]!r}; return the answer (a string), "
                    "a reward (a number), or {'answer': ..., 'reward': ...}")


class AgentWorker:
    """A Ray actor running one agent program's episodes, each in a thread of its own."""

    def __init__(self, target: str, folder: str | None, timeout: float | None):
        from flowrl.pyrefs import import_module_from, split_ref

        module, attr = split_ref(target)
        self.fn = getattr(import_module_from(module, folder), attr)
        self.timeout = timeout

    def ready(self) -> bool:
        return True

    def run(self, row: dict, base_url: str, api_key: str, model: str) -> dict:
        """One episode: ``run(client, row)``; never raises (the error is in the result)."""
        import openai

        t0 = time.time()
        kw = dict(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout)
        try:
            if inspect.iscoroutinefunction(self.fn):
                async def episode():
                    async with openai.AsyncOpenAI(**kw) as client:
                        return await self.fn(client, dict(row))
                value = asyncio.run(episode())
            else:
                with openai.OpenAI(**kw) as client:
                    value = self.fn(client, dict(row))
                if inspect.isawaitable(value):  # a plain function handing back a coroutine
                    async def finish(v=value):
                        return await v
                    value = asyncio.run(finish())
            answer, reward = _result(value)
            return {"answer": answer, "reward": reward, "seconds": time.time() - t0}
        except Exception as e:  # noqa: BLE001 - user code may raise anything: it ends this episode only
            return {"error": f"{type(e).__name__}: {e}"[:500], "seconds": time.time() - t0}


class AgentPool:
    """The workers of one ``agent(...)`` resource, and the endpoint its episodes talk to."""

    def __init__(self, env: EnvPlan, *, start: bool = True):
        from flowrl.pyrefs import folder_of

        self.plan = env
        self.target = str(env.options["target"])
        self.folder = folder_of(env.origin)
        self.timeout = float(env.options.get("timeout", 600.0)) or None
        self.max_turns = env.options.get("max_turns")
        self.size = int(env.options["workers"])
        self.restarts = 0
        self.endpoint: RolloutEndpoint | None = None
        self.workers: list = []
        if start:
            import ray

            self.node = ray.get_runtime_context().get_node_id()  # the endpoint's node: 127.0.0.1 reaches it
            self.workers = [self._spawn() for _ in range(self.size)]
            self._wait_ready(list(range(self.size)))

    def _spawn(self):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from flowrl.runtime.environment import ACTOR_ENV

        actor = ray.remote(AgentWorker).options(
            num_cpus=0, max_concurrency=ENV_CALLS_PER_WORKER,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node, soft=False),
            runtime_env={"env_vars": {k: os.environ[k] for k in ACTOR_ENV if k in os.environ}})
        return actor.remote(self.target, self.folder, self.timeout)

    def _wait_ready(self, indices: list[int]) -> None:
        import ray

        try:
            ray.get([self.workers[i].ready.remote() for i in indices])
        except Exception as e:  # noqa: BLE001 - the program could not be imported: a user error
            cause = getattr(e, "cause", None) or e
            raise RuntimeFlowError(f"{self.plan.origin}: agent `{self.plan.id}` (`{self.target}`) could not start: "
                                   f"{type(cause).__name__}: {cause}") from None

    def endpoint_for(self, tokenizer: Any, model: str) -> RolloutEndpoint:
        """The endpoint (started on first use) serving ``model`` with ``tokenizer``."""
        if self.endpoint is None or self.endpoint.model != model:
            if self.endpoint is not None:
                self.endpoint.close()
            self.endpoint = RolloutEndpoint(tokenizer, model)
        return self.endpoint

    def worker_of(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.size

    def launch(self, episodes: list[tuple[str, dict, str, str, str]]) -> list:
        """One program run per episode ``(key, row, base_url, api_key, model)``: their Ray refs."""
        return [self.workers[self.worker_of(key)].run.remote(row, url, api_key, model)
                for key, row, url, api_key, model in episodes]

    def replace_worker(self, w: int) -> None:
        """Kill worker ``w`` (stuck past a timeout, or dead) and start a fresh one."""
        import ray

        try:
            ray.kill(self.workers[w], no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.workers[w] = self._spawn()
        self.restarts += 1
        self._wait_ready([w])

    def close_episodes(self, keys: list[str]) -> None:
        """Nothing is kept per episode in the workers (a program's run is the episode)."""

    def close(self) -> None:
        import ray

        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        for actor in self.workers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self.workers = []


def agent(env: EnvPlan, plan: ExecutionPlan) -> AgentPool:
    """An ``agent("module:function")``: its pool of workers (and, on first use, its endpoint)."""
    return AgentPool(env)


# ---- the op ---------------------------------------------------------------------------------------


def _sampling(op: OpPlan, ctx: StepContext) -> tuple[Sampling, SamplingSpec]:
    o = op.options
    seed = int(o.get("seed", 0))
    s = Sampling(float(o["temperature"]), float(o["top_p"]), int(o["top_k"]), int(o["max_tokens"]),
                 tuple(o.get("stop") or ()), seed)
    spec = SamplingSpec(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                        stop=s.stop)
    return s, spec


def agent_rollout(op: OpPlan, ctx: StepContext) -> StepValue:
    """``n`` agent episodes per prompt through the endpoint (see the module docstring)."""
    import ray

    src = ctx.input(op, "prompts").fields
    pool = ctx.services.envs[op.inputs["env"]]
    n = int(op.options.get("n", 1))
    endpoint = pool.endpoint_for(ctx.services.data.tokenizer, op.model)
    sampling, spec = _sampling(op, ctx)
    endpoint.begin(sampling, context_limit(ctx.services.plan, op.model))
    prompts = src["prompt_ids"]
    rows = src.get("rows") or [{"prompt": p, "answer": a} for p, a in
                               zip(src.get("prompt_text") or [""] * len(prompts), src.get("answers") or [""] * len(prompts))]
    count = len(prompts) * n
    ids = [f"{ctx.tag}{ctx.step}.{ctx.draw}/{op.id}/{i}" for i in range(count)]
    keys = [endpoint.open_episode(e, pool.max_turns) for e in ids]
    refs = pool.launch([(e, rows[i // n], endpoint.url, k, op.model) for i, (e, k) in enumerate(zip(ids, keys))])
    results: list[dict | None] = [None] * count
    pending = {ref: i for i, ref in enumerate(refs)}
    started = time.monotonic()
    batches = [0]
    calls_before, batched_before = endpoint.engine_calls, endpoint.batched

    def generate(batch_prompts: list[list[int]]):
        seed = op_seed(ctx.services.seed + sampling.seed, ctx.step, f"{op.id}/draw{ctx.draw}/call{batches[0]}")
        batches[0] += 1
        groups, version = ctx.services.engines.generate(op.model, batch_prompts, replace(spec, seed=seed), ctx.step)
        ctx.metrics["perf/gen_tokens"] = ctx.metrics.get("perf/gen_tokens", 0) + sum(
            len(g[0].response_ids) for g in groups)
        return [g[0] for g in groups], version

    while pending:
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in done:
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the worker process died under the program
                results[i] = {"error": f"its agent worker died ({type(e).__name__})", "seconds": 0.0}
                w = pool.worker_of(ids[i])
                if not _alive(pool.workers[w]):
                    pool.replace_worker(w)
        if pending and pool.timeout is not None and time.monotonic() - started > pool.timeout:
            _give_up(pool, pending, results, ids)
            break
        if pending:
            endpoint.pump(generate, live=len(pending), wait=POLL_S)
    sessions = [endpoint.close_episode(e) for e in ids]
    engine_calls = endpoint.engine_calls - calls_before
    ctx.metrics["agent/engine_calls"] = ctx.metrics.get("agent/engine_calls", 0) + engine_calls
    ctx.metrics["agent/batch_mean"] = (endpoint.batched - batched_before) / max(engine_calls, 1)
    return _value(op, ctx, src, n, prompts, sessions, results)


def _alive(actor) -> bool:
    import ray

    try:
        ray.get(actor.ready.remote(), timeout=5)
        return True
    except Exception:  # noqa: BLE001 - dead or stuck: either way replaced
        return False


def _give_up(pool: AgentPool, pending: dict, results: list, ids: list[str]) -> None:
    """Episodes still running past the timeout end with an error; their workers are replaced (the
    other episodes they hosted end too, naming the timeout)."""
    stuck = sorted({pool.worker_of(ids[i]) for i in pending.values()})
    for i in pending.values():
        results[i] = {"error": f"the agent program ran longer than its timeout of {pool.timeout:g}s", "seconds":
                      pool.timeout}
    for w in stuck:
        pool.replace_worker(w)
    pending.clear()


def _value(op: OpPlan, ctx: StepContext, src: dict, n: int, prompts: list, sessions: list, results: list) -> StepValue:
    count = len(sessions)
    trajectories = [s.trajectory(list(prompts[i // n])) for i, s in enumerate(sessions)]
    rows = [(t.ids, t.mask, t.logprobs) for t in trajectories]
    batch = _batch(rows, ctx.services.data.pad_id)
    errors = [(i, r["error"] + (f" (the endpoint refused its request: {sessions[i].refused[-1]})"
                                 if sessions[i].refused else ""))
              for i, r in enumerate(results) if r is not None and "error" in r]
    texts, rewards = [], []
    for t, r in zip(trajectories, results):
        last = t.calls[-1].text if t.calls else ""
        texts.append(r.get("answer") if r and r.get("answer") is not None else last)
        rewards.append(float(r["reward"]) if r and r.get("reward") is not None else 0.0)
    firsts = [next((j for j, m in enumerate(t.mask) if m > 0), len(t.ids)) for t in trajectories]
    oldest = min((t.version for t in trajectories if t.calls), default=0)  # an episode that sampled nothing
    out = {
        "prompt_ids": [t.ids[:f] for t, f in zip(trajectories, firsts)],
        "response_ids": [t.ids[f:] for t, f in zip(trajectories, firsts)],
        "response_mask": batch.response_mask,
        "rollout_logprobs": batch.extras["rollout_logprobs"],
        "group_ids": torch.arange(count // max(n, 1)).repeat_interleave(n),
        "version": [t.version if t.calls else oldest for t in trajectories],
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "done": torch.ones(count, dtype=torch.bool),
        "truncated": torch.tensor([t.truncated for t in trajectories]),
    }
    for key, values in src.items():  # per-prompt fields repeat for each of the prompt's episodes
        if key not in out and isinstance(values, list) and len(values) * n == count:
            out[key] = [v for v in values for _ in range(n)]
    calls = [len(t.calls) for t in trajectories]
    ctx.metrics.update({
        "env/turns_mean": sum(calls) / max(count, 1), "env/turns_max": max(calls, default=0),
        "env/calls": ctx.metrics.get("env/calls", 0) + sum(calls),
        "env/errors": ctx.metrics.get("env/errors", 0) + len(errors),
        "env/truncated": sum(t.truncated for t in trajectories),
        "env/latency_s_mean": sum(r.get("seconds", 0.0) for r in results if r) / max(count, 1),
        "agent/off_row_calls": sum(t.off_row for t in trajectories),
        "agent/refused": sum(len(s.refused) for s in sessions),
        response_length_name(op, ctx.services.plan): float(batch.response_mask.sum()) / max(count, 1),
    })
    if errors:
        ctx.services.events.env_errors(op, ctx.step, errors)
    return StepValue(out, Rollouts(op.model, batch, tuple(t or "" for t in texts)))


__all__ = ["AgentPool", "AgentWorker", "agent", "agent_rollout"]
