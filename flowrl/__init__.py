"""flowrl: a declarative dataflow language and compiler for RL post-training of LLMs."""

__version__ = "0.1.0"

_BUILDER = ("Flow", "Schedule", "ctor", "size", "BuilderError")
"""Names of :mod:`flowrl.builder` exported here (``from flowrl import Flow, ctor, size``)."""


def __getattr__(name: str):
    # `from flowrl import Flow` without importing the builder (and the compiler) on `import flowrl`.
    if name in _BUILDER:
        from flowrl import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")
