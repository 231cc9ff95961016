"""cachesvc benchmark: the index at scale, the disk tier's read bandwidth, and a pool fetch against recompute.

    python -m app.bench.cachesvc [--blocks N] [--disk-mb N] [--reps N] [--quick] [--no-write]

1. **Index.** ``--blocks`` (1M) block keys, in 64-block chains spread over 4 instances (device tier; the first
   half of each chain also in another instance's host tier), published into JetStream and replayed by a real
   ``python -m services.cachesvc``. Reports ``MatchPrefix`` latency over gRPC (sync client on this machine) and
   in-process, the index's bytes per block (tracemalloc, in this process, same events), and how long a
   restarted cachesvc takes to rebuild the index from the stream (start to SERVING).
2. **Disk tier.** ``--disk-mb`` of SmolLM2-sized blocks (720 KiB) written through ``DiskTier`` in 64-block chains,
   then read back chain by chain (checksums verified), against plain sequential ``readinto`` of the same segment
   files in the same run; warm (page cache) and cold (``posix_fadvise(DONTNEED)`` before each pass).
3. **Fetch vs recompute** of a 1024-token prefix: the engine's prefill of 1024 tokens
   (``LLMEngine(EngineSettings(threads=1))``, real SmolLM2), against fetching the same 64 blocks from a running
   cachesvc (DRAM tier; then disk tier, warm and cold) plus loading them into the engine's paged KV
   (``PoolClient.fetch`` + ``BlockManager.adopt``), three ways, interleaved: the engines' path (cachesvc pushes
   the blocks through the transfer engine to the reader's ``TransferServer``, tcp and shm) and the old inline
   path (the bytes inside the ``GetBlocks`` reply) as the baseline. The first token after a load is checked
   against recompute.

The index and disk figures use cachesvc's own classes (``services.cachesvc``), as its unit tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmesh.bus import Bus, NatsServer, Subjects
from kvmesh.contracts.events import BlockStored
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc
from kvmesh.ready import wait_ready

from app.bench.report import markdown_table, write_section
from app.bench.stats import percentile

SECTION = "Index, disk tier and pool fetch"

REPO = Path(__file__).resolve().parents[2]  # <repo>/app/bench/cachesvc.py
CHAIN = 64
FETCH_PATHS = (("inline gRPC (baseline)", None), ("transfer engine, tcp", "tcp"), ("transfer engine, shm", "shm"))
FETCH_COLUMNS = ["path", "median", "best", "bytes", "vs recompute", "vs inline gRPC"]
INSTANCES = 4
SMOLLM2_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # layers x (k, v) x block_size x kv heads x head dim x fp32


@contextmanager
def cachesvc(nats_url: str, cluster: str, log_path: Path, **settings: object) -> Iterator[str]:
    """``python -m services.cachesvc`` on any free port until the block ends; yields the address it bound
    (from its ready file) once SERVING."""
    ready_path = log_path.with_suffix(".ready.json")
    ready_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "KVMESH_CACHESVC_DURABLE_NAME": f"bench-{cluster}", "KVMESH_CACHESVC_INSTANCE_TIMEOUT_S": "3600",
           **{f"KVMESH_CACHESVC_{k.upper()}": str(v) for k, v in settings.items()}}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cachesvc", "--port", "0", "--nats-url",
                                 nats_url, "--cluster", cluster, "--ready-file", str(ready_path)],
                                cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        yield wait_ready(ready_path, proc, "cachesvc", log_path, timeout_s=600).endpoints["grpc"]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- 1. the index ----------------------------------------------------------------------------------------------

def index_batches(num_blocks: int) -> list[KVEventBatch]:
    """Chains of 64 keys, round robin over the instances, half of each chain also in the next one's host tier."""
    rng = random.Random(0)
    seqs = [0] * INSTANCES
    batches = []
    per_batch = 32  # chains per batch
    for first in range(0, num_blocks // CHAIN, per_batch):
        by_instance: dict[int, list] = {}
        for c in range(first, min(first + per_batch, num_blocks // CHAIN)):
            keys = tuple(BlockKey(rng.getrandbits(64)) for _ in range(CHAIN))
            by_instance.setdefault(c % INSTANCES, []).append(BlockStored(keys, None, 16, "device"))
            by_instance.setdefault((c + 1) % INSTANCES, []).append(BlockStored(keys[:CHAIN // 2], None, 16, "host"))
        for inst, events in by_instance.items():
            seqs[inst] += 1
            batches.append(KVEventBatch(f"p{inst}", seqs[inst], 0.0, tuple(events)))
    return batches


def index_bytes_per_block(num_blocks: int) -> float:
    """Traced bytes the index holds once the events that built it are gone (their keys are its keys)."""
    from services.cachesvc.index import BlockIndex

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = BlockIndex()
    batches = index_batches(num_blocks)
    for batch in batches:
        index.apply(batch)
    del batches
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(index) == num_blocks
    return (after - before) / num_blocks


def timed(calls: list[Callable[[], object]]) -> tuple[float, float]:
    """p50 and p99 seconds of ``calls``, one at a time."""
    lat = []
    for call in calls:
        t = time.perf_counter()
        call()
        lat.append(time.perf_counter() - t)
    return percentile(lat, 50), percentile(lat, 99)


def latency_row(what: str, p50_p99: tuple[float, float], digits: int = 0) -> dict:
    return {"what": what, "p50": f"{p50_p99[0] * 1e6:.{digits}f} µs", "p99": f"{p50_p99[1] * 1e6:.{digits}f} µs"}


def grpc_latencies(address: str, queries: dict[str, list[list[int]]], num_blocks: int) -> list[dict]:
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        assert stub.Stats(cache_pb2.StatsRequest(), timeout=30).indexed_blocks == num_blocks
        check = health_pb2_grpc.HealthStub(channel).Check
        calls = len(next(iter(queries.values())))
        rows = [latency_row("gRPC baseline: Health.Check (empty call)",
                            timed([lambda: check(health_pb2.HealthCheckRequest(), timeout=5)] * calls))]
        for name, keys_list in queries.items():
            requests = [cache_pb2.MatchPrefixRequest(block_keys=keys) for keys in keys_list]
            rows.append(latency_row(f"MatchPrefix over gRPC, {name}",
                                    timed([functools.partial(stub.MatchPrefix, r, timeout=5) for r in requests])))
        # packed, as the router asks: holder ids and counts, the names already known (they come when they change)
        epoch = stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=[1], packed=True), timeout=5).holders_epoch
        for name, keys_list in queries.items():
            requests = [cache_pb2.MatchPrefixRequest(block_keys=keys, packed=True, holders_epoch=epoch)
                        for keys in keys_list]
            rows.append(latency_row(f"MatchPrefix over gRPC, packed, {name}",
                                    timed([functools.partial(stub.MatchPrefix, r, timeout=5) for r in requests])))
    return rows


def bench_index(num_blocks: int, work: Path, calls: int) -> list[dict]:
    from services.cachesvc.index import BlockIndex  # the service's own structure

    batches = index_batches(num_blocks)
    chains = [e.block_keys for b in batches for e in b.events if isinstance(e, BlockStored) and e.tier == "device"]
    rng = random.Random(1)
    queries: dict[str, list[list[int]]] = {
        "hit, 64 keys": [list(rng.choice(chains)) for _ in range(calls)],
        "miss, 64 keys": [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(calls)]}
    rows = []
    with NatsServer(work / "nats") as nats:
        subjects = Subjects(f"b{uuid.uuid4().hex[:8]}")

        async def publish() -> None:
            bus = await Bus.connect(nats.url, "bench-producer")
            await bus.ensure_events_stream(subjects, max_bytes=8 << 30)
            for batch in batches:
                await bus.publish_event(subjects.kv_events(batch.instance_id), batch)
            await bus.close()

        asyncio.run(publish())
        for start in ("first start", "restart"):
            t0 = time.perf_counter()
            with cachesvc(nats.url, subjects.cluster, work / "cachesvc-index.log", pool_capacity_mb=0) as address:
                rows.append({"what": f"cachesvc {start}: process start + replay of {len(batches)} batches, "
                                     "to SERVING", "p50": f"{time.perf_counter() - t0:.1f} s", "p99": ""})
                if start == "restart":
                    rows += grpc_latencies(address, queries, num_blocks)
    index = BlockIndex()
    for batch in batches:
        index.apply(batch)
    for name, keys_list in queries.items():
        rows.append(latency_row(f"BlockIndex.match_prefix in-process, {name}",
                                timed([functools.partial(index.match_prefix, keys) for keys in keys_list]), 1))
    del index
    rows.append({"what": "index bytes per block (1.5 holders each, 8 holders in all)",
                 "p50": f"{index_bytes_per_block(num_blocks):.0f} B", "p99": ""})
    return rows


# -- 2. the disk tier --------------------------------------------------------------------------------------------

def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_disk(disk_mb: int, work: Path, reps: int) -> list[dict]:
    from kvmesh.contracts.layout import KVLayout
    from kvmesh.engine.eviction import make_policy

    from services.cachesvc.disk import DiskTier
    from services.cachesvc.store import Leases, Retention, StoredBlock

    layout = KVLayout("bench", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
    assert layout.block_nbytes == SMOLLM2_BLOCK
    chains = max(1, (disk_mb << 20) // (CHAIN * SMOLLM2_BLOCK))
    leases = Leases(time.monotonic)
    directory = work / "disk"
    tier = DiskTier(directory, 2 * chains * CHAIN * SMOLLM2_BLOCK, 64 << 20, make_policy("lru"), leases.pinned,
                    time.monotonic)
    payload = os.urandom(SMOLLM2_BLOCK)
    keys = [[c * CHAIN + i for i in range(CHAIN)] for c in range(chains)]
    for chain in keys:
        blocks = []
        for k in chain:
            data = k.to_bytes(8, "little") + payload[8:]
            blocks.append(StoredBlock(k, xxhash.xxh3_64_intdigest(data), data))
        tier.put(layout, blocks, Retention())
    tier.close()
    tier = DiskTier(directory, 2 * chains * CHAIN * SMOLLM2_BLOCK, 64 << 20, make_policy("lru"), leases.pinned,
                    time.monotonic)
    files = sorted(directory.glob("seg-*.kvb"))
    total = chains * CHAIN * SMOLLM2_BLOCK
    buf = bytearray(CHAIN * SMOLLM2_BLOCK)

    def tier_pass() -> float:
        t = time.perf_counter()
        for chain in keys:
            assert len(tier.read(layout, chain)) == CHAIN
        return time.perf_counter() - t

    def raw_pass() -> float:
        t = time.perf_counter()
        view = memoryview(buf)
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass
        return time.perf_counter() - t

    rows = []
    for cache in ("warm", "cold"):
        for name, one_pass in (("raw sequential readinto, same files", raw_pass),
                               ("DiskTier.read, 64-block runs, checksums verified", tier_pass)):
            times = []
            for _ in range(reps):
                if cache == "cold":
                    drop_cache(files)
                else:
                    one_pass()
                times.append(one_pass())
            rows.append({"read": name, "page cache": cache, "MB": f"{total / 1e6:.0f}",
                         "GB/s (best)": f"{total / min(times) / 1e9:.2f}",
                         "GB/s (median)": f"{total / statistics.median(times) / 1e9:.2f}"})
    tier.close()
    return rows


# -- 3. fetch vs recompute ---------------------------------------------------------------------------------------

def bench_fetch(work: Path, reps: int) -> tuple[list[dict], list[str]]:
    from kvmesh.contracts.engine import EngineRequest, ExportPlan
    from kvmesh.contracts.sampling import SamplingParams
    from kvmesh.engine.kv_cache import block_bytes, blocks_from_bytes
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.instance.pool_client import PoolClient
    from kvmesh.settings import EngineSettings
    from kvmesh.transfer import TransferServer

    llm = LLMEngine(EngineSettings(threads=1))
    rng = random.Random(2)
    vocab = llm.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(1024)] for _ in range(reps + 1)]
    seed = llm.namespace_seed("")
    one = SamplingParams(max_tokens=1)
    llm.generate([prompts[-1]], one)  # warm-up
    recompute, first_tokens, exported = [], [], []
    for i, prompt in enumerate(prompts[:reps]):
        t = time.perf_counter()
        (done,) = llm.generate([prompt], one)
        recompute.append(time.perf_counter() - t)
        first_tokens.append(done.token_ids[0])
        # hits the local cache: a cheap read-out
        llm.add_request(EngineRequest(f"export-{i}", tuple(prompt), one, export=ExportPlan()))
        while llm.has_unfinished():
            for out in llm.step().outputs:
                if out.exported is not None:
                    exported.append((out.exported.block_keys[:CHAIN], out.exported.blocks[:CHAIN]))
        llm.release(f"export-{i}")
    assert all(len(keys) == CHAIN for keys, _ in exported)
    rows = [{"path": "recompute: prefill of 1024 tokens (SmolLM2, 1 thread)",
             "median": f"{statistics.median(recompute) * 1e3:.0f} ms", "best": f"{min(recompute) * 1e3:.0f} ms",
             "bytes": "-", "vs recompute": "1.0x", "vs inline gRPC": "-"}]
    notes: list[str] = []
    matched = loads = 0  # loads whose first token equals recompute's, of all loads

    def clear_engine_cache() -> None:
        while llm.blocks.evict(llm.blocks.num_cached_blocks) > 0:
            pass

    async def fetch_all(address: str, cold_dir: Path | None) -> dict[str, tuple[list[float], list[bool]]]:
        receivers = {b: await TransferServer.start(llm.layout, backend=b) for _, b in FETCH_PATHS if b}
        pools = {name: PoolClient(address, llm.layout, receivers.get(b)) for name, b in FETCH_PATHS}
        try:
            for keys, blocks in exported:
                await pools[FETCH_PATHS[1][0]].write_back(keys, block_bytes(blocks))
            results: dict[str, tuple[list[float], list[bool]]] = {name: ([], []) for name in pools}
            for (keys, _), prompt, token in zip(exported, prompts, first_tokens):
                for name, pool in pools.items():  # interleaved: a change in machine load hits every path alike
                    clear_engine_cache()
                    if cold_dir is not None:
                        drop_cache(sorted(cold_dir.glob("seg-*.kvb")))
                    t = time.perf_counter()
                    fetched = await pool.fetch(keys)
                    assert fetched is not None and fetched.num_blocks == CHAIN
                    assert llm.blocks.adopt(seed, prompt, blocks_from_bytes(llm.layout, fetched.data), 0)
                    results[name][0].append(time.perf_counter() - t)
                    (done,) = llm.generate([prompt], one)
                    results[name][1].append(done.token_ids[0] == token and done.cached_tokens == 1023)
            return results
        finally:
            for pool in pools.values():
                await pool.close()
            for receiver in receivers.values():
                await receiver.close()

    nbytes = CHAIN * llm.layout.block_nbytes
    base = statistics.median(recompute)
    with NatsServer(work / "nats-fetch") as nats:
        for label, settings, cold in (
                ("pool DRAM", {"pool_capacity_mb": 1024}, False),
                ("pool disk, page cache warm", {"pool_capacity_mb": 0, "disk_dir": work / "pool-disk",
                                                "disk_capacity_mb": 2048}, False),
                ("pool disk, page cache dropped", {"pool_capacity_mb": 0, "disk_dir": work / "pool-disk-cold",
                                                   "disk_capacity_mb": 2048}, True)):
            cluster = f"f{uuid.uuid4().hex[:8]}"
            with cachesvc(nats.url, cluster, work / "cachesvc-fetch.log", **settings) as address:
                cold_dir = Path(str(settings["disk_dir"])) if cold else None
                results = asyncio.run(fetch_all(address, cold_dir))
            inline = statistics.median(results[FETCH_PATHS[0][0]][0])
            for name, (times, same) in results.items():
                median = statistics.median(times)
                rows.append({"path": f"fetch 64 blocks ({label}) + verify + load: {name}",
                             "median": f"{median * 1e3:.0f} ms", "best": f"{min(times) * 1e3:.0f} ms",
                             "bytes": f"{nbytes / 1e6:.1f} MB", "vs recompute": f"{base / median:.1f}x",
                             "vs inline gRPC": f"{inline / median:.2f}x"})
                matched, loads = matched + sum(same), loads + len(same)
    notes.append(f"the first token after a load equals recompute's in {matched}/{loads} loads (every tier and "
                 "path)")
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.bench.cachesvc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="block keys in the index")
    parser.add_argument("--disk-mb", type=int, default=1024, help="data written to and read from the disk tier")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the disk and fetch measurements")
    parser.add_argument("--calls", type=int, default=2000, help="MatchPrefix calls per query kind")
    parser.add_argument("--quick", action="store_true", help="100k blocks, 256 MB, 2 reps (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print, do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.disk_mb, args.reps, args.calls = 100_032, 256, 2, 300
    args.blocks = max(CHAIN, args.blocks // CHAIN * CHAIN)  # whole chains
    load = "load average at start: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    work = Path(tempfile.mkdtemp(prefix="kvmesh-bench-cachesvc-"))
    try:
        print(f"index: {args.blocks} blocks ...", flush=True)
        index_rows = bench_index(args.blocks, work, args.calls)
        print(markdown_table(index_rows, ["what", "p50", "p99"]), flush=True)
        print(f"disk tier: {args.disk_mb} MB ...", flush=True)
        disk_rows = bench_disk(args.disk_mb, work, args.reps)
        print(markdown_table(disk_rows, ["read", "page cache", "MB", "GB/s (best)", "GB/s (median)"]), flush=True)
        print("fetch vs recompute ...", flush=True)
        fetch_rows, notes = bench_fetch(work, args.reps)
        print(markdown_table(fetch_rows, FETCH_COLUMNS), flush=True)
        print("\n".join(notes))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    body = (f"{load} (other work on this machine makes the figures noisy).\n\n"
            f"#### Index: {args.blocks:,} blocks, {INSTANCES} instances\n\n"
            f"{markdown_table(index_rows, ['what', 'p50', 'p99'])}\n\n"
            "Over gRPC: a sync Python client on the same machine, one call at a time; the empty call is the "
            "transport's own cost. In-process: the index walk alone. Bytes per block: tracemalloc of the index "
            "(dict slot, key object, holder mask).\n\n"
            f"#### Disk tier read bandwidth ({args.disk_mb} MB of 720 KiB blocks)\n\n"
            f"{markdown_table(disk_rows, ['read', 'page cache', 'MB', 'GB/s (best)', 'GB/s (median)'])}\n\n"
            "Cold: `posix_fadvise(DONTNEED)` on every segment file before each pass (this VM's virtual disk may "
            "still cache below the guest).\n\n"
            "#### Pool fetch vs recompute, 1024-token prefix (64 blocks)\n\n"
            f"{markdown_table(fetch_rows, FETCH_COLUMNS)}\n\n"
            "Fetch paths: *transfer engine* is what the engines do (GetBlocks names the reader's transfer "
            "endpoint; cachesvc leases the blocks, pushes them, releases, answers with keys and checksums only); "
            "*inline gRPC*, the baseline, carries the bytes inside the GetBlocks reply. Ratios are of medians; the "
            "three paths alternate within each repetition.\n\n"
            + "\n".join(f"- {n}" for n in notes) + "\n")
    if not args.no_write:
        path = write_section(SECTION, "python -m app.bench.cachesvc" + (" --quick" if args.quick else ""),
                             body)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
