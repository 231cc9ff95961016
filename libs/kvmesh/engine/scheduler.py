"""Which sequences run in the next forward step, and how many tokens each computes.

One rule covers prefill, chunked prefill, decode and recompute: a sequence computes
``min(uncomputed tokens, remaining budget)`` tokens and samples when it has none left. Running sequences go first
(decode rows cost one token each), then waiting ones are admitted while the token budget, the sequence cap and
the KV pool allow. When the pool runs dry the newest running sequence is preempted; its computed blocks stay in
the prefix cache, so recomputing it later is mostly a cache hit.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from kvmesh.engine.block_manager import BlockManager
from kvmesh.engine.sequence import Sequence, Status


class Scheduled(NamedTuple):
    seq: Sequence
    num_tokens: int


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batched_tokens: int, max_num_seqs: int) -> None:
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already attached (imported from a prefill instance)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_room(self) -> bool:
        return len(self.running) < self.max_num_seqs

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_batched_tokens
        batch: list[Scheduled] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, n):
                continue
            batch.append(Scheduled(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            first_admission = seq.num_preemptions == 0
            cached = seq.num_cached_tokens
            if not self.blocks.allocate_prefix(seq):
                break
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.ensure_slots(seq, seq.num_computed_tokens + n):
                self.blocks.free(seq)
                seq.num_computed_tokens = 0
                break
            if not first_admission:
                seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(Scheduled(seq, n))
            budget -= n
        return batch

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Make room for ``n`` more tokens of ``seq``, preempting newer sequences; False if ``seq`` itself
        had to be preempted."""
        while not self.blocks.ensure_slots(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.free(seq)
