"""Train-vs-rollout log-prob mismatch: metrics and truncated importance sampling (TIS).

The rollout engine (vLLM, SGLang) and the train engine compute slightly different
log-probs for the same tokens (kernels, precision, batch shapes, stale weights).
The rollout engine sampled the tokens, so the policy gradient is off-policy by the
ratio ``pi_train / pi_rollout``; these functions measure that gap and correct it.

Tensors are ``[B, T]`` log-probs of the sampled tokens, aligned with ``input_ids``
(see ``flowrl/engines/types.py``); only positions where ``response_mask`` is 1 count.
"""

from __future__ import annotations

import math

import torch

from flowrl.algos.advantages import AlgoError, check_2d, check_same_shape, masked_mean
from flowrl.algos.kl import kl_k3


@torch.no_grad()
def mismatch_metrics(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
    tokens: float | None = None,
) -> dict[str, float]:
    """How far the train engine's log-probs are from the rollout engine's.

    Args:
        train_logprobs: ``[B, T]`` log-probs from the train engine.
        rollout_logprobs: ``[B, T]`` log-probs reported by the rollout engine.
        response_mask: ``[B, T]``.

    Returns:
        ``mismatch_abs_mean`` and ``mismatch_abs_max``: mean / max of
        ``|train - rollout|`` over response tokens (nats); ``mismatch_kl``: k3 estimate
        of ``KL[rollout || train]`` on the sampled tokens (the rollout engine sampled
        them, so it is the ``p`` of the estimator). All 0 for an empty mask.
        With ``tokens`` (the whole batch's response-token count, when this is one
        micro-batch of it) the means divide by ``tokens``, so micro-batches' metrics add
        up (:func:`flowrl.algos.losses.combine_metrics`).
    """
    check_2d("mismatch_metrics", "train_logprobs", train_logprobs)
    check_same_shape(
        "mismatch_metrics",
        train_logprobs=train_logprobs,
        rollout_logprobs=rollout_logprobs,
        response_mask=response_mask,
    )
    train, rollout, mask = train_logprobs.float(), rollout_logprobs.float(), response_mask.float()
    diff = (train - rollout).abs()
    on = mask.bool()

    def mean(x: torch.Tensor) -> float:
        return float((x * mask).sum() / max(tokens, 1.0)) if tokens is not None else float(masked_mean(x, mask))

    return {
        "mismatch_abs_mean": mean(diff),
        "mismatch_abs_max": float(diff[on].max()) if on.any() else 0.0,
        "mismatch_kl": mean(kl_k3(rollout, train)),
    }


@torch.no_grad()
def tis_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
) -> torch.Tensor:
    """Token-level truncated importance weights ``min(pi_train / pi_rollout, cap)``.

    Truncation bounds the variance the correction adds (Ionides 2008; "Your efficient
    RL framework secretly brings you off-policy RL training", Yao et al. 2025).
    Pass the result as ``ppo_clip_loss(..., is_weights=...)``.

    Args:
        train_logprobs: ``[B, T]`` train-engine log-probs (usually ``old_logprobs``).
        rollout_logprobs: ``[B, T]`` rollout-engine log-probs of the same tokens.
        response_mask: ``[B, T]``.
        cap: largest weight, > 0.

    Returns:
        ``[B, T]`` float32 weights, detached, 0 off the response.
    """
    if not cap > 0:
        raise AlgoError(f"tis_weights: cap={cap}; hint: the truncation cap must be > 0 (2.0 is common)")
    check_2d("tis_weights", "train_logprobs", train_logprobs)
    check_same_shape(
        "tis_weights", train_logprobs=train_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask
    )
    log_ratio = train_logprobs.float() - rollout_logprobs.float()
    # exp(min(x, log cap)) == min(exp(x), cap) without overflowing on huge gaps.
    weights = torch.exp(log_ratio.clamp(max=math.log(cap)))
    return weights * response_mask.float()
