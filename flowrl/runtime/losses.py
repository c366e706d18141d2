"""The update's loss function, built from the plan's plain-data loss spec through :data:`LOSS_FUNCTIONS`.

The driver sends a dict (picklable, small) and the train worker builds the closure,
so nothing but data crosses the Ray boundary. Spec keys::

    {"name": a key of flowrl.catalog.losses.LOSSES, its parameters ("clip": 0.2, "agg": ...),
     "kl": 0.0, "kl_kind": "k3", "entropy": 0.0,
     "tis": 0.0, "mis": 0.0, "mis_low": 0.0, "is_level": "token"}

The catalogue record of ``name`` names its function (``LossSpec.fn``), one of
:data:`LOSS_FUNCTIONS`; an unknown name or function is an error, never a default.

Extras the batch must carry (``TokenBatch.extras``): ``advantages`` [B, T] and
``old_logprobs`` for policy losses (``ref_logprobs`` when kl > 0, ``is_weights`` when
truncated importance sampling is on); ``returns`` and ``old_values`` for value losses.
Without ``old_logprobs`` (the plan elided the old-logprob pass) the forward's own
log-probs stand in for them, and the mismatch against ``rollout_logprobs``, the KL to
``ref_logprobs`` and the off-policy correction (``tis`` / ``mis`` at ``is_level``:
:func:`~flowrl.algos.mismatch.importance_correction`, its ``offpolicy_*`` statistics) are
measured in the loss; with ``old_logprobs`` the update handler has done that on the driver
and sends ``is_weights``.

>>> sorted(LOSS_FUNCTIONS)[:3]
['cispo', 'gspo', 'pg']
>>> make_loss_fn({"name": "ppo_klip"})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
flowrl.runtime.losses.UnknownLossError: unknown loss 'ppo_klip'; losses: ... (did you mean 'ppo_clip'?)
"""

from __future__ import annotations

import difflib
from typing import Callable

import torch

from flowrl.algos.kl import kl_k3
from flowrl.algos.losses import aggregate, cispo_loss, entropy_bonus, gspo_loss, kl_loss, ppo_clip_loss, value_loss
from flowrl.algos.mismatch import importance_correction, mismatch_metrics, routing_metrics
from flowrl.catalog.ops import ROUTES
from flowrl.catalog.losses import LOSSES, LossSpec
from flowrl.engines.base import LossFn
from flowrl.engines.types import TokenBatch

PolicyObjective = Callable[[torch.Tensor, torch.Tensor, TokenBatch, dict], tuple[torch.Tensor, dict]]
"""``(logprobs [b, t] with grad, old logprobs [b, t], micro-batch, denominator) -> (loss, metrics)``."""


class UnknownLossError(KeyError):
    """A loss name the catalogue does not know, or a record whose function the runtime lacks."""

    def __str__(self) -> str:
        return str(self.args[0])


# ---- policy losses: the objective of one micro-batch, around the shared KL / entropy terms ----------


def ppo_clip(spec: dict) -> LossFn:
    """PPO's clipped surrogate at token level (``clip``, ``clip_high``, ``dual_clip``, ``agg``)."""
    def objective(lp, old, mb, denom):
        return ppo_clip_loss(lp, old, mb.extras["advantages"], mb.response_mask,
                             clip_low=spec.get("clip", 0.2), clip_high=spec.get("clip_high"),
                             dual_clip=spec.get("dual_clip"), agg=spec.get("agg", "token-mean"), denominator=denom,
                             is_weights=mb.extras.get("is_weights"))
    return _policy_loss(spec, objective)


def gspo(spec: dict) -> LossFn:
    """GSPO: the PPO clip on each sequence's length-normalised ratio (``clip``, ``clip_high``, ``agg``)."""
    def objective(lp, old, mb, denom):
        return gspo_loss(lp, old, mb.extras["advantages"], mb.response_mask, clip_low=spec.get("clip", 3e-4),
                         clip_high=spec.get("clip_high", 4e-4), agg=spec.get("agg", "seq-mean-token-mean"),
                         denominator=denom, is_weights=mb.extras.get("is_weights"))
    return _policy_loss(spec, objective)


def cispo(spec: dict) -> LossFn:
    """CISPO: REINFORCE with clipped stop-gradient IS weights (``clip_high``, ``clip``, ``agg``)."""
    def objective(lp, old, mb, denom):
        return cispo_loss(lp, old, mb.extras["advantages"], mb.response_mask, clip_low=spec.get("clip"),
                          clip_high=spec.get("clip_high", 4.0), agg=spec.get("agg", "token-mean"),
                          denominator=denom, is_weights=mb.extras.get("is_weights"))
    return _policy_loss(spec, objective)


