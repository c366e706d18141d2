"""Reward resources of a plan -> objects with ``score(completions, answers, prompts)``, through :data:`REWARD_KINDS`.

A plan's :class:`~flowrl.plan.RewardPlan` names its kind (the op that declared it:
``verifier``, ``python_reward``...); the catalogue record of that op names the builder here
(``OpSpec.handler``). ``verifier("math")`` and ``python_reward("module:function")`` run in a
:class:`~flowrl.rewards.pool.RewardPool` (a user's exception costs one sample its reward,
never the run). A kind whose builder is absent (``reward_model`` until it is built) is
refused by ``flowrl check`` through its record's platforms, and here by :func:`build_reward`.
"""

from __future__ import annotations

from typing import Callable

from flowrl.catalog.ops import OpKind
from flowrl.plan import ExecutionPlan, RewardPlan
from flowrl.runtime.errors import RuntimeFlowError
from flowrl.runtime.kinds import builder_for


class _Scaled:
    """A verifier whose 1/0 results are mapped to the flow's ``correct`` / ``wrong`` rewards."""

    def __init__(self, pool, correct: float, wrong: float):
        self.pool, self.correct, self.wrong = pool, correct, wrong

    def score(self, completions, answers, prompts=None, rows=None):
        result = self.pool.score(completions, answers, prompts, rows)
        result.rewards[:] = [self.correct if r >= 1.0 else self.wrong for r in result.rewards]
        return result

    def close(self) -> None:
        self.pool.close()


def verifier(r: RewardPlan, plan: ExecutionPlan):
    """A named rule verifier; cheap, so it scores in the driver process (no pool start-up)."""
    from flowrl.rewards.pool import RewardPool

    pool = RewardPool(str(r.options["target"]), workers=0)
    return _Scaled(pool, float(r.options.get("correct", 1.0)), float(r.options.get("wrong", 0.0)))


def python_reward(r: RewardPlan, plan: ExecutionPlan):
    """A user's ``module:function`` in a pool of worker processes."""
    from flowrl.pyrefs import folder_of
    from flowrl.rewards.pool import RewardPool

    return RewardPool(str(r.options["target"]), workers=int(r.options.get("workers", 2)),
                      error_reward=float(r.options.get("on_error", 0.0)),
                      folder=folder_of(r.origin))  # the flow file's folder first, as `flowrl check` looks


def reward_model(r: RewardPlan, plan: ExecutionPlan):
    """A served reward model: scores on the model's own engine (bound to the run's engines once they start)."""
    from flowrl.runtime.reward_model import ModelReward

    return ModelReward(str(r.options["target"]), r.origin)


REWARD_KINDS: dict[str, Callable] = {f.__name__: f for f in (verifier, python_reward, reward_model)}
"""``OpSpec.handler`` of a reward op -> ``builder(reward plan, plan)``."""


def builder_of(r: RewardPlan) -> Callable:
    """The builder of ``r``'s kind (its op's ``OpSpec.handler``); a kind without one is an error."""
    return builder_for(r.kind, OpKind.REWARD_FN, REWARD_KINDS, r.origin, noun="a reward kind", listing="kinds",
                       things="rewards")


def build_reward(r: RewardPlan, plan: ExecutionPlan):
    """The scorer of reward resource ``r``."""
    from flowrl.rewards.pool import RewardSpecError

    build = builder_of(r)
    try:
        return build(r, plan)
    except (RewardSpecError, KeyError) as e:
        raise RuntimeFlowError(f"{r.origin}: {e}") from None
