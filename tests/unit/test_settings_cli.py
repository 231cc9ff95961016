"""Typed settings: file + environment loading with clear errors, validation at start, `kvmesh config show`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kvmesh import config
from kvmesh.config import EngineConfig
from kvmesh.instance.config import WorkerConfig
from kvmesh.telemetry.config import TelemetryConfig

from app import config_show
from app.cli import main as kvmesh_main

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("key,value,expected", [
    ("KVMESH_BLOCK_SIZE", "abc", "KVMESH_BLOCK_SIZE='abc': expected an integer"),
    ("KVMESH_ENABLE_PREFIX_CACHING", "ture", "KVMESH_ENABLE_PREFIX_CACHING='ture': expected a boolean"),
])
def test_a_bad_environment_value_names_the_variable_and_what_it_expects(key, value, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        config.load(EngineConfig, env={key: value})


def test_environment_values_are_typed_and_empty_numbers_mean_unset():
    cfg = config.load(EngineConfig, env={"KVMESH_BLOCK_SIZE": " 32 ", "KVMESH_ENABLE_PREFIX_CACHING": "off",
                                         "KVMESH_THREADS": "", "KVMESH_MODEL": ""})
    assert (cfg.block_size, cfg.enable_prefix_caching, cfg.threads, cfg.model) == (32, False, 1, None)
    assert config.load(TelemetryConfig, env={"KVMESH_TRACE_SAMPLE_RATIO": "0.25"}).trace_sample_ratio == 0.25


def test_a_file_value_of_the_wrong_type_says_where_it_is(tmp_path):
    path = tmp_path / "kvmesh.toml"
    path.write_text('[engine]\nblock_size = "16"\n')
    expected = f"{path} [engine]: block_size = '16': expected an integer"
    with pytest.raises(ValueError, match=re.escape(expected)):
        config.load(EngineConfig, path, env={}, section="engine")


def test_an_unknown_file_setting_is_named_with_the_known_ones(tmp_path):
    path = tmp_path / "kvmesh.toml"
    path.write_text("[worker]\nports = 1\n")
    with pytest.raises(ValueError, match=r"unknown settings \['ports'\]; WorkerConfig has \[.*'port'"):
        config.load(WorkerConfig, path, env={}, section="worker")


@pytest.mark.parametrize("cls,changes,message", [
    (EngineConfig, {"dtype": "fp64"}, "dtype 'fp64' is unknown; choose one of"),
    (EngineConfig, {"eviction": "mru"}, "eviction 'mru' is unknown"),
    (EngineConfig, {"device": "tpu"}, "device must be cpu, cuda or cuda:<index>"),
    (EngineConfig, {"block_size": 0}, "block_size must be >= 1"),
    (EngineConfig, {"kv_cache_mb": 0}, "kv_cache_mb must be >= 1 (or set num_blocks)"),
    (WorkerConfig, {"transfer_backend": "rdma"}, "transfer_backend must be one of"),
    (WorkerConfig, {"port": 70000}, "port must be in [0, 65535]"),
    (WorkerConfig, {"nats_url": "127.0.0.1:4222"}, "nats_url must look like nats://host:port"),
    (WorkerConfig, {"cluster": "a.b"}, "cluster name 'a.b' is invalid"),
    (WorkerConfig, {"instance_id": "p 1"}, "instance_id 'p 1' is not a valid NATS subject token"),
    (WorkerConfig, {"heartbeat_s": 0.0}, "heartbeat_s must be > 0"),
    (TelemetryConfig, {"trace_flush_ms": 0}, "trace_flush_ms must be >= 1"),
])
def test_an_out_of_range_setting_fails_at_start_with_what_to_set(cls, changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**changes)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValueError, match="block_size must be >= 1.*max_num_seqs must be >= 1"):
        EngineConfig(block_size=0, max_num_seqs=0)


def test_config_show_prints_each_value_with_its_source(tmp_path, monkeypatch, capsys):
    path = tmp_path / "kvmesh.toml"
    path.write_text("[worker]\nheartbeat_s = 2.5\n")
    monkeypatch.setenv("KVMESH_PORT", "50061")
    assert kvmesh_main(["config", "show", "--service", "prefill", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r'^role +=  ?"prefill" +# default$', out, re.MULTILINE), out
    assert re.search(r"^port += 50061 +# env KVMESH_PORT$", out, re.MULTILINE)
    assert re.search(r"^heartbeat_s += 2.5 +# file$", out, re.MULTILINE)
    assert "[engine]" in out and "[telemetry]" in out and "[router]" not in out


def test_config_show_masks_secrets(monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_NATS_URL", "nats://router:hunter2@nats:4222")
    monkeypatch.setenv("KVMESH_API_KEY", "sk-secret")
    assert kvmesh_main(["config", "show", "--service", "router", "--json"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "sk-secret" not in out
    router = json.loads(out)["router"]
    assert router["nats_url"] == "nats://router:***@nats:4222" and router["api_key"] == "***"


def test_config_show_rejects_a_bad_value_with_its_message(monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_HEARTBEAT_S", "soon")
    assert kvmesh_main(["config", "show", "--service", "worker"]) == 2
    assert "kvmesh config: KVMESH_HEARTBEAT_S='soon': expected a number" in capsys.readouterr().err


def test_load_service_applies_flags_like_the_service_does():
    loaded = config_show.load_service("decode", None, {"KVMESH_PORT": "1"}, {"port": "2", "threads": "3"})
    assert (loaded["worker"].role, loaded["worker"].port, loaded["engine"].threads) == ("decode", 2, 3)
    with pytest.raises(ValueError, match="--port='x': expected an integer"):
        config_show.load_service("cachesvc", None, {}, {"port": "x"})


def test_every_setting_is_documented_in_the_readme():
    text = README.read_text()
    for section in config_show.SECTIONS:
        assert f"**`[{section}]`**" in text, f"README has no **`[{section}]`** table"
        block = re.split(r"\n\*\*`\[|\n## ", text.split(f"**`[{section}]`**", 1)[1], maxsplit=1)[0]
        missing = [n for n in config_show.field_names(section) if f"`{n}`" not in block]
        assert not missing, f"README's [{section}] table lacks {missing}"

