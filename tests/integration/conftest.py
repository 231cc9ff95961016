"""Fixtures shared by integration tests: real processes on 127.0.0.1."""

import asyncio
import contextlib
from collections.abc import Iterator

import nats
import pytest
from kvmesh.bus.nats_server import NatsServer

_server: list[NatsServer] = []  # the session's server, once a test asked for it


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One real nats-server (JetStream on) for the whole session; give each test its own cluster name
    (``kvmesh.bus.Subjects(<unique>)``) so subjects and streams do not collide."""
    state = tmp_path_factory.mktemp("nats")
    # Every events stream reserves its byte limit (1 GiB) of JetStream's storage, which defaults to 75% of the free
    # disk: on a runner with little free disk a module's streams run out of reservations ("insufficient storage
    # resources available") though they write kilobytes. The limit is accounting, not space: set it past need.
    config = state / "nats.conf"
    config.write_text("jetstream { max_file_store: 1T }\n")
    with NatsServer(state, config=config) as server:
        _server.append(server)
        yield server
        _server.clear()


@pytest.fixture(scope="module", autouse=True)
def _drop_streams_after_module() -> Iterator[None]:
    """Delete a module's streams when it ends: the session's server keeps what they stored on disk until then
    (their reservations no longer run out: the server's store limit is set past need, above)."""
    yield
    if _server and _server[0].running:
        asyncio.run(_delete_streams(_server[0].url))


async def _delete_streams(url: str) -> None:
    with contextlib.suppress(Exception):
        nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
        try:
            js = nc.jetstream()
            for info in await js.streams_info():
                await js.delete_stream(info.config.name)
        finally:
            await nc.close()
