"""The closed sets of strategy and mode names that settings, request headers and the simulator carry.

Each is a ``StrEnum``: a member compares equal to, hashes, formats and serialises as its string, so a registry
keyed on one (``kvmesh.engine.eviction.POLICIES``, ``kvmesh.routing.POLICIES``) answers a plain string from a
header or a file too, and ``kvmesh.settings`` lists the choices without importing the registries.
"""

from __future__ import annotations

import enum


class Eviction(enum.StrEnum):
    """An eviction strategy of a cache's tiers (engine, cachesvc pool, ``kvmesh sim``)."""

    LRU = "lru"
    LFU = "lfu"
    SLRU = "slru"              # blocks hit twice are protected
    PRIORITY = "priority"      # per-token-range retention priority and duration
    TAILFIRST = "tailfirst"    # predicted expiry, learned online
    GHOST = "ghost"            # tailfirst plus a memory of evicted blocks' reuse
    DUEL = "duel"              # ghost or lru, whichever miniature simulations say is ahead
    SESSION = "session"        # the sessions' signals (ended first, paused kept, TTL pins held), then lru
    SESSION_DUEL = "session_duel"  # the sessions' signals, then duel
    BELADY = "belady"          # the offline optimum: needs the future, ``kvmesh sim`` only

    @property
    def needs_future(self) -> bool:
        """It reads when each block is used next, which only the simulator knows: live caches refuse it."""
        return self is Eviction.BELADY

    @classmethod
    def online(cls) -> tuple[Eviction, ...]:
        """The strategies a live cache may use, sorted by name."""
        return tuple(sorted(e for e in cls if not e.needs_future))


class PrefillOrder(enum.StrEnum):
    """The order in which a native engine's prompts without a TTFT deadline take a step's prompt tokens."""

    ARRIVAL = "arrival"        # first come, first served
    LEAST_WORK = "least_work"  # earliest arrival + work first, the work past the cached prefix


class RoutingPolicy(enum.StrEnum):
    """How the router picks the prefill instance (per request: header / metadata ``x-kvmesh-policy``)."""

    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"
    CACHE_AWARE = "cache_aware"  # Mooncake's rule: the lowest estimated TTFT


class DisaggregationMode(enum.StrEnum):
    """Whether a request's prompt is prefilled on a prefill instance and its KV pushed to decode
    (per request: header / metadata ``x-kvmesh-disaggregate``)."""

    AUTO = "auto"      # the cost model chooses
    ALWAYS = "always"  # always through prefill (experiments)
    NEVER = "never"    # decode prefills what it lacks itself
