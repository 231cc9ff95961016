"""The router's migration limits (``services/router/migration.py``): per request, at once across the router, and
the slot a migration holds given back exactly once, whether its stream delivered again or failed."""

import asyncio

from services.router.errors import ErrorKind, RequestError
from services.router.migration import Migrations
from services.router.telemetry import RequestTrace, RouterMetrics

DEAD = RequestError(ErrorKind.UNAVAILABLE, "instance decode-0 failed: UNAVAILABLE", "decode-0", retryable=True)


def counted(metrics: RouterMetrics, outcome: str) -> float:
    return metrics.migrations.labels(outcome)._value.get()


def test_a_request_moves_at_most_migration_limit_times():
    metrics = RouterMetrics()
    m = Migrations(per_request=2, concurrent=10, metrics=metrics)
    rt = RequestTrace(metrics, "r1", "test")

    async def scenario() -> None:
        for done in range(2):
            (await m.start(rt, DEAD, done, carried=5)).arrived()
        assert await m.start(rt, DEAD, 2, carried=5) is None

    asyncio.run(scenario())
    assert counted(metrics, "migrated") == 2 and counted(metrics, "over_request_limit") == 1


def test_past_the_routers_limit_a_failed_stream_waits_for_a_slot_in_order_and_still_moves():
    metrics = RouterMetrics()
    m = Migrations(per_request=3, concurrent=2, metrics=metrics)

    async def scenario() -> None:
        first, second = [await m.start(RequestTrace(metrics, f"r{i}", "test"), DEAD, 0, 10) for i in range(2)]
        third = asyncio.create_task(m.start(RequestTrace(metrics, "r3", "test"), DEAD, 0, 10))
        fourth = asyncio.create_task(m.start(RequestTrace(metrics, "r4", "test"), DEAD, 0, 10))
        await asyncio.sleep(0)
        assert not third.done() and not fourth.done() and counted(metrics, "queued") == 2
        first.failed(DEAD)
        first.failed(DEAD)  # once only: one slot back, the first queued takes it
        assert (await third) is not None and not fourth.done()
        second.arrived()
        (await fourth).arrived()
        (await third).arrived()
        assert m.under_way == 0

    asyncio.run(scenario())
    assert counted(metrics, "migrated") == 4


def test_a_migrated_stream_is_held_to_no_ttft_target():
    """Admission must not refuse a stream mid-answer because its TTFT target ran out long ago."""
    from kvmesh.proto.v1 import common_pb2, worker_pb2

    from services.router.core import ttft_left

    slo = common_pb2.SLO(ttft_s=6.0, itl_s=0.15)
    assert ttft_left(worker_pb2.WorkRequest(slo=slo, waited_s=2.0)) == 4.0
    assert ttft_left(worker_pb2.WorkRequest(slo=slo, waited_s=9.0)) == 1e-3  # late: any estimate misses it
    assert ttft_left(worker_pb2.WorkRequest(slo=slo, waited_s=9.0, generated_tokens=12)) == 0.0
    assert ttft_left(worker_pb2.WorkRequest(waited_s=2.0)) == 0.0
