"""flowrl: a declarative dataflow language and compiler for RL post-training of LLMs."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from flowrl import Flow` without importing the builder (and the compiler) on `import flowrl`.
    if name == "Flow":
        from flowrl.builder import Flow

        return Flow
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")
