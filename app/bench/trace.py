"""Mooncake's request-trace format: one JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (ids of the prompt's 512-token blocks; equal ids = equal prefix blocks).

Optional session fields (kvmesh's, read where present): ``session_id`` (a string: the conversation or agent task
the request belongs to), ``session_end`` (true on a session's last request: the client says it is over) and
``pause`` (true when the response ends in a tool call: the session is back after the tool runs) and
``parent_session_id`` (a sub-agent's request: the session it was forked from, whose context it starts with). A trace
without session ids (Mooncake's) gets them rebuilt from its prefix chains (:func:`rebuild_sessions`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str = ""
    session_end: bool = False
    pause: bool = False
    parent_session_id: str = ""


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
                session, parent = d.get("session_id", ""), d.get("parent_session_id", "")
                for name, value in (("session_id", session), ("parent_session_id", parent)):
                    if not isinstance(value, str):
                        raise TypeError(f"{name} must be a string, not {value!r}")
                out.append(TraceRequest(d["timestamp"] / 1000.0, int(d["input_length"]), int(d["output_length"]),
                                        tuple(d["hash_ids"]), session, bool(d.get("session_end", False)),
                                        bool(d.get("pause", False)), parent))
            except (KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n + 1}: not a Mooncake trace line ({e})") from None
    return out


def dump_trace(trace: list[TraceRequest], path: str | Path) -> None:
    """``trace`` as JSONL (the session fields only where set)."""
    with open(path, "w") as f:
        for r in trace:
            d: dict = {"timestamp": round(r.arrival_s * 1000), "input_length": r.input_length,
                       "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            if r.session_id:
                d["session_id"] = r.session_id
            if r.session_end:
                d["session_end"] = True
            if r.pause:
                d["pause"] = True
            if r.parent_session_id:
                d["parent_session_id"] = r.parent_session_id
            f.write(json.dumps(d) + "\n")


def rebuild_sessions(trace: list[TraceRequest]) -> list[TraceRequest]:
    """Session ids and end marks for a trace that has none, from its prefix chains: a request continues the
    session whose latest request it extends (it starts with every full block of it: all its blocks but the
    last, which is partial, and more than the first block, which every request shares), the most recent such
    session when several qualify; otherwise it starts a session. Each session's last request is marked as its
    end. On Mooncake's conversation trace: 8,071 sessions, 2,043 of them with more than one turn (6,003 of its
    12,031 requests)."""
    latest: dict[int, tuple[int, ...]] = {}                     # session -> its latest request's blocks
    by_prefix: dict[tuple[int, ...], set[int]] = defaultdict(set)  # leading blocks -> sessions whose latest has them
    sessions: list[int] = []
    for r in trace:
        ids, found = r.hash_ids, None
        for k in range(len(ids), 1, -1):
            fits = [s for s in by_prefix.get(ids[:k], ()) if k >= len(latest[s]) - 1]
            if fits:
                found = max(fits)
                break
        if found is None:
            found = len(latest)
        else:
            old = latest[found]
            for k in range(1, len(old) + 1):
                by_prefix[old[:k]].discard(found)
        latest[found] = ids
        for k in range(1, len(ids) + 1):
            by_prefix[ids[:k]].add(found)
        sessions.append(found)
    last = {s: n for n, s in enumerate(sessions)}
    return [dataclasses.replace(r, session_id=f"s{s}", session_end=last[s] == n, pause=False)
            for n, (r, s) in enumerate(zip(trace, sessions))]


def signals_share(session_id: str, share: float) -> bool:
    """Whether session ``session_id`` is among the ``share`` of sessions whose client signals (a fixed hash:
    the same sessions at every run, and a larger share keeps those of a smaller one)."""
    return zlib.crc32(session_id.encode()) / 2**32 < share


def with_sessions(trace: list[TraceRequest], end_share: float = 1.0, unsignalled: str = "anonymous"
                  ) -> list[TraceRequest]:
    """The trace as a cache hears it when only ``end_share`` of its sessions' clients say when a session ends:
    sessions rebuilt from the prefix chains when it has none; the other sessions' requests carry no session id
    at all (``unsignalled="anonymous"``: a client that does not manage its sessions), or their id and pauses
    but never an end (``"named"``)."""
    if not 0.0 <= end_share <= 1.0:
        raise ValueError(f"the session end share must be in [0, 1], not {end_share}")
    if unsignalled not in ("anonymous", "named"):
        raise ValueError(f"unsignalled sessions are 'anonymous' or 'named', not {unsignalled!r}")
    if not any(r.session_id for r in trace):
        trace = rebuild_sessions(trace)
    out = []
    for r in trace:
        if not r.session_id or signals_share(r.session_id, end_share):
            out.append(r)
        elif unsignalled == "named":
            out.append(dataclasses.replace(r, session_end=False))
        else:
            out.append(dataclasses.replace(r, session_id="", session_end=False, pause=False,
                                           parent_session_id=""))
    return out


def last_requests(trace: list[TraceRequest]) -> dict[str, int]:
    """Each session's last request: its index in ``trace``."""
    return {r.session_id: n for n, r in enumerate(trace) if r.session_id}


def with_every_end(trace: list[TraceRequest]) -> list[TraceRequest]:
    """The trace as a cache would hear it if every session's last request said so, an abandoned one's too: the
    information no client has (whether its user comes back), for measuring what that information is worth. A
    session's last request carries ``session_end`` and no pause; the other requests are unchanged."""
    last = last_requests(trace)
    return [dataclasses.replace(r, session_end=True, pause=False)
            if r.session_id and last[r.session_id] == n and not r.session_end else r for n, r in enumerate(trace)]


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
