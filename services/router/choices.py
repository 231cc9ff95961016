"""``n`` > 1: one request, several independent answers (OpenAI's ``n``), its prompt computed once.

The first choice goes out as any request does. The others wait for its first chunk: by then the instance it ran
on holds the prompt's KV (a role-both instance computed it; a decode instance received it from prefill), and the
router routes each of them like a request of that prompt, to where it is cached: its instance computes only the
last, partial block. They differ as separate requests do: each its own dispatch id, and, when the request has a
seed, seed + i (a request with a seed still answers the same n choices every time). A later choice belongs to no
session (the first one speaks for the turn) and traces under the request's root, tagged with its index
(``RequestTrace.choice``). A choice that fails fails the request: the others are cancelled.
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
    """Choice ``index``'s request: its own dispatch id, seed + index, no session."""
    seed = request.sampling.seed
    sampling = (request.sampling if seed is None
                else dataclasses.replace(request.sampling, seed=(seed + index) % 2**64))
    return dataclasses.replace(request, sampling=sampling, session=None,
                               dispatch_id=dispatch_id(request.tenant, request.request_id))


async def fan_out(router: Router, request: Admitted, rt: RequestTrace, n: int) -> AsyncIterator[tuple[int, Chunk]]:
    """The chunks of ``request``'s ``n`` choices as ``(index, chunk)``, as they come."""
    if n == 1:
        async for c in router.generate(request, rt):
            yield 0, c
        return
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()
    first = asyncio.Event()  # choice 0 sent a chunk: its prompt's KV is in place

    async def run(index: int, req: Admitted, trace: RequestTrace) -> None:
        try:
            async for c in router.generate(req, trace):
                first.set()
                await queue.put((index, c))
            await queue.put((index, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, e))

    async def later() -> None:
        await first.wait()
        for i in range(1, n):
            tasks.append(asyncio.create_task(run(i, sibling(request, i), rt.choice(i))))

    tasks = [asyncio.create_task(run(0, request, rt))]
    starter = asyncio.create_task(later())
    try:
        left = n
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        starter.cancel()
        for t in tasks:
            t.cancel()
