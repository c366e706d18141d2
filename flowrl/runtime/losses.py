"""Build a train engine's loss function from the plan's plain-data loss spec.

The driver sends a dict (picklable, small) and the train worker builds the closure,
so nothing but data crosses the Ray boundary. Spec keys::

    {"name": "ppo_clip" | "pg" | "value_clip", "clip": 0.2, "clip_high": None, "dual_clip": None,
     "agg": "token-mean", "kl": 0.0, "kl_kind": "k3", "entropy": 0.0}

Extras the batch must carry (``TokenBatch.extras``): ``advantages`` [B, T] and
``old_logprobs`` for policy losses (``ref_logprobs`` when kl > 0, ``is_weights`` when
truncated importance sampling is on); ``returns`` and ``old_values`` for value losses.
Without ``old_logprobs`` (the plan elided the old-logprob pass) the forward's own
log-probs stand in for them, and the mismatch against ``rollout_logprobs`` and the KL to
``ref_logprobs`` are measured in the loss.
"""

from __future__ import annotations

import torch

from flowrl.algos.kl import kl_k3
from flowrl.algos.losses import aggregate, entropy_bonus, kl_loss, ppo_clip_loss, value_loss
from flowrl.algos.mismatch import mismatch_metrics
from flowrl.engines.types import TokenBatch


def make_loss_fn(spec: dict):
    name = spec["name"]
    agg = spec.get("agg", "token-mean")

    def policy_loss(outputs: dict[str, torch.Tensor], mb: TokenBatch, denom: dict) -> tuple:
        lp = outputs["logprobs"]
        mask = mb.response_mask
        adv = mb.extras["advantages"]
        old = mb.extras.get("old_logprobs")
        on_policy = {}
        if old is None:
            # The plan elided the old-logprob pass (one update on the step's own samples,
            # see flowrl.compiler.lower): this forward *is* the old policy's, so the
            # ratio is 1 with its gradient, and the rollout/train mismatch is measured here.
            old = lp.detach()
            if "rollout_logprobs" in mb.extras:
                on_policy = mismatch_metrics(old, mb.extras["rollout_logprobs"], mask, tokens=denom["tokens"])
            if "ref_logprobs" in mb.extras:
                on_policy["kl_ref"] = float(aggregate(kl_k3(old, mb.extras["ref_logprobs"]), mask, "token-mean",
                                                      denom))
        if name == "ppo_clip":
            loss, metrics = ppo_clip_loss(lp, old, adv, mask,
                                          clip_low=spec.get("clip", 0.2), clip_high=spec.get("clip_high"),
                                          dual_clip=spec.get("dual_clip"), agg=agg, denominator=denom,
                                          is_weights=mb.extras.get("is_weights"))
        else:  # "pg": vanilla policy gradient, -A * log pi
            weights = mb.extras.get("is_weights")
            per_token = -adv * lp * (weights if weights is not None else 1.0)
            loss = aggregate(per_token, mask, agg, denom)
            metrics = {"pg_loss": loss.detach()}
        metrics = {**metrics, **on_policy}
        if spec.get("kl", 0.0) > 0:
            kl = kl_loss(lp, mb.extras["ref_logprobs"], mask, spec.get("kl_kind", "k3"), agg, denom)
            loss = loss + spec["kl"] * kl
            metrics["kl_loss"] = kl.detach()
        if spec.get("entropy", 0.0) != 0 and "entropy" in outputs:
            ent = entropy_bonus(outputs["entropy"], mask, agg, denom)
            loss = loss - spec["entropy"] * ent
            metrics["entropy"] = ent.detach()
        return loss, metrics

    def critic_loss(outputs: dict[str, torch.Tensor], mb: TokenBatch, denom: dict) -> tuple:
        return value_loss(outputs["values"], mb.extras["old_values"], mb.extras["returns"], mb.response_mask,
                          clip=spec.get("clip", 0.2), agg=agg, denominator=denom)

    return critic_loss if name == "value_clip" else policy_loss
