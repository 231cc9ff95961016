"""TLS on the transfer connection, with the mesh's certificates (the gRPC ones, ``[shared] tls_*``): blocks
arrive bit-exact, buffered and landed in place; a plain-text client, a client without a mesh certificate and a
client trusting another CA are refused; a TLS client at a plain-text endpoint is told what is wrong. Real
sockets on 127.0.0.1, real certificates made with openssl."""

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
from kvmesh.transfer.conn import TlsConn
from kvmesh.transfer.header import TransferHeader, block_checksums, encode_header
from kvmesh.transfer.landing import Landing
from kvmesh.transfer.wire import MAGIC, PREFIX, parse_address, read_reply

from tests.certs import make_certs
from tests.integration.test_transfer import (
    LAYOUT,
    LOCAL_BACKENDS,
    eventually,
    make_blocks,
    run,
    same_bits,
    tensor,
    wire_bytes,
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def member(certs) -> SharedSettings:
    """A mesh member's settings: its certificate and key, and the mesh CA."""
    return SharedSettings(tls_cert=certs["cert"], tls_key=certs["key"], tls_ca=certs["ca"])


async def tls_server(member: SharedSettings, layout: KVLayout = LAYOUT, backend: str = "tcp") -> TransferServer:
    return await TransferServer.start(layout, backend=backend, tls=tls.transfer_server_context(member))


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_push_over_tls_arrives_bit_exact(member, backend: str) -> None:
    blocks = make_blocks(LAYOUT, n=5)

    async def scenario() -> None:
        async with await tls_server(member, backend=backend) as server, \
                TransferClient(tls=tls.transfer_client_tls(member)) as client:
            for i in range(2):  # the second push reuses the pooled TLS connection
                token = server.grant(f"r{i}", 0, 5, timeout_s=30.0).token
                await client.push(server.address, f"r{i}", LAYOUT, block_bytes(blocks), [], 20, token=token)
                assert same_bits(tensor(await server.take(f"r{i}", timeout=5)), blocks)
            ((conn, _),), = client._idle.values()  # one connection, pooled: TLS
            assert conn.tls

    run(scenario())


@pytest.mark.parametrize("block_size", [16, 256])  # a 96 KiB push, a 1.5 MiB one (many staging buffers)
def test_parts_land_in_place_over_tls_bit_exact(member, block_size: int) -> None:
    """Under TLS the payload is decrypted into a staging buffer and copied into each reserved view (no
    recvmsg_into scatter)."""
    layout = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=64, block_size=block_size)
    pool, sent, reserved = DeviceKVPool(layout, 8), make_blocks(layout, n=3), [6, 1, 4]

    async def scenario() -> None:
        async with await tls_server(member, layout) as server, \
                TransferClient(tls=tls.transfer_client_tls(member)) as client:
            token = server.grant("r@", 0, 3, timeout_s=30.0).token
            k, v = pool.landing_arrays()
            server.land("r@", land := Landing(k, v, reserved, 0))
            await client.push(server.address, "r@p#0", layout, block_bytes(sent), [], 3 * block_size, token=token)
            got = await server.take("r@p#0", timeout=5)
            assert got.landed and land.landed_bytes == sent.numel() * sent.element_size()

    run(scenario())
    assert pool.read_blocks(reserved).equal(sent)


def test_a_plain_text_client_is_refused_by_a_tls_server(member) -> None:
    async def scenario() -> None:
        async with await tls_server(member) as server, TransferClient() as client:
            token = server.grant("r", 0, 3, timeout_s=30.0).token
            with pytest.raises(TransferRejected, match="takes TLS only") as e:
                await client.push(server.address, "r", LAYOUT, wire_bytes(LAYOUT), [], 12, token=token)
            assert e.value.kind == Refusal.TLS and server.refused[Refusal.TLS] == 1
            assert server.buffered_bytes == 0

    run(scenario())


