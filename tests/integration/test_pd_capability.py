"""The push capability through a real router, prefill and decode (tiny model, real nats-server, loopback): decode
grants each accepted request's push, the router hands the token to prefill, and decode's transfer endpoint
refuses anything else. A push under a forged token is refused, counted and the prompt recomputed (the same
greedy tokens); a token replayed after its hand-off or borrowed for another request is refused and counted, and
the next request's push is used as before."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kvmesh.transfer import Refusal, TransferClient, TransferRejected

from services.prefill.faults import FaultyHandoff
from services.prefill.handoff import announcer
from services.prefill.servicer import PrefillServicer

from .test_pd_layer_groups import decode_blocks, generate
from .test_router_bad_input import TinyMesh, model_dir  # noqa: F401


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir) as m:
        yield m


def prompt(seed: int, n: int = 90) -> list[int]:
    return [(i * 7919 + seed * 104729) % 250 + 3 for i in range(n)]


def prefill_servicer(mesh: TinyMesh) -> PrefillServicer:
    return next(a for a in mesh.workers[0].attached if isinstance(a, PrefillServicer))


def refused(mesh: TinyMesh, reason: Refusal) -> float:
    return mesh.workers[1].metrics.registry.get_sample_value("kvmesh_worker_kv_transfer_refused_total",
                                                             {"reason": reason}) or 0.0


def pushes(mesh: TinyMesh) -> list[dict[str, Any]]:
    """Record every part prefill pushes from now on: its address, transfer id, token and a copy of its bytes."""
    client, seen = prefill_servicer(mesh).handoff.transfer, []
    push = client.push

    async def recording(address, transfer_id, layout, payload, block_keys, num_tokens, **kw):
        seen.append({"address": address, "transfer_id": transfer_id, "layout": layout, "payload": bytes(payload),
                     "num_tokens": num_tokens, **kw})
        return await push(address, transfer_id, layout, payload, block_keys, num_tokens, **kw)

    client.push = recording
    return seen


async def replay(part: dict[str, Any], transfer_id: str, token: str) -> TransferRejected:
    async with TransferClient() as client:
        with pytest.raises(TransferRejected) as e:
            await client.push(part["address"], transfer_id, part["layout"], part["payload"], [], part["num_tokens"],
                              layers=part.get("layers"), first_block=part["first_block"], token=token)
    return e.value


def holds_nothing(mesh: TinyMesh) -> bool:
    counts, decode = decode_blocks(mesh), mesh.workers[1]
    return counts["reserved"] == counts["pinned"] == 0 and decode.transfer_server.landings == 0 \
        and decode.transfer_server.buffered_bytes == 0 and len(decode.transfer_server.grants) == 0


def test_a_push_under_a_forged_token_is_refused_counted_and_the_prompt_recomputed(mesh) -> None:
    prefill, decode = prefill_servicer(mesh), mesh.workers[1]
    honest = prefill.handoff
    prefill.handoff = FaultyHandoff(announcer(mesh.workers[0]), forge=1)
    bad_tokens, fallbacks = refused(mesh, Refusal.BAD_TOKEN), decode.metrics_fallbacks
    try:
        forged = generate(mesh, prompt(1), "always")
    finally:
        mesh.call(prefill.handoff.close())
        prefill.handoff = honest
    assert decode.metrics_fallbacks == fallbacks + 1  # recomputed, nothing pushed was consumed
    assert refused(mesh, Refusal.BAD_TOKEN) == bad_tokens + 1  # its first part; the push stopped there
    assert forged == generate(mesh, prompt(1), "never", cache_salt="fresh")
    assert holds_nothing(mesh)


def test_a_token_replayed_or_borrowed_for_another_request_is_refused_and_counted(mesh) -> None:
    decode = mesh.workers[1]
    seen = pushes(mesh)
    generate(mesh, prompt(2), "always")
    first = len(seen)
    generate(mesh, prompt(3), "always")
    a, b = seen[0], seen[first]
    assert a["token"] != b["token"] and a["transfer_id"].split("@")[0] != b["transfer_id"].split("@")[0]
    expired, bad_tokens = refused(mesh, Refusal.EXPIRED), refused(mesh, Refusal.BAD_TOKEN)

    again = mesh.call(replay(a, a["transfer_id"], a["token"]))  # the same part once its hand-off ended
    assert again.kind == Refusal.EXPIRED and "revoked" in again.reason
    borrowed = mesh.call(replay(a, b["transfer_id"].rpartition("#")[0] + "#7", a["token"]))  # under b's id
    assert borrowed.kind == Refusal.BAD_TOKEN
    assert (refused(mesh, Refusal.EXPIRED), refused(mesh, Refusal.BAD_TOKEN)) == (expired + 1, bad_tokens + 1)
    assert holds_nothing(mesh)

    fallbacks = decode.metrics_fallbacks
    assert generate(mesh, prompt(4), "always") == generate(mesh, prompt(4), "never", cache_salt="fresh-4")
    assert decode.metrics_fallbacks == fallbacks  # the next push was used: refusals cost nobody else
