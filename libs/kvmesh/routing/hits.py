"""Hit attribution: for one request, the hit the router predicted, the hit the engine delivered, and why every
prompt token it computed was not served from a cache.

``attribute`` walks the prompt token by token range: the tokens the engine reused are the delivered hit, every
other one gets exactly one ``Cause``, so the causes add up to the missed prefill tokens (prompt − delivered) by
construction. The tokens past the last full block (a partial block has no key) and the prompt's last token (an
engine always computes it, for the first output's logits) are ``PARTIAL_BLOCK``; each other missed block asks
``explain`` (block index, key) → (cause, words) what the router knew. ``Explainer`` is that judgement from a
``RouteView`` (what the router saw when it routed) and a ``BlockHistory`` (the KV events it heard since).

Pure: the router (``services/router/hits.py``) and the simulator (``app/sim.py``) feed it their own facts.
"""

from __future__ import annotations

import enum
import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import NamedTuple

POOL = "pool"  # the cache service's own tiers, as the index names them


class Cause(enum.StrEnum):
    """Why a prompt token was computed rather than reused (one per token)."""

    NEVER_COMPUTED = "never_computed"      # no instance or tier of the cluster had its block before
    EVICTED = "evicted"                    # its block was stored, then removed (where, when, which tier)
    ROUTED_ELSEWHERE = "routed_elsewhere"  # another instance held it; the plan chose this one (its reason)
    INDEX_LAG = "index_lag"                # stored (or being computed) where the index did not yet say, at route
    STALE_INDEX = "stale_index"            # the index said the chosen instance held it; it no longer did
    NAMESPACE = "namespace"                # the same tokens are cached under another namespace (tenant, adapter)
    PARTIAL_BLOCK = "partial_block"        # past the last full block, or the last token (always computed)
    FETCH_FAILED = "fetch_failed"          # the pool (or a PD hand-off) had it; the transfer failed or was refused
    FETCH_SKIPPED = "fetch_skipped"        # the pool had it; fetching it was judged slower than recomputing
    LAYOUT = "layout"                      # held where its KV layout does not convert to the chosen instance's
    SCORED = "scored"                      # the request scored its prompt (prompt_logprobs): computed whole


WORDS = {
    Cause.NEVER_COMPUTED: "never computed in the cluster before",
    Cause.EVICTED: "evicted",
    Cause.ROUTED_ELSEWHERE: "held on another instance, routed elsewhere",
    Cause.INDEX_LAG: "index lag (stored after the route saw the index)",
    Cause.STALE_INDEX: "the index said the instance held it; it did not",
    Cause.NAMESPACE: "cached under another namespace (tenant salt, adapter or model)",
    Cause.PARTIAL_BLOCK: "partial last block / the last token (always computed)",
    Cause.FETCH_FAILED: "pool fetch or PD hand-off failed",
    Cause.FETCH_SKIPPED: "pool fetch judged slower than recompute",
    Cause.LAYOUT: "KV layout could not convert",
    Cause.SCORED: "the request asked for its prompt's logprobs (computed whole, by design)",
}


class Miss(NamedTuple):
    """A run of missed prompt tokens with one cause: blocks ``[first_block, last_block]``."""

    cause: Cause
    tokens: int
    first_block: int
    last_block: int
    detail: str = ""


