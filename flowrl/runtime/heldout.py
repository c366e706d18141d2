"""Held-out accuracy during a run: completions of the eval split, scored by the flow's reward
(or by the dataset's ``eval_reward`` verifier, where it names one).

The pass picks its ops by role, not by position (:func:`eval_pass`): the ``score`` whose
rollouts come from the *trained policy* (a model some ``update`` trains with a policy loss,
per the loss's catalogue record), and the ops between that score and the ``sample`` that
drew the prompts (whose dataset has the ``eval`` split):

* single-turn: the policy's ``generate``, fed by the ``sample``;
* multi-turn: the policy's first ``generate``, then the ``repeat`` loop of ``env_step`` and
  continuing ``generate`` whose last turn the score reads. The held-out pass plays the same
  episodes on the eval rows through the runtime's own handlers (same environments, same
  token layout, same end conditions), every turn at the pass's temperature; its environment
  episodes are its own (``StepContext.tag``).

A flow without such a chain (no trained policy, prompts that do not come straight from a
dataset, other ops between) has no held-out pass.

What counts as right: a reward at or above its scorer's ``correct`` (a verifier's ``correct``
option, 1.0 for ``python_reward``). A reward model's or a judge's score has no such value: a flow
that trains against one reports ``eval/reward`` only, unless its dataset names a rule verifier
for the held-out rows (``jsonl(..., eval_reward = "math")``, as veRL's validation reward is the
data source's rule while training reads a reward model), which then scores them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flowrl.catalog.losses import LOSSES
from flowrl.catalog.ops import OpKind
from flowrl.plan import ExecutionPlan, OpPlan
from flowrl.runtime.episodes import run_region, units
from flowrl.runtime.handlers import handler_of, prompt_value
from flowrl.runtime.rewards import ScoreJob, eval_verifier, score_rollouts
from flowrl.runtime.step import Services, StepContext

_CONTINUES = {OpKind.GENERATE.value: "prompts", OpKind.ENV_STEP.value: "rollouts"}
"""Ops a held-out chain may hold, and the argument each reads the chain's value from."""


@dataclass(frozen=True)
class HeldOutPass:
    """The ops the held-out pass runs (see the module docstring)."""

    sample: OpPlan
    """The ``sample`` whose dataset's eval split the pass plays."""
    ops: tuple[OpPlan, ...]
    """From the policy's first ``generate`` to the op the score reads, in plan order (a
    ``repeat`` region's ops included)."""
    score: OpPlan
    """The ``score`` of the last op's rollouts."""

    @property
    def generate(self) -> OpPlan:
        """The first ``generate``: its model is the policy, its options the completion budget."""
        return self.ops[0]

    @property
    def multi_turn(self) -> bool:
        return len(self.ops) > 1


def trained_policies(plan: ExecutionPlan) -> list[str]:
    """Models an ``update`` trains with a policy loss (its record's ``model_role``), in plan order."""
    out: list[str] = []
    for op in plan.ops:
        loss = op.options.get("loss") if op.kind == OpKind.UPDATE else None
        record = LOSSES.get(loss.get("name")) if isinstance(loss, dict) else None
        if record is not None and record.model_role == "trainable" and op.model not in out:
            out.append(op.model)
    return out


def eval_pass(plan: ExecutionPlan) -> HeldOutPass | None:
    """The held-out pass of ``plan`` (see the module docstring), or None."""
    for policy in trained_policies(plan):
        for score in plan.ops:
            if score.kind == OpKind.SCORE:
                found = _chain(plan, score, policy)
                if found is not None:
                    return found
    return None


def _chain(plan: ExecutionPlan, score: OpPlan, policy: str) -> HeldOutPass | None:
    ops = {op.id: op for op in plan.ops}
    chain: list[OpPlan] = []
    cur = ops.get(score.inputs.get("rollouts"))
    while cur is not None and cur.kind in _CONTINUES:
        chain.append(cur)
        cur = ops.get(cur.inputs.get(_CONTINUES[cur.kind]))
    if cur is None or cur.kind != OpKind.SAMPLE or not chain:
        return None
    regions = {op.region for op in chain if op.region is not None}
    ids = {op.id for op in chain}
    run = tuple(op for op in plan.ops if op.id in ids or (op.region is not None and op.region in regions))
    if run[0].kind != OpKind.GENERATE or run[0].region is not None:
        return None
    for op in run:
        if op.kind not in _CONTINUES or (op.kind == OpKind.GENERATE and op.model != policy):
            return None  # another model's turn, or an op the pass does not replay
    return HeldOutPass(cur, run, score)


