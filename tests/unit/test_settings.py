"""kvmesh.settings: one section per service plus shared, each variable in one section, defaults < file < env <
flags, unknown names stop with their replacement, bad values name their source, flags generated from fields."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from kvmesh import settings
from kvmesh.contracts.ids import Role, TransferBackend, choices
from kvmesh.contracts.names import DisaggregationMode, Eviction, RoutingPolicy
from kvmesh.settings import SECTIONS, SettingsError

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvmesh.toml"
    path.write_text(text)
    return path


def test_no_environment_variable_is_in_two_sections():
    owners: dict[str, list[str]] = {}
    for name, cls in SECTIONS.items():
        for field in cls.model_fields:
            owners.setdefault(cls.env_name(field), []).append(f"{name}.{field}")
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}
    assert len(settings.env_names()) == sum(len(c.model_fields) for c in SECTIONS.values())
    assert not settings.NOT_SETTINGS & set(owners)


def test_variable_names_follow_the_section():
    names = settings.env_names()
    assert names["KVMESH_CLUSTER"] == ("shared", "cluster")
    assert names["KVMESH_NATS_URL"] == ("shared", "nats_url")
    assert names["KVMESH_TLS_CERT"] == ("shared", "tls_cert")
    assert names["KVMESH_ENGINE_EVICTION"] == ("engine", "eviction")
    assert names["KVMESH_CACHESVC_POOL_EVICTION"] == ("cachesvc", "pool_eviction")
    assert names["KVMESH_INSTANCE_PORT"] == ("instance", "port")
    assert names["KVMESH_CACHESVC_PORT"] == ("cachesvc", "port")
    for section, cls in SECTIONS.items():
        prefix = "KVMESH_" if section == "shared" else f"KVMESH_{section.upper()}_"
        assert all(cls.env_name(f) == prefix + f.upper() for f in cls.model_fields)


def test_precedence_default_file_env_flag(tmp_path):
    path = write(tmp_path, "[engine]\nblock_size = 32\nthreads = 2\nmax_num_seqs = 8\n")
    env = {"KVMESH_ENGINE_THREADS": "3", "KVMESH_ENGINE_MAX_NUM_SEQS": "9"}
    cfg = settings.load(["engine"], path=path, env=env, overrides={"engine": {"max_num_seqs": 10, "dtype": None}})
    assert (cfg.engine.kv_cache_mb, cfg.engine.block_size, cfg.engine.threads, cfg.engine.max_num_seqs) == \
        (512, 32, 3, 10)
    kinds = {f: cfg.sources["engine"][f].kind for f in ("kv_cache_mb", "block_size", "threads", "max_num_seqs",
                                                        "dtype")}
    assert kinds == {"kv_cache_mb": "default", "block_size": "file", "threads": "env", "max_num_seqs": "flag",
                     "dtype": "default"}


def test_entry_point_defaults_sit_under_the_file():
    cfg = settings.load(["instance"], env={}, defaults={"instance": {"role": "prefill"}})
    assert cfg.instance.role == "prefill" and cfg.sources["instance"]["role"].kind == "default"
    cfg = settings.load(["instance"], env={"KVMESH_INSTANCE_ROLE": "decode"},
                        defaults={"instance": {"role": "prefill"}})
    assert cfg.instance.role == "decode"


def test_each_section_reads_only_its_own_variables():
    cfg = settings.load(env={"KVMESH_ENGINE_EVICTION": "lfu", "KVMESH_INSTANCE_PORT": "7001"})
    assert cfg.engine.eviction == "lfu" and cfg.cachesvc.pool_eviction == "lru"
    assert cfg.instance.port == 7001 and cfg.cachesvc.port == 50060
    cfg = settings.load(env={"KVMESH_CACHESVC_POOL_EVICTION": "slru", "KVMESH_CLUSTER": "prod"})
    assert cfg.engine.eviction == "lru" and cfg.cachesvc.pool_eviction == "slru" and cfg.shared.cluster == "prod"


def test_only_the_chosen_sections_and_shared_are_loaded():
    cfg = settings.load(["router"], env={})
    assert list(cfg.sections) == ["shared", "router"]
    with pytest.raises(KeyError, match="was not loaded"):
        cfg.engine  # noqa: B018
    with pytest.raises(ValueError, match=r"unknown settings sections \['worker'\]"):
        settings.load(["worker"], env={})


@pytest.mark.parametrize("old,new", [
    ("KVMESH_EVICTION", "set KVMESH_ENGINE_EVICTION (engine) or KVMESH_CACHESVC_POOL_EVICTION (cachesvc)"),
    ("KVMESH_PORT", "set KVMESH_INSTANCE_PORT (instance) or KVMESH_CACHESVC_PORT (cachesvc)"),
    ("KVMESH_BLOCK_SIZE", "set KVMESH_ENGINE_BLOCK_SIZE (engine) or KVMESH_ROUTER_BLOCK_SIZE (router)"),
    ("KVMESH_THREADS", "set KVMESH_ENGINE_THREADS (engine)"),
    ("KVMESH_API_KEY", "set KVMESH_ROUTER_API_KEY (router)"),
    ("KVMESH_TRACE_FILE", "set KVMESH_TELEMETRY_TRACE_FILE (telemetry)"),
])
def test_an_old_flat_name_stops_with_its_replacement(old, new):
    with pytest.raises(SettingsError, match=re.escape(f"{old} is no longer read: {new}")):
        settings.load(["engine"], env={old: "1"})


def test_every_renamed_variable_points_at_real_ones():
    names = settings.env_names()
    for old, new in settings.RENAMED.items():
        assert old not in names, old
        assert new and all(n in names for n in new), (old, new)


def test_an_unknown_variable_stops_and_others_pass():
    with pytest.raises(SettingsError, match=r"KVMESH_ENGINE_BLOK_SIZE is not a kvmesh setting; did you mean "
                                            r"KVMESH_ENGINE_BLOCK_SIZE\?"):
        settings.load(env={"KVMESH_ENGINE_BLOK_SIZE": "8"})
    ok = {"KVMESH_TAG": "1", "KVMESH_ROUTER_API_KEY_FILE": "/run/secrets/k", "PATH": "/bin", "OTHER_PORT": "1"}
    settings.load(env=ok)
    settings.load(env={"KVMESH_PORT": "1"}, check_env=False)


def test_all_unknown_variables_are_named_at_once():
    with pytest.raises(SettingsError) as info:
        settings.load(env={"KVMESH_PORT": "1", "KVMESH_EVICTION": "lru"})
    assert len(info.value.problems) == 2


def test_an_unknown_file_key_is_named_with_the_known_ones(tmp_path):
    path = write(tmp_path, "[instance]\nports = 1\n")
    with pytest.raises(SettingsError, match=r"\[instance\]: unknown key 'ports'; \[instance\] has \[.*'port'"):
        settings.load(path=path, env={})


def test_a_moved_file_key_or_table_says_where_it_went(tmp_path):
    with pytest.raises(SettingsError, match=r"unknown key 'cluster' \(cluster is in \[shared\]\)"):
        settings.load(path=write(tmp_path, '[router]\ncluster = "x"\n'), env={})
    with pytest.raises(SettingsError, match=r"unknown section \[worker\]; its settings are in \[instance\] now"):
        settings.load(path=write(tmp_path, "[worker]\nport = 1\n"), env={})


def test_a_file_value_of_the_wrong_type_says_where_it_is(tmp_path):
    path = write(tmp_path, '[engine]\nblock_size = "16"\n')
    with pytest.raises(SettingsError, match=re.escape(f"{path} [engine] block_size = '16': Input should be a "
                                                      "valid integer")):
        settings.load(path=path, env={})
    cfg = settings.load(path=write(tmp_path, "[router]\nslo_ttft_s = 2\n"), env={})  # an int is a fine float
    assert cfg.router.slo_ttft_s == 2.0


@pytest.mark.parametrize("env,message", [
    ({"KVMESH_ENGINE_BLOCK_SIZE": "abc"}, "KVMESH_ENGINE_BLOCK_SIZE='abc': Input should be a valid integer"),
    ({"KVMESH_ENGINE_ENABLE_PREFIX_CACHING": "ture"}, ("KVMESH_ENGINE_ENABLE_PREFIX_CACHING='ture': Input should "
                                                      "be a valid boolean")),
    ({"KVMESH_ENGINE_BLOCK_SIZE": "0"}, "block_size must be >= 1, not 0 (from KVMESH_ENGINE_BLOCK_SIZE)"),
    ({"KVMESH_INSTANCE_PORT": "70000"}, ("port must be in [0, 65535] (0 = a free port), not 70000 "
                                        "(from KVMESH_INSTANCE_PORT)")),
    ({"KVMESH_CLUSTER": "a.b"}, "cluster name 'a.b' is invalid"),
    ({"KVMESH_ENGINE_EVICTION": "belady"}, "eviction 'belady' is not one of"),
    ({"KVMESH_CACHESVC_POOL_EVICTION": "mru"}, "pool_eviction 'mru' is not one of"),
    ({"KVMESH_INSTANCE_TRANSFER_BACKEND": "rdma"}, ("transfer_backend 'rdma' is not one of ['tcp', 'shm', "
                                                   "'mooncake'] (from KVMESH_INSTANCE_TRANSFER_BACKEND)")),
    ({"KVMESH_NATS_URL": "127.0.0.1:4222"}, "nats_url must look like nats://host:port"),
    ({"KVMESH_NATS_URL": "nats://a:4222, b:4222"}, ("nats_url must look like nats://host:port (several: "
                                                    "comma-separated), not 'b:4222'")),
    ({"KVMESH_EVENTS_REPLICAS": "7"}, "events_replicas must be 1 to 5 (JetStream's range), not 7"),
    ({"KVMESH_TLS_CERT": "/nope.pem"}, "tls_cert and tls_key go together"),
    ({"KVMESH_ROUTER_POLICY": "fastest"}, "policy 'fastest' is not one of"),
    ({"KVMESH_ROUTER_DISAGGREGATE": "sometimes"}, ("disaggregate 'sometimes' is not one of ['auto', "
                                                  "'always', 'never'] (from KVMESH_ROUTER_DISAGGREGATE)")),
    ({"KVMESH_INSTANCE_ROLE": "cachesvc"}, "role 'cachesvc' is not one of ['prefill', 'decode', 'both']"),
    ({"KVMESH_ENGINE_EVICTION": ""}, "eviction '' is not one of"),
    ({"KVMESH_TELEMETRY_TRACE_SAMPLE_RATIO": "2"}, "trace_sample_ratio must be in [0, 1], not 2.0"),
    ({"KVMESH_INSTANCE_ID": "p 1"}, "id 'p 1' is not a valid NATS subject token"),
])
def test_a_bad_value_names_its_source(env, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        settings.load(env=env)


def test_a_bad_file_or_flag_value_names_it(tmp_path):
    path = write(tmp_path, "[cachesvc]\nmax_lease_s = 0\n")
    with pytest.raises(SettingsError, match=re.escape(f"max_lease_s must be > 0, not 0.0 (from {path} [cachesvc] "
                                                      "max_lease_s)")):
        settings.load(path=path, env={})
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, ["engine"])
    overrides = settings.flag_overrides(parser.parse_args(["--kv-cache-mb", "0"]))
    with pytest.raises(SettingsError, match=re.escape("kv_cache_mb must be >= 1 (or set num_blocks), not 0 "
                                                      "(from --kv-cache-mb)")):
        settings.load(["engine"], env={}, overrides=overrides)


def test_every_problem_is_reported_at_once():
    with pytest.raises(SettingsError) as info:
        settings.load(env={"KVMESH_ENGINE_BLOCK_SIZE": "0", "KVMESH_ROUTER_GRPC_PORT": "-1",
                           "KVMESH_ENGINE_DTYPE": "fp64"})
    assert len(info.value.problems) == 3


def test_environment_values_are_typed_and_empty_numbers_mean_unset():
    cfg = settings.load(env={"KVMESH_ENGINE_BLOCK_SIZE": " 32 ", "KVMESH_ENGINE_ENABLE_PREFIX_CACHING": "off",
                             "KVMESH_ENGINE_THREADS": "", "KVMESH_ENGINE_MODEL": "",
                             "KVMESH_ROUTER_CACHESVC_ADDRESS": "", "KVMESH_ROUTER_API_KEYS": "k1:alice,k2:bob",
                             "KVMESH_LOG_LEVEL": "debug"})
    assert (cfg.engine.block_size, cfg.engine.enable_prefix_caching, cfg.engine.threads, cfg.engine.model) == \
        (32, False, 1, None)
    assert cfg.router.cachesvc_address == "" and cfg.router.api_keys == {"k1": "alice", "k2": "bob"}
    assert cfg.shared.log_level == "DEBUG"


def test_choices_come_from_the_contracts_enums():
    assert settings.InstanceSettings.choices_of("role") == tuple(r.value for r in Role.engines())
    assert Role.CACHESVC.value not in settings.InstanceSettings.choices_of("role")
    for cls in (settings.InstanceSettings, settings.CacheServiceSettings):
        assert cls.choices_of("transfer_backend") == choices(TransferBackend)
    online = tuple(e.value for e in Eviction.online())
    assert settings.EngineSettings.choices_of("eviction") == online
    assert settings.CacheServiceSettings.choices_of("pool_eviction") == online
    assert Eviction.BELADY.value not in settings.EngineSettings.choices_of("eviction")
    assert settings.RouterSettings.choices_of("policy") == tuple(sorted(choices(RoutingPolicy)))
    assert settings.RouterSettings.choices_of("disaggregate") == choices(DisaggregationMode)


def test_named_choices_load_as_their_enums_and_show_as_their_strings(tmp_path):
    path = write(tmp_path, '[engine]\neviction = "slru"\n[router]\npolicy = "round_robin"\n')
    cfg = settings.load(path=path, env={"KVMESH_INSTANCE_ROLE": "decode",
                                        "KVMESH_ROUTER_DISAGGREGATE": "never",
                                        "KVMESH_CACHESVC_TRANSFER_BACKEND": "shm"})
    assert cfg.engine.eviction is Eviction.SLRU and cfg.router.policy is RoutingPolicy.ROUND_ROBIN
    assert cfg.instance.role is Role.DECODE and cfg.router.disaggregate is DisaggregationMode.NEVER
    assert cfg.cachesvc.transfer_backend is TransferBackend.SHM and cfg.cachesvc.pool_eviction is Eviction.LRU
    assert settings.as_env(cfg, kinds=("file", "env"))["KVMESH_ENGINE_EVICTION"] == "slru"
    assert settings.show(path, env={})["router"]["policy"]["value"] == "round_robin"
    with pytest.raises(SettingsError, match=re.escape("[engine] eviction = 3: Input should be a valid "
                                                      "string")):
        settings.load(path=write(tmp_path, "[engine]\neviction = 3\n"), env={})


def test_an_unknown_name_is_listed_with_every_other_problem():
    with pytest.raises(SettingsError) as e:
        settings.load(env={"KVMESH_ROUTER_POLICY": "x", "KVMESH_ROUTER_HTTP_PORT": "-1"})
    assert [p.split()[0] for p in e.value.problems] == ["policy", "http_port"]


def test_the_native_kernels_are_engine_settings_and_the_old_switches_name_them():
    cfg = settings.load(["engine"], env={"KVMESH_ENGINE_NATIVE_GEMM": "0",
                                         "KVMESH_ENGINE_NATIVE_POINTWISE": "false"})
    assert (cfg.engine.native_gemm, cfg.engine.native_pointwise) == (False, False)
    assert (settings.EngineSettings().native_gemm, settings.EngineSettings().native_pointwise) == (True, True)
    for old in ("KVMESH_NATIVE_GEMM", "KVMESH_NATIVE_POINTWISE"):
        new = old.replace("KVMESH_", "KVMESH_ENGINE_")
        with pytest.raises(SettingsError, match=re.escape(f"{old} is no longer read: set {new} (engine)")):
            settings.load(env={old: "0"})


def test_the_fault_knobs_are_marked_test_only_and_read_as_one_value():
    fault_fields = [f for f in settings.InstanceSettings.model_fields if f.startswith("fault_")]
    assert fault_fields and all(settings.InstanceSettings.is_test_only(f) for f in fault_fields)
    assert not any(cls.is_test_only(f) for cls in SECTIONS.values() for f in cls.model_fields
                   if not f.startswith("fault_"))
    lines = {line.split("|")[1].strip(" `"): line for line in settings.reference().splitlines()
             if line.startswith("| `KVMESH_")}
    assert all("**test only" in lines[settings.InstanceSettings.env_name(f)] for f in fault_fields)
    assert settings.InstanceSettings().faults == settings.Faults() and not settings.Faults().on
    cfg = settings.load(["instance"], env={"KVMESH_INSTANCE_FAULT_CORRUPT_PUSHES": "2",
                                           "KVMESH_INSTANCE_FAULT_DROP_KV_READY": "1"})
    assert cfg.instance.faults == settings.Faults(drop_kv_ready=True, corrupt_pushes=2)
    assert cfg.instance.faults.on


def test_a_section_built_directly_is_checked_too():
    with pytest.raises(ValueError, match="invalid engine settings: block_size must be >= 1"):
        settings.EngineSettings(block_size=0)
    assert settings.EngineSettings(block_size=8).block_size == 8
    with pytest.raises(ValueError):
        settings.EngineSettings(blocksize=8)  # extra fields are refused


@pytest.mark.parametrize("env,fix", [
    ({"KVMESH_ENGINE_DEVICE": "cuda", "KVMESH_ENGINE_ATTENTION": "flashinfer"},
     "set dtype=bf16 and kv_dtype=bf16 (or fp8), or attention=torch for fp32"),
    ({"KVMESH_ENGINE_DEVICE": "cuda:1", "KVMESH_ENGINE_ATTENTION": "flashinfer", "KVMESH_ENGINE_DTYPE": "bf16"},
     "kv_dtype=fp32 given"),
    ({"KVMESH_ENGINE_ATTENTION": "flashinfer"}, "runs on CUDA only: set device=cuda, or attention=auto or torch"),
    ({"KVMESH_ENGINE_DEVICE": "cuda", "KVMESH_ENGINE_ATTENTION": "native"}, "on CUDA set attention=auto"),
])
def test_an_attention_backend_the_device_cannot_run_is_refused_at_start_with_the_fix(env, fix):
    with pytest.raises(SettingsError, match=re.escape(fix)):
        settings.load(["engine"], env=env)


@pytest.mark.parametrize("env", [
    {"KVMESH_ENGINE_DEVICE": "cuda"},  # auto: torch attention in fp32
    {"KVMESH_ENGINE_DEVICE": "cuda", "KVMESH_ENGINE_ATTENTION": "flashinfer", "KVMESH_ENGINE_DTYPE": "bf16",
     "KVMESH_ENGINE_KV_DTYPE": "bf16"},
    {"KVMESH_ENGINE_DEVICE": "cuda", "KVMESH_ENGINE_ATTENTION": "flashinfer", "KVMESH_ENGINE_DTYPE": "fp16",
     "KVMESH_ENGINE_KV_DTYPE": "fp8"},
    {"KVMESH_ENGINE_DEVICE": "cuda", "KVMESH_ENGINE_ATTENTION": "torch"},
])
def test_the_cuda_configurations_that_run_are_accepted(env):
    assert settings.load(["engine"], env=env).engine.device.startswith("cuda")


def test_generated_flags_parse_and_override(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    settings.add_flags(parser, ["instance", "engine", "telemetry"])
    args = parser.parse_args(["--port", "7001", "--role", "decode", "--no-enable-prefix-caching", "--threads", "4",
                              "--cluster", "c1", "--kv-timeout-s", "2.5", "--no-tracing"])
    overrides = settings.flag_overrides(args)
    assert overrides == {"instance": {"port": 7001, "role": "decode", "kv_timeout_s": 2.5},
                         "engine": {"enable_prefix_caching": False, "threads": 4},
                         "shared": {"cluster": "c1"}, "telemetry": {"tracing": False}}
    env = {"KVMESH_INSTANCE_PORT": "1", "KVMESH_ENGINE_THREADS": "2"}
    cfg = settings.load(["instance", "engine", "telemetry"], env=env, overrides=overrides)
    assert (cfg.instance.port, cfg.instance.role, cfg.engine.threads, cfg.shared.cluster) == (7001, "decode", 4, "c1")
    assert cfg.sources["instance"]["port"] == settings.Source("flag", "--port")
    assert settings.flag_overrides(parser.parse_args([])) == {}  # unset flags change nothing


def test_generated_flags_have_types_choices_and_help(capsys):
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, ["instance"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--transfer-backend", "rdma"])
    assert "invalid choice: 'rdma'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "x"])
    assert "argument --port: invalid int value: 'x'" in capsys.readouterr().err
    text = parser.format_help()
    assert "KVMESH_INSTANCE_PORT" in text and "gRPC port (0 = a free one" in text and "--nats-url" in text


def test_flags_of_two_sections_with_one_field_name_must_be_prefixed():
    with pytest.raises(ValueError, match="--host would set both instance.host and cachesvc.host"):
        settings.add_flags(argparse.ArgumentParser(), ["instance", "cachesvc"])
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, ["instance", "cachesvc"], prefixed=True)
    overrides = settings.flag_overrides(parser.parse_args(["--instance-port", "1", "--cachesvc-port", "2",
                                                           "--cluster", "x"]), prefixed=True)
    assert overrides == {"instance": {"port": 1}, "cachesvc": {"port": 2}, "shared": {"cluster": "x"}}
    assert overrides.flags[("cachesvc", "port")] == "--cachesvc-port"
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, ["router"], skip=["router.model"])
    assert "--model " not in parser.format_help() and "--model-name" in parser.format_help()


def test_config_show_shape_and_sources(tmp_path):
    path = write(tmp_path, "[router]\nhttp_port = 8100\n")
    env = {"KVMESH_ENGINE_EVICTION": "lfu", "KVMESH_NATS_URL": "nats://router:hunter2@nats:4222",
           "KVMESH_ROUTER_API_KEY": "sk-secret"}
    shown = settings.show(path, env, overrides={"instance": {"port": 7}})
    assert list(shown) == list(SECTIONS)
    for section, fields in shown.items():
        assert list(fields) == list(SECTIONS[section].model_fields)
        for field, entry in fields.items():
            assert set(entry) == {"value", "source", "env"}
            assert entry["env"] == SECTIONS[section].env_name(field)
            assert entry["source"] in ("default", "file", "env", "flag")
    assert shown["engine"]["eviction"] == {"value": "lfu", "source": "env", "env": "KVMESH_ENGINE_EVICTION"}
    assert shown["cachesvc"]["pool_eviction"]["source"] == "default"
    assert shown["router"]["http_port"] == {"value": 8100, "source": "file", "env": "KVMESH_ROUTER_HTTP_PORT"}
    assert shown["instance"]["port"]["source"] == "flag"
    assert shown["shared"]["nats_url"]["value"] == "nats://router:***@nats:4222"
    assert shown["router"]["api_key"]["value"] == "***"
    assert "hunter2" not in json.dumps(shown) and "sk-secret" not in json.dumps(shown)


def test_the_configuration_doc_is_generated_from_the_models():
    text = settings.reference()
    for cls in SECTIONS.values():
        for field in cls.model_fields:
            assert f"`{cls.env_name(field)}`" in text
    assert DOC.read_text() == text, "docs/configuration.md is stale: python -m kvmesh.settings reference > it"


def test_only_the_given_environment_is_read(monkeypatch):
    monkeypatch.setenv("KVMESH_ENGINE_BLOCK_SIZE", "64")
    assert settings.load(["engine"], env={}).engine.block_size == 16
    assert settings.EngineSettings().block_size == 16  # a section built directly: defaults and arguments only
    assert settings.load(["engine"]).engine.block_size == 64  # env=None: os.environ


def test_a_nats_cluster_is_its_servers_comma_separated():
    shared = settings.load(env={"KVMESH_NATS_URL": "nats://a:4222,nats://b:4222", "KVMESH_EVENTS_REPLICAS": "3"})
    assert shared.shared.events_replicas == 3