@dataclass(frozen=True)
class Attribution:
    prompt_tokens: int
    predicted_tokens: int   # the router's view: what the chosen instance (and the pool) would reuse
    delivered_tokens: int   # what the engine reported it reused (cached_tokens)
    misses: tuple[Miss, ...]
    instance: str = ""

    @property
    def missed_tokens(self) -> int:
        return self.prompt_tokens - self.delivered_tokens

    def by_cause(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.misses:
            out[m.cause.value] = out.get(m.cause.value, 0) + m.tokens
        return out

    def lines(self) -> list[str]:
        """One line per miss run, in words."""
        out = []
        for m in self.misses:
            blocks = f"block {m.first_block}" if m.first_block == m.last_block else \
                f"blocks {m.first_block}-{m.last_block}"
            out.append(f"{m.tokens} tokens ({blocks}): {WORDS[m.cause]}" + (f" — {m.detail}" if m.detail else ""))
        return out


Explain = Callable[[int, int], tuple[Cause, str]]  # (block index, block key) -> cause, words


def attribute(prompt_tokens: int, block_size: int, keys: Sequence[int], delivered: int, explain: Explain,
              predicted: int = 0, instance: str = "") -> Attribution:
    """The causes of the ``prompt_tokens - delivered`` missed tokens (they add up exactly). ``keys``: the keys
    of the prompt's full blocks; ``delivered``: the tokens the engine reused (clipped to the prompt)."""
    delivered = max(0, min(delivered, prompt_tokens))
    full = min(len(keys), prompt_tokens // block_size)
    # tokens [partial_from, prompt) are the partial block's, or the last token
    partial_from = min(full * block_size, prompt_tokens - 1) if prompt_tokens else 0
    runs: list[Miss] = []
    # the open run (cause, detail, first block, last block, tokens) is kept in locals and closed into a Miss when
    # the next block's cause or words differ: a prompt's blocks mostly share one (this runs per finished request)
    cause: Cause | None = None
    detail, first, last, tokens = "", 0, 0, 0

    def add(c: Cause, d: str, a: int, b: int) -> None:
        """Blocks ``a`` .. ``b`` missed for one cause: the open run goes on, or closes and a new one opens."""
        nonlocal cause, detail, first, last, tokens
        n = min((b + 1) * block_size, partial_from) - max(a * block_size, delivered)
        if n <= 0:
            return
        b = min(b, (partial_from - 1) // block_size)  # a block left only its last token, which is the tail's
        if c is cause and d == detail:
            last, tokens = b, tokens + n
            return
        if cause is not None:
            runs.append(Miss(cause, tokens, first, last, detail))
        cause, detail, first, last, tokens = c, d, a, b, n

    if isinstance(explain, Explainer):  # a range of blocks at a time (``Explainer.spans``)
        for a, b, c, d in explain.spans(delivered // block_size, full):
            add(c, d, a, b)
    else:
        for i in range(delivered // block_size, full):
            add(*explain(i, keys[i]), i, i)
    if cause is not None:
        runs.append(Miss(cause, tokens, first, last, detail))
    tail = prompt_tokens - max(partial_from, delivered)
    if tail > 0:
        if runs and runs[-1].cause is Cause.PARTIAL_BLOCK and not runs[-1].detail and runs[-1].last_block + 1 >= full:
            runs[-1] = runs[-1]._replace(tokens=runs[-1].tokens + tail, last_block=full)
        else:
            runs.append(Miss(Cause.PARTIAL_BLOCK, tail, full, full, ""))
    att = Attribution(prompt_tokens, min(predicted, max(0, prompt_tokens - 1)), delivered, tuple(runs), instance)
    assert sum(m.tokens for m in runs) == att.missed_tokens, (runs, prompt_tokens, delivered)
    return att


# ---- what the router heard of each block ------------------------------------------------------------------------

class Held(NamedTuple):
    instance: str
    tier: str
    at: float  # wall clock
    reason: str = ""  # a removal's: the eviction policy, "quarantine", ...

    def tier_and_why(self) -> str:
        return f"{self.tier} tier" + (f" ({self.reason})" if self.reason else "")


class BlockHistory:
    """Per block key, where it is held now and where it was last removed, from the KV events (bounded: at most
    ``max_keys`` keys, the least recently touched forgotten first, so "never computed" means "not within the
    last ``max_keys`` blocks heard of"). One event loop; not thread-safe."""

    def __init__(self, max_keys: int = 200_000, clock: Callable[[], float] = time.time) -> None:
        self.max_keys = max_keys
        self.clock = clock
        self._held: OrderedDict[int, dict[tuple[str, str], float]] = OrderedDict()
        self._removed: dict[int, Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def stored(self, instance: str, tier: str, keys: Iterable[int], at: float | None = None) -> None:
        t = self.clock() if at is None else at
        for k in keys:
            self._touch(k)[(instance, tier)] = t

    def removed(self, instance: str, tier: str, keys: Iterable[int], at: float | None = None,
                reason: str = "") -> None:
        t = self.clock() if at is None else at
        for k in keys:
            self._touch(k).pop((instance, tier), None)
            self._removed[k] = Held(instance, tier, t, reason)

    def cleared(self, instance: str, at: float | None = None) -> None:
        """``instance`` dropped everything (``AllBlocksCleared``, or it went away)."""
        t = self.clock() if at is None else at
        for k, where in self._held.items():
            for w in [w for w in where if w[0] == instance]:
                del where[w]
                self._removed[k] = Held(instance, w[1], t)

    def seen(self, key: int) -> bool:
        return key in self._held

    def heard_of(self, keys: Iterable[int]) -> set[int]:
        """Those of ``keys`` held or removed anywhere (one pass in C: ``seen`` or ``last_removal`` of each)."""
        ks = set(keys)
        return (ks & self._held.keys()) | (ks & self._removed.keys())

    def holders(self, key: int) -> list[Held]:
        return [Held(i, tier, t) for (i, tier), t in self._held.get(key, {}).items()]

    def last_removal(self, key: int) -> Held | None:
        return self._removed.get(key)

    def _touch(self, key: int) -> dict[tuple[str, str], float]:
        where = self._held.get(key)
        if where is None:
            where = self._held[key] = {}
            while len(self._held) > self.max_keys:
                old, _ = self._held.popitem(last=False)
                self._removed.pop(old, None)
        else:
            self._held.move_to_end(key)
        return where


class Namespaces:
    """Which namespace seeds each namespace-free block key (the same tokens) was seen under. Bounded: at most
    ``max_keys`` and a prompt's keys, the least recently seen first out, a generation at a time (a key seen goes
    to the newer of two tables, the older one goes when the newer is full: an LRU table moving each of a 4k-token
    prompt's 256 keys to its end cost 1.4 times as much)."""

    def __init__(self, max_keys: int = 200_000) -> None:
        self.max_keys = max_keys
        self._seeds: dict[int, set[int]] = {}  # the newer generation
        self._older: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._seeds) + len(self._older)

    def saw(self, plain_keys: Iterable[int], seed: int) -> None:
        seeds_of, older = self._seeds, self._older
        get = seeds_of.get
        for k in plain_keys:
            seeds = get(k)
            if seeds is None:
                seeds = seeds_of[k] = older.pop(k, set())
            if seed not in seeds:
                seeds.add(seed)
                if len(seeds) > 8:
                    seeds.pop()
        if len(seeds_of) >= max(1, self.max_keys // 2):
            self._older, self._seeds = seeds_of, {}

    def seeds(self, plain_key: int) -> set[int]:
        """The seeds ``plain_key`` was seen under (empty: never, or forgotten)."""
        return self._seeds.get(plain_key) or self._older.get(plain_key) or set()

    def shared(self, plain_keys: Sequence[int], seed: int, lo: int, hi: int) -> dict[int, int]:
        """{i: how many other namespaces than ``seed`` block i's tokens were seen under} for the i in [lo, hi)
        where that is not 0."""
        out = {}
        for i, k in enumerate(plain_keys[lo:hi], lo):
            seeds = self._seeds.get(k) or self._older.get(k)
            if seeds and (n := len(seeds) - (seed in seeds)):
                out[i] = n
        return out


@dataclass(frozen=True)
class RouteView:
    """What the router knew of one request when it routed it, and what the dispatch reported back."""

    compute: str                       # the instance that computed the prompt (prefill, or the local one)
    indexed: Mapping[str, int]         # the index's leading blocks per instance (``POOL``: the pool's)
    recent: Mapping[str, int] = field(default_factory=dict)  # the router's table of prompts just sent
    reason: str = ""                   # the plan's reason for the route
    at: float = 0.0                    # wall clock of the route
    pool_outcome: str = ""             # the engine's pool fetch: "" none tried, "adopted", "failed: ...", ...
    fallback: str = ""                 # a PD hand-off that failed (decode recomputed): why
    unconvertible: str = ""            # the compute instance's KV cannot take pool blocks: why
    # (lo, hi) -> {block index: other namespaces its tokens were seen under}, for the blocks in [lo, hi) seen under
    # any (read for a range of blocks at once)
    other_namespaces: Callable[[int, int], dict[int, int]] = lambda lo, hi: {}

    def predicted_blocks(self) -> int:
        here = max(self.indexed.get(self.compute, 0), self.recent.get(self.compute, 0))
        pool = 0 if self.unconvertible else self.indexed.get(POOL, 0)
        return max(here, pool)


SKIPPED = ("local cache suffices", "below pool_fetch_min_blocks")
UNNAMED = -1  # a key no KV event names (block keys are unsigned): what a block's zone says of every such block


class Explainer:
    """Why block ``i`` (``key``) of a prompt with ``keys``, routed as ``view``, was computed: called by
    ``attribute`` for each missed full block (see the module docstring for the order of the checks)."""

    def __init__(self, view: RouteView, history: BlockHistory, keys: Sequence[int]) -> None:
        self.view, self.history, self.keys = view, history, keys
        self._runs: dict[str, int] = {}
        # what does not change from block to block (this is called for every missed block of every request)
        at = view.compute
        self._here = max(view.indexed.get(at, 0), view.recent.get(at, 0))
        self._here_index = view.indexed.get(at, 0)
        self._pool = view.indexed.get(POOL, 0)
        held = {x: max(view.indexed.get(x, 0), view.recent.get(x, 0)) for x in {*view.indexed, *view.recent}
                if x not in (at, POOL)}
        self._elsewhere_until = max(held.values(), default=0)  # no other instance holds block i >= this
        self._held_elsewhere = held
        self._heard = history.heard_of(keys)  # a block of none of these has no history to read
        self._lag = f"an earlier request sent to {at} had not stored it yet"
        self._stale = f"the index listed it on {at}"
        self._fallback = f"the hand-off to decode failed ({view.fallback}); decode recomputed"

    def spans(self, lo: int, hi: int) -> Iterator[tuple[int, int, Cause, str]]:
        """What ``self(i, keys[i])`` says of each block i in [lo, hi), as (first, last, cause, words) in order, a
        range of blocks at a time: the answer depends on the block's zone (the route's instance or the pool held
        it, another instance did, none did) and within a zone on the block itself only where the KV events named
        its key (or, in the last zone, its tokens' other namespaces); every other block shares its zone's."""
        if lo >= hi:
            return
        keys, heard = self.keys, self._heard
        here, pool, elsewhere = self._here, self._pool, self._elsewhere_until
        last_zone = max(here, pool, elsewhere)
        cuts = {here, pool, elsewhere, self._here_index, *self._held_elsewhere.values()}
        ends = sorted({lo, hi} | {c for c in cuts if lo < c < hi})
        for a, b in pairwise(ends):  # within [a, b) every block not named shares one answer
            if a >= last_zone:
                yield from self._unheld(a, b)
                continue
            # only the route's own instance's zone reads the key (an eviction from it)
            named = [i for i in range(a, b) if keys[i] in heard] if heard and a < here else []
            for i in named:
                if i > a:
                    yield (a, i - 1, *self(a, UNNAMED))
                yield (i, i, *self(i, keys[i]))
                a = i + 1
            if a < b:
                yield (a, b - 1, *self(a, UNNAMED))

    def _unheld(self, lo: int, hi: int) -> Iterator[tuple[int, int, Cause, str]]:
        """The last zone: a block the events named is explained alone, the rest by their tokens' other
        namespaces (read for the range at once)."""
        keys, heard = self.keys, self._heard
        shared = self.view.other_namespaces(lo, hi)
        own = {i for i in range(lo, hi) if keys[i] in heard} if heard else set()
        at = lo
        for i in sorted(own | shared.keys()):
            if i > at:
                yield at, i - 1, Cause.NEVER_COMPUTED, ""
            yield (i, i, *(self(i, keys[i]) if i in own else (Cause.NAMESPACE, namespace_words(shared[i]))))
            at = i + 1
        if at < hi:
            yield at, hi - 1, Cause.NEVER_COMPUTED, ""

    def run_on(self, instance: str) -> int:
        """The leading blocks of the prompt ``instance`` holds by the events heard (a block past a gap is no use
        to a prefix match)."""
        if instance not in self._runs:
            n = 0
            while n < len(self.keys) and any(h.instance == instance for h in self.history.holders(self.keys[n])):
                n += 1
            self._runs[instance] = n
        return self._runs[instance]

    def __call__(self, i: int, key: int) -> tuple[Cause, str]:
        view, history = self.view, self.history
        at = view.compute
        if i < self._here or i < self._pool:
            if view.fallback:
                return Cause.FETCH_FAILED, self._fallback
            if i < self._here:
                gone = history.last_removal(key)
                if gone is not None and gone.instance == at:
                    return Cause.EVICTED, f"from {at}'s {gone.tier_and_why()} {_when(gone.at, view.at)}"
                if i >= self._here_index:
                    return Cause.INDEX_LAG, self._lag
                return Cause.STALE_INDEX, self._stale
            if view.unconvertible:
                return Cause.LAYOUT, f"in the pool; {at}: {view.unconvertible}"
            if view.pool_outcome.startswith(SKIPPED):
                return Cause.FETCH_SKIPPED, f"in the pool; {at}: {view.pool_outcome}"
            return Cause.FETCH_FAILED, f"in the pool; fetch: {view.pool_outcome or 'not attempted'}"
        if i < self._elsewhere_until:
            elsewhere = sorted(x for x, n in self._held_elsewhere.items() if n > i)
            return Cause.ROUTED_ELSEWHERE, f"held on {', '.join(elsewhere)}; routed to {at}: {view.reason or 'plan'}"
        if history.seen(key):
            holders = [h for h in history.holders(key) if h.instance != at or h.at < view.at]
            lag = [h for h in holders if self.run_on(h.instance) > i]
            if lag:
                h = min(lag, key=lambda h: h.at)
                return Cause.INDEX_LAG, (f"stored on {h.instance} ({h.tier}) {_when(h.at, view.at)}, "
                                         "not in the index then")
            for h in holders:  # held, but an earlier block of its chain is gone there
                gap = self.run_on(h.instance)
                gone = history.last_removal(self.keys[gap])
                if gone is not None and gone.instance == h.instance:
                    return Cause.EVICTED, (f"block {gap} of its prefix, from {h.instance}'s {gone.tier_and_why()} "
                                           f"{_when(gone.at, view.at)}")
        gone = history.last_removal(key)
        if gone is not None:
            return Cause.EVICTED, f"from {gone.instance}'s {gone.tier_and_why()} {_when(gone.at, view.at)}"
        others = view.other_namespaces(i, i + 1).get(i, 0)
        if others:
            return Cause.NAMESPACE, namespace_words(others)
        return Cause.NEVER_COMPUTED, ""


def namespace_words(others: int) -> str:
    return f"the same tokens are cached under {others} other namespace(s)"


def _when(t: float, route: float) -> str:
    d = route - t
    return f"{d:.2f} s before the route" if d >= 0 else f"{-d:.2f} s after the route"


# ---- the offline optimum on a recorded stream ------------------------------------------------------------------

def infinite_cache_hits(stream: Iterable[tuple[Sequence[int], int]], block_size: int) -> list[int]:
    """Per request of ``(block keys, prompt tokens)`` in arrival order: the tokens an infinite cache shared by
    the whole fleet would have served (every block any earlier request had; the last token always computed).
    ``block keys``: the request's blocks as it left them, its output's included (the next turn of a conversation
    hits those); its lookup reads those of its prompt. Whole blocks: an engine that reuses a partial block can
    beat it by less than a block per request."""
    seen: set[int] = set()
    out = []
    for keys, prompt in stream:
        n = 0
        for k in keys[:-(-prompt // block_size)]:
            if k not in seen:
                break
            n += 1
        out.append(min(n * block_size, max(0, prompt - 1)))
        seen.update(keys)
    return out


def belady_hits(stream: Sequence[tuple[Sequence[int], int]], block_size: int, capacity: int) -> list[int]:
    """Per request: the tokens one fleet-wide cache of ``capacity`` blocks would have served, evicting the block
    used furthest in the future (Belady's rule; a block no later request uses is not kept at all)."""
    nexts: list[list[float]] = [[] for _ in stream]
    seen: dict[int, float] = {}
    for n in range(len(stream) - 1, -1, -1):
        nexts[n] = [seen.get(k, math.inf) for k in stream[n][0]]
        for k in stream[n][0]:
            seen[k] = n
    cache: dict[int, float] = {}  # key -> its next use
    heap: list[tuple[float, int]] = []  # (-next use, key); stale entries are skipped
    out = []
    for (keys, prompt), uses in zip(stream, nexts, strict=True):
        hit = 0
        for k in keys[:-(-prompt // block_size)]:
            if k not in cache:
                break
            hit += 1
        out.append(min(hit * block_size, max(0, prompt - 1)))
        for k, use in zip(keys, uses, strict=True):
            cache[k] = use
            heapq.heappush(heap, (-use, k))
        while len(cache) > capacity:
            use, k = heapq.heappop(heap)
            if cache.get(k) == -use:
                del cache[k]
    return out
