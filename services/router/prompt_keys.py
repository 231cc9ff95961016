"""A prompt's block keys, hashed only past the blocks it shares with the last prompt that started alike.

The router hashes every prompt it routes twice over (its block keys under the request's namespace, and the
namespace-free chain hit attribution reads): 512 xxh3 calls for a 4k-token prompt, 7-8% of its CPU in ``kvmesh
bench routers``. Most of those blocks are the same as the last prompt's of the same namespace: a tenant's system
prompt, a conversation's earlier turns, an agent's transcript. Block keys are chained (``key_i`` hashes
``key_{i-1}`` and block i's tokens), so a prompt whose first n blocks' tokens equal another's has that one's first
n keys: :class:`PromptKeys` keeps the last prompt's tokens and keys per first block key (a namespace's prompts that
start alike: one system prompt's, one conversation's), finds where the new prompt's tokens first differ from that
one's (one numpy comparison), takes the keys before that block and hashes the rest. Same keys as
``block_keys_and_plain`` (checked by the tests); at most ``capacity_bytes`` kept, the least recently used prompt
first out.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.keys import chain_on

_KEY_BYTES = 2 * (8 + 32)  # a block's two keys: a list slot and an int each
_ENTRY_BYTES = 400  # an entry's own objects and its table slot


@dataclass(frozen=True)
class _Last:
    seed: int
    tokens: np.ndarray  # int32, a copy of the prompt
    keys: list[BlockKey]
    plain: list[BlockKey]

    @property
    def cost(self) -> int:
        return self.tokens.nbytes + _KEY_BYTES * len(self.keys) + _ENTRY_BYTES


class PromptKeys:
    """Block keys under a seed and under 0 (``block_keys_and_plain``) of prompts packed as int32, reusing the keys
    of the last prompt with the same first block key for the leading blocks they share. One event loop's: not
    thread-safe."""

    def __init__(self, block_size: int, capacity_bytes: int = 32 << 20) -> None:
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self._last: OrderedDict[int, _Last] = OrderedDict()
        self.bytes = 0
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def __call__(self, seed: int, prompt: array) -> tuple[list[BlockKey], list[BlockKey]]:
        """The keys of ``prompt``'s full blocks under ``seed`` and under 0; the lists are the caller's."""
        tokens = np.frombuffer(prompt, dtype=np.int32)
        if len(tokens) < self.block_size:
            return [], []
        first = xxhash.xxh3_64_intdigest(memoryview(prompt)[:self.block_size], seed=seed)
        last = self._last.pop(first, None)
        if last is not None:
            self.bytes -= last.cost
            if last.seed != seed:  # another namespace's first key equal to this one's: nothing of it is this one's
                last = None
        shared = _shared_blocks(last.tokens, tokens, self.block_size) if last is not None else 0
        keys = last.keys[:shared] if last is not None else []
        plain = last.plain[:shared] if last is not None else []
        chain_on(keys, plain, seed, prompt, self.block_size)
        self.reused_blocks += shared
        self.hashed_blocks += len(keys) - shared
        if self.capacity_bytes > 0:
            entry = _Last(seed, tokens.copy(), list(keys), list(plain))  # the caller's lists are the caller's
            if entry.cost <= self.capacity_bytes:
                self._last[first] = entry
                self.bytes += entry.cost
                while self.bytes > self.capacity_bytes:
                    _, old = self._last.popitem(last=False)
                    self.bytes -= old.cost
        return keys, plain

    def __len__(self) -> int:
        return len(self._last)


def _shared_blocks(a: np.ndarray, b: np.ndarray, block_size: int) -> int:
    """How many leading full blocks of tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b)) // block_size * block_size
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    first = int(differ.argmax())
    return (first if differ[first] else n) // block_size