@dataclass(frozen=True)
class HeldOutScores:
    """What a held-out pass produced: per eval row, its completions' rewards."""

    rewards: list[list[float]]
    """Per eval row, the reward of each of its ``n`` completions (episodes)."""
    metrics: dict
    """The episodes' ``env/*`` metrics (multi-turn passes only)."""
    correct: float | None
    """The reward at or above which a completion is right (None: the scorer has no such value)."""


def play(services: Services, hp: HeldOutPass, rows: list[dict], *, n: int, temperature: float, seed: int,
         step: int) -> HeldOutScores:
    """``n`` completions (episodes) per row at ``temperature``, scored by the pass's reward
    (:func:`held_out_reward`).

    The runtime's own handlers run the pass's ops on the eval rows, in a context of the pass's
    own (no partial-rollout buffers; its environment episodes apart), and the reward scores the
    last op's rollouts as the ``score`` handler gives them (``score_rollouts``)."""
    dataset = hp.sample.inputs["dataset"]
    ctx = StepContext(step, replace(services, partial={}), {hp.sample.id: prompt_value(services.data, dataset, rows)},
                      tag="eval")

    def run_op(op: OpPlan) -> None:
        if op.kind == OpKind.GENERATE:
            extra = {"n": n} if op.id == hp.generate.id else {}
            op = replace(op, options={**op.options, **extra, "temperature": temperature, "seed": seed})
        ctx.values[op.id] = handler_of(op)(op, ctx)

    for unit in units(list(hp.ops)):
        if unit[0].region is None:
            run_op(unit[0])
        else:
            run_region(unit, ctx, run_op)
    last = ctx.values[hp.score.inputs["rollouts"]]
    reward = held_out_reward(services, hp)
    flat = score_rollouts(reward, ScoreJob(list(last.rollouts.texts), last.get("answers"), last.get("prompt_text"),
                                           last.get("rows"), last.rollouts.batch, step)).rewards
    metrics = {f"eval/{k}": v for k, v in ctx.metrics.items() if k.startswith("env/") and not k.endswith("_total")}
    return HeldOutScores([flat[i * n:(i + 1) * n] for i in range(len(rows))], metrics, reward.correct)


def held_out_reward(services: Services, hp: HeldOutPass):
    """What scores the held-out rows: the verifier the dataset's ``eval_reward`` names, else the reward
    of the pass's ``score``."""
    dataset = next(d for d in services.plan.datasets if d.id == hp.sample.inputs["dataset"])
    if dataset.eval_reward:
        return eval_verifier(dataset.eval_reward)
    return services.rewards[hp.score.inputs["reward"]]


def greedy_eval(services: Services, step: int) -> dict:
    """``eval/reward`` and ``eval/accuracy`` (rewards at least the scorer's ``correct``; absent where it has
    none) on the eval split, greedy (every turn of an episode too), and a multi-turn pass's ``eval/env/*``;
    empty when the flow has no held-out pass or its dataset no eval split."""
    hp = eval_pass(services.plan)
    if hp is None:
        return {}
    rows = services.data.eval_rows(hp.sample.inputs["dataset"])
    if not rows:
        return {}
    out = play(services, hp, rows, n=1, temperature=0.0, seed=0, step=step)
    r = [g[0] for g in out.rewards]
    accuracy = {} if out.correct is None else {"eval/accuracy": sum(x >= out.correct - 1e-9 for x in r) / len(r)}
    return {"eval/reward": sum(r) / len(r), **accuracy, **out.metrics}


__all__ = ["HeldOutPass", "HeldOutScores", "trained_policies", "eval_pass", "held_out_reward", "play",
           "greedy_eval"]
