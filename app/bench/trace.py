"""Mooncake's request-trace format: one JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (ids of the prompt's 512-token blocks; equal ids = equal prefix blocks)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, max_requests: int | None = None) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f):
            if max_requests is not None and n >= max_requests:
                break
            if not line.strip():
                continue
            d = json.loads(line)
            try:
                out.append(TraceRequest(d["timestamp"] / 1000.0, int(d["input_length"]), int(d["output_length"]),
                                        tuple(d["hash_ids"])))
            except (KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n + 1}: not a Mooncake trace line ({e})") from None
    return out


def synthesize_prompt(hash_ids: tuple[int, ...], input_length: int, token_scale: float, vocab: tuple[int, int],
                      block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """Deterministic token content: block i's tokens come from a generator seeded by its hash id, so equal ids give
    equal tokens (and equal prefixes give equal block keys). Lengths shrink by ``token_scale``."""
    per_block = max(1, round(block_tokens * token_scale))
    total = max(1, round(input_length * token_scale))
    lo, hi = vocab
    tokens: list[int] = []
    for hid in hash_ids:
        rng = random.Random(hid * 2654435761 % 2**32)
        tokens.extend(rng.randrange(lo, hi) for _ in range(per_block))
        if len(tokens) >= total:
            break
    return tokens[:total]
