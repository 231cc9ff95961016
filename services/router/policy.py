"""Which instance serves a request. First policy: the longest cached prefix, then the least loaded."""

from __future__ import annotations

from services.router.registry import Instance


def prefix_then_load(candidates: list[Instance], matched_blocks: dict[str, int]) -> Instance:
    return min(candidates, key=lambda i: (-matched_blocks.get(i.id, 0), i.queue_depth,
                                          i.beat.load.get("waiting_tokens", 0), i.id))
