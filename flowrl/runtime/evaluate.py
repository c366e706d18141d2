"""Held-out evaluation without training (``flowrl eval``): greedy accuracy and pass@k.

Built on the driver's public pieces: a :class:`~flowrl.runtime.driver.Runtime` sets up the
plan's engines, :meth:`~flowrl.runtime.driver.Runtime.restore` loads a checkpoint into them
(the train engine's weights, pushed to the rollout engines by the plan's resync), and the
held-out pass (:mod:`flowrl.runtime.heldout`) picks the ops: the ``generate`` of the trained
policy, the dataset its ``sample`` reads (its ``eval`` split) and the reward of its ``score``.

Two measurements on the eval split:

* **greedy**: one completion per prompt at temperature 0; ``accuracy`` is the share scored
  at least the reward's ``correct`` value (1.0 for verifiers), as ``eval/accuracy`` in a run
  (None for a reward without one, a reward model's score, unless the dataset names an
  ``eval_reward``: :mod:`flowrl.runtime.heldout`).
* **sampled**: ``n`` completions per prompt at ``temperature``; ``pass@k`` for each ``k <= n``
  by the unbiased estimator of Chen et al. (2021), averaged over prompts:
  ``pass@k = 1 - C(n - c, k) / C(n, k)`` for a prompt with ``c`` correct of ``n`` (none where
  nothing counts as correct).

>>> pass_at_k(n=4, c=1, k=1), pass_at_k(n=4, c=1, k=4), pass_at_k(n=4, c=0, k=2)
(0.25, 1.0, 0.0)
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flowrl.plan import ExecutionPlan


class EvalError(ValueError):
    """An evaluation that cannot be made as asked (no held-out split, a checkpoint of other models)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` of the ``n`` samples (``c`` correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalResult:
    prompts: int
    """Held-out prompts evaluated (the whole eval split)."""
    greedy_accuracy: float | None
    """None where the held-out reward has no ``correct`` value (a reward model's score)."""
    greedy_reward: float
    n: int
    """Completions sampled per prompt (0: no sampled pass)."""
    temperature: float
    pass_at: dict[int, float] = field(default_factory=dict)
    """k -> pass@k (0..1), for the k asked that are <= n."""
    sampled_reward: float | None = None
    """Mean reward of the sampled completions."""
    checkpoint: str | None = None
    """The checkpoint evaluated (None: the flow's initial model)."""
    dataset: str = ""

    def to_dict(self) -> dict:
        return {**asdict(self), "pass_at": {str(k): v for k, v in self.pass_at.items()}}


def evaluate(plan: ExecutionPlan, checkpoint: Path | None = None, *, n: int = 8, ks: tuple[int, ...] = (1,),
             temperature: float = 1.0, seed: int = 0, ray_address: str | None = None, log=None) -> EvalResult:
    """Greedy accuracy and pass@k of ``plan``'s trained policy on its held-out split.

    ``checkpoint``: a ``checkpoints/step_NNNNNN`` directory of a run of these models (None: the
    models as the flow builds them). Engines start as for a run (in a scratch directory), and stop.
    """
    from flowrl.runtime.driver import Runtime
    from flowrl.runtime.heldout import eval_pass, greedy_eval
    from flowrl.runtime.observe import Timeline

    hp = eval_pass(plan)
    if hp is None:
        raise EvalError(f"{plan.source}: flow `{plan.flow}` has no held-out pass: it needs a `generate` of the trained "
                        "policy on prompts a `sample` draws from a dataset (and, multi-turn, the `repeat` loop of "
                        "`env_step` and `generate` after it), scored by a `score`")
    dataset = next(d for d in plan.datasets if d.id == hp.sample.inputs["dataset"])
    if not (dataset.eval_path or dataset.options.get("eval") or dataset.parts):  # a file, a split, a mixture's
        raise EvalError(f"{dataset.origin}: dataset `{dataset.id}` has no held-out split; "
                        f'declare one: jsonl("train.jsonl", eval = "test.jsonl")')
    if checkpoint is not None:
        trained = {m.id for m in plan.models if m.train_engine is not None}
        saved = {p.name for p in checkpoint.iterdir() if p.is_dir()}
        if not trained <= saved:
            raise EvalError(f"{checkpoint} holds the weights of {', '.join(sorted(saved)) or 'no model'}, "
                            f"not of {', '.join(sorted(trained - saved))}: evaluate it with the flow it was trained with")
    with tempfile.TemporaryDirectory(prefix="flowrl-eval-") as scratch:
        rt = Runtime(plan, Path(scratch), ray_address=ray_address, log=log)
        rt.timeline = Timeline(plan.flow)
        try:
            rt.setup()
            if checkpoint is not None:
                rt.restore(checkpoint)
            greedy = greedy_eval(rt.services, 0)
            result = EvalResult(len(rt.services.data.eval_rows(dataset.id)), greedy.get("eval/accuracy"),
                                greedy["eval/reward"], n, temperature,
                                checkpoint=str(checkpoint) if checkpoint else None, dataset=dataset.eval_path)
            if n > 0:
                _sampled(rt.services, hp, result, ks, seed)
        finally:
            rt.shutdown()
    return result


def _sampled(services, hp, result: EvalResult, ks: tuple[int, ...], seed: int) -> None:
    """pass@k from ``result.n`` completions (episodes) per held-out prompt at ``result.temperature``."""
    from flowrl.runtime.heldout import play

    rows = services.data.eval_rows(hp.sample.inputs["dataset"])
    out = play(services, hp, rows, n=result.n, temperature=result.temperature, seed=seed, step=0)
    groups = out.rewards
    result.sampled_reward = sum(sum(g) for g in groups) / sum(len(g) for g in groups)
    if out.correct is None:
        return
    hits = [sum(r >= out.correct - 1e-9 for r in g) for g in groups]
    for k in sorted({k for k in ks if 1 <= k <= result.n}):
        result.pass_at[k] = sum(pass_at_k(len(g), c, k) for g, c in zip(groups, hits)) / len(groups)


__all__ = ["EvalError", "EvalResult", "evaluate", "pass_at_k"]
