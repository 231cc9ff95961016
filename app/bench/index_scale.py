"""Index and router scale: MatchPrefix and one router's per-request CPU as instances and indexed blocks grow.

    kvmesh bench index [--instances 64,256,1024] [--blocks 1M,10M,100M] [--calls N] [--max-rss-gb G] [--quick]
                       [--no-write]

1. **Index.** For each (instances, blocks) size, a fresh ``services.cachesvc.index.BlockIndex`` in a child process
   is filled through its real ``apply`` with the KV event batches of a simulated fleet (``Fleet``): 64 system
   prompts of 64 blocks, the first held by every instance and the k-th by 1/(k+1) of them (device tier, half of
   those also in host), and per-conversation chains of 64-448 blocks on one instance that holds its system
   prompt (half of them with their first half offloaded to host, a fifth also on a second instance). Reports
   MatchPrefix p50/p99 for 256-key (4,096-token) prompts of three kinds (a held conversation; a new conversation
   behind a shared system prompt: the walk ends where the holders of the shared prefix drop out; random keys),
   the apply rate, and bytes per block (the child's RSS growth over the fill, divided by the blocks indexed).
   A size whose projected RSS passes ``--max-rss-gb`` is not filled: its bytes per block at 1M say what a shard
   of it would take.
2. **Over gRPC**, for one size (the most instances at the fewest blocks): the same batches published into
   JetStream and replayed by a real ``python -m services.cachesvc``; MatchPrefix from a sync client on this
   machine (``app.bench.cachesvc``'s harness), next to the in-process figure of the same index.
3. **The router's per-request CPU** for a 4k-token text prompt, part by part: tokenize (the default model's
   tokenizer), hash (``block_keys``), match (the in-process index's packed answer, ``match_packed``,
   shared-prefix prompt), that answer read into per-instance counts (``HolderNames``, as ``Router.matched_blocks``
   does), the fleet view (the registry's records as the planner's views, as ``Router._fleet`` builds them, one
   instance's in-flight count changed per request), and score (``kvmesh.routing.plan`` with the cache-aware
   policy over every instance, role both; beside
   it, the same without a recorded span's attributes); decisions/s of one core, and a cProfile of the whole.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import math
import multiprocessing
import pstats
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from kvmesh.contracts.events import BlockStored, KVEvent
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.messages import KVEventBatch

from app.bench.cachesvc import REPO, cachesvc, grpc_latencies
from app.bench.report import load_average, markdown_table, write_section
from app.bench.stats import percentile

SECTION = "Index and router scale"
BLOCK_SIZE = 16
PROMPT_BLOCKS = 256                   # a 4,096-token prompt
SYSTEM_PROMPTS, SYSTEM_BLOCKS = 64, 64
CONVERSATION_BLOCKS = (64, 448)       # uniform: 256 on average
ROUND = 64                            # conversations per round of batches (one batch per instance in it)
QUERY_KINDS = ("held conversation", "new conversation, shared prefix", "miss")
INDEX_COLUMNS = ["instances", "blocks", "holders", "apply (events/s)", "apply (blocks/s)", "bytes/block",
                 *(f"{k} p50 / p99 (CPU p99)" for k in QUERY_KINDS)]
ROUTER_COLUMNS = ["part", "p50", "p99", "CPU p99", "share of p50"]


class Fleet:
    """The KV events of ``instances`` simulated engines that together hold ``blocks`` distinct block keys, and
    256-key prompts to ask about them. Deterministic in ``seed``; ``batches()`` may be called again (the same
    events); the keys are random 64-bit ints, as chained xxh3 keys are."""

    def __init__(self, instances: int, blocks: int, seed: int = 0, samples: int = 1000) -> None:
        if blocks < SYSTEM_PROMPTS * SYSTEM_BLOCKS:
            raise ValueError(f"blocks must be at least {SYSTEM_PROMPTS * SYSTEM_BLOCKS} (the system prompts)")
        self.instances, self.blocks, self.seed, self.samples = instances, blocks, seed, samples
        self.held: list[list[int]] = []        # filled by batches(): prompts every key of which is indexed
        self.systems: list[tuple[BlockKey, ...]] = []  # filled by batches(): the system prompts' keys

    def batches(self) -> Iterator[KVEventBatch]:
        rng, keys = random.Random(self.seed), np.random.default_rng(self.seed)
        n = self.instances
        systems = self.systems = [tuple(_random_keys(keys, SYSTEM_BLOCKS)) for _ in range(SYSTEM_PROMPTS)]
        holders = [rng.sample(range(n), max(1, n // (s + 1))) for s in range(SYSTEM_PROMPTS)]
        seqs = [0] * n
        start: dict[int, list[KVEvent]] = {}
        for s, held_by in enumerate(holders):
            for i in held_by:
                start.setdefault(i, []).append(BlockStored(systems[s], None, BLOCK_SIZE, "device"))
                if i % 2 == 0:
                    start[i].append(BlockStored(systems[s], None, BLOCK_SIZE, "host"))
        yield from _per_instance(start, seqs)
        popularity = _popularity()
        self.held = []
        left = self.blocks - SYSTEM_PROMPTS * SYSTEM_BLOCKS
        while left > 0:
            round_events: dict[int, list[KVEvent]] = {}
            for _ in range(ROUND):
                if left <= 0:
                    break
                s = rng.choices(range(SYSTEM_PROMPTS), popularity)[0]
                chain = tuple(_random_keys(keys, min(left, rng.randint(*CONVERSATION_BLOCKS))))
                left -= len(chain)
                home = rng.choice(holders[s])
                events = round_events.setdefault(home, [])
                events.append(BlockStored(chain, systems[s][-1], BLOCK_SIZE, "device"))
                if rng.random() < 0.5:  # offloaded: its first half also in host memory
                    events.append(BlockStored(chain[:len(chain) // 2], systems[s][-1], BLOCK_SIZE, "host"))
                if rng.random() < 0.2:  # a copy elsewhere (moved, or fetched from the pool)
                    other = rng.choice(holders[s])
                    round_events.setdefault(other, []).append(
                        BlockStored(chain, systems[s][-1], BLOCK_SIZE, "device"))
                prompt = list((systems[s] + chain)[:PROMPT_BLOCKS])
                if len(prompt) == PROMPT_BLOCKS and len(self.held) < self.samples:
                    self.held.append(prompt)
            yield from _per_instance(round_events, seqs)

    def shared(self, count: int) -> list[list[int]]:
        """New conversations: a system prompt (as popular as in the fleet), then keys nobody holds."""
        rng, keys = random.Random(self.seed + 1), np.random.default_rng(self.seed + 1)
        return [list(self.systems[s]) + _random_keys(keys, PROMPT_BLOCKS - SYSTEM_BLOCKS)
                for s in rng.choices(range(SYSTEM_PROMPTS), _popularity(), k=count)]

    def misses(self, count: int) -> list[list[int]]:
        keys = np.random.default_rng(self.seed + 2)
        return [_random_keys(keys, PROMPT_BLOCKS) for _ in range(count)]


def _popularity() -> list[float]:
    return [1 / (s + 1) for s in range(SYSTEM_PROMPTS)]


def _random_keys(rng: np.random.Generator, count: int) -> list[BlockKey]:
    return np.frombuffer(rng.bytes(8 * count), np.uint64).tolist()


def _per_instance(events: dict[int, list[KVEvent]], seqs: list[int]) -> Iterator[KVEventBatch]:
    for i in sorted(events):
        seqs[i] += 1
        yield KVEventBatch(f"i{i}", seqs[i], 0.0, tuple(events[i]))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def fill(fleet: Fleet) -> tuple[object, dict]:
    """A ``BlockIndex`` fed every batch of ``fleet`` through ``apply``; and what the fill cost."""
    from services.cachesvc.index import BlockIndex  # the service's own structure

    gc.collect()
    before = rss_bytes()
    index = BlockIndex()
    applying = 0.0
    stored = 0
    for batch in fleet.batches():
        t = time.perf_counter()
        index.apply(batch)
        applying += time.perf_counter() - t
        stored += sum(len(e.block_keys) for e in batch.events if isinstance(e, BlockStored))
    gc.collect()
    assert len(index) == fleet.blocks, (len(index), fleet.blocks)
    samples = sum(sys.getsizeof(p) for p in fleet.held)  # their keys are the index's own
    return index, {"events": index.events_applied, "stored": stored, "apply_s": applying,
                   "bytes_per_block": (rss_bytes() - before - samples) / fleet.blocks,
                   "holders": len(index._ids)}


def timed_cpu(calls: list[Callable[[], object]]) -> tuple[float, float, float]:
    """Wall-clock p50 and p99 seconds of ``calls``, one at a time, and the p99 of their own CPU time (on a shared
    machine the wall p99 is mostly the time another process held the core)."""
    wall, cpu = [], []
    for call in calls:
        t, c = time.perf_counter(), time.thread_time()
        call()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    return percentile(wall, 50), percentile(wall, 99), percentile(cpu, 99)


def query_sets(fleet: Fleet, calls: int) -> dict[str, list[list[int]]]:
    rng = random.Random(2)
    return {QUERY_KINDS[0]: [rng.choice(fleet.held) for _ in range(calls)],
            QUERY_KINDS[1]: fleet.shared(calls),
            QUERY_KINDS[2]: fleet.misses(calls)}


def measure_size(instances: int, blocks: int, calls: int) -> dict:
    """One size, in a child process of its own (a clean RSS baseline; its memory goes back when it ends)."""
    fleet = Fleet(instances, blocks)
    index, cost = fill(fleet)
    row = {"instances": instances, "blocks": f"{blocks:,}", "_blocks": blocks, "holders": cost["holders"],
           "apply (events/s)": f"{cost['events'] / cost['apply_s']:,.0f}",
           "apply (blocks/s)": f"{cost['stored'] / cost['apply_s']:,.0f}",
           "bytes/block": f"{cost['bytes_per_block']:.0f}", "_bytes_per_block": cost["bytes_per_block"],
           "_rss": rss_bytes()}
    for kind, keys_list in query_sets(fleet, calls).items():
        p50, p99, cpu99 = timed_cpu([functools.partial(index.match_prefix, keys)  # type: ignore[attr-defined]
                                     for keys in keys_list])
        row[f"{kind} p50 / p99 (CPU p99)"] = f"{p50 * 1e6:.0f} / {p99 * 1e6:.0f} ({cpu99 * 1e6:.0f}) µs"
        row[f"_{kind}"] = (p50, p99, cpu99)
        row[f"_{kind} matches"] = len(index.match_prefix(keys_list[0]))  # type: ignore[attr-defined]
    return row


def bench_index(sizes: list[tuple[int, int]], calls: int, max_rss: int) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    per_block: dict[int, float] = {}  # instances -> bytes per block at the largest size measured
    measured: dict[int, int] = {}     # instances -> that size
    context = multiprocessing.get_context("fork")
    for instances, blocks in sizes:
        known = per_block.get(instances)
        if known is not None and known * blocks > max_rss:
            shards = math.ceil(known * blocks / max_rss)
            notes.append(f"{instances} instances x {blocks:,} blocks: not filled; at {known:.0f} B/block (measured "
                         f"at {measured[instances]:,} blocks) one process would hold {known * blocks / 2**30:.1f} "
                         f"GiB, over the {max_rss / 2**30:g} GiB cap: it takes {shards} shards of "
                         f"{blocks // shards:,} blocks ({known * blocks / shards / 2**30:.1f} GiB each)")
            print(notes[-1], flush=True)
            continue
        t = time.perf_counter()
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            row = pool.submit(measure_size, instances, blocks, calls).result()
        print(f"{instances} instances x {blocks:,} blocks: {time.perf_counter() - t:.0f} s, child RSS "
              f"{row['_rss'] / 2**30:.2f} GiB", flush=True)
        per_block[instances], measured[instances] = row["_bytes_per_block"], blocks
        rows.append(row)
    return rows, notes


def growth(rows: list[dict]) -> list[str]:
    """Each figure's growth as a ratio, largest over smallest: with the blocks (at the most instances) and with
    the instances (at the most blocks)."""
    out = []
    for axis, fixed, key in (("blocks", "instances", "_blocks"), ("instances", "blocks", "instances")):
        at = max(r[f"_{fixed}" if fixed == "blocks" else fixed] for r in rows)
        line = [r for r in rows if (r["_blocks"] if fixed == "blocks" else r["instances"]) == at]
        if len(line) < 2:
            continue
        small, large = min(line, key=lambda r: r[key]), max(line, key=lambda r: r[key])
        ratio = large[key] / small[key]
        figures = [f"{kind} p50 x{large[f'_{kind}'][0] / small[f'_{kind}'][0]:.1f}, "
                   f"p99 x{large[f'_{kind}'][1] / small[f'_{kind}'][1]:.1f}, "
                   f"CPU p99 x{large[f'_{kind}'][2] / small[f'_{kind}'][2]:.1f}" for kind in QUERY_KINDS]
        figures.append(f"bytes/block x{large['_bytes_per_block'] / small['_bytes_per_block']:.2f}")
        out.append(f"{axis} x{ratio:g} ({small[key]:,} -> {large[key]:,}, at {at:,} {fixed}): " + "; ".join(figures))
    return out


# -- 2. over gRPC -----------------------------------------------------------------------------------------------

def bench_grpc(instances: int, blocks: int, calls: int, work: Path) -> list[dict]:
    import asyncio

    from kvmesh.bus import Bus, NatsServer, Subjects

    fleet = Fleet(instances, blocks)
    with NatsServer(work / "nats") as nats:
        subjects = Subjects(f"x{uuid.uuid4().hex[:8]}")

        async def publish() -> None:
            bus = await Bus.connect(nats.url, "bench-producer")
            await bus.ensure_events_stream(subjects, max_bytes=8 << 30)
            for batch in fleet.batches():
                await bus.publish_event(subjects.kv_events(batch.instance_id), batch)
            await bus.close()

        asyncio.run(publish())
        queries = query_sets(fleet, calls)
        with cachesvc(nats.url, subjects.cluster, work / "cachesvc-index.log", pool_capacity_mb=0) as address:
            rows = grpc_latencies(address, queries, blocks)
    index, _ = fill(fleet)
    for kind, keys_list in queries.items():
        p50, p99, cpu99 = timed_cpu([functools.partial(index.match_prefix, keys)  # type: ignore[attr-defined]
                                     for keys in keys_list])
        rows.append({"what": f"BlockIndex.match_prefix in-process, {kind}", "p50": f"{p50 * 1e6:.0f} µs",
                     "p99": f"{p99 * 1e6:.0f} µs (CPU {cpu99 * 1e6:.0f} µs)"})
    return rows


# -- 3. the router's per-request CPU -----------------------------------------------------------------------------

def prompt_text(tokenizer: object, tokens: int) -> str:
    """At least ``tokens`` tokens of prose: docs/architecture.md, from its start, repeated as needed."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    text = doc
    while len(tokenizer.encode(text)) < tokens:  # type: ignore[attr-defined]
        text += "\n" + doc
    ids = tokenizer.encode(text)[:tokens]  # type: ignore[attr-defined]
    return tokenizer.decode(ids)  # type: ignore[attr-defined,no-any-return]


