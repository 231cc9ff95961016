"""A work request off the wire becomes the engine's request in one conversion (``engine_request_from_proto``),
which both engine services use: every field carried over, a bad one refused naming it."""

from __future__ import annotations

import pytest
from kvmesh.contracts.engine import (
    EngineRequest,
    ExportPlan,
    RetentionRange,
    SessionHint,
    engine_request_from_proto,
    prompt_ids,
    prompt_length,
    unpacked,
)
from kvmesh.contracts.keys import block_keys, int32s
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.contracts.slo import SLO
from kvmesh.proto.v1 import common_pb2, worker_pb2


def work(**fields: object) -> worker_pb2.WorkRequest:
    base: dict[str, object] = {"request_id": "r1", "prompt_token_ids": [5, 6, 7, 8],
                               "sampling": common_pb2.SamplingParams(max_tokens=9, temperature=0.5)}
    return worker_pb2.WorkRequest(**{**base, **fields})


def test_every_field_of_a_work_request_reaches_the_engine_request():
    wire = work(cache_salt="s", lora_name="a", session_key="t:chat", session_end=True, generated_tokens=2,
                retention=[common_pb2.Retention(start=0, end=4, priority=80, ttl_s=30)],
                slo=common_pb2.SLO(ttft_s=1.5, itl_s=0.1), waited_s=0.25)
    got = engine_request_from_proto(wire, ExportPlan(first_block=1))
    assert got == EngineRequest("r1", (5, 6, 7, 8), SamplingParams(max_tokens=9, temperature=0.5), "s", "a",
                                (RetentionRange(0, 4, 80, 30.0),), ExportPlan(first_block=1), None, 2,
                                SessionHint("t:chat", True), SLO(1.5, 0.1), 0.25)


def test_a_work_request_without_the_optional_fields_is_a_plain_request():
    got = engine_request_from_proto(work())
    assert (got.session, got.retention, got.export, got.imported, got.slo, got.generated) == (None, (), None, None,
                                                                                              SLO(), 0)


@pytest.mark.parametrize("fields, names", [
    ({"sampling": common_pb2.SamplingParams(max_tokens=9, top_p=1.5)}, "top_p"),
    ({"retention": [common_pb2.Retention(start=4, end=2)]}, "retention"),
    ({"slo": common_pb2.SLO(ttft_s=-1)}, "ttft_s"),
    ({"generated_tokens": 4}, "generated"),
])
def test_a_bad_field_is_refused_naming_it(fields, names):
    with pytest.raises(ValueError, match=names):
        engine_request_from_proto(work(**fields))


def packed(ids: list[int]) -> bytes:
    return b"".join(i.to_bytes(4, "little") for i in ids)


def test_a_packed_prompt_reaches_the_engine_as_the_repeated_one_does():
    ids = [0, 5, 49151, 2**31 - 1, 7]
    wire = work(prompt_token_ids=[], prompt_packed=packed(ids))
    assert prompt_ids(wire) == tuple(ids) and prompt_length(wire) == 5
    assert engine_request_from_proto(wire) == engine_request_from_proto(work(prompt_token_ids=ids))
    assert prompt_length(work()) == 4 and prompt_ids(work()) == (5, 6, 7, 8)


def test_the_router_s_int32_ids_are_the_packed_bytes_and_key_the_same_blocks():
    ids = [(i * 7919) % 49152 for i in range(100)]
    data = int32s(ids)
    assert data.tobytes() == packed(ids) and int32s(data) is data  # converted once, for the keys and the wire
    assert block_keys(1, data, 16) == block_keys(1, ids, 16)


def test_an_instance_of_the_build_before_gets_the_ids_repeated():
    wire = work(prompt_token_ids=[], prompt_packed=packed([9, 8, 7]), cache_salt="s")
    old = unpacked(wire)
    assert list(old.prompt_token_ids) == [9, 8, 7] and old.prompt_packed == b"" and old.cache_salt == "s"
    assert wire.prompt_packed == packed([9, 8, 7])  # the router's own copy is untouched
    assert unpacked(work()) == work()


@pytest.mark.parametrize("fields, words", [
    ({"prompt_packed": packed([1, 2])}, "both set"),
    ({"prompt_token_ids": [], "prompt_packed": packed([1, 2])[:-1]}, "7 bytes: not a whole number"),
])
def test_a_prompt_sent_twice_or_cut_mid_id_is_refused_naming_it(fields, words):
    with pytest.raises(ValueError, match=words):
        engine_request_from_proto(work(**fields))
