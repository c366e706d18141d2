"""Advantage estimators for GRPO, Dr.GRPO, RLOO, REINFORCE++(-baseline) and PPO (GAE).

Conventions (see ``flowrl/engines/types.py``): a batch is ``B`` right-padded rows of
``T`` tokens; every per-token tensor is ``[B, T]`` and aligned with ``input_ids``;
``response_mask[b, t] = 1`` exactly on response tokens. Per-sequence quantities
(one reward per completion) are ``[N]`` with ``N == B``.

Every function here is pure torch, runs without gradients (advantages are targets,
never differentiated) and returns tensors on the input's device.

This module also holds the masked reductions and the :class:`AlgoError` that the
other ``flowrl.algos`` modules build on, so it imports nothing from them.
"""

from __future__ import annotations

import torch


class AlgoError(ValueError):
    """A caller passed tensors or options an RL function cannot use (bad shape, bad value)."""


# ---------------------------------------------------------------------------
# checks shared by flowrl.algos
# ---------------------------------------------------------------------------


def check_same_shape(where: str, **tensors: torch.Tensor) -> None:
    """Raise :class:`AlgoError` unless every keyword tensor has the same shape.

    ``where`` names the calling function so the message points at the right call.
    """
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{n}{list(s)}" for n, s in shapes.items())
        raise AlgoError(f"{where}: shapes differ: {listed}; hint: every per-token tensor is [B, T]")


def check_2d(where: str, name: str, t: torch.Tensor) -> None:
    """Raise :class:`AlgoError` unless ``t`` is ``[B, T]``."""
    if t.dim() != 2:
        raise AlgoError(f"{where}: {name} has shape {list(t.shape)}; hint: expected [B, T] (rows x tokens)")


# ---------------------------------------------------------------------------
# masked reductions
# ---------------------------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is 1. ``x``, ``mask``: same shape; ``dim=None`` sums everything."""
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1.

    ``x``, ``mask``: same shape. ``dim=None`` -> scalar; ``dim=d`` -> that dim reduced.
    An all-zero mask gives 0 (not NaN): an empty response contributes nothing.
    """
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Scalar variance of ``x`` over masked positions (Bessel-corrected when ``unbiased``)."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    sq = masked_sum((x - mean) ** 2, m)
    count = m.sum()
    denom = count - 1.0 if unbiased else count
    return sq / denom.clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean if ``shift_mean``) over masked positions.

    ``x``, ``mask``: same shape (typically ``[B, T]``); statistics are global over every
    masked element. Positions where ``mask`` is 0 come back as 0 so padding never
    leaks into a loss.
    """
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    std = masked_var(x, m).sqrt()
    out = ((x - mean) if shift_mean else x) / (std + eps)
    return out * m


# ---------------------------------------------------------------------------
# per-sequence (outcome) advantages
# ---------------------------------------------------------------------------


def _group_index(group_ids: torch.Tensor | int, n: int, device: torch.device, where: str) -> torch.Tensor:
    """Dense group index ``[N]`` in ``0..G-1`` from ids ``[N]`` or from a group size.

    A group size ``k`` means rows ``0..k-1`` are group 0, ``k..2k-1`` group 1, ...
    (the order vLLM returns ``n`` completions per prompt in).
    """
    if isinstance(group_ids, int):
        if group_ids < 1 or n % group_ids:
            raise AlgoError(
                f"{where}: group size {group_ids} does not divide {n} rewards; "
                "hint: pass group_ids [N] when groups have different sizes"
            )
        return torch.arange(n, device=device) // group_ids
    if group_ids.shape != (n,):
        raise AlgoError(
            f"{where}: group_ids has shape {list(group_ids.shape)}, rewards has [{n}]; hint: one id per reward"
        )
    return torch.unique(group_ids, return_inverse=True)[1].to(device)


