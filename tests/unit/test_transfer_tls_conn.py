"""The TLS control connection (``TlsConn``) over a socket pair, with certificates from a mesh CA of the test's own:
payloads of any size arrive byte-exact in both directions and keep the stream in frame, requests and replies
alternate, a landing gets no byte after it said no, pauses on either side lose nothing, and a peer that leaves
mid-payload raises ``PeerClosed`` (receiving) or a broken pipe / reset (sending)."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from kvmesh import tls
from kvmesh.identity import Identity, MeshRole
from kvmesh.mesh_ca import MESH_SERVER_NAME, CertFiles, MeshCA
from kvmesh.settings import SharedSettings
from kvmesh.transfer.conn import TlsConn
from kvmesh.transfer.wire import PeerClosed


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertFiles, CertFiles]:
    ca = MeshCA.open(Path(tmp_path_factory.mktemp("mesh")))
    return ca.issue(Identity(MeshRole.DECODE, "decode-0")), ca.issue(Identity(MeshRole.PREFILL, "prefill-0"))


def settings(files: CertFiles) -> SharedSettings:
    return SharedSettings(tls_cert=str(files.cert), tls_key=str(files.key), tls_ca=str(files.ca),
                          tls_server_name=MESH_SERVER_NAME)


Scenario = Callable[[TlsConn, TlsConn], Coroutine[Any, Any, None]]


async def connected(mesh: tuple[CertFiles, CertFiles]) -> tuple[TlsConn, TlsConn]:
    """Both ends of a TLS connection over a fresh socket pair: (client, server)."""
    server_files, client_files = mesh
    client_tls = tls.transfer_client_tls(settings(client_files))
    server_context = tls.transfer_server_context(settings(server_files))
    assert client_tls is not None and server_context is not None
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    client, server = await asyncio.gather(
        TlsConn.handshake(a, client_tls.context, server_side=False, server_name=MESH_SERVER_NAME),
        TlsConn.handshake(b, server_context, server_side=True))
    return client, server


def over_tls(mesh: tuple[CertFiles, CertFiles], scenario: Scenario) -> None:
    """Run ``scenario(client, server)`` on a TLS connection over a fresh socket pair."""

    async def body() -> None:
        client, server = await connected(mesh)
        try:
            await scenario(client, server)
        finally:
            client.close()
            server.close()

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.parametrize("size", [1, 64 << 10, (256 << 10) + 1, (1 << 20) + 17, (16 << 20) + 5])
def test_a_payload_arrives_byte_exact_whatever_its_size(mesh, size: int) -> None:
    payload = os.urandom(size)

    async def scenario(client: TlsConn, server: TlsConn) -> None:
        got = bytearray(size)
        await asyncio.gather(client.sendall(payload), server.recv_into(memoryview(got)))
        assert got == payload

    over_tls(mesh, scenario)


def test_large_payloads_arrive_byte_exact_in_both_directions_and_in_frame(mesh) -> None:
    """Frames back to back each way, large ones between small ones: the receiver never reads a byte of the next
    frame into this one, whatever ciphertext it read ahead."""
    sizes = [3 << 20, 7, 5 << 20, 64 << 10, 2 << 20, 1]
    frames = [os.urandom(n) for n in sizes]

    async def send(conn: TlsConn) -> None:
        for frame in frames:
            await conn.sendall(frame)

    async def receive(conn: TlsConn) -> list[bytes]:
        return [bytes(await conn.recv_bytes(n)) for n in sizes]

    async def scenario(client: TlsConn, server: TlsConn) -> None:
        _, at_server = await asyncio.gather(send(client), receive(server))
        _, at_client = await asyncio.gather(send(server), receive(client))
        assert at_server == frames and at_client == frames

    over_tls(mesh, scenario)


def test_a_request_and_its_reply_alternate_on_one_connection(mesh) -> None:
    """What a push does: a large payload one way, a small reply the other, many times over."""
    payload = os.urandom((4 << 20) + 3)

    async def scenario(client: TlsConn, server: TlsConn) -> None:
        async def serve() -> None:
            for _ in range(5):
                got = await server.recv_bytes(len(payload))
                await server.sendall(b"ok" if got == payload else b"no")

        async def push() -> list[bytes]:
            replies = []
            for _ in range(5):
                await client.sendall(payload)
                replies.append(bytes(await client.recv_bytes(2)))
            return replies

        _, replies = await asyncio.gather(serve(), push())
        assert replies == [b"ok"] * 5

    over_tls(mesh, scenario)


def test_a_large_payload_lands_in_views_byte_exact(mesh) -> None:
    payload = os.urandom(6 << 20)
    cut = [0, 1, 100_000, 2 << 20, (2 << 20) + 1, len(payload)]  # views of uneven sizes, in wire order

    async def scenario(client: TlsConn, server: TlsConn) -> None:
        buf = bytearray(len(payload))
        views = [memoryview(buf)[a:b] for a, b in itertools.pairwise(cut) if b > a]
        _, landed = await asyncio.gather(client.sendall(payload), server.recv_scatter(views, lambda: True))
        assert landed and buf == payload

    over_tls(mesh, scenario)


def test_a_revoked_landing_gets_no_byte_after_it_said_no_and_the_stream_stays_in_frame(mesh) -> None:
    payload, after = os.urandom(8 << 20), os.urandom(300_000)

    async def scenario(client: TlsConn, server: TlsConn) -> None:
        buf = bytearray(len(payload))
        asked, at_no = 0, b""

        def still_open() -> bool:
            nonlocal asked, at_no
            asked += 1
            if asked == 3:
                at_no = bytes(buf)  # what had landed when it said no
            return asked < 3

        async def send() -> None:
            await client.sendall(payload)
            await client.sendall(after)

        async def receive() -> tuple[bool, bytes]:
            landed = await server.recv_scatter([memoryview(buf)], still_open)
            return landed, bytes(await server.recv_bytes(len(after)))

        _, (landed, next_frame) = await asyncio.gather(send(), receive())
        assert not landed and next_frame == after
        assert buf == at_no  # not a byte after the no
        n = len(at_no.rstrip(b"\0"))
        assert 0 < n < len(payload) and at_no[:n] == payload[:n]  # a prefix had landed, in order

    over_tls(mesh, scenario)


def test_a_payload_with_pauses_on_either_side_arrives_byte_exact(mesh) -> None:
    """The sender stops half-way for a while, then the receiver reads slowly (the sender waits for room): both pick
    up where they were."""
    payload, pause = os.urandom(6 << 20), 0.05

    async def scenario(client: TlsConn, server: TlsConn) -> None:
        async def send() -> None:
            await client.sendall(payload[:3 << 20])
            await asyncio.sleep(pause)
            await client.sendall(payload[3 << 20:])

        got = bytearray(len(payload))
        await asyncio.gather(send(), server.recv_into(memoryview(got)))
        assert got == payload

        async def read_slowly() -> bytes:
            parts = []
            for _ in range(6):
                await asyncio.sleep(pause)
                parts.append(bytes(await server.recv_bytes(1 << 20)))
            return b"".join(parts)

        _, back = await asyncio.gather(client.sendall(payload), read_slowly())
        assert back == payload

    over_tls(mesh, scenario)


@pytest.mark.parametrize("size", [64 << 10, 8 << 20])
def test_a_peer_closing_mid_payload_is_peer_closed(mesh, size: int) -> None:
    async def scenario(client: TlsConn, server: TlsConn) -> None:
        async def leave() -> None:
            await client.sendall(os.urandom(size // 2))
            client.sock.shutdown(socket.SHUT_WR)  # as a process dying mid-push: no close_notify

        _, got = await asyncio.gather(leave(), server.recv_bytes(size), return_exceptions=True)
        assert isinstance(got, PeerClosed) and "bytes of the frame missing" in str(got)

    over_tls(mesh, scenario)


def test_a_peer_gone_mid_payload_fails_the_send(mesh) -> None:
    async def scenario(client: TlsConn, server: TlsConn) -> None:
        server.sock.close()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            await client.sendall(os.urandom(64 << 20))

    over_tls(mesh, scenario)
