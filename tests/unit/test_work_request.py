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
)
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
