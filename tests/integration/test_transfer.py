"""The transfer engine over real sockets on 127.0.0.1. Async bodies run under ``asyncio.run``."""

import asyncio
import os
import socket
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import pytest
import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.kv_cache import block_bytes, blocks_from_bytes, storage_dtype
from kvmesh.transfer import ReceivedBlocks, TransferClient, TransferRejected, TransferServer, TransferStats
from kvmesh.transfer.backends import Backend, Staged
from kvmesh.transfer.header import TransferHeader, block_checksums, encode_header
from kvmesh.transfer.wire import MAGIC, PREFIX, Reply, decode_reply, parse_address

from tests.ports import refusing_port

LAYOUT = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
LOCAL_BACKENDS = ("tcp", "shm")


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def eventually(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll until ``condition()`` holds (the server acts on its own schedule); fail after ``within_s``."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def make_blocks(layout: KVLayout, n: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn((n, *layout.block_shape), generator=g) * 10
    return values.to(storage_dtype(layout.dtype))


def wire_bytes(layout: KVLayout, n: int = 3, seed: int = 0) -> memoryview:
    """What the engine hands the transfer client: the blocks' bytes, a view of the tensor."""
    return block_bytes(make_blocks(layout, n, seed))


def tensor(got: ReceivedBlocks) -> torch.Tensor:
    """What the engine makes of received bytes: ``[n, *block_shape]`` in the storage dtype."""
    return blocks_from_bytes(got.layout, got.data)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


async def push(client: TransferClient, server: TransferServer, transfer_id: str, layout: KVLayout,
               payload: memoryview, block_keys: list[int], num_tokens: int, **kw: Any) -> TransferStats:
    """A push its receiver asked for: ``server``'s owner grants ``transfer_id`` (any blocks, for a while) and hands
    ``client`` the token, which it pushes with."""
    token = server.grant(transfer_id, 0, 1 << 20, timeout_s=60.0).token
    return await client.push(server.address, transfer_id, layout, payload, block_keys, num_tokens, token=token, **kw)


def shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("kvmesh_")}


async def round_trip(backend: str, layout: KVLayout) -> tuple[torch.Tensor, ReceivedBlocks]:
    blocks = make_blocks(layout)
    async with await TransferServer.start(layout, backend=backend) as server, TransferClient() as client:
        await push(client, server, "req-1", layout, block_bytes(blocks), [11, 22, 33], 3 * layout.block_size)
        return blocks, await server.take("req-1", timeout=5)


class CorruptingClient(TransferClient):
    """Flips one byte after the checksums were taken: what a bad wire or a bad buffer would do."""

    def _stage(self, backend: Backend, payload: memoryview, local_host: str) -> Staged:
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0xFF
        return super()._stage(backend, memoryview(bad), local_host)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_fp32_blocks_round_trip_bit_exact(backend: str) -> None:
    sent, got = run(round_trip(backend, LAYOUT))
    assert same_bits(tensor(got), sent)
    assert (got.transfer_id, got.layout, got.num_tokens) == ("req-1", LAYOUT, 12)
    assert got.block_keys == (11, 22, 33)
    assert got.nbytes == sent.numel() * 4


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_fp8_blocks_round_trip_bit_exact(backend: str) -> None:
    layout = replace(LAYOUT, dtype="fp8")
    sent, got = run(round_trip(backend, layout))
    assert tensor(got).dtype == torch.float8_e4m3fn
    assert same_bits(tensor(got), sent)


def test_received_blocks_load_into_a_device_pool() -> None:
    from kvmesh.engine.kv_cache import DeviceKVPool

    sent, got = run(round_trip("tcp", LAYOUT))
    pool = DeviceKVPool(LAYOUT, num_blocks=8)
    pool.write_blocks([5, 1, 6], tensor(got))
    assert same_bits(pool.read_blocks([5, 1, 6]), sent)


