"""Bad input at the router's two APIs: each gets a clear 4xx (HTTP) or INVALID_ARGUMENT / RESOURCE_EXHAUSTED /
NOT_FOUND (gRPC) naming what to fix, and the next good request is served. A real router in front of a real
prefill and decode instance (tiny random model), real nats-server, real ports."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import grpc
import pytest
from aiohttp import web
from kvmesh.engine.loader import save_hf_dir
from kvmesh.grpc_server import ServiceServer
from kvmesh.instance.host import EngineHost
from kvmesh.model_source.hf_config import ModelConfig
from kvmesh.model_source.tokenizer import save_byte_tokenizer
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc, common_pb2
from kvmesh.settings import EngineSettings, InstanceSettings, RouterSettings, SharedSettings

from services.decode.servicer import ROLE as DECODE
from services.prefill.servicer import ROLE as PREFILL
from services.router.core import Router
from services.router.grpc_api import KvmeshServicer, add_to_server
from services.router.http_api import OpenAIApi
from services.router.intake import Intake

CONTEXT = ModelConfig.tiny().max_position_embeddings  # 512
HI = [{"role": "user", "content": "Hi"}]


def tiny_model_dir(root: Path) -> Path:
    """The tiny random Llama as an HF folder with the byte tokenizer (ChatML template)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = ModelConfig.tiny()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_hf()))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return save_hf_dir(config, weights, root / "tiny", save_byte_tokenizer(root / "tok"))


ROLE_PLUGINS = {"prefill": [PREFILL], "decode": [DECODE], "both": [PREFILL, DECODE]}


