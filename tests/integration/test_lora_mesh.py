"""Multi-LoRA through a real router in front of a real prefill and a real decode instance (tiny model, real
nats-server, loopback): adapters loaded and unloaded at run time over HTTP (vLLM's API), listed with their
parent, picked per request with ``model``, their greedy tokens equal to Hugging Face + PEFT on the same weights,
and their KV their own (another adapter never hits it; the second turn under the same one does)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from kvmesh.proto.v1 import api_pb2, common_pb2

from tests.lora_helpers import ATTN, MLP, make_adapter, peft_greedy

from .test_router_bad_input import TinyMesh, assert_http_error, model_dir, still_serves  # noqa: F401

PROMPT = [5, 17, 33, 2, 99, 180, 7, 64, 12, 250, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48]  # > 1 block of 16


@pytest.fixture(scope="module")
def hf(model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {"sql": (str(root / "sql"), make_adapter(hf, root / "sql", ATTN, r=8, seed=1)),
            "chat": (str(root / "chat"), make_adapter(hf, root / "chat", ATTN + MLP, r=4, seed=2))}


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir, adapters) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir) as m:
        for name, (path, _) in adapters.items():
            status, body, _ = m.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            assert status == 200, body
            assert body == {"raw": f"Success: LoRA adapter '{name}' added successfully."}
        yield m


def generate(mesh: TinyMesh, model: str, prompt: list[int], n: int = 8) -> tuple[list[int], int]:
    """Greedy tokens through the router's gRPC API, and the prompt tokens served from cache."""
    with grpc.insecure_channel(mesh.grpc_target) as channel:
        req = api_pb2.GenerateRequest(model=model, token_ids=api_pb2.TokenIds(ids=prompt),
                                      sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True))
        tokens, cached = [], 0
        for chunk in mesh.stub(channel).Generate(req, timeout=60):
            tokens += chunk.token_ids
            if chunk.HasField("usage"):
                cached = chunk.usage.cached_tokens
    return tokens, cached


def test_models_lists_each_adapter_with_the_base_as_parent(mesh):
    status, body, _ = mesh.http("GET", "/v1/models")
    assert status == 200
    base = body["data"][0]["id"]
    assert {m["id"]: m["parent"] for m in body["data"]} == {base: None, "chat": base, "sql": base}


def test_greedy_tokens_per_adapter_equal_hf_peft(mesh, adapters, hf):
    from tests.unit.helpers import hf_greedy

    base, _ = generate(mesh, "", PROMPT)
    assert base == hf_greedy(hf, PROMPT, 8)
    for name, (_, ref) in adapters.items():
        got, _ = generate(mesh, name, PROMPT)
        assert got == peft_greedy(ref, PROMPT, 8), name
        assert got != base, name


def test_kv_is_keyed_by_adapter(mesh):
    prompt = [p + 1 for p in PROMPT] + list(range(100, 120))  # 40 tokens: 2 full blocks
    first, cached = generate(mesh, "sql", prompt)
    assert cached == 0
    _, cached_other = generate(mesh, "chat", prompt)
    assert cached_other == 0  # the same prompt under another adapter shares no block
    _, cached_base = generate(mesh, "", prompt)
    assert cached_base == 0
    _, cached_again = generate(mesh, "sql", prompt + first + [9, 9])
    assert cached_again >= 32  # the second turn under the same adapter hits its first


def test_openai_request_picks_an_adapter_by_model_and_names_it(mesh, adapters):
    out = {}
    for model in ("sql", ""):
        status, body, _ = mesh.post("/v1/completions", {"model": model, "prompt": "Hello there", "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        out[model] = body["choices"][0]["text"]
        assert body["model"] == (model or mesh.router.model_id)  # the answer names the adapter it came from
    assert out["sql"] != out[""]


def test_unknown_adapter_is_404_naming_those_served(mesh):
    assert_http_error(mesh, mesh.post("/v1/completions", {"model": "nope", "prompt": "Hi", "max_tokens": 2}),
                      404, "'nope'", "'chat'", "'sql'")


def test_bad_adapter_is_400_and_the_mesh_keeps_serving(mesh, tmp_path):
    from kvmesh.model_source.hf_config import ModelConfig

    from tests.unit.helpers import hf_tiny

    make_adapter(hf_tiny(ModelConfig.tiny(hidden_size=32, head_dim=8)), tmp_path / "other", ["q_proj"], r=2)
    assert_http_error(mesh, mesh.post("/v1/load_lora_adapter", {"lora_name": "other",
                                                                "lora_path": str(tmp_path / "other")}),
                      400, "do not fit the base model")
    assert_http_error(mesh, mesh.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}),
                      400, "not a readable directory")
    assert_http_error(mesh, mesh.post("/v1/load_lora_adapter", {"lora_name": "x"}), 400, "lora_path")
    _, body, _ = mesh.http("GET", "/v1/models")
    assert "other" not in {m["id"] for m in body["data"]}
    still_serves(mesh)
    assert generate(mesh, "sql", PROMPT)[0]


def test_loading_a_loaded_name_needs_inplace_and_a_reload_gets_new_keys(mesh, adapters, hf, tmp_path):
    path, _ = adapters["chat"]
    assert_http_error(mesh, mesh.post("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": path}),
                      400, "already been loaded")
    prompt = [7] * 20 + [8] * 20
    generate(mesh, "chat", prompt)
    assert generate(mesh, "chat", prompt)[1] > 0
    ref = make_adapter(hf, tmp_path / "chat2", MLP, r=2, seed=7)
    status, body, _ = mesh.post("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(tmp_path / "chat2"),
                                                          "load_inplace": True})
    assert status == 200, body
    got, cached = generate(mesh, "chat", prompt)
    assert cached == 0  # other weights under the same name: new keys, no stale KV
    assert got == peft_greedy(ref, prompt, 8)


def test_unload_then_the_adapter_is_404(mesh, adapters, hf, tmp_path):
    make_adapter(hf, tmp_path / "tmp", ["v_proj"], r=2, seed=5)
    assert mesh.post("/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(tmp_path / "tmp")})[0] == 200
    assert generate(mesh, "tmp", PROMPT)[0]
    status, body, _ = mesh.post("/v1/unload_lora_adapter", {"lora_name": "tmp"})
    assert status == 200 and "removed" in body["raw"]
    assert_http_error(mesh, mesh.post("/v1/completions", {"model": "tmp", "prompt": "Hi", "max_tokens": 2}),
                      404, "'tmp'")
    assert_http_error(mesh, mesh.post("/v1/unload_lora_adapter", {"lora_name": "tmp"}), 404, "'tmp'")
