"""Transfer benchmark: GB/s of one push (header, payload, verify, reply) per backend and payload size, against
raw Python sockets measured in the same run.

    kvmesh bench transfer [--backends tcp,shm,mooncake] [--repeats N] [--rounds 3] [--tls-compare] [--quick]
                          [--link-mbit R] [--no-write]

Sender and receiver are separate processes (in one process they would share the GIL). Each push is one block
of the given size, sent after the previous one was verified; the baseline does the same exchange with blocking
``sendall`` / ``recv_into`` into a preallocated buffer and a one-byte ack, the ceiling Python reaches here.

``--tls-compare``: each backend also with the mesh's mutual TLS, as ``kvmesh up`` runs it (``[shared] mesh_tls``,
its default): certificates from a mesh CA of the run's own, the receiver a decode instance, the sender a prefill
instance; TLS 1.3 on the connection (``tcp``'s payload sealed outside the TLS records, :mod:`kvmesh.transfer.seal`;
for ``shm`` only the control connection), interleaved with the plain runs, and a table of each one's GB/s against
its plain twin, round by round. ``tcp + mTLS (v2)``: tcp under mTLS to a receiver that reads header version 2
only (a fleet mid-upgrade), whose payload travels in TLS records.

``--link-mbit R``: the receiver on a host of its own (a network namespace, ``app/netlab``) behind a link capped at
``R`` Mbit/s each way (tc tbf), the sender on another; tcp only (shm needs one host). Where both ends share this
machine's cores on loopback, the sender's encryption and the kernel's copy are in series on one core; between hosts
the link sets the pace. Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing as mp
import socket
import statistics
import struct
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from kvmesh import tls
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.kv_cache import block_bytes
from kvmesh.identity import Identity, MeshRole
from kvmesh.mesh_ca import MESH_SERVER_NAME, CertFiles, MeshCA
from kvmesh.settings import SharedSettings
from kvmesh.transfer import TransferClient, TransferServer
from kvmesh.transfer.header import UNSAID, Versions, parse_versions

from app.bench.report import load_average, markdown_table, publish

if TYPE_CHECKING:
    from app.netlab.hosts import Lab

Where = tuple[str, str]  # a receiver's network namespace and the address it binds there

SECTION = "Transfer"
SECTION_TLS = "Transfer, mTLS on vs off"
SECTION_LINK = "Transfer over a capped link, mTLS on vs off"

SIZES = (64 << 10, 1 << 20, 16 << 20)
RAW = "raw socket"
MTLS = " + mTLS"  # a backend's name with this suffix: the same backend under the mesh's mutual TLS
V2 = " + mTLS (v2)"  # tcp under mTLS as a version-2 receiver takes it: the payload in TLS records, not sealed
_LEN = struct.Struct("<Q")


def layout_for(size: int) -> KVLayout:
    """A one-layer fp32 layout whose block is ``size`` bytes (head_dim 128, one KV head)."""
    return KVLayout("bench", num_layers=1, num_kv_heads=1, head_dim=128, block_size=size // 1024)


def auto_repeats(size: int) -> int:
    return max(8, min(400, (256 << 20) // size))


def mesh_settings(files: CertFiles) -> SharedSettings:
    """The ``[shared]`` TLS settings of a holder of ``files``, as ``kvmesh up`` hands them to a service."""
    return SharedSettings(tls_cert=str(files.cert), tls_key=str(files.key), tls_ca=str(files.ca),
                          tls_server_name=MESH_SERVER_NAME)


# -- receivers (child processes) -----------------------------------------------------------------------------

def _engine_receiver(conn: Connection, backend: str, sizes: list[int], counts: list[int],
                     certs: CertFiles | None, where: Where | None = None) -> None:
    host = _enter(where)
    torch.set_num_threads(1)
    context = tls.transfer_server_context(mesh_settings(certs)) if certs else None

    async def serve() -> None:
        for size, count in zip(sizes, counts, strict=True):
            async with await TransferServer.start(layout_for(size), host, backend=backend, tls=context) as server:
                grant = server.grant("t", 0, 1, timeout_s=3600.0)  # every push t<i>: one block each
                conn.send((server.address, grant.token, str(server.versions)))
                await server.take("t0", timeout=120)  # the warm-up push
                cpu = time.process_time()
                for i in range(1, count):
                    await server.take(f"t{i}", timeout=120)
                conn.send(time.process_time() - cpu)
                conn.recv()  # the sender has its last reply: safe to close

    asyncio.run(serve())


def _raw_receiver(conn: Connection, sizes: list[int], counts: list[int], where: Where | None = None) -> None:
    host = _enter(where)
    for size, count in zip(sizes, counts, strict=True):
        with socket.create_server((host, 0)) as listener:
            conn.send((f"raw://{host}:{listener.getsockname()[1]}", "", ""))
            peer, _ = listener.accept()
            buf = memoryview(bytearray(size))
            with peer:
                peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                cpu = 0.0
                for i in range(count):
                    if i == 1:
                        cpu = time.process_time()
                    _recv_exactly(peer, memoryview(bytearray(_LEN.size)))
                    _recv_exactly(peer, buf)
                    peer.sendall(b"\x01")
                conn.send(time.process_time() - cpu)
            conn.recv()


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("sender closed early")
        view = view[n:]


# -- senders (this process) ----------------------------------------------------------------------------------

async def _push_all(address: str, token: str, versions: Versions, size: int, count: int,
                    certs: CertFiles | None) -> tuple[float, float]:
    """(wall, CPU) seconds of pushes 1 .. count - 1, after a warm-up push that connects."""
    layout = layout_for(size)
    blocks = block_bytes(torch.randn((1, *layout.block_shape)))
    async with TransferClient(tls=tls.transfer_client_tls(mesh_settings(certs)) if certs else None) as client:
        await client.push(address, "t0", layout, blocks, [1], layout.block_size, token=token,
                          versions=versions)  # connect, warm up
        started, cpu = time.perf_counter(), time.process_time()
        for i in range(1, count):
            await client.push(address, f"t{i}", layout, blocks, [i], layout.block_size, token=token,
                              versions=versions)
        return time.perf_counter() - started, time.process_time() - cpu


def _send_raw(address: str, size: int, count: int) -> tuple[float, float]:
    host, port = address.removeprefix("raw://").rsplit(":", 1)
    payload = memoryview(bytearray(size))
    ack = bytearray(1)
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = cpu = 0.0
        for i in range(count):
            if i == 1:
                started, cpu = time.perf_counter(), time.process_time()
            sock.sendall(_LEN.pack(size))
            sock.sendall(payload)
            _recv_exactly(sock, memoryview(ack))
        return time.perf_counter() - started, time.process_time() - cpu


def _enter(where: Where | None) -> str:
    """In a receiver process: move into its host's namespace (``where``: namespace, address), if any; the address
    to bind."""
    if where is None:
        return "127.0.0.1"
    from app.netlab.hosts import enter

    enter(where[0])
    return where[1]


def _measure(name: str, sizes: tuple[int, ...], counts: list[int], mesh: MeshCA | None = None,
             lab: Lab | None = None) -> list[dict]:
    """One round of ``name`` (a backend, ``RAW``, or a backend + ``MTLS`` / ``V2`` with certificates from
    ``mesh``); with ``lab``, the receiver on its ``decode`` host, the sender on its ``prefill`` host."""
    backend = _plain(name)
    receiver = sender = None
    if backend != name:
        assert mesh is not None, f"{name} needs a mesh CA"
        receiver = mesh.issue(Identity(MeshRole.DECODE, "decode-0"))
        sender = mesh.issue(Identity(MeshRole.PREFILL, "prefill-0"))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    where = (lab["decode"].ns, lab["decode"].address) if lab else None
    if backend == RAW:
        proc = ctx.Process(target=_raw_receiver, args=(child, list(sizes), counts, where), daemon=True)
    else:
        proc = ctx.Process(target=_engine_receiver, args=(child, backend, list(sizes), counts, receiver, where),
                           daemon=True)
    on_sender = (lambda fn: lab.call("prefill", fn)) if lab else (lambda fn: fn())
    proc.start()
    rows = []
    try:
        for size, count in zip(sizes, counts, strict=True):
            address, token, versions = _reply(parent, proc)
            versions_ = UNSAID if name.endswith(V2) else parse_versions(versions)  # raw's "": UNSAID
            send = (functools.partial(_send_raw, address, size, count) if backend == RAW else
                    functools.partial(asyncio.run, _push_all(address, token, versions_, size, count, sender)))
            seconds, cpu = on_sender(send)
            cpu += _reply(parent, proc)  # the receiver's CPU seconds over the same pushes
            parent.send("done")
            gb = size * (count - 1) / 1e9
            rows.append({"backend": name, "size": size, "pushes": count - 1, "seconds": seconds, "gbps": gb / seconds,
                         "cpu_per_gb": cpu / gb})
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    return rows


def _reply(conn: Connection, proc: mp.process.BaseProcess, timeout_s: float = 120.0) -> Any:
    """The receiver's next message (its address and the push token it granted; after the pushes, its CPU
    seconds); fails instead of hanging when the receiver died."""
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
        repeats: int | None = None, rounds: int = 3, tls_compare: bool = False,
        link_mbit: float | None = None) -> list[dict]:
    """One row per (backend, size): ``backend, size, pushes, gbps, gbps_min, gbps_max, vs_raw, cpu_per_gb`` (the
    sender's and the receiver's CPU seconds per GB moved, median over rounds), the raw-socket baseline first; with
    ``tls_compare`` each backend is followed by itself under mutual TLS (``<backend> + mTLS``), whose rows also
    have ``vs_plain``: the median over rounds of its GB/s over the plain backend's in the same round. Each round
    measures every backend once (interleaved, so load drifts hit all alike); ``gbps`` is the median over rounds.
    ``repeats`` pushes per size and round (None: ~256 MiB worth, 8..400). Backends that cannot be imported here
    (mooncake) are skipped. ``link_mbit``: receivers on a host of their own behind a link capped at that rate
    (tcp only; see the module)."""
    torch.set_num_threads(1)
    if link_mbit is not None:
        backends = tuple(b for b in backends if b == "tcp")
    counts = [1 + (repeats or auto_repeats(s)) for s in sizes]
    usable = [RAW]
    for b in backends:
        if b != "mooncake" or _mooncake_loads():
            usable += ([b, b + MTLS, *([b + V2] if b == "tcp" else [])] if tls_compare else [b])
    samples: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        mesh = MeshCA.open(Path(tmp)) if tls_compare else None
        lab = None
        if link_mbit is not None:
            from app.netlab.hosts import Lab, unavailable

            if (why := unavailable()) is not None:
                raise SystemExit(f"--link-mbit: {why}")
            lab = stack.enter_context(Lab(["prefill", "decode"]))
            # a bucket of two 4 ms kernel ticks at the rate: tbf needs burst >= rate / HZ to reach the rate
            lab.cap("decode", link_mbit, burst_kb=max(256, int(link_mbit * 1e6 / 8 / 250 * 2 / 1024)))
        for _ in range(rounds):
            for name in usable:
                for r in _measure(name, sizes, counts, mesh, lab):
                    samples.setdefault((name, r["size"]), []).append(r["gbps"])
                    cpu.setdefault((name, r["size"]), []).append(r["cpu_per_gb"])
    raw = {size: statistics.median(samples[RAW, size]) for size in sizes}
    rows = [{"backend": b, "size": size, "pushes": count - 1, "gbps": statistics.median(samples[b, size]),
             "gbps_min": min(samples[b, size]), "gbps_max": max(samples[b, size]),
             "vs_raw": statistics.median(samples[b, size]) / raw[size],
             "cpu_per_gb": statistics.median(cpu[b, size])}
            for b in usable for size, count in zip(sizes, counts, strict=True)]
    for r in rows:
        if _plain(r["backend"]) != r["backend"]:
            plain = samples[_plain(r["backend"]), r["size"]]
            r["vs_plain"] = statistics.median(t / p for t, p in zip(samples[r["backend"], r["size"]], plain))
    return rows


def _plain(name: str) -> str:
    """The backend a row's name measures (without the ``MTLS`` / ``V2`` suffix)."""
    return name.removesuffix(V2).removesuffix(MTLS)


