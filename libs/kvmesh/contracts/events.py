"""KV events (vLLM's schema): what an engine or pool reports when blocks appear in or leave a tier."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.contracts.ids import BlockKey

TIER_DEVICE = "device"
TIER_HOST = "host"


@dataclass(frozen=True)
class BlockStored:
    block_keys: tuple[BlockKey, ...]
    parent_key: BlockKey | None  # None when the first block starts the sequence
    token_count: int             # tokens per block
    tier: str
    lora: str | None = None
    extra_keys: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class BlockRemoved:
    block_keys: tuple[BlockKey, ...]
    tier: str
    reason: str = ""  # what removed them: the eviction policy's name, "quarantine", "replaced"; "" not said


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSink = Callable[[KVEvent], None]