def _group_stats(rewards: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group sum, group count and group unbiased std, each ``[N]``.

    Singleton groups get std 0 (one sample has no spread).
    """
    g = int(index.max()) + 1 if index.numel() else 0
    zeros = torch.zeros(g, dtype=rewards.dtype, device=rewards.device)
    sums = zeros.index_add(0, index, rewards)
    counts = zeros.index_add(0, index, torch.ones_like(rewards))
    means = sums / counts
    sq = zeros.index_add(0, index, (rewards - means[index]) ** 2)
    std = torch.where(counts > 1, (sq / (counts - 1).clamp(min=1.0)).sqrt(), torch.zeros_like(sq))
    return sums[index], counts[index], std[index]


@torch.no_grad()
def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | int,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group mean, divided by the group std.

    Args:
        rewards: ``[N]`` one scalar reward per completion.
        group_ids: ``[N]`` ids (any integers; equal id = same prompt), or an int group
            size ``k`` meaning consecutive blocks of ``k`` rows.
        normalize_std: ``True`` is GRPO ``(r - mean) / (std + eps)`` with the unbiased
            group std; ``False`` is Dr.GRPO ``r - mean`` (no std, which otherwise
            up-weights prompts that are almost always right or almost always wrong).
        eps: added to the std so an all-equal group gives 0, not NaN.

    Returns:
        ``[N]`` advantages; zero mean within every group. Singleton groups get 0.
    """
    index = _group_index(group_ids, rewards.shape[0], rewards.device, "group_advantages")
    rewards = rewards.float()
    sums, counts, std = _group_stats(rewards, index)
    centered = rewards - sums / counts
    return centered / (std + eps) if normalize_std else centered


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor | int) -> torch.Tensor:
    """REINFORCE Leave-One-Out: each reward minus the mean of the *other* rewards in its group.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
    from Human Feedback in LLMs" (arXiv:2402.14740v2), Sec. 2.3: the RLOO estimator, an
    unnumbered display there (an instance of the baseline subtraction of their Eq. (7)), whose
    baseline for sample ``i`` of ``k`` is the mean reward of the other ``k - 1`` samples (the
    estimator itself is credited to Kool et al. 2019). This function returns that advantage::

        A_i = r_i - (sum_j r_j - r_i) / (n - 1)      (n = size of i's group)

    an unbiased baseline because it does not depend on sample ``i``. The paper's ``r`` already
    holds the KL penalty (Sec. 2.2, Eq. (3)-(4)); here the caller folds it into ``rewards``.
    Equal to TRL 1.16's ``RLOOTrainer`` advantages (``normalize_advantages=False``,
    ``beta=0``) to 1e-6: ``tests/algos/test_vs_trl.py::test_rloo_advantages_match_trl``.

    Args:
        rewards: ``[N]`` one scalar reward per completion.
        group_ids: ``[N]`` ids or an int group size (see :func:`group_advantages`).

    Returns:
        ``[N]`` advantages. A singleton group has no other sample to form a
        baseline from and gets 0 (no learning signal), like GRPO.
    """
    index = _group_index(group_ids, rewards.shape[0], rewards.device, "rloo_advantages")
    rewards = rewards.float()
    sums, counts, _ = _group_stats(rewards, index)
    baseline = (sums - rewards) / (counts - 1).clamp(min=1.0)
    return torch.where(counts > 1, rewards - baseline, torch.zeros_like(rewards))


# ---------------------------------------------------------------------------
# per-token advantages
# ---------------------------------------------------------------------------


