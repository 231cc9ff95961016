"""A transfer endpoint survives hostile peers (``kvmesh.transfer.server.Limits``): silent connections are closed
after the idle timeout, one host cannot hold more than its share, a full endpoint makes room by closing the
connection idle longest, running out of file descriptors does not end the accept loop, and a header larger than
any grant expects is refused before it is read. Every refusal is counted; each peer is logged once, not per
connection. Real sockets on 127.0.0.1; the hostile peer dials from 127.0.0.2 (another host to the endpoint)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvmesh.transfer import Limits, Refusal, TransferClient, TransferServer
from kvmesh.transfer.conn import Conn
from kvmesh.transfer.header import HEADER_BASE, TransferHeader, encode_header, header_limit
from kvmesh.transfer.wire import MAGIC, PREFIX, read_reply

from tests.integration.test_transfer import LAYOUT, eventually, make_blocks, run, same_bits, tensor, wire_bytes

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = "127.0.0.2"


async def dial(server: TransferServer, n: int, source: str = HOSTILE) -> list[socket.socket]:
    """``n`` connections to ``server`` from ``source`` that never send a byte."""
    loop = asyncio.get_running_loop()
    port = int(server.address.rsplit(":", 1)[1])
    socks = []
    for _ in range(n):
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((source, 0))
        await loop.sock_connect(sock, ("127.0.0.1", port))
        socks.append(sock)
    return socks


async def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (waits for it, or for a byte: a silent endpoint fails the test)."""
    try:
        return await asyncio.get_running_loop().sock_recv(sock, 1) == b""
    except ConnectionResetError:
        return True


async def push_ok(server: TransferServer, client: TransferClient, tid: str) -> None:
    token = server.grant(tid, 0, 3, timeout_s=30.0).token
    await client.push(server.address, tid, LAYOUT, wire_bytes(LAYOUT), [], 3 * LAYOUT.block_size, token=token)
    assert same_bits(tensor(await server.take(tid, timeout=5)), make_blocks(LAYOUT))


def test_a_connection_that_sends_no_frame_is_closed_after_the_idle_timeout(caplog) -> None:
    async def scenario() -> None:
        limits = Limits(idle_timeout_s=0.2)
        async with await TransferServer.start(LAYOUT, limits=limits) as server, TransferClient() as client:
            socks = await dial(server, 3)
            with caplog.at_level(logging.WARNING, "kvmesh.transfer.server"):
                assert all([await closed_by_peer(s) for s in socks])
            await eventually(lambda: server.connections == 0)
            assert server.refused[Refusal.IDLE] == 3
            assert caplog.text.count(f"peer {HOSTILE}: connection closed: no frame within") == 1  # once per peer
            await push_ok(server, client, "after-idle")  # a sender that does send is served as ever
            for s in socks:
                s.close()

    run(scenario())


def test_one_host_holds_at_most_its_share_and_another_still_pushes(caplog) -> None:
    async def scenario() -> None:
        limits = Limits(max_connections_per_peer=4)
        async with await TransferServer.start(LAYOUT, limits=limits) as server, TransferClient() as client:
            with caplog.at_level(logging.WARNING, "kvmesh.transfer.server"):
                socks = await dial(server, 10)
                await eventually(lambda: server.refused[Refusal.CONNECTIONS] == 6)
            assert server.connections == 4
            assert sum([await closed_by_peer(s) for s in socks[4:]]) == 6  # closed unread
            assert caplog.text.count(f"peer {HOSTILE}: connection closed unread") == 1
            await push_ok(server, client, "beside-the-flood")
            assert server.refused[Refusal.CONNECTIONS] == 6 and server.refused[Refusal.IDLE] == 0
            for s in socks:
                s.close()

    run(scenario())


