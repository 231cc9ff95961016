"""The snapshot wire format (kvmesh.bus.snapshot): chunks that fit the max payload, one tier each."""

import pytest
from kvmesh.bus import Subjects
from kvmesh.bus.snapshot import decode_chunk, encode_snapshot, snapshot_subject


def test_a_snapshot_round_trips_through_its_chunks():
    blocks = [(k, "device") for k in range(1000)] + [(2**64 - 1, "host")]
    chunks = encode_snapshot(42, blocks, max_payload=1024)
    assert all(len(c) <= 1024 for c in chunks) and len(chunks) == 10  # 124 keys per chunk: 9 device + 1 host
    decoded = [decode_chunk(c) for c in chunks]
    assert {(seq, total) for seq, _, total, _, _ in decoded} == {(42, 10)}
    assert [chunk for _, chunk, _, _, _ in decoded] == list(range(10))
    keys: dict[str, list[int]] = {}
    for _, _, _, tier, part in decoded:
        keys.setdefault(tier, []).extend(part)
    assert keys == {"device": list(range(1000)), "host": [2**64 - 1]}


def test_an_empty_snapshot_is_one_chunk_without_keys():
    (chunk,) = encode_snapshot(7, [], max_payload=1024)
    assert decode_chunk(chunk) == (7, 0, 1, "", [])


@pytest.mark.parametrize("data", [b"", b"KVS0" + bytes(30), b"hello world, not a snapshot chunk"])
def test_garbage_is_not_a_chunk(data):
    with pytest.raises(ValueError):
        decode_chunk(data)


def test_the_subject_is_per_instance():
    assert snapshot_subject(Subjects("c1"), "p0") == "kvmesh.c1.kv.snapshot.p0"
    with pytest.raises(ValueError, match="instance 'a.b' is not a valid NATS subject token"):
        snapshot_subject(Subjects("c1"), "a.b")
