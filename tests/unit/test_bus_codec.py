import json

import pytest
from kvmesh.contracts.engine import Speed
from kvmesh.contracts.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.contracts.ids import BlockKey, Role
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.messages import (
    VERSION,
    CodecError,
    Heartbeat,
    InstanceLoad,
    KVCopies,
    KVEventBatch,
    KVQuarantine,
    KVReady,
    RouterLoad,
    SessionSignal,
    decode,
)
from kvmesh.contracts.sessions import SessionEvent

MAX_KEY = BlockKey(2**64 - 1)


def make_batch() -> KVEventBatch:
    return KVEventBatch(instance_id="prefill-0", seq=41, ts=1700000000.25, events=(
        BlockStored(block_keys=(BlockKey(1), MAX_KEY), parent_key=BlockKey(2**63 + 1), token_count=16,
                    tier="device", lora="adapter-a", extra_keys=("img:abc",)),
        BlockStored(block_keys=(BlockKey(7),), parent_key=None, token_count=16, tier="host"),
        BlockRemoved(block_keys=(MAX_KEY,), tier="device"),
        AllBlocksCleared(),
    ))


def make_ready(**over) -> KVReady:
    fields = {"request_id": "req-1", "decode_instance": "decode-0", "transfer_id": "t-9",
                  "block_keys": (BlockKey(3), MAX_KEY), "num_tokens": 37, "first_token": 128001,
                  "layout": KVLayout("m", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="fp16"),
                  "prefill_instance": "prefill-0"}
    return KVReady(**{**fields, **over})


def make_heartbeat() -> Heartbeat:
    return Heartbeat(instance_id="decode-0", role="decode", grpc_address="127.0.0.1:50051",
                     transfer_address="127.0.0.1:50052", ts=1700000000.5,
                     load=InstanceLoad(running=3, waiting=1, free_blocks=900, total_blocks=1024,
                                       speed=Speed(prefill_tok_per_s=812.5)),
                     model="smollm2-135m", block_size=16)


MESSAGES = [make_batch(), make_ready(), make_ready(ok=False, error="transfer timed out"), make_heartbeat(),
            SessionSignal("tenant/s-1", SessionEvent.PAUSE, 1.5, "both-0"),
            KVCopies("decode-0", shared=(BlockKey(1), MAX_KEY), sole=(BlockKey(9),)),
            KVQuarantine("both-0", (BlockKey(3), MAX_KEY), "pool"),
            RouterLoad("router-1", 12.5, {"decode-0": 3}, {"decode-0": 800})]


@pytest.mark.parametrize("msg", MESSAGES)
def test_every_message_type_round_trips(msg):
    assert type(msg).decode(msg.encode()) == msg
    assert decode(msg.encode()) == msg


def test_64_bit_block_keys_stay_exact():
    wire = make_batch().encode()
    assert str(2**64 - 1).encode() in wire  # an integer on the wire, not a float
    stored = KVEventBatch.decode(wire).events[0]
    assert stored.block_keys[1] == 2**64 - 1 and stored.parent_key == 2**63 + 1


def test_messages_carry_version_and_type():
    body = json.loads(make_heartbeat().encode())
    assert body["v"] == VERSION and body["type"] == "heartbeat"


def test_unknown_version_is_rejected():
    body = json.loads(make_heartbeat().encode()) | {"v": 2}
    with pytest.raises(CodecError, match="version 2"):
        decode(json.dumps(body).encode())


def test_unknown_type_is_rejected():
    with pytest.raises(CodecError, match="unknown message type 'gossip'"):
        decode(b'{"v": 1, "type": "gossip"}')


@pytest.mark.parametrize("msg", MESSAGES)
def test_every_message_type_reads_past_a_field_a_newer_writer_added(msg):
    """A newer build adds fields without a version bump: this one reads its messages as before."""
    body = json.loads(msg.encode()) | {"added_later": {"of": ["any", 1, "shape"]}}
    assert decode(json.dumps(body).encode()) == msg


def test_an_event_and_a_load_with_fields_a_newer_writer_added_read_as_before():
    batch = json.loads(make_batch().encode())
    for event in batch["events"]:
        event["added_later"] = [1]
    assert decode(json.dumps(batch).encode()) == make_batch()
    beat = json.loads(make_heartbeat().encode())
    beat["load"]["added_later"] = 2.5
    assert decode(json.dumps(beat).encode()) == make_heartbeat()


