"""CacheServiceConfig: defaults < [cachesvc] table of a TOML file < KVMESH_<FIELD> < explicit values."""

import pytest

from services.cachesvc.config import CacheServiceConfig, load_config


def test_defaults():
    cfg = load_config(env={})
    assert cfg == CacheServiceConfig()
    assert (cfg.cluster, cfg.host, cfg.port, cfg.durable_name, cfg.pool_capacity_mb, cfg.eviction,
            cfg.instance_timeout_s) == ("local", "127.0.0.1", 50060, "cachesvc", 256, "lru", 5.0)


def test_the_disk_tier_is_off_until_it_has_a_directory():
    cfg = load_config(env={"KVMESH_DISK_DIR": "/var/lib/kvmesh/pool", "KVMESH_DISK_CAPACITY_MB": "2048"})
    assert (cfg.disk_dir, cfg.disk_capacity_mb, cfg.disk_segment_mb) == ("/var/lib/kvmesh/pool", 2048, 64)
    assert CacheServiceConfig().disk_dir == ""


def test_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "kvmesh.toml"
    path.write_text('[cachesvc]\nport = 7000\ncluster = "file"\neviction = "slru"\n')
    cfg = load_config(path, env={"KVMESH_PORT": "7001", "KVMESH_INSTANCE_TIMEOUT_S": "2.5"}, cluster="flag")
    assert (cfg.port, cfg.cluster, cfg.eviction, cfg.instance_timeout_s) == (7001, "flag", "slru", 2.5)


@pytest.mark.parametrize("bad, message", [
    ({"eviction": "mru"}, "eviction 'mru' is unknown"),
    ({"cluster": "a.b"}, "cluster name 'a.b' is invalid"),
    ({"instance_timeout_s": 0}, "instance_timeout_s must be > 0"),
    ({"durable_name": "a.b"}, "durable_name 'a.b' must be"),
    ({"disk_dir": "/tmp/x", "disk_capacity_mb": 10, "disk_segment_mb": 64},
     r"disk_segment_mb \(64\) must be in \[1, disk_capacity_mb \(10\)\]"),
    ({"max_lease_s": 0}, "max_lease_s and snapshot_timeout_s must be > 0"),
    ({"external": "redis"}, "external 'redis' is not supported"),
    ({"external": "mooncake", "mooncake_segment_mb": 8}, r"mooncake_segment_mb 0 \(lend none\) or >= 16"),
    ({"mooncake_manifest_s": 0}, "mooncake_manifest_s must be > 0 seconds, got 0"),
    ({"transfer_backend": "rdma"}, "transfer_backend 'rdma' is not one of tcp, shm, mooncake"),
    ({"transfer_port": 70000}, r"transfer_port must be in \[0, 65535\]"),
    ({"transfer_timeout_s": 0}, "transfer_timeout_s must be > 0"),
])
def test_bad_settings_say_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        load_config(env={}, **bad)


def test_mooncake_may_lend_no_memory_so_its_blocks_outlive_cachesvc():
    cfg = load_config(env={"KVMESH_EXTERNAL": "mooncake", "KVMESH_MOONCAKE_SEGMENT_MB": "0",
                           "KVMESH_MOONCAKE_MANIFEST_S": "2.5"})
    assert (cfg.mooncake_segment_mb, cfg.mooncake_manifest_s) == (0, 2.5)
    assert CacheServiceConfig().mooncake_manifest_s == 5.0
