"""Dying processes cost one request at most, never the service (real processes, real nats-server)."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from .conftest import start_stack

pytestmark = pytest.mark.slow


def service(stack, name: str):
    return next(s for s in stack.services if s.name == name)


def chat(stack, content: str, max_tokens: int = 8, timeout: float = 120) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{stack.opts.http_port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def stream_events(stack, content: str, max_tokens: int, events: list, started: threading.Event) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{stack.opts.http_port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if b'"content": "' in line:
                        started.set()
    except Exception as e:  # noqa: BLE001 - recorded for the assertion
        events.append(repr(e).encode())
    started.set()


def test_killing_a_decode_mid_stream_fails_only_its_stream(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "killdecode", decode=2)
    try:
        runs = []
        for i in range(2):  # the router spreads two idle-time requests over the two decode instances
            events, started = [], threading.Event()
            t = threading.Thread(target=stream_events, args=(stack, f"Count to one hundred, take {i}.", 48,
                                                             events, started))
            t.start()
            started.wait(60)
            runs.append((t, events))
        service(stack, "decode-0").proc.send_signal(signal.SIGKILL)
        for t, _ in runs:
            t.join(120)
        outcomes = [b"[DONE]" in ev[-1:] and not any(b'"error"' in e for e in ev) for _, ev in runs]
        assert sorted(outcomes) == [False, True]  # one stream failed, the other finished
        failed = next(ev for (_, ev), ok in zip(runs, outcomes) if not ok)
        assert any(b'"error"' in e and b"decode-0" in e for e in failed)
        time.sleep(4)  # the router drops decode-0 after instance_timeout_s (3 s) without heartbeats
        for q in ("What is 2 + 2?", "Name a color."):
            assert chat(stack, q)["choices"][0]["message"]["content"]
    finally:
        stack.stop()


def test_killing_the_cache_service_degrades_routing_to_load(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "killcache")
    try:
        first = chat(stack, "What is the capital of Italy?")
        service(stack, "cachesvc").proc.send_signal(signal.SIGKILL)
        again = chat(stack, "What is the capital of Italy?")
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # prefill's own cache still hits
    finally:
        stack.stop()


def test_a_dead_prefill_costs_latency_not_the_answer(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "killprefill", env={"KVMESH_KV_TIMEOUT_S": "2"})
    try:
        expected = chat(stack, "Say hello in French.")["choices"][0]["message"]["content"]
        service(stack, "prefill-0").proc.send_signal(signal.SIGKILL)
        # until missed heartbeats drop it, the router may still pick the dead prefill: decode recomputes
        got = chat(stack, "Say hello in French.")
        assert got["choices"][0]["message"]["content"] == expected
    finally:
        stack.stop()


def test_every_request_has_a_deadline(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "deadline", env={"KVMESH_REQUEST_TIMEOUT_S": "1.5"})
    try:
        body = json.dumps({"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{stack.opts.http_port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 503 and "DEADLINE_EXCEEDED" in json.load(err.value)["error"]["message"]
        assert time.monotonic() - t0 < 10
        assert chat(stack, "Hi", max_tokens=2)["choices"][0]["message"]["content"]  # still serving
    finally:
        stack.stop()
