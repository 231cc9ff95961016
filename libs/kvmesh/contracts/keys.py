"""Block keys: chained xxh3_64 hashes over fixed-size token blocks (TensorRT-LLM's BlockKey).

``key_i = xxh3_64(key_{i-1} || tokens_i)`` where ``key_{-1}`` is a namespace seed derived from the model
fingerprint, tokenizer fingerprint, LoRA id, cache salt (tenant) and multimodal hashes. Equal keys mean an equal
namespace and an equal token prefix; two tenants with different salts never share a key. Hashes are stable across
processes and machines (xxh3 over little-endian int32 token bytes, never Python's ``hash()``).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import xxhash

from kvmesh.contracts.ids import BlockKey, NamespaceSeed


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


def int32s(tokens: Iterable[int] | array) -> array:
    """Token ids as little-endian int32 (OverflowError for an id that does not fit); numpy arrays work too. An
    ``array`` this returned is taken as it is (one conversion serves the keys and the wire's packed prompt)."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    if isinstance(tokens, (tuple, list)):  # a 4k-id prompt: ~2x faster packed by struct than read by array
        data = array("i")
        try:
            data.frombytes(struct.pack(f"<{len(tokens)}i", *tokens))
        except struct.error as e:
            raise OverflowError(f"token ids must be int32: {e}") from None
        return data
    data = array("i", tokens)
    if data.itemsize != 4:  # pragma: no cover - C int is 32 bits on every platform kvmesh runs on
        raise RuntimeError(f"C int is {data.itemsize} bytes here; block keys hash int32 tokens")
    if sys.byteorder == "big":  # pragma: no cover
        data.byteswap()
    return data


def chain_key(parent: int, tokens: Iterable[int]) -> BlockKey:
    """The key of one block whose prefix has key ``parent`` (or the namespace seed for block 0)."""
    return BlockKey(xxhash.xxh3_64_intdigest(int32s(tokens).tobytes(), seed=parent))


def block_keys_and_plain(seed: int, tokens: Iterable[int], block_size: int) -> tuple[list[BlockKey], list[BlockKey]]:
    """:func:`block_keys` under ``seed`` and under seed 0 (the namespace-free chain of the same tokens), from one
    conversion of ``tokens`` in one pass."""
    keys: list[BlockKey] = []
    plain: list[BlockKey] = []
    chain_on(keys, plain, seed, int32s(tokens), block_size)
    return keys, plain


def chain_on(keys: list[BlockKey], plain: list[BlockKey], seed: int, data: array, block_size: int) -> None:
    """Extend ``keys`` (under ``seed``) and ``plain`` (under 0), the chains of ``data``'s first ``len(keys)``
    blocks, with the keys of its remaining full blocks (:func:`block_keys_and_plain` of all of ``data``)."""
    view = memoryview(data).cast("B")
    stride = 4 * block_size
    parent, bare = (keys[-1], plain[-1]) if keys else (seed, 0)
    digest = cast(Callable[..., BlockKey], xxhash.xxh3_64_intdigest)  # BlockKey(k) is k: not called per block
    key, bare_key = keys.append, plain.append
    for start in range(len(keys) * stride, len(view) - stride + 1, stride):  # a 4k-token prompt: 256 blocks twice
        block = view[start:start + stride]
        parent, bare = digest(block, seed=parent), digest(block, seed=bare)
        key(parent)
        bare_key(bare)


def block_keys(seed: int, tokens: Iterable[int], block_size: int) -> list[BlockKey]:
    """Keys of every *full* block of ``tokens``; a trailing partial block has no key."""
    data = memoryview(int32s(tokens)).cast("B")
    stride = 4 * block_size
    keys: list[int] = []
    parent = seed
    digest, key = xxhash.xxh3_64_intdigest, keys.append
    for start in range(0, len(data) - stride + 1, stride):
        parent = digest(data[start:start + stride], seed=parent)
        key(parent)
    return cast(list[BlockKey], keys)
