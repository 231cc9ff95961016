"""What an instance remembers of each session's context: the token ids its last request here left (prompt and
output), its tenant salt and adapter. With them the host can fetch what the pool holds of a paused session's KV
before the session returns (``Engine.on_session_due``) and when its next request reaches a router (``RESUME``),
so the prefill finds it in place: the engine's cache keys its blocks by their tokens, which the session's block
keys alone do not give back once the blocks have left every local tier.

Bounded by tokens (``InstanceSettings.session_context_tokens``), the least recently used first; 4 bytes a token."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SessionContext:
    cache_salt: str
    lora: str
    tokens: array  # int32 token ids


class SessionContexts:
    def __init__(self, budget_tokens: int) -> None:
        if budget_tokens < 0:
            raise ValueError(f"session_context_tokens {budget_tokens} must be >= 0")
        self.budget = budget_tokens
        self.tokens = 0  # held now, over every session
        self._items: OrderedDict[str, SessionContext] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def remember(self, key: str, cache_salt: str, lora: str, tokens: Sequence[int]) -> None:
        """Session ``key``'s context is ``tokens`` now (it replaces what was kept); one longer than the whole
        budget is not kept."""
        self.forget(key)
        if not key or not tokens or len(tokens) > self.budget:
            return
        while self.tokens + len(tokens) > self.budget:
            _, old = self._items.popitem(last=False)
            self.tokens -= len(old.tokens)
        self._items[key] = SessionContext(cache_salt, lora, array("i", tokens))
        self.tokens += len(tokens)

    def get(self, key: str) -> SessionContext | None:
        ctx = self._items.get(key)
        if ctx is not None:
            self._items.move_to_end(key)
        return ctx

    def forget(self, key: str) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.tokens -= len(old.tokens)
