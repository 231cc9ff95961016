"""Fixtures shared by integration tests: real processes on 127.0.0.1."""

from collections.abc import Iterator

import pytest

from kvmesh.bus.nats_server import NatsServer


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One real nats-server (JetStream on) for the whole session; give each test its own cluster name
    (``kvmesh.bus.Subjects(<unique>)``) so subjects and streams do not collide."""
    with NatsServer(tmp_path_factory.mktemp("nats")) as server:
        yield server
