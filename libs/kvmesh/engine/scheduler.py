"""Which sequences run in the next forward step, and how many tokens each computes.

One rule covers prefill, chunked prefill, decode and recompute: a sequence computes
``min(uncomputed tokens, remaining budget)`` tokens and samples when it has none left. Sarathi-style, every step
first takes all running decode rows (one token each), then fills what is left of the token budget with prefill
chunks: running prefills first, then waiting sequences admitted while the budget, the sequence cap and the KV pool
allow, each group in ``Sequence.slo_rank`` order (the owner ranks prompts by their TTFT deadlines, ``engine/slo.py``;
without deadlines, the arrival order, or with ``engine.prefill_order = least_work`` by arrival + the work left
past the cached prefix). While decode rows run, the prefill part
is further capped at the step's ``chunk_tokens`` (the pacer's cap, ``engine/pacer.py``, from the measured step cost
and the streams' ITL targets), so a new prompt delays the running streams by a bounded amount instead of a whole
prefill. When the pool runs dry the newest running sequence is preempted; its computed blocks stay in the prefix
cache, so recomputing it later is mostly a cache hit.
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
    """``one_order``: running prefills and waiting prompts take the prompt tokens in one ``slo_rank`` order, so a
    waiting prompt ranked ahead of a running prefill is admitted before that prefill's next chunk
    (``engine.prefill_order = least_work``); otherwise every running prefill's chunk comes first."""

    def __init__(self, blocks: BlockManager, max_batched_tokens: int, max_num_seqs: int,
                 one_order: bool = False) -> None:
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.one_order = one_order
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.max_loras = 0  # distinct LoRA adapters one step may run (0: no cap); the base model is free
        self._starved: set[str] = set()  # adapters whose decode rows waited last step: they go first now

    def _adapter_fits(self, seq: Sequence, adapters: set[str]) -> bool:
        """Whether ``seq``'s adapter may join a step already running ``adapters`` (and note it if so)."""
        name = seq.lora_name
        if not name or name in adapters:
            return True
        if self.max_loras and len(adapters) >= self.max_loras:
            return False
        adapters.add(name)
        return True

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

    def schedule(self, chunk_tokens: int | None = None) -> list[Scheduled]:
        """The next step's rows: the running decode rows, then the running prefills' chunks and waiting
        sequences admitted (``_prompt_rows``); while decode rows run, the prefill part carries at most
        ``chunk_tokens`` (None: the whole token budget)."""
        adapters: set[str] = set()
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        decode = self._decode_rows(adapters)
        budget = self.max_batched_tokens - len(decode)
        if decode and chunk_tokens is not None:
            budget = min(budget, chunk_tokens)
        rows = decode + self._prompt_rows(prefilling, budget, adapters)
        # a row scheduled before a later row's room preempted it (the newest running sequence goes first)
        return [r for r in rows if r.seq.status is Status.RUNNING]

    def _decode_rows(self, adapters: set[str]) -> list[Scheduled]:
        """One token for each running decode row, within the token budget and the adapter cap; the adapters whose
        rows waited last step go first."""
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        if self._starved:
            decoding.sort(key=lambda s: s.lora_name not in self._starved)
        batch: list[Scheduled] = []
        starved: set[str] = set()
        for seq in decoding:
            if len(batch) == self.max_batched_tokens:
                break
            if not self._adapter_fits(seq, adapters):
                starved.add(seq.lora_name)
                continue
            if seq.status is Status.RUNNING and self._reserve(seq, 1):  # not preempted earlier in this loop
                batch.append(Scheduled(seq, 1))
        self._starved = starved
        return batch

    def _chunk(self, seq: Sequence, budget: int, adapters: set[str]) -> Scheduled | None:
        """Running prefill ``seq``'s next chunk of at most ``budget`` tokens, its room made; None when it was
        preempted (by an earlier row's room, or by its own) or its adapter cannot join the step."""
        if seq.status is not Status.RUNNING or not self._adapter_fits(seq, adapters):
            return None
        n = min(seq.num_uncomputed, budget)
        return Scheduled(seq, n) if self._reserve(seq, n) else None

    def _prompt_rows(self, prefilling: list[Sequence], budget: int, adapters: set[str]) -> list[Scheduled]:
        """The running prefills' next chunks and the waiting prompts' first ones, within ``budget`` tokens, in
        ``slo_rank`` order: every running prefill before any waiting prompt, or with ``one_order`` all of them in
        one order (running before waiting among equals; stable: the running and the queue's order among equals).
        Admissions stop at the first waiting prompt that does not fit; running prefills ranked behind it still
        get their chunks. A sequence preempted earlier in the step is left for a later one."""
        batch: list[Scheduled] = []
        admitting = True
        ranked = sorted([(s, False) for s in prefilling] + [(s, True) for s in self.waiting],
                        key=lambda sw: (not self.one_order and sw[1], sw[0].slo_rank))
        for seq, waiting in ranked:
            if budget <= 0:
                break
            if waiting:
                if not admitting or seq.status is not Status.WAITING:
                    continue
                if (row := self._admit_one(seq, budget, adapters)) is not None:
                    batch.append(row)
                    budget -= row.num_tokens
                else:
                    admitting = False
            elif (row := self._chunk(seq, budget, adapters)) is not None:
                batch.append(row)
                budget -= row.num_tokens
        return batch

    def _admit_one(self, seq: Sequence, budget: int, adapters: set[str]) -> Scheduled | None:
        """Admit waiting ``seq`` with its first chunk of at most ``budget`` tokens; None (nothing held) when the
        sequence cap, the adapter cap or the KV pool does not allow it."""
        if len(self.running) >= self.max_num_seqs or not self._adapter_fits(seq, adapters):
            return None
        first_admission = seq.num_preemptions == 0
        cached = seq.num_cached_tokens
        if not self.blocks.allocate_prefix(seq):
            return None
        n = min(seq.num_uncomputed, budget)
        if not self.blocks.ensure_slots(seq, seq.num_computed_tokens + n):
            self.blocks.free(seq)
            seq.num_computed_tokens = 0
            return None
        if not first_admission:
            seq.num_cached_tokens = cached
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return Scheduled(seq, n)

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