def load_tokenizer() -> tuple[object, str]:
    from kvmesh.model_source.resolve import resolve_model
    from kvmesh.model_source.tokenizer import Tokenizer, save_byte_tokenizer

    try:
        source = resolve_model(None)
        return Tokenizer.from_dir(source.hf_dir), "the default model's tokenizer"
    except (FileNotFoundError, OSError):
        directory = save_byte_tokenizer(Path(tempfile.mkdtemp(prefix="kvmesh-bench-tok-")) / "tok")
        return Tokenizer.from_dir(directory), "a byte-level tokenizer (the default model is not on this machine)"


def router_parts(index: object, instances: int, text: str, tokenizer: object, prompts: list[list[int]]
                 ) -> tuple[dict[str, Callable[[int], object]], dict[str, Callable[[int], object]]]:
    """The router's per-request steps, each a call on request ``r``, and the variants measured beside them (not
    in the sum); ``prompts``: the block keys matched (the text's own keys are nobody's: the index is
    simulated)."""
    from kvmesh.contracts.messages import Heartbeat, InstanceLoad
    from kvmesh.routing import CostModel, make_policy
    from kvmesh.routing.plan import FleetView, InstanceView, RouteAsk, plan

    from services.router.holders import HolderNames
    from services.router.registry import Registry
    from services.router.scheduling import view

    cost = CostModel()
    policy = make_policy("cache_aware", cost)
    rng = random.Random(4)
    views = tuple(InstanceView(f"i{i}", "both", queue_depth=rng.randint(0, 8), waiting_tokens=rng.randint(0, 8192),
                               free_blocks=rng.randint(0, 4096)) for i in range(instances))
    # the router's registry of the same fleet, viewed whole per request as Router._fleet does; each request
    # changes one instance's in-flight count (its own dispatch), so one view is rebuilt
    registry = Registry(timeout_s=3600, block_size=BLOCK_SIZE, fingerprint="bench")
    for v in views:
        registry.observe(Heartbeat(instance_id=v.id, role="both", grpc_address="", transfer_address="", ts=time.time(),
                                   load=InstanceLoad(waiting=int(v.queue_depth), waiting_tokens=int(v.waiting_tokens),
                                                     free_blocks=v.free_blocks), model="bench", block_size=BLOCK_SIZE))

    def fleet_view(r: int) -> tuple[InstanceView, ...]:
        registry.get(f"i{r % instances}").inflight ^= 1
        return tuple(view(i, cost) for i in registry.alive())

    tokens = tokenizer.encode(text)  # type: ignore[attr-defined]
    # what cachesvc answers a packed MatchPrefix, and the router's reading of it (the names known)
    names, epoch = HolderNames(1), index.holders_epoch  # type: ignore[attr-defined]
    names.learn(0, epoch, index.holder_names())  # type: ignore[attr-defined]
    answers = [index.match_packed(keys) for keys in prompts]  # type: ignore[attr-defined]

    def read(r: int) -> dict[str, int]:
        ids, counts = answers[r % len(answers)]
        numbers = names.translate(0, epoch, ids.astype(np.int64))
        assert numbers is not None
        return names.best(numbers, counts.astype(np.int64))

    matched = [read(r) for r in range(len(answers))]
    ask, quiet = RouteAsk(len(tokens), "cache_aware"), RouteAsk(len(tokens), "cache_aware", explain=False)

    return {
        "tokenize (Tokenizer.encode)": lambda r: tokenizer.encode(text),  # type: ignore[attr-defined]
        "hash (block_keys, 256 blocks)": lambda r: block_keys(12345, tokens, BLOCK_SIZE),
        "match (BlockIndex.match_packed, in process)": lambda r: index.match_packed(  # type: ignore[attr-defined]
            prompts[r % len(prompts)]),
        "the answer -> per-instance counts (HolderNames)": read,
        "fleet view (Router._fleet: the registry's records as the planner's views)": fleet_view,
        "score (plan, cache_aware, every instance; a recorded span's attributes)": lambda r: plan(
            ask, FleetView(views, matched[r % len(matched)], BLOCK_SIZE, cost), policy),
    }, {"score, no span recorded (RouteAsk.explain off)": lambda r: plan(
            quiet, FleetView(views, matched[r % len(matched)], BLOCK_SIZE, cost), policy)}


