"""Rewards for the end-to-end tests (imported by name from a flow: "e2e_rewards:sevens")."""


def sevens(completions, answers, prompts=None):
    """Fraction of the completion's characters that are '7': learnable from random init."""
    return [c.count("7") / max(len(c), 1) for c in completions]


def flaky(completions, answers, prompts=None):
    """Like ``sevens`` but raises on completions that start with '1' (a user bug)."""
    if any(c.startswith("1") for c in completions):
        raise ValueError("flaky reward: completion starts with 1")
    return sevens(completions, answers)


def short(completions, answers, prompts=None):
    """1.0 for a completion of at most 4 characters (a length shaping term for ``weighted_sum``)."""
    return [1.0 if len(c) <= 4 else 0.0 for c in completions]