class TinyMesh:
    """nats-server (the caller's) + a prefill and a decode ``EngineHost`` (``roles=("both",)``: one serving both)
    (+ with ``cachesvc``, the cache service and its pool) + the router's gRPC and HTTP APIs, all in one event
    loop on a background thread, on free loopback ports."""

    def __init__(self, nats_url: str, model_dir: Path, cachesvc: bool = False,
                 roles: tuple[str, ...] = ("prefill", "decode"), engine: dict | None = None,
                 pool: dict | None = None, **router: object) -> None:
        """``engine``, ``pool``: settings of the engines and of cachesvc over the defaults here."""
        self.roles = roles
        self.pool_cfg = pool or {}
        self.cluster = f"t{uuid.uuid4().hex[:10]}"
        self.cachesvc = cachesvc
        self.shared = SharedSettings(cluster=self.cluster, nats_url=nats_url)
        self.cfg = RouterSettings(model=str(model_dir), cachesvc_address="", grpc_port=0, http_port=0,  # type: ignore
                                  **{"instance_timeout_s": 30.0, **router})  # a busy CI box must not drop them
        self.engine_cfg = EngineSettings(**{"model": str(model_dir), "attention": "torch", "num_blocks": 512,
                                            "max_batched_tokens": 512, **(engine or {})})
        self.worker_cfg = InstanceSettings()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        self.call(self._start(), timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self._stop(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.cache = None
        if self.cachesvc:
            from kvmesh.settings import CacheServiceSettings

            from services.cachesvc.server import CacheServer

            self.cache = CacheServer(CacheServiceSettings(port=0, durable_name=f"cachesvc-{self.cluster}",
                                                          **self.pool_cfg), self.shared)
            await self.cache.start()
            self.cfg = self.cfg.model_copy(update={"cachesvc_address": self.cache.address})
            self.worker_cfg = self.worker_cfg.model_copy(update={"cachesvc_address": self.cache.address})
        self.workers = [EngineHost(self.worker_cfg.model_copy(update={"role": role,
                                                                      "id": f"{role}-{self.roles[:n].count(role)}"}),
                                   self.engine_cfg, ROLE_PLUGINS[role], self.shared)
                        for n, role in enumerate(self.roles)]
        for w in self.workers:
            await w.start()
        self.router = Router(self.cfg, self.shared)
        await self.router.start()
        self.intake = Intake(self.router)
        self.admission = self.intake.admission
        self.grpc = ServiceServer(["kvmesh.v1.Kvmesh"], max_receive_bytes=self.cfg.max_body_bytes)
        add_to_server(KvmeshServicer(self.router, self.intake), self.grpc.server, self.cfg.max_body_bytes)
        self.grpc_target = self.grpc.bind("127.0.0.1", 0)
        await self.grpc.start()
        self.runner = web.AppRunner(OpenAIApi(self.router, self.intake).app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.http_port = self.runner.addresses[0][1]
        deadline = time.monotonic() + 30
        while len(self.router.registry.alive()) < len(self.workers):
            if time.monotonic() > deadline:
                raise TimeoutError("the engine instances never beat")
            await asyncio.sleep(0.05)

    async def _stop(self) -> None:
        await self.grpc.stop(0)
        await self.runner.cleanup()
        await self.router.stop()
        for w in self.workers:
            await w.stop()
        if self.cache is not None:
            await self.cache.stop()

    # ---- clients -------------------------------------------------------------------------------------------
    def http(self, method: str, path: str, body: bytes | dict | list | str | None = None,
             headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, dict, dict]:
        """One HTTP request; the status, the JSON body (``{"raw": text}`` when not JSON) and the headers."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        try:
            conn.request(method, path, body=data,
                         headers={"content-type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            text = resp.read().decode()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = {"raw": text}
            return resp.status, parsed, {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def post(self, path: str, body, headers: dict[str, str] | None = None, timeout: float = 60):
        return self.http("POST", path, body, headers, timeout)

    def stub(self, channel: grpc.Channel) -> api_pb2_grpc.KvmeshStub:
        return api_pb2_grpc.KvmeshStub(channel)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:
    with TinyMesh(nats_server.url, model_dir, max_body_bytes=64 * 1024) as m:
        yield m


@pytest.fixture
def stub(mesh) -> Iterator[api_pb2_grpc.KvmeshStub]:
    with grpc.insecure_channel(mesh.grpc_target) as channel:
        yield mesh.stub(channel)


def still_serves(mesh: TinyMesh) -> None:
    status, body, _ = mesh.post("/v1/chat/completions", {"messages": HI, "max_tokens": 3, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1


def assert_http_error(mesh: TinyMesh, resp: tuple[int, dict, dict], status: int, *words: str) -> None:
    code, body, _headers = resp
    assert code == status, body
    error = body["error"]
    assert error["code"] == status and error["type"] and error["message"]
    for w in words:
        assert w in error["message"], error["message"]
    still_serves(mesh)


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG = "word " * (CONTEXT + 20)


@pytest.mark.parametrize("path,body,words", [
    (CHAT, {"messages": [{"role": "user", "content": ""}]}, ["messages[0].content is blank"]),
    (CHAT, {"messages": [{"role": "system", "content": " \n"}, {"role": "user", "content": "\t "}]},
     ["messages[1].content is blank"]),
    (CHAT, {"messages": []}, ["messages", "non-empty"]),
    (CHAT, {}, ["messages is required"]),
    (CHAT, {"messages": "hello"}, ["messages"]),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, ["messages[0]", "role"]),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, ["messages[0].content must be a string"]),
    (COMPLETIONS, {"prompt": "   "}, ["blank"]),
    (COMPLETIONS, {"prompt": ""}, ["blank"]),
    (COMPLETIONS, {"prompt": []}, ["prompt must be"]),
    (COMPLETIONS, {"prompt": [1, 10**9]}, ["token ids"]),
    (COMPLETIONS, {"prompt": LONG}, ["shorten the prompt", str(CONTEXT)]),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, ["shorten the prompt"]),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, ["max_tokens must be >= 1"]),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": -3}, ["max_tokens must be >= 1"]),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": CONTEXT}, ["max_tokens", "at most"]),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 10**30}, ["max_tokens", "context"]),
    (COMPLETIONS, {"prompt": "Hi", "max_completion_tokens": 0, "max_tokens": 5}, ["max_tokens must be >= 1"]),
    (COMPLETIONS, {"prompt": "Hi", "temperature": -0.5}, ["temperature"]),
    (COMPLETIONS, {"prompt": "Hi", "temperature": 10**400}, ["temperature is out of range"]),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 0}, ["top_p must be in (0, 1]"]),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 1.5}, ["top_p must be in (0, 1]"]),
    (COMPLETIONS, {"prompt": "Hi", "top_p": -1}, ["top_p must be in (0, 1]"]),
    (COMPLETIONS, {"prompt": "Hi", "top_k": -2}, ["top_k"]),
    (COMPLETIONS, {"prompt": "Hi", "top_k": 10**12}, ["top_k", "vocabulary"]),
    (COMPLETIONS, {"prompt": "Hi", "seed": -1}, ["seed"]),
    (COMPLETIONS, {"prompt": "Hi", "seed": 2**64}, ["seed"]),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [-1]}, ["stop_token_ids"]),
    (COMPLETIONS, {"prompt": "Hi", "stop": [""]}, ["stop strings must not be empty"]),
    (COMPLETIONS, {"prompt": "Hi", "stop": [1]}, ["stop must be"]),
    (COMPLETIONS, {"prompt": "Hi", "n": 17}, ["n must be an integer in [1, 16]"]),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": "5"}, ["max_tokens must be an integer, not a string"]),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2.5}, ["max_tokens must be an integer"]),
    (COMPLETIONS, {"prompt": "Hi", "temperature": "hot"}, ["temperature must be a number"]),
    (COMPLETIONS, {"prompt": "Hi", "temperature": True}, ["temperature must be a number"]),
    (COMPLETIONS, {"prompt": "Hi", "stream": "yes"}, ["stream must be true or false"]),
    (COMPLETIONS, {"prompt": "Hi", "stream": True, "stream_options": [1]},
     ["stream_options must be an object"]),
    (COMPLETIONS, {"prompt": "Hi", "ignore_eos": 1}, ["ignore_eos must be true or false"]),
    (COMPLETIONS, {"prompt": "Hi", "return_token_ids": "yes"}, ["return_token_ids must be true or false"]),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "return_token_ids": 1},
     ["return_token_ids must be true or false"]),
    (COMPLETIONS, {"prompt": "Hi", "model": 7}, ["model must be a string"]),
    (COMPLETIONS, {"prompt": "Hi", "cache_salt": ["a"]}, ["cache_salt must be a string"]),
    (COMPLETIONS, {"prompt": "Hi", "cache_salt": "a\u0000b"}, ["cache_salt", "NUL"]),
    (COMPLETIONS, {"prompt": "Hi", "kvmesh_policy": {"x": 1}}, ["kvmesh_policy must be a string"]),
    (COMPLETIONS, {"prompt": "Hi", "kvmesh_policy": "fastest"}, ["unknown routing policy"]),
])
def test_http_bad_field_gets_400_naming_it(mesh, path, body, words):
    assert_http_error(mesh, mesh.post(path, body), 400, *words)


def test_http_unknown_model_gets_404_naming_the_served_one(mesh):
    assert_http_error(mesh, mesh.post(CHAT, {"model": "gpt-9", "messages": HI}), 404, "gpt-9", "tiny")


@pytest.mark.parametrize("raw,words", [
    (b'{"messages": [', ["must be JSON"]),
    (b"", ["must be JSON"]),
    (b"[1, 2]", ["JSON object, not a list"]),
    (b'"hi"', ["JSON object, not a string"]),
    (b'{"prompt": "Hi", "temperature": NaN}', ["NaN is not a JSON number"]),
    (b'{"prompt": "Hi", "top_p": Infinity}', ["Infinity"]),
    (b'{"prompt": "\xff\xfe caf\xe9"}', ["not valid UTF-8"]),
    (b'{"prompt": "\\ud800 lone"}', ["surrogate"]),
    (b'{"prompt": "Hi", "stop": ["\\udfff"]}', ["surrogate"]),
    (b"[" * 20_000 + b"]" * 20_000, ["nested too deeply"]),
    (b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}", ["must be JSON"]),
])
def test_http_malformed_body_gets_400(mesh, raw, words):
    assert_http_error(mesh, mesh.post(COMPLETIONS, raw), 400, *words)


def test_http_oversized_body_gets_a_json_413(mesh):
    body = json.dumps({"prompt": "x" * (mesh.cfg.max_body_bytes + 1)}).encode()
    assert_http_error(mesh, mesh.post(COMPLETIONS, body), 413, "max_body_bytes", str(mesh.cfg.max_body_bytes))


def test_http_unknown_path_and_method_get_json_errors(mesh):
    assert_http_error(mesh, mesh.http("POST", "/v1/embeddings", {"input": "x"}), 404, "/v1/chat/completions")
    assert_http_error(mesh, mesh.http("GET", CHAT), 405, "POST /v1/chat/completions")


def test_http_content_parts_are_joined_into_the_message(mesh):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    plain = mesh.post(CHAT, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1})
    joined = mesh.post(CHAT, {"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert plain[0] == joined[0] == 200
    assert plain[1]["usage"]["prompt_tokens"] == joined[1]["usage"]["prompt_tokens"]


def test_http_blank_system_message_is_fine_when_another_has_text(mesh):
    status, body, _ = mesh.post(CHAT, {"messages": [{"role": "system", "content": ""}, *HI], "max_tokens": 2})
    assert status == 200, body


# ---- gRPC --------------------------------------------------------------------------------------------------

def sampling(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_tokens": 3, **kw})


def grpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        result = call()
        if not isinstance(result, api_pb2.ChatResponse):
            list(result)
    return e.value


def grpc_still_serves(stub) -> None:
    chunks = list(stub.Generate(api_pb2.GenerateRequest(text="Hello", sampling=sampling()), timeout=60))
    assert chunks[-1].finished and chunks[-1].usage.completion_tokens >= 1


def msgs(*contents: str, role: str = "user") -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role=role, content=c) for c in contents]


@pytest.mark.parametrize("request_,code,words", [
    (api_pb2.GenerateRequest(text=" \n", sampling=sampling()), "INVALID_ARGUMENT", ["blank"]),
    (api_pb2.GenerateRequest(sampling=sampling()), "INVALID_ARGUMENT", ["a prompt is required"]),
    (api_pb2.GenerateRequest(messages=api_pb2.ChatMessages(messages=msgs("", " ")), sampling=sampling()),
     "INVALID_ARGUMENT", ["messages[1].content is blank"]),
    (api_pb2.GenerateRequest(messages=api_pb2.ChatMessages(messages=msgs("hi", role="robot"))),
     "INVALID_ARGUMENT", ["messages[0]", "role"]),
    (api_pb2.GenerateRequest(text=LONG), "INVALID_ARGUMENT", ["shorten the prompt"]),
    (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[5, 300])), "INVALID_ARGUMENT", ["token ids"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(max_tokens=CONTEXT)), "INVALID_ARGUMENT",
     ["max_tokens", "at most"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(max_tokens=2**32 - 1)), "INVALID_ARGUMENT",
     ["max_tokens"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(temperature=-1)), "INVALID_ARGUMENT",
     ["temperature"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(temperature=float("nan"))), "INVALID_ARGUMENT",
     ["temperature"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(temperature=float("inf"))), "INVALID_ARGUMENT",
     ["temperature"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(top_p=1.5)), "INVALID_ARGUMENT", ["top_p"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(top_p=-0.1)), "INVALID_ARGUMENT", ["top_p"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(top_k=2**32 - 1)), "INVALID_ARGUMENT", ["top_k"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(stop_token_ids=[9999])), "INVALID_ARGUMENT",
     ["stop_token_ids"]),
    (api_pb2.GenerateRequest(text="Hi", sampling=sampling(stop=[""])), "INVALID_ARGUMENT", ["stop"]),
    (api_pb2.GenerateRequest(text="Hi", cache_salt="a\x00b"), "INVALID_ARGUMENT", ["NUL"]),
    (api_pb2.GenerateRequest(text="Hi", request_id="x" * 200), "INVALID_ARGUMENT", ["request_id"]),
    (api_pb2.GenerateRequest(text="Hi", request_id="id\u00e9"), "INVALID_ARGUMENT", ["request_id"]),
    (api_pb2.GenerateRequest(text="Hi", model="gpt-9"), "NOT_FOUND", ["gpt-9"]),
    (api_pb2.ChatRequest(messages=[]), "INVALID_ARGUMENT", ["messages"]),
    (api_pb2.ChatRequest(messages=msgs("\t")), "INVALID_ARGUMENT", ["messages[0].content is blank"]),
    (api_pb2.ChatRequest(messages=msgs("hi"), sampling=sampling(top_p=2)), "INVALID_ARGUMENT", ["top_p"]),
    (api_pb2.ChatRequest(messages=msgs("hi"), model="other"), "NOT_FOUND", ["other"]),
])
def test_grpc_bad_request_gets_a_status_naming_the_field(stub, request_, code, words):
    call = stub.Chat if isinstance(request_, api_pb2.ChatRequest) else stub.Generate
    err = grpc_error(lambda: call(request_, timeout=30))
    assert err.code().name == code, err.details()
    for w in words:
        assert w in err.details(), err.details()
    grpc_still_serves(stub)


@pytest.mark.parametrize("method", ["Generate", "Chat"])
@pytest.mark.parametrize("raw,code,words", [
    (b"\x12\x02\xff\xfe", "INVALID_ARGUMENT", ["UTF-8"]),          # field 2 (model), a string of bad UTF-8
    (b"\xff\xff\xff\xff", "INVALID_ARGUMENT", ["not a valid"]),      # not a protobuf message at all
])
def test_grpc_undecodable_request_gets_invalid_argument(mesh, stub, method, raw, code, words):
    with grpc.insecure_channel(mesh.grpc_target) as channel:
        rpc = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
            f"/kvmesh.v1.Kvmesh/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        err = grpc_error(lambda: rpc(raw, timeout=30))
    assert err.code().name == code and all(w in err.details() for w in words), err.details()
    grpc_still_serves(stub)


def test_grpc_oversized_request_gets_resource_exhausted(mesh, stub):
    big = api_pb2.GenerateRequest(text="x" * (mesh.cfg.max_body_bytes + 1))
    err = grpc_error(lambda: stub.Generate(big, timeout=30))  # gRPC's receive limit: "larger than max (N vs. M)"
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(mesh.cfg.max_body_bytes) in err.details()
    grpc_still_serves(stub)


# ---- too many at once --------------------------------------------------------------------------------------

@contextlib.contextmanager
def capped(mesh: TinyMesh, total: int, per_tenant: int = 0) -> Iterator[None]:
    """Lower the live caps (the admission object both APIs share) for one test."""
    old = mesh.admission.max_total, mesh.admission.max_per_tenant
    mesh.admission.max_total, mesh.admission.max_per_tenant = total, per_tenant
    try:
        yield
    finally:
        mesh.admission.max_total, mesh.admission.max_per_tenant = old


def open_stream(mesh: TinyMesh) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A long streaming request, held open after its first event."""
    conn = http.client.HTTPConnection("127.0.0.1", mesh.http_port, timeout=60)
    conn.request("POST", COMPLETIONS, body=json.dumps({"prompt": "Hi", "max_tokens": CONTEXT - 10,
                                                        "ignore_eos": True, "stream": True}),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read(6) == b"data: "
    return conn, resp


def wait_until(predicate, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_over_the_concurrency_cap_is_refused_at_once_with_429_and_retry_after(mesh, stub):
    with capped(mesh, total=1):
        conn, _ = open_stream(mesh)
        start = time.monotonic()
        status, body, headers = mesh.post(CHAT, {"messages": HI, "max_tokens": 2})
        assert time.monotonic() - start < 2
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert "1 requests in flight" in body["error"]["message"] and headers["retry-after"] == "1"
        request = api_pb2.GenerateRequest(text="Hi", sampling=sampling())
        err = grpc_error(lambda: stub.Generate(request, timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in err.details()
        assert dict(err.trailing_metadata()).get("retry-after") == "1"
        conn.close()  # the client goes away mid-stream: its slot comes back
        assert wait_until(lambda: mesh.admission.total == 0)
        still_serves(mesh)
        grpc_still_serves(stub)
    assert mesh.admission.total == 0


def test_finished_and_failed_requests_leave_no_slot_behind(mesh, stub):
    for _ in range(3):
        mesh.post(CHAT, {"messages": HI, "max_tokens": 2})
        mesh.post(CHAT, {"messages": [], "max_tokens": 2})
        list(stub.Generate(api_pb2.GenerateRequest(text="Hi", sampling=sampling(max_tokens=2)), timeout=30))
        grpc_error(lambda: stub.Chat(api_pb2.ChatRequest(messages=msgs(" ")), timeout=30))
    assert wait_until(lambda: mesh.admission.total == 0 and not mesh.admission.per_tenant)


# ---- admin operations ----------------------------------------------------------------------------------------

def test_without_an_admin_key_configured_adapter_load_and_unload_are_refused_alike(mesh, model_dir, tmp_path):
    """The default: no admin_key, so no call loads or unloads an adapter, and the answer is the same whether
    the path exists or not (it names nothing the caller sent)."""
    calls = [("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(model_dir)}),   # exists
             ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path / "none")}),
             ("/v1/load_lora_adapter", b"not json"),
             ("/v1/unload_lora_adapter", {"lora_name": "a"})]
    answers = set()
    for path, body in calls:
        for headers in ({}, {"authorization": "Bearer anything"}):
            status, got, _ = mesh.post(path, body, headers)
            answers.add((status, got["error"]["type"], got["error"]["message"]))
    assert len(answers) == 1, answers
    status, error_type, message = answers.pop()
    assert status == 403 and error_type == "permission_error" and "admin_key" in message
    still_serves(mesh)
