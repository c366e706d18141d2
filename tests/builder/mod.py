"""User functions the builder tests' flows call (`call("mod:fn", ...)`, `call("mod:log", ...)`):
`flowrl check` finds this module next to the file that builds the flow and reads, never runs, it."""


def fn(*values) -> dict:
    return {"f": [], "g": []}


def log(*values) -> dict:
    return {}
