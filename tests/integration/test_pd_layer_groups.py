"""KV pushed layer group by layer group (``push_layer_groups``) through a real router, prefill and decode
(tiny model, real nats-server, loopback): a prompt of several prefill chunks leaves prefill in parts of
(blocks, layer range), decode reassembles and imports them, and the greedy tokens equal a fresh computation
(Hugging Face on the same weights) and decode computing the prompt itself."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from kvmesh.proto.v1 import api_pb2, common_pb2

from .test_router_bad_input import TinyMesh, model_dir  # noqa: F401

PROMPT = [(i * 7919) % 250 + 3 for i in range(150)]  # 150 tokens: chunks of 64, 64, 22; 10 blocks of 16


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    m = TinyMesh(nats_server.url, model_dir)
    m.engine_cfg = m.engine_cfg.model_copy(update={"max_batched_tokens": 64})
    m.worker_cfg = m.worker_cfg.model_copy(update={"push_layer_groups": 2})  # the tiny model's 2 layers
    with m:
        yield m


def pushed_parts(mesh: TinyMesh) -> list[tuple[int, tuple[int, int] | None]]:
    """Record each part prefill pushes from now on: (first block, layers)."""
    prefill = next(a for a in mesh.workers[0].attached if hasattr(a, "handoff"))
    client, parts = prefill.handoff.transfer, []
    push = client.push

    async def recording(*args, **kwargs):
        parts.append((kwargs.get("first_block", 0), kwargs.get("layers")))
        return await push(*args, **kwargs)

    client.push = recording
    return parts


def generate(mesh: TinyMesh, prompt: list[int], disaggregate: str, cache_salt: str = "") -> list[int]:
    """Greedy token ids through the router's gRPC API, the path forced by ``x-kvmesh-disaggregate``."""
    with grpc.insecure_channel(mesh.grpc_target) as channel:
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt), cache_salt=cache_salt,
                                      sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True))
        return [t for chunk in mesh.stub(channel).Generate(req, timeout=60,
                                                           metadata=(("x-kvmesh-disaggregate", disaggregate),))
                for t in chunk.token_ids]


def received_bytes(worker, direction: str) -> float:
    return worker.metrics.registry.get_sample_value("kvmesh_worker_kv_transfer_bytes_total",
                                                    {"direction": direction}) or 0.0


def decode_blocks(mesh: TinyMesh) -> dict[str, int]:
    decode = mesh.workers[1]
    return mesh.call(decode.engine.call(lambda e: e.blocks.counts()))


def test_a_multi_chunk_prompt_pushed_in_layer_groups_gives_the_tokens_of_a_fresh_computation(mesh, model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from tests.unit.helpers import hf_greedy

    parts = pushed_parts(mesh)
    decode = mesh.workers[1]
    fallbacks = decode.metrics_fallbacks
    received, landed = received_bytes(decode, "receive"), received_bytes(decode, "receive_in_place")
    pushed = generate(mesh, PROMPT, "always")
    assert decode.metrics_fallbacks == fallbacks  # the pushed KV was used, not recomputed
    # every pushed byte landed straight in decode's pool: none was buffered and copied in
    assert received_bytes(decode, "receive_in_place") - landed == received_bytes(decode, "receive") - received > 0
    counts = decode_blocks(mesh)
    assert counts["reserved"] == counts["pinned"] == 0 and mesh.workers[1].transfer_server.landings == 0
    assert parts == [(0, (0, 1)), (0, (1, 2)), (4, (0, 1)), (4, (1, 2)), (8, (0, 1)), (8, (1, 2))]
    local = generate(mesh, PROMPT, "never", cache_salt="fresh")  # decode computes it all, nothing reused
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert pushed == local == hf_greedy(hf, PROMPT, 8)


def test_with_receive_in_place_off_the_push_is_buffered_and_gives_the_same_tokens(mesh):
    decode = mesh.workers[1]
    decode.cfg = decode.cfg.model_copy(update={"receive_in_place": False})
    try:
        prompt = PROMPT[:70]  # its own prompt: nothing of it is cached on either side
        landed, fallbacks = received_bytes(decode, "receive_in_place"), decode.metrics_fallbacks
        buffered = generate(mesh, prompt, "always")
        assert decode.metrics_fallbacks == fallbacks
        assert received_bytes(decode, "receive_in_place") == landed  # nothing landed in place
    finally:
        decode.cfg = decode.cfg.model_copy(update={"receive_in_place": True})
    assert buffered == generate(mesh, prompt, "never", cache_salt="fresh-70")
    assert decode_blocks(mesh)["reserved"] == 0
