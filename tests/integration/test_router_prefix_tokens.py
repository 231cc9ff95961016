"""The router's prefix token cache on a real stack: prompts that repeat a long system prompt are tokenized only
past it, and the ids the router routed (``return_token_ids``) are the whole prompt's, for completions and chats.
A real router in front of a role ``both`` instance; a tiny random model with a 4,096-token context (the byte
tokenizer: one id a byte), real nats-server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvmesh.engine.loader import save_hf_dir
from kvmesh.model_source.hf_config import ModelConfig
from kvmesh.model_source.tokenizer import Tokenizer, save_byte_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from .test_router_bad_input import TinyMesh
from .test_sessions import eventually

SYSTEM = "You answer questions about the mesh and its caches, briefly and without guessing. " * 30  # ~2,500 chars
ASK = {"max_tokens": 2, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("model")
    config = ModelConfig.tiny(max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_hf()))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return save_hf_dir(config, weights, root / "tiny", save_byte_tokenizer(root / "tok"))


@pytest.fixture(scope="module")
def mesh(nats_server, long_model_dir) -> Iterator[TinyMesh]:
    with TinyMesh(nats_server.url, long_model_dir, roles=("both",), engine={"num_blocks": 1024}) as m:
        yield m


def tokenized(mesh: TinyMesh) -> dict[str, float]:
    text = mesh.router.metrics.exposition()[0].decode()
    out = {}
    for how in ("reused", "encoded"):
        line = next(ln for ln in text.splitlines()
                    if ln.startswith(f'kvmesh_router_prompt_tokens_tokenized_total{{how="{how}"}}'))
        out[how] = float(line.split()[-1])
    return out


def test_completions_that_repeat_a_system_prompt_are_tokenized_past_it_with_the_whole_prompts_ids(mesh,
                                                                                                   long_model_dir):
    whole = Tokenizer.from_dir(long_model_dir)
    assert "kvmesh_router_prefix_token_cache_enabled 1.0" in mesh.router.metrics.exposition()[0].decode()
    before = tokenized(mesh)
    for q in ("What is a block key?", "Why keep a pool beside the instances?", "Who hashes the prompt?"):
        prompt = SYSTEM + "Question: " + q
        status, body, _ = mesh.post("/v1/completions", {"model": mesh.router.model_id, "prompt": prompt, **ASK})
        assert status == 200, body
        assert body["choices"][0]["prompt_token_ids"] == whole.encode(prompt)
    after = tokenized(mesh)
    reused = after["reused"] - before["reused"]
    assert reused >= 2 * (len(SYSTEM) - 512)  # the second and third prompts: all but the system prompt's last chunk
    assert after["encoded"] - before["encoded"] < reused


def test_chats_with_one_system_prompt_reuse_it_and_route_the_templates_ids(mesh, long_model_dir):
    whole = Tokenizer.from_dir(long_model_dir)
    before = tokenized(mesh)
    for q in ("Say something.", "Say something else, please."):
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        status, body, _ = mesh.post("/v1/chat/completions", {"model": mesh.router.model_id, "messages": chat,
                                                             **ASK})
        assert status == 200, body
        assert body["prompt_token_ids"] == whole.apply_chat_template(chat)
    assert tokenized(mesh)["reused"] - before["reused"] >= len(SYSTEM) - 512


def test_a_long_system_messages_cache_control_pins_exactly_its_blocks(mesh):
    """A message's cache_control covers the chat up to the end of that message: rendered and tokenized on the
    tokenize threads (the system message is long), and its blocks, not the question's, get the priority."""
    system = f"{uuid.uuid4().hex} " + SYSTEM
    chat = [{"role": "system", "content": system, "cache_control": {"ttl": 600, "priority": 70}},
            {"role": "user", "content": "And what is the question after it? " * 8}]
    status, body, _ = mesh.post("/v1/chat/completions", {"model": mesh.router.model_id, "messages": chat, **ASK})
    assert status == 200, body
    tok = mesh.router.tokenizer
    plain = [{k: v for k, v in m.items() if k != "cache_control"} for m in chat]
    upto = len(tok.apply_chat_template(plain[:1], add_generation_prompt=False))
    prompt = tok.apply_chat_template(plain)
    engine = mesh.workers[0].engine
    bm = engine.engine.blocks  # type: ignore[attr-defined]
    block = bm.block_size

    def priorities() -> list[int]:
        return [n.priority for n in bm.match(engine.namespace(""), prompt).nodes]

    assert eventually(lambda: len(priorities()) == len(prompt) // block)
    got = priorities()
    assert set(got[:upto // block]) == {70}  # the system message's whole blocks
    assert set(got[upto // block + 1:]) == {0}  # past the block it ends in: the question's
