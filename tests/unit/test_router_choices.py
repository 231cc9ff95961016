"""``n`` > 1 (``services/router/choices.py``): the later choices go out only once the first one sent a chunk (its
prompt's KV is then where the router will send them), each its own dispatch id and seed + i, in no session; the
chunks come back tagged with their choice; a choice that fails fails the request and cancels the others."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from kvmesh.contracts.engine import SessionHint, TokenLogprobs
from kvmesh.contracts.sampling import SamplingParams

from services.router.choices import fan_out, sibling
from services.router.core import Chunk
from services.router.errors import ErrorKind, RequestError
from services.router.intake import Admitted
from services.router.telemetry import RequestTrace

REQUEST = Admitted("r1", (1, 2, 3), SamplingParams(max_tokens=2, temperature=0.8, seed=2**64 - 1), "t", "t\x00",
                   "m", session=SessionHint("t/s"), dispatch_id="ab.r1.0011")


class FakeRouter:
    """Each request streams two chunks; ``log`` says when each started and sent; ``fail``: the choice whose
    seed this is raises after its first chunk."""

    def __init__(self, fail: int | None = None) -> None:
        self.log: list[str] = []
        self.requests: list[Admitted] = []
        self.fail = fail
        self.cancelled = 0

    async def generate(self, request: Admitted, rt: RequestTrace):
        self.requests.append(request)
        name = request.dispatch_id
        self.log.append(f"start {name}")
        try:
            await asyncio.sleep(0.01)
            self.log.append(f"chunk {name}")
            scored = request.sampling.prompt_logprobs is not None
            yield Chunk([7], "a", prompt_logprobs=(TokenLogprobs(2, -1.0, (), 3),) if scored else ())
            if request.sampling.seed == self.fail:
                raise RequestError(ErrorKind.UNAVAILABLE, "instance gone")
            await asyncio.sleep(0.01)
            yield Chunk([8], "b", True, "length")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def collect(router: FakeRouter, n: int) -> list[tuple[int, str]]:
    async def body() -> list[tuple[int, str]]:
        rt = RequestTrace(None, "r1", "test")
        return [(i, c.text) async for i, c in fan_out(router, [(REQUEST, rt)], n)]  # type: ignore[arg-type]

    return asyncio.run(body())


def test_later_choices_start_after_the_first_sent_a_chunk_and_differ_as_separate_requests():
    router = FakeRouter()
    got = collect(router, 3)
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")]
    first = REQUEST.dispatch_id
    assert router.log.index(f"chunk {first}") < min(i for i, e in enumerate(router.log) if e.startswith("start")
                                                   and first not in e)
    later = router.requests[1:]
    assert [r.sampling.seed for r in router.requests] == [2**64 - 1, 0, 1]  # seed + i, wrapped
    assert len({r.dispatch_id for r in router.requests}) == 3 and all(r.session is None for r in later)
    assert all(r.prompt == REQUEST.prompt and r.request_id == "r1" for r in later)


def test_one_choice_is_the_request_itself():
    router = FakeRouter()
    assert collect(router, 1) == [(0, "a"), (0, "b")] and router.requests == [REQUEST]


def test_a_failing_choice_fails_the_request_and_cancels_the_others():
    router = FakeRouter(fail=0)  # choice 1's seed: 2**64 - 1 + 1 wrapped
    with pytest.raises(RequestError, match="instance gone"):
        collect(router, 3)
    assert router.cancelled >= 1


def test_the_prompt_is_scored_by_the_first_choice_alone_and_every_choice_carries_its_logprobs():
    """A scored prompt reuses no cache: the later choices, sent to where its KV now is, do not score it again."""
    scored = dataclasses.replace(REQUEST, sampling=dataclasses.replace(REQUEST.sampling, prompt_logprobs=0))
    router = FakeRouter()

    async def body() -> list[tuple[int, Chunk]]:
        return [(i, c) async for i, c in fan_out(router, [(scored, RequestTrace(None, "r1", "test"))], 3)]  # type: ignore[arg-type]

    got = asyncio.run(body())
    assert [r.sampling.prompt_logprobs for r in router.requests] == [0, None, None]
    for i in range(3):
        first, second = [c for j, c in got if j == i]
        assert first.prompt_logprobs == (TokenLogprobs(2, -1.0, (), 3),) and second.prompt_logprobs == ()


def test_an_unseeded_request_stays_unseeded():
    unseeded = Admitted("r", (1,), SamplingParams(temperature=1.0), "t", "t\x00", "m", dispatch_id="x.r.1")
    assert sibling(unseeded, 2).sampling.seed is None and sibling(unseeded, 2).dispatch_id != "x.r.1"


def test_a_batch_of_prompts_fans_out_each_with_its_n_choices_in_prompt_order():
    router = FakeRouter()
    other = Admitted("r1", (4, 5), REQUEST.sampling, "t", "t\x00", "m", dispatch_id="cd.r1.0022")

    async def body() -> list[tuple[int, str]]:
        rt = RequestTrace(None, "r1", "test")
        batch = [(REQUEST, rt), (other, rt.choice(2, prompt=True))]
        return [(i, c.text) async for i, c in fan_out(router, batch, 2)]  # type: ignore[arg-type]

    got = asyncio.run(body())
    assert sorted(got) == [(i, t) for i in range(4) for t in "ab"]
    firsts = {REQUEST.dispatch_id, other.dispatch_id}
    starts = [e for e in router.log if e.startswith("start")]
    assert {e.split()[1] for e in starts[:2]} == firsts  # every prompt's first choice at once
    prompts = [r.prompt for r in router.requests]
    assert sorted(prompts) == sorted([(1, 2, 3), (1, 2, 3), (4, 5), (4, 5)])
    for r in router.requests[2:]:  # each later choice after its own prompt's first chunk
        first = REQUEST.dispatch_id if r.prompt == REQUEST.prompt else other.dispatch_id
        assert router.log.index(f"chunk {first}") < router.log.index(f"start {r.dispatch_id}")
