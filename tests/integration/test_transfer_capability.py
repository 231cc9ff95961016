"""A transfer server takes only the pushes its own side asked for (``kvmesh.transfer.grants``): a push without a
capability, with a forged or another request's token, a replay after the hand-off ended, a late one or one
holding blocks it was not granted is refused before its payload is read, counted by reason, logged with the
peer's address, and never disturbs the genuine push. Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import secrets

import pytest
from kvmesh.engine.kv_cache import block_bytes
from kvmesh.instance.metrics import WorkerMetrics
from kvmesh.transfer import Refusal, TransferClient, TransferRejected, TransferServer

from tests.integration.test_transfer import (
    LAYOUT,
    LOCAL_BACKENDS,
    make_blocks,
    run,
    same_bits,
    tensor,
    wire_bytes,
)


def others(server: TransferServer, *kinds: Refusal) -> int:
    """Refusals counted under any reason but ``kinds``."""
    return sum(n for kind, n in server.refused.items() if kind not in kinds)


async def refused(client: TransferClient, server: TransferServer, tid: str, token: str, *, n: int = 3,
                  first_block: int = 0) -> TransferRejected:
    with pytest.raises(TransferRejected) as e:
        await client.push(server.address, tid, LAYOUT, wire_bytes(LAYOUT, n=n), [], n * LAYOUT.block_size,
                          first_block=first_block, token=token)
    return e.value


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_push_nobody_asked_for_is_refused_counted_and_logged_with_the_peer(backend: str, caplog) -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, backend=backend) as server, TransferClient() as client:
            with caplog.at_level(logging.WARNING, "kvmesh.transfer.server"):
                e = await refused(client, server, "r@p#0", secrets.token_urlsafe(24))
            assert e.kind == Refusal.UNSOLICITED and "no push was asked for" in e.reason
            assert server.refused[Refusal.UNSOLICITED] == 1 and others(server, Refusal.UNSOLICITED) == 0
            with pytest.raises(asyncio.TimeoutError):  # not even a rejection is left under its id
                await server.take("r@p#0", timeout=0.05)
            assert server.buffered_bytes == 0
            assert "transfer r@p#0 from 127.0.0.1:" in caplog.text  # the sender's address and port
            assert "refused (unsolicited)" in caplog.text

    run(scenario())


def test_a_forged_token_is_refused_and_the_genuine_push_still_lands() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            grant = server.grant("r@", 0, 3, timeout_s=30.0)
            e = await refused(client, server, "r@evil#0", secrets.token_urlsafe(24))
            assert e.kind == Refusal.BAD_TOKEN and "a token the receiver did not issue" in e.reason
            assert (await refused(client, server, "r@p#0", "")).reason.endswith("carries no token")
            blocks = make_blocks(LAYOUT)  # the forgeries settled nothing under the genuine part's id
            await client.push(server.address, "r@p#0", LAYOUT, block_bytes(blocks), [], 12, token=grant.token)
            assert same_bits(tensor(await server.take("r@p#0", timeout=5)), blocks)
            assert server.refused[Refusal.BAD_TOKEN] == 2 and others(server, Refusal.BAD_TOKEN) == 0

    run(scenario())


def test_the_token_of_another_request_is_refused() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            mine = server.grant("r1@", 0, 3, timeout_s=30.0)
            server.grant("r2@", 0, 3, timeout_s=30.0)
            assert (await refused(client, server, "r2@p#0", mine.token)).kind == Refusal.BAD_TOKEN
            assert server.refused[Refusal.BAD_TOKEN] == 1

    run(scenario())


def test_a_token_replayed_after_its_handoff_ended_is_refused() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            grant = server.grant("r@", 0, 3, timeout_s=30.0)
            await client.push(server.address, "r@p#0", LAYOUT, wire_bytes(LAYOUT), [], 12, token=grant.token)
            await server.take("r@p#0", timeout=5)
            server.revoke("r@", grant)  # decode took the push: nothing more is pushed under it
            for tid in ("r@p#0", "r@p#1"):  # the same part again, and one more
                e = await refused(client, server, tid, grant.token)
                assert e.kind == Refusal.EXPIRED and "revoked" in e.reason
            assert server.refused[Refusal.EXPIRED] == 2 and server.buffered_bytes == 0

    run(scenario())


def test_a_push_after_the_deadline_is_refused_and_fails_its_transfer() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            grant = server.grant("r@", 0, 3, timeout_s=0.2)
            await asyncio.sleep(0.3)
            e = await refused(client, server, "r@p#0", grant.token)
            assert e.kind == Refusal.EXPIRED and "after its capability expired" in e.reason
            with pytest.raises(TransferRejected, match="expired"):  # its sender held the token: the outcome
                await server.take("r@p#0", timeout=1)
            assert server.refused[Refusal.EXPIRED] == 1

    run(scenario())


def test_blocks_outside_the_grant_are_refused() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            grant = server.grant("r@", 2, 5, timeout_s=30.0)  # blocks 2, 3, 4
            assert (await refused(client, server, "r@p#0", grant.token, first_block=1)).kind == Refusal.BLOCKS
            e = await refused(client, server, "r@p#1", grant.token, first_block=3)
            assert "holds blocks 3..5, outside the blocks 2..4 granted" in e.reason
            await client.push(server.address, "r@p#2", LAYOUT, wire_bytes(LAYOUT), [], 12, first_block=2,
                              token=grant.token)
            assert (await server.take("r@p#2", timeout=5)).first_block == 2
            assert server.refused[Refusal.BLOCKS] == 2

    run(scenario())


def test_a_grant_is_forgotten_after_its_deadline_and_linger() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, ttl=0.2) as server, TransferClient() as client:
            grant = server.grant("r@", 0, 3, timeout_s=0.1)
            assert len(server.grants) == 1
            await asyncio.sleep(0.5)
            assert (await refused(client, server, "r@p#0", grant.token)).kind == Refusal.UNSOLICITED
            assert len(server.grants) == 0

    run(scenario())


def test_refusals_are_exported_by_reason_from_the_start() -> None:
    async def scenario() -> float | None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            metrics = WorkerMetrics()
            metrics.watch_transfers(server)
            value = lambda reason: metrics.registry.get_sample_value(
                "kvmesh_worker_kv_transfer_refused_total", {"reason": reason})
            assert all(value(kind) == 0 for kind in Refusal)
            server.grant("r@", 0, 3, timeout_s=30.0)
            await refused(client, server, "r@p#0", "forged")
            return value("bad_token")

    assert run(scenario()) == 1
