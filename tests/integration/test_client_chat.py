"""``kvmesh chat`` over scripted stdin/stdout against a fake router."""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from kvmesh.client import KvmeshClient
from kvmesh.state import StackInfo

from app import chat

from .test_client_fake import FakeKvmesh, serve

REPLY = "Hello there, friend."


@pytest.fixture
def fake() -> FakeKvmesh:
    return FakeKvmesh(reply=REPLY)


@pytest.fixture
def target(fake: FakeKvmesh) -> Iterator[str]:
    with serve(fake) as address:
        yield address


def run(target: str, script: str, system: str | None = None,
        out: io.StringIO | None = None) -> tuple[int, str]:
    out = out or io.StringIO()
    with KvmeshClient(target, backoff_s=0.01) as client:
        code = chat.run_chat(client, system, max_tokens=32, temperature=0.0, stream_out=out,
                             stream_in=io.StringIO(script))
    return code, out.getvalue()


def conversation(request) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in request.messages.messages]


def test_second_turn_sends_the_first_exchange(target, fake):
    code, _ = run(target, "Hi\nHow are you?\n/quit\n", system="Be brief.")
    assert code == 0
    assert conversation(fake.requests[1]) == [("system", "Be brief."), ("user", "Hi"), ("assistant", REPLY),
                                              ("user", "How are you?")]


def test_reply_streams_with_a_stats_footer(target):
    _, out = run(target, "Hi\nHow are you?\n")
    assert out.count(REPLY) == 2
    assert "[3 tokens · 0/1 prompt tokens cached · TTFT" in out
    assert "[3 tokens · 4/7 prompt tokens cached · TTFT" in out      # the history's KV was reused


def test_reset_clears_the_history(target, fake):
    run(target, "Hi\n/reset\nAgain\n", system="Be brief.")
    assert conversation(fake.requests[1]) == [("system", "Be brief."), ("user", "Again")]


def test_eof_exits_cleanly(target, fake):
    assert run(target, "Hi\n")[0] == 0 and len(fake.requests) == 1


class InterruptOnce(io.StringIO):
    """stdout that raises KeyboardInterrupt (as Ctrl-C would) the first time reply text is written."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = False

    def write(self, s: str) -> int:
        if not self.fired and s == "Hello":
            self.fired = True
            raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_cancels_the_reply_but_not_the_session(target, fake):
    fake.reply, fake.chunk_delay_s = "Hello" + " word" * 200, 0.01
    code, out = run(target, "First\nSecond\n/quit\n", out=InterruptOnce())
    assert code == 0 and "[reply cancelled" in out
    assert conversation(fake.requests[1]) == [("user", "Second")]    # the cancelled exchange is not kept
    deadline = time.monotonic() + 3
    while fake.cancelled < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.cancelled == 1


def test_failed_reply_is_reported_and_the_session_continues(target, fake):
    fake.fail_before_first, fake.detail = [grpc.StatusCode.INVALID_ARGUMENT], "prompt too long"
    code, out = run(target, "Hi\nAgain\n")
    assert code == 0 and "error: INVALID_ARGUMENT: prompt too long" in out
    assert conversation(fake.requests[1]) == [("user", "Again")]


def test_main_without_a_stack_says_how_to_start_one(tmp_path, capsys):
    assert chat.main(["--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "kvmesh up" in err and err.count("\n") == 1


def test_main_with_an_unreachable_router_says_how_to_start_one(capsys):
    assert chat.main(["--target", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert "kvmesh up" in err and "127.0.0.1:1" in err and err.count("\n") == 1


def test_main_finds_the_stack_in_the_state_dir(target, fake, tmp_path, monkeypatch, capsys):
    StackInfo(target, "http://127.0.0.1:1", "nats://127.0.0.1:1", "test").write(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/quit\n"))
    assert chat.main(["--state-dir", str(tmp_path), "--system", "Be brief.", "--api-key", "sk-1",
                      "--max-tokens", "7"]) == 0
    assert REPLY in capsys.readouterr().out
    assert fake.requests[-1].sampling.max_tokens == 7 and fake.metadata[-1]["authorization"] == "Bearer sk-1"
