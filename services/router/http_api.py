"""OpenAI-compatible HTTP API (aiohttp): /v1/chat/completions, /v1/completions, /v1/models, SSE streaming.

Accepts the sampling extensions vLLM does (top_k, seed, ignore_eos, stop_token_ids), so tools written for vLLM
drive kvmesh unchanged. Every response carries ``x-request-id`` and ``traceparent`` (the request's span; a
``traceparent`` the caller sent is honoured, so its trace continues here). ``GET /metrics``: Prometheus.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from kvmesh.engine.sequence import SamplingParams
from services.router.core import Chunk, RequestError, Router, new_request_id
from services.router.telemetry import RequestTrace

HTTP_STATUS = {"invalid": 400, "unauthenticated": 401, "not_found": 404, "overloaded": 429, "unavailable": 503,
               "internal": 500}
ERROR_TYPE = {"invalid": "invalid_request_error", "unauthenticated": "authentication_error",
              "not_found": "not_found_error", "overloaded": "rate_limit_error", "unavailable": "service_unavailable",
              "internal": "internal_error"}


def error_response(kind: str, message: str, request_id: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": ERROR_TYPE[kind], "param": param, "code": HTTP_STATUS[kind]}}
    return web.json_response(body, status=HTTP_STATUS[kind], headers=headers or {"x-request-id": request_id})


def _int(body: dict, name: str, default: int | None) -> int | None:
    v = body.get(name, default)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise RequestError("invalid", f"{name} must be an integer")
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise RequestError("invalid", f"{name} must be a number")
    return float(v)


def sampling_from_body(body: dict) -> SamplingParams:
    if _int(body, "n", 1) != 1:
        raise RequestError("invalid", "only n=1 is supported")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("invalid", "stop must be a string or a list of strings")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise RequestError("invalid", "stop_token_ids must be a list of integers")
    max_tokens = _int(body, "max_completion_tokens", None) or _int(body, "max_tokens", None) or 64
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0),
                              top_k=max(0, _int(body, "top_k", 0) or 0), top_p=_num(body, "top_p", 1.0),
                              seed=_int(body, "seed", None), stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                              ignore_eos=bool(body.get("ignore_eos", False)))
    except ValueError as e:
        raise RequestError("invalid", str(e)) from None


class OpenAIApi:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.app = web.Application(client_max_size=64 * 2**20)
        self.app.add_routes([web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                             web.get("/v1/models", self.models), web.get("/health", self.health),
                             web.get("/metrics", self.metrics)])

    def _authorized(self, request: web.Request) -> bool:
        key = self.router.cfg.api_key
        given = request.headers.get("x-api-key") or request.headers.get("Authorization", "").removeprefix("Bearer ")
        return not key or given.strip() == key

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("invalid", "the request body must be JSON") from None
        if not isinstance(body, dict):
            raise RequestError("invalid", "the request body must be a JSON object")
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        rid = request.headers.get("x-request-id") or new_request_id()
        rt = RequestTrace(self.router.metrics, rid, "http.chat" if chat else "http.completions", request.headers)
        try:
            if not self._authorized(request):
                raise RequestError("unauthenticated", "missing or wrong API key (Authorization: Bearer <key>)")
            with rt.segment("router.tokenize") as span:
                body = await self._body(request)
                params = sampling_from_body(body)
                if chat:
                    messages = body.get("messages")
                    if not isinstance(messages, list):
                        raise RequestError("invalid", "messages must be a list of {role, content} objects")
                    prompt = self.router.prompt_ids(messages=messages)
                else:
                    prompt = self._completion_prompt(body.get("prompt"))
                model = body.get("model") or ""
                self.router.check(model, prompt, params)
                span.set_attribute("kvmesh.tokens.prompt", len(prompt))
            tenant = str(body.get("cache_salt") or body.get("user") or "")
            rt.describe(model or self.router.model_id, tenant, len(prompt))
            stream = self.router.generate(rid, prompt, params, tenant, trace=rt,
                                          policy=request.headers.get("x-kvmesh-policy") or body.get("kvmesh_policy"))
            kind = "chat.completion" if chat else "text_completion"
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._sse(request, rid, kind, stream, include_usage, rt)
            return await self._whole(rid, kind, stream, rt)
        except RequestError as e:
            rt.finish(e.kind, e.message)
            return error_response(e.kind, e.message, rid, headers=rt.headers(rid))
        except (asyncio.CancelledError, ConnectionResetError):
            rt.finish("cancelled", "the client went away")
            raise
        except Exception as e:
            rt.finish("internal", str(e))
            raise
        finally:
            rt.finish()

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return self.router.prompt_ids(text=prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return self._completion_prompt(prompt[0])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return self.router.prompt_ids(token_ids=prompt)
        raise RequestError("invalid", "prompt must be a string or a list of token ids (one prompt per request)")

    def _envelope(self, rid: str, kind: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{rid}", "object": kind,
               "created": int(time.time()), "model": self.router.model_id, "choices": choices}
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

    async def _whole(self, rid: str, kind: str, stream, rt: RequestTrace) -> web.Response:
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
        return web.json_response(self._envelope(rid, kind, [choice], self._usage(last)), headers=rt.headers(rid))

    async def _sse(self, request: web.Request, rid: str, kind: str, stream, include_usage: bool,
                   rt: RequestTrace) -> web.StreamResponse:
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
            await send(self._envelope(rid, chunk_kind, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                         "finish_reason": None}]))
        c: Chunk | None = first
        try:
            while c is not None:
                delta = ({"delta": {"content": c.text}} if chunk_kind == "chat.completion.chunk"
                         else {"text": c.text, "logprobs": None})
                await send(self._envelope(rid, chunk_kind, [{"index": 0, **delta,
                                                             "finish_reason": c.finish_reason or None}]))
                rt.first_token_sent()
                if c.finished:
                    if include_usage:
                        await send(self._envelope(rid, chunk_kind, [], self._usage(c)))
                    break
                c = await it.__anext__()
        except RequestError as e:
            rt.finish(e.kind, e.message)
            await send({"error": {"message": e.message, "type": ERROR_TYPE[e.kind], "code": HTTP_STATUS[e.kind]}})
        await send("[DONE]")
        await resp.write_eof()
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.router.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def models(self, request: web.Request) -> web.Response:
        r = self.router
        return web.json_response({"object": "list", "data": [
            {"id": r.model_id, "object": "model", "created": 0, "owned_by": "kvmesh",
             "max_model_len": r.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        roles = {i.beat.role for i in self.router.registry.alive()}
        ok = "both" in roles or {"prefill", "decode"} <= roles
        return web.json_response({"ok": ok, "instances": len(self.router.registry.alive())},
                                 status=200 if ok else 503)
