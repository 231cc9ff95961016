"""The logit adjustments at the router: OpenAI's and vLLM's fields read from a body with errors naming them, what
kvmesh does not serve refused unless it says "off", and a request that needs them sent only to instances whose
heartbeat says they apply them (an engine of an older build would ignore them)."""

from __future__ import annotations

import types

import pytest
from kvmesh.contracts.messages import FEATURES, Heartbeat, InstanceLoad

from services.router import openai_body
from services.router.core import Router
from services.router.errors import ErrorKind, RequestError
from services.router.registry import Instance


def sampling(**body):
    return openai_body.sampling_from_body({"prompt": "x", **body})[0]


def test_the_fields_are_read():
    p = sampling(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_p=0.05, min_tokens=3,
                 logit_bias={"50256": -100, "7": 2.5})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (
        0.5, -1.0, 1.2, 0.05, 3)
    assert p.logit_bias == ((7, 2.5), (50256, -100.0)) and p.features == ("logits",)
    assert sampling(presence_penalty=0, frequency_penalty=0, logit_bias={}).features == ()  # what clients send


@pytest.mark.parametrize("body,words", [
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": "high"}, "frequency_penalty must be a number"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 10]"),
    ({"min_p": 2}, "min_p must be in [0, 1]"),
    ({"min_tokens": 100, "max_tokens": 10}, "min_tokens must be in [0, max_tokens = 10]"),
    ({"logit_bias": [1, 2]}, "logit_bias must be an object"),
    ({"logit_bias": {"abc": 1}}, "must be a token id (digits)"),
    ({"logit_bias": {"5": 250}}, "bias must be in [-100, 100]"),
    ({"best_of": 3}, "best_of is not supported"),
    ({"prompt_logprobs": -1}, "prompt_logprobs -1"),
    ({"suffix": "end"}, "suffix is not supported"),
    ({"functions": [{"name": "f"}]}, "use tools"),
])
def test_bad_fields_are_400s_naming_them(body, words):
    with pytest.raises(RequestError) as e:
        sampling(**body)
    assert e.value.kind == ErrorKind.INVALID and words in e.value.message


def test_off_values_of_unserved_fields_pass():
    sampling(best_of=1, echo=False, suffix=None, functions=None, function_call="none")


def inst(iid: str, features: tuple[str, ...]) -> Instance:
    beat = Heartbeat(instance_id=iid, role="both", grpc_address="", transfer_address="", ts=0.0,
                     load=InstanceLoad(), model="m", block_size=16, features=features)
    return Instance(beat, 0.0)


def lacking(instances: list[Instance], needs: tuple[str, ...]) -> set[str]:
    router = types.SimpleNamespace(registry=types.SimpleNamespace(alive=lambda: instances))
    return Router._lacking(router, needs)  # type: ignore[arg-type]


def test_a_request_that_needs_the_adjustments_skips_instances_that_do_not_say_they_apply_them():
    fleet = [inst("new", FEATURES), inst("old", ())]
    assert lacking(fleet, ()) == set() and lacking(fleet, ("logits",)) == {"old"}
    with pytest.raises(RequestError) as e:
        lacking([inst("old", ())], ("logits",))
    assert e.value.kind == ErrorKind.UNAVAILABLE and "upgrade the engines" in e.value.message
    assert lacking([], ("logits",)) == set()  # nobody up: the planner says so


def test_the_heartbeat_carries_the_features_and_an_older_one_reads_as_none():
    beat = inst("a", FEATURES).beat
    assert Heartbeat.decode(beat.encode()).features == FEATURES
    assert Heartbeat.decode(inst("b", ()).beat.encode()).features == ()
