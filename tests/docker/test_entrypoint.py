"""docker/entrypoint.py without Docker: secrets from files, the container-specific settings it fills in, and a
bad setting stopping the container before the service starts."""

from __future__ import annotations

import importlib.util
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
    env = {"KVMESH_API_KEY_FILE": str(tmp_path / "key"), "OTHER_FILE": "/nope"}
    entrypoint.read_secret_files(env)
    assert env == {"KVMESH_API_KEY": "sk-123", "OTHER_FILE": "/nope"}


def test_a_missing_secret_file_stops_with_what_to_fix(capsys):
    with pytest.raises(SystemExit) as exit_:
        entrypoint.read_secret_files({"NATS_WORKER_PASSWORD_FILE": "/run/secrets/none"})
    assert exit_.value.code == 2
    assert "NATS_WORKER_PASSWORD_FILE='/run/secrets/none': cannot read the secret file" in capsys.readouterr().err


def test_an_engine_gets_its_address_a_port_and_a_unique_instance_id():
    env = {"KVMESH_HOST": "127.0.0.1", "KVMESH_PORT": "0"}
    address = entrypoint.prepare_service("decode", ["--role", "decode"], env)
    port = int(env["KVMESH_PORT"])
    assert port > 0 and address == f"grpc://127.0.0.1:{port}"
    assert env["KVMESH_INSTANCE_ID"].startswith("decode-") and env["KVMESH_INSTANCE_ID"].endswith(f"-{port}")


def test_the_router_is_checked_on_its_grpc_port_through_loopback():
    env = {"KVMESH_HOST": "0.0.0.0", "KVMESH_GRPC_PORT": "50999"}
    assert entrypoint.prepare_service("router", [], env) == "grpc://127.0.0.1:50999"
    assert entrypoint.nats_address(["nats-server", "-c", "x.conf", "-a", "127.0.0.1", "-p", "4333"]) == \
        "nats://127.0.0.1:4333"


def test_a_bad_setting_stops_the_container_before_the_service_starts():
    out = subprocess.run([sys.executable, str(ENTRYPOINT), sys.executable, "-m", "services.cachesvc"],
                         env={"KVMESH_POOL_CAPACITY_MB": "lots", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "bad settings for cachesvc: KVMESH_POOL_CAPACITY_MB='lots': expected an integer" in out.stderr
