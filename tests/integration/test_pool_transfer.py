"""The pool's data path: block bytes move between engines and a real cachesvc through the transfer engine
(tcp, shm), never inside the gRPC messages. Async bodies run under ``asyncio.run`` (no pytest-asyncio)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, Self

import grpc
import pytest
import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.kv_cache import block_bytes, blocks_from_bytes, storage_dtype
from kvmesh.instance.pool_client import PoolClient, PoolError
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc
from kvmesh.settings import CacheServiceSettings, SharedSettings
from kvmesh.transfer import Refusal, TransferClient, TransferRejected, TransferServer
from kvmesh.transfer.backends import Backend, Staged
from kvmesh.transfer.header import CODEC, HeaderCodec, block_checksums

from services.cachesvc.server import CacheServer
from services.cachesvc.store import StoredBlock
from tests.ports import refusing_port

LAYOUT = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
KEYS = [0x1000 + i for i in range(6)]
BACKENDS = ("tcp", "shm")


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def make_blocks(n: int, layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((n, *layout.block_shape), generator=g) * 10).to(storage_dtype(layout.dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class CorruptingClient(TransferClient):
    """Flips one byte after the checksums were taken: what a bad wire or a bad buffer would do."""

    def _stage(self, backend: Backend, payload: memoryview, local_host: str) -> Staged:
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0xFF
        return super()._stage(backend, memoryview(bad), local_host)


class Recorder(grpc.aio.UnaryUnaryClientInterceptor):
    """Every (rpc, request, response) a channel carried."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []

    async def intercept_unary_unary(self, continuation, details, request):
        call = await continuation(details, request)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.calls.append((method.rsplit("/", 1)[-1], request, await call))
        return call

    def of(self, rpc: str) -> list[tuple[Any, Any]]:
        return [(req, resp) for name, req, resp in self.calls if name == rpc]


def recorded(pool: PoolClient, address: str) -> Recorder:
    """Route ``pool``'s RPCs through a recording channel."""
    recorder = Recorder()
    channel = grpc.aio.insecure_channel(address, interceptors=[recorder])
    pool.channels = [channel]
    pool.shards = [pool.shards[0]._replace(stub=cache_pb2_grpc.CacheServiceStub(channel))]
    return recorder


class Mesh:
    """A real cachesvc (in this event loop) and engine-side ends: a receiver per instance, a raw stub."""

    def __init__(self, nats_url: str, backend: str = "tcp", **settings: Any) -> None:
        cluster = f"t{uuid.uuid4().hex[:10]}"
        self.backend = backend
        self.server = CacheServer(CacheServiceSettings(
            port=0, durable_name=f"cachesvc-{cluster}", instance_timeout_s=60.0, transfer_backend=backend,
            **settings), SharedSettings(nats_url=nats_url, cluster=cluster))
        self.closers: list[Any] = []

    async def __aenter__(self) -> Self:
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = cache_pb2_grpc.CacheServiceStub(self.channel)
        return self

    async def instance(self, layout: KVLayout = LAYOUT, codec: HeaderCodec = CODEC) -> PoolClient:
        """An engine instance's pool client with its own transfer endpoint (both speaking ``codec``'s header
        versions)."""
        receiver = await TransferServer.start(layout, backend=self.backend, codec=codec)
        pool = PoolClient(self.server.address, layout, receiver, timeout_s=10.0)
        assert pool.transfer is not None
        pool.transfer.codec = codec
        self.closers += [pool.close, receiver.close]
        return pool

    async def stats(self) -> cache_pb2.StatsResponse:
        return await self.stub.Stats(cache_pb2.StatsRequest())

    async def __aexit__(self, *exc: object) -> None:
        for close in reversed(self.closers):
            await close()
        await self.channel.close()
        await self.server.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_back_and_fetch_move_the_bytes_through_the_transfer_engine(nats_server, backend):
    async def body() -> None:
        async with Mesh(nats_server.url, backend) as mesh:
            writer, reader = await mesh.instance(), await mesh.instance()
            writes, reads = recorded(writer, mesh.server.address), recorded(reader, mesh.server.address)
            blocks = make_blocks(len(KEYS))
            assert await writer.write_back(KEYS, block_bytes(blocks)) == len(KEYS)
            fetched = await reader.fetch(KEYS[:4] + [0xDEAD])
            assert fetched is not None and same_bits(blocks_from_bytes(LAYOUT, fetched.data), blocks[:4])
            assert (await mesh.stats()).transfer_address.startswith(f"{backend}://")
            (_, granted), = writes.of("GrantPut")  # the push's capability, cachesvc's own
            (put, put_reply), = writes.of("PutBlocks")
            assert put.transfer_id == granted.transfer_id and len(put.data) == 0 and put_reply.stored == len(KEYS)
            (get, get_reply), = reads.of("GetBlocks")
            assert get.transfer_address == reader.receiver.address and get.transfer_id and get.transfer_token
            assert list(get_reply.block_keys) == KEYS[:4] and len(get_reply.data) == 0
            assert reader.receiver.buffered_bytes == 0 and mesh.server.transfer.buffered_bytes == 0
            assert len(reader.receiver.grants) == len(mesh.server.transfer.grants) == 0  # each used up
            assert sum(reader.receiver.refused.values()) == sum(mesh.server.transfer.refused.values()) == 0

    run(body())


