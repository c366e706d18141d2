"""RL math for flowrl: advantages, KL estimators, losses and train/rollout mismatch.

Pure torch functions over right-padded ``[B, T]`` batches (see
``flowrl/engines/types.py``); each one is small and documented with shapes.
"""

from flowrl.algos.advantages import (
    AlgoError,
    broadcast_to_tokens,
    gae,
    group_advantages,
    last_response_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_reward_to_tokens,
)
from flowrl.algos.kl import KL_ESTIMATORS, kl_estimate, kl_k1, kl_k2, kl_k3, kl_penalty_in_reward
from flowrl.algos.losses import (
    AGGREGATIONS,
    aggregate,
    entropy_bonus,
    global_denominator,
    kl_loss,
    ppo_clip_loss,
    value_loss,
)
from flowrl.algos.mismatch import mismatch_metrics, tis_weights

__all__ = [
    "AGGREGATIONS",
    "AlgoError",
    "KL_ESTIMATORS",
    "aggregate",
    "broadcast_to_tokens",
    "entropy_bonus",
    "gae",
    "global_denominator",
    "group_advantages",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_penalty_in_reward",
    "last_response_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_reward_to_tokens",
    "tis_weights",
    "value_loss",
]
