import socket

import pytest
from kvmesh.bus.nats_server import NatsServer
from kvmesh.ready import PortInUse


def test_server_starts_with_jetstream_logs_to_its_state_dir_and_stops(tmp_path):
    with NatsServer(tmp_path) as server:
        with socket.create_connection((server.host, server.port), timeout=2) as s:
            assert b'"jetstream":true' in s.recv(4096)
        assert server.running
    assert not server.running
    assert "Server is ready" in server.log_path.read_text()
    assert (tmp_path / "jetstream").is_dir()


def test_port_0_binds_a_free_port_and_reports_it(tmp_path):
    with NatsServer(tmp_path, port=0) as server:
        assert server.port > 0 and server.url == f"nats://127.0.0.1:{server.port}"
        assert f"Listening for client connections on 127.0.0.1:{server.port}" in server.log_path.read_text()


def test_a_restart_binds_the_same_port_again(tmp_path):
    with NatsServer(tmp_path) as server:
        port = server.port
        server.stop()
        server.start()
        assert server.port == port and server.running


def test_a_taken_port_fails_fast_with_the_log_tail(tmp_path, nats_server):
    with pytest.raises(PortInUse, match=f"(?s)NATS port {nats_server.port} is in use.*address already in use"):
        NatsServer(tmp_path, port=nats_server.port).start()
