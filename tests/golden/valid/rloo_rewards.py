"""The reward `rloo.flow` names (`python_reward("rloo_rewards:score")`): found next to the flow
file by `flowrl check`, which reads this source without running it."""


def score(completions: list[str], answers: list[str]) -> list[float]:
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]
