"""A migrated stream's earlier output tokens in vLLM's presence and frequency penalties (vLLM 0.32's v1 logits
processors).

A stream that goes on on a vLLM instance after another one stopped (``EngineRequest.generated``) is vLLM's
prompt whole, the tokens streamed so far at its end: vLLM's repetition penalty counts them (it reads the prompt
and the output), but its presence and frequency penalties read only what vLLM itself generates, so the stream
would go on as though it had said nothing yet. The native engine counts them as output (``Tally``); this
processor makes vLLM do the same, exactly:

vLLM applies, for a token ``t`` of the earlier outputs (in its prompt, so always under the repetition penalty
``r``): ``rep(x) - f * own(t) - p * [t in own]``, with ``rep(x) = x / r`` for ``x > 0`` else ``x * r`` and
``own`` its own output so far. The stream's rule is ``rep(x) - f * (own(t) + earlier(t)) - p * [t in own or
earlier]``. Running before vLLM's penalties (custom logits processors do), this one sets the token's logit to
``rep⁻¹(rep(x) - f * earlier(t) - p * [t not in own])``; ``rep`` is a monotone bijection, so vLLM's own steps then
give the stream's rule. The logit bias and ``min_tokens`` (vLLM's built-in processors) come before it, as before
penalties in both engines.

The request carries its earlier tokens in ``SamplingParams.extra_args[EARLIER]`` (``requests.sampling_params``);
a request without them, or with neither penalty set, gets no processor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

EARLIER = "kvmesh_earlier_outputs"  # SamplingParams.extra_args key: the stream's output before this instance


class EarlierOutputs(AdapterLogitsProcessor):
    """vLLM's per-request adapter: an :class:`Earlier` for each request that carries earlier outputs and sets a
    presence or frequency penalty."""

    def is_argmax_invariant(self) -> bool:
        return False  # it moves logits: greedy requests need it too

    def new_req_logits_processor(self, params: SamplingParams) -> Earlier | None:
        earlier = (params.extra_args or {}).get(EARLIER)
        if not earlier or (not params.presence_penalty and not params.frequency_penalty):
            return None
        return Earlier(earlier, params.presence_penalty, params.frequency_penalty, params.repetition_penalty)


class Earlier:
    """One request's adjustment (module docstring): called with vLLM's running output ids and the request's row
    of logits, before vLLM's penalties."""

    def __init__(self, earlier: Sequence[int], presence: float, frequency: float, repetition: float) -> None:
        counts = Counter(int(t) for t in earlier)
        self.tokens = list(counts)
        self.ids = torch.tensor(self.tokens, dtype=torch.long)
        self.frequency = torch.tensor([frequency * n for n in counts.values()], dtype=torch.float32)
        self.presence, self.repetition = presence, repetition
        self._own: set[int] = set()  # vLLM's own outputs so far (read incrementally from its running list)
        self._read = 0

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for t in output_ids[self._read:]:
            if t >= 0:  # -1: a placeholder of a token not sampled yet (async scheduling)
                self._own.add(t)
        self._read = len(output_ids)
        if self.ids.device != logits.device:  # once: the request's rows stay on one device
            self.ids, self.frequency = self.ids.to(logits.device), self.frequency.to(logits.device)
        ids = self.ids
        x = logits[ids].float()
        r = self.repetition
        y = torch.where(x > 0, x / r, x * r) if r != 1.0 else x
        y = y - self.frequency
        if self.presence:
            unseen = torch.tensor([t not in self._own for t in self.tokens], dtype=torch.bool, device=y.device)
            y = y - self.presence * unseen
        if r != 1.0:
            y = torch.where(y > 0, y * r, y / r)
        logits[ids] = y.to(logits.dtype)
        return logits
