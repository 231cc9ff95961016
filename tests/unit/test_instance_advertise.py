"""An engine instance advertises (heartbeats, the pool's pushes to it) the address others dial: ``advertise_host``
in place of the host it bound, the ports and the transfer backend's scheme kept."""

from types import SimpleNamespace

import pytest
from kvmesh.instance.host import EngineHost


def advertised(advertise_host: str, address: str) -> str:
    return EngineHost.advertised(SimpleNamespace(cfg=SimpleNamespace(advertise_host=advertise_host)), address)


@pytest.mark.parametrize("bound,expected", [("0.0.0.0:50062", "10.0.0.9:50062"),
                                            ("tcp://0.0.0.0:50063", "tcp://10.0.0.9:50063"), ("", "")])
def test_the_advertised_host_replaces_the_bound_one(bound, expected):
    assert advertised("10.0.0.9", bound) == expected


def test_without_an_advertised_host_the_bound_address_is_advertised():
    assert advertised("", "tcp://127.0.0.1:50063") == "tcp://127.0.0.1:50063"
