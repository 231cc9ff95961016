"""docker/entrypoint.py without Docker: secrets from files, the container-specific settings it fills in, and a
bad setting stopping the container before the service starts."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENTRYPOINT = Path(__file__).resolve().parents[2] / "docker" / "entrypoint.py"
spec = importlib.util.spec_from_file_location("kvmesh_entrypoint", ENTRYPOINT)
entrypoint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(entrypoint)


def test_a_secret_file_becomes_the_variable(tmp_path):
    (tmp_path / "key").write_text("sk-123\n")
    env = {"KVMESH_ROUTER_API_KEY_FILE": str(tmp_path / "key"), "OTHER_FILE": "/nope"}
    entrypoint.read_secret_files(env)
    assert env == {"KVMESH_ROUTER_API_KEY": "sk-123", "OTHER_FILE": "/nope"}


def test_a_missing_secret_file_stops_with_what_to_fix(capsys):
    with pytest.raises(SystemExit) as exit_:
        entrypoint.read_secret_files({"KVMESH_ROUTER_API_KEY_FILE": "/run/secrets/none"})
    assert exit_.value.code == 2
    assert "KVMESH_ROUTER_API_KEY_FILE='/run/secrets/none': cannot read the secret file" in capsys.readouterr().err


def test_an_engine_on_port_0_is_checked_through_its_ready_file_and_gets_a_unique_instance_id():
    env = {"KVMESH_INSTANCE_HOST": "127.0.0.1", "KVMESH_INSTANCE_PORT": "0"}
    address = entrypoint.prepare_service("decode", ["--role", "decode"], env)
    assert env["KVMESH_INSTANCE_PORT"] == "0"  # no port picked here: the engine binds one and reports it
    assert address == "ready:///tmp/kvmesh-ready.json" and env["KVMESH_READY_FILE"] == "/tmp/kvmesh-ready.json"
    assert env["KVMESH_INSTANCE_ID"].startswith("decode-")
    other = {"KVMESH_INSTANCE_HOST": "127.0.0.1", "KVMESH_INSTANCE_PORT": "0"}
    entrypoint.prepare_service("decode", ["--role", "decode"], other)
    assert other["KVMESH_INSTANCE_ID"] != env["KVMESH_INSTANCE_ID"]


def test_an_engine_on_a_fixed_port_is_checked_there():
    env = {"KVMESH_INSTANCE_HOST": "0.0.0.0", "KVMESH_INSTANCE_PORT": "50123"}
    assert entrypoint.prepare_service("prefill", [], env) == "grpc://127.0.0.1:50123"
    assert env["KVMESH_INSTANCE_ID"].endswith("-50123")


def test_the_router_is_checked_on_its_grpc_port_through_loopback():
    env = {"KVMESH_ROUTER_HOST": "0.0.0.0", "KVMESH_ROUTER_GRPC_PORT": "50999"}
    assert entrypoint.prepare_service("router", [], env) == "grpc://127.0.0.1:50999"
    assert env["HEALTHCHECK_TLS"] == "none"  # the clients' port: plaintext here, whatever mesh certificate it has
    assert entrypoint.nats_address(["nats-server", "-c", "x.conf", "-a", "127.0.0.1", "-p", "4333"]) == \
        "nats://127.0.0.1:4333"


def test_a_bad_setting_stops_the_container_before_the_service_starts():
    out = subprocess.run([sys.executable, str(ENTRYPOINT), sys.executable, "-m", "services.cachesvc"],
                         env={"KVMESH_CACHESVC_POOL_CAPACITY_MB": "lots", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": os.environ.get("PYTHONPATH", "")},  # this checkout's code
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "bad settings for cachesvc: KVMESH_CACHESVC_POOL_CAPACITY_MB='lots': Input should be a valid integer" \
        in out.stderr


def test_an_old_variable_stops_the_container_naming_its_replacement():
    out = subprocess.run([sys.executable, str(ENTRYPOINT), sys.executable, "-m", "services.router"],
                         env={"KVMESH_HOST": "auto", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "KVMESH_HOST is no longer read: set KVMESH_INSTANCE_HOST (instance) or KVMESH_ROUTER_HOST" in out.stderr


def test_the_healthcheck_reads_the_grpc_address_from_a_ready_file(tmp_path):
    hc_spec = importlib.util.spec_from_file_location("kvmesh_healthcheck", ENTRYPOINT.parent / "healthcheck.py")
    healthcheck = importlib.util.module_from_spec(hc_spec)
    hc_spec.loader.exec_module(healthcheck)
    ready = tmp_path / "ready.json"
    with pytest.raises(RuntimeError, match="not ready yet"):
        healthcheck.ready_grpc_address(str(ready))
    ready.write_text('{"service": "decode-x", "pid": 1, "endpoints": {"grpc": "0.0.0.0:41234"}}')
    assert healthcheck.ready_grpc_address(str(ready)) == "127.0.0.1:41234"
