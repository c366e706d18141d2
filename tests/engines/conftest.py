"""Fixtures for engine tests (helpers live in engine_testkit.py, importable by test files)."""

from __future__ import annotations

import pytest

from engine_testkit import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Directory of the tiny Llama checkpoint, shared by every engine test."""
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))

