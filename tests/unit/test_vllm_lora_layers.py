"""Which vLLM instances get vLLM's LoRA layers (kvmesh/vllm/engine.py), without vLLM: they cost every step, so only
an instance that may serve adapters builds them."""

from kvmesh.settings import EngineSettings
from kvmesh.vllm.engine import lora_layers


def test_an_instance_without_adapters_runs_vllm_without_its_lora_layers():
    assert not lora_layers(EngineSettings(backend="vllm"))


def test_adapters_at_start_or_vllm_lora_build_them():
    assert lora_layers(EngineSettings(backend="vllm", lora_adapters="sql=/adapters/sql"))
    assert lora_layers(EngineSettings(backend="vllm", vllm_lora=True))
