"""The transfer header codec, its version negotiation and the checks a receiver runs on it (no sockets)."""

import json
from dataclasses import replace

import pytest
from kvmesh.contracts.layout import KVLayout, layout_mismatch
from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.header import (
    SPOKEN,
    UNSAID,
    TransferHeader,
    Versions,
    block_checksums,
    corrupt_blocks,
    decode_header,
    encode_header,
    negotiate,
    parse_versions,
)
from kvmesh.transfer.wire import REPLY_PREFIX, Address, Reply, decode_reply, encode_reply, flat_bytes, parse_address

from tests.wire_next import NEXT, NextCodec, Recording

LAYOUT = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def header(**changes) -> TransferHeader:
    h = TransferHeader("req-1", "tcp", LAYOUT, (2**64 - 1, 7), 7, (2**63 + 5, 11, 12), {})
    return replace(h, **changes)


def doc_of(h: TransferHeader) -> dict:
    return json.loads(encode_header(h))


def test_header_round_trips_through_json() -> None:
    h = header(source={"segment": "kvmesh_x"})
    assert decode_header(encode_header(h)) == h


def test_64_bit_keys_and_checksums_travel_as_exact_hex_strings() -> None:
    doc = doc_of(header())
    assert doc["block_keys"][0] == "ffffffffffffffff"
    assert decode_header(encode_header(header())).block_keys[0] == 2**64 - 1


def test_header_states_payload_size_of_all_blocks() -> None:
    assert doc_of(header())["nbytes"] == 3 * LAYOUT.block_nbytes


def test_equal_layouts_have_no_mismatch() -> None:
    assert layout_mismatch(LAYOUT, replace(LAYOUT)) is None


def test_layout_mismatch_names_every_differing_field() -> None:
    other = replace(LAYOUT, dtype="fp16", head_dim=16, tp_rank=1)
    diff = layout_mismatch(LAYOUT, other)
    assert diff is not None
    assert "dtype 'fp16'!='fp32'" in diff and "head_dim 16!=8" in diff and "tp_rank 1!=0" in diff


def test_equal_byte_counts_do_not_make_layouts_equal() -> None:
    other = replace(LAYOUT, block_size=8, num_kv_heads=1)
    assert other.block_nbytes == LAYOUT.block_nbytes
    assert layout_mismatch(LAYOUT, other) is not None


def test_checksums_cover_each_block_separately() -> None:
    data = bytes(range(3 * 64))
    sums = block_checksums(memoryview(data), 64)
    assert len(sums) == 3 and len(set(sums)) == 3


def test_flipped_byte_is_found_in_its_block() -> None:
    data = bytearray(3 * LAYOUT.block_nbytes)
    h = header(checksums=block_checksums(memoryview(data), LAYOUT.block_nbytes))
    data[LAYOUT.block_nbytes + 5] ^= 1
    assert corrupt_blocks(h, memoryview(data)) == [1]


def test_flat_bytes_views_a_typed_buffer_without_copying() -> None:
    import array

    words = array.array("I", [0, 0])
    view = flat_bytes(memoryview(words))
    view[4] = 1
    assert (len(view), words[1]) == (8, 1)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_unparseable_header_is_rejected_as_malformed(raw: bytes) -> None:
    with pytest.raises(TransferRejected, match="malformed header"):
        decode_header(raw)


def test_a_header_version_outside_the_receivers_range_is_refused_naming_both_ranges() -> None:
    doc = doc_of(header()) | {"v": 99, "speaks": "98-99"}
    with pytest.raises(TransferRejected, match=f"unsupported header version 99 \\(the sender speaks 98-99\\); "
                                               f"this receiver speaks {SPOKEN}") as e:
        decode_header(json.dumps(doc).encode())
    assert e.value.kind == Refusal.VERSION


def test_a_header_names_its_senders_versions() -> None:
    assert doc_of(header())["speaks"] == str(SPOKEN)
    assert doc_of(header())["v"] == SPOKEN.high


