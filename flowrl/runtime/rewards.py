"""Reward resources of a plan -> objects with ``score(completions, answers, prompts)``, through :data:`REWARD_KINDS`.

A plan's :class:`~flowrl.plan.RewardPlan` names its kind (the op that declared it:
``verifier``, ``python_reward``...); the catalogue record of that op names the builder here
(``OpSpec.handler``). ``verifier("math")`` and ``python_reward("module:function")`` run in a
:class:`~flowrl.rewards.pool.RewardPool` (a user's exception costs one sample its reward,
never the run); a ``reward_model`` scores token rows on its model's engine (``score_tokens``);
a ``weighted_sum`` adds the weighted scores of rewards built before it; an ``llm_judge`` generates
on its model's rollout engine. A kind whose builder is absent is refused by ``flowrl check``
through its record's platforms, and here by :func:`build_reward`. :func:`score_rollouts` scores a
batch with any of them.

Every scorer has ``correct``: the reward at or above which a completion counts as right in the
held-out accuracy (a verifier's ``correct`` option; 1.0 for a ``python_reward``, by convention),
or None where a reward has no such value (a reward model's or a judge's score, a sum holding one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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


@dataclass(frozen=True)
class ScoreJob:
    """One batch of completions to score, in every form a reward may read."""

    texts: list[str]
    answers: list[str]
    prompts: list[str] | None
    rows: list[dict] | None
    batch: Any
    """The rollouts' token rows (:class:`~flowrl.engines.types.TokenBatch`; ``score_tokens`` reads them)."""
    step: int


def score_rollouts(reward, job: ScoreJob):
    """``reward``'s :class:`~flowrl.rewards.pool.RewardResult` of ``job``: a served model scores the
    token rows (nothing decoded and re-encoded), one that reads the whole job (a combined reward, a judge
    that generates at the step) its ``score_job``, the rest the texts."""
    if hasattr(reward, "score_job"):
        return reward.score_job(job)
    if hasattr(reward, "score_tokens"):
        return reward.score_tokens(job.batch, job.step)
    return reward.score(job.texts, job.answers, job.prompts, rows=job.rows)


class WeightedSum:
    """``weighted_sum(a, b, ..., weights = [wa, wb, ...])``: each reward scores the batch as it
    would alone; the reward is ``sum(w * score)``. A part's failed samples keep its ``on_error``
    reward (weighted) and are reported. ``correct`` (what the held-out accuracy counts as right) is
    the sum when every part gives its ``correct`` reward; None when a part has none."""

    def __init__(self, parts: list[tuple[str, Any, float]]):
        self.parts = parts
        rights = [p.correct for _, p, _ in parts]
        self.correct = None if None in rights else sum(w * c for (_, _, w), c in zip(parts, rights))

    def _combine(self, results: list) -> Any:
        from flowrl.rewards.pool import RewardResult

        n = len(results[0].rewards)
        total = [sum(w * res.rewards[i] for (_, _, w), res in zip(self.parts, results)) for i in range(n)]
        errors = sorted((e for res in results for e in res.errors), key=lambda e: e.index)
        return RewardResult(total, errors, {name: list(res.rewards) for (name, _, _), res in zip(self.parts, results)},
                            recovered=sorted((e for res in results for e in res.recovered), key=lambda e: e.index),
                            output=sorted(o for res in results for o in res.output))

    def score_job(self, job: ScoreJob):
        return self._combine([score_rollouts(p, job) for _, p, _ in self.parts])

    def score(self, completions, answers, prompts=None, rows=None):
        return self._combine([p.score(completions, answers, prompts, rows=rows) for _, p, _ in self.parts])

    def close(self) -> None:
        """Nothing of its own: its parts are the run's rewards, closed with them."""


def verifier(r: RewardPlan, plan: ExecutionPlan, built: dict):
    """A named rule verifier; cheap, so it scores in the driver process (no pool start-up)."""
    from flowrl.rewards.pool import RewardPool

    pool = RewardPool(str(r.options["target"]), workers=0, fn_kwargs={"timeout_s": float(r.options.get("timeout", 5.0))})
    return _Scaled(pool, float(r.options.get("correct", 1.0)), float(r.options.get("wrong", 0.0)))


