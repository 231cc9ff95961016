"""A request inside the engine: its tokens, sampling parameters and KV bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.contracts.engine import RetentionRange, SessionHint
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.contracts.slo import late_gaps_allowed

__all__ = ["RetentionRange", "Sequence", "Status"]

if TYPE_CHECKING:
    from kvmesh.engine.lora import LoRASpec
    from kvmesh.engine.radix import Node


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace_seed: int = 0
    retention: tuple[RetentionRange, ...] = ()
    arrival: float = field(default_factory=time.monotonic)  # when this engine took it
    lora: LoRASpec | None = None      # the adapter it runs under (kept even if the name is unloaded meanwhile)
    earlier_outputs: int = 0          # output tokens generated elsewhere before it came here: the prompt's tail
    session: SessionHint | None = None  # the session it belongs to
    waited: float = 0.0               # how long it had waited before this engine took it (router, prefill, hand-off)

    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    block_table: list[int] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)  # cached blocks held, aligned with block_table's prefix
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0       # prompt tokens served from cache at admission
    reuse_offered: bool = False      # its reused prefix was offered to the KV canary (engine/canary.py)
    first_token_time: float | None = None
    num_preemptions: int = 0
    # its SLO: the TTFT deadline (monotonic; None: no target), the ITL target (0: none) and its gaps so far
    ttft_deadline: float | None = None
    itl_target: float = 0.0
    last_token_time: float | None = None
    gaps: int = 0
    late_gaps: int = 0
    slo_rank: tuple[int, float] = (1, 0.0)  # its place in the prefill order, set each step (lower goes first)
    # while waiting: the cached prefix last found for it, and the pacer's step it was looked up at (-1: never)
    cached_estimate: int = 0
    estimated_at: int = -1

    @property
    def mesh_arrival(self) -> float:
        """When it reached the mesh (``arrival`` less what it waited before this engine took it), on this
        engine's monotonic clock: what its TTFT counts from, and its place among prompts that arrived apart."""
        return self.arrival - self.waited

    @property
    def lora_name(self) -> str:
        return self.lora.name if self.lora is not None else ""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are still owed (``SamplingParams.prompt_logprobs``, before its first token): every
        prompt position is computed, none reused from a cache."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed > 1 or not self.output_token_ids

    def record_token(self, now: float) -> None:
        """A token left at ``now``: the gap since the previous one is counted, and whether it missed the ITL
        target."""
        if self.last_token_time is not None:
            self.gaps += 1
            self.late_gaps += bool(self.itl_target) and now - self.last_token_time > self.itl_target
        self.last_token_time = now

    @property
    def late_allowance(self) -> int:
        """Gaps that may still exceed the ITL target with the request's p99 within it, were it to generate all
        of ``max_tokens`` (fewer when it stops early)."""
        return late_gaps_allowed(self.params.max_tokens - 1) - self.late_gaps

    def slo_met(self) -> tuple[bool, bool]:
        """Whether it met its TTFT and its ITL target so far (True where it has none)."""
        ttft = self.ttft_deadline is None or (self.first_token_time is not None
                                              and self.first_token_time <= self.ttft_deadline)
        return ttft, not self.itl_target or self.late_gaps <= late_gaps_allowed(self.gaps)