def test_unknown_event_type_inside_a_batch_is_rejected():
    body = json.loads(make_batch().encode())
    body["events"].append({"type": "block_moved"})
    with pytest.raises(CodecError, match="block_moved"):
        decode(json.dumps(body).encode())


@pytest.mark.parametrize("data", [b"", b"not json", b"\xff\xfe", b"[1, 2]"])
def test_garbage_is_a_codec_error(data):
    with pytest.raises(CodecError):
        decode(data)


def test_missing_field_is_named():
    body = json.loads(make_ready().encode())
    del body["transfer_id"]
    with pytest.raises(CodecError, match="transfer_id"):
        decode(json.dumps(body).encode())


@pytest.mark.parametrize("key", [-1, 2**64, 1.5, "12", True])
def test_out_of_range_or_non_integer_block_keys_are_rejected(key):
    body = json.loads(make_ready().encode())
    body["block_keys"] = [key]
    with pytest.raises(CodecError, match="block key"):
        decode(json.dumps(body).encode())


def test_out_of_range_block_key_is_rejected_on_encode():
    with pytest.raises(CodecError, match="block key"):
        make_ready(block_keys=(BlockKey(2**64),)).encode()


def test_decoding_as_the_wrong_type_is_rejected():
    with pytest.raises(CodecError, match="expected a kv_ready message, got heartbeat"):
        KVReady.decode(make_heartbeat().encode())


def test_heartbeat_role_must_be_known():
    with pytest.raises(ValueError, match="role 'router'"):
        Heartbeat(instance_id="r", role="router", grpc_address="", transfer_address="", ts=0.0, load=InstanceLoad(),
                  model="m", block_size=16)


def test_a_ready_layout_travels_as_its_json_form():
    body = json.loads(make_ready().encode())
    assert body["layout"] == make_ready().layout.to_dict()


def test_a_ready_with_a_bad_layout_is_rejected_naming_the_field():
    body = json.loads(make_ready().encode())
    body["layout"]["dtype"] = "int3"
    with pytest.raises(CodecError, match="field 'layout': unknown KV dtype 'int3'"):
        decode(json.dumps(body).encode())


def test_a_failed_ready_carries_no_layout():
    failed = make_ready(ok=False, error="push failed", layout=None)
    assert json.loads(failed.encode())["layout"] == {}
    assert KVReady.decode(failed.encode()) == failed


def test_heartbeat_role_is_a_role_and_travels_as_its_string():
    beat = make_heartbeat()
    assert beat.role is Role.DECODE
    assert json.loads(beat.encode())["role"] == "decode"
    assert Heartbeat.decode(beat.encode()).role is Role.DECODE


def test_kv_ready_carries_where_a_delta_push_starts():
    from kvmesh.contracts.messages import KVReady

    ready = KVReady("r", "decode-0", "r@prefill-0", (11, 12), 40, 5, None, "prefill-0", first_block=3)
    assert KVReady.decode(ready.encode()).first_block == 3
    assert KVReady.decode(KVReady("r", "d", "t", (), 1, 0, None, "p").encode()).first_block == 0


def test_a_ready_pushed_in_parts_names_each_parts_transfer_and_defaults_to_one():
    ready = make_ready(parts=3, first_block=2)
    assert KVReady.decode(ready.encode()) == ready
    assert ready.part_ids() == ("t-9#0", "t-9#1", "t-9#2")
    body = json.loads(make_ready().encode())
    del body["parts"]  # absent: one part
    assert KVReady.decode(json.dumps(body).encode()).part_ids() == ("t-9#0",)
    with pytest.raises(CodecError, match="parts"):
        KVReady.decode(json.dumps({**body, "parts": 0}).encode())


def test_a_ready_carries_the_first_tokens_logprobs_exactly_and_none_when_not_asked():
    from kvmesh.contracts.engine import TokenLogprobs

    lp = TokenLogprobs(128001, -0.1234567890123, ((128001, -0.1234567890123), (7, -2.5), (2**31, -9999.0)))
    assert KVReady.decode(make_ready(first_logprobs=lp).encode()).first_logprobs == lp
    assert KVReady.decode(make_ready().encode()).first_logprobs is None
    body = json.loads(make_ready().encode())
    del body["first_logprobs"]  # a prefill that predates them
    assert KVReady.decode(json.dumps(body).encode()).first_logprobs is None


