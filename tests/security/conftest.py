"""One real stack for the attack suite: ``kvmesh up``'s launcher with its default settings (mesh TLS on: a CA and a
certificate per service in the state directory, every internal call authorised by role), the tiny random model,
real processes, real gRPC, real nats-server, every port a free one."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from kvmesh import tls
from kvmesh.bus import Bus
from kvmesh.identity import MeshRole

from app.launcher import Stack, StackOptions
from tests.integration.test_router_bad_input import tiny_model_dir

# two tenants and the admin: the router's keys (every other setting is the default)
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
ADMIN_KEY = "sk-admin"


def auth(key: str = "sk-alice") -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = tiny_model_dir(tmp_path_factory.mktemp("model"))
    s = Stack(tmp_path_factory.mktemp("secure"), StackOptions.local("secure", settings={
        "engine": {"model": str(model)}, "instance": {"kv_timeout_s": 20.0},
        "router": {"api_keys": KEYS, "admin_key": ADMIN_KEY}}))
    s.start(timeout_s=180)
    yield s
    s.stop()


def channel(stack: Stack, address: str, role: MeshRole | None, instance: str = "attacker") -> grpc.Channel:
    """A channel to ``address`` holding the mesh certificate of ``role`` (None: plaintext)."""
    if role is None:
        return grpc.insecure_channel(address)
    return tls.channel(address, cfg=stack.mesh_settings(role, instance))


async def bus(stack: Stack, role: MeshRole | None, instance: str = "attacker", **kw: float) -> Bus:
    """A NATS connection to the stack's server holding the mesh certificate of ``role/instance`` (None: none);
    the stack's own instance names (``prefill-0``) get those instances' NATS permissions."""
    creds = None if role is None else tls.bus_tls(stack.mesh_settings(role, instance))
    return await Bus.connect(stack.info().nats_url, f"{role}-{instance}", tls=creds, **kw)
