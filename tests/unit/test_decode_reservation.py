"""A Decode call's reservation (``kvmesh.transfer.receiver.Reservation``): its blocks are lent to the transfer
server as a landing, and releasing it
revokes the landing before the engine may free (and reuse) the blocks, whatever ended the call."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.block_manager import BlockManager
from kvmesh.engine.kv_cache import DeviceKVPool
from kvmesh.engines import Reserved
from kvmesh.transfer.landing import Landing
from kvmesh.transfer.receiver import Reservation

LAYOUT = KVLayout("t", 2, 1, 4, 4)


class FakeEngine:
    """The seam's reserve / release over a real block manager and pool; records what each release saw."""

    def __init__(self, server: FakeServer) -> None:
        self.kv = DeviceKVPool(LAYOUT, 8)
        self.blocks = BlockManager(self.kv)
        self.server, self.log = server, []

    async def reserve(self, lease: str, request: EngineRequest, first_block: int) -> Reserved | None:
        n = -(-len(request.prompt) // LAYOUT.block_size) - first_block
        ids = self.blocks.reserve(lease, n)
        if ids is None:
            return None
        return Reserved(lease, first_block, tuple(ids), Landing(*self.kv.landing_arrays(), ids, first_block))

    def release(self, lease: str) -> None:
        self.log.append(("release", [landing.open for landing in self.server.lent]))
        self.blocks.release_reserved(lease)


class FakeServer:
    def __init__(self) -> None:
        self.lent, self.landings = [], {}

    def land(self, prefix, landing) -> None:
        self.lent.append(landing)
        self.landings[prefix] = landing

    def unland(self, prefix, landing=None) -> None:
        if self.landings.get(prefix) is landing:
            del self.landings[prefix]
        landing.revoke()


def request(tokens: int) -> EngineRequest:
    return EngineRequest("req", tuple(range(tokens)), SamplingParams())


def host() -> SimpleNamespace:
    server = FakeServer()
    return SimpleNamespace(transfer_server=server, engine=FakeEngine(server),
                           layout=LAYOUT)


def test_a_reservation_lends_the_prompts_blocks_past_the_pinned_ones_and_release_revokes_before_freeing():
    h = host()
    # 14 tokens: blocks 0-3, block 0 pinned
    r = Reservation(h.transfer_server, h.engine, request(14), 1, LAYOUT.block_size)
    assert asyncio.run(r.acquire())
    blocks = h.engine.blocks
    assert len(r.block_ids) == 3 and blocks.counts()["reserved"] == 3
    assert h.transfer_server.landings["req@"].block_ids == r.block_ids
    r.release()
    assert h.engine.log == [("release", [False])]  # the landing was revoked when the free was submitted
    assert blocks.counts()["reserved"] == 0 and h.transfer_server.landings == {}
    r.release()  # idempotent
    assert len(h.engine.log) == 1


def test_a_reservation_handed_over_lands_nothing_more_and_its_release_frees_nothing_adopted():
    h = host()
    r = Reservation(h.transfer_server, h.engine, request(8), 0, LAYOUT.block_size)
    asyncio.run(r.acquire())
    r.hand_over()
    assert not h.transfer_server.lent[0].open
    h.engine.blocks.leases.take(r.lease)  # what the import's adoption does
    free = h.engine.blocks.num_free_blocks
    r.release()
    assert h.engine.blocks.num_free_blocks == free


def test_a_pool_without_room_reserves_nothing_and_lends_nothing():
    h = host()
    r = Reservation(h.transfer_server, h.engine, request(40), 0, LAYOUT.block_size)  # 10 blocks; the pool has 8
    assert not asyncio.run(r.acquire())
    r.release()
    assert h.transfer_server.lent == [] and h.engine.blocks.num_free_blocks == 8