@pytest.mark.parametrize("bad", [[1, 2], {"token_id": 1, "logprob": -1.0, "top": [[1]]},
                                 {"token_id": 1, "logprob": -1.0, "top": [["a", -1.0]]},
                                 {"token_id": 1, "logprob": "x", "top": []}, {"logprob": -1.0, "top": []}])
def test_a_ready_with_malformed_logprobs_is_rejected_naming_the_field(bad):
    body = {**json.loads(make_ready().encode()), "first_logprobs": bad}
    with pytest.raises(CodecError, match="field 'first_logprobs'"):
        KVReady.decode(json.dumps(body).encode())


def test_a_routers_load_round_trips_and_refuses_what_is_not_a_count():
    load = RouterLoad("router-1", 12.5, {"decode-0": 3}, {"decode-0": 800})
    assert decode(load.encode()) == load
    bad = json.loads(load.encode())
    bad["inflight"]["decode-0"] = -1
    with pytest.raises(CodecError, match="'inflight' must map instance ids to counts"):
        decode(json.dumps(bad).encode())


def test_a_session_signal_names_a_known_event():
    assert SessionSignal("t/s", "end", 1.0).event is SessionEvent.END
    with pytest.raises(CodecError, match="session event 'stop'"):
        decode(json.dumps({"v": VERSION, "type": "session_signal", "session": "t/s", "event": "stop",
                           "ts": 1}).encode())


def test_a_heartbeats_load_travels_as_flat_numbers_and_comes_back_typed():
    load = InstanceLoad(running=2, waiting_tokens=300, kv_block_bytes=4096, lora_load_s=0.02,
                        speed=Speed(prefill_tok_per_s=900.0, prefill_overhead_s=0.01))
    wire = load.to_dict()
    assert wire["prefill_tok_per_s"] == 900.0 and "decode_step_s" not in wire  # unmeasured: not said
    assert InstanceLoad.from_dict(wire) == load


def test_a_least_work_engines_queue_ahead_travels_one_key_an_edge_and_an_older_beat_has_none():
    load = InstanceLoad(waiting_tokens=2000, ahead_tokens=(0, 50, 1050, 2000))
    wire = load.to_dict()
    assert wire["ahead_tokens_250ms"] == 0 and wire["ahead_tokens_16000ms"] == 2000
    assert InstanceLoad.from_dict(wire) == load
    del wire["ahead_tokens_4000ms"]  # edges this reader does not share: none read, the whole queue counts
    assert InstanceLoad.from_dict(wire).ahead_tokens == ()
    assert "ahead_tokens_250ms" not in InstanceLoad(waiting_tokens=9).to_dict()


def test_a_load_from_another_version_keeps_what_it_can_read():
    """Unknown keys (a newer instance) are ignored; a known one that is not a finite number >= 0 stays at its
    default, so one bad field does not drop the instance from routing."""
    load = InstanceLoad.from_dict({"running": 3, "queue_depth_v9": 7, "waiting": -1, "free_blocks": "many",
                                   "prefill_tok_per_s": float("nan"), "decode_step_s": 0.05, "kv_fallbacks": True})
    assert load == InstanceLoad(running=3, speed=Speed(decode_step_s=0.05))


def test_a_removal_says_why_and_an_older_peers_removal_reads_as_not_said():
    """``BlockRemoved.reason`` (the eviction policy, or "quarantine") travels when set; a batch from a peer that
    does not send it decodes with it empty."""
    from kvmesh.contracts.events import BlockRemoved
    from kvmesh.contracts.ids import BlockKey, InstanceId
    from kvmesh.contracts.messages import KVEventBatch

    batch = KVEventBatch(InstanceId("i"), 1, 0.0, (BlockRemoved((BlockKey(5),), "device", "lru"),
                                                   BlockRemoved((BlockKey(6),), "host")))
    data = batch.encode()
    assert KVEventBatch.decode(data) == batch
    assert b'"reason"' in data and data.count(b'"reason"') == 1


def test_a_draining_heartbeat_says_so_and_an_older_one_reads_as_not_draining():
    import dataclasses

    b = dataclasses.replace(make_heartbeat(), draining=True)
    assert decode(b.encode()) == b and json.loads(b.encode())["draining"] is True
    assert "draining" not in json.loads(make_heartbeat().encode())  # what an older engine sends: no field
    assert decode(make_heartbeat().encode()).draining is False
