"""``kv.ready``'s MAC under the push capability: only a holder of the request's capability makes one decode takes."""

from __future__ import annotations

from kvmesh.contracts.ids import InstanceId, RequestId, TransferId
from kvmesh.contracts.messages import KVReady

READY = KVReady(request_id=RequestId("t.req.n"), decode_instance=InstanceId("decode-0"),
                transfer_id=TransferId("t.req.n@prefill-0"), block_keys=(), num_tokens=1, first_token=7, layout=None,
                prefill_instance=InstanceId("prefill-0"))


def test_a_kv_ready_signed_with_the_push_capability_verifies():
    assert READY.signed("cap").verify("cap")


def test_an_unsigned_or_wrongly_signed_or_altered_kv_ready_does_not():
    assert not READY.verify("cap")
    assert not READY.signed("a guessed token").verify("cap")
    signed = READY.signed("cap")
    assert not KVReady(**{**signed.__dict__, "first_token": 8}).verify("cap")  # the MAC covers the fields