def last_response_index(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: the column of each row's last response token (``response_mask`` ``[B, T]``).

    Raises :class:`AlgoError` naming the first row that has no response token.
    """
    check_2d("last_response_index", "response_mask", response_mask)
    has = response_mask.bool()
    empty = (~has.any(dim=1)).nonzero()
    if empty.numel():
        raise AlgoError(
            f"last_response_index: row {int(empty[0])} has no response token; "
            "hint: drop empty completions before computing token rewards"
        )
    width = response_mask.shape[1]
    # argmax returns the first maximum, so search the row reversed to find the last 1.
    return width - 1 - has.flip(dims=[1]).to(torch.uint8).argmax(dim=1)


@torch.no_grad()
def sequence_reward_to_tokens(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar reward on its last response token (outcome reward for PPO).

    Args:
        rewards: ``[B]`` one reward per completion.
        response_mask: ``[B, T]``.

    Returns:
        ``[B, T]`` float32, zero everywhere except ``[b, last response token of b] = rewards[b]``.
    """
    check_2d("sequence_reward_to_tokens", "response_mask", response_mask)
    if rewards.shape != response_mask.shape[:1]:
        raise AlgoError(
            f"sequence_reward_to_tokens: rewards has shape {list(rewards.shape)}, response_mask has "
            f"{list(response_mask.shape)}; hint: one reward per row"
        )
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    rows = torch.arange(response_mask.shape[0], device=response_mask.device)
    out[rows, last_response_index(response_mask)] = rewards.float()
    return out


@torch.no_grad()
def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Give every response token of row ``b`` the row's advantage.

    Args:
        advantages: ``[B]`` per-sequence advantages (GRPO, RLOO).
        response_mask: ``[B, T]``.

    Returns:
        ``[B, T]`` float32: ``advantages[b]`` on response tokens, 0 elsewhere.
    """
    check_2d("broadcast_to_tokens", "response_mask", response_mask)
    if advantages.shape != response_mask.shape[:1]:
        raise AlgoError(
            f"broadcast_to_tokens: advantages has shape {list(advantages.shape)}, response_mask has "
            f"{list(response_mask.shape)}; hint: one advantage per row"
        )
    return advantages.float()[:, None] * response_mask.float()


def _discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` within response tokens; 0 off-mask. ``[B, T]`` -> ``[B, T]``."""
    mask = response_mask.float()
    returns = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float32, device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        # Multiplying by the mask zeroes the running sum on padding, so a row's return
        # never includes anything after its response.
        running = (token_rewards[:, t].float() + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


@torch.no_grad()
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    whiten: bool = True,
) -> torch.Tensor:
    """REINFORCE++ advantages: per-token discounted return, whitened over the whole batch.

    Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global
    Normalization" (arXiv:2501.03262v9), Sec. 3.1, the ``k >= 1`` variant:

    * Eq. (4): ``A_t = r(o, q) - beta * sum_{i >= t} KL(i)``, the return from token ``t`` of a
      reward made of the outcome reward and a per-token k1 KL penalty (``KL(i) = log
      pi_old(o_i) - log pi_ref(o_i)``). Here the caller builds those token rewards
      (:func:`sequence_reward_to_tokens` then :func:`flowrl.algos.kl.kl_penalty_in_reward`,
      ``kind="k1"``) and this function sums them from ``t`` to the end,
      ``G_t = sum_{i >= t} gamma^(i - t) r_i``, which is Eq. (4) exactly when ``gamma = 1`` (the
      paper has no discount; ``gamma < 1`` is a flowrl generalisation);
    * Eq. (5): ``A_norm = (A - mean_batch A) / (std_batch A + eps)``, mean and std over every
      response token of the batch (each token's ``G_t`` is one element), the std Bessel-corrected,
      ``eps = 1e-8``; ``whiten=False`` skips this step (not in the paper).

    Args:
        rewards: ``[B, T]`` token rewards (e.g. outcome reward on the last token minus a
            per-token KL penalty), or ``[B]`` per-sequence rewards, which are placed on
            each row's last response token.
        response_mask: ``[B, T]``.
        gamma: discount per token (1.0 = undiscounted, the usual choice for LLMs).
        whiten: normalise to zero mean and unit variance over *all* response tokens of
            the batch (REINFORCE++'s global baseline, instead of a per-prompt one).

    Returns:
        ``[B, T]`` advantages, 0 off the response.
    """
    check_2d("reinforce_pp_advantages", "response_mask", response_mask)
    token_rewards = rewards if rewards.dim() == 2 else sequence_reward_to_tokens(rewards, response_mask)
    check_same_shape("reinforce_pp_advantages", rewards=token_rewards, response_mask=response_mask)
    returns = _discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask) if whiten else returns


