"""RL math for flowrl: advantages, KL estimators, losses, off-policy corrections, reward
shaping, dynamic sampling and learning-rate schedules.

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
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_reward_to_tokens,
)
from flowrl.algos.filtering import dynamic_sample, varied_groups
from flowrl.algos.kl import KL_ESTIMATORS, kl_abs, kl_estimate, kl_k1, kl_k2, kl_k3, kl_penalty_in_reward
from flowrl.algos.losses import (
    AGGREGATIONS,
    aggregate,
    cispo_loss,
    entropy_bonus,
    global_denominator,
    gspo_loss,
    kl_loss,
    pg_loss,
    ppo_clip_loss,
    value_loss,
)
from flowrl.algos.mismatch import IS_LEVELS, importance_correction, mismatch_metrics, tis_weights
from flowrl.algos.schedules import LR_SCHEDULES, lr_factor
from flowrl.algos.shaping import overlong_penalty

__all__ = [
    "AGGREGATIONS",
    "AlgoError",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "LR_SCHEDULES",
    "aggregate",
    "broadcast_to_tokens",
    "cispo_loss",
    "dynamic_sample",
    "entropy_bonus",
    "gae",
    "global_denominator",
    "group_advantages",
    "gspo_loss",
    "importance_correction",
    "kl_abs",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_penalty_in_reward",
    "last_response_index",
    "lr_factor",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "overlong_penalty",
    "pg_loss",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_reward_to_tokens",
    "tis_weights",
    "value_loss",
    "varied_groups",
]
