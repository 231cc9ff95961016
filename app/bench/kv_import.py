"""What decode's intake of one cold push costs, buffered vs received in place, against a memcpy of its bytes.

    python -m app.bench.kv_import [--tokens 1500] [--repeats 5] [--backends tcp,shm] [--groups 2] [--chunk 1024]
                                  [--no-write]

SmolLM2-135M's KV layout (30 layers, 3 KV heads, head dim 64, fp32, 16-token blocks; 1,500 tokens are 66 MiB).
A sender process pushes the prompt's KV as prefill does (per ``--chunk``-token chunk, ``--groups`` layer groups
each); this process receives it with a ``TransferServer`` and imports it into a ``BlockManager`` over a CPU
``DeviceKVPool``, the way decode does: ``buffered`` (each part into a buffer of its own, copied into pool blocks
by ``import_prefix``) or ``in place`` (blocks reserved first, parts landed in them, adopted by the import).
``receive_ms``: the parts' own header → verified times, added up (what ``decode.load``'s ``kvmesh.receive_ms``
says); ``import_ms``: the engine's import; ``memcpy_ms``: one copy of the same bytes between two preallocated
tensors. Medians over ``--repeats``; each backend in turn. Writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.block_manager import BlockManager
from kvmesh.engine.kv_cache import DeviceKVPool, KVPiece, Landed, block_bytes, blocks_from_bytes
from kvmesh.engine.sequence import Sequence
from kvmesh.transfer import TransferClient, TransferServer
from kvmesh.transfer.landing import Landing

from app.bench.report import load_average, markdown_table, publish

SECTION = "KV import"
LAYOUT = KVLayout("bench-smollm2-135m", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)


def parts_of(tokens: int, chunk: int, groups: int) -> list[tuple[int, int, tuple[int, int] | None]]:
    """(first block, blocks, layers) of each part prefill pushes for a cold prompt of ``tokens``."""
    bs, layers = LAYOUT.block_size, LAYOUT.num_layers
    bounds = [round(layers * g / groups) for g in range(groups + 1)]
    out, start = [], 0
    while start < tokens:
        end = min(tokens, start + chunk)
        first, last = start // bs, -(-end // bs) if end == tokens else end // bs
        for g in range(groups):
            out.append((first, last - first, None if groups == 1 else (bounds[g], bounds[g + 1])))
        start = end
    return out


def _sender(conn: Connection, tokens: int, chunk: int, groups: int, repeats: int) -> None:
    torch.set_num_threads(1)
    n = -(-tokens // LAYOUT.block_size)
    blocks = torch.randn(n, *LAYOUT.block_shape)
    plan = parts_of(tokens, chunk, groups)
    payloads = [block_bytes(blocks[b:b + m, lo:hi].contiguous()) for b, m, (lo, hi) in
                ((b, m, layers or (0, LAYOUT.num_layers)) for b, m, layers in plan)]

    async def push() -> None:
        async with TransferClient() as client:
            for _ in range(2 * repeats):  # buffered and in place, alternating
                address, rid, token = conn.recv()
                for i, ((b, m, layers), payload) in enumerate(zip(plan, payloads, strict=True)):
                    toks = min(tokens, (b + m) * LAYOUT.block_size) - b * LAYOUT.block_size
                    await client.push(address, f"{rid}@p#{i}", LAYOUT, payload, [], toks, layers=layers,
                                      first_block=b, token=token)
                conn.send("pushed")

    asyncio.run(push())


async def _receive(server: TransferServer, conn: Connection, bm: BlockManager, rid: str, tokens: int,
                   nparts: int, in_place: bool) -> tuple[float, float]:
    n = -(-tokens // LAYOUT.block_size)
    if in_place:
        ids = bm.reserve(rid, n)
        assert ids is not None
        server.land(f"{rid}@", Landing(*bm.device.landing_arrays(), ids, 0))  # type: ignore[misc]
    grant = server.grant(f"{rid}@", 0, n, timeout_s=600.0)
    conn.send((server.address, rid, grant.token))
    got = [await server.take(f"{rid}@p#{i}", timeout=60) for i in range(nparts)]
    assert conn.recv() == "pushed"
    receive_s = sum(g.seconds for g in got)
    seq = Sequence(rid, list(range(tokens)) + [0], SamplingParams(), 1)
    t = time.perf_counter()
    if in_place:
        server.unland(f"{rid}@")
        ok = bm.import_prefix(seq, Landed(rid, []), tokens, 0)
    else:
        pieces = [KVPiece(g.first_block, blocks_from_bytes(LAYOUT, g.data, g.layers), g.layers) for g in got]
        ok = bm.import_prefix(seq, pieces, tokens, 0)
    import_s = time.perf_counter() - t
    assert ok and all(g.landed == in_place for g in got)
    bm.free(seq)
    return receive_s, import_s


def measure(backend: str, tokens: int, chunk: int, groups: int, repeats: int) -> list[dict]:
    """Rows of the table for one backend: each mode's medians, and the memcpy of the same bytes."""
    n = -(-tokens // LAYOUT.block_size)
    nbytes = n * LAYOUT.block_nbytes
    nparts = len(parts_of(tokens, chunk, groups))
    parent, child = mp.Pipe()
    sender = mp.get_context("spawn").Process(target=_sender, daemon=True,
                                             args=(child, tokens, chunk, groups, repeats))
    sender.start()
    results: dict[str, list[tuple[float, float]]] = {"buffered": [], "in place": []}

    async def run() -> None:
        # room for two prompts, and no prefix caching: every repeat is a cold import into fresh-looking blocks
        bm = BlockManager(DeviceKVPool(LAYOUT, 2 * n + 8), enable_prefix_caching=False)
        async with await TransferServer.start(LAYOUT, backend=backend,
                                              max_buffered_bytes=4 * nbytes) as server:
            for r in range(repeats):
                for mode, rows in results.items():
                    rows.append(await _receive(server, parent, bm, f"r{r}{mode[0]}", tokens, nparts,
                                               mode == "in place"))

    asyncio.run(run())
    sender.join(10)
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    copies = []
    for _ in range(max(5, repeats)):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
    memcpy_ms = statistics.median(copies) * 1e3
    table = []
    for mode, rows in results.items():
        rec, imp = (statistics.median(x) * 1e3 for x in zip(*rows, strict=True))
        table.append({"backend": backend, "mode": mode, "receive ms": f"{rec:.2f}", "import ms": f"{imp:.3f}",
                      "total ms": f"{rec + imp:.2f}", "memcpy ms": f"{memcpy_ms:.2f}",
                      "import / memcpy": f"{imp / memcpy_ms:.2f}"})
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", default="tcp,shm", help="comma-separated: tcp, shm")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    backends = args.backends.split(",")
    if unknown := set(backends) - {"tcp", "shm"}:
        ap.error(f"--backends: unknown {sorted(unknown)}; choose from tcp, shm")
    torch.set_num_threads(1)
    n = -(-args.tokens // LAYOUT.block_size)
    nparts = len(parts_of(args.tokens, args.chunk, args.groups))
    load_start = load_average()
    table = [row for b in backends for row in measure(b, args.tokens, args.chunk, args.groups, args.repeats)]
    body = (f"A sender process pushes a cold {args.tokens:,}-token prompt's KV as prefill does ({args.chunk:,}-token "
            f"chunks in {args.groups} layer groups: {n} blocks, {n * LAYOUT.block_nbytes / 2**20:.1f} MiB, "
            f"{nparts} parts); this process receives and imports it into a `BlockManager` over the CPU pool, "
            f"`buffered` (each part into a buffer, copied into pool blocks by the import) or `in place` (blocks "
            f"reserved first, parts landed in them, adopted by the import). `receive ms`: the parts' own "
            f"header → verified times added up; `memcpy ms`: one copy of the same bytes between preallocated "
            f"tensors. Medians of {args.repeats}. Load average (1, 5, 15 min) {load_start} at the start, "
            f"{load_average()} at the end.\n\n" + markdown_table(table, list(table[0])))
    cmd = (f"python -m app.bench.kv_import --repeats {args.repeats}"
           + ("" if args.backends == "tcp,shm" else f" --backends {args.backends}")
           + ("" if args.tokens == 1500 else f" --tokens {args.tokens}"))
    publish(SECTION, cmd, body, write=not args.no_write)


if __name__ == "__main__":
    main()
