"""The sealed-payload format (:mod:`kvmesh.transfer.seal`) and how a header carries it: chunk sizes chosen per
payload, sizes on the wire, a key never printed, every malformed seal refused saying which field is wrong, and the
chunks' buffers lent per push and kept within a bound."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
from kvmesh.contracts.layout import KVLayout
from kvmesh.transfer.conn import BufferPool, Conn
from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.header import SEALED, TransferHeader, decode_header, encode_header
from kvmesh.transfer.seal import CHUNK, KEY_BYTES, SMALLEST, TAG, Seal

LAYOUT = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def header(seal: Seal | None, backend: str = "tcp") -> TransferHeader:
    return TransferHeader("r", backend, LAYOUT, (), 4, (1,), seal=seal)


@pytest.mark.parametrize(("nbytes", "chunk"), [(1, SMALLEST), (64 << 10, SMALLEST), (1 << 20, 256 << 10),
                                                (3 << 20, CHUNK), (16 << 20, CHUNK), (1 << 30, CHUNK)])
def test_a_payload_is_sealed_in_chunks_of_a_power_of_two_four_or_more_where_it_allows(nbytes: int,
                                                                                    chunk: int) -> None:
    seal = Seal.new(nbytes)
    assert seal.chunk == chunk and len(seal.key) == KEY_BYTES
    assert seal.sealed_nbytes(nbytes) == nbytes + TAG * -(-nbytes // chunk)


def test_every_push_gets_a_key_of_its_own_and_it_is_never_printed() -> None:
    a, b = Seal.new(1 << 20), Seal.new(1 << 20)
    assert a.key != b.key
    assert a.key.hex() not in repr(a) and a.key.hex() not in repr(header(a))


def test_nonces_and_associated_data_differ_per_chunk_and_mark_the_last() -> None:
    assert len({Seal.nonce(i) for i in range(1000)}) == 1000 and all(len(Seal.nonce(i)) == 12 for i in range(3))
    assert Seal.aad(3, True) != Seal.aad(3, False) != Seal.aad(4, False)


def test_a_seal_travels_in_a_version_3_header() -> None:
    seal = Seal.new(1 << 20)
    got = decode_header(encode_header(header(seal), SEALED))
    assert got.seal == seal and got == header(seal)
    assert decode_header(encode_header(header(None), SEALED)).seal is None


def doc_with(**seal: object) -> bytes:
    doc = json.loads(encode_header(header(Seal.new(1 << 20)), SEALED))
    doc["seal"] |= seal
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("change", "message"), [
    ({"aead": "AES-128-CBC"}, "seal.aead 'AES-128-CBC' is not 'AES-256-GCM'"),
    ({"chunk": 100}, "seal.chunk 100 is not a byte count"),
    ({"chunk": 1 << 30}, "is not a byte count from"),
    ({"chunk": True}, "seal.chunk True"),
    ({"key": "c2hvcnQ="}, "seal.key must be 32 bytes"),
    ({"key": "not base64!"}, "seal.key must be 32 bytes"),
    ({"key": 7}, "seal.key must be 32 bytes"),
])
def test_a_malformed_seal_is_refused_saying_which_field(change: dict, message: str) -> None:
    with pytest.raises(TransferRejected, match=message.replace("(", "\\(")) as e:
        decode_header(doc_with(**change))
    assert e.value.kind == Refusal.MALFORMED


def test_a_seal_on_a_payload_that_does_not_travel_on_the_connection_is_refused() -> None:
    doc = json.loads(encode_header(header(Seal.new(1 << 20)), SEALED)) | {"backend": "shm"}
    with pytest.raises(TransferRejected, match="a sealed payload travels on the connection"):
        decode_header(json.dumps(doc).encode())


def test_a_version_2_header_naming_a_seal_is_read_without_it() -> None:
    """Version 2 has no seal: a receiver reads such a payload as TLS records, and a forged field changes nothing."""
    doc = json.loads(encode_header(header(Seal.new(1 << 20)), SEALED)) | {"v": 2}
    assert decode_header(json.dumps(doc).encode()).seal is None


def test_sealed_chunks_buffers_are_lent_per_push_reused_and_bounded_when_idle() -> None:
    pool = BufferPool(max_idle_bytes=3 * BufferPool.GRAIN)
    with pool.lend((64 << 10) + TAG) as a:
        assert len(a) == 2 * BufferPool.GRAIN  # rounded up to the grain
        with pool.lend(100) as b:  # lent twice at once: two buffers
            assert len(b) == BufferPool.GRAIN and b.obj is not a.obj
    assert pool.idle_bytes == 3 * BufferPool.GRAIN
    with pool.lend((64 << 10) + TAG) as again:
        assert again.obj is a.obj  # written before: no page faults the second time
    with pool.lend(BufferPool.GRAIN + 1) as c, pool.lend(BufferPool.GRAIN + 1) as d:
        assert c.obj is a.obj and d.obj is not a.obj
    assert pool.idle_bytes <= pool.max_idle_bytes  # the one over the bound was let go


def test_a_sealed_send_cancelled_mid_payload_sends_nothing_more() -> None:
    """A push given up on (its deadline, a cancelled request) stops sending: nothing more reaches the socket the
    caller then closes (and whose number the next socket may take)."""
    async def body() -> None:
        a, b = socket.socketpair()
        a.setblocking(False)
        payload = memoryview(bytearray(64 << 20))
        task = asyncio.create_task(Conn(a).send_sealed(payload, Seal.new(len(payload))))
        await asyncio.sleep(0.2)  # nobody reads b: the send waits for room
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        a.close()
        b.setblocking(False)
        got = 0
        with contextlib.suppress(BlockingIOError):
            while chunk := b.recv(1 << 20):
                got += len(chunk)
        assert 0 < got < Seal.new(len(payload)).sealed_nbytes(len(payload))
        b.close()

    asyncio.run(body())
