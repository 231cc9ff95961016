"""Client SDK: request building, error mapping, retry budget, result types (no server)."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from kvmesh.client import (
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    KvmeshClient,
    KvmeshError,
    Overloaded,
    Unauthenticated,
    Unavailable,
)
from kvmesh.client.errors import from_rpc_error
from kvmesh.client.requests import chat_request, generate_request
from kvmesh.client.retry_policy import CallPolicy
from kvmesh.client.types import CompletionBuilder, GenerateChunk, Usage, completion_from_chat, trace_id


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", trailing: tuple = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing


# --- request building ---------------------------------------------------------------------------------------

def test_text_prompt_becomes_text():
    req = generate_request("Hello")
    assert req.WhichOneof("prompt") == "text" and req.text == "Hello"


def test_token_prompt_becomes_token_ids():
    req = generate_request([1, 2, 3])
    assert req.WhichOneof("prompt") == "token_ids" and list(req.token_ids.ids) == [1, 2, 3]


def test_messages_become_chat_messages():
    req = generate_request(messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi"}])
    assert req.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in req.messages.messages] == [("system", "Be brief."), ("user", "Hi")]


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}])
def test_exactly_one_of_prompt_and_messages(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        generate_request(**kwargs)


def test_sampling_options_are_carried():
    req = generate_request("x", max_tokens=7, temperature=0.5, top_k=4, top_p=0.9, seed=0, stop=["\n"],
                           stop_token_ids=[2], ignore_eos=True, cache_salt="tenant-a", request_id="r1",
                           model="m")
    s = req.sampling
    assert (s.max_tokens, s.top_k, s.stop_token_ids, s.stop, s.ignore_eos) == (7, 4, [2], ["\n"], True)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.HasField("seed") and s.seed == 0
    assert (req.cache_salt, req.request_id, req.model) == ("tenant-a", "r1", "m")


def test_defaults_are_greedy_64_tokens_without_seed():
    s = generate_request("x").sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p) == (64, 0.0, 0, 1.0)
    assert not s.HasField("seed") and not s.HasField("logprobs")


@pytest.mark.parametrize("n", [0, 5, 20])
def test_logprobs_are_asked_for_with_how_many_most_likely(n):
    s = generate_request("x", logprobs=n).sampling
    assert s.HasField("logprobs") and s.logprobs == n


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0},
                                 {"top_p": 1.5}, {"seed": -1}, {"stop": "\n"}, {"logprobs": -1},
                                 {"logprobs": 21}])
def test_bad_sampling_is_rejected_before_sending(bad):
    with pytest.raises(ValueError):
        generate_request("x", **bad)


def test_latency_targets_travel_with_the_request_and_a_bad_one_is_rejected_before_sending():
    assert (generate_request("x", ttft_s=6, itl_s=0.15).slo.ttft_s, chat_request(
        [{"role": "user", "content": "hi"}], itl_s=0.15).slo.itl_s) == (6.0, 0.15)
    with pytest.raises(ValueError, match="ttft_s must be a number of seconds"):
        generate_request("x", ttft_s=-1)


def test_malformed_messages_are_rejected():
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        generate_request(messages=[{"role": "user"}])
    with pytest.raises(ValueError, match="at least one"):
        chat_request([])


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError):
        generate_request("x", max_new_tokens=3)


def test_chat_request_carries_messages_and_sampling():
    req = chat_request([{"role": "user", "content": "Hi"}], max_tokens=5, cache_salt="s")
    assert [m.content for m in req.messages] == ["Hi"]
    assert req.sampling.max_tokens == 5 and req.cache_salt == "s"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_chat_request_carries_tools_and_the_conversations_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    req = chat_request([{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}],
                       tools=[WEATHER, {"name": "get_time"}], tool_choice={"type": "function",
                                                                           "function": {"name": "get_time"}},
                       parallel_tool_calls=False)
    assert [(t.name, t.description) for t in req.tools] == [("get_weather", "now"), ("get_time", "")]
    assert json.loads(req.tools[0].parameters) == WEATHER["function"]["parameters"] and req.tools[1].parameters == ""
    assert req.tool_choice == "get_time" and req.HasField("parallel_tool_calls") and not req.parallel_tool_calls
    assert [(c.id, c.name, c.arguments) for c in req.messages[1].tool_calls] == [
        ("call_1", "get_weather", '{"city": "Oslo"}')]
    assert req.messages[2].tool_call_id == "call_1"
    plain = chat_request([{"role": "user", "content": "Hi"}])
    assert not plain.tools and plain.tool_choice == "" and not plain.HasField("parallel_tool_calls")
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        chat_request([{"role": "user", "content": "Hi"}], tools=[{"type": "function"}])


def test_a_chat_answers_calls_it_can_send_back():
    from kvmesh.proto.v1 import api_pb2, common_pb2

    r = api_pb2.ChatResponse(request_id="r", finish_reason="tool_calls", tool_calls=[
        common_pb2.ToolCall(id="call_9", name="get_weather", arguments='{"city": "Rome"}')])
    c = completion_from_chat(r, {}, 0.1)
    assert c.tool_calls[0].name == "get_weather" and c.finish_reason == "tool_calls"
    assert c.message() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}


# --- error mapping ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code,cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest), (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
    (grpc.StatusCode.UNAVAILABLE, Unavailable), (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
    (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated), (grpc.StatusCode.CANCELLED, Cancelled),
    (grpc.StatusCode.INTERNAL, KvmeshError)])
def test_status_codes_map_to_error_classes(code, cls):
    err = from_rpc_error(FakeRpcError(code, "detail"))
    assert type(err) is cls and err.code == code.name


def test_error_keeps_server_detail_and_request_id():
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is 9000 tokens; max is 2048",
                                      (("x-request-id", "req-7"),)))
    assert err.message == "prompt is 9000 tokens; max is 2048" and err.request_id == "req-7"
    assert "INVALID_ARGUMENT" in str(err) and "max is 2048" in str(err) and "req-7" in str(err)


def test_deadline_error_names_the_deadline():
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), timeout_s=2.5)
    assert isinstance(err, DeadlineExceeded) and "2.5s" in err.message


# --- retry budget -------------------------------------------------------------------------------------------

def test_only_unavailable_is_retried():
    policy = CallPolicy(None, retries=3, backoff_s=0.1, metadata=())
    assert policy.retry_delay(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)) is None
    assert policy.retry_delay(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED)) is None
    assert policy.retry_delay(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) is not None


def test_backoff_doubles_until_retries_run_out():
    policy = CallPolicy(None, retries=3, backoff_s=0.1, metadata=())
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE)
    delays = [policy.retry_delay(unavailable) for _ in range(4)]
    assert delays[3] is None
    for n, d in enumerate(delays[:3]):
        assert 0.1 * 2 ** n * 0.8 <= d <= 0.1 * 2 ** n * 1.2


def test_no_retry_that_would_outlive_the_deadline():
    policy = CallPolicy(0.05, retries=3, backoff_s=1.0, metadata=())
    assert policy.retry_delay(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) is None


def test_attempt_timeout_is_what_is_left_of_the_deadline():
    policy = CallPolicy(10.0, retries=0, backoff_s=0, metadata=())
    assert 9.0 < policy.attempt_timeout() <= 10.0
    assert CallPolicy(None, 0, 0, ()).attempt_timeout() is None
    expired = CallPolicy(0.0, 0, 0, ())
    time.sleep(0.001)
    with pytest.raises(DeadlineExceeded):
        expired.attempt_timeout()


def test_api_key_becomes_bearer_metadata():
    with KvmeshClient("127.0.0.1:1", api_key="sk-1") as client:
        assert client._policy(None).metadata == (("authorization", "Bearer sk-1"),)
    with KvmeshClient("127.0.0.1:1") as client:
        assert client._policy(None).metadata == ()


def test_client_default_timeout_applies_unless_call_overrides():
    with KvmeshClient("127.0.0.1:1", timeout_s=7) as client:
        assert client._policy(None).timeout_s == 7 and client._policy(2).timeout_s == 2


# --- results ------------------------------------------------------------------------------------------------

def test_trace_id_is_parsed_from_traceparent():
    assert trace_id({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}) == \
        "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id({"traceparent": "garbage"}) == "" and trace_id({}) == ""


def test_builder_collects_chunks_and_prefers_stream_request_id():
    b = CompletionBuilder()
    b.add(GenerateChunk("r1", (5,), "Hi", False, "", None))
    b.add(GenerateChunk("r1", (6,), " there", False, "", None))
    b.add(GenerateChunk("r1", (), "", True, "stop", Usage(3, 2, 1)))
    done = b.build({"x-request-id": "other"})
    assert (done.text, done.token_ids, done.finish_reason) == ("Hi there", [5, 6], "stop")
    assert done.usage == Usage(3, 2, 1)
    assert done.request_id == "r1" and done.ttft_s is not None and len(done.itl_s) == 1


def test_builder_collects_each_tokens_logprobs_from_chunks_and_from_chat():
    from kvmesh.client import TokenLogprobs
    from kvmesh.contracts.engine import logprobs_to_proto
    from kvmesh.proto.v1 import api_pb2

    lps = [TokenLogprobs(5, -0.5, ((5, -0.5), (9, -1.5))), TokenLogprobs(6, -2.0)]
    b = CompletionBuilder()
    for tok, lp in zip((5, 6), lps):
        b.add(GenerateChunk.from_pb(api_pb2.GenerateChunk(request_id="r1", token_ids=[tok],
                                                          logprobs=[logprobs_to_proto(lp)])))
    assert b.build({}).logprobs == lps
    chat = api_pb2.ChatResponse(token_ids=[5, 6], logprobs=[logprobs_to_proto(lp) for lp in lps])
    assert completion_from_chat(chat, {}, 0.1).logprobs == lps


def test_builder_falls_back_to_trailing_request_id():
    b = CompletionBuilder()
    b.add(GenerateChunk("", (5,), "x", True, "length", None))
    assert b.build({"x-request-id": "req-9"}).request_id == "req-9"


def test_from_state_dir_reads_router_address(tmp_path):
    from kvmesh.state import StackInfo

    StackInfo("127.0.0.1:50123", "http://127.0.0.1:8000", "nats://127.0.0.1:4222", "c").write(tmp_path)
    with KvmeshClient.from_state_dir(tmp_path, timeout_s=3) as client:
        assert client.target == "127.0.0.1:50123" and client.timeout_s == 3


def test_from_state_dir_without_stack_says_how_to_start_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="kvmesh up"):
        KvmeshClient.from_state_dir(tmp_path / "nothing")


def test_the_agent_hints_go_on_the_request_and_bad_ones_say_what_to_fix():
    req = chat_request([{"role": "user", "content": "go"}], session_id="run:researcher", parent_session_id="run",
                       session_pause_s=2.5, session_retention="demote")
    assert (req.session_id, req.parent_session_id, req.session_pause_s, req.session_retention) == (
        "run:researcher", "run", 2.5, "demote")
    with pytest.raises(ValueError, match="parent_session_id needs a session_id"):
        generate_request("x", parent_session_id="run")
    with pytest.raises(ValueError, match=r"session_pause_s must be a number of seconds in \[0, 86400\]"):
        generate_request("x", session_id="s", session_pause_s=-1)
    with pytest.raises(ValueError, match="session_retention must be one of retain, demote, release"):
        generate_request("x", session_id="s", session_retention="keep")
