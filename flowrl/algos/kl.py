"""Per-token KL estimators and the PPO-style KL penalty in the reward.

Convention of Schulman, "Approximating KL Divergence" (2020): tokens are sampled
from the policy ``p``; ``q`` is the reference. With ``log r = log q - log p`` the
estimators of ``KL[p || q]`` on one sampled token are

* ``k1 = -log r = log p - log q``         unbiased, high variance, can be negative;
* ``k2 = 0.5 * (log r)^2``                biased, low variance, always >= 0;
* ``k3 = (r - 1) - log r``                unbiased, low variance, always >= 0
  (the estimator GRPO uses for its KL loss);
* ``abs = |log r|``                       biased, >= 0 (veRL's ``kl_penalty="abs"``).

k3 is clamped as veRL's ``kl_penalty_forward`` does (log r to +-20, k3 to +-10): a
token the reference finds impossible (``log q = -100`` against ``log p = 0``) gives
``e^100``, which overflows, and an ``inf`` loss or gradient. The clamped value is
finite and its gradient is 0 where a bound is active (the token stops pulling).

All tensors are ``[B, T]`` log-probabilities of the sampled tokens (aligned with
``input_ids``, see ``flowrl/engines/types.py``); results are ``[B, T]`` in nats.
"""

from __future__ import annotations

from typing import Callable

import torch

from flowrl.algos.advantages import AlgoError, check_2d, check_same_shape


def kl_k1(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``log p - log q`` per token. ``[B, T]``, nats."""
    return logp - logq


def kl_k2(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``0.5 * (log p - log q)^2`` per token. ``[B, T]``, nats."""
    return 0.5 * (logp - logq) ** 2


K3_MAX_LOG_RATIO = 20.0
"""k3's log-ratio is clamped to +-this before ``exp`` (veRL: ``torch.clamp(kl, -20, 20)``)."""
K3_MAX = 10.0
"""k3 itself is clamped to +-this (veRL: ``torch.clamp(kld, -10, 10)``)."""


def kl_k3(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``exp(log q - log p) - (log q - log p) - 1`` per token. ``[B, T]``, nats, in ``[0, 10]``.

    The log-ratio is clamped to ``+-K3_MAX_LOG_RATIO`` and the result to ``K3_MAX`` (veRL's
    bounds), so the value and its gradient stay finite for any pair of log-probs.
    """
    log_r = (logq - logp).clamp(-K3_MAX_LOG_RATIO, K3_MAX_LOG_RATIO)
    # expm1 keeps precision when the two distributions are close (log_r ~ 0).
    return (torch.expm1(log_r) - log_r).clamp(-K3_MAX, K3_MAX)


def kl_abs(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``|log p - log q|`` per token. ``[B, T]``, nats, >= 0 (veRL's ``"abs"`` estimator)."""
    return (logp - logq).abs()


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "abs": kl_abs,
}
"""Estimator name -> ``fn(logp, logq) -> [B, T]``; the names a flow program may use (the
catalogue's :data:`flowrl.catalog.losses.KL_ESTIMATORS`, paired by ``tests/algos/test_kl.py``)."""


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL[policy || reference]`` on the sampled tokens.

    Args:
        logprobs: ``[B, T]`` log p of the sampled tokens under the policy.
        ref_logprobs: ``[B, T]`` log q of the same tokens under the reference.
        kind: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"`` (see the module docstring).

    Returns:
        ``[B, T]`` in nats, differentiable in both inputs; masking is the caller's job.
    """
    estimator = KL_ESTIMATORS.get(kind)
    if estimator is None:
        raise AlgoError(f"kl_estimate: unknown KL estimator {kind!r}; hint: use one of {sorted(KL_ESTIMATORS)}")
    check_same_shape("kl_estimate", logprobs=logprobs, ref_logprobs=ref_logprobs)
    return estimator(logprobs, ref_logprobs)


@torch.no_grad()
def kl_penalty_in_reward(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> torch.Tensor:
    """PPO-style KL in the reward: ``r_t - coef * kl_t`` on every response token.

    Args:
        token_rewards: ``[B, T]`` rewards (e.g. from ``sequence_reward_to_tokens``).
        logprobs: ``[B, T]`` policy log-probs of the sampled tokens (the rollout's
            ``old_logprobs``).
        ref_logprobs: ``[B, T]`` reference log-probs of the same tokens.
        response_mask: ``[B, T]``; the penalty applies only where it is 1.
        coef: penalty weight (``beta``), >= 0.
        kind: KL estimator, ``"k1"`` by default (InstructGPT / OpenRLHF).

    Returns:
        ``[B, T]`` float32 penalised rewards. Computed without gradients: the reward is
        a fixed target, not a differentiable term.
    """
    check_2d("kl_penalty_in_reward", "token_rewards", token_rewards)
    check_same_shape(
        "kl_penalty_in_reward",
        token_rewards=token_rewards,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        response_mask=response_mask,
    )
    if coef < 0:
        raise AlgoError(f"kl_penalty_in_reward: coef={coef} is negative; hint: a KL penalty weight is >= 0")
    kl = kl_estimate(logprobs.float(), ref_logprobs.float(), kind)
    return token_rewards.float() - coef * kl * response_mask.float()
