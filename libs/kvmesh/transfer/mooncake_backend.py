"""The Mooncake Transfer Engine as a backend (PyPI ``mooncake-transfer-engine-non-cuda``; its shared library
needs Debian's ``libibverbs1`` even for TCP).

One engine per process, started on first use with the P2P handshake (no metadata server) and the ``tcp``
protocol. The sender registers its payload buffer and sends ``{session, addr}``; the receiver registers its
result buffer and does a one-sided ``transfer_sync_read`` from the sender's memory (in a worker thread: it
blocks). Imported lazily: the base install never needs mooncake.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvmesh.contracts.ids import TransferBackend
from kvmesh.transfer.backends import Backend, Progress, Staged
from kvmesh.transfer.conn import Conn
from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.header import TransferHeader

ABANDON_LINGER_S = 60.0
_lock = threading.Lock()
_engine: Any = None
_session = ""
_executor: ThreadPoolExecutor | None = None
_registered: Counter[tuple[int, int]] = Counter()  # (addr, length) -> pushes using it; guarded by _lock


def engine_class() -> Any:
    """Mooncake's ``TransferEngine`` class; RuntimeError saying what to install when it cannot load."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read at import; its INFO lines on stderr are noise here
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as e:
        raise RuntimeError(
            "the mooncake transfer backend needs the PyPI package 'mooncake-transfer-engine-non-cuda' and "
            f"Debian's libibverbs1 (apt-get install libibverbs1): {e}") from e
    return TransferEngine


def engine(host: str) -> tuple[Any, str]:
    """The process's engine and its session name (``host:rpc_port``), started on first call."""
    global _engine, _session
    with _lock:
        if _engine is None:
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
            te = engine_class()()
            rc = te.initialize(host, "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) "
                                   f"failed: rc={rc}")
            _engine, _session = te, f"{host}:{te.get_rpc_port()}"
        return _engine, _session


def _reader() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake-read")
        return _executor


def _register(te: Any, addr: int, length: int) -> None:
    with _lock:
        if _registered[(addr, length)] == 0 and (rc := te.register_memory(addr, length)) != 0:
            raise RuntimeError(f"Mooncake register_memory failed: rc={rc}")
        _registered[(addr, length)] += 1


def _unregister(te: Any, addr: int, length: int) -> None:
    with _lock:
        _registered[(addr, length)] -= 1
        if _registered[(addr, length)] == 0:
            del _registered[(addr, length)]
            te.unregister_memory(addr)


def _address(view: memoryview) -> tuple[np.ndarray, int]:
    """A numpy array over ``view`` (holding its buffer alive) and the address of its first byte."""
    array = np.frombuffer(view, dtype=np.uint8)
    return array, array.ctypes.data


class MooncakeBackend(Backend):
    name = TransferBackend.MOONCAKE

    def stage(self, payload: memoryview, local_host: str) -> Staged:
        te, session = engine(local_host)
        held, addr = _address(payload)
        n = len(payload)
        _register(te, addr, n)

        def release(keep: np.ndarray = held) -> None:  # holds the payload alive until released
            _unregister(te, addr, n)

        def abandon() -> None:  # the receiver may still be reading: keep the memory registered (and alive)
            asyncio.get_running_loop().call_later(ABANDON_LINGER_S, release)

        return Staged(source={"session": session, "addr": addr}, release=release, abandon=abandon)

    async def fetch(self, header: TransferHeader, conn: Conn, view: memoryview,
                    progress: Progress | None = None) -> None:
        session, addr = header.source.get("session"), header.source.get("addr")
        if not isinstance(session, str) or not isinstance(addr, int):
            raise TransferRejected(f"mooncake source needs 'session' and 'addr': {header.source!r}",
                                   Refusal.BACKEND)
        te, _ = engine(conn.local_host)
        into, local = _address(view)
        n = len(view)
        _register(te, local, n)

        # A cancelled await must not free `into` while the engine still writes into it: the concurrent
        # future's callback (which holds `into`) unregisters only once the read has really ended.
        def done(_: Future[int], keep: np.ndarray = into) -> None:
            _unregister(te, local, n)

        read = _reader().submit(te.transfer_sync_read, session, local, addr, n)
        read.add_done_callback(done)
        rc = await asyncio.wrap_future(read)
        if rc < 0:
            raise TransferRejected(f"mooncake read of {n} bytes from {session} failed: rc={rc}", Refusal.BACKEND)