def eval_verifier(name: str) -> _Scaled:
    """The rule verifier ``name`` (1.0 right, 0.0 wrong), in the driver: what a dataset's
    ``eval_reward`` scores its held-out rows with."""
    from flowrl.rewards.pool import RewardPool

    return _Scaled(RewardPool(name, workers=0), 1.0, 0.0)


def reasoning_gym_score(r: RewardPlan, plan: ExecutionPlan, built: dict):
    """Each completion's score by its row's Reasoning Gym task (:mod:`flowrl.rewards.reasoning_gym`), partial
    credit kept; in the driver (a cached generator and a scorer call per sample). A row it cannot score costs
    that sample ``on_error`` and is reported, as any reward's error."""
    from flowrl.rewards.pool import RewardPool

    return RewardPool("reasoning_gym", workers=0, error_reward=float(r.options.get("on_error", 0.0)),
                      fn_kwargs={"extract_mode": str(r.options.get("extract", "auto"))})


def python_reward(r: RewardPlan, plan: ExecutionPlan, built: dict):
    """A user's ``module:function`` in a pool of worker processes."""
    from flowrl.pyrefs import folder_of
    from flowrl.rewards.pool import RewardPool

    return RewardPool(str(r.options["target"]), workers=int(r.options.get("workers", 2)),
                      error_reward=float(r.options.get("on_error", 0.0)), timeout_s=float(r.options.get("timeout", 60.0)),
                      folder=folder_of(r.origin))  # the flow file's folder first, as `flowrl check` looks


def reward_model(r: RewardPlan, plan: ExecutionPlan, built: dict):
    """A served reward model: scores on the model's own engine (bound to the run's engines once they start)."""
    from flowrl.runtime.reward_model import ModelReward

    from flowrl.runtime.materialize import tokenizer_model

    return ModelReward(str(r.options["target"]), r.origin, policy=tokenizer_model(plan))


def llm_judge(r: RewardPlan, plan: ExecutionPlan, built: dict):
    """A generative judge on its model's rollout engine (bound to the run's engines once they start)."""
    from flowrl.runtime.judge import LLMJudge

    return LLMJudge(str(r.options["target"]), str(r.options["template"]), int(r.options["max_tokens"]),
                    float(r.options["on_error"]), r.origin)


def weighted_sum(r: RewardPlan, plan: ExecutionPlan, built: dict):
    """The weighted sum of rewards built before it (:func:`build_rewards` builds parts first)."""
    return WeightedSum([(name, built[name], float(w)) for name, w in zip(r.options["parts"], r.options["weights"])])


REWARD_KINDS: dict[str, Callable] = {f.__name__: f for f in (verifier, python_reward, reward_model, llm_judge,
                                                             weighted_sum, reasoning_gym_score)}
"""``OpSpec.handler`` of a reward op -> ``builder(reward plan, plan, rewards built so far by name)``."""


def builder_of(r: RewardPlan) -> Callable:
    """The builder of ``r``'s kind (its op's ``OpSpec.handler``); a kind without one is an error."""
    return builder_for(r.kind, OpKind.REWARD_FN, REWARD_KINDS, r.origin, noun="a reward kind", listing="kinds",
                       things="rewards")


def build_reward(r: RewardPlan, plan: ExecutionPlan, built: dict | None = None):
    """The scorer of reward resource ``r`` (``built``: the rewards it combines, by name)."""
    from flowrl.rewards.pool import RewardSpecError

    build = builder_of(r)
    try:
        return build(r, plan, built or {})
    except (RewardSpecError, KeyError) as e:
        raise RuntimeFlowError(f"{r.origin}: {e}") from None


def build_rewards(plan: ExecutionPlan) -> dict:
    """Every reward of ``plan`` by name, each built once, the rewards a ``weighted_sum`` names before it."""
    todo = {r.id: r for r in plan.rewards}
    built: dict = {}

    def build(rid: str) -> None:
        r = todo[rid]
        for part in r.options.get("parts", ()):
            if part not in built:
                build(part)
        built[rid] = build_reward(r, plan, built)

    try:
        for rid in todo:
            if rid not in built:
                build(rid)
    except BaseException:
        for reward in built.values():
            reward.close()
        raise
    return built
