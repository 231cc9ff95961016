"""A Decode call that asked the engine to pin the prompt's cached blocks releases that lease (and revokes the
push capability it granted) whatever happens to the call, also when it is cancelled after the engine ran the
pin but before the count came back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvmesh.proto.v1 import worker_pb2
from kvmesh.transfer.header import SPOKEN

from services.decode.servicer import DecodeServicer


class PinRecorder:
    """The engine side of the seam: ``pin`` / ``unpin`` over a set of held leases; ``pin`` holds the lease at once
    (the engine got to it) and then never answers, as if the caller went away first."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.ran_pin = asyncio.Event()

    def namespace(self, cache_salt: str = "", lora: str = "") -> int:
        return 0

    def holds(self, namespace: int, tokens: list[int], max_blocks: int) -> int:
        return min(2, max_blocks)

    async def pin(self, lease: str, namespace: int, tokens: list[int], max_blocks: int) -> int:
        self.held.add(lease)
        self.ran_pin.set()
        await asyncio.Event().wait()  # the answer never reaches the caller: it is cancelled first
        return max_blocks

    def unpin(self, lease: str) -> None:
        self.held.discard(lease)


class Grants:
    """The transfer server's part in the call: the push granted as the call is accepted, revoked as it ends."""

    versions = SPOKEN  # advertised beside each grant

    def __init__(self) -> None:
        self.open: set[str] = set()
        self.sent: list[tuple[str, str]] = []

    def grant(self, prefix: str, first_block: int, end_block: int, timeout_s: float) -> SimpleNamespace:
        self.open.add(prefix)
        return SimpleNamespace(token=f"token-{prefix}")

    def revoke(self, prefix: str, grant: object = None) -> None:
        self.open.discard(prefix)

    async def send_initial_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.sent += metadata


def test_a_call_cancelled_while_its_pin_is_answered_still_unpins():
    grants = Grants()

    async def main() -> tuple[set[str], set[str]]:
        engine = PinRecorder()
        counter = SimpleNamespace(labels=lambda *_: SimpleNamespace(inc=lambda n=1: None))
        metrics = SimpleNamespace(transfer_bytes=counter, kv_ready_dropped=counter, rejections=counter)
        host = SimpleNamespace(engine=engine, span_attributes=lambda rid, salt: {}, metrics=metrics, pool=None,
                               transfer_server=grants, layout=SimpleNamespace(block_size=16), convertible=frozenset(),
                               cfg=SimpleNamespace(kv_timeout_s=10.0, receive_in_place=True))
        servicer = DecodeServicer.__new__(DecodeServicer)
        servicer.w = host
        servicer.kv_ready = SimpleNamespace(board=None)  # never reached: the call is cancelled at its pin
        work = worker_pb2.WorkRequest(request_id="r1", prompt_token_ids=list(range(40)))
        request = worker_pb2.DecodeRequest(work=work, cached_blocks=2)

        async def consume() -> None:
            decode = DecodeServicer.Decode.__wrapped__  # the RPC without its tracing wrapper
            async for _ in decode(servicer, request, grants, SimpleNamespace(set_attributes=lambda a: None)):
                pass

        task = asyncio.ensure_future(consume())
        await engine.ran_pin.wait()
        held_during = set(engine.held)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return held_during, engine.held

    held_during, held_after = asyncio.run(asyncio.wait_for(main(), 10))
    assert held_during == {"r1"}  # the engine pinned for the call...
    assert held_after == set()  # ...and the cancelled call released it
    # sent to the router before the pin, with the blocks decode holds (which prefill then does not push)
    assert grants.sent == [("x-kvmesh-push-token", "token-r1@"), ("x-kvmesh-transfer-versions", str(SPOKEN)),
                           ("x-kvmesh-held-blocks", "2")]
    assert grants.open == set()  # and revoked as the call ended
