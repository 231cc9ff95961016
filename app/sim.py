"""``kvmesh sim``: replay a Mooncake trace on N simulated prefill instances, with the real routing policies
(``kvmesh.routing``) and eviction strategies, and a cost model calibrated from the engine.

Each instance prefills its queue first-come first-served; a request's TTFT is its wait + the prefill time of the
tokens not served from cache + the time to fetch the blocks it takes from the global pool. Blocks are the trace's
512-token blocks. Time is scaled (``--time-scale``, default ``auto``) so that the offered prefill work with no
reuse at all would keep the cluster exactly busy: the policies then compete on how much work reuse saves.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.contracts.names import Eviction
from kvmesh.engine.eviction import make_policy as make_eviction
from kvmesh.engine.eviction_queue import EvictionQueue
from kvmesh.engine.sessions import owner_after
from kvmesh.routing import CacheAware, Candidate, CostModel, make_policy
from kvmesh.routing.hits import POOL, BlockHistory, Explainer, RouteView, attribute

from app.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace, with_sessions

SECTION = "Routing simulator, {instances} instances"  # --write: the section of docs/benchmarks.md
SIM_POLICIES = ("random", "round_robin", "least_loaded", "cache_aware_local", "cache_aware")


class BlockCache:
    """A bounded set of block ids, evicted by the same strategy classes as the engine, exactly (one block at a
    time, through :class:`EvictionQueue`). Any block may go, as in Mooncake's simulator; the strategies rank a
    chain's tail first themselves. The clock counts block accesses, so LRU is exact."""

    @dataclass(slots=True, eq=False)
    class Entry:
        last_access: float
        depth: int
        parent: int | None
        hit_count: int = 0
        priority: int = 0
        priority_until: float = 0.0
        prev_access: float = -math.inf
        fanout: int = 0         # cached children
        extended: bool = False  # has had a child (not a request's tail)
        next_use: float = math.inf
        key: int | None = None  # the block id (what a strategy's ghost list of evicted blocks remembers)
        session_owner: str = ""  # the session that used it ("" none, ``sessions.SHARED`` several)

    def __init__(self, capacity: int, eviction: Eviction | str = Eviction.LRU,
                 on_evict: Callable[[int], None] | None = None) -> None:
        self.capacity = capacity
        self.on_evict = on_evict  # told each evicted block id (hit attribution's record of evictions)
        self.strategy = make_eviction(eviction, online=False)
        self.items: dict[int, BlockCache.Entry] = {}
        self.queue: EvictionQueue[int] = EvictionQueue(self.strategy, self.items.__getitem__)
        self.sessions = getattr(self.strategy, "sessions", None)  # a session-aware strategy's table
        if self.sessions is not None:  # the clock counts block accesses: no pause length means anything yet
            self.sessions.default_pause_s = math.inf
        self.clock = 0.0

    def prefix(self, ids: tuple[int, ...]) -> int:
        n = 0
        for i in ids:
            if i not in self.items:
                break
            n += 1
        return n

    def touch(self, ids: tuple[int, ...], hits: int, next_uses: tuple[float, ...] | None = None,
              session: str = "", end: bool = False, pause: bool = False) -> None:
        """Insert ``ids`` (the first ``hits`` were cache hits) as most recently used; ``next_uses``: when each is
        used next (what ``belady`` reads); ``session``: the request's session ("" = none), ``end``: its last
        request, ``pause``: its response ends in a tool call. The pause is heard before the cache makes room:
        an engine cannot evict a running request's blocks, and once it is done they are a paused session's, so
        they compete for the room as such (heard after it, they would go first, as a live session's)."""
        policy, items = self.strategy, self.items
        parent, parent_new = None, False
        for n, i in enumerate(ids):
            self.clock += 1
            e = items.get(i)
            new = e is None
            if (new or parent_new) and parent is not None:  # a new child, or its parent came back
                items[parent].fanout += 1
                items[parent].extended = True
            if e is None:
                e = items[i] = BlockCache.Entry(self.clock, n, parent, key=i)
            else:
                if n < hits:
                    policy.on_hit(e, self.clock)
                    e.hit_count += 1
                e.prev_access, e.last_access = e.last_access, self.clock
            if next_uses is not None:
                e.next_use = next_uses[n]
            e.session_owner = owner_after(e.session_owner, session)
            parent, parent_new = i, new
        if session and self.sessions is not None:
            changed = self.sessions.request(session, ids, self.clock, end)
            if pause and not end:
                changed |= self.sessions.pause(session, self.clock)
            self._rerank(changed)
        for i in ids:
            self.queue.push(i, self.clock)
        while len(items) > self.capacity:
            self._evict_one()

    def pause(self, session: str, expected_s: float = 0.0) -> None:
        """``session``'s last response ended in a tool call (``expected_s``: the pause it announced, 0 none)."""
        if session and self.sessions is not None:
            self._rerank(self.sessions.pause(session, self.clock, expected_s=expected_s))

    def _rerank(self, blocks: set[int]) -> None:
        for i in blocks:
            if i in self.items:
                self.queue.push(i, self.clock)

    def _evict_one(self) -> None:
        victim = self.queue.pop(self.clock)
        assert victim is not None
        e = self.items.pop(victim)
        self.strategy.on_evict(e, self.clock)
        if self.on_evict is not None:
            self.on_evict(victim)
        parent = self.items.get(e.parent) if e.parent is not None else None
        if parent is not None:
            parent.fanout = max(0, parent.fanout - 1)
            self.queue.push(e.parent, self.clock)  # type: ignore[arg-type]


