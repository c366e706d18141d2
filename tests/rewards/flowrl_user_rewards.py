"""User reward functions for the reward-pool tests (imported by spec string, also in spawned workers)."""

import time


def length_reward(completions, answers):
    """len(completion) as a float."""
    return [float(len(c)) for c in completions]


def fragile_reward(completions, answers):
    """1.0 for a correct answer; raises on the completion "boom" and on non-digit answers."""
    out = []
    for c, a in zip(completions, answers):
        if c == "boom":
            raise ValueError(f"cannot score {c!r}")
        out.append(float(int(c) == int(a)))
    return out


def prompt_aware(completions, answers, prompts):
    """1.0 when the completion repeats the prompt's first character."""
    return [float(bool(p) and c.startswith(p[0])) for p, c in zip(prompts, completions)]


def wrong_length(completions, answers):
    return [1.0]


def not_a_number(completions, answers):
    return ["high" if c == "x" else 0.5 for c in completions]


def slow_on_sleep(completions, answers):
    if "sleep" in completions:
        time.sleep(60)
    return [1.0 for _ in completions]


NOT_CALLABLE = 3