def test_a_corrupted_write_back_is_refused_and_nothing_is_stored(nats_server):
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh:
            writer = await mesh.instance()
            writer.transfer = CorruptingClient()
            with pytest.raises(PoolError, match="cachesvc refused the pushed blocks: checksum mismatch in 1 of 3"):
                await writer.write_back(KEYS[:3], block_bytes(make_blocks(3)))
            assert (await mesh.stats()).pool_blocks == 0
            writer.transfer = TransferClient()
            assert await writer.write_back(KEYS[:3], block_bytes(make_blocks(3))) == 3  # nothing was marked written

    run(body())


def test_a_corrupted_fetch_push_is_refused_the_fetch_fails_and_the_lease_ends(nats_server):
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh:
            writer, reader = await mesh.instance(), await mesh.instance()
            await writer.write_back(KEYS, block_bytes(make_blocks(len(KEYS))))
            mesh.server.transfer_client = CorruptingClient()
            with pytest.raises(PoolError, match="FAILED_PRECONDITION: .* refused the push of 6 blocks: "
                                                "checksum mismatch"):
                await reader.fetch(KEYS)
            stats = await mesh.stats()
            assert (stats.leases, stats.leased_blocks) == (0, 0)
            assert reader.receiver.buffered_bytes == 0

    run(body())


def test_a_block_damaged_in_the_pool_is_caught_by_the_reader_against_its_stored_checksum(nats_server):
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh:
            writer, reader = await mesh.instance(), await mesh.instance()
            await writer.write_back(KEYS, block_bytes(make_blocks(len(KEYS))))
            dram = mesh.server.pool.tier("dram")
            entry = dram._blocks[KEYS[1]][LAYOUT]
            damaged = bytearray(entry.block.data)
            damaged[7] ^= 0x01
            entry.block = StoredBlock(entry.block.key, entry.block.checksum, bytes(damaged))
            # cachesvc pushes the checksums stored with the blocks: the reader's check covers the storage too
            with pytest.raises(PoolError, match="checksum mismatch in 1 of 6 blocks"):
                await reader.fetch(KEYS)

    run(body())


def test_a_fetch_to_an_unreachable_endpoint_is_unavailable_and_releases_its_lease(nats_server):
    async def body() -> None:
        async with Mesh(nats_server.url, transfer_timeout_s=2.0) as mesh:
            await (await mesh.instance()).write_back(KEYS[:2], block_bytes(make_blocks(2)))
            request = cache_pb2.GetBlocksRequest(layout=LAYOUT.to_proto(), block_keys=KEYS[:2],
                                                 transfer_address=f"tcp://127.0.0.1:{port}",
                                                 transfer_id="t-1", transfer_token="t")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.stub.GetBlocks(request)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "the push of 2 blocks to tcp://127.0.0.1:" in err.value.details()
            assert (await mesh.stats()).leases == 0

    with refusing_port() as port:
        run(body())