def test_a_full_endpoint_closes_the_connection_idle_longest_to_take_a_new_one() -> None:
    async def scenario() -> None:
        limits = Limits(max_connections=4, max_connections_per_peer=100)
        async with await TransferServer.start(LAYOUT, limits=limits) as server, TransferClient() as client:
            socks = await dial(server, 4)
            await eventually(lambda: server.connections == 4)
            await push_ok(server, client, "at-the-cap")  # its connection replaced the idle one held longest
            assert await closed_by_peer(socks[0])
            assert server.refused[Refusal.IDLE] == 1 and server.refused[Refusal.CONNECTIONS] == 0
            for s in socks:
                s.close()

    run(scenario())


@pytest.mark.parametrize("granted", [0, 1000])
def test_a_header_larger_than_the_widest_grant_expects_is_refused_unread(granted: int) -> None:
    """The limit follows the grants: with none held only a header of no blocks fits; a grant of 1000 blocks lets
    a 1000-block header through (it is then checked as ever), never a larger one. Nothing past the prefix is sent:
    the reply comes before the server read a byte of the header."""
    async def scenario() -> None:
        async with await TransferServer.start(LAYOUT) as server:
            if granted:
                server.grant("big", 0, granted, timeout_s=30.0)
            loop = asyncio.get_running_loop()
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", int(server.address.rsplit(":", 1)[1])))
            await loop.sock_sendall(sock, PREFIX.pack(MAGIC, header_limit(granted) + 1))
            reply = await read_reply(Conn(sock))
            assert not reply.ok and reply.kind == Refusal.MALFORMED
            assert f"exceeds the {header_limit(granted)}-byte limit" in reply.reason
            sock.close()

    run(scenario())


def test_the_limit_fits_the_largest_header_a_sender_can_write() -> None:
    """What HEADER_BASE leaves room for: a 1024-character transfer id, layer slices, a mooncake source."""
    n = 4096
    header = TransferHeader("r" * 1024, "mooncake", LAYOUT, tuple(range(2**63, 2**63 + n)), n * LAYOUT.block_size,
                            tuple(range(2**64 - n, 2**64)), {"session": "[ffff::1]:65535", "addr": 2**64 - 1,
                                                             "len": 2**48}, (0, 2), 7, "t" * 32)
    assert len(encode_header(header)) <= header_limit(n)
    assert len(encode_header(header)) - 38 * n < HEADER_BASE / 2  # the margin


CHILD = textwrap.dedent("""
    import asyncio, os, resource, sys
    from tests.integration.test_transfer import LAYOUT
    from kvmesh.transfer import Limits, TransferServer

    async def main():
        # a cap far above the descriptors the process will have: only the accept loop stands between the
        # flood and the endpoint
        server = await TransferServer.start(LAYOUT, limits=Limits(max_connections=100_000,
                                                                  max_connections_per_peer=100_000))
        token = server.grant("after-emfile", 0, 3, timeout_s=120).token
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
        print(server.address, token, flush=True)
        got = await server.take("after-emfile", timeout=120)
        print("took", got.num_blocks, server.refused, flush=True)
        await server.close()

    asyncio.run(main())
""")


def test_running_out_of_file_descriptors_does_not_stop_the_accept_loop() -> None:
    """The endpoint's process has 16 descriptors to spare; 64 idle connections exhaust them (``EMFILE`` at
    accept). Once the flood goes, the same endpoint still accepts and verifies a push."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "libs"), str(ROOT)])}
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        address, token = child.stdout.readline().split()
        port = int(address.rsplit(":", 1)[1])
        flood = []
        for _ in range(64):  # the kernel completes the handshakes (backlog) whether or not accept() can
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            flood.append(s)
        for s in flood:
            s.close()

        async def push() -> None:
            async with TransferClient(connect_timeout=30, reply_timeout=60) as client:
                await client.push(address, "after-emfile", LAYOUT, wire_bytes(LAYOUT), [], 3 * LAYOUT.block_size,
                                  token=token)

        run(push(), timeout_s=90)
        out, err = child.communicate(timeout=60)
        assert out.startswith("took 3"), err
        assert "cannot accept a connection (EMFILE" in err
    finally:
        child.kill()
        child.wait()