def next_uses(trace: list[TraceRequest]) -> list[tuple[float, ...]]:
    """Per request, per block: the index of the next request that holds the block (``inf``: none)."""
    out: list[tuple[float, ...]] = [()] * len(trace)
    seen: dict[int, float] = {}
    for n in range(len(trace) - 1, -1, -1):
        ids = trace[n].hash_ids
        out[n] = tuple(seen.get(i, math.inf) for i in ids)
        for i in ids:
            seen[i] = n
    return out


class SimHits:
    """Hit attribution of the simulated fleet: each request's missed tokens by cause (``kvmesh.routing.hits``,
    the router's own rules, fed the simulator's exact view: no index lag, no namespaces, every fetch works) and
    the recorded stream the offline optimum replays. The clock is the request's index."""

    def __init__(self) -> None:
        self.history = BlockHistory(max_keys=10**9)
        self.causes: dict[str, int] = {}
        self.stream: list[tuple[list[int], int]] = []
        self.prompt = self.delivered = self.predicted = 0
        self.now = 0.0

    def evicted(self, where: str) -> Callable[[int], None]:
        return lambda block: self.history.removed(where, "device" if where != POOL else POOL, (block,), self.now)

    def served(self, r: TraceRequest, n: int, chosen: str, matched: dict[str, int], reason: str,
               delivered: int) -> None:
        self.now = float(n)
        view = RouteView(chosen, matched, reason=reason, at=self.now, pool_outcome="adopted")
        att = attribute(r.input_length, TRACE_BLOCK_TOKENS, r.hash_ids, delivered,
                        Explainer(view, self.history, r.hash_ids), view.predicted_blocks() * TRACE_BLOCK_TOKENS)
        for c, t in att.by_cause().items():
            self.causes[c] = self.causes.get(c, 0) + t
        self.prompt += att.prompt_tokens
        self.delivered += att.delivered_tokens
        self.predicted += att.predicted_tokens
        self.stream.append((list(r.hash_ids), r.input_length))

    def stored(self, where: str, ids: tuple[int, ...], n: int) -> None:
        self.history.stored(where, "device" if where != POOL else POOL, ids, float(n) + 0.5)

    def report(self, capacity_blocks: int) -> dict:
        from app.hits_cli import summary

        return summary(len(self.stream), self.prompt, self.predicted, self.delivered, self.causes, self.stream,
                       TRACE_BLOCK_TOKENS, capacity_blocks)


