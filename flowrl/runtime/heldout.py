"""Held-out accuracy during a run: greedy completions of the eval split, scored by the flow's reward.

The pass picks its ops by role, not by position: the ``generate`` of the *trained policy*
(a model some ``update`` trains with a policy loss, per the loss's catalogue record), the
``sample`` that feeds it its prompts (whose dataset has the ``eval`` split) and the
``score`` of those rollouts (whose reward judges the answers). A flow without such a
triple (no trained policy, prompts that do not come straight from a dataset) has no
held-out pass.
"""

from __future__ import annotations

from flowrl.catalog.losses import LOSSES
from flowrl.catalog.ops import OpKind
from flowrl.engines.types import SamplingSpec
from flowrl.plan import ExecutionPlan, OpPlan
from flowrl.runtime.step import Services


def trained_policies(plan: ExecutionPlan) -> list[str]:
    """Models an ``update`` trains with a policy loss (its record's ``model_role``), in plan order."""
    out: list[str] = []
    for op in plan.ops:
        loss = op.options.get("loss") if op.kind == OpKind.UPDATE else None
        record = LOSSES.get(loss.get("name")) if isinstance(loss, dict) else None
        if record is not None and record.model_role == "trainable" and op.model not in out:
            out.append(op.model)
    return out


def eval_ops(plan: ExecutionPlan) -> tuple[OpPlan, OpPlan, OpPlan] | None:
    """The ``(sample, generate, score)`` the held-out pass runs (see the module docstring), or None."""
    ops = {op.id: op for op in plan.ops}
    for policy in trained_policies(plan):
        for gen in plan.ops:
            if gen.kind != OpKind.GENERATE or gen.model != policy:
                continue
            sample = ops.get(gen.inputs.get("prompts"))
            score = next((op for op in plan.ops if op.kind == OpKind.SCORE and op.inputs.get("rollouts") == gen.id),
                         None)
            if sample is not None and sample.kind == OpKind.SAMPLE and score is not None:
                return sample, gen, score
    return None


def greedy_eval(services: Services, step: int) -> dict:
    """``eval/reward`` and ``eval/accuracy`` (rewards at least the reward's ``correct``) on the eval split;
    empty when the flow has no held-out pass or its dataset no eval split."""
    ops = eval_ops(services.plan)
    if ops is None:
        return {}
    sample, gen, score = ops
    dataset = sample.inputs["dataset"]
    rows = services.data.eval_rows(dataset)
    if not rows:
        return {}
    prompt, answer = services.data.columns(dataset)
    prompts = [r[prompt] for r in rows]
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=int(gen.options["max_tokens"]),
                        stop=tuple(gen.options.get("stop") or ()), seed=0)
    groups, _ = services.engines.generate(gen.model, services.data.tokenize(prompts), spec, step)
    reward = services.rewards[score.inputs["reward"]]
    r = reward.score([g[0].text for g in groups], [str(row[answer]) for row in rows], prompts,
                     rows=[dict(row) for row in rows]).rewards
    correct = getattr(reward, "correct", 1.0)
    return {"eval/reward": sum(r) / len(r), "eval/accuracy": sum(x >= correct - 1e-9 for x in r) / len(r)}


__all__ = ["trained_policies", "eval_ops", "greedy_eval"]
