"""A hand-off goes through while hostile peers hold idle connections to decode's transfer endpoint: a real router,
prefill and decode (tiny model, real nats-server, loopback), the endpoint capped by ``[shared]
transfer_max_connections`` / ``transfer_max_connections_per_peer``. Three hosts (127.0.0.2-4) each open far more
connections than their share and never send a byte; the endpoint holds at most its cap, and a PD request is
pushed, not recomputed."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from kvmesh.transfer import Refusal

from .test_pd_layer_groups import generate, received_bytes
from .test_router_bad_input import TinyMesh, model_dir  # noqa: F401

TOTAL, PER_PEER, HOSTS, EACH = 64, 32, ("127.0.0.2", "127.0.0.3", "127.0.0.4"), 100


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    m = TinyMesh(nats_server.url, model_dir)
    m.shared = m.shared.model_copy(update={"transfer_max_connections": TOTAL,
                                           "transfer_max_connections_per_peer": PER_PEER})
    with m:
        yield m


def test_a_flood_of_idle_connections_costs_no_hand_off(mesh) -> None:
    decode = mesh.workers[1]
    server = decode.transfer_server
    host, port = server.address.split("://")[1].rsplit(":", 1)
    flood = []
    for source in HOSTS:
        for _ in range(EACH):
            s = socket.socket()
            s.bind((source, 0))
            s.connect((host, int(port)))
            flood.append(s)
    try:
        over_share = len(HOSTS) * (EACH - PER_PEER)
        mesh.call(_eventually(lambda: server.refused[Refusal.CONNECTIONS] >= over_share))
        assert server.connections <= TOTAL
        pushed, fallbacks = received_bytes(decode, "receive"), decode.metrics_fallbacks
        prompt = [(i * 7919) % 250 + 3 for i in range(90)]
        assert len(generate(mesh, prompt, "always")) == 8
        assert decode.metrics_fallbacks == fallbacks  # pushed, not recomputed
        assert received_bytes(decode, "receive") > pushed
        assert server.connections <= TOTAL
    finally:
        for s in flood:
            s.close()


async def _eventually(condition, within_s: float = 20.0) -> None:
    from tests.integration.test_transfer import eventually

    await eventually(condition, within_s)
