"""Eviction strategies: each is one method returning a sort key; the smallest key is evicted first.

Adding a policy is adding a small class (SGLang's ``get_priority`` idea). The objects being ranked only need the
attributes of :class:`Evictable`.
"""

from __future__ import annotations

import time
from typing import Protocol


class Evictable(Protocol):
    last_access: float
    hit_count: int
    priority: int          # retention priority: higher outlives lower (0 = default)
    priority_until: float  # monotonic deadline after which ``priority`` no longer applies (inf = forever)


class EvictionPolicy(Protocol):
    name: str

    def sort_key(self, item: Evictable, now: float) -> tuple: ...


class LRU:
    name = "lru"

    def sort_key(self, item: Evictable, now: float) -> tuple:
        return (item.last_access,)


class LFU:
    name = "lfu"

    def sort_key(self, item: Evictable, now: float) -> tuple:
        return (item.hit_count, item.last_access)


class SLRU:
    """Segmented LRU: blocks hit at least twice sit in the protected segment and go after all probation ones."""

    name = "slru"

    def sort_key(self, item: Evictable, now: float) -> tuple:
        return (item.hit_count >= 2, item.last_access)


class PriorityLRU:
    """TensorRT-LLM-style retention priority: a higher priority outlives lower ones until its duration ends."""

    name = "priority"

    def sort_key(self, item: Evictable, now: float) -> tuple:
        priority = item.priority if now < item.priority_until else 0
        return (priority, item.last_access)


POLICIES: dict[str, type] = {p.name: p for p in (LRU, LFU, SLRU, PriorityLRU)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None


def now() -> float:
    return time.monotonic()
