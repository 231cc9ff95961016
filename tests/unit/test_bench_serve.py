"""The serving harness against a fake OpenAI-compatible server (aiohttp, in process): what it measures, sends and
writes."""

import asyncio
import io
import json
from typing import Self

import pytest
from aiohttp import web

from app.bench import serve
from app.bench import workloads as wl
from app.bench.serve import RunOptions, run_workload
from app.bench.stats import SLO, RequestRecord

GAP_S = 0.03


class FakeServer:
    """Streams ``reply-<n>`` (n = messages received) as 4 chunks ``GAP_S`` apart, then usage. A user message
    containing ``busy`` gets HTTP 429, ``hang`` never answers, ``broken`` gets an SSE error event."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        app = web.Application()
        app.add_routes([web.get("/v1/models", self.models), web.post("/v1/chat/completions", self.complete),
                        web.post("/v1/completions", self.complete)])
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        self.url = ""

    async def __aenter__(self) -> Self:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        last = (body.get("messages") or [{}])[-1].get("content", "")
        if "busy" in last:
            return web.json_response({"error": {"message": "try later"}}, status=429)
        if "hang" in last:
            await asyncio.sleep(3600)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in body

        async def send(obj) -> None:
            await resp.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = len(body.get("messages") or body.get("prompt"))
        for piece in ("re", "ply", "-", str(n)):
            await asyncio.sleep(GAP_S)
            if "broken" in last and piece == "-":
                await send({"error": {"message": "engine died"}})
                break
            await send({"choices": [{"index": 0, **({"delta": {"content": piece}} if chat else {"text": piece})}]})
        else:
            await send({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44,
                                                 "prompt_tokens_details": {"cached_tokens": 16}}})
        await send("[DONE]")
        return resp


def run(workload: wl.Workload, **kw):
    async def go():
        async with FakeServer() as server:
            result = await run_workload(server.url, workload, RunOptions(**kw), progress=False)
            return result, server.bodies

    return asyncio.run(go())


def chat(*users: str, cid: str = "c", max_tokens: int = 4) -> wl.Conversation:
    return wl.Conversation(cid, tuple(wl.Turn(u, max_tokens=max_tokens) for u in users), system="be brief")


def one_phase(*convs: wl.Conversation) -> wl.Workload:
    return wl.Workload("test", (wl.Phase("p", convs),))


def test_ttft_every_gap_usage_and_text_are_measured_at_the_client():
    result, bodies = run(one_phase(chat("hi")))
    (r,) = result.records
    assert r.ok and r.text == "reply-2" and result.model == "fake-model"
    assert r.ttft_s >= GAP_S and len(r.itl_s) == 3 and all(g >= GAP_S * 0.8 for g in r.itl_s)
    assert (r.prompt_tokens, r.cached_tokens, r.output_tokens) == (40, 16, 4)
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s) * 0.99
    assert bodies[0]["stream"] and bodies[0]["stream_options"] == {"include_usage": True}
    assert bodies[0]["temperature"] == 0 and bodies[0]["model"] == "fake-model"


def test_each_turn_resends_the_history_with_the_actual_replies():
    _, bodies = run(one_phase(chat("one", "two", "three")))
    assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
    assert bodies[2]["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one"},
                                     {"role": "assistant", "content": "reply-2"}, {"role": "user", "content": "two"},
                                     {"role": "assistant", "content": "reply-4"}, {"role": "user", "content": "three"}]


def test_an_http_error_is_counted_and_the_rest_of_its_conversation_is_not_sent():
    result, bodies = run(one_phase(chat("busy", "next", cid="a"), chat("fine", cid="b")))
    recs = {r.key: r for r in result.records}
    assert recs["a/0"].error == "HTTP 429: try later" and "earlier turn failed" in recs["a/1"].error
    assert recs["b/0"].ok and len(bodies) == 2


def test_a_stream_error_event_fails_the_request_keeping_what_arrived():
    result, _ = run(one_phase(chat("broken")))
    (r,) = result.records
    assert not r.ok and "engine died" in r.error and r.text == "reply"


def test_a_request_that_never_answers_times_out_within_the_client_timeout():
    result, _ = run(one_phase(chat("hang"), chat("quick", cid="d")), timeout_s=0.5, concurrency=2)
    recs = {r.key: r for r in result.records}
    assert recs["c/0"].timed_out and recs["c/0"].e2e_s < 2 and recs["d/0"].ok


def test_token_id_prompts_go_to_completions_with_ignore_eos_and_the_seed():
    work = one_phase(wl.Conversation("t", (wl.Turn(prompt_ids=(5, 6, 7), max_tokens=3, ignore_eos=True),)))
    result, bodies = run(work, seed=7)
    assert result.records[0].ok and result.records[0].text == "reply-3"
    assert bodies[0]["prompt"] == [5, 6, 7] and bodies[0]["ignore_eos"] is True and bodies[0]["seed"] == 7


def test_phases_run_one_after_another_and_open_loop_arrivals_are_honoured():
    work = wl.Workload("w", (wl.Phase("first", (chat("a", cid="a"),)),
                             wl.Phase("second", (wl.Conversation("b", (wl.Turn("b"),), arrival_s=0.3),))))
    result, _ = run(work)
    a, b = result.records
    assert (a.phase, b.phase) == ("first", "second")
    assert b.start_s >= a.start_s + a.e2e_s + 0.3 * 0.9
    assert [p for p, _ in result.phases] == ["first", "second"]


def test_closed_loop_keeps_at_most_concurrency_conversations_in_flight():
    result, _ = run(one_phase(*(chat("x", cid=f"c{i}") for i in range(4))), concurrency=2)
    starts = sorted(r.start_s for r in result.records)
    assert starts[2] - starts[0] >= GAP_S * 3  # the third waited for one of the first two


def test_the_command_writes_json_markdown_plots_and_a_side_by_side_table(tmp_path, capsys):
    async def go():
        async with FakeServer() as a, FakeServer() as b:
            argv = ["--target", f"one={a.url}", "--target", f"two={b.url}/v1", "--workload", "multi-turn",
                    "--conversations", "2", "--turns", "2", "--max-tokens", "4", "--out", str(tmp_path), "--quiet"]
            return await asyncio.to_thread(serve.main, argv)

    assert asyncio.run(go()) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["one", "two"]
    assert data["runs"][0]["summary"]["ok"] == 4 and len(data["runs"][1]["records"]) == 4
    assert "| one |" in (tmp_path / "summary.md").read_text()
    pytest.importorskip("matplotlib")
    assert all((tmp_path / f).stat().st_size > 1000 for f in ("ttft_cdf.png", "itl_cdf.png", "timeline.png"))
    out = capsys.readouterr().out
    assert "TTFT p50/p90/p99 ms" in out and "one" in out and "two" in out


def test_an_unreachable_target_is_a_clear_error(capsys):
    from tests.ports import refusing_port

    with refusing_port() as port:
        assert serve.main(["--target", f"http://127.0.0.1:{port}", "--quiet", "--out", "/tmp/unused"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_goodput_of_a_run_uses_the_slo():
    result, _ = run(one_phase(chat("a", cid="a"), chat("b", cid="b")))
    assert result.summary(SLO(ttft_s=10, itl_s=10))["slo_met"] == 2
    assert result.summary(SLO(ttft_s=0.001, itl_s=10))["slo_met"] == 0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _records() -> list[RequestRecord]:
    return [RequestRecord("c/0", ttft_s=0.1), RequestRecord("c/1", ttft_s=0.3), RequestRecord("c/2", error="boom")]


def test_progress_on_a_terminal_shows_done_errors_and_ttft_p50(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    bar = serve.Progress(3, "run", enabled=True)
    for rec in _records():
        bar.update(rec)
    bar.close()
    out = term.getvalue()
    assert "run" in out and "3/3" in out and "errors 1 TTFT p50 200 ms" in out


@pytest.mark.parametrize("enabled, stderr", [(False, _Terminal), (True, io.StringIO)])
def test_progress_is_silent_when_quiet_or_stderr_is_not_a_terminal(monkeypatch, enabled, stderr):
    out = stderr()
    monkeypatch.setattr("sys.stderr", out)
    bar = serve.Progress(3, "run", enabled=enabled)
    for rec in _records():
        bar.update(rec)
    bar.close()
    assert out.getvalue() == ""


def test_an_event_streams_text_is_read_from_its_json_however_it_is_spaced():
    from app.bench.serve import sse_text

    for line in (b'data: {"choices":[{"index":0,"delta":{"content":"Par"}}]}\n',
                 b'data: {"choices": [{"index": 0, "delta": {"content": "Par"}}]}\n'):
        assert sse_text(line) == "Par"
    assert sse_text(b'data: {"choices":[{"text":" x","index":0}]}') == " x"  # a completion's
    for line in (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n', b"data: [DONE]\n", b"\n",
                 b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n', b": keep-alive\n"):
        assert sse_text(line) == ""