def _size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def table(rows: list[dict]) -> str:
    sizes = sorted({r["size"] for r in rows})
    cells: dict[str, dict[str, str]] = {}
    for r in rows:
        cells.setdefault(r["backend"], {"backend": r["backend"]})[_size_name(r["size"])] = (
            f"{r['gbps']:.2f} GB/s ({r['vs_raw']:.2f}x)")  # median of the rounds
    return markdown_table(list(cells.values()), ["backend", *map(_size_name, sizes)])


def tls_table(rows: list[dict]) -> str:
    """Each backend under mutual TLS against itself in plain text: its GB/s over the plain backend's, and the
    CPU seconds per GB (sender and receiver together) of each."""
    sizes = sorted({r["size"] for r in rows})
    plain = {(r["backend"], r["size"]): r for r in rows}
    cells: dict[str, dict[str, str]] = {}
    for r in rows:
        if "vs_plain" in r:
            base = plain[_plain(r["backend"]), r["size"]]
            cells.setdefault(r["backend"], {"backend": f"{r['backend']} vs {base['backend']}"})[
                _size_name(r["size"])] = (f"{r['vs_plain']:.2f}x (CPU {r['cpu_per_gb']:.2f} / "
                                          f"{base['cpu_per_gb']:.2f} s/GB)")
    return markdown_table(list(cells.values()), ["backend", *map(_size_name, sizes)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench transfer")
    p.add_argument("--backends", default="tcp,shm,mooncake",
                   help="comma-separated (mooncake is skipped where it is not installed)")
    p.add_argument("--repeats", type=int, default=None, help="pushes per size (default: ~256 MiB worth)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows the median")
    p.add_argument("--tls-compare", action="store_true",
                   help="each backend also under the mesh's mutual TLS (kvmesh up's default), interleaved")
    p.add_argument("--quick", action="store_true", help="one round of 8 pushes per size (a smoke run)")
    p.add_argument("--link-mbit", type=float, default=None,
                   help="sender and receiver on hosts of their own (network namespaces) behind a link capped at "
                        "this many Mbit/s; tcp only; needs root")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    rows = run(backends=tuple(args.backends.split(",")), repeats=8 if args.quick else args.repeats,
               rounds=rounds, tls_compare=args.tls_compare, link_mbit=args.link_mbit)
    where = ("on loopback" if args.link_mbit is None else
             f"on two hosts (network namespaces on this machine) joined by a link capped at {args.link_mbit:g} "
             f"Mbit/s each way ({args.link_mbit / 8000:.2f} GB/s; tc tbf)")
    body = ("GB/s of one verified push (one block per push, sequential, sender and receiver in separate "
            f"processes {where}), median of {rounds} interleaved rounds; in brackets the ratio to raw "
            "Python sockets in the same run.\n\n" + table(rows))
    if args.tls_compare:
        body += ("\n\n`+ mTLS`: the same backend with the mesh's mutual TLS as `kvmesh up` runs it (TLS 1.3, "
                 "certificates from a mesh CA of the run's own: the receiver a decode instance's, the sender a "
                 "prefill instance's; one connection, its handshake in the warm-up push). tcp's payload is "
                 "sealed (AES-256-GCM under a key of its own, sent outside the TLS records: header version 3); "
                 "`+ mTLS (v2)` is tcp as a version-2 receiver takes it, the payload in TLS records; shm's "
                 "travels in the shared-memory segment (only the header and reply are encrypted). Its GB/s "
                 "over the plain backend's, the median of the rounds' ratios; in brackets the CPU seconds the "
                 "sender and the receiver spent per GB moved, with TLS / without (medians of the rounds: what a "
                 "shared machine's other jobs do not inflate as they do the wall time):\n\n" + tls_table(rows)
                 + f"\n\nLoad average (1, 5, 15 min) at the end: {load_average()}.")
    command = " ".join(["kvmesh bench transfer", *([f"--backends {args.backends}", "--tls-compare"]
                                                   if args.tls_compare else []),
                        *([f"--rounds {args.rounds}"] if args.rounds != 3 else []),
                        *([f"--repeats {args.repeats}"] if args.repeats else []),
                        *([f"--link-mbit {args.link_mbit:g}"] if args.link_mbit is not None else [])])
    section = SECTION_LINK if args.link_mbit is not None else SECTION_TLS if args.tls_compare else SECTION
    publish(section, command, body, write=not args.no_write and not args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
