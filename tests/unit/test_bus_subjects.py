import pytest
from kvmesh.bus.subjects import Subjects


def test_subjects_share_one_cluster_prefix():
    s = Subjects("prod")
    assert s.kv_ready("decode-0") == "kvmesh.prod.kv.ready.decode-0"
    assert s.kv_events("prefill-1") == "kvmesh.prod.kv.events.prefill-1"
    assert s.kv_events_all == "kvmesh.prod.kv.events.>"
    assert s.heartbeat("decode", "decode-0") == "kvmesh.prod.heartbeat.decode.decode-0"
    assert s.heartbeats_all == "kvmesh.prod.heartbeat.>"


def test_events_stream_name_is_a_valid_jetstream_name():
    assert Subjects("prod-eu_1").events_stream == "KVMESH_prod-eu_1_KV_EVENTS"


@pytest.mark.parametrize("cluster", ["", "a.b", "a b", "a*", "a>", "a/b"])
def test_invalid_cluster_names_are_rejected(cluster):
    with pytest.raises(ValueError, match="cluster name"):
        Subjects(cluster)


@pytest.mark.parametrize("instance", ["", "dec.0", "dec 0", "*", ">", "a\tb"])
def test_invalid_instance_tokens_are_rejected(instance):
    s = Subjects("c")
    for make in (s.kv_ready, s.kv_events, lambda i: s.heartbeat("decode", i)):
        with pytest.raises(ValueError, match="not a valid NATS subject token"):
            make(instance)


def test_invalid_role_token_is_rejected():
    with pytest.raises(ValueError, match="role"):
        Subjects("c").heartbeat("de.code", "d0")


def test_instance_ids_with_colons_and_dashes_are_fine():
    assert Subjects("c").kv_events("host:9000-a") == "kvmesh.c.kv.events.host:9000-a"
