"""Off-policy corrections: train-vs-rollout mismatch, TIS, MIS, sequence-level IS, their statistics.

The rollout engine (vLLM, SGLang) and the train engine compute slightly different
log-probs for the same tokens (kernels, precision, batch shapes), and under staleness
``s > 1`` the rollout engine also held older weights. The rollout engine sampled the
tokens, so the policy gradient is off-policy by the ratio ``rho = pi_train / pi_rollout``
(behaviour = the rollout engine, current = the trainer's weights at update time); these
functions measure that ratio and correct for it:

* **TIS** (truncated IS): weight ``min(rho, cap)`` (Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training", a blog post with no numbered
  equations and no arXiv version; see :func:`tis_weights`);
* **MIS** (masked IS): weight 0 where ``rho`` leaves the band ``[low, high]``, ``rho`` inside
  it: IcePop's masking function, Ling Team 2025, arXiv:2510.18855v2, Sec. 2.3.2, Eq. (2)
  (veRL's ``rollout_is_mode="mask"``; see :func:`importance_correction`);
* at three **levels** (veRL's ``rollout_is_level``): per ``token``; per ``sequence``, the
  product of the row's token ratios ``prod_t rho_t`` (the true sequence likelihood ratio;
  Seq-TIS / Seq-MIS of Liu, Li et al. 2025, "When speed kills stability", a blog post with no
  numbered equations); ``geometric``, its length-normalised form ``exp(mean_t log rho_t)``
  (the form of GSPO's ratio, arXiv:2507.18071v2, Eq. (7)).

Tensors are ``[B, T]`` log-probs of the sampled tokens, aligned with ``input_ids``
(see ``flowrl/engines/types.py``); only positions where ``response_mask`` is 1 count.
"""

from __future__ import annotations

import math

import torch

from flowrl.algos.advantages import AlgoError, check_2d, check_same_shape, masked_mean
from flowrl.algos.kl import kl_k3

IS_LEVELS = ("token", "sequence", "geometric")
"""Where the importance ratio is taken (see the module docstring); the catalogue's
``update(is_level = ...)`` choices (:data:`flowrl.catalog.ops.IS_LEVELS`)."""

_MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` (veRL's bound), each token's and a sequence's
sum (or mean) again, so nothing overflows. A token's weight never changes (``e^20 ~ 5e8`` is
beyond any cap or band); a sequence's or geometric weight can, on a row holding a token beyond
the bound, whose clamped log-ratio then enters the sum (veRL clamps only the sum)."""


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
def routing_metrics(routes_differ: torch.Tensor, routes: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, float]:
    """How much routing replay changed a mixture of experts' forward.

    Args:
        routes_differ: ``[B, T]`` per token, the MoE layers where the replayed experts (as a set)
            were not the train engine's own router's choice (the train engine's ``routes_differ``).
        routes: ``[B, T, L, k]`` the replayed expert ids, -1 where a token has none.
        attention_mask: ``[B, T]``: real tokens (prompt and response: the forward routes both).

    Returns:
        ``routing_replayed``: token-layers routed by the rollout engine's experts;
        ``routing_differ``: of them, those where the train engine's router would have picked other
        experts (without replay, routes that differ between rollout and training). Counts, so
        micro-batches' metrics add up (:func:`flowrl.algos.losses.combine_metrics`).

    >>> routes = torch.tensor([[[[0, 1], [2, 3]], [[-1, -1], [-1, -1]]]])
    >>> routing_metrics(torch.tensor([[1.0, 0.0]]), routes, torch.tensor([[1, 1]]))
    {'routing_replayed': 2.0, 'routing_differ': 1.0}
    """
    real = attention_mask.bool()[..., None]
    replayed = ((routes[..., 0] >= 0) & real).sum()
    return {"routing_replayed": float(replayed), "routing_differ": float((routes_differ * attention_mask).sum())}


@torch.no_grad()
def tis_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
) -> torch.Tensor:
    """Token-level truncated importance weights ``min(pi_train / pi_rollout, cap)``.

    Yao, Liu, Zhang, Dong, Shang, Gao 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training" (blog post, fengyao.notion.site/off-policy-rl, first published
    2025-08-05; its workshop version, "On the Rollout-Training Mismatch in Modern RL Systems",
    NeurIPS 2025 workshop, is not on arXiv). The blog numbers no equations; the formula
    implemented is its TIS-for-PPO estimator, which multiplies the PPO-clip gradient of each
    sampled token by::

        w_t = min( pi_train(y_t; theta_old) / pi_rollout(y_t; theta_old), C )

    with ``pi_train(theta_old)`` the training engine's recomputation of the rollout's tokens
    (``train_logprobs``, usually ``old_logprobs``), ``pi_rollout`` the inference engine's
    probabilities (``rollout_logprobs``) and ``C = cap``. Computed in log space as
    ``exp(min(train - rollout, log C))``, which equals it without overflowing. The truncation
    is one-sided, as in the blog (ratios below 1 are kept as they are). Truncating IS weights
    to bound their variance goes back to Ionides 2008, who truncates at a sample-size-dependent
    level rather than at a fixed ``C``.
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


@torch.no_grad()
def importance_correction(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tis: float = 0.0,
    mis: float = 0.0,
    mis_low: float = 0.0,
    level: str = "token",
    denominator: dict | None = None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Importance weights for the behaviour-vs-current gap, and that gap's statistics.

    With ``rho_t = exp(train_t - rollout_t)`` per response token, the ratio at ``level`` is
    ``w = rho_t`` (token), ``prod_t rho_t`` (sequence) or ``exp(mean_t log rho_t)``
    (geometric), the last two the same on every token of a row. Then, in this order:

    * MIS (``mis > 0``): ``w = 0`` where ``w > mis`` or ``w < mis_low`` (``mis_low = 0``:
      ``1 / mis`` when ``mis > 1``, veRL's default lower threshold, else no lower bound);
      inside the band ``w`` is kept (TRL's ``token_mask`` / ``sequence_mask``, veRL's ``mask``
      mode). At token level this is IcePop's masking function, Ling Team 2025, "Every Step
      Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model"
      (arXiv:2510.18855v2), Sec. 2.3.2, Eq. (2): ``M(k) = k if alpha <= k <= beta else 0`` with
      ``k = pi_train(theta_old) / pi_infer(theta_old)``, ``alpha = mis_low``, ``beta = mis``
      (the paper's run: ``alpha = 0.5``, ``beta = 5``; pass ``mis_low`` for an ``alpha`` other
      than ``1 / mis``), multiplying the PPO-clip term as in its Eq. (1) once the weights go to
      ``ppo_clip_loss(..., is_weights=...)``. At sequence level it is Seq-MIS (Liu, Li et al.
      2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
      Mismatch", a blog post with no numbered equations: ``1[rho(y) <= C] * rho(y)``) plus a
      lower bound, which that blog does not have. At geometric level the kept weight is the
      geometric ratio itself, as in veRL (that blog series' Geo-Mask keeps weight 1 instead);
    * TIS (``tis > 0``): ``w = min(w, tis)``: Yao et al.'s truncation (see :func:`tis_weights`)
      at token level, Seq-TIS ``min(rho(y), C)`` at sequence level; TRL's ``token_truncate``
      without a lower clip.

    With neither the weights are ``None`` (no correction) and only the statistics come back.
    Every per-token log-ratio is clamped to ``+-20`` before ``exp`` and before a row's sum, and
    the sum (or mean) again (:data:`_MAX_LOG_RATIO`); veRL clamps only the row's sum (or mean),
    so sequence and geometric weights differ from veRL's on rows holding a token whose ratio is
    beyond ``e^20`` (about ``5e8``) or below ``e^-20``.

    Args:
        train_logprobs: ``[B, T]`` the trainer's log-probs of the sampled tokens (the old
            policy's: ``old_logprobs``, or the update's own first forward).
        rollout_logprobs: ``[B, T]`` the rollout engine's log-probs of the same tokens.
        response_mask: ``[B, T]``.
        tis: truncation cap, ``>= 0`` (0: off).
        mis: upper bound of the band, ``>= 0`` (0: off).
        mis_low: lower bound of the band, ``>= 0`` (0: ``1 / mis`` when ``mis > 1``).
        level: one of :data:`IS_LEVELS`.
        denominator: ``{"tokens": ..., "sequences": ...}`` of the whole batch when this is a
            micro-batch of it, so that the means add up over micro-batches
            (:func:`flowrl.algos.losses.combine_metrics`).

    Returns:
        ``(weights [B, T] float32 detached or None, metrics)``; metrics over response tokens:
        ``offpolicy_ratio_mean`` / ``_max`` / ``_min`` (token ratio ``rho``), ``offpolicy_kl``
        (k3 of KL[rollout || train]); at sequence and geometric level also
        ``offpolicy_seq_ratio_mean`` (per row) / ``_max`` / ``_min``; with TIS
        ``offpolicy_clipped_frac`` (share of tokens whose weight was truncated); with MIS
        ``offpolicy_masked_frac`` (share of tokens masked out); with either
        ``offpolicy_weight_mean`` (mean weight applied).
    """
    if level not in IS_LEVELS:
        raise AlgoError(f"importance_correction: unknown level {level!r}; hint: use one of {list(IS_LEVELS)}")
    if tis < 0:
        raise AlgoError(f"importance_correction: tis={tis}; hint: the truncation cap is > 0 (e.g. 2.0), 0 is off")
    if mis < 0 or mis_low < 0:
        raise AlgoError(f"importance_correction: mis={mis}, mis_low={mis_low}; hint: the band's bounds are >= 0 "
                        "(e.g. mis = 2.0), mis = 0 is off")
    check_2d("importance_correction", "train_logprobs", train_logprobs)
    check_same_shape("importance_correction", train_logprobs=train_logprobs, rollout_logprobs=rollout_logprobs,
                     response_mask=response_mask)
    mask = response_mask.float()
    on = mask.bool()
    log_rho = ((train_logprobs.float() - rollout_logprobs.float()) * mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho = torch.exp(log_rho)
    tokens = float(denominator["tokens"]) if denominator else float(mask.sum())
    rows = float(denominator["sequences"]) if denominator else float(mask.shape[0])

    def token_mean(x: torch.Tensor) -> float:
        return float((x.float() * mask).sum() / max(tokens, 1.0))

    def extreme(x: torch.Tensor, fn) -> float:
        return float(fn(x[on])) if on.any() else 1.0

    metrics = {"offpolicy_ratio_mean": token_mean(rho), "offpolicy_ratio_max": extreme(rho, torch.max),
               "offpolicy_ratio_min": extreme(rho, torch.min),
               "offpolicy_kl": token_mean(kl_k3(rollout_logprobs.float(), train_logprobs.float()))}
    if level == "token":
        w = rho
    else:
        log_seq = log_rho.sum(dim=1)
        if level == "geometric":
            log_seq = log_seq / mask.sum(dim=1).clamp(min=1.0)
        seq = torch.exp(log_seq.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B]
        has = mask.sum(dim=1) > 0
        metrics.update(offpolicy_seq_ratio_mean=float(seq[has].sum() / max(rows, 1.0)),
                       offpolicy_seq_ratio_max=float(seq[has].max()) if has.any() else 1.0,
                       offpolicy_seq_ratio_min=float(seq[has].min()) if has.any() else 1.0)
        w = seq[:, None].expand_as(mask)
    if not tis and not mis:
        return None, metrics
    weights = w
    if mis:
        low = mis_low or (1.0 / mis if mis > 1.0 else 0.0)
        outside = (w > mis) | (w < low)
        weights = torch.where(outside, torch.zeros_like(w), weights)
        metrics["offpolicy_masked_frac"] = token_mean(outside)
    if tis:
        metrics["offpolicy_clipped_frac"] = token_mean((weights > tis))
        weights = weights.clamp(max=tis)
    weights = weights * mask
    metrics["offpolicy_weight_mean"] = token_mean(weights)
    return weights, metrics
