"""``n`` > 1: one request, several independent answers (OpenAI's ``n``), its prompt computed once.

The first choice goes out as any request does. The others wait for its first chunk: by then the instance it ran
on holds the prompt's KV (a role-both instance computed it; a decode instance received it from prefill), and the
router routes each of them like a request of that prompt, to where it is cached: its instance computes only the
last, partial block. They differ as separate requests do: each its own dispatch id, and, when the request has a
seed, seed + i (a request with a seed still answers the same n choices every time). A later choice belongs to no
session (the first one speaks for the turn) and traces under the request's root, tagged with its index
(``RequestTrace.choice``). The prompt's logprobs (``prompt_logprobs``), the same for every choice, are computed by
the first alone (a scored prompt reuses no cache); the others reuse its KV and carry its logprobs. A choice that
fails fails the request: the others are cancelled.

A completions batch (``prompt`` a list of several) is one request of several prompts, each admitted and routed
as a request of its own (its own slot, dispatch id and route) and each with its ``n`` choices, in the order of
the prompts (vLLM's: prompt j's choice i is choice ``j * n + i``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from services.router.access import dispatch_id
from services.router.core import Chunk, Router
from services.router.intake import Admitted
from services.router.telemetry import RequestTrace


def sibling(request: Admitted, index: int) -> Admitted:
    """Choice ``index``'s request: its own dispatch id, seed + index, no session, the prompt not scored again."""
    seed = request.sampling.seed
    sampling = dataclasses.replace(request.sampling, prompt_logprobs=None,
                                   seed=None if seed is None else (seed + index) % 2**64)
    return dataclasses.replace(request, sampling=sampling, session=None,
                               dispatch_id=dispatch_id(request.tenant, request.request_id))


async def fan_out(router: Router, requests: list[tuple[Admitted, RequestTrace]],
                  n: int) -> AsyncIterator[tuple[int, Chunk]]:
    """The chunks of ``n`` choices of each of ``requests`` (a completions batch holds several prompts; each
    with its trace) as ``(index, chunk)``, as they come: prompt j's choice i is index ``j * n + i``. Every
    prompt's first choice goes out at once; its others once that one sent a chunk."""
    if len(requests) == 1 and n == 1:
        request, rt = requests[0]
        async for c in router.generate(request, rt):
            yield 0, c
        return
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()
    firsts = [asyncio.Event() for _ in requests]  # prompt j's first choice sent a chunk: its KV is in place
    scored: list[tuple] = [() for _ in requests]  # prompt j's logprobs, from its first choice's first chunk

    async def run(index: int, req: Admitted, trace: RequestTrace) -> None:
        try:
            opening = True
            async for c in router.generate(req, trace):
                j = index // n
                if index % n == 0 and c.prompt_logprobs:
                    scored[j] = c.prompt_logprobs
                elif opening and scored[j]:
                    c = dataclasses.replace(c, prompt_logprobs=scored[j])
                opening = False
                firsts[j].set()
                await queue.put((index, c))
            await queue.put((index, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, e))

    async def later(j: int, request: Admitted, rt: RequestTrace) -> None:
        await firsts[j].wait()
        for i in range(1, n):
            tasks.append(asyncio.create_task(run(j * n + i, sibling(request, i), rt.choice(j * n + i))))

    tasks = [asyncio.create_task(run(j * n, request, rt)) for j, (request, rt) in enumerate(requests)]
    starters = [asyncio.create_task(later(j, request, rt)) for j, (request, rt) in enumerate(requests) if n > 1]
    try:
        left = n * len(requests)
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in starters + tasks:
            t.cancel()
