"""Rewards: built-in verifiers and a fault-tolerant pool for user reward functions."""

from flowrl.rewards.pool import RewardError, RewardPool, RewardResult, RewardSpecError, resolve_reward
from flowrl.rewards.verifiers import VERIFIERS, UnknownVerifierError, get_verifier

__all__ = [
    "VERIFIERS", "RewardError", "RewardPool", "RewardResult", "RewardSpecError",
    "UnknownVerifierError", "get_verifier", "resolve_reward",
]