@dataclass
class Instance:
    id: str
    cache: BlockCache
    free_at: float = 0.0


def simulate(trace: list[TraceRequest], instances: int, policy: str, capacity_blocks: int,
             pool_blocks: int | None = None, cost: CostModel | None = None, time_scale: float | str = "auto",
             slo_ttft_s: float | None = None, eviction: str = "lru", seed: int = 0, hits: bool = False) -> dict:
    if policy not in SIM_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(SIM_POLICIES)}")
    cost = cost or CostModel(block_bytes=CostModel().block_bytes * TRACE_BLOCK_TOKENS // 16)
    duration = max(r.arrival_s for r in trace) or 1.0
    if time_scale == "auto":
        work = sum(cost.prefill_s(r.input_length) for r in trace)
        time_scale = work / (instances * duration)
    scale = float(time_scale)
    ledger = SimHits() if hits else None
    insts = [Instance(f"i{k:03d}", BlockCache(capacity_blocks, eviction,
                                              ledger.evicted(f"i{k:03d}") if ledger else None))
             for k in range(instances)]
    use_pool = policy == "cache_aware"
    pool = BlockCache(pool_blocks if pool_blocks is not None else capacity_blocks * instances, eviction,
                      ledger.evicted(POOL) if ledger else None)
    chooser = CacheAware(cost, use_pool=use_pool) if policy.startswith("cache_aware") else make_policy(policy)
    future = next_uses(trace) if pool.strategy.name.needs_future else None
    ttfts, served_blocks, total_blocks, computed_tokens = [], 0, 0, 0
    half = len(trace) // 2
    held_served = held_total = 0
    for n, r in enumerate(trace):
        t = r.arrival_s * scale
        cands = []
        for inst in insts:
            queued = max(0.0, inst.free_at - t) * cost.prefill_tok_per_s
            local = inst.cache.prefix(r.hash_ids)
            cands.append(Candidate(inst.id, queued_tokens=int(queued), local_blocks=local))
        pool_prefix = pool.prefix(r.hash_ids) if use_pool else 0
        decision = chooser.choose(cands, r.input_length, TRACE_BLOCK_TOKENS, pool_prefix)
        chosen = decision.chosen
        assert chosen is not None
        inst = next(i for i in insts if i.id == chosen.id)
        local = chosen.local_blocks
        fetched = max(0, pool_prefix - local)
        hit_blocks = local + fetched
        hit_tokens = min(r.input_length - 1, hit_blocks * TRACE_BLOCK_TOKENS)
        if ledger is not None:
            matched = {c.id: c.local_blocks for c in cands if c.local_blocks}
            if pool_prefix:
                matched[POOL] = pool_prefix
            ledger.served(r, n, chosen.id, matched, decision.reason, hit_tokens)
        compute = cost.prefill_s(r.input_length - hit_tokens) + cost.fetch_s(fetched)
        start = max(t, inst.free_at)
        inst.free_at = start + compute
        ttfts.append(inst.free_at - t)
        nexts = future[n] if future is not None else None
        if ledger is not None:
            ledger.now = float(n)
        inst.cache.touch(r.hash_ids, local, nexts, r.session_id, r.session_end, r.pause)
        if use_pool:
            pool.touch(r.hash_ids, pool_prefix, nexts, r.session_id, r.session_end, r.pause)
        if ledger is not None:
            ledger.stored(inst.id, r.hash_ids, n)
            if use_pool:
                ledger.stored(POOL, r.hash_ids, n)
        served_blocks += min(hit_blocks, len(r.hash_ids))
        total_blocks += len(r.hash_ids)
        if n >= half:
            held_served += min(hit_blocks, len(r.hash_ids))
            held_total += len(r.hash_ids)
        computed_tokens += r.input_length - hit_tokens
    ttfts_sorted = sorted(ttfts)
    slo = slo_ttft_s if slo_ttft_s is not None else 5 * statistics.mean(cost.prefill_s(r.input_length) for r in trace)
    return {
        **({"hits": ledger.report(capacity_blocks * instances + (pool.capacity if use_pool else 0))}
           if ledger is not None else {}),
        "policy": policy, "instances": instances, "requests": len(trace), "capacity_blocks": capacity_blocks,
        "eviction": eviction, "hit_rate": served_blocks / total_blocks if total_blocks else 0.0,
        "hit_rate_first_half": (served_blocks - held_served) / max(1, total_blocks - held_total),
        "hit_rate_second_half": held_served / max(1, held_total),
        "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": ttfts_sorted[len(ttfts) // 2],
        "ttft_p90_s": ttfts_sorted[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "slo_ttft_s": slo, "slo_attainment": sum(x <= slo for x in ttfts) / len(ttfts),
        "prefill_tokens_computed": computed_tokens, "time_scale": scale,
        "prefill_tok_per_s": cost.prefill_tok_per_s,
        "sessions": len({r.session_id for r in trace if r.session_id}),
        "sessions_ended": sum(r.session_end for r in trace),
    }


def _write(args: argparse.Namespace, results: list[dict]) -> None:
    from app.bench.report import markdown_table, write_section

    rows = [{"policy": r["policy"], "block hit rate": f"{r['hit_rate'] * 100:.1f}%",
             "TTFT mean s": f"{r['ttft_mean_s']:.1f}", "TTFT p90 s": f"{r['ttft_p90_s']:.1f}",
             "SLO attainment": f"{r['slo_attainment'] * 100:.1f}%"} for r in results]
    r0 = results[0]
    body = (f"{r0['requests']} requests of `{args.trace.split('/')[-1]}` on {args.instances} simulated prefill "
            f"instances, {args.capacity_blocks} blocks (512 tokens) of local cache each, global pool "
            f"{args.pool_blocks or args.capacity_blocks * args.instances} blocks; prefill "
            f"{r0['prefill_tok_per_s']:.0f} tok/s per instance, arrivals stretched x{r0['time_scale']:.1f} so the "
            "cluster would be exactly busy "
            f"without reuse; SLO: TTFT <= {r0['slo_ttft_s']:.1f} s (5x the mean cold prefill).\n\n"
            + markdown_table(rows, ["policy", "block hit rate", "TTFT mean s", "TTFT p90 s", "SLO attainment"]))
    cmd = (f"kvmesh sim --trace {args.trace} --instances {args.instances} --policy {args.policy} "
           f"--capacity-blocks {args.capacity_blocks} --write")
    write_section(SECTION.format(instances=args.instances), cmd, body)


HITS_SECTION = "Hit attribution on the simulated fleet, {instances} instances"


def _write_hits(args: argparse.Namespace, results: list[dict]) -> None:
    from app.bench.report import markdown_table, write_section

    rows, causes = [], sorted({c for r in results for c in r["hits"]["missed_by_cause"]})
    for r in results:
        h = r["hits"]
        p = max(1, h["prompt_tokens"])
        rows.append({"policy": r["policy"], "delivered hit": f"{h['delivered_hit_tokens'] / p:.1%}",
                     **{f"{c} (of missed)": f"{h['missed_share_by_cause'].get(c, 0):.1%}" for c in causes},
                     "causes add up": "yes" if h["causes_add_up"] else "NO",
                     "optimum: infinite": f"{h['optimum_infinite_hit_tokens'] / p:.1%}",
                     "optimum: Belady": f"{h['optimum_belady_hit_tokens'] / p:.1%}",
                     "gap to Belady": f"{(h['optimum_belady_hit_tokens'] - h['delivered_hit_tokens']) / p:.1%}"})
    h0 = results[0]["hits"]
    body = (f"{h0['requests']} requests, {h0['prompt_tokens']} prompt tokens of `{args.trace.split('/')[-1]}` on "
            f"{args.instances} simulated instances of {args.capacity_blocks} blocks (512 tokens) each. Every "
            "missed prefill token attributed to one cause by the router's rules (`kvmesh.routing.hits`); the "
            "shares are of the missed tokens, and they add up to the missed tokens exactly. The optimum replays "
            "the same block stream through one cache shared by the fleet: infinite, and Belady's over the fleet's "
            "capacity (instances' caches + the pool where the policy uses one); the gap to it is the hit a perfect "
            "router with perfect eviction could still win.\n\n"
            + markdown_table(rows, ["policy", "delivered hit", *(f"{c} (of missed)" for c in causes), "causes add up",
                                    "optimum: infinite", "optimum: Belady", "gap to Belady"]))
    cmd = (f"kvmesh sim --trace {args.trace} --instances {args.instances} --policy {args.policy} "
           f"--capacity-blocks {args.capacity_blocks} --hits --write")
    write_section(HITS_SECTION.format(instances=args.instances), cmd, body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--policy", default="cache_aware", choices=SIM_POLICIES + ("all",))
    p.add_argument("--capacity-blocks", type=int, default=6000, help="local cache per instance, 512-token blocks")
    p.add_argument("--pool-blocks", type=int, help="global pool capacity (default: instances × capacity)")
    p.add_argument("--eviction", default="lru", choices=sorted(e.value for e in Eviction),
                   help="eviction strategy of every cache (belady: the offline optimum, for reference)")
    p.add_argument("--session-end-share", type=float, default=1.0, metavar="P",
                   help="the share of sessions whose client says when they end, in [0, 1] (sessions rebuilt "
                        "from the prefix chains when the trace has no session_id)")
    p.add_argument("--unsignalled", default="anonymous", choices=("anonymous", "named"),
                   help="the other sessions' requests: without a session id, or with it but never an end")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--prefill-tok-s", type=float, default=CostModel().prefill_tok_per_s,
                   help="calibrated prefill speed of one instance (default: the engine measured here)")
    p.add_argument("--time-scale", default="auto", help="multiply arrival times; 'auto' = cluster exactly busy "
                   "without reuse")
    p.add_argument("--slo-ttft-s", type=float, help="default: 5 × the mean cold prefill time")
    p.add_argument("--hits", action="store_true", help="also attribute every missed prefill token to a cause and "
                   "compare with the offline optimum (kvmesh report hits on the simulated fleet)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", action="store_true", help="also write the table into docs/benchmarks.md (with --hits: "
                   "the hit attribution's table)")
    args = p.parse_args(argv)
    try:
        trace = with_sessions(load_trace(args.trace, args.max_requests), args.session_end_share, args.unsignalled)
    except (OSError, ValueError) as e:
        print(f"kvmesh sim: {e}", file=sys.stderr)
        return 2
    base = CostModel()
    cost = CostModel(args.prefill_tok_s, base.prefill_overhead_s, base.fetch_gbps,
                     base.block_bytes * TRACE_BLOCK_TOKENS // 16)
    scale = args.time_scale if args.time_scale == "auto" else float(args.time_scale)
    policies = SIM_POLICIES if args.policy == "all" else (args.policy,)
    results = [simulate(trace, args.instances, pol, args.capacity_blocks, args.pool_blocks, cost, scale,
                        args.slo_ttft_s, args.eviction, hits=args.hits) for pol in policies]
    if args.write:  # with --hits, the hit attribution's section alone
        (_write_hits if args.hits else _write)(args, results)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        for r in results:
            print(f"{r['policy']:>18}: hit {r['hit_rate'] * 100:5.1f}%  TTFT mean {r['ttft_mean_s']:8.2f}s  "
                  f"p90 {r['ttft_p90_s']:8.2f}s  SLO {r['slo_attainment'] * 100:5.1f}%")
            if "hits" in r:
                from app.hits_cli import text

                print(text(r["hits"]))
    return 0
