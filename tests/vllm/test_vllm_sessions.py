"""Sessions on a vLLM instance: a paused session's KV, pushed out of vLLM's prefix cache by other traffic, comes
back from the pool when the session resumes, while a prompt of no session written back at the same time is
gone (so what kept the session's blocks was its pause, not room in the pool)."""

from __future__ import annotations

import random

import pytest
from kvmesh.client import KvmeshClient

from app.bench.vllm_servers import POOL_FETCH, instance_metric
from tests.vllm.conftest import vllm_stack
from tests.vllm.test_vllm_stack import eventually, matches

pytestmark = pytest.mark.vllm
CONTEXT = 512  # tokens: 4 vLLM blocks of 128, 32 kvmesh blocks (23.6 MB of fp32 KV)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One vLLM instance whose cache holds about two such contexts, a pool (session eviction) about 2.7."""
    s = vllm_stack(tmp_path_factory, "vllm-sessions", both=1, engine={"num_blocks": 72, "max_model_len": 1024},
                   cachesvc={"pool_capacity_mb": 64, "pool_eviction": "session"}, router={"api_keys": {"sk-t": "t0"}})
    yield s
    s.stop()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def pool_blocks(stack, prompt: list[int]) -> int:
    return next((m.num_blocks for m in matches(stack, prompt) if m.instance_id == "pool"), 0)


def test_a_paused_sessions_kv_comes_back_from_the_pool_after_vllm_evicted_it(stack):
    rng = random.Random(5)
    agent, stranger = tokens(rng, CONTEXT), tokens(rng, CONTEXT)
    metrics = next(s.endpoints["metrics"] for s in stack.services if s.name.startswith("both"))
    with KvmeshClient(stack.router_grpc, api_key="sk-t") as c:
        first = c.complete(agent, max_tokens=4, temperature=0, ignore_eos=True, session_id="agent-1",
                           session_pause_s=120)
        assert eventually(lambda: pool_blocks(stack, agent) == CONTEXT // 16), "turn 1 was not written back"
        c.complete(stranger, max_tokens=4, temperature=0, ignore_eos=True)  # no session: LRU order only
        assert eventually(lambda: pool_blocks(stack, stranger) == CONTEXT // 16)
        for _ in range(4):  # other traffic: out of vLLM's cache and, written back, pressing on the pool
            c.complete(tokens(rng, CONTEXT), max_tokens=1, temperature=0)
        before = instance_metric(metrics, *POOL_FETCH)
        resumed = c.complete(agent + first.token_ids + tokens(rng, 32), max_tokens=4, temperature=0,
                             ignore_eos=True, session_id="agent-1", session_end=True)
        fetched = instance_metric(metrics, *POOL_FETCH) - before
        again = c.complete(stranger + tokens(rng, 32), max_tokens=4, temperature=0, ignore_eos=True)
    assert resumed.usage.cached_tokens >= 0.9 * CONTEXT, resumed.usage
    assert fetched > 0, "the resumed turn's KV did not come from the pool"
    assert again.usage.cached_tokens == 0, "the pool had room for everything: the test shows nothing"
