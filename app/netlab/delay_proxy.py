"""A TCP proxy that adds a fixed one-way delay to every byte, both ways: what ``tc netem delay`` does, for kernels
without netem. Each direction of each connection is a reader that stamps what it reads and a writer that sends
it once its time has come, so the delay adds latency without limiting throughput.

    python -m app.netlab.delay_proxy --delay-ms 5 LISTEN_HOST:PORT=UPSTREAM_HOST:PORT [...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time

log = logging.getLogger("delay_proxy")
READ = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while data := await reader.read(READ):
            queue.put_nowait((time.monotonic() + delay_s, data))
        queue.put_nowait((time.monotonic() + delay_s, b""))

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(read(), write())


async def serve(listen: tuple[str, int], upstream: tuple[str, int], delay_s: float) -> asyncio.Server:
    """Forward connections to ``listen`` to ``upstream``, ``delay_s`` late each way."""

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        peer = client_w.get_extra_info("peername")
        log.info("connection from %s to %s:%d", peer[0] if peer else "?", *upstream)
        try:
            up_r, up_w = await asyncio.open_connection(*upstream)
        except OSError as e:
            log.warning("cannot reach %s:%d: %s", *upstream, e)
            client_w.close()
            return
        try:
            await asyncio.gather(_pipe(client_r, up_w, delay_s), _pipe(up_r, client_w, delay_s))
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (client_w, up_w):
                w.close()

    return await asyncio.start_server(handle, *listen)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _main(routes: list[str], delay_s: float) -> None:
    servers = []
    for route in routes:
        listen, _, upstream = route.partition("=")
        servers.append(await serve(_address(listen), _address(upstream), delay_s))
    print("delay proxy ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.netlab.delay_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every byte")
    p.add_argument("routes", nargs="+", metavar="LISTEN=UPSTREAM", help="host:port=host:port")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    asyncio.run(_main(args.routes, args.delay_ms / 1e3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
