"""Policy (PPO-clip, GSPO, CISPO), value, KL and entropy losses, with micro-batch-exact aggregation.

Every per-token tensor is ``[B, T]`` aligned with ``input_ids`` (see
``flowrl/engines/types.py``); losses are taken only where ``response_mask`` is 1.

Aggregation modes (``agg``), for a per-token loss ``l[b, t]`` and mask ``m``:

* ``"token-mean"``:          ``sum_bt l*m / sum_bt m`` (every token weighs the same; DAPO);
* ``"seq-mean-token-sum"``:  ``sum_b (sum_t l*m) / B`` (Dr.GRPO-style, no length normalisation);
* ``"seq-mean-token-mean"``: ``sum_b (sum_t l*m / sum_t m) / B`` (original GRPO).

Micro-batching: a train engine that splits a batch into micro-batches passes the
whole batch's counts as ``denominator={"tokens": ..., "sequences": ...}`` (see
:func:`global_denominator`); each micro-batch then divides by the *global* count, so
the sum of micro-batch losses equals the full-batch loss exactly (and so do the
accumulated gradients).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from flowrl.algos.advantages import AlgoError, broadcast_to_tokens, check_2d, check_same_shape
from flowrl.algos.kl import kl_estimate, kl_k3

Denominator = Mapping[str, float]
"""``{"tokens": response tokens in the whole batch, "sequences": rows in the whole batch}``."""

# exp() of a log-ratio above this overflows float32 quickly; 20 nats is a ratio of 5e8,
# far beyond any clip range, so clamping changes no clipped loss value.
_MAX_LOG_RATIO = 20.0


def global_denominator(response_mask: torch.Tensor) -> dict[str, float]:
    """Counts of the *whole* batch for micro-batched aggregation.

    Args:
        response_mask: ``[B, T]`` of the full batch (before splitting).

    Returns:
        ``{"tokens": number of response tokens, "sequences": B}``.
    """
    check_2d("global_denominator", "response_mask", response_mask)
    return {"tokens": float(response_mask.float().sum()), "sequences": float(response_mask.shape[0])}


def _count(denominator: Denominator | None, key: str, local: torch.Tensor | float) -> torch.Tensor | float:
    """The global count ``denominator[key]`` if given, else the micro-batch's own ``local`` count."""
    if denominator is None:
        return local
    if key not in denominator:
        raise AlgoError(
            f"aggregate: denominator {dict(denominator)} lacks {key!r}; hint: use global_denominator(response_mask)"
        )
    return float(denominator[key])


def _token_mean(x: torch.Tensor, m: torch.Tensor, denominator: Denominator | None) -> torch.Tensor:
    total = torch.as_tensor(_count(denominator, "tokens", m.sum()), dtype=x.dtype, device=x.device)
    return (x * m).sum() / total.clamp(min=1.0)


def _seq_mean_token_sum(x: torch.Tensor, m: torch.Tensor, denominator: Denominator | None) -> torch.Tensor:
    rows = _count(denominator, "sequences", float(x.shape[0]))
    return (x * m).sum(dim=1).sum() / max(rows, 1.0)


def _seq_mean_token_mean(x: torch.Tensor, m: torch.Tensor, denominator: Denominator | None) -> torch.Tensor:
    rows = _count(denominator, "sequences", float(x.shape[0]))
    # A row without response tokens has token-mean 0 (clamp avoids 0/0) and still
    # counts as a row, matching the global "sequences" count.
    per_row = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return per_row.sum() / max(rows, 1.0)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, Denominator | None], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
}
"""Aggregation name -> ``fn(per_token [B, T], mask [B, T], denominator) -> scalar``."""


