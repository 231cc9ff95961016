import socket

import pytest
from kvmesh.bus.nats_server import NatsServer


def test_server_starts_with_jetstream_logs_to_its_state_dir_and_stops(tmp_path):
    with NatsServer(tmp_path) as server:
        with socket.create_connection((server.host, server.port), timeout=2) as s:
            assert b'"jetstream":true' in s.recv(4096)
        assert server.running
    assert not server.running
    assert "Server is ready" in server.log_path.read_text()
    assert (tmp_path / "jetstream").is_dir()


def test_a_taken_port_fails_fast_with_the_log_tail(tmp_path, nats_server):
    with pytest.raises(RuntimeError, match="(?s)exited with code.*address already in use"):
        NatsServer(tmp_path, port=nats_server.port).start()
