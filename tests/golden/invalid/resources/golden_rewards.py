"""Reward functions for the golden E606 case: `flowrl check` reads this source, never runs it."""


def score_answers(completions: list[str], answers: list[str]) -> list[float]:
    return [float(c.strip() == a) for c, a in zip(completions, answers)]
