"""The router's migration limits (``services/router/migration.py``): per request, at once across the router, and
the slot a migration holds given back exactly once, whether its stream delivered again or failed."""

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
    for done in range(2):
        m.start(rt, DEAD, done, carried=5).arrived()
    assert m.start(rt, DEAD, 2, carried=5) is None
    assert counted(metrics, "migrated") == 2 and counted(metrics, "over_request_limit") == 1


def test_past_the_routers_limit_a_failed_stream_is_not_moved_until_a_slot_is_back():
    metrics = RouterMetrics()
    m = Migrations(per_request=3, concurrent=2, metrics=metrics)
    first, second = (m.start(RequestTrace(metrics, f"r{i}", "test"), DEAD, 0, 10) for i in range(2))
    assert m.start(RequestTrace(metrics, "r3", "test"), DEAD, 0, 10) is None
    assert counted(metrics, "over_router_limit") == 1
    first.failed(DEAD)
    first.failed(DEAD)  # once only
    second.arrived()
    assert m.under_way == 0
    assert m.start(RequestTrace(metrics, "r4", "test"), DEAD, 0, 10) is not None


def test_a_migrated_stream_is_held_to_no_ttft_target():
    """Admission must not refuse a stream mid-answer because its TTFT target ran out long ago."""
    from kvmesh.proto.v1 import common_pb2, worker_pb2

    from services.router.core import ttft_left

    slo = common_pb2.SLO(ttft_s=6.0, itl_s=0.15)
    assert ttft_left(worker_pb2.WorkRequest(slo=slo, waited_s=2.0)) == 4.0
    assert ttft_left(worker_pb2.WorkRequest(slo=slo, waited_s=9.0)) == 1e-3  # late: any estimate misses it
    assert ttft_left(worker_pb2.WorkRequest(slo=slo, waited_s=9.0, generated_tokens=12)) == 0.0
    assert ttft_left(worker_pb2.WorkRequest(waited_s=2.0)) == 0.0