@torch.no_grad()
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | int,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """REINFORCE++-baseline: each reward minus its group's mean, then whitened over the batch.

    Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global
    Normalization" (arXiv:2501.03262v9; earlier versions had other titles and numbering),
    Sec. 3.2, "REINFORCE++ w/ Baseline" for k > 1 samples per prompt:

    * Eq. (6): ``A'_i = r_i - mean_{j in group(i)} r_j`` (the group mean as the baseline, without
      GRPO's division by the group std);
    * Eq. (7): ``A = (A' - mean_batch A') / (std_batch A' + eps)``, over every response token of
      the batch (row ``i``'s ``A'_i`` counted once per response token, so longer responses weigh
      more in the statistics), the std Bessel-corrected, ``eps = 1e-8``.

    This is veRL's ``compute_reinforce_plus_plus_baseline_outcome_advantage``, which it matches.
    Deviations from the paper: ``[B, T]`` token rewards are summed per row, so a KL penalty put in
    them enters the reward, whereas the paper's variant keeps the reward KL-free and adds a k2 KL
    loss instead (Eq. (8): ``0.5 * (log pi / pi_ref)^2``, :func:`flowrl.algos.losses.kl_loss`
    with ``kind="k2"``); a singleton group (undefined in the paper, which assumes k > 1) keeps
    its reward as ``A'`` (baseline 0, veRL's convention).

    Args:
        rewards: ``[B]`` one reward per completion, or ``[B, T]`` token rewards (e.g. with a
            KL penalty in them), which are summed per row first, as veRL does.
        group_ids: ``[B]`` ids or an int group size (see :func:`group_advantages`).
        response_mask: ``[B, T]``.

    Returns:
        ``[B, T]`` float32 advantages, the row's whitened value on its response tokens, 0 off
        them. A singleton group's baseline is 0 (veRL's convention: its reward is kept).
        Whitening uses the Bessel-corrected std over all response tokens (+1e-8).
    """
    check_2d("reinforce_pp_baseline_advantages", "response_mask", response_mask)
    scores = rewards.float().sum(dim=-1) if rewards.dim() == 2 else rewards.float()
    if scores.shape != response_mask.shape[:1]:
        raise AlgoError(
            f"reinforce_pp_baseline_advantages: rewards has shape {list(rewards.shape)}, response_mask has "
            f"{list(response_mask.shape)}; hint: one reward (or one row of token rewards) per row"
        )
    index = _group_index(group_ids, scores.shape[0], scores.device, "reinforce_pp_baseline_advantages")
    sums, counts, _ = _group_stats(scores, index)
    centred = scores - torch.where(counts > 1, sums / counts, torch.zeros_like(sums))
    return masked_whiten(broadcast_to_tokens(centred, response_mask), response_mask)


@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (PPO) over response tokens.

    ``values[b, t]`` is the critic's estimate at the state where token ``t`` is
    generated; the episode ends after the last response token, so the value after it
    is 0. With ``delta_t = r_t + gamma * V_{t+1} - V_t``:
    ``A_t = delta_t + gamma * lam * A_{t+1}`` and ``returns_t = A_t + V_t``.

    Args:
        token_rewards: ``[B, T]`` (see :func:`sequence_reward_to_tokens`).
        values: ``[B, T]`` critic values aligned with ``input_ids``.
        response_mask: ``[B, T]``.
        gamma: discount per token.
        lam: GAE bias/variance trade-off (1.0 = Monte-Carlo returns minus values).

    Returns:
        ``(advantages [B, T], returns [B, T])``, both 0 off the response. Advantages
        are not whitened; call :func:`masked_whiten` if the recipe wants it.
    """
    check_2d("gae", "response_mask", response_mask)
    check_same_shape("gae", token_rewards=token_rewards, values=values, response_mask=response_mask)
    mask = response_mask.float()
    rewards, values = token_rewards.float() * mask, values.float() * mask
    b, t_len = mask.shape
    advantages = torch.zeros_like(mask)
    next_value = torch.zeros(b, dtype=torch.float32, device=mask.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(t_len)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = (delta + gamma * lam * next_adv) * mask[:, t]
        advantages[:, t] = adv_t
        # Off-mask positions reset the recursion to 0, so each row's last response
        # token sees a terminal next state (value 0, advantage 0).
        next_value, next_adv = values[:, t], adv_t
    returns = (advantages + values) * mask
    return advantages, returns
