"""Multi-LoRA through a real router in front of a real prefill and a real decode instance (tiny model, real
nats-server, loopback): adapters loaded and unloaded at run time over HTTP (vLLM's API, with the router's admin
key, from folders under its lora_root), listed with their parent, picked per request with ``model``, their
greedy tokens equal to Hugging Face + PEFT on the same weights, and their KV their own (another adapter never
hits it; the second turn under the same one does). Without the admin key nothing is loaded or unloaded, and the
answer is the same whatever the call names."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from kvmesh.proto.v1 import api_pb2, common_pb2

from tests.lora_helpers import ATTN, MLP, make_adapter, peft_greedy

from .test_router_bad_input import TinyMesh, assert_http_error, model_dir, still_serves  # noqa: F401

PROMPT = [5, 17, 33, 2, 99, 180, 7, 64, 12, 250, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48]  # > 1 block of 16
ADMIN = "sk-admin-test"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def admin(mesh: TinyMesh, path: str, body: dict, key: str | None = ADMIN) -> tuple[int, dict, dict]:
    """An admin call, with the admin key unless ``key`` says otherwise (None: no key)."""
    return mesh.post(path, body, {"authorization": f"Bearer {key}"} if key is not None else {})


@pytest.fixture(scope="module")
def hf(model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The router's lora_root."""
    return tmp_path_factory.mktemp("loras")


@pytest.fixture
def under_root(root) -> Path:
    """A fresh folder under the root for one test's adapters."""
    path = root / uuid.uuid4().hex[:8]
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def adapters(hf, root):
    return {"sql": (str(root / "sql"), make_adapter(hf, root / "sql", ATTN, r=8, seed=1)),
            "chat": (str(root / "chat"), make_adapter(hf, root / "chat", ATTN + MLP, r=4, seed=2))}


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir, adapters, root) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir, admin_key=ADMIN, lora_root=str(root)) as m:
        for name, (path, _) in adapters.items():
            status, body, _ = admin(m, LOAD, {"lora_name": name, "lora_path": path})
            assert status == 200, body
            assert body == {"raw": f"Success: LoRA adapter '{name}' added successfully."}
        yield m


def served(mesh: TinyMesh) -> set[str]:
    status, body, _ = mesh.http("GET", "/v1/models")
    assert status == 200, body
    return {m["id"] for m in body["data"]}


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


def test_bad_adapter_is_400_and_the_mesh_keeps_serving(mesh, under_root):
    from kvmesh.model_source.hf_config import ModelConfig

    from tests.unit.helpers import hf_tiny

    make_adapter(hf_tiny(ModelConfig.tiny(hidden_size=32, head_dim=8)), under_root / "other", ["q_proj"], r=2)
    assert_http_error(mesh, admin(mesh, LOAD, {"lora_name": "other", "lora_path": str(under_root / "other")}),
                      400, "do not fit the base model")
    assert_http_error(mesh, admin(mesh, LOAD, {"lora_name": "x", "lora_path": str(under_root / "nonexistent")}),
                      400, "not a readable directory")
    assert_http_error(mesh, admin(mesh, LOAD, {"lora_name": "x"}), 400, "lora_path")
    assert "other" not in served(mesh)
    still_serves(mesh)
    assert generate(mesh, "sql", PROMPT)[0]


def test_loading_a_loaded_name_needs_inplace_and_a_reload_gets_new_keys(mesh, adapters, hf, under_root):
    path, _ = adapters["chat"]
    assert_http_error(mesh, admin(mesh, LOAD, {"lora_name": "chat", "lora_path": path}), 400, "already been loaded")
    prompt = [7] * 20 + [8] * 20
    generate(mesh, "chat", prompt)
    assert generate(mesh, "chat", prompt)[1] > 0
    ref = make_adapter(hf, under_root / "chat2", MLP, r=2, seed=7)
    status, body, _ = admin(mesh, LOAD, {"lora_name": "chat", "lora_path": str(under_root / "chat2"),
                                         "load_inplace": True})
    assert status == 200, body
    got, cached = generate(mesh, "chat", prompt)
    assert cached == 0  # other weights under the same name: new keys, no stale KV
    assert got == peft_greedy(ref, prompt, 8)


def test_unload_then_the_adapter_is_404(mesh, adapters, hf, root, under_root):
    make_adapter(hf, under_root / "tmp", ["v_proj"], r=2, seed=5)
    relative = os.path.relpath(under_root / "tmp", root)  # a path relative to lora_root names a folder in it
    assert admin(mesh, LOAD, {"lora_name": "tmp", "lora_path": relative})[0] == 200
    assert generate(mesh, "tmp", PROMPT)[0]
    status, body, _ = admin(mesh, UNLOAD, {"lora_name": "tmp"})
    assert status == 200 and "removed" in body["raw"]
    assert_http_error(mesh, mesh.post("/v1/completions", {"model": "tmp", "prompt": "Hi", "max_tokens": 2}),
                      404, "'tmp'")
    assert_http_error(mesh, admin(mesh, UNLOAD, {"lora_name": "tmp"}), 404, "'tmp'")


# ---- the admin key and the root ----------------------------------------------------------------------------

@pytest.mark.parametrize("key", [None, "sk-wrong", "sk-admin-tes", ADMIN + " x"], ids=["none", "wrong", "prefix",
                                                                                        "longer"])
def test_without_the_admin_key_nothing_changes_and_the_answer_names_nothing(mesh, adapters, hf, under_root, key):
    make_adapter(hf, under_root / "new", ["q_proj"], r=2, seed=3)
    before = served(mesh)
    calls = [(LOAD, {"lora_name": "new", "lora_path": str(under_root / "new")}),     # a real adapter
             (LOAD, {"lora_name": "new", "lora_path": str(under_root / "missing")}),  # a path that does not exist
             (LOAD, {"lora_name": "new", "lora_path": "/etc"}),                      # outside the root
             (LOAD, {"lora_name": "sql", "lora_path": adapters["chat"][0], "load_inplace": True}),
             (LOAD, {}), (UNLOAD, {"lora_name": "sql"}), (UNLOAD, {"lora_name": "never-loaded"})]
    answers = set()
    for path, body in calls:
        status, got, _ = admin(mesh, path, body, key)
        answers.add((status, got["error"]["type"], got["error"]["message"]))
    assert len(answers) == 1, answers  # one answer, whatever the call names
    status, error_type, message = answers.pop()
    assert status == 401 and error_type == "authentication_error" and "admin key" in message
    assert served(mesh) == before
    assert generate(mesh, "sql", PROMPT)[0]


def test_a_path_outside_lora_root_is_refused_with_the_admin_key(mesh, adapters, hf, root, tmp_path):
    make_adapter(hf, tmp_path / "outside", ["q_proj"], r=2, seed=4)  # a valid adapter, not under the root
    (root / "escape").symlink_to(tmp_path / "outside")                  # nor is a link out of it
    for lora_path in (str(tmp_path / "outside"), f"{root}/../{tmp_path.name}/outside",
                      os.path.relpath(tmp_path / "outside", root), str(root / "escape")):
        assert_http_error(mesh, admin(mesh, LOAD, {"lora_name": "outside", "lora_path": lora_path}), 400,
                          "outside lora_root")
    assert "outside" not in served(mesh)