def test_the_sender_writes_the_highest_version_both_speak() -> None:
    assert negotiate(Versions(2, 3), Versions(2, 2)) == 2   # an N+1 sender, an N receiver
    assert negotiate(Versions(2, 2), Versions(2, 3)) == 2   # an N sender, an N+1 receiver
    assert negotiate(Versions(2, 3), Versions(3, 4)) == 3
    assert negotiate(Versions(2, 4), Versions(1, 9)) == 4


@pytest.mark.parametrize(("ours", "theirs", "upgrade"), [(Versions(2, 2), Versions(3, 4), "this sender"),
                                                         (Versions(3, 4), Versions(2, 2), "the receiver")])
def test_disjoint_ranges_are_refused_naming_both_and_which_end_to_upgrade(ours, theirs, upgrade) -> None:
    with pytest.raises(TransferRejected, match=f"this sender speaks {ours}, the receiver {theirs}; "
                                               f"upgrade {upgrade}") as e:
        negotiate(ours, theirs)
    assert e.value.kind == Refusal.VERSION


def test_a_receiver_that_advertises_nothing_speaks_2_only() -> None:
    assert parse_versions("") == UNSAID == Versions(2, 2)
    assert negotiate(NextCodec.speaks, parse_versions("")) == 2


def test_an_advertised_range_round_trips_as_text() -> None:
    assert parse_versions(str(Versions(2, 3))) == Versions(2, 3)


@pytest.mark.parametrize("text", ["3", "3-2", "a-b", "2-", "-3", "2-3-4"])
def test_a_malformed_range_is_refused_saying_what_one_looks_like(text) -> None:
    with pytest.raises(ValueError, match="'<low>-<high>'"):
        parse_versions(text)


def test_an_n_plus_1_receiver_reads_both_versions_and_uses_the_newer_ones_field() -> None:
    n, n1 = Recording(), NextCodec()
    h = header(token="t")
    assert n1.decode(n1.encode(h, NEXT)) == h and len(n1.sent) == 1
    assert n1.decode(n.encode(h, SPOKEN.high)) == h and len(n1.sent) == 1  # an N header: nothing more to use
    assert [v for v, _ in n1.read] == [NEXT, SPOKEN.high]


def test_an_n_receiver_never_sees_the_newer_field_and_refuses_the_newer_version() -> None:
    n, n1 = Recording(), NextCodec()
    assert n.decode(n1.encode(header(), negotiate(n1.speaks, n.speaks))) == header()
    assert "sent_ns" not in n.read[0][1]
    with pytest.raises(TransferRejected, match=f"version {NEXT} \\(the sender speaks {n1.speaks}\\)") as e:
        n.decode(n1.encode(header(), NEXT))
    assert e.value.kind == Refusal.VERSION


def test_a_receiver_ignores_fields_it_does_not_know() -> None:
    doc = doc_of(header()) | {"priority": 5, "sent_ns": 1}
    assert decode_header(json.dumps(doc).encode()) == header()


def test_a_sender_writes_only_versions_it_speaks() -> None:
    with pytest.raises(ValueError, match=f"version {NEXT} is not one this sender speaks"):
        encode_header(header(), NEXT)


def test_the_push_token_travels_in_the_header() -> None:
    h = header(token="Zm9yZ2Vk-token_")
    assert doc_of(h)["token"] == "Zm9yZ2Vk-token_" and decode_header(encode_header(h)).token == h.token


def test_a_version_1_sender_is_refused_with_what_to_do() -> None:
    """Version 1 predates the push capability (and negotiation: it names no range of its own)."""
    doc = doc_of(header()) | {"v": 1}
    del doc["token"], doc["speaks"]
    with pytest.raises(TransferRejected, match=f"version 1 \\(the sender speaks 1\\); this receiver speaks {SPOKEN}: "
                                               "upgrade the sender, to one that carries the push capability") as e:
        decode_header(json.dumps(doc).encode())
    assert e.value.kind == Refusal.VERSION


def test_a_header_without_a_token_field_is_malformed() -> None:
    doc = doc_of(header())
    del doc["token"]
    with pytest.raises(TransferRejected, match="field 'token' must be str") as e:
        decode_header(json.dumps(doc).encode())
    assert e.value.kind == Refusal.MALFORMED


