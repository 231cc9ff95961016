"""The router's sessions: the fields on the wire (body, header, gRPC), their checks, tool-call pauses, affinity
unless overloaded, and the signals it publishes."""

from __future__ import annotations

import asyncio

import pytest
from kvmesh.contracts.engine import SessionHint
from kvmesh.contracts.messages import Heartbeat, InstanceLoad, SessionSignal
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.settings import RouterSettings

from services.router.access import TenantTerms
from services.router.errors import RequestError
from services.router.intake import CacheControl, Draft, Intake, message_cache_control
from services.router.openai_body import draft
from services.router.registry import Instance
from services.router.sessions import Sessions, ends_in_tool_call
from services.router.tool_formats import FORMATS

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_the_session_comes_from_the_body_or_the_header_and_they_must_agree():
    assert draft({**CHAT, "session_id": "c1"}, True, {}).session_id == "c1"
    assert draft(CHAT, True, {"x-session-id": "c2"}).session_id == "c2"
    assert draft({**CHAT, "session_id": "c3"}, True, {"x-session-id": "c3"}).session_id == "c3"
    with pytest.raises(RequestError, match="x-session-id header .* and session_id .* differ"):
        draft({**CHAT, "session_id": "a"}, True, {"x-session-id": "b"})


@pytest.mark.parametrize("body,words", [
    ({"session_id": 7}, "session_id must be a string"),
    ({"session_end": "yes"}, "session_end must be true or false"),
    ({"cache_control": "1h"}, "cache_control must be an object"),
    ({"cache_control": {"ttl": "soon"}}, "cache_control.ttl must be a number of seconds or a duration"),
    ({"cache_control": {"ttl": [1]}}, "cache_control.ttl must be a number of seconds"),
    ({"cache_control": {"priority": "high"}}, r"cache_control.priority must be an integer in \[0, 100\]"),
])
def test_a_malformed_session_field_is_refused_naming_it(body, words):
    with pytest.raises(RequestError, match=words):
        draft({**CHAT, **body}, True, {})


def test_cache_control_takes_seconds_or_durations():
    assert message_cache_control({"type": "ephemeral", "ttl": "5m"}, "f") == CacheControl(300, None, "f")
    assert message_cache_control({"ttl": 90.5, "priority": 70}, "f") == CacheControl(90.5, 70, "f")
    assert message_cache_control({}, "f") == CacheControl(None, None, "f")


class FakeTokenizer:
    """A chat template of one token per character of each message, plus one per message."""

    takes_tools = takes_tool_calls = False

    def render_chat(self, messages, add_generation_prompt=True, tools=None, continue_final_message=False,
                    extra=None):
        return "a" * sum(len(m["content"]) + 1 for m in messages) + ("b" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return [1 if c == "a" else 2 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, continue_final_message=False,
                            extra=None):
        return self.encode(self.render_chat(messages, add_generation_prompt), False)


class FakeRouter:
    tokenizer = FakeTokenizer()
    tool_format = FORMATS["hermes"]


def intake() -> Intake:
    i = Intake.__new__(Intake)
    i.router = FakeRouter()  # type: ignore[assignment]
    i.terms = TenantTerms.from_config(RouterSettings())
    return i


def test_a_session_is_namespaced_by_the_tenant():
    d = Draft(sampling=None, text="x", session_id="chat-1", session_end=True)  # type: ignore[arg-type]
    assert Intake.session(d, "alice") == SessionHint("alice/chat-1", True)
    assert Intake.session(d, "bob") != Intake.session(d, "alice")
    assert Intake.session(Draft(sampling=None, text="x"), "alice") is None  # type: ignore[arg-type]


@pytest.mark.parametrize("draft_fields,words", [
    ({"session_id": "a/b"}, "session_id must be 1 to 128 printable ASCII characters without '/'"),
    ({"session_id": "x" * 129}, "session_id must be 1 to 128"),
    ({"session_id": "caf\u00e9"}, "printable ASCII"),
    ({"session_end": True}, "session_end needs a session_id"),
])
def test_a_bad_session_is_a_400_naming_the_field(draft_fields, words):
    d = Draft(sampling=None, text="x", **draft_fields)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=words) as e:
        Intake.session(d, "t")
    assert e.value.kind.http == 400