@pytest.mark.parametrize("other", [
    replace(LAYOUT, dtype="fp16", head_dim=16),          # same bytes per block, other dtype
    replace(LAYOUT, block_size=8, num_kv_heads=1),       # same bytes per block, other block size
    replace(LAYOUT, model_fingerprint="other-model"),
], ids=["dtype", "block_size", "model"])
def test_layout_mismatch_is_rejected_and_never_taken(other: KVLayout) -> None:
    assert other.block_nbytes == LAYOUT.block_nbytes

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            with pytest.raises(TransferRejected, match="layout mismatch"):
                await push(client, server, "req-1", other, wire_bytes(other), [], 4)
            with pytest.raises(TransferRejected, match="layout mismatch"):
                await server.take("req-1", timeout=1)
            assert server.buffered_bytes == 0

    run(scenario())


def test_a_layout_named_convertible_is_received_for_its_taker_to_convert_and_others_still_refused() -> None:
    """A receiver whose engine casts bf16 pushes (``convertible``) takes them, in their own layout, verified;
    a layout it names no converter for is refused as before."""
    bf16 = replace(LAYOUT, dtype="bf16")

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, convertible=frozenset({bf16})) as server, \
                TransferClient() as client:
            await push(client, server, "req-1", bf16, wire_bytes(bf16), [], 12)
            got = await server.take("req-1", timeout=5)
            assert got.layout == bf16 and got.nbytes == 3 * bf16.block_nbytes
            fp16 = replace(LAYOUT, dtype="fp16")
            with pytest.raises(TransferRejected, match="layout mismatch"):
                await push(client, server, "req-2", fp16, wire_bytes(fp16), [], 12)

    run(scenario())


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_corrupted_bytes_are_rejected_and_never_taken(backend: str) -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, backend=backend) as server, \
                CorruptingClient() as client:
            with pytest.raises(TransferRejected, match="checksum mismatch in 1 of 3 blocks"):
                await push(client, server, "req-1", LAYOUT, wire_bytes(LAYOUT), [1, 2, 3], 12)
            with pytest.raises(TransferRejected, match="checksum mismatch"):
                await server.take("req-1", timeout=1)
            assert server.buffered_bytes == 0

    run(scenario())


def test_take_times_out_when_nothing_arrives() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server:
            with pytest.raises(asyncio.TimeoutError):
                await server.take("never-sent", timeout=0.05)

    run(scenario())


def test_eight_concurrent_pushes_arrive_intact() -> None:
    async def scenario() -> None:
        sent = {f"req-{i}": make_blocks(LAYOUT, n=1 + i, seed=i) for i in range(8)}
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            await asyncio.gather(*(push(client, server, tid, LAYOUT, block_bytes(blocks), [],
                                               4 * len(blocks))
                                   for tid, blocks in sent.items()))
            received = await asyncio.gather(*(server.take(tid, timeout=5) for tid in sent))
        for got in received:
            assert same_bits(tensor(got), sent[got.transfer_id])

    run(scenario())