def test_missing_field_is_rejected_naming_it() -> None:
    doc = doc_of(header())
    del doc["num_tokens"]
    with pytest.raises(TransferRejected, match="num_tokens"):
        decode_header(json.dumps(doc).encode())


def test_nbytes_disagreeing_with_layout_is_rejected() -> None:
    doc = doc_of(header()) | {"nbytes": 5}
    with pytest.raises(TransferRejected, match="nbytes 5"):
        decode_header(json.dumps(doc).encode())


def test_layout_with_unknown_dtype_is_rejected() -> None:
    doc = doc_of(header())
    doc["layout"]["dtype"] = "int4"
    with pytest.raises(TransferRejected, match="int4"):
        decode_header(json.dumps(doc).encode())


def test_layout_with_extra_field_is_rejected() -> None:
    doc = doc_of(header())
    doc["layout"]["rope"] = "yarn"
    with pytest.raises(TransferRejected, match="layout fields"):
        decode_header(json.dumps(doc).encode())


def test_more_block_keys_than_blocks_is_rejected() -> None:
    with pytest.raises(TransferRejected, match="4 block keys for 3 blocks"):
        decode_header(encode_header(header(block_keys=(1, 2, 3, 4))))


def test_more_tokens_than_blocks_hold_is_rejected() -> None:
    with pytest.raises(TransferRejected, match="num_tokens 13"):
        decode_header(encode_header(header(num_tokens=13)))


def test_bool_is_not_accepted_as_an_integer() -> None:
    doc = doc_of(header()) | {"num_tokens": True}
    with pytest.raises(TransferRejected, match="num_tokens"):
        decode_header(json.dumps(doc).encode())


def test_address_names_backend_host_and_port() -> None:
    assert parse_address("shm://127.0.0.1:5000") == Address("shm", "127.0.0.1", 5000)
    assert str(Address("tcp", "h", 1)) == "tcp://h:1"


def test_ipv6_address_survives_a_round_trip() -> None:
    assert parse_address(str(Address("tcp", "::1", 7))) == Address("tcp", "::1", 7)


def test_address_without_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="<backend>://<host>:<port>"):
        parse_address("127.0.0.1:5000")


def test_a_layer_group_part_states_its_layers_and_place_and_sizes_by_the_slice() -> None:
    h = header(layers=(1, 2), first_block=5)
    assert decode_header(encode_header(h)) == h
    assert doc_of(h)["layers"] == [1, 2] and doc_of(h)["first_block"] == 5
    assert h.nbytes == 3 * LAYOUT.block_nbytes // 2
    assert "layers" not in doc_of(header())  # whole blocks: as before


@pytest.mark.parametrize("layers", [[1, 1], [0, 3], [-1, 1], [0], [True, 2]])
def test_a_layer_range_outside_the_layout_is_refused(layers) -> None:
    doc = doc_of(header(layers=(0, 1)))
    doc["layers"] = layers
    with pytest.raises(TransferRejected, match="layers"):
        decode_header(json.dumps(doc).encode())


def test_checksums_of_a_layer_group_part_cover_each_blocks_slice() -> None:
    stride = LAYOUT.layers_nbytes((0, 1))
    payload = bytearray(range(256)) * (3 * stride // 256)
    h = header(layers=(0, 1), checksums=block_checksums(memoryview(payload), stride))
    assert corrupt_blocks(h, memoryview(payload)) == []
    payload[stride + 3] ^= 1
    assert corrupt_blocks(h, memoryview(payload)) == [1]


@pytest.mark.parametrize(("kind", "read"), [("checksum", Refusal.CHECKSUM), ("idle", Refusal.IDLE),
                                            ("from-a-newer-peer", Refusal.OTHER), (None, Refusal.OTHER),
                                            (7, Refusal.OTHER)])
def test_a_reply_reads_its_refusal_kind_and_one_it_does_not_know_as_other(kind, read) -> None:
    assert decode_reply(json.dumps({"ok": False, "reason": "r", "kind": kind}).encode()) == Reply(False, "r", read)
    assert decode_reply(encode_reply(Reply(True))[REPLY_PREFIX.size:]) == Reply(True)
