"""OpenAI-compatible HTTP API (aiohttp): /v1/chat/completions, /v1/completions, /v1/models, SSE streaming.

Accepts the sampling extensions vLLM does (top_k, seed, ignore_eos, stop_token_ids), so tools written for vLLM
drive kvmesh unchanged; structured output (``response_format``, vLLM's ``guided_*`` / ``structured_outputs``):
services/router/structured.py. Every response carries ``x-request-id`` and ``traceparent`` (the request's span; a
``traceparent`` the caller sent is honoured, so its trace continues here). ``GET /health`` says whether the
router can serve and how many instances it sees, never where they are. Every error, ours or aiohttp's (unknown
path, body too large), is OpenAI's JSON error shape.

``InternalApi`` is the router's other port (``metrics_port``), for the operator's network only: Prometheus
``GET /metrics`` and ``GET /health`` with every instance's id, role, address and load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any, NamedTuple

from aiohttp import web
from aiohttp.typedefs import Handler
from kvmesh.contracts.sessions import check_session_id, session_key

from services.router import openai_body
from services.router.access import RETRY_AFTER_S, AdminKey
from services.router.choices import fan_out
from services.router.core import Chunk, Router
from services.router.errors import ErrorKind, RequestError, invalid
from services.router.intake import Admitted, Call, Draft, Intake, chat_messages, new_request_id, valid_request_id
from services.router.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    joined,
    prompt_logprobs_json,
)
from services.router.reasoning import ThinkSplitter
from services.router.telemetry import RequestTrace
from services.router.tools import ChatOutput, Tools, finish_reason, read_chat

log = logging.getLogger(__name__)


def error_body(status: int, error_type: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(e: RequestError, headers: Mapping[str, str]) -> web.Response:
    """``e`` in OpenAI's error shape, with its status (and ``Retry-After`` when overloaded)."""
    headers = dict(headers)
    if e.kind == ErrorKind.OVERLOADED:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return web.json_response(error_body(e.kind.http, e.kind.error_type, e.message), status=e.kind.http,
                             headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 4xx answers (unknown path, wrong method, ...) in the OpenAI error shape, not as text."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = (f"no route for {request.method} {request.path}; this API serves "
                   "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, "
                   "POST /tokenize, POST /detokenize, "
                   "POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, DELETE /v1/sessions/{session_id} "
                   "(Prometheus /metrics is on the router's internal metrics_port)"
                   if e.status in (404, 405) else e.text or e.reason)
        kept = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
        return web.json_response(error_body(e.status, "invalid_request_error", message), status=e.status,
                                 headers=kept)