@pytest.mark.parametrize("control,words", [
    (CacheControl(ttl_s=-1), r"cache_control.ttl must be a number of seconds in \(0, 604800\]"),
    (CacheControl(ttl_s=0), "cache_control.ttl"),
    (CacheControl(ttl_s=10**7), "cache_control.ttl"),
    (CacheControl(priority=101), r"cache_control.priority must be an integer in \[0, 100\]"),
    (CacheControl(priority=-3), "cache_control.priority"),
])
def test_a_bad_ttl_or_priority_is_a_400_naming_the_field(control, words):
    d = Draft(sampling=None, text="x", cache_control=control)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=words) as e:
        asyncio.run(intake().retention(d, 10))
    assert e.value.kind.http == 400


def test_retention_covers_the_prompt_or_the_prompt_through_a_message():
    messages = [{"role": "system", "content": "abcd", "cache_control": {"ttl": 60, "priority": 80}},
                {"role": "user", "content": "hello"}]
    d = Draft(sampling=None, messages=messages, cache_control=CacheControl(ttl_s=30))  # type: ignore[arg-type]
    whole, system = asyncio.run(intake().retention(d, 12))
    assert (whole.start, whole.end, whole.priority, whole.duration_s) == (0, 12, 50, 30.0)
    assert (system.end, system.priority, system.duration_s) == (5, 80, 60.0)  # 4 characters + 1
    bad = [{"role": "user", "content": "x", "cache_control": {"priority": 500}}]
    with pytest.raises(RequestError, match=r"messages\[0\].cache_control.priority"):
        asyncio.run(intake().retention(Draft(sampling=None, messages=bad), 3))  # type: ignore[arg-type]


@pytest.mark.parametrize("text,reason,yes", [
    ('I will look.\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>', "stop", True),
    ('<tool_call>{"name": "search", "arguments": {}}', "stop", True),   # cut at the stop string </tool_call>
    ('<tool_call>{"name": "search"', "length", False),                 # ran out of tokens: not a call
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "stop", True),
    ('{"answer": 42}', "stop", False),
    ("The capital of France is Paris.", "stop", False),
])
def test_a_response_that_ends_in_a_tool_call_is_told_apart(text, reason, yes):
    assert ends_in_tool_call(text, reason) is yes


def inst(iid: str, running: int) -> Instance:
    beat = Heartbeat(instance_id=iid, role="both", grpc_address="", transfer_address="", ts=0.0,
                     load=InstanceLoad(running=running), model="m", block_size=16)
    return Instance(beat, 0.0)


def test_a_session_stays_on_its_instance_unless_it_is_overloaded():
    s = Sessions(publish=None, overload=2)  # type: ignore[arg-type]
    hint = SessionHint("t/c")
    a, b = inst("a", 1), inst("b", 0)
    assert s.place(hint, [a, b]) == (None, "")  # never seen: the policy chooses
    s.ran(hint, "a")
    home, why = s.place(hint, [a, b])
    assert home is a and "stays on a" in why
    busy = inst("a", 3)
    home, why = s.place(hint, [busy, b])
    assert home is None and "overloaded" in why and s.moved == 1
    assert s.place(hint, [b])[0] is None  # its instance is gone
    s.ran(SessionHint("t/c", end=True), "b")
    assert s.instance_of("t/c") is None


def test_the_router_remembers_at_most_max_sessions():
    s = Sessions(publish=None, max_sessions=2)  # type: ignore[arg-type]
    for k in ("t/1", "t/2", "t/3"):
        s.ran(SessionHint(k), "a")
    assert len(s) == 2 and s.instance_of("t/1") is None


