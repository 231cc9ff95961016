"""Push capabilities (``kvmesh.transfer.grants``) without sockets: which grant covers a transfer id, and what a
part under it is refused for. Async bodies run under ``asyncio.run`` (grants keep timers on the loop)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from kvmesh.contracts.layout import KVLayout
from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.grants import Grants
from kvmesh.transfer.header import TransferHeader, decode_header, encode_header

LAYOUT = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def part(tid: str, token: str, first_block: int = 0, blocks: int = 2) -> TransferHeader:
    return TransferHeader(tid, "tcp", LAYOUT, (), 4, (0,) * blocks, first_block=first_block, token=token)


def test_the_longest_prefix_covers_a_transfer_id() -> None:
    async def body() -> None:
        grants = Grants(linger_s=60.0)
        short = grants.issue("r@", 0, 4, 10.0)
        longer = grants.issue("r@p#1", 0, 4, 10.0)
        assert grants.check(part("r@p#1", longer.token)) is None
        assert grants.check(part("r@p#0", short.token)) is None
        assert grants.check(part("r@p#1", short.token)).kind == Refusal.BAD_TOKEN  # the longer grant rules
        assert grants.check(part("s@p#0", short.token)).kind == Refusal.UNSOLICITED
        grants.close()

    asyncio.run(body())


def test_a_revoke_names_the_grant_it_ends() -> None:
    async def body() -> None:
        grants = Grants(linger_s=60.0)
        first = grants.issue("r@", 0, 4, 10.0)
        second = grants.issue("r@", 0, 4, 10.0)  # the same request again: replaces the first
        grants.revoke("r@", first)  # the first call ending does not end the second's grant
        assert grants.check(part("r@p#0", second.token)) is None and len(grants) == 1
        grants.revoke("r@", second)
        assert grants.check(part("r@p#0", second.token)).kind == Refusal.EXPIRED and len(grants) == 0
        grants.close()

    asyncio.run(body())


def test_a_grant_is_forgotten_after_it_lingered() -> None:
    async def body() -> None:
        grants = Grants(linger_s=0.05)
        grant = grants.issue("r@", 0, 4, 0.05)
        await asyncio.sleep(0.07)
        assert grants.check(part("r@p#0", grant.token)).kind == Refusal.EXPIRED  # known, past its deadline
        await asyncio.sleep(0.1)
        assert grants.check(part("r@p#0", grant.token)).kind == Refusal.UNSOLICITED
        assert not grants._by_prefix and not grants._lengths

    asyncio.run(body())


def test_a_grant_covers_only_its_blocks() -> None:
    async def body() -> None:
        grants = Grants(linger_s=60.0)
        grant = grants.issue("r@", 2, 6, 10.0)  # blocks 2..5
        assert grants.check(part("r@p#0", grant.token, first_block=2, blocks=4)) is None
        for first, n in ((1, 2), (5, 2), (0, 8)):
            refused = grants.check(part("r@p#0", grant.token, first_block=first, blocks=n))
            assert refused.kind == Refusal.BLOCKS and "outside the blocks 2..5 granted" in refused.reason
        grants.close()

    asyncio.run(body())


@pytest.mark.parametrize(("args", "message"), [(("", 0, 1, 1.0), "prefix"), (("r@", 3, 3, 1.0), "at least one"),
                                               (("r@", 0, 1, 0.0), "timeout")])
def test_a_grant_of_nothing_is_a_value_error(args: tuple, message: str) -> None:
    async def body() -> None:
        with pytest.raises(ValueError, match=message):
            Grants(linger_s=1.0).issue(*args)

    asyncio.run(body())


def test_a_transfer_id_longer_than_any_handoff_is_malformed() -> None:
    raw = encode_header(replace(part("r@p#0", "t"), transfer_id="x" * 1025))
    with pytest.raises(TransferRejected, match="transfer_id of 1025 characters") as e:
        decode_header(raw)
    assert e.value.kind == Refusal.MALFORMED
