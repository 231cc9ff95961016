"""One tenant's cached prefix gives another tenant nothing, not even time: on the real stack (API keys on, the
real model, cachesvc and its pool), a prompt another tenant has just sent takes as long as a cold one, while
the same tenant's repeat is much faster."""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
import uuid

import pytest

from .conftest import start_stack

pytestmark = pytest.mark.slow

KEYS = {"alice": "sk-alice-e2e", "bob": "sk-bob-e2e"}
BLOCK = 16  # a hit shorter than one block is a chance common start, not a reused prefix
COLORS = ["red", "green", "blue", "amber", "violet", "grey", "white", "black"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    env = {"KVMESH_ROUTER_API_KEYS": ",".join(f"{key}:{tenant}" for tenant, key in KEYS.items())}
    stack = start_stack(tmp_path_factory, "tenants", env=env)
    yield stack
    stack.stop()


def prompt() -> str:
    """About 600 tokens that begin unlike any earlier prompt, but for a chance common token or two."""
    lines = [f"Item {i}: the {COLORS[i % 8]} box on shelf {i % 5} holds {i * 7} marbles." for i in range(40)]
    return f"Inventory {uuid.uuid4().hex}.\n" + "\n".join(lines) + "\nHow many marbles are there in all?"


def first_token(stack, tenant: str | None, text: str) -> tuple[float, dict]:
    """Seconds to the first (and only) token of a completion of ``text`` as ``tenant``, and the usage."""
    headers = {"content-type": "application/json"}
    if tenant:
        headers["authorization"] = f"Bearer {KEYS[tenant]}"
    body = json.dumps({"prompt": text, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/completions", data=body,
                                 headers=headers)
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        body = json.load(r)
    return time.perf_counter() - start, body["usage"]


def test_keys_are_required(stack):
    with pytest.raises(urllib.error.HTTPError) as e:
        first_token(stack, None, "Hello")
    assert e.value.code == 401


def test_a_foreign_prefix_is_no_faster_than_a_cold_prompt(stack):
    for tenant in KEYS:  # warm both tenants' paths (first-call costs) on prompts no one reuses
        first_token(stack, tenant, prompt())
    cold, warm, foreign = [], [], []
    for _ in range(2):
        shared = prompt()
        t, usage = first_token(stack, "alice", shared)
        assert usage["prompt_tokens_details"]["cached_tokens"] < BLOCK
        assert 500 <= usage["prompt_tokens"] <= 900
        cold.append(t)
        t, usage = first_token(stack, "alice", shared)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16
        warm.append(t)
        t, usage = first_token(stack, "bob", shared)
        assert usage["prompt_tokens_details"]["cached_tokens"] < BLOCK
        foreign.append(t)
        t, usage = first_token(stack, "bob", prompt())
        assert usage["prompt_tokens_details"]["cached_tokens"] < BLOCK
        cold.append(t)
    cold_s, warm_s, foreign_s = statistics.median(cold), statistics.median(warm), statistics.median(foreign)
    report = f"cold {cold_s:.3f} s, same tenant {warm_s:.3f} s, other tenant {foreign_s:.3f} s"
    print(report)
    assert warm_s <= 0.5 * cold_s, report
    assert foreign_s >= 0.6 * cold_s, report
