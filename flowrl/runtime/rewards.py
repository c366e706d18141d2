"""Reward resources of a plan -> objects with ``score(completions, answers, prompts)``.

``verifier("math")`` and ``python_reward("module:function")`` run in a
:class:`~flowrl.rewards.pool.RewardPool` (a user's exception costs one sample its reward,
never the run). ``reward_model(m)`` is scored by a frozen model and is not in this build.
"""

from __future__ import annotations

from flowrl.plan import ExecutionPlan, RewardPlan
from flowrl.runtime.handlers import RuntimeFlowError


class _Scaled:
    """A verifier whose 1/0 results are mapped to the flow's ``correct`` / ``wrong`` rewards."""

    def __init__(self, pool, correct: float, wrong: float):
        self.pool, self.correct, self.wrong = pool, correct, wrong

    def score(self, completions, answers, prompts=None):
        result = self.pool.score(completions, answers, prompts)
        result.rewards[:] = [self.correct if r >= 1.0 else self.wrong for r in result.rewards]
        return result

    def close(self) -> None:
        self.pool.close()


def build_reward(r: RewardPlan, plan: ExecutionPlan):
    from flowrl.rewards.pool import RewardPool, RewardSpecError

    try:
        if r.kind == "verifier":
            # Built-in verifiers are cheap: score in the driver process (no pool start-up).
            pool = RewardPool(str(r.options["target"]), workers=0)
            return _Scaled(pool, float(r.options.get("correct", 1.0)), float(r.options.get("wrong", 0.0)))
        if r.kind == "python_reward":
            return RewardPool(str(r.options["target"]), workers=int(r.options.get("workers", 2)),
                              error_reward=float(r.options.get("on_error", 0.0)))
    except (RewardSpecError, KeyError) as e:
        raise RuntimeFlowError(f"{r.origin}: {e}") from None
    raise RuntimeFlowError(f"{r.origin}: `{r.kind}` rewards cannot run in this build yet "
                           "(use verifier(...) or python_reward(\"module:function\"))")
