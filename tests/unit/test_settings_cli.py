"""The settings wired to the entry points: generated flags, an unknown or renamed variable stopping a service at
start (exit 2, no traceback), `kvmesh config show`, what `kvmesh up` hands its children, the README's pointer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvmesh import settings
from kvmesh.settings import SettingsError

from app.cli import main as kvmesh_main
from app.launcher import Stack, StackOptions

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = ["services.router", "services.cachesvc", "services.prefill", "services.decode", "app.both"]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    return {**env, **extra}


def _run(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_an_old_variable_stops_every_entry_point_naming_its_replacement(module):
    out = _run(["-m", module], _clean_env(KVMESH_TRACE_FILE="/tmp/x.jsonl"))
    assert out.returncode == 2, out.stderr
    assert "KVMESH_TRACE_FILE is no longer read: set KVMESH_TELEMETRY_TRACE_FILE (telemetry)" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_bad_flag_value_stops_with_where_it_came_from():
    out = _run(["-m", "services.cachesvc", "--pool-eviction", "mru"], _clean_env())
    assert out.returncode == 2 and "invalid choice: 'mru'" in out.stderr and "Traceback" not in out.stderr
    out = _run(["-m", "services.router"], _clean_env(KVMESH_ROUTER_SLO_TTFT_S="-1"))
    assert out.returncode == 2 and "slo_ttft_s must be >= 0" in out.stderr
    assert "KVMESH_ROUTER_SLO_TTFT_S" in out.stderr and "Traceback" not in out.stderr


def test_an_engine_asked_for_another_role_names_the_entry_point():
    out = _run(["-m", "services.prefill", "--role", "decode"], _clean_env())
    assert out.returncode == 2 and "python -m services.decode" in out.stderr


@pytest.mark.parametrize("module,sections", [("services.router", ("router", "telemetry")),
                                             ("services.cachesvc", ("cachesvc", "telemetry")),
                                             ("services.decode", ("instance", "engine", "telemetry"))])
def test_each_entry_point_has_a_flag_for_every_field_it_reads(module, sections):
    out = _run(["-m", module, "--help"], _clean_env())
    assert out.returncode == 0, out.stderr
    for section in ("shared", *sections):
        for field in settings.SECTIONS[section].model_fields:
            assert settings.flag_name(section, field) in out.stdout, (module, section, field)


def test_config_show_json_has_every_section_and_no_variable_in_two():
    out = _run(["-m", "app", "config", "show", "--json"], _clean_env(KVMESH_INSTANCE_PORT="50061"))
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert set(shown) == set(settings.SECTIONS)
    names = [item["env"] for fields in shown.values() for item in fields.values()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for section, fields in shown.items():
        for field, item in fields.items():
            assert set(item) == {"value", "source", "env"}
            assert item["env"] == settings.SECTIONS[section].env_name(field)
    assert shown["instance"]["port"] == {"value": 50061, "source": "env", "env": "KVMESH_INSTANCE_PORT"}


def test_config_show_prints_each_value_with_its_source(tmp_path, monkeypatch, capsys):
    path = tmp_path / "kvmesh.toml"
    path.write_text("[instance]\nheartbeat_s = 2.5\n")
    monkeypatch.setenv("KVMESH_INSTANCE_PORT", "50061")
    assert kvmesh_main(["config", "show", "--service", "prefill", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r'^role +=  ?"prefill" +# default$', out, re.MULTILINE), out
    assert re.search(r"^port += 50061 +# env KVMESH_INSTANCE_PORT$", out, re.MULTILINE)
    assert re.search(r"^heartbeat_s += 2.5 +# file$", out, re.MULTILINE)
    assert "[shared]" in out and "[engine]" in out and "[telemetry]" in out and "[router]" not in out


def test_config_show_masks_secrets(monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_NATS_URL", "nats://router:hunter2@nats:4222")
    monkeypatch.setenv("KVMESH_ROUTER_API_KEY", "sk-secret")
    assert kvmesh_main(["config", "show", "--service", "router", "--json"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "sk-secret" not in out
    shown = json.loads(out)
    assert shown["shared"]["nats_url"]["value"] == "nats://router:***@nats:4222"
    assert shown["router"]["api_key"]["value"] == "***"


def test_config_show_rejects_a_bad_value_or_an_old_name(monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_INSTANCE_HEARTBEAT_S", "soon")
    assert kvmesh_main(["config", "show", "--service", "instance"]) == 2
    assert "KVMESH_INSTANCE_HEARTBEAT_S='soon'" in capsys.readouterr().err
    monkeypatch.delenv("KVMESH_INSTANCE_HEARTBEAT_S")
    monkeypatch.setenv("KVMESH_PORT", "1")
    assert kvmesh_main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert "KVMESH_PORT is no longer read" in err and "KVMESH_INSTANCE_PORT" in err


def test_load_service_applies_flags_like_the_service_does():
    loaded = settings.load_entry_point("decode", ["--port", "2", "--threads", "3"], {"KVMESH_INSTANCE_PORT": "1"})
    assert (loaded.instance.role, loaded.instance.port, loaded.engine.threads) == ("decode", 2, 3)
    assert loaded.sources["instance"]["port"].kind == "flag"
    with pytest.raises(ValueError, match="--port"):
        settings.load_entry_point("cachesvc", ["--port", "x"], {})


def test_kvmesh_up_hands_its_children_the_new_names(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("KVMESH_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVMESH_ROUTER_POLICY", "round_robin")  # inherited as it is
    opts = StackOptions.local("t", settings={"engine": {"threads": 2, "model": "/m"}},
                              env={"KVMESH_INSTANCE_KV_TIMEOUT_S": "3"})
    stack = Stack(tmp_path, opts)
    env = stack.child_env
    assert env["KVMESH_TELEMETRY_TRACE_FILE"] == str(tmp_path / "traces.jsonl")
    assert env["KVMESH_ENGINE_THREADS"] == "2" and env["KVMESH_CLUSTER"] == "t"
    assert env["KVMESH_ROUTER_HTTP_PORT"] == "0" and env["KVMESH_CACHESVC_PORT"] == "0"
    assert "KVMESH_ROUTER_POLICY" not in env and "KVMESH_INSTANCE_KV_TIMEOUT_S" not in env  # from the env
    assert all(k in settings.env_names() for k in env), sorted(set(env) - set(settings.env_names()))


def test_kvmesh_up_stops_on_a_bad_setting_before_starting_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_HTTP_PORT", "8001")
    with pytest.raises(SettingsError, match="KVMESH_ROUTER_HTTP_PORT"):
        Stack(tmp_path, StackOptions())
    assert kvmesh_main(["up", "--state-dir", str(tmp_path)]) == 2
    assert "KVMESH_HTTP_PORT is no longer read" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_kvmesh_up_flags_are_the_settings_prefixed_by_section(capsys):
    with pytest.raises(SystemExit):
        kvmesh_main(["up", "--help"])
    out = capsys.readouterr().out
    for flag in ("--router-http-port", "--engine-model", "--instance-transfer-backend", "--cachesvc-pool-eviction",
                 "--telemetry-trace-file", "--cluster", "--nats-url", "--prefill", "--both", "--state-dir"):
        assert flag in out, flag
    assert "--instance-id" not in out and "--ready-file" not in out  # the launcher sets those per child


def test_the_readme_points_to_the_generated_reference_for_every_knob():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    assert "docs/configuration.md" in section and "python -m kvmesh.settings reference" in section
    known = settings.env_names()
    for name in set(re.findall(r"\bKVMESH_[A-Z0-9_]*[A-Z0-9]\b", text)):
        old = name in settings.RENAMED and f"{name} is no longer read" in text  # the example of the message
        assert name in known or name in settings.NOT_SETTINGS or old, f"README names {name}, which is no setting"


def test_kvmesh_up_gives_each_cachesvc_shard_its_number_ports_and_disk_directory(tmp_path, capsys):
    from kvmesh.settings import CacheServiceSettings

    from app.launcher import _cache_shards

    assert _cache_shards(1, CacheServiceSettings(port=50060)) == [("cachesvc", {})]
    shards = _cache_shards(3, CacheServiceSettings(port=50060, transfer_port=0, metrics_port=9400,
                                                   disk_dir=str(tmp_path / "disk")))
    assert [name for name, _ in shards] == ["cachesvc-0", "cachesvc-1", "cachesvc-2"]
    env = dict(shards)["cachesvc-2"]
    assert env["KVMESH_CACHESVC_SHARD"] == "2" and env["KVMESH_CACHESVC_SHARDS"] == "3"
    assert env["KVMESH_CACHESVC_PORT"] == "50062" and env["KVMESH_CACHESVC_METRICS_PORT"] == "9402"
    assert "KVMESH_CACHESVC_TRANSFER_PORT" not in env  # 0 stays any free port
    assert env["KVMESH_CACHESVC_DISK_DIR"] == str(tmp_path / "disk" / "cachesvc-2")
    with pytest.raises(ValueError, match="--cachesvc must be at least 1"):
        Stack(tmp_path, StackOptions.local("t", cachesvc=0))
    with pytest.raises(SystemExit):
        kvmesh_main(["up", "--help"])
    assert "--cachesvc N" in capsys.readouterr().out
