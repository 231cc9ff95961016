"""Transfer benchmark: GB/s of one push (header, payload, verify, reply) per backend and payload size, against
raw Python sockets measured in the same run.

    kvmesh bench transfer [--backends tcp,shm,mooncake] [--repeats N] [--rounds 3] [--quick] [--no-write]

Sender and receiver are separate processes (in one process they would share the GIL). Each push is one block
of the given size, sent after the previous one was verified; the baseline does the same exchange with blocking
``sendall`` / ``recv_into`` into a preallocated buffer and a one-byte ack, the ceiling Python reaches here.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import struct
import time
from multiprocessing.connection import Connection

import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.kv_cache import block_bytes
from kvmesh.transfer import TransferClient, TransferServer

from app.bench.report import markdown_table, publish

SECTION = "Transfer"

SIZES = (64 << 10, 1 << 20, 16 << 20)
RAW = "raw socket"
_LEN = struct.Struct("<Q")


def layout_for(size: int) -> KVLayout:
    """A one-layer fp32 layout whose block is ``size`` bytes (head_dim 128, one KV head)."""
    return KVLayout("bench", num_layers=1, num_kv_heads=1, head_dim=128, block_size=size // 1024)


def auto_repeats(size: int) -> int:
    return max(8, min(400, (256 << 20) // size))


# -- receivers (child processes) -----------------------------------------------------------------------------

def _engine_receiver(conn: Connection, backend: str, sizes: list[int], counts: list[int]) -> None:
    torch.set_num_threads(1)

    async def serve() -> None:
        for size, count in zip(sizes, counts, strict=True):
            async with await TransferServer.start(layout_for(size), backend=backend) as server:
                grant = server.grant("t", 0, 1, timeout_s=3600.0)  # every push t<i>: one block each
                conn.send((server.address, grant.token))
                for i in range(count):
                    await server.take(f"t{i}", timeout=120)
                conn.recv()  # the sender has its last reply: safe to close

    asyncio.run(serve())


def _raw_receiver(conn: Connection, sizes: list[int], counts: list[int]) -> None:
    for size, count in zip(sizes, counts, strict=True):
        with socket.create_server(("127.0.0.1", 0)) as listener:
            conn.send((f"raw://127.0.0.1:{listener.getsockname()[1]}", ""))
            peer, _ = listener.accept()
            buf = memoryview(bytearray(size))
            with peer:
                peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(count):
                    _recv_exactly(peer, memoryview(bytearray(_LEN.size)))
                    _recv_exactly(peer, buf)
                    peer.sendall(b"\x01")
            conn.recv()


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("sender closed early")
        view = view[n:]


# -- senders (this process) ----------------------------------------------------------------------------------

async def _push_all(address: str, token: str, size: int, count: int) -> float:
    layout = layout_for(size)
    blocks = block_bytes(torch.randn((1, *layout.block_shape)))
    async with TransferClient() as client:
        await client.push(address, "t0", layout, blocks, [1], layout.block_size, token=token)  # connect, warm up
        started = time.perf_counter()
        for i in range(1, count):
            await client.push(address, f"t{i}", layout, blocks, [i], layout.block_size, token=token)
        return time.perf_counter() - started


def _send_raw(address: str, size: int, count: int) -> float:
    host, port = address.removeprefix("raw://").rsplit(":", 1)
    payload = memoryview(bytearray(size))
    ack = bytearray(1)
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = 0.0
        for i in range(count):
            if i == 1:
                started = time.perf_counter()
            sock.sendall(_LEN.pack(size))
            sock.sendall(payload)
            _recv_exactly(sock, memoryview(ack))
        return time.perf_counter() - started


def _measure(backend: str, sizes: tuple[int, ...], counts: list[int]) -> list[dict]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    if backend == RAW:
        proc = ctx.Process(target=_raw_receiver, args=(child, list(sizes), counts), daemon=True)
    else:
        proc = ctx.Process(target=_engine_receiver, args=(child, backend, list(sizes), counts), daemon=True)
    proc.start()
    rows = []
    try:
        for size, count in zip(sizes, counts, strict=True):
            address, token = _reply(parent, proc)
            seconds = _send_raw(address, size, count) if backend == RAW else asyncio.run(
                _push_all(address, token, size, count))
            parent.send("done")
            rows.append({"backend": backend, "size": size, "pushes": count - 1, "seconds": seconds,
                         "gbps": size * (count - 1) / seconds / 1e9})
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    return rows


def _reply(conn: Connection, proc: mp.process.BaseProcess, timeout_s: float = 120.0) -> tuple[str, str]:
    """The receiver's next message (its address and the push token it granted); fails instead of hanging when
    the receiver died."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"benchmark receiver died or stalled (exit code {proc.exitcode})")
    return conn.recv()


def _mooncake_loads() -> bool:
    from kvmesh.transfer.mooncake_backend import engine_class

    try:
        engine_class()
    except RuntimeError:
        return False
    return True


def run(sizes: tuple[int, ...] = SIZES, backends: tuple[str, ...] = ("tcp", "shm", "mooncake"),
        repeats: int | None = None, rounds: int = 3) -> list[dict]:
    """One row per (backend, size): ``backend, size, pushes, gbps, gbps_min, gbps_max, vs_raw``, the
    raw-socket baseline first. Each round measures every backend once (interleaved, so load drifts hit all
    alike); ``gbps`` is the median over rounds. ``repeats`` pushes per size and round (None: ~256 MiB worth,
    8..400). Backends that cannot be imported here (mooncake) are skipped."""
    torch.set_num_threads(1)
    counts = [1 + (repeats or auto_repeats(s)) for s in sizes]
    usable = [RAW] + [b for b in backends if b != "mooncake" or _mooncake_loads()]
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for backend in usable:
            for r in _measure(backend, sizes, counts):
                samples.setdefault((backend, r["size"]), []).append(r["gbps"])
    raw = {size: statistics.median(samples[RAW, size]) for size in sizes}
    return [{"backend": b, "size": size, "pushes": count - 1, "gbps": statistics.median(samples[b, size]),
             "gbps_min": min(samples[b, size]), "gbps_max": max(samples[b, size]),
             "vs_raw": statistics.median(samples[b, size]) / raw[size]}
            for b in usable for size, count in zip(sizes, counts, strict=True)]


def _size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def table(rows: list[dict]) -> str:
    sizes = sorted({r["size"] for r in rows})
    cells: dict[str, dict[str, str]] = {}
    for r in rows:
        cells.setdefault(r["backend"], {"backend": r["backend"]})[_size_name(r["size"])] = (
            f"{r['gbps']:.2f} GB/s ({r['vs_raw']:.2f}x)")  # median of the rounds
    return markdown_table(list(cells.values()), ["backend", *map(_size_name, sizes)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench transfer")
    p.add_argument("--backends", default="tcp,shm,mooncake",
                   help="comma-separated (mooncake is skipped where it is not installed)")
    p.add_argument("--repeats", type=int, default=None, help="pushes per size (default: ~256 MiB worth)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows the median")
    p.add_argument("--quick", action="store_true", help="one round of 8 pushes per size (a smoke run)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    rows = run(backends=tuple(args.backends.split(",")), repeats=8 if args.quick else args.repeats,
               rounds=rounds)
    body = ("GB/s of one verified push (one block per push, sequential, sender and receiver in separate "
            f"processes on loopback), median of {rounds} interleaved rounds; in brackets the ratio to raw "
            "Python sockets in the same run.\n\n" + table(rows))
    publish(SECTION, "kvmesh bench transfer", body, write=not args.no_write and not args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