def bench_router(instances: int, blocks: int, calls: int) -> dict:
    fleet = Fleet(instances, blocks)
    index, _ = fill(fleet)
    tokenizer, which = load_tokenizer()
    text = prompt_text(tokenizer, PROMPT_BLOCKS * BLOCK_SIZE)
    parts, beside = router_parts(index, instances, text, tokenizer, query_sets(fleet, calls)[QUERY_KINDS[1]])
    rows, total = [], 0.0
    times = {}
    for name, part in {**parts, **beside}.items():
        part(0)
        times[name] = timed_cpu([functools.partial(part, r) for r in range(calls)])
        total += times[name][0] if name in parts else 0.0
    for name, (p50, p99, cpu99) in times.items():
        rows.append({"part": name, "p50": f"{p50 * 1e6:.0f} µs", "p99": f"{p99 * 1e6:.0f} µs",
                     "CPU p99": f"{cpu99 * 1e6:.0f} µs",
                     "share of p50": f"{p50 / total:.0%}" if name in parts else "(not in the sum)"})
    t = time.perf_counter()
    for r in range(calls):
        for part in parts.values():
            part(r)
    per_decision = (time.perf_counter() - t) / calls
    profile = cProfile.Profile()
    profile.enable()
    for r in range(min(calls, 200)):
        for part in parts.values():
            part(r)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
    return {"rows": rows, "per_decision": per_decision, "profile": _trim_profile(out.getvalue()),
            "tokens": len(tokenizer.encode(text)), "tokenizer": which,  # type: ignore[attr-defined]
            "instances": instances, "blocks": blocks}


