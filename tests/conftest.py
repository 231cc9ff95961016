import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture
def tiny_config():
    from kvmesh.model_source.hf_config import ModelConfig

    return ModelConfig.tiny()