def aggregate(
    per_token: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    denominator: Denominator | None = None,
) -> torch.Tensor:
    """Reduce a per-token quantity ``[B, T]`` to a scalar over response tokens.

    Args:
        per_token: ``[B, T]`` loss (or entropy, KL ...) per token.
        response_mask: ``[B, T]``.
        agg: one of :data:`AGGREGATIONS` (see the module docstring).
        denominator: global counts for micro-batching; ``None`` uses this batch's own.

    Returns:
        0-dim tensor, differentiable in ``per_token``.
    """
    fn = AGGREGATIONS.get(agg)
    if fn is None:
        raise AlgoError(f"aggregate: unknown aggregation {agg!r}; hint: use one of {sorted(AGGREGATIONS)}")
    check_2d("aggregate", "per_token", per_token)
    check_same_shape("aggregate", per_token=per_token, response_mask=response_mask)
    return fn(per_token, response_mask.to(per_token.dtype), denominator)


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 < clip_low < 1.0:
        raise AlgoError(
            f"ppo_clip_loss: clip_low={clip_low}; hint: the ratio is clipped to [1 - clip_low, ...], "
            "use 0 < clip_low < 1"
        )
    if clip_high <= 0.0:
        raise AlgoError(f"ppo_clip_loss: clip_high={clip_high}; hint: use clip_high > 0 (e.g. 0.28 for clip-higher)")
    if dual_clip is not None and dual_clip <= 1.0:
        raise AlgoError(f"ppo_clip_loss: dual_clip={dual_clip}; hint: the dual-clip constant c must be > 1 (e.g. 3.0)")


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    denominator: Denominator | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate policy loss (GRPO, RLOO, REINFORCE++, PPO actor).

    Per token, with ``ratio = exp(logprobs - old_logprobs)``:
    ``l = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``; with
    ``dual_clip = c`` tokens with ``A < 0`` are further bounded by ``-A * c`` (Dual-clip
    PPO: a huge ratio on a bad token cannot blow up the loss). ``is_weights`` (e.g.
    truncated importance weights for the rollout/train mismatch) multiply ``l``.

    Args:
        logprobs: ``[B, T]`` current policy log-probs of the sampled tokens (with grad).
        old_logprobs: ``[B, T]`` log-probs of the policy that produced the batch.
        advantages: ``[B, T]`` per-token, or ``[B]`` per-sequence (broadcast to tokens).
        response_mask: ``[B, T]``.
        clip_low: lower clip epsilon, ``0 < clip_low < 1``.
        clip_high: upper clip epsilon; ``None`` = ``clip_low`` (symmetric). A larger
            value ("clip-higher", DAPO) lets low-probability tokens grow faster.
        dual_clip: constant ``c > 1`` or ``None`` (off).
        agg: aggregation mode, see :func:`aggregate`.
        denominator: global counts for micro-batching, see :func:`global_denominator`.
        is_weights: ``[B, T]`` importance weights, detached here (weights, not targets).

    Returns:
        ``(loss, metrics)``: 0-dim loss tensor with grad; metrics are floats over this
        batch's response tokens: ``pg_loss``, ``clipfrac`` (share of tokens where the
        clipped term is active), ``dual_clipfrac``, ``approx_kl`` (k3 estimate of
        KL[old || new]), ``ratio_mean``, ``ratio_max``, ``ratio_min``.
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clip(clip_low, clip_high, dual_clip)
    # Old log-probs keep their own dtype here (the ratio is taken in the promoted one).
    mask, advantages, _ = _policy_inputs("ppo_clip_loss", logprobs, old_logprobs, advantages, response_mask)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    per_token = _weighted("ppo_clip_loss", per_token, is_weights, response_mask)
    loss = aggregate(per_token, mask, agg, denominator)
    return loss, _policy_metrics(loss, logprobs, old_logprobs.detach(), mask, denominator, ratio,
                                 clipfrac=clipped > unclipped, dual_clipfrac=dual_active)


def _policy_inputs(where, logprobs, old_logprobs, advantages, response_mask):
    """Checked ``(mask, advantages [B, T], old log-probs)`` in ``logprobs``' dtype, detached."""
    check_2d(where, "logprobs", logprobs)
    if advantages.dim() == 1:
        advantages = broadcast_to_tokens(advantages, response_mask)
    check_same_shape(where, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                     response_mask=response_mask)
    mask = response_mask.to(logprobs.dtype)
    return mask, advantages.detach().to(logprobs.dtype), old_logprobs.detach().to(logprobs.dtype)


