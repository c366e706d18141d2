"""The user function `abstract_library.flow` calls (`call("mod:fn", ...)`): found next to the
flow file by `flowrl check`, which reads this source without running it."""


def fn(data_in: dict, rollouts: dict) -> dict:
    """A bonus of 0 per sample: the fields of each data argument in, a dict of fields out."""
    return {"bonus": [0.0] * len(rollouts["response_ids"])}
