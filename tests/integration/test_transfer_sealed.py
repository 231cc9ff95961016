"""Sealed payloads (header version 3, :mod:`kvmesh.transfer.seal`) over real TLS connections on 127.0.0.1, with
certificates from a CA of the test's own: a TLS push to a version-3 receiver is sealed and arrives bit-exact,
buffered and landed in place, in whole chunks and with a short last one; a version-2 receiver gets it in TLS
records; a chunk altered in flight is refused and nothing of it is taken, and the connection carries the next push;
a refused sealed push is skipped whole; a landing revoked mid-payload gets no byte after; a sealed header on a
plain-text connection is refused."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
from kvmesh import tls
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.kv_cache import DeviceKVPool, block_bytes
from kvmesh.settings import SharedSettings
from kvmesh.transfer import Refusal, TransferClient, TransferRejected, TransferServer
from kvmesh.transfer.conn import Conn, TlsConn
from kvmesh.transfer.header import SEALED, HeaderCodec, TransferHeader, Versions, block_checksums, encode_header
from kvmesh.transfer.landing import Landing
from kvmesh.transfer.seal import TAG, Seal
from kvmesh.transfer.wire import MAGIC, PREFIX, Reply, configure, parse_address, read_reply

from tests.certs import make_certs
from tests.integration.test_transfer import eventually, make_blocks, run, same_bits, tensor
from tests.wire_next import Recording

# 2 layers x K|V x 64 tokens x 2 heads x 64 dims x fp32: 128 KiB a block; 3 blocks = 384 KiB = 6 chunks of 64 KiB
LAYOUT = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=64, block_size=64)


@pytest.fixture(scope="module")
def member(tmp_path_factory) -> SharedSettings:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    return SharedSettings(tls_cert=certs["cert"], tls_key=certs["key"], tls_ca=certs["ca"])


class V2Only(Recording):
    """A receiver of the build before sealing: it reads header version 2 only."""

    speaks = Versions(2, 2)


def sealed(payload: memoryview, seal: Seal) -> bytearray:
    """``payload`` as a sender seals it on the wire."""
    out, n = bytearray(), len(payload)
    aead, count = seal.aead(), seal.chunks(n)
    for i in range(count):
        out += aead.encrypt(seal.nonce(i), bytes(payload[i * seal.chunk:(i + 1) * seal.chunk]),
                            seal.aad(i, i == count - 1))
    return out


async def dial(server: TransferServer, member: SharedSettings | None) -> Conn:
    """A raw connection to ``server``'s endpoint (TLS with ``member``'s certificate, or plain)."""
    addr = parse_address(server.address)
    sock = socket.create_connection((addr.host, addr.port))
    configure(sock)
    if member is None:
        return Conn(sock)
    client = tls.transfer_client_tls(member)
    assert client is not None
    return await TlsConn.handshake(sock, client.context, server_side=False, server_name=addr.host)


def header_for(tid: str, payload: memoryview, token: str, seal: Seal | None, layout: KVLayout = LAYOUT) -> bytes:
    n = len(payload) // layout.block_nbytes
    raw = encode_header(TransferHeader(tid, "tcp", layout, (), n * layout.block_size,
                                       block_checksums(payload, layout.block_nbytes), token=token, seal=seal), SEALED)
    return PREFIX.pack(MAGIC, len(raw)) + raw


async def send_raw(conn: Conn, data: bytes | bytearray) -> None:
    """On the socket itself, past the TLS records (as a sealed payload travels)."""
    await asyncio.get_running_loop().sock_sendall(conn.sock, data)


async def exchange(conn: Conn, header: bytes, wire: bytes | bytearray) -> Reply:
    await conn.sendall(header)
    await send_raw(conn, wire)
    return await asyncio.wait_for(read_reply(conn), 10)


# 96 KiB a block: 3 blocks are 4.5 chunks of 64 KiB, the last one short
SHORT_TAIL = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=64, block_size=48)


@pytest.mark.parametrize("layout", [LAYOUT, SHORT_TAIL], ids=["whole-chunks", "short-last-chunk"])
def test_a_tls_push_to_a_version_3_receiver_is_sealed_and_arrives_bit_exact(member, layout: KVLayout) -> None:
    blocks, codec = make_blocks(layout), Recording()

    async def scenario() -> None:
        async with await TransferServer.start(layout, tls=tls.transfer_server_context(member), codec=codec) as server, \
                TransferClient(tls=tls.transfer_client_tls(member)) as client:
            for i in range(2):  # the second on the pooled connection
                token = server.grant(f"r{i}", 0, 3, timeout_s=30.0).token
                await client.push(server.address, f"r{i}", layout, block_bytes(blocks), [], 3 * layout.block_size,
                                  token=token, versions=server.versions)
                assert same_bits(tensor(await server.take(f"r{i}", timeout=5)), blocks)

    run(scenario())
    assert [v for v, _ in codec.read] == [SEALED, SEALED]
    assert all(doc["seal"]["aead"] == "AES-256-GCM" and doc["seal"]["chunk"] == 64 << 10 for _, doc in codec.read)


@pytest.mark.parametrize(("layout", "n"), [(LAYOUT, 3), (LAYOUT, 1), (SHORT_TAIL, 3)],
                         ids=["six-chunks", "one-block-two-chunks", "short-last-chunk"])
def test_sealed_parts_land_in_place_bit_exact(member, layout: KVLayout, n: int) -> None:
    pool, sent, reserved = DeviceKVPool(layout, 8), make_blocks(layout, n=n), [6, 1, 4][:n]

    async def scenario() -> None:
        async with await TransferServer.start(layout, tls=tls.transfer_server_context(member)) as server, \
                TransferClient(tls=tls.transfer_client_tls(member)) as client:
            token = server.grant("r@", 0, n, timeout_s=30.0).token
            k, v = pool.landing_arrays()
            server.land("r@", land := Landing(k, v, reserved, 0))
            await client.push(server.address, "r@p#0", layout, block_bytes(sent), [], n * layout.block_size,
                              token=token, versions=server.versions)
            got = await server.take("r@p#0", timeout=5)
            assert got.landed and land.landed_bytes == sent.numel() * sent.element_size()

    run(scenario())
    assert pool.read_blocks(reserved).equal(sent)


def test_a_version_2_receiver_gets_the_payload_in_tls_records(member) -> None:
    blocks, codec = make_blocks(LAYOUT), V2Only()

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, tls=tls.transfer_server_context(member), codec=codec) as server, \
                TransferClient(tls=tls.transfer_client_tls(member)) as client:
            token = server.grant("r", 0, 3, timeout_s=30.0).token
            await client.push(server.address, "r", LAYOUT, block_bytes(blocks), [], 3 * LAYOUT.block_size,
                              token=token, versions=server.versions)
            assert same_bits(tensor(await server.take("r", timeout=5)), blocks)

    run(scenario())
    assert [(v, "seal" in doc) for v, doc in codec.read] == [(2, False)]


@pytest.mark.parametrize("landed", [False, True])
def test_a_chunk_altered_in_flight_is_refused_and_the_connection_carries_the_next_push(member, landed: bool) -> None:
    pool, blocks = DeviceKVPool(LAYOUT, 4), make_blocks(LAYOUT)
    payload = block_bytes(blocks)

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, tls=tls.transfer_server_context(member)) as server:
            if landed:
                k, v = pool.landing_arrays()
                server.land("bad@", Landing(k, v, [3, 1, 0], 0))
            conn = await dial(server, member)
            seal = Seal.new(len(payload))
            wire = sealed(payload, seal)
            wire[seal.chunk + TAG + 100] ^= 1  # a bit of the second chunk
            token = server.grant("bad@p#0", 0, 3, timeout_s=30.0).token
            reply = await exchange(conn, header_for("bad@p#0", payload, token, seal), wire)
            assert not reply.ok and reply.kind == Refusal.CHECKSUM
            assert "chunk 1 of 6 failed authentication" in reply.reason
            with pytest.raises(TransferRejected, match="failed authentication"):
                await server.take("bad@p#0", timeout=5)
            if landed:  # chunk 0 (block 0's layer 0) landed; nothing of chunk 1 (its layer 1) or after
                first = pool.read_blocks([3])[0]
                assert first[0].equal(blocks[0, 0]) and not first[1].any() and not pool.read_blocks([1, 0]).any()
            token = server.grant("next", 0, 3, timeout_s=30.0).token
            seal = Seal.new(len(payload))
            assert (await exchange(conn, header_for("next", payload, token, seal), sealed(payload, seal))).ok
            assert same_bits(tensor(await server.take("next", timeout=5)), blocks)
            conn.close()

    run(scenario())


def test_a_refused_sealed_push_is_skipped_whole_and_the_next_one_arrives(member) -> None:
    blocks = make_blocks(LAYOUT)

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, tls=tls.transfer_server_context(member)) as server, \
                TransferClient(tls=tls.transfer_client_tls(member)) as client:
            server.grant("r", 0, 3, timeout_s=30.0)
            with pytest.raises(TransferRejected) as e:
                await client.push(server.address, "r", LAYOUT, block_bytes(blocks), [], 3 * LAYOUT.block_size,
                                  token="forged", versions=server.versions)
            assert e.value.kind == Refusal.BAD_TOKEN
            token = server.grant("s", 0, 3, timeout_s=30.0).token
            await client.push(server.address, "s", LAYOUT, block_bytes(blocks), [], 3 * LAYOUT.block_size,
                              token=token, versions=server.versions)
            assert same_bits(tensor(await server.take("s", timeout=5)), blocks)
            ((conn, _),), = client._idle.values()  # both on one connection: the refused payload was skipped
            assert conn.tls

    run(scenario())


def test_a_landing_revoked_mid_sealed_payload_is_never_written_again(member) -> None:
    pool, blocks = DeviceKVPool(LAYOUT, 4), make_blocks(LAYOUT)
    payload = block_bytes(blocks)

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT, tls=tls.transfer_server_context(member)) as server:
            token = server.grant("r@", 0, 3, timeout_s=30.0).token
            k, v = pool.landing_arrays()
            server.land("r@", Landing(k, v, [3, 1, 0], 0))
            conn = await dial(server, member)
            seal = Seal.new(len(payload))
            wire = sealed(payload, seal)
            await conn.sendall(header_for("r@p#0", payload, token, seal))
            half = 3 * (seal.chunk + TAG)
            await send_raw(conn, wire[:half])
            await eventually(lambda: int(np.count_nonzero(k[:, 3])) > 0)  # chunks are landing
            await asyncio.sleep(0.05)
            server.unland("r@")
            before = (pool.k.clone(), pool.v.clone())
            await send_raw(conn, wire[half:])
            reply = await asyncio.wait_for(read_reply(conn), 5)
            assert not reply.ok and "released while it was received" in reply.reason
            assert pool.k.equal(before[0]) and pool.v.equal(before[1])  # not a byte after the revoke
            token = server.grant("next", 0, 3, timeout_s=30.0).token
            seal = Seal.new(len(payload))
            assert (await exchange(conn, header_for("next", payload, token, seal), sealed(payload, seal))).ok
            conn.close()

    run(scenario())


def test_a_sealed_header_on_a_plain_text_connection_is_refused(member) -> None:
    """Its key travelled in clear: the receiver takes nothing and closes."""
    payload = block_bytes(make_blocks(LAYOUT))

    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server:
            token = server.grant("r", 0, 3, timeout_s=30.0).token
            conn = await dial(server, None)
            seal = Seal.new(len(payload))
            reply = await exchange(conn, header_for("r", payload, token, seal), sealed(payload, seal))
            assert not reply.ok and reply.kind == Refusal.MALFORMED and "plain-text connection" in reply.reason
            assert server.refused[Refusal.MALFORMED] == 1 and server.buffered_bytes == 0
            conn.close()

    run(scenario())


def test_a_header_codec_of_version_2_never_writes_a_seal() -> None:
    payload = block_bytes(make_blocks(LAYOUT))
    header = TransferHeader("r", "tcp", LAYOUT, (), 3 * LAYOUT.block_size,
                            block_checksums(payload, LAYOUT.block_nbytes), seal=Seal.new(len(payload)))
    with pytest.raises(ValueError, match="needs header version 3"):
        HeaderCodec().encode(header, 2)
