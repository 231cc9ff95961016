"""The router's hit attribution (``kvmesh.routing.hits``): what it heard of every block, what it knew when it
routed each request, and, when the request finishes, why each prompt token it did not reuse was computed.

The router hears the engines' KV events (``kv.events.>``, core NATS: a gap only blurs an explanation) into a
``BlockHistory`` — where each block is held and where it was last removed — and keeps which namespaces each
block's tokens were seen under (``Namespaces``, keyed by the namespace-free chain of the prompt). Each finished
request gets ``kvmesh.hit.*`` attributes on its root span (``kvmesh trace --why`` reads them, ``kvmesh report
hits`` sums them) and its missed tokens by cause in ``kvmesh_router_missed_prefill_tokens_total``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.contracts.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.contracts.messages import KVEventBatch, Message
from kvmesh.routing.hits import Attribution, BlockHistory, Cause, Explainer, Namespaces, RouteView, attribute
from opentelemetry.trace import Span

MAX_KEYS_ATTRIBUTE = 4096  # block keys recorded on a span (what ``kvmesh report hits`` replays for its optimum)


@dataclass
class Routed:
    """One dispatch as hit attribution needs it: filled in by the route, then by the dispatch's replies."""

    keys: Sequence[int]
    plain: Sequence[int]
    seed: int
    compute: str = ""
    indexed: dict[str, int] = field(default_factory=dict)
    recent: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    at: float = 0.0
    unconvertible: str = ""
    pool_fetch: str = ""
    fallback: str = ""
    scored: bool = False  # the request scored its prompt (prompt_logprobs): nothing of it could be reused


class HitLedger:
    def __init__(self, block_size: int, max_keys: int = 200_000) -> None:
        self.block_size = block_size
        self.history = BlockHistory(max_keys)
        self.namespaces = Namespaces(max_keys)

    async def on_events(self, msg: Message, headers: dict[str, str]) -> None:
        if not isinstance(msg, KVEventBatch):
            return
        for e in msg.events:
            if isinstance(e, BlockStored):
                self.history.stored(msg.instance_id, e.tier, e.block_keys, msg.ts)
            elif isinstance(e, BlockRemoved):
                self.history.removed(msg.instance_id, e.tier, e.block_keys, msg.ts, e.reason)
            elif isinstance(e, AllBlocksCleared):
                self.history.cleared(msg.instance_id, msg.ts)

    def routing(self, seed: int, keys: Sequence[int], plain: Sequence[int]) -> Routed:
        """A dispatch of a prompt whose block keys are ``keys`` under ``seed`` and ``plain`` under seed 0
        (``kvmesh.contracts.keys.block_keys_and_plain``) is being routed."""
        return Routed(list(keys), plain, seed, at=time.time())

    def settle(self, routed: Routed, prompt_tokens: int, delivered: int) -> Attribution:
        """The request ended having reused ``delivered`` of its ``prompt_tokens``: its attribution. Its tokens
        count as seen under its namespace from now on."""
        view = RouteView(routed.compute, routed.indexed, routed.recent, routed.reason, routed.at,
                         routed.pool_fetch, routed.fallback, routed.unconvertible,
                         lambda lo, hi: self.namespaces.shared(routed.plain, routed.seed, lo, hi))
        keys = routed.keys[:prompt_tokens // self.block_size]
        explain = _scored if routed.scored else Explainer(view, self.history, keys)
        att = attribute(prompt_tokens, self.block_size, keys, delivered, explain,
                        0 if routed.scored else view.predicted_blocks() * self.block_size, routed.compute)
        self.namespaces.saw(routed.plain[:len(keys)], routed.seed)
        return att


def _scored(i: int, key: int) -> tuple[Cause, str]:
    """Every full block of a prompt that scored itself: computed whole, by design."""
    return Cause.SCORED, ""


def record(span: Span, att: Attribution, keys: Sequence[int], block_size: int) -> None:
    """The attribution as the root span's ``kvmesh.hit.*`` attributes; ``keys``: the blocks the request left
    (prompt and output), which ``kvmesh report hits`` replays through the offline optimum."""
    if not span.is_recording():
        return
    span.set_attributes({
        "kvmesh.hit.instance": att.instance,
        "kvmesh.hit.block_size": block_size,
        "kvmesh.hit.prompt_tokens": att.prompt_tokens,
        "kvmesh.hit.predicted_tokens": att.predicted_tokens,
        "kvmesh.hit.delivered_tokens": att.delivered_tokens,
        "kvmesh.hit.missed_tokens": att.missed_tokens,
        "kvmesh.hit.causes": [f"{c}={n}" for c, n in att.by_cause().items()],
        "kvmesh.hit.why": att.lines(),
        "kvmesh.hit.keys": " ".join(f"{k:x}" for k in keys[:MAX_KEYS_ATTRIBUTE]),
    })
