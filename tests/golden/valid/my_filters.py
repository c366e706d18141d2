"""The user function `user_call.flow` calls (`call("my_filters:drop_degenerate", ...)`): found
next to the flow file by `flowrl check`, which reads this source without running it."""


def drop_degenerate(rollouts: dict, scores: dict) -> dict:
    """Keep every sample that generated at least one token; its reward is kept as it is."""
    keep = [bool(len(ids)) for ids in rollouts["response_ids"]]
    return {"rewards": scores["rewards"], "keep": keep}