def test_a_caller_lease_outlives_the_push(nats_server):
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh:
            pool = await mesh.instance()
            await pool.write_back(KEYS[:2], block_bytes(make_blocks(2)))
            grant = pool.receiver.grant("t-2", 0, 2, timeout_s=10.0)
            request = cache_pb2.GetBlocksRequest(layout=LAYOUT.to_proto(), block_keys=KEYS[:2], lease_s=30,
                                                 transfer_address=pool.receiver.address, transfer_id="t-2",
                                                 transfer_token=grant.token)
            reply = await mesh.stub.GetBlocks(request)
            assert reply.lease_id and reply.leased_blocks == 2 and not reply.data
            assert (await pool.receiver.take("t-2", 1)).block_keys == tuple(KEYS[:2])
            assert (await mesh.stats()).leases == 1

    run(body())


def test_a_put_whose_transfer_never_came_is_unavailable(nats_server):
    async def body() -> None:
        async with Mesh(nats_server.url, transfer_timeout_s=0.3) as mesh:
            blocks = make_blocks(2)
            request = cache_pb2.PutBlocksRequest(layout=LAYOUT.to_proto(), block_keys=KEYS[:2],
                                                 checksums=block_checksums(block_bytes(blocks), LAYOUT.block_nbytes),
                                                 transfer_id="never-pushed")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.stub.PutBlocks(request)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "transfer never-pushed did not arrive within 0.3s" in err.value.details()

    run(body())


def test_cachesvc_takes_pushes_of_any_layout_and_refuses_a_put_naming_another(nats_server):
    other = replace(LAYOUT, model_fingerprint="other-model", dtype="fp16")

    async def body() -> None:
        async with Mesh(nats_server.url) as mesh, TransferClient() as client:
            blocks = make_blocks(2, other)
            sums = block_checksums(block_bytes(blocks), other.block_nbytes)
            for named in (other, LAYOUT):
                grant = await mesh.stub.GrantPut(cache_pb2.GrantPutRequest(num_blocks=2))
                await client.push(grant.transfer_address, grant.transfer_id, other, block_bytes(blocks), KEYS[:2],
                                  2 * other.block_size, token=grant.token)
                request = cache_pb2.PutBlocksRequest(layout=named.to_proto(), block_keys=KEYS[:2],
                                                     checksums=sums, transfer_id=grant.transfer_id)
                if named == other:
                    assert (await mesh.stub.PutBlocks(request)).stored == 2
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await mesh.stub.PutBlocks(request)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert (f"transfer {grant.transfer_id} carried another layout than PutBlocks names"
                        in err.value.details())
                assert "dtype 'fp16'!='fp32'" in err.value.details()

    run(body())


def test_a_layer_group_part_pushed_to_the_pool_is_refused_and_nothing_is_stored(nats_server):
    """A hand-off's part holds a slice of its blocks' layers: the pool stores whole blocks only."""
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh, TransferClient() as client:
            grant = await mesh.stub.GrantPut(cache_pb2.GrantPutRequest(num_blocks=2))
            part = make_blocks(2)[:, :1].contiguous()  # layer 0 of each block
            sums = block_checksums(block_bytes(part), LAYOUT.layers_nbytes((0, 1)))
            await client.push(grant.transfer_address, grant.transfer_id, LAYOUT, block_bytes(part), KEYS[:2],
                              2 * LAYOUT.block_size, layers=(0, 1), token=grant.token)
            request = cache_pb2.PutBlocksRequest(layout=LAYOUT.to_proto(), block_keys=KEYS[:2], checksums=sums,
                                                 transfer_id=grant.transfer_id)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.stub.PutBlocks(request)
            assert "holds layers [0, 1] of its blocks, not whole blocks" in err.value.details()
            assert (await mesh.stats()).pool_blocks == 0

    run(body())