def test_signals_are_published_for_ends_pauses_and_closes():
    sent: list[SessionSignal] = []

    async def publish(msg: SessionSignal) -> None:
        sent.append(msg)

    async def body() -> None:
        s = Sessions(publish)
        assert s.finished(SessionHint("t/a"), "plain answer", "stop") is None
        assert s.finished(SessionHint("t/a"), "<tool_call>{}</tool_call>", "stop") is SessionEvent.PAUSE
        assert s.finished(SessionHint("t/b", end=True), "bye", "stop") is SessionEvent.END
        assert s.finished(None, "<tool_call>{}</tool_call>", "stop") is None
        assert s.finished(SessionHint("t/d", calls_tool=True), '{"city": "Oslo"}', "stop") is SessionEvent.PAUSE
        await asyncio.sleep(0)  # the signals go out in the background
        await s.close("t/c")

    asyncio.run(body())
    assert [(m.session, m.event) for m in sent] == [("t/a", SessionEvent.PAUSE), ("t/b", SessionEvent.END),
                                                    ("t/d", SessionEvent.PAUSE), ("t/c", SessionEvent.END)]


def test_a_forced_tool_call_pauses_the_session():
    """``tool_choice`` required or a named function: the answer is a call whatever its text says (a named
    function's is only its arguments), so the session it belongs to pauses."""
    from services.router import openai_body

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "session_id": "s1", "tools": [tool]}
    for choice, forced in (("auto", False), ("none", False), ("required", True),
                           ({"type": "function", "function": {"name": "f"}}, True)):
        draft = openai_body.draft({**body, "tool_choice": choice}, True, {})
        assert Intake.session(draft, "t").calls_tool is forced


def test_the_agent_hints_come_from_the_body_or_kvmesh_or_dynamo_headers():
    d = draft({**CHAT, "session_id": "a", "parent_session_id": "p", "session_pause_s": 2.5,
               "session_retention": "demote"}, True, {})
    assert (d.parent_session_id, d.session_pause_s, d.session_retention) == ("p", 2.5, "demote")
    d = draft(CHAT, True, {"x-dynamo-session-id": "run:researcher", "x-dynamo-parent-session-id": "run",
                           "x-dynamo-session-final": "true"})
    assert (d.session_id, d.parent_session_id, d.session_end) == ("run:researcher", "run", True)
    d = draft(CHAT, True, {"x-session-id": "a", "x-session-pause-s": "3", "x-session-retention": "release"})
    assert (d.session_pause_s, d.session_retention) == (3.0, "release")
    assert Intake.session(d, "t") == SessionHint("t/a", False, "", 3.0, "release")
    assert Intake.session(draft({**CHAT, "session_id": "c", "parent_session_id": "p"}, True, {}), "t").parent == "t/p"


@pytest.mark.parametrize("body,headers,words", [
    ({}, {"x-session-id": "a", "x-dynamo-session-id": "b"}, "x-session-id and x-dynamo-session-id headers differ"),
    ({"session_pause_s": 3}, {"x-session-id": "a", "x-session-pause-s": "4"}, "header .* and session_pause_s"),
    ({"session_id": "a", "session_pause_s": -1}, {}, r"session_pause_s must be a number of seconds in \[0, 86400\]"),
    ({"session_id": "a", "session_retention": "forever"}, {}, "session_retention must be one of retain, demote"),
    ({"session_id": "a", "parent_session_id": "x/y"}, {}, "parent_session_id must be 1 to 128"),
    ({}, {"x-session-id": "a", "x-dynamo-session-final": "maybe"}, "x-dynamo-session-final header must be true"),
    ({}, {"x-session-id": "a", "x-session-pause-s": "soon"}, "x-session-pause-s header must be a number"),
])
def test_a_bad_agent_hint_is_a_400_naming_it(body, headers, words):
    with pytest.raises(RequestError, match=words) as e:
        draft({**CHAT, **body}, True, headers)
    assert e.value.kind.http == 400