def test_sender_dying_mid_payload_leaves_server_serving_the_next_transfer() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            payload = wire_bytes(LAYOUT)
            token = server.grant("dies", 0, 3, timeout_s=60.0).token
            header = encode_header(TransferHeader("dies", "tcp", LAYOUT, (), 12,
                                                  block_checksums(payload, LAYOUT.block_nbytes), token=token))
            addr = parse_address(server.address)
            with socket.create_connection((addr.host, addr.port)) as dying:
                dying.sendall(PREFIX.pack(MAGIC, len(header)) + header + payload[:len(payload) // 2])
            blocks = make_blocks(LAYOUT, seed=1)
            await push(client, server, "next", LAYOUT, block_bytes(blocks), [], 12)
            assert same_bits(tensor(await server.take("next", timeout=5)), blocks)
            with pytest.raises(asyncio.TimeoutError):
                await server.take("dies", timeout=0.1)
            await eventually(lambda: server.buffered_bytes == 0)

    run(scenario())


def test_stalled_sender_is_dropped_after_the_io_timeout() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, io_timeout=0.5) as server, TransferClient() as client:
            payload = wire_bytes(LAYOUT)
            token = server.grant("stalls", 0, 3, timeout_s=60.0).token
            header = encode_header(TransferHeader("stalls", "tcp", LAYOUT, (), 12,
                                                  block_checksums(payload, LAYOUT.block_nbytes), token=token))
            addr = parse_address(server.address)
            with socket.create_connection((addr.host, addr.port)) as stalled:
                stalled.sendall(PREFIX.pack(MAGIC, len(header)) + header + payload[:100])
                await eventually(lambda: server.buffered_bytes == len(payload))  # admitted, then stalls
                await eventually(lambda: server.buffered_bytes == 0)  # dropped after io_timeout
                await push(client, server, "next", LAYOUT, wire_bytes(LAYOUT), [], 12)
                await server.take("next", timeout=1)

    run(scenario())


def test_malformed_header_gets_a_clear_rejection() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server:
            addr = parse_address(server.address)
            reader, writer = await asyncio.open_connection(addr.host, addr.port)
            garbage = b'{"v": 2, "transfer_id": 5}'
            writer.write(PREFIX.pack(MAGIC, len(garbage)) + garbage)
            length = int.from_bytes(await reader.readexactly(4), "little")
            reply = decode_reply(await reader.readexactly(length))
            writer.close()
            assert not reply.ok and "malformed header: field 'transfer_id' must be str" in reply.reason

    run(scenario())


def test_transfer_over_capacity_is_rejected_before_its_payload_is_read() -> None:
    async def scenario() -> None:
        cap = 2 * LAYOUT.block_nbytes
        async with await TransferServer.start(LAYOUT, max_buffered_bytes=cap) as server, \
                TransferClient() as client:
            await push(client, server, "fits", LAYOUT, wire_bytes(LAYOUT, n=2), [], 8)
            with pytest.raises(TransferRejected, match="over capacity"):
                await push(client, server, "too-much", LAYOUT, wire_bytes(LAYOUT, n=1), [], 4)
            await server.take("fits", timeout=1)
            await push(client, server, "fits-now", LAYOUT, wire_bytes(LAYOUT, n=1), [], 4)

    run(scenario())


def test_untaken_transfer_is_dropped_after_its_ttl() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, ttl=0.3) as server, TransferClient() as client:
            await push(client, server, "orphan", LAYOUT, wire_bytes(LAYOUT), [], 12)
            assert server.buffered_bytes == 3 * LAYOUT.block_nbytes
            await eventually(lambda: server.buffered_bytes == 0)
            with pytest.raises(asyncio.TimeoutError):
                await server.take("orphan", timeout=0.05)

    run(scenario())


def test_discarded_transfer_is_refused_when_it_arrives_late() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            server.discard("late")
            with pytest.raises(TransferRejected, match="discarded by the receiver"):
                await push(client, server, "late", LAYOUT, wire_bytes(LAYOUT), [], 12)
            assert server.buffered_bytes == 0

    run(scenario())


def test_discarding_a_prefix_frees_the_parts_held_and_refuses_those_still_coming() -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            for tid in ("r1@p0#0", "r1@p0#1", "r2@p0#0"):
                await push(client, server, tid, LAYOUT, wire_bytes(LAYOUT), [], 12)
            server.discard_prefix("r1@")
            assert server.buffered_bytes == 3 * LAYOUT.block_nbytes  # r2's part only
            with pytest.raises(TransferRejected, match="discarded by the receiver"):
                await push(client, server, "r1@p0#2", LAYOUT, wire_bytes(LAYOUT), [], 12)
            with pytest.raises(asyncio.TimeoutError):  # gone, not handed out
                await server.take("r1@p0#0", timeout=0.05)
            assert (await server.take("r2@p0#0", timeout=1)).num_blocks == 3

    run(scenario())


def test_duplicate_transfer_id_does_not_replace_the_first() -> None:
    async def scenario() -> None:
        first, second = make_blocks(LAYOUT, seed=1), make_blocks(LAYOUT, seed=2)
        async with await TransferServer.start(LAYOUT) as server, TransferClient() as client:
            await push(client, server, "req", LAYOUT, block_bytes(first), [], 12)
            with pytest.raises(TransferRejected, match="already received"):
                await push(client, server, "req", LAYOUT, block_bytes(second), [], 12)
            other = replace(LAYOUT, dtype="fp16", head_dim=16)
            with pytest.raises(TransferRejected, match="already received"):
                await push(client, server, "req", other, wire_bytes(other), [], 12)
            assert same_bits(tensor(await server.take("req", timeout=1)), first)

    run(scenario())