@pytest.mark.parametrize(("request_", "message"), [
    (cache_pb2.GetBlocksRequest(block_keys=KEYS, transfer_address="tcp://127.0.0.1:1"),
     "transfer_address and transfer_id go together"),
    (cache_pb2.GetBlocksRequest(block_keys=KEYS, transfer_address="127.0.0.1:1", transfer_id="t",
                                transfer_token="x"),
     "is not '<backend>://<host>:<port>'"),
    (cache_pb2.GetBlocksRequest(block_keys=KEYS, transfer_address="tcp://127.0.0.1:1", transfer_id="t"),
     "transfer_token is required with transfer_address"),
    (cache_pb2.GetBlocksRequest(block_keys=KEYS, transfer_address="tcp://127.0.0.1:1", transfer_id="t",
                                transfer_token="x", transfer_versions="two"),
     "transfer header versions 'two' are not '<low>-<high>'"),
    (cache_pb2.PutBlocksRequest(block_keys=KEYS[:1], checksums=[1], data=b"x", transfer_id="t"),
     "set either data (inline blocks) or transfer_id (pushed blocks), not both"),
])
def test_bad_transfer_requests_say_what_to_fix(nats_server, request_, message):
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh:
            request_.layout.CopyFrom(LAYOUT.to_proto())
            rpc = mesh.stub.GetBlocks if isinstance(request_, cache_pb2.GetBlocksRequest) else mesh.stub.PutBlocks
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rpc(request_)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()

    run(body())


def test_the_inline_path_still_works_for_a_client_without_a_receiver(nats_server):
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh:
            pool = PoolClient(mesh.server.address, LAYOUT)
            mesh.closers.append(pool.close)
            calls = recorded(pool, mesh.server.address)
            blocks = make_blocks(3)
            await pool.write_back(KEYS[:3], block_bytes(blocks))
            fetched = await pool.fetch(KEYS[:3])
            assert fetched is not None and same_bits(blocks_from_bytes(LAYOUT, fetched.data), blocks)
            assert len(calls.of("PutBlocks")[0][0].data) == len(calls.of("GetBlocks")[0][1].data) == blocks.numel() * 4

    run(body())


def test_the_pool_endpoint_takes_only_the_pushes_it_granted(nats_server):
    """A push to cachesvc's transfer endpoint needs a GrantPut's token: without one, with a forged one, or once
    PutBlocks used it up, it is refused, counted, and nothing is stored."""
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh, TransferClient() as client:
            blocks = block_bytes(make_blocks(2))
            address = (await mesh.stats()).transfer_address
            with pytest.raises(TransferRejected, match="no push was asked for"):
                await client.push(address, "pool-put-mine", LAYOUT, blocks, KEYS[:2], 8, token="guess")
            grant = await mesh.stub.GrantPut(cache_pb2.GrantPutRequest(num_blocks=2))
            assert grant.transfer_address == address and grant.expires_in_s > 0
            with pytest.raises(TransferRejected) as forged:
                await client.push(address, grant.transfer_id, LAYOUT, blocks, KEYS[:2], 8, token="guess")
            assert forged.value.kind == Refusal.BAD_TOKEN
            await client.push(address, grant.transfer_id, LAYOUT, blocks, KEYS[:2], 8, token=grant.token)
            put = cache_pb2.PutBlocksRequest(layout=LAYOUT.to_proto(), block_keys=KEYS[:2],
                                             transfer_id=grant.transfer_id,
                                             checksums=block_checksums(blocks, LAYOUT.block_nbytes))
            assert (await mesh.stub.PutBlocks(put)).stored == 2
            with pytest.raises(TransferRejected) as replayed:  # its grant is used up
                await client.push(address, grant.transfer_id, LAYOUT, blocks, KEYS[:2], 8, token=grant.token)
            assert replayed.value.kind == Refusal.EXPIRED
            sample = mesh.server.metrics.registry.get_sample_value
            assert [sample("kvmesh_cachesvc_transfer_refused_total", {"reason": r})
                    for r in ("unsolicited", "bad_token", "expired", "checksum")] == [1, 1, 1, 0]
            assert (await mesh.stats()).pool_blocks == 2

    run(body())


