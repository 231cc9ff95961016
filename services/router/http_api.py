"""OpenAI-compatible HTTP API (aiohttp): /v1/chat/completions, /v1/completions, /v1/models, SSE streaming.

Accepts the sampling extensions vLLM does (top_k, seed, ignore_eos, stop_token_ids), so tools written for vLLM
drive kvmesh unchanged; structured output (``response_format``, vLLM's ``guided_*`` / ``structured_outputs``):
services/router/structured.py. Every response carries ``x-request-id`` and ``traceparent`` (the request's span; a
``traceparent`` the caller sent is honoured, so its trace continues here). ``GET /metrics``: Prometheus.
Every error, ours or aiohttp's (unknown path, body too large), is OpenAI's JSON error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, NamedTuple

from aiohttp import web
from kvmesh.contracts.sampling import DEFAULT_MAX_TOKENS, SamplingParams

from services.router.access import RETRY_AFTER_S, Admission, Tenants, cache_salt
from services.router.core import Chunk, RequestError, Router, new_request_id
from services.router.loras import LoRAError
from services.router.structured import structured_from_body
from services.router.telemetry import RequestTrace

log = logging.getLogger(__name__)
HTTP_STATUS = {"invalid": 400, "unauthenticated": 401, "not_found": 404, "too_large": 413, "overloaded": 429,
               "unavailable": 503, "internal": 500}
ERROR_TYPE = {"invalid": "invalid_request_error", "unauthenticated": "authentication_error",
              "not_found": "not_found_error", "too_large": "invalid_request_error",
              "overloaded": "rate_limit_error", "unavailable": "service_unavailable",
              "internal": "internal_error"}


def error_body(status: int, error_type: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(kind: str, message: str, request_id: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(headers or {"x-request-id": request_id})
    if kind == "overloaded":
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return web.json_response(error_body(HTTP_STATUS[kind], ERROR_TYPE[kind], message, param),
                             status=HTTP_STATUS[kind], headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own 4xx answers (unknown path, wrong method, ...) in the OpenAI error shape, not as text."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = (f"no route for {request.method} {request.path}; this API serves "
                   "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, "
                   "GET /metrics, POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter"
                   if e.status in (404, 405) else e.text or e.reason)
        kept = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
        return web.json_response(error_body(e.status, "invalid_request_error", message), status=e.status,
                                 headers=kept)


def _int(body: dict, name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise RequestError("invalid", f"{name} must be an integer, not {_kind(v)}")
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise RequestError("invalid", f"{name} must be a number, not {_kind(v)}")
    try:
        return float(v)
    except OverflowError:
        raise RequestError("invalid", f"{name} is out of range") from None


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is not None and not isinstance(v, bool):
        raise RequestError("invalid", f"{name} must be true or false, not {_kind(v)}")
    return bool(v)


def _str(body: dict, name: str) -> str:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise RequestError("invalid", f"{name} must be a string, not {_kind(v)}")
    return v or ""


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(v), type(v).__name__)


def sampling_from_body(body: dict) -> SamplingParams:
    """The request's sampling parameters; RequestError names the field that is wrong and how."""
    if _int(body, "n", 1) != 1:
        raise RequestError("invalid", "only n=1 is supported")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("invalid", "stop must be a string or a list of strings")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(type(t) is int for t in stop_ids):
        raise RequestError("invalid", "stop_token_ids must be a list of integers")
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS)
    top_k = _int(body, "top_k", 0) or 0
    if top_k < -1:
        raise RequestError("invalid", f"top_k must be >= 0 (-1 or 0 turn it off), not {top_k}")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0),
                              top_k=max(0, top_k), top_p=_num(body, "top_p", 1.0),
                              seed=_int(body, "seed", None), stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                              ignore_eos=_bool(body, "ignore_eos"), structured=structured_from_body(body))
    except ValueError as e:
        raise RequestError("invalid", str(e)) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_strings(body: Any) -> None:
    """Every string in the body must be encodable: JSON escapes can smuggle in lone UTF-16 surrogates."""
    stack = [body]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                raise RequestError("invalid", "the request body has a lone UTF-16 surrogate escape (e.g. "
                                              "\\ud800): strings must be valid Unicode") from None
        elif isinstance(v, dict):
            stack += v.keys()
            stack += v.values()
        elif isinstance(v, list):
            stack += v


class Answer(NamedTuple):
    """What every chunk of one response repeats: the request id, the object kind and the model it names."""

    rid: str
    kind: str
    model: str  # the LoRA adapter's name when one was asked for, else the base model's id


