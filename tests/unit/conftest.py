"""Fixtures the engine's unit tests share: the tiny Llama config and random transformers weights of it (one
instance per test module, as each module had its own)."""

import pytest
from kvmesh.model_source.hf_config import ModelConfig

from .helpers import hf_tiny


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.tiny()


@pytest.fixture(scope="module")
def hf(cfg):
    return hf_tiny(cfg)