def _trim_profile(text: str) -> str:
    lines = text.splitlines()
    start = next((n for n, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(line.replace(str(Path.cwd()) + "/", "") for line in lines[start:] if line.strip())


def in_child(fn: Callable[..., dict], *args: object) -> dict:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(fn, *args).result()


def parse_count(text: str) -> int:
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


# -- 4. across shards ---------------------------------------------------------------------------------------------

SHARD_SECTION = "Index across cachesvc shards"
SHARD_COLUMNS = ["prompt", "matches", "shard MatchPrefix p50 / p99 (CPU p99)", "router combine p50 / p99 (CPU p99)",
                 "packed: shard answer p50 / p99 (CPU p99)", "packed: router p50 / p99 (CPU p99)"]


def measure_shard(instances: int, blocks: int, shards: int, copies: int, calls: int) -> dict:
    """One shard of ``shards`` (index ``copies``) filled from the events of a fleet holding ``blocks`` keys, in a
    child process: what it holds and costs, its MatchPrefix (``BlockIndex.match_own`` over its own positions, as
    the server answers) and the router's ``combine`` of ``shards`` answers of that shape; then the same packed
    (``match_packed``, the answer serialized as the server sends it; the router parsing ``shards`` of them, naming
    the ids, ``combine_packed`` and the best run per instance, as ``Router.matched_blocks`` does)."""
    from kvmesh.contracts.shards import ShardMap, combine
    from kvmesh.proto.v1 import cache_pb2

    from services.cachesvc.index import BlockIndex
    from services.router.holders import HolderNames, combine_packed

    smap = ShardMap(shards, copies)
    fleet = Fleet(instances, blocks)
    gc.collect()
    before = rss_bytes()
    index = BlockIndex(smap.index_slots(0))
    t = time.perf_counter()
    for batch in fleet.batches():
        index.apply(batch)
    fill_s = time.perf_counter() - t
    gc.collect()
    held = len(index)
    samples = sum(sys.getsizeof(p) for p in fleet.held)
    rss = rss_bytes() - before - samples
    # the filled index out of the collector's sight: a shard's server is not collecting on every combine, and the
    # router (where combine runs) holds no index; without this, a GC pass over 12M entries lands in the p99
    gc.freeze()

    def answer(keys: list[int]) -> list[tuple[str, str, int]]:
        return [tuple(m) for m in index.match_own(keys, smap.index_positions(0, keys))]  # type: ignore[misc]

    names, epoch = HolderNames(shards), index.holders_epoch
    for shard in range(shards):  # every shard's table is known (it is sent once, when it changes)
        names.learn(shard, epoch, index.holder_names())

    def packed_answer(keys: list[int]) -> bytes:
        ids, counts = index.match_packed(keys, smap.index_positions(0, keys))
        return cache_pb2.MatchPrefixResponse(
            packed=True, holder_ids=ids.astype("<u4").tobytes(), holder_counts=counts.astype("<u4").tobytes(),
            holders_epoch=epoch, index_copies=copies).SerializeToString()

    def route_packed(keys: list[int], wire: bytes) -> dict[str, int]:
        answers = {}
        for shard in range(shards):
            read = names.read(shard, cache_pb2.MatchPrefixResponse.FromString(wire))
            assert read is not None
            answers[shard] = read
        return names.best(*combine_packed(smap, keys, answers, len(names)))

    def best(matches: list[tuple[str, str, int]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for instance, _, n in matches:
            out[instance] = max(out.get(instance, 0), n)
        return out

    rows = []
    for kind, keys_list in query_sets(fleet, calls).items():
        own = timed_cpu([functools.partial(answer, keys) for keys in keys_list])
        # every shard's answer is of this shape (uniform keys): the router combines N of them
        answers = [dict.fromkeys(range(shards), answer(keys)) for keys in keys_list]
        merged = timed_cpu([functools.partial(combine, smap, keys, a, {}) for keys, a in zip(keys_list, answers)])
        packed = timed_cpu([functools.partial(packed_answer, keys) for keys in keys_list])
        wires = [packed_answer(keys) for keys in keys_list]
        routed = timed_cpu([functools.partial(route_packed, keys, w) for keys, w in zip(keys_list, wires)])
        for keys, a, w in list(zip(keys_list, answers, wires))[:20]:  # the packed path answers the same
            assert route_packed(keys, w) == best(combine(smap, keys, a, {})), kind
        rows.append({"prompt": kind, "matches": len(combine(smap, keys_list[0], answers[0], {})),
                     SHARD_COLUMNS[2]: _us(own), SHARD_COLUMNS[3]: _us(merged), SHARD_COLUMNS[4]: _us(packed),
                     SHARD_COLUMNS[5]: _us(routed), "_own": own, "_combine": merged, "_packed": packed,
                     "_routed": routed, "_bytes": len(wires[0])})
    return {"instances": instances, "blocks": blocks, "shards": shards, "copies": copies, "held": held,
            "fill_s": fill_s, "rss": rss, "rows": rows}


def _us(t: tuple[float, float, float]) -> str:
    return f"{t[0] * 1e6:.0f} / {t[1] * 1e6:.0f} ({t[2] * 1e6:.0f}) µs"


def shard_report(r: dict, grpc_note: str) -> str:
    worst = max(row["_own"][1] + row["_combine"][1] for row in r["rows"])
    worst_packed = max(row["_packed"][1] + row["_routed"][1] for row in r["rows"])
    largest = max(row["_bytes"] for row in r["rows"])
    return (f"A fleet of {r['instances']:,} simulated instances holding {r['blocks']:,} distinct blocks (the events "
            f"of part 1's `Fleet`), over {r['shards']} shards with {r['copies']} index copies: shard 0 was filled "
            f"through `BlockIndex.apply` in a process of its own and kept {r['held']:,} keys "
            f"({r['held'] / r['blocks']:.1%}; {r['copies']}/{r['shards']} = {r['copies'] / r['shards']:.1%} "
            f"expected) in {r['rss'] / 2**30:.2f} GiB ({r['rss'] / max(r['held'], 1):.0f} B a key); the fill "
            f"(every event of the fleet, the other shards' keys filtered out) took {r['fill_s']:.0f} s. "
            "MatchPrefix on the shard is what its server runs (`match_own` over its own positions of the 256 keys, "
            f"one tuple a holder); the router then combines {r['shards']} answers of that shape "
            "(`kvmesh.contracts.shards.combine`; the gRPC messages' parsing not counted). Packed, as the router asks "
            "today: the shard's `match_packed` (holder ids and counts as two arrays) and the serialized reply "
            f"(at most {largest:,} bytes here); the router parses {r['shards']} such replies, names their ids "
            "(`HolderNames`, the tables known), takes the least over the shards (`combine_packed`) and the best run "
            "per instance; checked equal to the unpacked result.\n\n"
            f"{markdown_table(r['rows'], SHARD_COLUMNS)}\n\n"
            f"The shards answer at once, so a sharded MatchPrefix costs one shard's answer plus the router's part: "
            f"at most {worst * 1e3:.2f} ms p99 unpacked, {worst_packed * 1e3:.2f} ms p99 packed, in process "
            f"(target: p99 <= 2 ms at 100M blocks). {grpc_note}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh bench index", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", default="64,256,1024", help="simulated instances, comma-separated")
    parser.add_argument("--blocks", default="1M,10M,100M", help="indexed blocks, comma-separated (1M, 100k, ...)")
    parser.add_argument("--calls", type=int, default=2000, help="MatchPrefix calls per query kind")
    parser.add_argument("--max-rss-gb", type=float, default=7.0, help="fill no size projected past this RSS")
    parser.add_argument("--grpc", default="", help="the size measured over gRPC too, INSTANCES:BLOCKS "
                                                   "(default: the most instances at the fewest blocks)")
    parser.add_argument("--quick", action="store_true", help="64,256 instances x 100k blocks, 300 calls")
    parser.add_argument("--shards", type=int, default=0,
                        help="only: one cachesvc shard of this many (index copies --copies) at the largest "
                             "--instances and --blocks, and the router's combine of their answers")
    parser.add_argument("--copies", type=int, default=2, help="with --shards: shards that index each key")
    parser.add_argument("--no-write", action="store_true", help="print, do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.instances, args.blocks, args.calls = "64,256", "100k", 300
    instances = [int(n) for n in args.instances.split(",")]
    blocks = [parse_count(b) for b in args.blocks.split(",")]
    if args.shards:
        print(f"one shard of {args.shards} at {max(instances)} instances x {max(blocks):,} blocks ...", flush=True)
        r = in_child(measure_shard, max(instances), max(blocks), args.shards, args.copies, args.calls)
        note = ("Over gRPC a MatchPrefix adds the call itself: see \"MatchPrefix over gRPC\" in "
                "\"Index and router scale\".")
        body = f"load average at start: {load_average()}.\n\n" + shard_report(r, note)
        print(body)
        if not args.no_write:
            command = (f"kvmesh bench index --shards {args.shards} --copies {args.copies} --instances "
                       f"{max(instances)} --blocks {args.blocks.split(',')[-1]} --calls {args.calls}")
            print(f"wrote {write_section(SHARD_SECTION, command, body)}")
        return 0
    sizes = [(n, b) for b in blocks for n in instances]
    grpc_size = tuple(parse_count(x) for x in args.grpc.split(":")) if args.grpc else (max(instances), min(blocks))
    load = f"load average at start: {load_average()}"
    work = Path(tempfile.mkdtemp(prefix="kvmesh-bench-index-"))
    try:
        rows, notes = bench_index(sizes, args.calls, int(args.max_rss_gb * 2**30))
        print(markdown_table(rows, INDEX_COLUMNS), flush=True)
        notes += growth(rows)
        print(f"gRPC at {grpc_size[0]} instances x {grpc_size[1]:,} blocks ...", flush=True)
        grpc_rows = bench_grpc(grpc_size[0], grpc_size[1], args.calls, work)
        print(markdown_table(grpc_rows, ["what", "p50", "p99"]), flush=True)
        router = [in_child(bench_router, n, min(blocks), min(args.calls, 500)) for n in instances]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    body = (f"{load} (other work on this machine makes the figures noisy).\n\n"
            "#### MatchPrefix in process, 256-key (4,096-token) prompts\n\n"
            f"{markdown_table(rows, INDEX_COLUMNS)}\n\n"
            + "\n".join(f"- {n}" for n in notes) + "\n\n"
            f"#### MatchPrefix over gRPC: {grpc_size[0]} instances, {grpc_size[1]:,} blocks\n\n"
            f"{markdown_table(grpc_rows, ['what', 'p50', 'p99'])}\n\n")
    for r in router:
        body += (f"#### Router per-request CPU: {r['instances']} instances, {r['blocks']:,} blocks, a "
                 f"{r['tokens']}-token text prompt ({r['tokenizer']})\n\n"
                 f"{markdown_table(r['rows'], ROUTER_COLUMNS)}\n\n"
                 f"All parts in a row: {r['per_decision'] * 1e3:.2f} ms a request, "
                 f"{1 / r['per_decision']:.0f} decisions/s of one core.\n\n")
    body += f"cProfile of the router's parts, {router[-1]['instances']} instances (by own time):\n\n```\n" \
            f"{router[-1]['profile']}\n```\n"
    print(body)
    if not args.no_write:
        print(f"wrote {write_section(SECTION, 'kvmesh bench index' + (' --quick' if args.quick else ''), body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