def _weighted(where, per_token, is_weights, response_mask):
    if is_weights is None:
        return per_token
    check_same_shape(where, is_weights=is_weights, response_mask=response_mask)
    return per_token * is_weights.detach().to(per_token.dtype)


def _policy_metrics(loss, logprobs, old, mask, denominator, ratio, prefix="ratio", **fractions) -> dict[str, float]:
    """The metrics of a ratio-based policy loss, as floats over this batch's response tokens.

    ``ratio`` is ``[B, T]`` (GSPO passes its sequence ratio on every token), ``old`` the
    detached old log-probs and each of ``fractions`` a ``[B, T]`` boolean logged as a share
    of tokens (``clipfrac`` ...). Returns ``pg_loss``, the fractions, ``approx_kl`` (k3
    estimate of KL[old || new]) and ``{prefix}_mean``, ``{prefix}_max``, ``{prefix}_min``.
    """
    with torch.no_grad():
        on = mask.bool()
        ratio_on = ratio[on] if on.any() else torch.ones(1, dtype=ratio.dtype)

        def token_mean(x: torch.Tensor) -> float:
            # Over the global token count when micro-batching, so that summing the
            # micro-batches' metrics (combine_metrics) gives the whole batch's mean.
            return float(_token_mean(x.to(mask.dtype), mask, denominator))

        metrics = {"pg_loss": float(loss)}
        metrics.update({key: token_mean(share) for key, share in fractions.items()})
        metrics["approx_kl"] = token_mean(kl_k3(old, logprobs.detach()))
        metrics[f"{prefix}_mean"] = token_mean(ratio)
        metrics[f"{prefix}_max"] = float(ratio_on.max())
        metrics[f"{prefix}_min"] = float(ratio_on.min())
    return metrics


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    agg: str = "seq-mean-token-mean",
    denominator: Denominator | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: the PPO clip on a sequence-level, length-normalised importance ratio.

    Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), Eq. (7):
    ``s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(mean_t (log pi - log pi_old))``, and
    Eq. (5): ``J = E[1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)]``: the
    whole sequence is clipped or not. Written in the GSPO-token form of Eq. (13)-(14),
    ``s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]``: its value is ``s_i`` on every token and its
    gradient ``s_i * grad log pi(y_it)``, so with the advantage constant along a row (GRPO's)
    and ``agg = "seq-mean-token-mean"`` (the default: ``1/G sum_i`` of Eq. 5) loss and gradient
    are exactly GSPO's, and token advantages (REINFORCE++'s) are allowed as well.

    Args:
        logprobs: ``[B, T]`` current log-probs (with grad).
        old_logprobs: ``[B, T]`` log-probs of the policy that produced the batch.
        advantages: ``[B, T]`` or ``[B]`` (broadcast).
        response_mask: ``[B, T]``.
        clip_low, clip_high: the clip range ``[1 - clip_low, 1 + clip_high]`` of ``s_i`` (``0 <=
            clip_low < 1``, ``clip_high >= 0``); the paper uses 3e-4 and 4e-4 (a
            length-normalised ratio moves far less than a token's). ``clip_high=None`` = ``clip_low``.
        agg, denominator: see :func:`aggregate`.
        is_weights: ``[B, T]`` importance weights (rollout/train mismatch), detached.

    Returns:
        ``(loss, metrics)``: ``pg_loss``, ``clipfrac`` (share of response tokens in clipped
        sequences), ``seq_ratio_mean`` (token-weighted mean of ``s_i``), ``seq_ratio_max``,
        ``seq_ratio_min``, ``approx_kl`` (k3 of KL[old || new] per token).
    """
    clip_high = clip_low if clip_high is None else clip_high
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise AlgoError(f"gspo_loss: clip_low={clip_low}, clip_high={clip_high}; hint: s_i is clipped to "
                        "[1 - clip_low, 1 + clip_high]: use 0 <= clip_low < 1 and clip_high >= 0 (GSPO: 3e-4, 4e-4)")
    mask, adv, old = _policy_inputs("gspo_loss", logprobs, old_logprobs, advantages, response_mask)
    tokens = mask.sum(dim=1).clamp(min=1.0)
    log_s = ((logprobs - old) * mask).sum(dim=1) / tokens  # [B]: log of Eq. (7)'s s_i
    log_s = log_s.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # Eq. (14): value s_i on every token, gradient s_i * d log pi(y_it).
    log_s_tok = log_s.detach()[:, None] + logprobs - logprobs.detach()
    ratio = torch.exp(log_s_tok)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = _weighted("gspo_loss", torch.maximum(unclipped, clipped), is_weights, response_mask)
    loss = aggregate(per_token, mask, agg, denominator)
    # s_i on each of its row's tokens: the same mean (token-weighted), max and min as over rows.
    s_tok = torch.exp(log_s.detach())[:, None].expand_as(mask)
    return loss, _policy_metrics(loss, logprobs, old, mask, denominator, s_tok, prefix="seq_ratio",
                                 clipfrac=clipped > unclipped)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float | None = None,
    clip_high: float = 4.0,
    agg: str = "token-mean",
    denominator: Denominator | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: REINFORCE weighted by clipped, stop-gradient importance ratios.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention" (arXiv:2506.13585), Eq. (4): ``J = E[1/sum_i |o_i| sum_i sum_t
    sg(r^_it) A_it log pi(o_it)]`` with Eq. (5): ``r^_it = clip(r_it, 1 - eps_low, 1 + eps_high)``
    and ``r_it = pi / pi_old``. Unlike PPO's clip, no token's gradient is dropped: the clip
    bounds its weight (``r^``), never its contribution. Per token
    ``l = -sg(r^) * A * log pi``; ``agg = "token-mean"`` is Eq. (4)'s ``1 / sum |o_i|``.

    Args:
        logprobs: ``[B, T]`` current log-probs (with grad).
        old_logprobs: ``[B, T]`` log-probs of the policy that produced the batch.
        advantages: ``[B, T]`` or ``[B]`` (broadcast).
        response_mask: ``[B, T]``.
        clip_low: ``eps_low`` in ``[0, 1)``, ``None`` = no lower bound (the paper sets none; TRL neither).
        clip_high: ``eps_high >= 0``: weights are at most ``1 + clip_high`` (4.0: TRL's
            recommended ``epsilon_high = 5.0``, ScaleRL's eps_max).
        agg, denominator: see :func:`aggregate`.
        is_weights: ``[B, T]`` importance weights (rollout/train mismatch), detached.

    Returns:
        ``(loss, metrics)``: ``pg_loss``, ``clipfrac`` (share of tokens whose weight was
        clipped), ``ratio_mean``, ``ratio_max``, ``ratio_min``, ``approx_kl``.
    """
    if clip_high < 0.0:
        raise AlgoError(f"cispo_loss: clip_high={clip_high}; hint: weights are clipped to 1 + clip_high, use >= 0")
    if clip_low is not None and not 0.0 <= clip_low < 1.0:
        raise AlgoError(f"cispo_loss: clip_low={clip_low}; hint: use 0 < clip_low < 1, or none for no lower bound")
    mask, adv, old = _policy_inputs("cispo_loss", logprobs, old_logprobs, advantages, response_mask)
    with torch.no_grad():
        ratio = torch.exp((logprobs.detach() - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        low = 0.0 if clip_low is None else 1.0 - clip_low
        weight = ratio.clamp(low, 1.0 + clip_high)  # Eq. (5), stop-gradient
    per_token = _weighted("cispo_loss", -weight * adv * logprobs, is_weights, response_mask)
    loss = aggregate(per_token, mask, agg, denominator)
    return loss, _policy_metrics(loss, logprobs, old, mask, denominator, ratio, clipfrac=weight != ratio)


def pg_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    denominator: Denominator | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Vanilla policy gradient (REINFORCE, Williams 1992): per token ``l = -A * log pi``.

    Args:
        logprobs: ``[B, T]`` current log-probs (with grad).
        advantages: ``[B, T]`` or ``[B]`` (broadcast).
        response_mask: ``[B, T]``.
        agg, denominator: see :func:`aggregate`.
        is_weights: ``[B, T]`` importance weights, detached.

    Returns:
        ``(loss, {"pg_loss": ...})``.
    """
    mask, adv, _ = _policy_inputs("pg_loss", logprobs, logprobs, advantages, response_mask)
    per_token = _weighted("pg_loss", -adv * logprobs, is_weights, response_mask)
    loss = aggregate(per_token, mask, agg, denominator)
    return loss, {"pg_loss": float(loss.detach())}


def combine_metrics(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Fold one micro-batch's (or data-parallel rank's) loss metrics into ``total``, in place.

    Loss metrics are computed over the *global* denominator (see :func:`aggregate`), so
    they add up across micro-batches and ranks; keys ending in ``_max`` / ``_min`` take
    the maximum / minimum instead. Returns ``total``.
    """
    for key, value in part.items():
        value = float(value)
        if key not in total:
            total[key] = value
        elif key.endswith("_max"):
            total[key] = max(total[key], value)
        elif key.endswith("_min"):
            total[key] = min(total[key], value)
        else:
            total[key] += value
    return total


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    denominator: Denominator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value (critic) loss: ``0.5 * max((V - R)^2, (V_clip - R)^2)`` per token.

    ``V_clip = old_V + clip(V - old_V, -clip, clip)`` keeps the critic from moving far
    from the values used to compute the advantages; ``clip=None`` gives plain
    ``0.5 * (V - R)^2``.

    Args:
        values: ``[B, T]`` current critic values (with grad).
        old_values: ``[B, T]`` values at rollout time.
        returns: ``[B, T]`` targets (e.g. from :func:`flowrl.algos.advantages.gae`).
        response_mask: ``[B, T]``.
        clip: absolute clip range in reward units, > 0, or ``None``.
        agg, denominator: see :func:`aggregate`.

    Returns:
        ``(loss, metrics)`` with metrics ``vf_loss``, ``vf_clipfrac`` (share of tokens
        where the clipped error is the larger), ``value_mean``.
    """
    check_2d("value_loss", "values", values)
    check_same_shape("value_loss", values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    if clip is not None and clip <= 0:
        raise AlgoError(f"value_loss: clip={clip}; hint: use clip > 0, or None for an unclipped value loss")
    mask = response_mask.to(values.dtype)
    returns, old_values = returns.detach().to(values.dtype), old_values.detach().to(values.dtype)
    err = (values - returns) ** 2
    if clip is None:
        per_token, clipped_active = 0.5 * err, torch.zeros_like(err)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        clipped_active = (err_clip > err).to(values.dtype)
    loss = aggregate(per_token, mask, agg, denominator)
    with torch.no_grad():
        metrics = {
            "vf_loss": float(loss),
            # Over the global token count, so micro-batches' metrics add up (combine_metrics).
            "vf_clipfrac": float(_token_mean(clipped_active, mask, denominator)),
            "value_mean": float(_token_mean(values.detach(), mask, denominator)),
        }
    return loss, metrics


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "k3",
    agg: str = "token-mean",
    denominator: Denominator | None = None,
) -> torch.Tensor:
    """KL-to-reference as a loss term (GRPO): ``aggregate(k(logprobs, ref_logprobs))``.

    Args:
        logprobs: ``[B, T]`` policy log-probs (with grad).
        ref_logprobs: ``[B, T]`` reference log-probs (detached here).
        response_mask: ``[B, T]``.
        kind: a name of :data:`flowrl.algos.kl.KL_ESTIMATORS` (k1, k2, k3, abs).
        agg, denominator: see :func:`aggregate`.

    Returns:
        0-dim tensor in nats; the caller adds ``beta * kl_loss(...)`` to the loss.
    """
    return aggregate(kl_estimate(logprobs, ref_logprobs.detach(), kind), response_mask, agg, denominator)


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    denominator: Denominator | None = None,
) -> torch.Tensor:
    """Aggregated policy entropy over response tokens.

    Args:
        entropy: ``[B, T]`` entropy of the policy's next-token distribution, nats.
        response_mask: ``[B, T]``.
        agg, denominator: see :func:`aggregate`.

    Returns:
        0-dim tensor, the (positive) entropy; a bonus is *subtracted* from the loss:
        ``loss = pg_loss - coef * entropy_bonus(...)``.
    """
    return aggregate(entropy, response_mask, agg, denominator)