def pg(spec: dict) -> LossFn:
    """Vanilla policy gradient (REINFORCE): ``-A * log pi`` per token, times the IS weights if any."""
    def objective(lp, old, mb, denom):
        weights = mb.extras.get("is_weights")
        per_token = -mb.extras["advantages"] * lp * (weights if weights is not None else 1.0)
        loss = aggregate(per_token, mb.response_mask, spec.get("agg", "token-mean"), denom)
        return loss, {"pg_loss": loss.detach()}
    return _policy_loss(spec, objective)


def _policy_loss(spec: dict, objective: PolicyObjective) -> LossFn:
    """A policy loss: ``objective`` plus the KL-in-loss and entropy terms of ``spec``."""
    agg = spec.get("agg", "token-mean")

    def loss_fn(outputs: dict[str, torch.Tensor], mb: TokenBatch, denom: dict) -> tuple:
        lp = outputs["logprobs"]
        mask = mb.response_mask
        old = mb.extras.get("old_logprobs")
        on_policy = {}
        if old is None:
            # The plan elided the old-logprob pass (one update on the step's own samples,
            # see flowrl.compiler.lower): this forward *is* the old policy's, so the
            # ratio is 1 with its gradient, and the rollout/train mismatch is measured here.
            old = lp.detach()
            if "rollout_logprobs" in mb.extras:
                on_policy = mismatch_metrics(old, mb.extras["rollout_logprobs"], mask, tokens=denom["tokens"])
            if "routes_differ" in outputs:  # a mixture of experts replaying the rollout engine's routes
                on_policy.update(routing_metrics(outputs["routes_differ"].detach(), mb.extras[ROUTES],
                                                 mb.attention_mask))
            if "ref_logprobs" in mb.extras:
                on_policy["kl_ref"] = float(aggregate(kl_k3(old, mb.extras["ref_logprobs"]), mask, "token-mean",
                                                      denom))
            if "rollout_logprobs" in mb.extras:
                # behaviour (rollout engine) vs current (this forward): statistics always, weights
                # when the update asks for a correction
                weights, stats = importance_correction(
                    old, mb.extras["rollout_logprobs"], mask, tis=float(spec.get("tis", 0.0)),
                    mis=float(spec.get("mis", 0.0)), mis_low=float(spec.get("mis_low", 0.0)),
                    level=spec.get("is_level", "token"), denominator=denom)
                on_policy.update(stats)
                if weights is not None:
                    mb = TokenBatch(mb.input_ids, mb.attention_mask, mask, {**mb.extras, "is_weights": weights})
        loss, metrics = objective(lp, old, mb, denom)
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

    return loss_fn


# ---- value losses ------------------------------------------------------------------------------------


def value_clip(spec: dict) -> LossFn:
    """The critic's clipped value loss against the update's ``returns`` (``clip``, ``agg``)."""
    def loss_fn(outputs: dict[str, torch.Tensor], mb: TokenBatch, denom: dict) -> tuple:
        return value_loss(outputs["values"], mb.extras["old_values"], mb.extras["returns"], mb.response_mask,
                          clip=spec.get("clip", 0.2), agg=spec.get("agg", "token-mean"), denominator=denom)
    return loss_fn


LOSS_FUNCTIONS: dict[str, Callable[[dict], LossFn]] = {
    f.__name__: f for f in (ppo_clip, gspo, cispo, pg, value_clip)}
"""``LossSpec.fn`` -> ``builder(spec) -> loss_fn``; each builder is named as the records name it."""


def loss_record(spec: dict, origin: str = "") -> LossSpec:
    """The catalogue record of ``spec["name"]``, whose function the runtime has; else :class:`UnknownLossError`
    (prefixed by ``origin``, the update's source position, when given)."""
    name = spec.get("name")
    where = f"{origin}: " if origin else ""
    record = LOSSES.get(name)
    if record is None:
        close = difflib.get_close_matches(str(name), LOSSES, n=1)
        raise UnknownLossError(f"{where}unknown loss {name!r}; losses: {', '.join(sorted(LOSSES))}"
                               + (f" (did you mean {close[0]!r}?)" if close else ""))
    if record.fn not in LOSS_FUNCTIONS:
        raise UnknownLossError(f"{where}loss {name!r}: its function {record.fn!r} is not in the runtime's "
                               f"LOSS_FUNCTIONS ({', '.join(sorted(LOSS_FUNCTIONS))}); hint: add a builder named "
                               f"{record.fn!r}")
    return record


def make_loss_fn(spec: dict) -> LossFn:
    """The loss function of ``spec`` (see the module docstring); unknown names raise :class:`UnknownLossError`."""
    return LOSS_FUNCTIONS[loss_record(spec).fn](spec)


__all__ = ["LOSS_FUNCTIONS", "UnknownLossError", "loss_record", "make_loss_fn", "ppo_clip", "gspo", "cispo", "pg",
           "value_clip"]
