"""Fixtures for tests/models: tiny checkpoints built once per session."""

import pytest

from flowrl.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random-weight tiny Llama over the arith charset (default shape)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), seed=0)
