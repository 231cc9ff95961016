"""Router replicas (``kvmesh up --routers 2``): stack.json names them, they spread concurrent load over the decode
instances as one router does (their in-flight counts shared over NATS), and killing one costs no request: new
ones go through the other, and a stream it was serving is resumed there by the SDK."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import pytest
from kvmesh.client import KvmeshClient
from kvmesh.state import StackInfo

from .conftest import start_stack
from .test_faults import HANG, PROMPT, greedy_reference

pytestmark = pytest.mark.slow


def stream_and_hang(http: str, content: str, opened: list) -> None:
    """Open a streamed chat completion (its decode hangs after a token: the fault) and keep it open until the
    test closes the response."""
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 64, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{http}/v1/chat/completions", data=body, headers={"content-type": "application/json"})
    opened.append(urllib.request.urlopen(req, timeout=300))


def hung_per_decode(stack) -> dict[str, int]:
    return {s.name: s.log_path.read_text().count(HANG) for s in stack.services if "decode" in s.name}


def test_two_routers_are_named_in_stack_json(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "replicas-json", routers=2)
    try:
        info = StackInfo.read(stack.state_dir)
        assert {"router-0", "router-1"} <= set(info.endpoints) and "router" not in info.endpoints
        assert all(info.endpoints[r]["http"].startswith("http://") for r in ("router-0", "router-1"))
        assert {"router-0", "router-1"} <= set(info.pids)
        assert info.router_grpcs == [info.endpoints["router-0"]["grpc"], info.endpoints["router-1"]["grpc"]]
        for r in ("router-0", "router-1"):
            with urllib.request.urlopen(f"{info.endpoints[r]['http']}/health", timeout=10) as resp:
                assert json.load(resp)["instances"] == 2
    finally:
        stack.stop()


def test_two_routers_under_concurrent_load_do_not_herd(tmp_path_factory):
    """Three streams through each router at once, each held open by its decode (it hangs after one token: the
    fault), so every one is in flight at the end: the two decodes hold them within 1.5x of each other, so 3 and
    3. (Replicas blind to each other that break ties alike would each send 2 + 1 to the same pair: 4 and 2.)"""
    stack = start_stack(tmp_path_factory, "replicas-load", decode=2, routers=2,  # held open: no watchdog
                        env={"KVMESH_INSTANCE_FAULT_HANG_AFTER_TOKENS": "1",
                             "KVMESH_ROUTER_INTER_TOKEN_TIMEOUT_S": "0"})
    opened: list = []
    try:
        threads = [threading.Thread(target=stream_and_hang, args=(r.endpoints["http"], f"Tell story {i}.", opened))
                   for i in range(3) for r in stack.routers]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 240
        while sum(hung_per_decode(stack).values()) < 6:  # every stream reached its decode and hangs there
            assert time.monotonic() < deadline, f"not every stream is in flight: {hung_per_decode(stack)}"
            time.sleep(0.2)
        counts = sorted(hung_per_decode(stack).values())
        assert counts[1] <= 1.5 * counts[0], f"the replicas herded: {hung_per_decode(stack)}"
    finally:
        for resp in opened:
            resp.close()
        stack.stop()


def test_a_router_killed_costs_no_request(tmp_path_factory):
    """A stream through router-0 hangs after 5 tokens at its decode (the fault); router-0 is SIGKILLed there. The
    SDK resumes it on router-1 with the 5 tokens (a continuation: it does not hang) and gets all 30, equal to
    the uninterrupted greedy run; new requests keep succeeding through router-1."""
    stack = start_stack(tmp_path_factory, "replicas-kill", routers=2,
                        env={"KVMESH_INSTANCE_FAULT_HANG_AFTER_TOKENS": "5"})
    try:
        routers = [r.endpoints["grpc"] for r in stack.routers]
        tokens: list[int] = []
        with KvmeshClient(routers, timeout_s=240, backoff_s=0.05) as client:
            for chunk in client.generate(PROMPT, max_tokens=30, temperature=0, ignore_eos=True):
                tokens += chunk.token_ids
                if len(tokens) == 5:
                    stack.service("router-0").proc.send_signal(signal.SIGKILL)
            assert chunk.finished and chunk.usage.completion_tokens == 30
            # fresh requests, fewer tokens than the fault lets through, from this client and a new one
            assert all(client.complete("Name a fruit.", max_tokens=4).text for _ in range(3))
        with KvmeshClient(routers, timeout_s=60, backoff_s=0.05) as fresh:
            assert fresh.complete("Name a color.", max_tokens=4).text
        assert tokens == greedy_reference(PROMPT, 30)[0]
        with urllib.request.urlopen(f"{stack.service('router-1').endpoints['http']}/health", timeout=10) as resp:
            assert json.load(resp)["instances"] == 2
    finally:
        stack.stop()
