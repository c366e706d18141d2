"""Rewards for the algorithm end-to-end tests (imported by name from a flow: "algo_rewards:starts_with_7")."""


def starts_with_7(completions, answers, prompts=None):
    """1.0 when the completion starts with '7', else 0.0: a right/wrong reward, so that a random
    policy's groups are often all wrong (all 0) and DAPO's dynamic sampling has to draw again."""
    return [1.0 if c.startswith("7") else 0.0 for c in completions]
