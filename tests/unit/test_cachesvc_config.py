"""The cache service's [cachesvc] settings: defaults < its TOML table < KVMESH_CACHESVC_* < flags."""

import pytest
from kvmesh import settings
from kvmesh.settings import CacheServiceSettings


def load(path=None, env=None, **flags):
    return settings.load(["cachesvc"], path=path, env=env or {}, overrides={"cachesvc": flags})


def test_defaults():
    cfg = load()
    assert cfg.cachesvc == CacheServiceSettings()
    assert (cfg.shared.cluster, cfg.cachesvc.host, cfg.cachesvc.port, cfg.cachesvc.durable_name,
            cfg.cachesvc.pool_capacity_mb, cfg.cachesvc.pool_eviction,
            cfg.cachesvc.instance_timeout_s) == ("local", "127.0.0.1", 50060, "cachesvc", 256, "lru", 5.0)


def test_the_disk_tier_is_off_until_it_has_a_directory():
    cfg = load(env={"KVMESH_CACHESVC_DISK_DIR": "/var/lib/kvmesh/pool",
                    "KVMESH_CACHESVC_DISK_CAPACITY_MB": "2048"}).cachesvc
    assert (cfg.disk_dir, cfg.disk_capacity_mb, cfg.disk_segment_mb) == ("/var/lib/kvmesh/pool", 2048, 64)
    assert CacheServiceSettings().disk_dir == ""


def test_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "kvmesh.toml"
    path.write_text('[cachesvc]\nport = 7000\npool_eviction = "slru"\ndurable_name = "file"\n')
    cfg = load(path, {"KVMESH_CACHESVC_PORT": "7001", "KVMESH_CACHESVC_INSTANCE_TIMEOUT_S": "2.5"},
               durable_name="flag").cachesvc
    assert (cfg.port, cfg.durable_name, cfg.pool_eviction, cfg.instance_timeout_s) == (7001, "flag", "slru", 2.5)


@pytest.mark.parametrize("bad, message", [
    ({"pool_eviction": "mru"}, "pool_eviction 'mru' is not one of"),
    ({"instance_timeout_s": 0}, "instance_timeout_s must be > 0"),
    ({"durable_name": "a.b"}, "durable_name 'a.b' must be"),
    ({"disk_dir": "/tmp/x", "disk_capacity_mb": 10, "disk_segment_mb": 64},
     r"disk_segment_mb \(64\) must be in \[1, disk_capacity_mb \(10\)\]"),
    ({"max_lease_s": 0}, "max_lease_s must be > 0"),
    ({"external": "redis"}, "external 'redis' is not one of"),
    ({"external": "mooncake", "mooncake_segment_mb": 8}, r"mooncake_segment_mb must be 0 \(lend none\) or >= 16"),
    ({"mooncake_manifest_s": 0}, "mooncake_manifest_s must be > 0"),
    ({"transfer_backend": "rdma"}, "transfer_backend 'rdma' is not one of"),
    ({"transfer_port": 70000}, r"transfer_port must be in \[0, 65535\]"),
    ({"transfer_timeout_s": 0}, "transfer_timeout_s must be > 0"),
    ({"shard": -1}, r"shard must be in \[0, shards - 1\] = \[0, 0\] \(or shards and more"),
    ({"shard": 1, "shards": 3, "peers": "a:1,b:2"}, "peers lists 2 addresses but shards is 3: list every"),
    ({"shard": 2, "shards": 2, "peers": "a:1,b:2"}, "peers lists 2 addresses but shards is 2 and this is shard 2"),
])
def test_bad_settings_say_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        load(**bad)


def test_mooncake_may_lend_no_memory_so_its_blocks_outlive_cachesvc():
    cfg = load(env={"KVMESH_CACHESVC_EXTERNAL": "mooncake", "KVMESH_CACHESVC_MOONCAKE_SEGMENT_MB": "0",
                    "KVMESH_CACHESVC_MOONCAKE_MANIFEST_S": "2.5"}).cachesvc
    assert (cfg.mooncake_segment_mb, cfg.mooncake_manifest_s) == (0, 2.5)
    assert CacheServiceSettings().mooncake_manifest_s == 5.0


def test_a_shard_at_or_past_the_count_is_leaving_and_peers_list_those_leaving_after_the_shards():
    cfg = load(shard=2, shards=2, peers="a:1,b:2,c:3").cachesvc
    assert cfg.leaving and not load(shard=1, shards=2).cachesvc.leaving
    assert load(shard=0, shards=2, peers="a:1,b:2,c:3").cachesvc.peers == "a:1,b:2,c:3"  # shard 0 asks c too
