"""The KV correctness canary on a vLLM instance: a sampled share of the requests that reused KV (vLLM's own prefix
cache, blocks loaded from the pool, a PD hand-off's push) have their first token's distribution compared with a
recompute of the same prompt that reads no cached KV.

The native engine compares the KV itself (``kvmesh.engine.canary``). vLLM offers no forward pass outside its
scheduler to recompute KV into a scratch pool, so here the check compares what the KV produced: the first token's
logprobs. A request the canary samples (``engine.canary_share``, drawn when it is added) asks vLLM for the top
``TOP`` logprobs of each token (the client still gets only what it asked for); if its first output says it reused
whole blocks, its prompt and the first token's logprobs wait as a ``Check``. While the engine is idle (within
``engine.canary_budget`` of the idle time, as the native canary), a reference request runs the same prompt with
``skip_reading_prefix_cache`` (vLLM computes every token; kvmesh's connector loads nothing for it either), one
output token, the lowest priority, so a real request arriving meanwhile is scheduled first. The two distributions
must agree within the dtype's tolerance (``TOLERANCE``, on logprobs); when they do not, the reused blocks are a
divergence: counted, logged with their keys and path, dropped from vLLM's prefix cache (vLLM reports them removed,
so the index forgets them), and quarantined in the pool. A logprob comparison cannot say which block was wrong, so
the whole reused prefix goes.

What it catches: KV that makes the model answer differently (a layer swap, a wrong dtype, a wrong block, a bad
conversion). What it does not: a corruption too small to move the first token's top logprobs past the tolerance.
Owned by the engine thread; counters are read racily for metrics.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvmesh.contracts.ids import BlockKey
from kvmesh.engine.canary import Canary, ReusePath

log = logging.getLogger(__name__)

TOP = 8  # logprobs compared per check
# largest |served - recomputed| logprob among the reference's top tokens that is still agreement: the same kernels
# in another batch shape and another split of the prompt into chunks differ in the last bits of the activations;
# a wrong KV moves logprobs by whole units
TOLERANCE = {"fp32": 0.02, "bf16": 0.3, "fp16": 0.15, "fp8": 0.5}
REFERENCE_PRIORITY = 2**62  # vLLM's priority scheduling runs the smallest first: a reference runs last
CANARY_PREFIX = "kvmesh-canary-"


@dataclass
class Check:
    request_id: str
    path: ReusePath
    prompt: list[int]
    keys: list[BlockKey]            # the reused prefix's kvmesh blocks
    served: dict[int, float]        # the first token's top logprobs as served: token id -> logprob
    cache_salt: str = ""
    lora: Any = None                # vLLM's LoRARequest, or None
    prompt_keys: list[BlockKey] = field(default_factory=list)  # every full block of the prompt (all built on it)
    hashes: list[bytes] = field(default_factory=list)          # the prompt's vLLM block hashes


@dataclass
class Reference:
    check: Check
    request_id: str
    began: float
    cpu0: float
    logprobs: dict[int, float] = field(default_factory=dict)


def top_logprobs(per_token: Any) -> dict[int, float]:
    """vLLM's first position ``{token id: Logprob}`` as ``{token id: logprob}`` (its ranked entries)."""
    if not per_token:
        return {}
    return {int(tid): float(e.logprob) for tid, e in per_token[0].items() if e.rank is not None and e.rank <= TOP}


def divergence(served: dict[int, float], recomputed: dict[int, float]) -> float:
    """The largest logprob difference among the recompute's top tokens (inf when the served distribution lacks
    the recompute's most likely token, or one that should rank within its top by more than noise)."""
    if not recomputed:
        return 0.0
    worst = 0.0
    floor = min(served.values()) if served else float("inf")
    best = max(recomputed, key=recomputed.__getitem__)
    for tid, lp in recomputed.items():
        if tid in served:
            worst = max(worst, abs(served[tid] - lp))
        elif tid == best:
            return float("inf")
        else:  # outside the served top: it must have been below the served top's last, give or take noise
            worst = max(worst, lp - floor)
    return worst


class VLLMCanary:
    """The checks of one vLLM engine: sampling, budget and counts are the native canary's (``Canary``)."""

    def __init__(self, share: float, budget: float, dtype: str, kv_dtype: str) -> None:
        self.core = Canary(share, budget)
        self.tolerance = max(TOLERANCE.get(dtype, 0.02), TOLERANCE.get(kv_dtype, 0.02))  # the coarser of the two
        self.sampled: set[str] = set()       # requests asked for TOP logprobs, their first output not yet seen
        self.pending: list[Check] = []
        self.running: Reference | None = None
        self.largest_ok = 0.0  # the largest divergence within tolerance so far (how much margin it has)
        self._ids = itertools.count()

    def wants(self) -> bool:
        """Whether a request being added is sampled (decided before it runs: it must ask for logprobs)."""
        return len(self.pending) < self.core.max_pending and self.core.wants()

    def due(self) -> float | None:
        """Seconds until a reference may start (None: nothing to check, or one running)."""
        if self.running is not None or not self.pending:
            return None
        return self.core.wait_s()

    def start(self) -> Reference:
        check = self.pending.pop(0)
        self.running = Reference(check, f"{CANARY_PREFIX}{next(self._ids)}", time.monotonic(), time.thread_time())
        return self.running

    def finish(self) -> tuple[Check, float, bool]:
        """The running reference ended: (its check, the divergence, whether it is out of tolerance); counted."""
        ref, self.running = self.running, None
        assert ref is not None
        self.core.spent(time.monotonic() - ref.began, time.thread_time() - ref.cpu0)
        err = divergence(ref.check.served, ref.logprobs)
        bad = err > self.tolerance
        if not bad:
            self.largest_ok = max(self.largest_ok, err)
        log.debug("KV canary: request %s (%s): largest logprob difference %.3g", ref.check.request_id,
                  ref.check.path.value, err)
        key = (ref.check.path.value, "diverged" if bad else "ok")
        self.core.counts[key] = self.core.counts.get(key, 0) + 1
        return ref.check, err, bad

    def abandon(self) -> None:
        """The running reference failed (the step failed, the engine died): no verdict, the budget still pays."""
        if self.running is not None:
            self.core.spent(time.monotonic() - self.running.began, time.thread_time() - self.running.cpu0)
            self.running = None
