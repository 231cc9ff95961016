"""The KV correctness canary: a sampled share of reused prefixes is recomputed off the critical path and compared
with what was served.

When a sequence's first forward pass starts on a reused prefix (a local prefix hit, blocks adopted from the pool,
or a PD hand-off's imported KV), ``Canary.wants`` draws whether to check it (``engine.canary_share``); a check
copies the served blocks as they are at that moment (``Check.served``). While the engine has nothing else to do,
``LLMEngine.canary_step`` recomputes the check's tokens from nothing into a scratch pool of its own, one chunk of
at most ``engine.canary_chunk_tokens`` per idle round, and spends at most ``engine.canary_budget`` of the idle
time (after a chunk of t seconds the next waits t·(1−budget)/budget). The served KV must match the recomputed one
within its dtype's tolerance (``TOLERANCE``, of the largest magnitude per layer and K|V); a block that does not is
a divergence: counted, logged with the block keys and the path, and its keys quarantined (``BlockManager.
quarantine``: never matched again until a request rewrites them, and removed from the index by ``BlockRemoved``).

Owned by the engine thread (not thread-safe); the counters are read racily for metrics.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvmesh.contracts.ids import BlockKey

log = logging.getLogger(__name__)

# largest |served − recomputed| over the largest |recomputed|, per layer and K|V, that is still agreement: the same
# kernels in another batch shape differ in the last bits (fp32), rounding to the storage dtype in one ulp
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 4e-2, torch.float16: 1e-2, torch.float8_e4m3fn: 0.15}


class ReusePath(enum.StrEnum):
    LOCAL = "local"      # the engine's own prefix cache
    POOL = "pool"        # blocks fetched from the pool (adopted into the prefix cache)
    HANDOFF = "handoff"  # a PD hand-off's pushed KV


@dataclass
class Check:
    request_id: str
    path: ReusePath
    tokens: list[int]          # the reused prefix, whole blocks
    keys: list[BlockKey]
    served: torch.Tensor       # the served blocks, [n, layers, 2, block_size, heads, head_dim] (a copy)
    done: int = 0              # tokens recomputed so far
    scratch: object = None     # the check's own KV pool, once started


class Verdict(NamedTuple):
    check: Check
    error: float               # the worst block's relative error
    bad_blocks: list[int]      # indices of the blocks out of tolerance


@dataclass
class Canary:
    share: float = 0.0
    budget: float = 0.1
    chunk_tokens: int = 64
    max_pending: int = 8
    seed: int = 0
    clock: Callable[[], float] = time.monotonic
    pending: list[Check] = field(default_factory=list)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)  # (path, outcome) -> checks
    adopted: OrderedDict[int, None] = field(default_factory=OrderedDict)  # keys that came from the pool
    quarantined_keys: int = 0
    seconds: float = 0.0  # spent recomputing, in all
    cpu_seconds: float = 0.0  # the engine thread's CPU time of those
    on_quarantine: Callable[[list[BlockKey], str], None] | None = None  # (keys, path): tell the pool
    _next: float = 0.0
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def wants(self) -> bool:
        """Whether to check the reuse at hand (its share of the reuses, while fewer than ``max_pending`` wait)."""
        if self.share <= 0 or len(self.pending) >= self.max_pending:
            return False
        return self.share >= 1 or self._rng.random() < self.share

    def from_pool(self, keys: Iterable[int]) -> None:
        for k in keys:
            self.adopted[k] = None
            self.adopted.move_to_end(k)
        while len(self.adopted) > 100_000:
            self.adopted.popitem(last=False)

    def path_of(self, keys: list[BlockKey], imported: bool) -> ReusePath:
        if imported:
            return ReusePath.HANDOFF
        return ReusePath.POOL if any(k in self.adopted for k in keys) else ReusePath.LOCAL

    def due_in(self) -> float | None:
        """Seconds until the next chunk may run (None: nothing to check)."""
        if not self.pending:
            return None
        return self.wait_s()

    def wait_s(self) -> float:
        """Seconds until the budget allows the next recompute."""
        return max(0.0, self._next - self.clock())

    def spent(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        """A chunk took ``seconds``: the next waits so the canary keeps within its budget of the idle time."""
        self.seconds += seconds
        self.cpu_seconds += cpu_seconds
        b = min(1.0, max(1e-3, self.budget))
        self._next = self.clock() + seconds * (1 - b) / b

    def quarantined(self, keys: list[BlockKey], path: ReusePath) -> None:
        self.quarantined_keys += len(keys)
        if self.on_quarantine is not None and keys:
            self.on_quarantine(keys, path.value)

    def judge(self, check: Check, recomputed: torch.Tensor) -> Verdict:
        """Compare the served blocks with the recomputed ones (both ``[n, layers, 2, ...]``) and count it."""
        served = check.served.to(torch.float32)
        ref = recomputed.to(torch.float32)
        dims = tuple(range(3, served.dim()))
        scale = ref.abs().amax(dim=dims).clamp_min(1e-6)        # [n, layers, 2]
        err = ((served - ref).abs().amax(dim=dims) / scale)     # [n, layers, 2]
        err = torch.nan_to_num(err, nan=float("inf"))
        per_block = err.amax(dim=(1, 2))
        tol = TOLERANCE.get(check.served.dtype, 1e-3)
        bad = [int(i) for i in torch.nonzero(per_block > tol).flatten()]
        outcome = "diverged" if bad else "ok"
        self.counts[(check.path.value, outcome)] = self.counts.get((check.path.value, outcome), 0) + 1
        return Verdict(check, float(per_block.max()) if per_block.numel() else 0.0, bad)