def test_a_plain_text_client_mid_payload_still_reads_the_refusal(member) -> None:
    """The refusal comes while a large payload is still going out (more than the socket buffers hold): the
    server closes without resetting the sender, so the sender reads why, not a bare connection reset."""
    layout = KVLayout("tiny-model", num_layers=8, num_kv_heads=4, head_dim=64, block_size=64)  # 1 MiB a block
    payload = wire_bytes(layout, n=32)

    async def scenario() -> None:
        async with await tls_server(member, layout) as server, TransferClient() as client:
            for i in range(3):
                token = server.grant(f"r{i}", 0, 32, timeout_s=30.0).token
                with pytest.raises(TransferRejected, match="takes TLS only"):
                    await client.push(server.address, f"r{i}", layout, payload, [], 32 * 64, token=token)
            assert server.refused[Refusal.TLS] == 3 and server.buffered_bytes == 0

    run(scenario())


@pytest.mark.parametrize("who", ["no client certificate", "trusts another CA"])
def test_a_client_outside_the_mesh_gets_nothing_through(certs, member, who: str) -> None:
    stranger = SharedSettings(tls_ca=certs["ca"]) if who == "no client certificate" else SharedSettings(
        tls_cert=certs["cert"], tls_key=certs["key"], tls_ca=certs["other_ca"])

    async def scenario() -> None:
        async with await tls_server(member) as server, \
                TransferClient(tls=tls.transfer_client_tls(stranger)) as client:
            token = server.grant("r", 0, 3, timeout_s=30.0).token
            with pytest.raises(ConnectionError, match="TLS with the transfer endpoint .* failed: .*(certificate "
                                                      "required|certificate verify failed)"):
                await client.push(server.address, "r", LAYOUT, wire_bytes(LAYOUT), [], 12, token=token)
            await eventually(lambda: server.refused[Refusal.TLS] == 1)  # the server's side of the handshake
            assert server.buffered_bytes == 0 and sum(server.refused.values()) == 1

    run(scenario())


def test_a_tls_client_at_a_plain_text_endpoint_is_told_what_is_wrong(member) -> None:
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server, \
                TransferClient(tls=tls.transfer_client_tls(member)) as client:
            with pytest.raises(ConnectionError, match="TLS with the transfer endpoint .* failed"):
                await client.push(server.address, "r", LAYOUT, wire_bytes(LAYOUT), [], 12, token="t")

    run(scenario())


def test_a_landing_revoked_mid_payload_over_tls_is_never_written_again(member) -> None:
    """As over plain TCP: half a part has landed when the landing is revoked; the rest of the bytes arrive,
    none reaches the pool, the part is refused, and the same TLS connection carries the next transfer."""
    layout = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=64, block_size=64)
    pool, blocks = DeviceKVPool(layout, 4), make_blocks(layout, 2)
    payload = block_bytes(blocks)

    async def scenario() -> None:
        async with await tls_server(member, layout) as server:
            token = server.grant("r@", 0, 2, timeout_s=30.0).token
            k, v = pool.landing_arrays()
            server.land("r@", Landing(k, v, [3, 1], 0))
            client = tls.transfer_client_tls(member)
            addr = parse_address(server.address)
            sock = socket.create_connection((addr.host, addr.port))
            sock.setblocking(False)
            conn = await TlsConn.handshake(sock, client.context, server_side=False, server_name=addr.host)
            header = encode_header(TransferHeader("r@p#0", "tcp", layout, (), 2 * layout.block_size,
                                                  block_checksums(payload, layout.block_nbytes), token=token))
            half = len(payload) // 2
            await conn.sendall(PREFIX.pack(MAGIC, len(header)) + header + payload[:half])
            await eventually(lambda: int(np.count_nonzero(k[:, 3])) > 0)  # bytes are landing
            await asyncio.sleep(0.05)  # and the server waits for the rest
            server.unland("r@")
            before = (pool.k.clone(), pool.v.clone())
            await conn.sendall(payload[half:])
            reply = await asyncio.wait_for(read_reply(conn), 5)
            assert not reply.ok and "released while it was received" in reply.reason
            assert pool.k.equal(before[0]) and pool.v.equal(before[1])  # not a byte after the revoke
            token = server.grant("next", 0, 2, timeout_s=30.0).token
            other = encode_header(TransferHeader("next", "tcp", layout, (), 2 * layout.block_size,
                                                 block_checksums(payload, layout.block_nbytes), token=token))
            await conn.sendall(PREFIX.pack(MAGIC, len(other)) + other + bytes(payload))
            assert (await asyncio.wait_for(read_reply(conn), 5)).ok  # buffered (no landing), stream in sync
            assert bytes((await server.take("next", timeout=5)).data) == bytes(payload)
            conn.close()

    run(scenario())