async def read_body(request: web.Request) -> dict:
    """The request's JSON object (``openai_body.parse``); a body over ``max_body_bytes`` is TOO_LARGE."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(ErrorKind.TOO_LARGE, f"the request body is over the limit of {request.client_max_size} "
                                                "bytes (max_body_bytes): send a shorter prompt") from None
    return openai_body.parse(raw)


class Answer(NamedTuple):
    """What every chunk of one response repeats: the request id, the object kind and the model it names; and
    whether its choices carry logprobs. ``prompts``: each prompt's token ids (a batch has several; choice i is
    prompt ``i // n``'s) when the body asked for them (``return_token_ids``: then every choice carries its
    ``token_ids`` too), else None."""

    rid: str
    kind: str
    model: str  # the LoRA adapter's name when one was asked for, else the base model's id
    logprobs: bool = False
    prompts: tuple[tuple[int, ...], ...] | None = None
    tools: Tools | None = None  # a chat's offered tools: its text is read for calls (``tools.py``)
    think: bool | None = None   # a chat's reasoning split out (``reasoning.py``): whether it begins inside it
    show_reasoning: bool = True  # include_reasoning
    ids_as_tokens: bool = False  # return_tokens_as_token_ids: logprobs name each token "token_id:<id>"
    echo: Echo | None = None  # a completion's prompts, before each choice's text (and logprobs); a chat's last
    # message (the assistant's), before each choice's content
    prompt_logprobs: bool = False  # each choice (a chat: the response) carries vLLM's prompt_logprobs field


class Echo(NamedTuple):
    """What a completion with ``echo`` repeats of its prompts: each one's text (as sent; its tokens' when it came
    as token ids or was truncated) and token ids; ``only``: the prompt alone (``max_tokens`` 0)."""

    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    only: bool = False


class Body:
    """One completions or chat request's body, read when the intake asks for its fields; what it says about
    the answer (``stream``, ``stream_options``, ``return_token_ids``) is kept for the handler."""

    def __init__(self, request: web.Request, chat: bool) -> None:
        self.request, self.chat = request, chat
        self.shape = openai_body.Shape(False, False, False)
        self.tools: Tools | None = None
        self.drafted: Draft | None = None

    async def draft(self) -> Draft:
        body = await read_body(self.request)
        self.shape = openai_body.shape(body)
        draft = openai_body.draft(body, self.chat, self.request.headers, self.shape)
        self.tools, self.drafted = draft.tools, draft
        return draft

    @property
    def batched(self) -> bool:
        return self.drafted is not None and bool(self.drafted.more)


class OpenAIApi:
    def __init__(self, router: Router, intake: Intake | None = None, admin: AdminKey | None = None) -> None:
        """``intake`` is shared with the gRPC API (the caps count both); by default it, and the ``admin`` key,
        come from the router's settings."""
        self.router = router
        self.intake = intake or Intake(router)
        self.admin = admin or AdminKey.from_config(router.cfg)
        self.app = web.Application(client_max_size=router.cfg.max_body_bytes, middlewares=[json_errors])
        self.app.add_routes([web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                             web.get("/v1/models", self.models), web.get("/health", self.health),
                             web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                             web.post("/v1/load_lora_adapter", self.load_lora),
                             web.post("/v1/unload_lora_adapter", self.unload_lora),
                             web.delete("/v1/sessions/{session_id}", self.close_session)])

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        given = request.headers.get("x-request-id", "")  # a header that is no valid id is replaced, not refused
        call = Call("http.chat" if chat else "http.completions", request.headers,
                    given if valid_request_id(given) else "")
        rt = self.intake.trace(call)
        rid = rt.request_id
        body = Body(request, chat)
        try:
            async with AsyncExitStack() as held:
                requests = await self._admit(call, rt, body, held)
                req, n = requests[0][0], body.shape.n
                answer = Answer(rid, "chat.completion" if chat else "text_completion", req.model,
                                req.sampling.logprobs is not None,
                                tuple(r.prompt for r, _ in requests) if body.shape.token_ids else None,
                                body.tools if body.tools is not None and body.tools.offered else None,
                                self.router.thinking(req.prompt) if chat else None,
                                body.shape.include_reasoning, body.shape.ids_as_tokens,
                                self._echo(body, [r for r, _ in requests], chat) if body.shape.echo else None,
                                body.shape.prompt_logprobs)
                stream = fan_out(self.router, requests, n)
                if body.shape.stream:
                    lens = tuple(len(r.prompt) for r, _ in requests) if body.shape.continuous_usage else None
                    return await self._sse(request, answer, stream, body.shape.include_usage, rt, n, len(requests),
                                           lens)
                return await self._whole(answer, stream, rt, n, len(requests))
        except RequestError as e:
            rt.finish(e.kind, e.message)
            return error_response(e, rt.headers())
        except (asyncio.CancelledError, ConnectionResetError):
            rt.finish(ErrorKind.CANCELLED, "the client went away")
            raise
        except Exception as e:  # a fault of ours, before the response started: logged, answered as JSON
            log.exception("request %s (trace %s) failed", rid, rt.trace_id)
            rt.finish(ErrorKind.INTERNAL, str(e))
            return error_response(RequestError(ErrorKind.INTERNAL, f"internal error; the router's log has request "
                                                                   f"{rid}"), rt.headers())
        finally:
            rt.finish()

    async def _admit(self, call: Call, rt: RequestTrace, body: Body,
                     held: AsyncExitStack) -> list[tuple[Admitted, RequestTrace]]:
        """The request's prompts admitted, each with its trace (a batch's further prompts trace as choices of
        this request); every slot held until ``held`` closes. All or none: a prompt refused refuses the request,
        naming it (``prompt[2]: ...``)."""
        try:
            first = await held.enter_async_context(self.intake.admit(call, rt, body.draft))
        except RequestError as e:
            raise _of_prompt(e, 0) if body.batched else e from None
        out = [(first, rt)]
        if body.drafted is not None and body.drafted.more:
            for j, draft in enumerate(body.drafted.batch()[1:], 1):
                trace = rt.choice(j * body.shape.n, prompt=True)
                try:
                    out.append((await held.enter_async_context(self.intake.admit(call, trace, _ready(draft))),
                                trace))
                except RequestError as e:
                    raise _of_prompt(e, j) from None
        return out

    def _echo(self, body: Body, requests: list[Admitted], chat: bool) -> Echo | None:
        """A completion's prompts as its echo repeats them; a chat's last message when it is the assistant's (the
        turn the answer continues: vLLM's rule), else nothing to echo."""
        if chat:
            last = chat_messages(body.drafted.messages)[-1] if body.drafted is not None else {}
            return Echo((last["content"],), ()) if last.get("role") == "assistant" and last["content"] else None
        drafts = body.drafted.batch() if body.drafted is not None else []
        texts = tuple(d.text if d.text is not None and not d.truncate else self.router.tokenizer.decode(list(r.prompt))
                      for d, r in zip(drafts, requests, strict=True))
        return Echo(texts, tuple(r.prompt for r in requests), body.shape.echo_only)

    @staticmethod
    def _envelope(answer: Answer, kind: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{answer.rid}", "object": kind,
               "created": int(time.time()), "model": answer.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    @staticmethod
    def _usage(finished: list[Chunk], n: int = 1) -> dict:
        """The request's usage from its choices' last chunks (``n`` a prompt): each prompt once (and what of it
        its first choice found cached), the completions' tokens together."""
        usages = [c.usage for c in finished]
        assert any(u is not None for u in usages)
        firsts = [u for u in usages[::n] if u is not None]
        prompt, completion = sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in usages if u)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in firsts)}}

    def _logprobs(self, answer: Answer, chunks: list[Chunk], offset: int = 0,
                  prompt: int | None = None) -> dict | None:
        """The choice's (or a streamed chunk's) ``logprobs`` in the endpoint's shape; None when not asked for.
        ``offset``: where ``chunks``' text starts in the completion; ``prompt``: the echoed prompt whose tokens'
        come first (``chunks`` are then the choice's first: the first of them carries the prompt's)."""
        if not answer.logprobs:
            return None
        text = self._token_text(answer)
        if answer.kind == "chat.completion":
            return chat_logprobs([lp for c in chunks for lp in c.logprobs], text)
        if answer.echo is None or prompt is None:
            return completion_logprobs([(c.logprobs, c.text) for c in chunks], text, offset)
        head = echoed_logprobs(answer.echo.ids[prompt], chunks[0].prompt_logprobs if chunks else (), text)
        if answer.echo.only:
            return head
        return joined(head, completion_logprobs([(c.logprobs, c.text) for c in chunks], text,
                                                len(answer.echo.texts[prompt])))

    def _token_text(self, answer: Answer) -> Callable[[int], str]:
        return token_id_text if answer.ids_as_tokens else self.router.tokenizer.token_text

    def _echoed(self, answer: Answer, prompt: int, text: str) -> str:
        """A completion choice's text as the client gets it: its prompt's first when echoed (alone, ``echo.only``)."""
        if answer.echo is None:
            return text
        return answer.echo.texts[prompt] + ("" if answer.echo.only else text)

    async def _whole(self, answer: Answer, stream: AsyncIterator[tuple[int, Chunk]], rt: RequestTrace,
                     n: int = 1, prompts: int = 1) -> web.Response:
        kind = answer.kind
        chunks: list[list[Chunk]] = [[] for _ in range(n * prompts)]
        async for i, c in stream:
            rt.first_token_sent()  # not streaming: TTFT ends when the first token is in hand
            chunks[i].append(c)
        choices = [self._choice(answer, i, cs, i // n) for i, cs in enumerate(chunks)]
        out = self._envelope(answer, kind, choices, self._usage([cs[-1] for cs in chunks], n))
        if answer.prompt_logprobs and kind == "chat.completion":  # vLLM's place: the response's (one prompt)
            out["prompt_logprobs"] = prompt_logprobs_json(chunks[0][0].prompt_logprobs, self._token_text(answer))
        if answer.prompts is not None:  # vLLM's places: a chat's prompt ids on the response, a completion's choice
            for i, (choice, cs) in enumerate(zip(choices, chunks, strict=True)):
                choice["token_ids"] = [t for c in cs for t in c.token_ids]
                (out if kind == "chat.completion" else choice)["prompt_token_ids"] = list(answer.prompts[i // n])
        return web.Response(body=openai_body.json_bytes(out), content_type="application/json", headers=rt.headers())

    def _choice(self, answer: Answer, index: int, chunks: list[Chunk], prompt: int = 0) -> dict[str, Any]:
        """One whole choice from its chunks (the last finished it), of prompt ``prompt`` (a batch's)."""
        assert chunks
        content, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason or "stop"
        choice: dict[str, Any] = ({"index": index, "message": {"role": "assistant", "content": content}}
                                  if answer.kind == "chat.completion"
                                  else {"index": index, "text": self._echoed(answer, prompt, content)})
        if answer.tools is not None or answer.think is not None:
            read = read_chat(content, reason, answer.tools, self.router.tool_format, answer.think)
            message: dict[str, Any] = {"role": "assistant", "content": read.content}
            if read.calls:
                message["tool_calls"] = read.calls
            if read.reasoning is not None and answer.show_reasoning:
                message["reasoning"] = read.reasoning
            choice["message"], reason = message, read.finish_reason
        if answer.echo is not None and answer.kind == "chat.completion":  # the continued message, whole
            choice["message"]["content"] = answer.echo.texts[0] + (choice["message"]["content"] or "")
        choice["logprobs"] = self._logprobs(answer, chunks, prompt=prompt)
        choice["finish_reason"] = reason
        if answer.prompt_logprobs and answer.kind != "chat.completion":  # vLLM's place: each completion choice's
            choice["prompt_logprobs"] = prompt_logprobs_json(chunks[0].prompt_logprobs, self._token_text(answer))
        return choice

    async def _sse(self, request: web.Request, answer: Answer, stream: AsyncIterator[tuple[int, Chunk]],
                   include_usage: bool, rt: RequestTrace, n: int = 1, prompts: int = 1,
                   continuous: tuple[int, ...] | None = None) -> web.StreamResponse:
        """``continuous``: each prompt's length, when every chunk carries its choice's usage so far (vLLM's
        ``stream_options.continuous_usage_stats``)."""
        rid, kind = answer.rid, answer.kind
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        # pull the first chunk before answering, so an error still becomes a proper HTTP status
        it = stream.__aiter__()
        first = await it.__anext__()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **rt.headers()})
        await resp.prepare(request)

        async def send(obj: dict | str) -> None:
            await resp.write(b"".join((b"data: ", obj.encode() if isinstance(obj, str) else openai_body.json_bytes(obj),
                                       b"\n\n")))

        # return_token_ids (vLLM's shape): the prompt's ids once, in the first chunk (a chat's on the chunk, a
        # completion's on its choice), and each chunk's own token ids on its choice
        # (a batch: each prompt's ids on the first chunk of its choices)
        due = {} if answer.prompts is None else {j: {"prompt_token_ids": list(p)} for j, p in enumerate(answer.prompts)}
        generated = [0] * (n * prompts)  # each choice's tokens so far (continuous usage)

        def usage(i: int) -> dict[str, Any] | None:
            if continuous is None:
                return None
            p = continuous[i // n]
            return {"prompt_tokens": p, "completion_tokens": generated[i], "total_tokens": p + generated[i]}

        if chunk_kind == "chat.completion.chunk":
            await send(self._envelope(answer, chunk_kind, [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)], usage(0)) | due.pop(0, {}))
            if answer.echo is not None:  # the message the answer continues, first (vLLM's chunk)
                await send(self._envelope(answer, chunk_kind, [
                    {"index": i, "delta": {"content": answer.echo.texts[0]}, "logprobs": None, "finish_reason": None}
                    for i in range(n)]))
        item: tuple[int, Chunk] | None = first
        total = n * prompts
        sent = [0] * total  # characters of each choice's text streamed so far: where its next chunk's tokens start
        read = answer.tools is not None or answer.think is not None  # a chat's text read: reasoning, calls
        outputs = [ChatOutput(answer.tools.reader(self.router.tool_format) if answer.tools is not None else None,
                              ThinkSplitter(answer.think) if answer.think is not None else None)
                   for _ in range(total)] if read else None
        last: dict[int, Chunk] = {}
        opened: set[int] = set()  # choices whose echoed prompt went out
        try:
            while item is not None:
                i, c = item
                delta: dict[str, Any]
                out = outputs[i] if outputs is not None else None
                if out is not None:
                    delta = {"delta": chat_delta(out, c.text, c.finished, answer.show_reasoning)}
                elif chunk_kind == "chat.completion.chunk":
                    delta = {"delta": {"content": c.text}}
                else:
                    delta = {"text": c.text}
                if answer.echo is not None and answer.kind != "chat.completion" and i not in opened:
                    # the echoed prompt first, with its logprobs
                    opened.add(i)
                    delta = {"text": self._echoed(answer, i // n, c.text)}
                    logprobs = self._logprobs(answer, [c], prompt=i // n)
                    sent[i] = len(answer.echo.texts[i // n])  # where the completion's text starts
                else:
                    logprobs = self._logprobs(answer, [c], sent[i])
                reason = c.finish_reason or None
                choice: dict[str, Any] = {"index": i, **delta, "logprobs": logprobs,
                          "finish_reason": finish_reason(reason, out.called) if out and reason else reason}
                if answer.prompts is not None:
                    choice |= due.pop(i // n, {}) | {"token_ids": list(c.token_ids)}
                generated[i] += len(c.token_ids)
                await send(self._envelope(answer, chunk_kind, [choice], usage(i)))
                sent[i] += len(c.text)
                rt.first_token_sent()
                if c.finished:
                    last[i] = c
                item = await anext(it, None)
            if include_usage:
                await send(self._envelope(answer, chunk_kind, [], self._usage([last[i] for i in sorted(last)], n)))
        except RequestError as e:
            rt.finish(e.kind, e.message)
            await send({"error": {"message": e.message, "type": e.kind.error_type, "code": e.kind.http}})
        except ConnectionResetError:
            raise
        except Exception as e:  # a fault of ours mid-stream: the client still gets an error event and [DONE]
            log.exception("request %s (trace %s) failed mid-stream", rid, rt.trace_id)
            rt.finish(ErrorKind.INTERNAL, str(e))
            internal = ErrorKind.INTERNAL
            await send({"error": {"message": f"internal error; the router's log has request {rid}",
                                  "type": internal.error_type, "code": internal.http}})
        await send("[DONE]")
        await resp.write_eof()
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: a completions ``prompt`` (text) or a chat's ``messages`` (with ``tools``,
        ``add_generation_prompt``) as the token ids a request would send: ``{count, max_model_len, tokens}``, and
        ``token_strs`` with ``return_token_strs``. A text's special tokens as the tokenizer adds them unless
        ``add_special_tokens`` is false."""
        rid = new_request_id()
        try:
            self.intake.tenants.authenticate(request.headers)
            body = await read_body(request)
            chat = "messages" in body
            if not chat and not isinstance(body.get("prompt"), str):
                raise invalid("tokenize takes a prompt (a string) or messages (a chat)")
            draft = openai_body.draft(body, chat, request.headers)
            ids = await self.intake.token_ids(draft, openai_body.bool_field(body, "add_generation_prompt", True),
                                              openai_body.bool_field(body, "add_special_tokens", not chat))
            strs = openai_body.bool_field(body, "return_token_strs")
        except RequestError as e:
            return error_response(e, {"x-request-id": rid})
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.router.max_model_len, "tokens": ids}
        if strs:
            out["token_strs"] = [self.router.tokenizer.token_text(t) for t in ids]
        return web.json_response(out, headers={"x-request-id": rid})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /detokenize``: ``{"tokens": [...]}`` as text, ``{"prompt": ...}``."""
        rid = new_request_id()
        try:
            self.intake.tenants.authenticate(request.headers)
            tokens = (await read_body(request)).get("tokens")
            vocab = self.router.source.config.vocab_size
            if (not isinstance(tokens, list) or set(map(type, tokens)) - {int}
                    or tokens and (min(tokens) < 0 or max(tokens) >= vocab)):
                raise invalid(f"tokens must be a list of token ids, integers in [0, {vocab})")
        except RequestError as e:
            return error_response(e, {"x-request-id": rid})
        return web.json_response({"prompt": self.router.tokenizer.decode(tokens)}, headers={"x-request-id": rid})

    async def models(self, request: web.Request) -> web.Response:
        try:
            self.intake.tenants.authenticate(request.headers)
        except RequestError as e:
            return error_response(e, {"x-request-id": new_request_id()})
        r = self.router
        base = {"id": r.model_id, "object": "model", "created": 0, "owned_by": "kvmesh", "root": r.model_id,
                "parent": None, "max_model_len": r.max_model_len}
        loras = [{**base, "id": name, "root": path, "parent": r.model_id}
                 for name, (_, path) in r.loras.served().items()]
        return web.json_response({"object": "list", "data": [base, *loras]})

    async def close_session(self, request: web.Request) -> web.Response:
        """``DELETE /v1/sessions/{session_id}``: the caller's session is over; every cache lets what it holds go
        first. Only the caller's tenant's session of that id: another tenant's is another session."""
        rid = new_request_id()
        try:
            tenant = self.intake.tenants.authenticate(request.headers)
            session_id = request.match_info["session_id"]
            try:
                check_session_id(session_id)
            except ValueError as e:
                raise invalid(str(e)) from None
            await self.router.sessions.close(session_key(tenant, session_id))
        except RequestError as e:
            return error_response(e, {"x-request-id": rid})
        return web.json_response({"id": session_id, "object": "session", "closed": True},
                                 headers={"x-request-id": rid})

    async def _admin(self, request: web.Request, operation: Callable[[dict], Awaitable[str]]) -> web.Response:
        """An admin operation (vLLM's runtime LoRA API): the admin key first, the body only then, so a caller
        without the key gets the same answer whatever the body names. 200 with a plain-text "Success: ..." or
        an OpenAI JSON error."""
        try:
            self.admin.authorize(request.headers)
            return web.Response(text=await operation(await read_body(request)))
        except RequestError as e:
            return error_response(e, {"x-request-id": new_request_id()})

    async def _load(self, body: dict) -> str:
        name = openai_body.str_field(body, "lora_name")
        if not name:
            raise invalid("lora_name is required")
        path = openai_body.str_field(body, "lora_path")
        if not path:
            raise invalid("lora_path is required: a PEFT adapter directory under the router's lora_root")
        await self.router.loras.load(name, path, inplace=openai_body.bool_field(body, "load_inplace"))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _unload(self, body: dict) -> str:
        name = openai_body.str_field(body, "lora_name")
        if not name:
            raise invalid("lora_name is required")
        await self.router.loras.unload(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def load_lora(self, request: web.Request) -> web.Response:
        return await self._admin(request, self._load)

    async def unload_lora(self, request: web.Request) -> web.Response:
        return await self._admin(request, self._unload)

    async def health(self, request: web.Request) -> web.Response:
        roles = {i.beat.role for i in self.router.registry.alive()}
        ok = "both" in roles or {"prefill", "decode"} <= roles
        return web.json_response({"ok": ok, "instances": len(self.router.registry.alive())},
                                 status=200 if ok else 503)


class InternalApi:
    """The router's internal port: what an operator's tools read and a client must not (the instances'
    addresses, the counters). No keys: the port is kept off the clients' network (compose publishes only the
    public ports; in Kubernetes a NetworkPolicy admits the monitoring namespace alone)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.app = web.Application()
        self.app.add_routes([web.get("/metrics", self.metrics), web.get("/health", self.health)])

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.router.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        alive = self.router.registry.alive()
        roles = {i.beat.role for i in alive}
        ok = "both" in roles or {"prefill", "decode"} <= roles
        return web.json_response({"ok": ok, "instances": [
            {"instance_id": i.id, "role": i.beat.role, "grpc_address": i.beat.grpc_address,
             "age_s": round(now - i.last_seen, 3), "load": i.beat.load.to_dict()} for i in alive]},
            status=200 if ok else 503)


def token_id_text(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` name of a token, unambiguous where its text is not."""
    return f"token_id:{token_id}"


def _ready(draft: Draft) -> Callable[[], Awaitable[Draft]]:
    """The intake's ``read`` of a draft already read (a batch's further prompt)."""
    async def read() -> Draft:
        return draft
    return read


def _of_prompt(e: RequestError, j: int) -> RequestError:
    """A batch's prompt ``j``'s refusal, naming it."""
    return RequestError(e.kind, f"prompt[{j}]: {e.message}", e.instance, e.retryable)


def chat_delta(out: ChatOutput, text: str, last: bool, show: bool) -> dict[str, Any]:
    """A chat chunk's ``delta`` when its text is read (reasoning split out, tools offered): the reasoning (left
    out when the request said ``include_reasoning: false``), the content let through, the calls completed."""
    thought, said, calls = out.feed(text, last)
    delta: dict[str, Any] = {"reasoning": thought} if thought and show else {}
    if said or not calls:
        delta["content"] = said
    if calls:
        delta["tool_calls"] = [d.wire() for d in calls]
    return delta