@pytest.mark.parametrize("field", ["parent_session_id", "session_pause_s", "session_retention"])
def test_an_agent_hint_needs_a_session(field):
    value = {"parent_session_id": "p", "session_pause_s": 2.0, "session_retention": "demote"}[field]
    with pytest.raises(RequestError, match=f"{field} needs a session_id"):
        Intake.session(Draft(sampling=None, text="x", **{field: value}), "t")  # type: ignore[arg-type]


class Sent(list):
    async def __call__(self, msg: SessionSignal) -> None:
        self.append(msg)


def test_a_paused_session_back_at_the_router_has_its_instance_warm_its_kv():
    async def run() -> tuple[Sent, Sent]:
        signals, shared = Sent(), Sent()
        s = Sessions(signals, share=shared)
        hint = SessionHint("t/a", pause_s=4.0)
        assert s.arrived(hint) is None  # never seen: nothing to warm
        s.ran(hint, "i1")
        assert s.finished(hint, "no tool call here", "stop") is SessionEvent.PAUSE  # the announced pause
        assert s.paused_at("t/a") is not None
        assert s.arrived(SessionHint("t/a")) == "i1" and s.paused_at("t/a") is None
        assert s.arrived(SessionHint("t/a")) is None  # told once per pause
        await asyncio.sleep(0)
        return signals, shared

    signals, shared = asyncio.run(run())
    assert [(m.event, m.instance, m.expected_s) for m in signals] == [
        (SessionEvent.PAUSE, "i1", 4.0), (SessionEvent.RESUME, "i1", 0.0)]
    assert [(m.event, m.instance) for m in shared] == [(SessionEvent.ROUTED, "i1")]


@pytest.mark.parametrize("hint,text,event", [
    (SessionHint("t/a", retention="demote"), "plain answer", SessionEvent.DEMOTE),
    (SessionHint("t/a", pause_s=2.0, retention="demote"), "", SessionEvent.DEMOTE),
    (SessionHint("t/a", retention="release"), '<tool_call>{"name": "x", "arguments": {}}</tool_call>',
     SessionEvent.RELEASE),
    (SessionHint("t/a", retention="retain"), '<tool_call>{"name": "x", "arguments": {}}</tool_call>',
     SessionEvent.PAUSE),
    (SessionHint("t/a", True, pause_s=3.0), "", SessionEvent.END),
    (SessionHint("t/a", retention="retain"), "plain answer", None),
])
def test_what_a_finished_request_says_of_its_session(hint, text, event):
    async def run():
        return Sessions(Sent()).finished(hint, text, "stop")

    assert asyncio.run(run()) is event


def test_replicas_share_placements_pauses_and_ends():
    async def run() -> Sessions:
        other = Sessions(Sent())
        await other.heard(SessionSignal("t/a", SessionEvent.ROUTED, 1.0, "i2"), {})
        await other.heard(SessionSignal("t/b", SessionEvent.ROUTED, 1.0, "i1"), {})
        await other.heard(SessionSignal("t/a", SessionEvent.PAUSE, 2.0, "i2"), {})
        await other.heard(SessionSignal("t/b", SessionEvent.END, 3.0), {})
        return other

    other = asyncio.run(run())
    assert other.instance_of("t/a") == "i2" and other.paused_at("t/a") == 2.0
    assert other.instance_of("t/b") is None and len(other) == 1


def test_a_sub_agent_starts_where_its_parent_ran():
    async def run() -> Sessions:
        s = Sessions(Sent())
        s.ran(SessionHint("t/parent"), "b")
        child = SessionHint("t/child", parent="t/parent")
        home, why = s.place(child, [inst("a", 0), inst("b", 1)])
        assert home is not None and home.id == "b" and "stays on b" in why
        s.ran(child, "b")
        assert s.home(SessionHint("t/orphan", parent="t/nobody")) is None
        return s

    s = asyncio.run(run())
    assert s.forked == 1 and s.instance_of("t/child") == "b"
