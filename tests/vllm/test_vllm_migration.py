"""A vLLM instance continues a stream another instance started: on a vLLM-only mesh, the instance serving a greedy
stream is killed at token 10 of 40 and the client's stream goes on, with the tokens of an uninterrupted run: its
presence, frequency and repetition penalties counting the 10 tokens streamed before the cut (``kvmesh.vllm
.penalties``), its ``min_tokens`` counted from the stream's start."""

from __future__ import annotations

import re
import signal
import time

import pytest
from kvmesh.client import KvmeshClient

from tests.vllm.conftest import vllm_stack

pytestmark = pytest.mark.vllm
HANG = "fault injection: the stream hangs after"
PROMPT = [(i * 7919) % 30000 + 100 for i in range(24)]
# penalties strong enough that a continuation which forgot the first 10 tokens picks others; min_tokens past what is
# left after the cut (30), which vLLM refuses unless it counts from the stream's start
SAMPLING = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "presence_penalty": 0.6,
            "frequency_penalty": 0.9, "repetition_penalty": 1.1, "min_tokens": 35}


def hung_instance(stack, request_id: str, within_s: float = 120.0):
    """The instance whose stream of ``request_id`` hangs (``fault_hang_after_tokens``), once it logged so."""
    deadline = time.monotonic() + within_s
    while True:
        # an instance knows the request by its dispatch id, <tenant hash>.<client id>.<nonce>
        hung = [s for s in stack.services if s.name.startswith("both-") and re.search(
            rf"request [0-9a-f]+\.{re.escape(request_id)}\.[0-9a-f]+: {HANG}", s.log_path.read_text())]
        if hung:
            return hung[0]
        assert time.monotonic() < deadline, f"no instance hung on {request_id}"
        time.sleep(0.1)


def test_a_vllm_instance_killed_at_token_10_of_40_costs_no_token(tmp_path_factory):
    """Both instances' fresh streams hang after 10 tokens (test-only fault); the one serving the request is
    SIGKILLed there. The router migrates it (prompt + the 10 tokens) to the other vLLM instance, which continues
    it: the client gets the uninterrupted run's 40 tokens and text, penalties and all."""
    stack = vllm_stack(tmp_path_factory, "vllm-migrate", both=2, instance={"fault_hang_after_tokens": 10})
    try:
        chunks, killed = [], ""
        with KvmeshClient(stack.router_grpc, timeout_s=300, retries=0) as client:
            for chunk in client.generate(PROMPT, request_id="migrate-me", **SAMPLING):
                chunks.append(chunk)
                if not killed and sum(len(c.token_ids) for c in chunks) == 10:
                    victim = hung_instance(stack, "migrate-me")
                    victim.proc.send_signal(signal.SIGKILL)
                    killed = victim.name
    finally:
        stack.stop()
    tokens = [t for c in chunks for t in c.token_ids]
    assert killed and len(tokens) == 40 and chunks[-1].finished
    assert (tokens, "".join(c.text for c in chunks)) == uninterrupted(tmp_path_factory)


def uninterrupted(tmp_path_factory) -> tuple[list[int], str]:
    """The same request on one vLLM instance with no fault: its 40 greedy tokens and text."""
    stack = vllm_stack(tmp_path_factory, "vllm-reference", both=1)
    try:
        with KvmeshClient(stack.router_grpc, timeout_s=300) as client:
            out = client.complete(PROMPT, **SAMPLING)
        return list(out.token_ids), out.text
    finally:
        stack.stop()
