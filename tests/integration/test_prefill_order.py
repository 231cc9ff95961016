"""``engine.prefill_order = least_work`` through a real stack (router HTTP, NATS, an engine instance, the tiny
random model): a request whose prompt is mostly cached, sent while a long cold prompt is being prefilled, is
answered before that prompt has its first token. Under ``arrival`` it could not be: a running prefill's chunks
go before any waiting prompt (``tests/unit/test_prefill_order.py`` shows both orders on one engine)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest

from .test_router_bad_input import TinyMesh, model_dir  # noqa: F401 - model_dir: a fixture

PREFIX = [(i * 37) % 240 + 3 for i in range(64)]
COLD = [(i * 53) % 240 + 5 for i in range(480)]  # 120 steps of 4 tokens


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir, roles=("both",),
                  engine={"prefill_order": "least_work", "max_batched_tokens": 4}) as m:
        yield m


def complete(mesh: TinyMesh, prompt: list[int]) -> openai.types.Completion:
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused", max_retries=0,
                        timeout=120)
    return api.completions.create(model=mesh.router.model_id, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"ignore_eos": True})


def cold_state(mesh: TinyMesh) -> tuple[int, int] | None:
    """The cold prompt's (computed tokens, output tokens) on the engine; None while it is not running there."""
    def read(e):
        return next(((s.num_computed_tokens, len(s.output_token_ids)) for s in e.scheduler.running
                     if s.num_tokens >= len(COLD)), None)
    return mesh.call(mesh.workers[0].engine.call(read))


def test_a_mostly_cached_prompt_is_served_while_a_long_cold_one_is_still_prefilling(mesh):
    complete(mesh, [*PREFIX, 1])  # the prefix is now cached on the instance
    cold = threading.Thread(target=complete, args=(mesh, COLD), daemon=True)
    cold.start()
    deadline = time.monotonic() + 60
    while (state := cold_state(mesh)) is None or state[0] == 0:  # wait until its prefill is under way
        assert time.monotonic() < deadline and cold.is_alive(), "the cold prompt never started its prefill"
        time.sleep(0.005)
    warm = complete(mesh, [*PREFIX, 2, 3])
    after = cold_state(mesh)
    assert warm.usage.prompt_tokens_details.cached_tokens >= len(PREFIX) - 4  # it was served from the cache
    assert after is not None and after[1] == 0 and after[0] < len(COLD), \
        f"the cold prompt had its first token before the cached one was answered: {after}"
    cold.join(120)
    assert not cold.is_alive()
