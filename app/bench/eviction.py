"""Eviction figures for docs/benchmarks.md: hit rate per strategy × capacity (with Belady), a synthetic agentic
trace the strategies were not designed on, and the cost per access of the eviction queue at 1M cached blocks.

    python -m app.bench.eviction table --trace T [--capacities 1000,6000,20000]
    python -m app.bench.eviction synth --out agentic.jsonl   # fixed seed
    python -m app.bench.eviction cost [--blocks 1000000] [--policy duel]

How far any keep-time strategy could get on a trace: ``python -m app.bench.eviction_bound``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import time
from dataclasses import dataclass

from kvmesh.contracts.names import Eviction
from kvmesh.engine.eviction import make_policy
from kvmesh.engine.eviction_queue import EvictionQueue

from app.bench.trace import load_trace
from app.sim import simulate


def table(trace_path: str, capacities: list[int], max_requests: int | None = None) -> str:
    trace = load_trace(trace_path, max_requests)
    names = [*Eviction.online(), *(e for e in Eviction if e.needs_future)]
    rows = []
    for name in names:
        cells = []
        for cap in capacities:
            r = simulate(trace, 1, "round_robin", cap, 0, eviction=name)
            cells.append(f"{r['hit_rate'] * 100:.1f}% ({r['hit_rate_second_half'] * 100:.1f}%)")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    head = "| eviction | " + " | ".join(f"{c:,} blocks" for c in capacities) + " |"
    return "\n".join([head, "|---" * (len(capacities) + 1) + "|", *rows])


def synth(out: str, sessions: int = 1500, seed: int = 7) -> int:
    """An agentic, multi-tenant trace: 8 tenants each with a long tool/system prefix (20-60 blocks) shared by
    all its sessions; each session runs 2-12 agent steps a few seconds apart, every step appending 1-4 blocks
    (tool output) to the session's context. Reuse is mostly short-gap and deep, unlike the chat trace."""
    rng = random.Random(seed)
    prefixes, next_id = shared_prefixes(rng, 8)
    events = []
    for _ in range(sessions):
        tenant = min(int(rng.paretovariate(1.2)) - 1, 7)
        ctx = [0, *prefixes[tenant]]
        t = rng.uniform(0, 3600_000)
        for _ in range(rng.randint(2, 12)):
            grow = rng.randint(1, 4)
            ctx = ctx + list(range(next_id, next_id + grow))
            next_id += grow
            events.append((t, list(ctx)))
            ctx = ctx[:-1]  # the last block is partial: the next step's version of it differs
            t += rng.expovariate(1 / 8000)
    events.sort(key=lambda e: e[0])
    with open(out, "w") as f:
        for t, ids in events:
            f.write(json.dumps({"timestamp": round(t), "input_length": 512 * len(ids) - 100,
                                "output_length": 200, "hash_ids": ids}) + "\n")
    return len(events)


def shared_prefixes(rng: random.Random, count: int) -> tuple[list[list[int]], int]:
    """``count`` system / tool preambles of 20-60 blocks each (ids from 1 on, after the shared block 0), and the
    next free id."""
    next_id, out = 1, []
    for _ in range(count):
        n = rng.randint(20, 60)
        out.append(list(range(next_id, next_id + n)))
        next_id += n
    return out, next_id


@dataclass(eq=False)
class Block:
    """A hand-made :class:`~kvmesh.engine.eviction.Evictable` (the cost measurement and the unit tests)."""

    last_access: float
    hit_count: int = 0
    priority: int = 0
    priority_until: float = 0.0
    depth: int = 0
    extended: bool = True
    next_use: float = math.inf
    key: int | None = None


def cost(blocks: int = 1_000_000, accesses: int = 200_000, policy: str = "tailfirst", seed: int = 0) -> dict:
    """µs per access (re-rank one block) and per eviction (take the lowest, push it back as a new block) with
    ``blocks`` cached, and per eviction while the queue re-ranks everything after a change of mind (``duel``)."""
    rng = random.Random(seed)
    strategy = make_policy(policy)
    q: EvictionQueue[Block] = EvictionQueue(strategy)
    items = [Block(float(i), depth=i % 64, key=i) for i in range(blocks)]
    for b in items:
        q.push(b, b.last_access)
    picks = [items[rng.randrange(blocks)] for _ in range(accesses)]
    t0 = time.perf_counter()
    for n, b in enumerate(picks):
        strategy.on_hit(b, blocks + n)
        b.last_access, b.hit_count = blocks + n, b.hit_count + 1
        q.push(b, b.last_access)
    access_us = (time.perf_counter() - t0) / accesses * 1e6
    t0 = time.perf_counter()
    for _ in range(accesses):
        victim = q.pop(blocks + accesses)
        assert victim is not None
        strategy.on_evict(victim, blocks + accesses)
        q.push(victim, victim.last_access)  # keep the queue at ``blocks``
    evict_us = (time.perf_counter() - t0) / accesses * 1e6
    # A change of mind (``duel``'s epoch): the queue ranks everything afresh, a few items per eviction.
    q._epoch -= 1
    t0 = time.perf_counter()
    for _ in range(accesses):
        victim = q.pop(blocks + accesses)
        assert victim is not None
        strategy.on_evict(victim, blocks + accesses)
        q.push(victim, victim.last_access)
    rerank_us = (time.perf_counter() - t0) / accesses * 1e6
    return {"policy": policy, "blocks": blocks, "access_us": round(access_us, 2), "evict_us": round(evict_us, 2),
            "evict_us_reranking": round(rerank_us, 2)}


def pool_cost(blocks: int = 100_000, puts: int = 2_000, policy: str = "lru") -> dict:
    """µs per put into cachesvc's DRAM tier when it is full (each put evicts one block) with ``blocks`` held."""
    from kvmesh.contracts.layout import KVLayout

    from services.cachesvc.dram import DramTier
    from services.cachesvc.store import Retention, StoredBlock

    layout = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp32")  # 64 bytes
    ticks = iter(itertools.count(1))
    tier = DramTier(blocks * layout.block_nbytes, make_policy(policy), lambda key: False,
                    lambda: float(next(ticks)))
    data = bytes(layout.block_nbytes)
    for key in range(blocks):
        tier.put(layout, [StoredBlock(key, 0, data)], Retention())
    t0 = time.perf_counter()
    for key in range(blocks, blocks + puts):
        tier.put(layout, [StoredBlock(key, 0, data)], Retention())
    return {"tier": "dram", "policy": policy, "blocks": blocks,
            "put_us": round((time.perf_counter() - t0) / puts * 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.eviction")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("--trace", required=True)
    t.add_argument("--capacities", default="1000,6000,20000")
    t.add_argument("--max-requests", type=int)
    s = sub.add_parser("synth")
    s.add_argument("--out", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--blocks", type=int, default=1_000_000)
    c.add_argument("--policy", default="tailfirst")
    pc = sub.add_parser("pool-cost", help="cachesvc's DRAM tier: µs per put that evicts")
    pc.add_argument("--blocks", type=int, default=100_000)
    pc.add_argument("--policy", default="lru")
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(table(args.trace, [int(x) for x in args.capacities.split(",")], args.max_requests))
    elif args.cmd == "synth":
        print(f"{synth(args.out)} requests written to {args.out}")
    elif args.cmd == "pool-cost":
        print(json.dumps(pool_cost(args.blocks, policy=args.policy)))
    else:
        print(json.dumps(cost(args.blocks, policy=args.policy)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