class OpenAIApi:
    def __init__(self, router: Router, tenants: Tenants | None = None,
                 admission: Admission | None = None) -> None:
        """``tenants`` and ``admission`` are shared with the gRPC API (the caps count both); by default they
        are built from the router's settings."""
        self.router = router
        self.tenants = tenants or Tenants.from_config(router.cfg)
        self.admission = admission or Admission.from_config(router.cfg)
        self.app = web.Application(client_max_size=router.cfg.max_body_bytes, middlewares=[json_errors])
        self.app.add_routes([web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                             web.get("/v1/models", self.models), web.get("/health", self.health),
                             web.get("/metrics", self.metrics),
                             web.post("/v1/load_lora_adapter", self.load_lora),
                             web.post("/v1/unload_lora_adapter", self.unload_lora)])

    async def _body(self, request: web.Request) -> dict:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError("too_large", f"the request body is over the limit of "
                                            f"{request.client_max_size} bytes (max_body_bytes): send a "
                                            "shorter prompt") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError("invalid", f"the request body is not valid UTF-8 (byte {e.start}): send UTF-8 "
                                          "JSON") from None
        try:
            body = json.loads(text, parse_constant=_reject_constant)
        except ValueError as e:
            raise RequestError("invalid", f"the request body must be JSON: {e}") from None
        except RecursionError:
            raise RequestError("invalid", "the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise RequestError("invalid", f"the request body must be a JSON object, not {_kind(body)}")
        _check_strings(body)
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        rid = request.headers.get("x-request-id") or new_request_id()
        if len(rid) > 128 or not rid.isascii() or not rid.isprintable():
            rid = new_request_id()
        rt = RequestTrace(self.router.metrics, rid, "http.chat" if chat else "http.completions", request.headers)
        leave = None
        try:
            tenant = self.tenants.authenticate(request.headers)
            leave = self.admission.enter(tenant)
            with rt.segment("router.tokenize") as span:
                body = await self._body(request)
                params = sampling_from_body(body)
                if chat:
                    if "messages" not in body:
                        raise RequestError("invalid", "messages is required: a list of {role, content} "
                                                      "objects")
                    prompt = self.router.prompt_ids(messages=body["messages"])
                else:
                    prompt = self._completion_prompt(body.get("prompt"))
                model = _str(body, "model")
                lora = self.router.check(model, prompt, params)
                span.set_attribute("kvmesh.tokens.prompt", len(prompt))
            requested = _str(body, "cache_salt") or _str(body, "user")
            salt = cache_salt(tenant, requested)
            policy = request.headers.get("x-kvmesh-policy") or _str(body, "kvmesh_policy")
            stream_opts = body.get("stream_options") or {}
            if not isinstance(stream_opts, dict):
                raise RequestError("invalid", "stream_options must be an object like "
                                              "{\"include_usage\": true}")
            streaming, include_usage = _bool(body, "stream"), _bool(stream_opts, "include_usage")
            rt.describe(model or self.router.model_id, tenant or requested, len(prompt))
            stream = self.router.generate(rid, prompt, params, salt, trace=rt, policy=policy or None, lora=lora,
                                          disaggregate=request.headers.get("x-kvmesh-disaggregate") or None)
            kind = "chat.completion" if chat else "text_completion"
            answer = Answer(rid, kind, lora or self.router.model_id)  # an adapter's answer names the adapter
            if streaming:
                return await self._sse(request, answer, stream, include_usage, rt)
            return await self._whole(answer, stream, rt)
        except RequestError as e:
            rt.finish(e.kind, e.message)
            return error_response(e.kind, e.message, rid, headers=rt.headers(rid))
        except (asyncio.CancelledError, ConnectionResetError):
            rt.finish("cancelled", "the client went away")
            raise
        except Exception as e:  # a fault of ours, before the response started: logged, answered as JSON
            log.exception("request %s (trace %s) failed", rid, rt.trace_id)
            rt.finish("internal", str(e))
            return error_response("internal", f"internal error; the router's log has request {rid}", rid,
                                  headers=rt.headers(rid))
        finally:
            rt.finish()
            if leave is not None:
                leave()

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return self.router.prompt_ids(text=prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return self._completion_prompt(prompt[0])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return self.router.prompt_ids(token_ids=prompt)
        raise RequestError("invalid", "prompt must be a string or a list of token ids (one prompt per request)")

    @staticmethod
    def _envelope(answer: Answer, kind: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{answer.rid}", "object": kind,
               "created": int(time.time()), "model": answer.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    @staticmethod
    def _usage(c: Chunk) -> dict:
        u = c.usage
        assert u is not None
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

    async def _whole(self, answer: Answer, stream, rt: RequestTrace) -> web.Response:
        rid, kind = answer.rid, answer.kind
        text, last = [], None
        async for c in stream:
            rt.first_token_sent()  # not streaming: TTFT ends when the first token is in hand
            text.append(c.text)
            last = c
        assert last is not None
        content = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}} if kind == "chat.completion"
                  else {"index": 0, "text": content, "logprobs": None})
        choice["finish_reason"] = last.finish_reason or "stop"
        return web.json_response(self._envelope(answer, kind, [choice], self._usage(last)), headers=rt.headers(rid))

    async def _sse(self, request: web.Request, answer: Answer, stream, include_usage: bool,
                   rt: RequestTrace) -> web.StreamResponse:
        rid, kind = answer.rid, answer.kind
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        # pull the first chunk before answering, so an error still becomes a proper HTTP status
        it = stream.__aiter__()
        first = await it.__anext__()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **rt.headers(rid)})
        await resp.prepare(request)

        async def send(obj: dict | str) -> None:
            await resp.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

        if chunk_kind == "chat.completion.chunk":
            await send(self._envelope(answer, chunk_kind, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                         "finish_reason": None}]))
        c: Chunk | None = first
        try:
            while c is not None:
                delta = ({"delta": {"content": c.text}} if chunk_kind == "chat.completion.chunk"
                         else {"text": c.text, "logprobs": None})
                await send(self._envelope(answer, chunk_kind, [{"index": 0, **delta,
                                                             "finish_reason": c.finish_reason or None}]))
                rt.first_token_sent()
                if c.finished:
                    if include_usage:
                        await send(self._envelope(answer, chunk_kind, [], self._usage(c)))
                    break
                c = await it.__anext__()
        except RequestError as e:
            rt.finish(e.kind, e.message)
            await send({"error": {"message": e.message, "type": ERROR_TYPE[e.kind], "code": HTTP_STATUS[e.kind]}})
        except ConnectionResetError:
            raise
        except Exception as e:  # a fault of ours mid-stream: the client still gets an error event and [DONE]
            log.exception("request %s (trace %s) failed mid-stream", rid, rt.trace_id)
            rt.finish("internal", str(e))
            await send({"error": {"message": f"internal error; the router's log has request {rid}",
                                  "type": ERROR_TYPE["internal"], "code": 500}})
        await send("[DONE]")
        await resp.write_eof()
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.router.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def models(self, request: web.Request) -> web.Response:
        try:
            self.tenants.authenticate(request.headers)
        except RequestError as e:
            return error_response(e.kind, e.message, new_request_id())
        r = self.router
        base = {"id": r.model_id, "object": "model", "created": 0, "owned_by": "kvmesh", "root": r.model_id,
                "parent": None, "max_model_len": r.max_model_len}
        loras = [{**base, "id": name, "root": path, "parent": r.model_id}
                 for name, (_, path) in r.loras.served().items()]
        return web.json_response({"object": "list", "data": [base, *loras]})

    async def _lora_call(self, request: web.Request, load: bool) -> web.Response:
        """vLLM's runtime LoRA API: 200 with a plain-text "Success: ..." or an OpenAI JSON error."""
        rid = new_request_id()
        try:
            self.tenants.authenticate(request.headers)
            body = await self._body(request)
            name = _str(body, "lora_name")
            if not name:
                raise RequestError("invalid", "lora_name is required")
            if load:
                path = _str(body, "lora_path")
                if not path:
                    raise RequestError("invalid", "lora_path is required: a PEFT adapter directory")
                await self.router.loras.load(name, path, inplace=_bool(body, "load_inplace"))
                return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
            await self.router.loras.unload(name)
            return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
        except (RequestError, LoRAError) as e:
            return error_response(e.kind, e.message, rid)

    async def load_lora(self, request: web.Request) -> web.Response:
        return await self._lora_call(request, load=True)

    async def unload_lora(self, request: web.Request) -> web.Response:
        return await self._lora_call(request, load=False)

    async def health(self, request: web.Request) -> web.Response:
        roles = {i.beat.role for i in self.router.registry.alive()}
        ok = "both" in roles or {"prefill", "decode"} <= roles
        return web.json_response({"ok": ok, "instances": len(self.router.registry.alive())},
                                 status=200 if ok else 503)
