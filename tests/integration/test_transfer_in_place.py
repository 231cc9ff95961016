"""Receiving in place (``kvmesh.transfer.landing``): a part lands straight in the pool blocks reserved for it,
verified there; a corrupted one is refused; a landing revoked mid-payload is never written again; parts that do
not belong to it are refused or buffered. Real sockets on 127.0.0.1, a real ``DeviceKVPool`` as the memory."""

import asyncio
import socket

import numpy as np
import pytest
import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.kv_cache import DeviceKVPool, block_bytes
from kvmesh.transfer import TransferClient, TransferRejected, TransferServer
from kvmesh.transfer.conn import Conn
from kvmesh.transfer.header import TransferHeader, block_checksums, encode_header
from kvmesh.transfer.landing import Landing
from kvmesh.transfer.wire import IOV_MAX, MAGIC, PREFIX, parse_address, read_reply

from tests.integration.test_transfer import LOCAL_BACKENDS, CorruptingClient, eventually, make_blocks, run

LAYOUT = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
RESERVED = [5, 2, 7]  # blocks 1..3 of the request land here (not consecutive: a pool after some churn)


def landing(pool: DeviceKVPool, first_block: int = 1) -> Landing:
    k, v = pool.landing_arrays()
    return Landing(k, v, RESERVED, first_block)


def grant_request(server: TransferServer, prefix: str = "r@") -> str:
    """What decode does as it accepts request ``r``: grant its hand-off's parts (blocks 0..7, for a while)."""
    return server.grant(prefix, 0, 8, timeout_s=60.0).token


async def push_part(client: TransferClient, server: TransferServer, tid: str, blocks: torch.Tensor,
                    layers: tuple[int, int] | None, token: str, first_block: int = 1) -> None:
    lo, hi = layers or (0, LAYOUT.num_layers)
    await client.push(server.address, tid, LAYOUT, block_bytes(blocks[:, lo:hi].contiguous()), [],
                      blocks.shape[0] * LAYOUT.block_size, layers=layers, first_block=first_block, token=token)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_parts_in_layer_groups_land_in_the_reserved_pool_blocks_bit_exact(backend: str) -> None:
    pool, sent = DeviceKVPool(LAYOUT, 8), make_blocks(LAYOUT, 3)

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, backend=backend) as server, TransferClient() as client:
            token = grant_request(server)
            server.land("r@", land := landing(pool))
            for i, layers in enumerate([(0, 1), (1, 2)]):
                await push_part(client, server, f"r@p#{i}", sent, layers, token)
                assert server.buffered_bytes == 0  # nothing held by the server: it is in the pool
            got = [await server.take(f"r@p#{i}", timeout=5) for i in range(2)]
            assert all(g.landed and len(g.data) == 0 for g in got)
            assert [g.layers for g in got] == [(0, 1), (1, 2)] and got[0].first_block == 1
            assert land.landed_bytes == sent.numel() * sent.element_size()

    run(scenario())
    assert pool.read_blocks(RESERVED).equal(sent)
    others = [b for b in range(8) if b not in RESERVED]
    assert not pool.read_blocks(others).any()  # nothing landed anywhere else


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_corrupted_part_is_refused_where_it_landed_and_its_cells_are_never_landed_again(backend: str) -> None:
    pool, sent = DeviceKVPool(LAYOUT, 8), make_blocks(LAYOUT, 3)

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, backend=backend) as server:
            token = grant_request(server)
            server.land("r@", land := landing(pool))
            async with CorruptingClient() as bad:
                with pytest.raises(TransferRejected, match="checksum mismatch in 1 of 3 blocks"):
                    await push_part(bad, server, "r@p#0", sent, None, token)
            with pytest.raises(TransferRejected, match="checksum mismatch"):
                await server.take("r@p#0", timeout=1)
            assert land.claimed.all()
            async with TransferClient() as good:  # the same blocks again: refused, not written over garbage
                with pytest.raises(TransferRejected, match="claimed by another part"):
                    await push_part(good, server, "r@p#1", sent, None, token)

    run(scenario())


def test_parts_outside_the_reservation_or_of_a_second_handoff_do_not_land() -> None:
    pool, sent = DeviceKVPool(LAYOUT, 8), make_blocks(LAYOUT, 3)

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            token = grant_request(server)
            server.land("r@", landing(pool))
            with pytest.raises(TransferRejected, match="outside the ones reserved for it"):  # granted, not reserved
                await push_part(client, server, "r@p#0", sent, None, token, first_block=2)  # blocks 2..4; 1..3 are
            # another prefill's hand-off of the same request (a retry) is received into a buffer as before
            await push_part(client, server, "r@q#0", sent, None, token)
            got = await server.take("r@q#0", timeout=5)
            assert not got.landed and bytes(got.data) == bytes(block_bytes(sent))

    run(scenario())
    assert not pool.k.any() and not pool.v.any()