async def restart_on(port: int) -> TransferServer:
    """A server on the port a closed one bound. Free a moment ago, it can still be taken (by another process or
    a socket in the kernel's hands): retry the bind a few times for a short while."""
    for _ in range(20):
        try:
            return await TransferServer.start(LAYOUT, port=port)
        except OSError:
            await asyncio.sleep(0.1)
    return await TransferServer.start(LAYOUT, port=port)


def test_client_reconnects_after_the_server_restarts_on_the_same_port() -> None:
    async def scenario() -> None:
        async with TransferClient() as client:
            server = await TransferServer.start(LAYOUT)
            await push(client, server, "a", LAYOUT, wire_bytes(LAYOUT), [], 12)
            port = parse_address(server.address).port
            await server.close()
            async with await restart_on(port) as again:
                await push(client, again, "b", LAYOUT, wire_bytes(LAYOUT), [], 12)
                await again.take("b", timeout=1)

    run(scenario())


def test_unreachable_receiver_raises_connection_error() -> None:
    async def scenario(port: int) -> None:
        async with TransferClient() as client:
            with pytest.raises(ConnectionError):
                await client.push(f"tcp://127.0.0.1:{port}", "x", LAYOUT, wire_bytes(LAYOUT), [], 12, token="t")

    with refusing_port() as port:  # held for the whole test: no other process can start listening there
        run(scenario(port))


def test_shm_leaves_no_segment_behind() -> None:
    before = shm_segments()

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, backend="shm") as server:
            async with TransferClient() as client:
                for i in range(3):
                    await push(client, server, f"ok-{i}", LAYOUT, wire_bytes(LAYOUT), [], 12)
                other = replace(LAYOUT, dtype="fp16", head_dim=16)
                with pytest.raises(TransferRejected):
                    await push(client, server, "bad-layout", other, wire_bytes(other), [], 12)
                assert len(shm_segments() - before) == 1  # one staging segment, reused
            async with CorruptingClient() as client:
                with pytest.raises(TransferRejected):
                    await push(client, server, "corrupt", LAYOUT, wire_bytes(LAYOUT), [], 12)
            await server.take("ok-0", timeout=1)

    run(scenario())
    assert shm_segments() == before


def test_shm_push_that_breaks_midway_unlinks_its_segment() -> None:
    class BreakingClient(TransferClient):
        async def _exchange(self, *args: object) -> Reply:
            assert shm_segments() - before  # staged, then the connection breaks
            raise ConnectionResetError("simulated: connection reset mid-push")

    before = shm_segments()

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, backend="shm") as server, BreakingClient() as client:
            with pytest.raises(ConnectionResetError):
                await push(client, server, "breaks", LAYOUT, wire_bytes(LAYOUT), [], 12)
            assert shm_segments() == before  # not kept for reuse: the receiver might still be reading it

    run(scenario())


def test_more_tokens_than_the_blocks_hold_is_refused_before_sending() -> None:
    async def scenario() -> None:
        async with TransferClient() as client:
            with pytest.raises(ValueError, match="num_tokens 13"):
                await client.push("tcp://127.0.0.1:1", "x", LAYOUT, wire_bytes(LAYOUT), [], 13, token="t")

    run(scenario())


def mooncake_missing() -> str | None:
    """Why the mooncake engine cannot load here (what to install), or None."""
    from kvmesh.transfer.mooncake_backend import engine_class

    try:
        engine_class()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.skipif(mooncake_missing() is not None, reason=f"{mooncake_missing()}")
@pytest.mark.parametrize("dtype", ["fp32", "fp8"])
def test_mooncake_blocks_round_trip_bit_exact(dtype: str) -> None:
    layout = replace(LAYOUT, dtype=dtype)
    sent, got = run(round_trip("mooncake", layout))
    assert same_bits(tensor(got), sent)