def test_an_instance_endpoint_refuses_a_pool_push_it_did_not_ask_for(nats_server):
    """GetBlocks naming an instance's endpoint with a token it never issued: cachesvc's push is refused there,
    the call fails saying so, and the lease the push held ends."""
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh:
            pool = await mesh.instance()
            await pool.write_back(KEYS[:2], block_bytes(make_blocks(2)))
            request = cache_pb2.GetBlocksRequest(layout=LAYOUT.to_proto(), block_keys=KEYS[:2],
                                                 transfer_address=pool.receiver.address, transfer_id="t-x",
                                                 transfer_token="forged")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.stub.GetBlocks(request)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "refused the push of 2 blocks: transfer t-x: no push was asked for" in err.value.details()
            assert pool.receiver.refused[Refusal.UNSOLICITED] == 1 and pool.receiver.buffered_bytes == 0
            assert (await mesh.stats()).leases == 0

    run(body())


def test_a_grant_for_no_block_says_what_to_fix(nats_server):
    async def body() -> None:
        async with Mesh(nats_server.url) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.stub.GrantPut(cache_pb2.GrantPutRequest())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "num_blocks must be > 0" in err.value.details()

    run(body())


def test_a_session_write_back_in_several_puts_names_the_session_in_each(nats_server, monkeypatch):
    """A write-back larger than one call is several PutBlocks: each names the session and its context (the pool
    makes room before each put, and blocks an earlier put stored under no session would be nobody's, so the next
    put's first victims); only the last ends it."""
    from kvmesh.contracts.engine import SessionHint
    from kvmesh.instance import pool_client

    monkeypatch.setattr(pool_client, "MAX_MESSAGE_BYTES", 4 * LAYOUT.block_nbytes)  # 2 blocks a call

    async def body() -> None:
        async with Mesh(nats_server.url, pool_eviction="session") as mesh:
            writer = await mesh.instance()
            writes = recorded(writer, mesh.server.address)
            session = SessionHint("t/agent", end=True)
            assert await writer.write_back(KEYS, block_bytes(make_blocks(len(KEYS))), session=session) == 6
            puts = [req for req, _ in writes.of("PutBlocks")]
            assert [len(p.block_keys) for p in puts] == [2, 2, 2]
            assert all(p.session_key == "t/agent" and list(p.session_blocks) == KEYS for p in puts)
            assert [p.session_end for p in puts] == [False, False, True]

    run(body())


def test_a_block_written_back_long_ago_is_sent_again_and_one_the_router_saw_held_is_not(nats_server, monkeypatch):
    """The pool evicts: a block this instance wrote back a while ago may be gone, so it is sent again (the pool
    skips what it still holds); within WRITTEN_TRUST_S it is not (requests sharing a prefix write it once); nor
    are the leading blocks the router saw the pool hold when it routed the request."""
    from kvmesh.instance import pool_client

    async def body() -> None:
        async with Mesh(nats_server.url) as mesh:
            writer = await mesh.instance()
            data = block_bytes(make_blocks(len(KEYS)))
            assert await writer.write_back(KEYS, data) == 6
            assert await writer.write_back(KEYS, data) == 0  # just written: trusted
            monkeypatch.setattr(pool_client, "WRITTEN_TRUST_S", 0.0)
            assert await writer.write_back(KEYS, data) == 6  # written a while ago: sent again, the pool skips
            assert await writer.write_back(KEYS, data, held=4) == 2  # the router saw 4 held

    run(body())
