"""flowrl: a declarative dataflow language and compiler for RL post-training of LLMs."""

__version__ = "0.1.0"
