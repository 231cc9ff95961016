"""Fixtures the engine's unit tests share: the tiny Llama config and random transformers weights of it (one
instance per test module, as each module had its own), and engines of it that detokenize with the byte
tokenizer."""

import pytest
from kvmesh.model_source.hf_config import ModelConfig
from kvmesh.model_source.tokenizer import Tokenizer, save_byte_tokenizer

from .helpers import hf_tiny


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.tiny()


@pytest.fixture(scope="module")
def hf(cfg):
    return hf_tiny(cfg)


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(save_byte_tokenizer(tmp_path_factory.mktemp("bytetok")))


@pytest.fixture
def byte_engine(tiny_config, byte_tokenizer):
    """A factory of fresh engines on the tiny random model, detokenizing with the byte tokenizer (its EOS too)."""
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.settings import EngineSettings

    def build() -> LLMEngine:
        e = LLMEngine(EngineSettings(num_blocks=128, block_size=4, max_batched_tokens=256, attention="torch"),
                      model_config=tiny_config)
        e.tokenizer, e.eos_token_ids = byte_tokenizer, set(byte_tokenizer.eos_token_ids)
        return e
    return build
