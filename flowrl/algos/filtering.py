"""DAPO's dynamic sampling: keep groups whose rewards differ, draw again until the batch is full.

A group whose completions all score the same has advantage 0 on every token under any
group baseline (GRPO, RLOO, DAPO): it costs a forward and backward and teaches nothing,
and as accuracy rises more groups are like that, so the effective batch shrinks. DAPO
(Yu et al. 2025, arXiv:2503.14476, Eq. (11): the constraint ``0 < |{o_i | is_equivalent(a,
o_i)}| < G`` of the objective) over-samples and filters them out: draw prompts, generate,
score, keep the groups with unequal rewards, and repeat until ``size`` groups are kept.

:func:`dynamic_sample` is that loop, independent of how a draw is made (the runtime's
filter op replays the step's producer ops for each draw); it bounds the draws and keeps the
statistics a run logs. Rewards are ``[N]`` per completion; groups are ``n`` consecutive rows
(the order a generate op returns ``n`` completions per prompt in).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from flowrl.algos.advantages import AlgoError

Draw = TypeVar("Draw")


@torch.no_grad()
def varied_groups(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """``[N / group]`` bool: which groups of ``group`` consecutive rewards are not all equal.

    Exact comparison (veRL's ``np.std(values) > 0``): rule rewards take a few exact values,
    and two rewards a float apart already give a non-zero advantage.
    """
    if rewards.dim() != 1:
        raise AlgoError(f"varied_groups: rewards has shape {list(rewards.shape)}; hint: one reward per completion [N]")
    if group < 2 or rewards.shape[0] % group:
        raise AlgoError(f"varied_groups: group size {group} does not split {rewards.shape[0]} rewards into groups "
                        "of two or more; hint: pass the generate op's `n`")
    r = rewards.reshape(-1, group)
    return r.max(dim=1).values > r.min(dim=1).values


def dynamic_sample(
    draw: Callable[[int], Draw],
    rewards_of: Callable[[Draw], torch.Tensor],
    group: int,
    size: int,
    max_draws: int,
) -> tuple[list[tuple[Draw, torch.Tensor]], dict[str, float]]:
    """Draw until ``size`` groups with unequal rewards are kept, at most ``max_draws`` times.

    Args:
        draw: ``draw(k)`` makes draw ``k`` (0, 1, ...): new prompts, their completions, scores.
        rewards_of: a draw's ``[N]`` rewards, ``N`` a multiple of ``group``.
        group: completions per prompt (>= 2).
        size: groups to keep (>= 1); ``0`` means as many as the first draw has.
        max_draws: the bound on draws per step (>= 1; 1 filters without drawing again).

    Returns:
        ``(kept, metrics)``: ``kept`` lists ``(draw, row indices [k] int64)`` in draw order,
        whole groups only, at most ``size`` groups in all (the first ones found: veRL keeps
        ``batch[:train_batch_size]``). When ``max_draws`` draws leave fewer, those are kept
        (a smaller batch); when none has unequal rewards at all, the last draw is kept whole
        (every advantage is 0 then: only KL and entropy terms act). ``metrics``:
        ``filter/draws`` (draws made), ``filter/prompts_drawn``, ``filter/groups_varied``
        (groups with unequal rewards among those drawn), ``filter/groups_kept``,
        ``filter/kept_frac`` (varied / drawn), ``filter/short`` (1.0 when fewer than
        ``size`` were kept).
    """
    if max_draws < 1:
        raise AlgoError(f"dynamic_sample: max_draws={max_draws}; hint: at least one draw per step")
    if size < 0:
        raise AlgoError(f"dynamic_sample: size={size}; hint: groups to keep, >= 1 (0: the first draw's count)")
    kept: list[tuple[Draw, torch.Tensor]] = []
    have = drawn = varied_total = draws = 0
    last = None
    while draws < max_draws and (size == 0 or have < size):
        last = draw(draws)
        draws += 1
        rewards = rewards_of(last)
        varied = varied_groups(rewards, group)
        if size == 0 and draws == 1:
            size = int(varied.shape[0])
        drawn += int(varied.shape[0])
        varied_total += int(varied.sum())
        take = varied.nonzero().flatten()[: max(size - have, 0)]
        if take.numel():
            rows = (take[:, None] * group + torch.arange(group)[None, :]).flatten()
            kept.append((last, rows))
            have += int(take.numel())
    if not kept and last is not None:
        kept = [(last, torch.arange(int(rewards_of(last).shape[0])))]
    metrics = {"filter/draws": float(draws), "filter/prompts_drawn": float(drawn),
               "filter/groups_varied": float(varied_total), "filter/groups_kept": float(have),
               "filter/kept_frac": varied_total / max(drawn, 1), "filter/short": float(have < size)}
    return kept, metrics


__all__ = ["varied_groups", "dynamic_sample"]
