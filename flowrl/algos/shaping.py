"""Reward shaping on completion length: DAPO's soft overlong punishment.

Tensors follow ``flowrl/engines/types.py``: ``response_mask`` is ``[B, T]`` with 1 on the
response tokens of each right-padded row; rewards are ``[B]``, one per completion.
"""

from __future__ import annotations

import torch

from flowrl.algos.advantages import AlgoError, check_2d


@torch.no_grad()
def overlong_penalty(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    max_tokens: int,
    buffer: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """Rewards plus DAPO's length-aware penalty for completions that run into the length limit.

    Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
    (arXiv:2503.14476), Eq. (13), with ``L_max = max_tokens`` and ``L_cache = buffer``::

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                 if L_max < |y|

    added to the rule reward, scaled by ``factor`` (veRL's ``overlong_buffer.penalty_factor``):
    a completion loses reward linearly over the last ``buffer`` tokens before the limit, so a
    truncated answer is not punished as hard as a wrong one while the policy learns to finish
    earlier. ``|y|`` counts every response token (EOS included), as veRL does.

    Args:
        rewards: ``[B]`` rewards (e.g. 1 correct, 0 wrong).
        response_mask: ``[B, T]``.
        max_tokens: ``L_max`` >= 1, normally the generate op's ``max_tokens``.
        buffer: ``L_cache``, ``1 <= buffer <= max_tokens``.
        factor: penalty scale >= 0 (1.0: the paper's).

    Returns:
        ``[B]`` float32 shaped rewards.
    """
    check_2d("overlong_penalty", "response_mask", response_mask)
    if rewards.shape != response_mask.shape[:1]:
        raise AlgoError(f"overlong_penalty: rewards has shape {list(rewards.shape)}, response_mask has "
                        f"{list(response_mask.shape)}; hint: one reward per row")
    if not 1 <= buffer <= max_tokens:
        raise AlgoError(f"overlong_penalty: buffer={buffer}, max_tokens={max_tokens}; hint: the penalty ramps "
                        "over the last `buffer` tokens before the limit, so 1 <= buffer <= max_tokens")
    if factor < 0:
        raise AlgoError(f"overlong_penalty: factor={factor}; hint: a penalty scale is >= 0")
    length = response_mask.float().sum(dim=1)
    ramp = ((max_tokens - buffer) - length) / buffer  # Eq. (13)'s middle case
    return rewards.float() + factor * ramp.clamp(min=-1.0, max=0.0)


__all__ = ["overlong_penalty"]
