"""Workers that answer at once, with no model behind them, for ``kvmesh bench routers``: what a router costs is
then all that a request through it costs.

    python -m app.bench.stub_workers --http N [--zmq] | --kvmesh N --nats-url URL --cluster C [--ready-file F]

``--http N``: N OpenAI-compatible HTTP servers as ``vllm-router`` and ``sglang-router`` expect their workers
(``/health``, ``/v1/models``, ``/get_model_info``, ``/get_server_info``; ``POST /v1/completions`` and
``/v1/chat/completions`` answer one token, streamed or not). ``--zmq``: for ``vllm-router --policy kv_aware``,
each also binds a ZMQ PUB socket, the KV-event source it subscribes to (nothing is published on it: the stubs
hold no KV), and answers ``POST /v1/completions/render`` (``Renderer``). ``--kvmesh N``: N engine instances of
role ``both`` as the kvmesh router finds them: a gRPC ``kvmesh.v1.Decode`` service answering one token, announced
by a real ``Heartbeat`` every second on NATS (the default model's fingerprint and block size, so the router takes
them).

All of them run on one event loop in this process. Once serving, it writes ``{"http": [urls], "zmq": [endpoints],
"kvmesh": [addresses]}`` to ``--ready-file`` (or prints it) and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

MODEL = "stub"


def completion(body: dict, chat: bool) -> dict:
    """A one-token OpenAI answer to ``body``."""
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
    return {"id": "cmpl-stub", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": body.get("model") or MODEL, "choices": [choice], "usage": usage}


class Renderer:
    """vLLM's ``POST /v1/completions/render`` (its prompt as token ids), which ``vllm-router``'s ``kv_aware`` asks
    a worker for before it routes a text prompt: the default model's tokenizer, each distinct prompt tokenized
    once and remembered, so a worker answers at once (what it costs a real vLLM server is the worker's, not the
    router's)."""

    def __init__(self) -> None:
        from kvmesh.engine.loader import resolve_model
        from kvmesh.model_source.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_dir(resolve_model(None).hf_dir)
        self.known: dict[str, list[int]] = {}

    def ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if prompt not in self.known:
            self.known[prompt] = self.tokenizer.encode(prompt)
        return self.known[prompt]


def http_app(name: str, renderer: Renderer | None) -> web.Application:
    info = {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True, "max_total_num_tokens": 1 << 20}

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": name,
                                                              "max_model_len": 1 << 17}]})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response(info)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        answer = completion(body, chat=request.path.endswith("/chat/completions"))
        if not body.get("stream"):
            return web.json_response(answer)
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f"data: {json.dumps(answer)}\n\ndata: [DONE]\n\n".encode())
        await out.write_eof()
        return out

    async def render(request: web.Request) -> web.Response:
        if renderer is None:
            return web.json_response({"error": "no renderer"}, status=404)
        body = await request.json()
        return web.json_response([{"request_id": "stub", "token_ids": renderer.ids(body["prompt"])}])

    async def other(request: web.Request) -> web.Response:  # a probe not listed above: logged, answered 200
        print(f"{name}: {request.method} {request.path}", flush=True)
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.get("/health", ok), web.get("/health_generate", ok), web.get("/v1/models", models),
                    web.get("/get_model_info", model_info), web.get("/get_server_info", model_info),
                    web.post("/v1/completions", generate), web.post("/v1/chat/completions", generate),
                    web.post("/v1/completions/render", render),
                    web.route("*", "/{tail:.*}", other)])
    return app


async def serve_http(count: int, zmq_too: bool) -> tuple[list[str], list[str], list[object]]:
    urls, endpoints, keep = [], [], []
    renderer = Renderer() if zmq_too and count else None  # the workers of kv_aware: one tokenizer for all
    for i in range(count):
        runner = web.AppRunner(http_app(f"stub-http-{i}", renderer), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        urls.append(f"http://127.0.0.1:{port}")
        keep.append(runner)
    if zmq_too:
        import zmq

        ctx = zmq.Context.instance()
        for _ in range(count):
            sock = ctx.socket(zmq.PUB)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            endpoints.append(f"tcp://127.0.0.1:{port}")
            keep.append(sock)
    return urls, endpoints, keep


async def serve_kvmesh(count: int, nats_url: str, cluster: str) -> tuple[list[str], list[object]]:
    import grpc.aio
    from kvmesh.bus import Bus, Subjects
    from kvmesh.contracts.messages import FEATURES, Heartbeat, InstanceLoad
    from kvmesh.engine.loader import resolve_model
    from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc
    from kvmesh.settings import RouterSettings

    class Decode(worker_pb2_grpc.DecodeServicer):
        async def Decode(self, request: worker_pb2.DecodeRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeChunk]:
            yield worker_pb2.DecodeChunk(token_ids=[42], text="x", finished=True, finish_reason="length")

    fingerprint = resolve_model(None).fingerprint
    block_size = RouterSettings().block_size
    subjects = Subjects(cluster)
    bus = await Bus.connect(nats_url, name="stub-engines")
    addresses, beats, keep = [], [], []
    for i in range(count):
        server = grpc.aio.server()
        keep.append(server)  # a server nothing refers to is collected, and stops
        worker_pb2_grpc.add_DecodeServicer_to_server(Decode(), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        addresses.append(address)
        beats.append(Heartbeat(instance_id=f"stub-{i}", role="both", grpc_address=address, transfer_address="",
                               ts=0.0, load=InstanceLoad(free_blocks=1 << 16, total_blocks=1 << 16),
                               model=fingerprint, block_size=block_size, features=FEATURES))

    async def beat(hb: Heartbeat) -> None:
        while True:
            await bus.publish(subjects.heartbeat("both", hb.instance_id), dataclasses.replace(hb, ts=time.time()))
            await asyncio.sleep(1.0)

    return addresses, [*keep, bus, *(asyncio.create_task(beat(hb)) for hb in beats)]


async def run(args: argparse.Namespace) -> None:
    urls, endpoints, keep = await serve_http(args.http, args.zmq)
    addresses, serving = await serve_kvmesh(args.kvmesh, args.nats_url, args.cluster) if args.kvmesh else ([], [])
    ready = json.dumps({"http": urls, "zmq": endpoints, "kvmesh": addresses})
    if args.ready_file:
        tmp = Path(args.ready_file).with_suffix(".tmp")
        tmp.write_text(ready)
        tmp.rename(args.ready_file)
    else:
        print(ready, flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    del keep, serving


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m app.bench.stub_workers", description=__doc__.split("\n\n")[0])
    p.add_argument("--http", type=int, default=0, help="OpenAI HTTP stub workers")
    p.add_argument("--zmq", action="store_true", help="a ZMQ KV-event PUB socket per HTTP worker (silent)")
    p.add_argument("--kvmesh", type=int, default=0, help="kvmesh stub engine instances (role both)")
    p.add_argument("--nats-url", default="")
    p.add_argument("--cluster", default="kvmesh")
    p.add_argument("--ready-file", default="")
    args = p.parse_args(argv)
    if args.kvmesh and not args.nats_url:
        p.error("--kvmesh needs --nats-url")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