def test_a_landing_revoked_mid_payload_is_never_written_again_and_the_connection_stays_usable() -> None:
    """The sender has sent half a part, the server is blocked reading the rest into the pool; the landing is
    revoked (decode gave up on the request). The rest of the bytes arrive: not one reaches the pool, the
    part is refused, and the same connection carries the next transfer."""
    layout = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=64, block_size=64)
    pool = DeviceKVPool(layout, 4)
    blocks = make_blocks(layout, 2)
    payload = block_bytes(blocks)

    async def scenario() -> None:
        async with await TransferServer.start(layout) as server:
            header = encode_header(TransferHeader("r@p#0", "tcp", layout, (), 2 * layout.block_size,
                                                  block_checksums(payload, layout.block_nbytes), first_block=0,
                                                  token=grant_request(server)))
            k, v = pool.landing_arrays()
            server.land("r@", Landing(k, v, [3, 1], 0))
            addr = parse_address(server.address)
            loop = asyncio.get_running_loop()
            sock = socket.create_connection((addr.host, addr.port))
            sock.setblocking(False)
            half = len(payload) // 2
            await loop.sock_sendall(sock, PREFIX.pack(MAGIC, len(header)) + header + payload[:half])
            await eventually(lambda: int(np.count_nonzero(k[:, 3])) > 0)  # bytes are landing
            await asyncio.sleep(0.05)  # and the server waits for the rest
            server.unland("r@")
            before = (pool.k.clone(), pool.v.clone())
            await loop.sock_sendall(sock, payload[half:])
            reply = await asyncio.wait_for(read_reply(Conn(sock)), 5)
            assert not reply.ok and "released while it was received" in reply.reason
            assert pool.k.equal(before[0]) and pool.v.equal(before[1])  # not a byte after the revoke
            assert not pool.read_blocks([1]).equal(blocks[1:2])  # the part never completed in the pool
            other = encode_header(TransferHeader("next", "tcp", layout, (), 2 * layout.block_size,
                                                 block_checksums(payload, layout.block_nbytes),
                                                 token=grant_request(server, "next")))
            await loop.sock_sendall(sock, PREFIX.pack(MAGIC, len(other)) + other + bytes(payload))
            assert (await asyncio.wait_for(read_reply(Conn(sock)), 5)).ok  # buffered (no landing), stream in sync
            assert bytes((await server.take("next", timeout=5)).data) == bytes(payload)
            sock.close()

    run(scenario())


def test_recv_scatter_fills_more_views_than_one_syscall_takes_in_order() -> None:
    sizes = [7, 1, 13] * (IOV_MAX // 2)  # > IOV_MAX views of uneven sizes, so syscalls end mid-view
    data = bytes(np.random.default_rng(0).integers(0, 256, sum(sizes), dtype=np.uint8))
    views = [memoryview(bytearray(n)) for n in sizes]

    async def scenario() -> None:
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        loop = asyncio.get_running_loop()
        sending = asyncio.create_task(loop.sock_sendall(b, data))
        assert await Conn(a).recv_scatter(views, lambda: True)
        await sending
        a.close()
        b.close()

    run(scenario())
    assert b"".join(bytes(v) for v in views) == data


def test_recv_scatter_stops_writing_once_told_and_drains_the_rest() -> None:
    views = [memoryview(bytearray(4)) for _ in range(4)]
    calls = []

    def still_open() -> bool:
        calls.append(1)
        return len(calls) < 2  # open for the first syscall only

    async def scenario() -> None:
        a, b = socket.socketpair()
        a.setblocking(False)
        b.sendall(b"\x01" * 8)  # the first syscall gets these
        task = asyncio.create_task(Conn(a).recv_scatter(views, still_open))
        await asyncio.sleep(0.05)
        b.sendall(b"\x02" * 8 + b"tail")
        assert not await task
        a.setblocking(True)
        assert a.recv(4) == b"tail"  # exactly the payload was consumed
        a.close()
        b.close()

    run(scenario())
    assert [bytes(v) for v in views] == [b"\x01" * 4] * 2 + [b"\x00" * 4] * 2
