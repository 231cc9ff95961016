"""Block keys: chained xxh3_64 hashes over fixed-size token blocks (TensorRT-LLM's BlockKey).

``key_i = xxh3_64(key_{i-1} || tokens_i)`` where ``key_{-1}`` is a namespace seed derived from the model
fingerprint, tokenizer fingerprint, LoRA id, cache salt (tenant) and multimodal hashes. Equal keys mean an equal
namespace and an equal token prefix; two tenants with different salts never share a key. Hashes are stable across
processes and machines (xxh3 over little-endian int32 token bytes, never Python's ``hash()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import numpy as np
import xxhash

BlockKey = NewType("BlockKey", int)
"""Hash of one full block *and its whole prefix* inside a namespace."""

NamespaceSeed = NewType("NamespaceSeed", int)
"""``key_{-1}``: what must be equal for two requests to share any block."""


@dataclass(frozen=True)
class Namespace:
    model_fingerprint: str
    tokenizer_fingerprint: str = ""
    lora_id: str = ""
    cache_salt: str = ""
    mm_hashes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def seed(self) -> NamespaceSeed:
        parts = (self.model_fingerprint, self.tokenizer_fingerprint, self.lora_id, self.cache_salt,
                 *self.mm_hashes)
        return NamespaceSeed(xxhash.xxh3_64_intdigest("\x1f".join(parts).encode()))


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def chain_key(parent: int, tokens: Sequence[int] | np.ndarray) -> BlockKey:
    """The key of one block whose prefix has key ``parent`` (or the namespace seed for block 0)."""
    return BlockKey(xxhash.xxh3_64_intdigest(_token_bytes(tokens), seed=parent))


def block_keys(seed: int, tokens: Sequence[int] | np.ndarray, block_size: int) -> list[BlockKey]:
    """Keys of every *full* block of ``tokens``; a trailing partial block has no key."""
    data = np.asarray(tokens, dtype="<i4")
    n_full = len(data) // block_size
    keys: list[BlockKey] = []
    parent = seed
    for i in range(n_full):
        parent = chain_key(parent, data[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys
