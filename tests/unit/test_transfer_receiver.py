"""The hand-off receiver (``kvmesh.transfer.receiver``) without a process: it grants before anything else, takes
only the request's authentic ``kv.ready`` (forgeries are counted and waited past), and as the call ends revokes,
releases and unpins whatever happened."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.ids import InstanceId, RequestId, TransferId
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.messages import KVReady
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.transfer.receiver import KVReadyBoard, ReceiveCounters, Receiver

LAYOUT = KVLayout("t", 2, 1, 4, 4)
RID = "tenant.r1.nonce"


class FakeServer:
    def __init__(self) -> None:
        self.log: list[str] = []

    def grant(self, prefix: str, first_block: int, end_block: int, timeout_s: float) -> SimpleNamespace:
        self.log.append(f"grant {prefix} {first_block}-{end_block}")
        return SimpleNamespace(token="capability")

    def revoke(self, prefix: str, grant: object = None) -> None:
        self.log.append(f"revoke {prefix}")

    def discard_prefix(self, prefix: str) -> None:
        self.log.append(f"discard {prefix}")


class FakeEngine:
    def __init__(self) -> None:
        self.pinned: set[str] = set()

    def holds(self, namespace: int, tokens: list[int], max_blocks: int) -> int:
        return 1

    async def pin(self, lease: str, namespace: int, tokens: list[int], max_blocks: int) -> int:
        self.pinned.add(lease)
        return max_blocks

    def unpin(self, lease: str) -> None:
        self.pinned.discard(lease)

    async def reserve(self, lease: str, request: EngineRequest, first_block: int) -> None:
        return None  # no room: the push would be buffered

    def release(self, lease: str) -> None:
        pass


def ready(**fields) -> KVReady:
    base = {"request_id": RequestId(RID), "decode_instance": InstanceId("decode-0"),
            "transfer_id": TransferId(f"{RID}@prefill-0"), "block_keys": (), "num_tokens": 10, "first_token": 7,
            "layout": None, "prefill_instance": InstanceId("prefill-0")}
    return KVReady(**{**base, **fields})


def test_only_the_requests_authentic_kv_ready_is_taken_and_forgeries_are_counted():
    dropped: list[str] = []
    server, engine, board = FakeServer(), FakeEngine(), KVReadyBoard()

    async def main():
        receiver = Receiver(server, board, engine, EngineRequest(RID, tuple(range(10)), SamplingParams()), 0,
                            LAYOUT, counters=ReceiveCounters(ready_dropped=dropped.append))
        sent: list[tuple[str, int]] = []

        async def send_grant(grant, held: int) -> None:
            sent.append((grant.token, held))
            board.post(ready())  # unsigned: anyone on the bus could send it
            board.post(ready().signed("a guess"))
            board.post(ready(transfer_id=TransferId("other.r9.x@prefill-0")).signed("capability"))
            board.post(ready(ok=False, error="the prefill failed").signed("capability"))  # the genuine one

        try:
            return sent, await receiver.receive(5.0, send_grant)
        finally:
            receiver.close()

    sent, intake = asyncio.run(asyncio.wait_for(main(), 10))
    assert sent == [("capability", 1)]  # granted first, with the block held here
    assert intake.imported is None and intake.fallback == "prefill prefill-0: the prefill failed"
    assert dropped == ["unauthenticated", "unauthenticated", "transfer_id"]
    assert server.log[0] == f"grant {RID}@ 1-3" and f"revoke {RID}@" in server.log
    assert engine.pinned == set()  # unpinned as the call ended
