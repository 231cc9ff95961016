"""A kvmesh request as vLLM takes it, and vLLM's outputs and errors as kvmesh's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.contracts.engine import EngineOutput, SessionHint, TokenLogprobs
from kvmesh.contracts.sampling import SamplingParams

SESSION_ACTION = "kvmesh.session"  # the KV-hint action a kvmesh request's session travels in, version "1"


def kv_hints(request_id: str, session: SessionHint | None) -> Any:
    """The request's session as vLLM 0.32 carries an orchestrator's hints (``KvHintsEnvelope``: whatever KV
    offload or connector reads ``Request.kv_hints`` sees it): one ``kvmesh.session`` action naming the session,
    the sub-agent's parent and whether this is its last request. None for a request without a session."""
    if session is None:
        return None
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    payload = {"session_id": session.key, "parent_session_id": session.parent, "session_end": session.end}
    return KvHintsEnvelope(protocol_version="1", message_id=request_id,
                           actions=[KvHintAction(f"{request_id}/session", SESSION_ACTION, "1", payload)])


def sampling_params(p: SamplingParams, transfer: dict[str, Any] | None = None, earlier: Sequence[int] = ()) -> Any:
    """vLLM's ``SamplingParams`` for kvmesh's: one output per request, streamed as deltas; ``transfer``: what the
    KV connector reads of the request (``kv_transfer_params``); ``earlier``: a continued stream's output before
    this instance, which the penalties count (``penalties.py``). ValueError naming the field when vLLM refuses a
    value."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    from kvmesh.vllm.penalties import EARLIER

    structured = None
    if p.structured is not None:
        s = p.structured
        if s.kind == "json_schema":
            structured = StructuredOutputsParams(json=s.spec)
        elif s.kind == "regex":
            structured = StructuredOutputsParams(regex=s.spec)
        elif s.kind == "grammar":
            structured = StructuredOutputsParams(grammar=s.spec)
        elif s.kind == "choice":
            structured = StructuredOutputsParams(choice=s.options)
        else:
            structured = StructuredOutputsParams(json_object=True)
    try:
        return VSamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                               seed=p.seed, stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids),
                               ignore_eos=p.ignore_eos, logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
                               structured_outputs=structured,
                               presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                               repetition_penalty=p.repetition_penalty, min_p=p.min_p, min_tokens=p.min_tokens,
                               logit_bias=dict(p.logit_bias) or None, skip_special_tokens=p.skip_special_tokens,
                               output_kind=RequestOutputKind.DELTA,
                               extra_args={**({"kv_transfer_params": transfer} if transfer else {}),
                                           **({EARLIER: list(earlier)} if earlier else {})} or None)
    except Exception as e:  # noqa: BLE001 - VLLMValidationError and plain ValueErrors: the request is at fault
        raise ValueError(f"sampling: {e}") from None


def client_fault(e: BaseException) -> bool:
    """Whether vLLM blames the request (its 4xx errors, or a ValueError it raised while checking it)."""
    from vllm.exceptions import VLLMClientError

    return isinstance(e, VLLMClientError | ValueError | TypeError)


def output(out: Any, first: bool, top_n: int | None, prompt_n: int | None = None) -> EngineOutput:
    """One ``RequestOutput`` (delta mode) as the seam's output; ``first``: its first, which says what was cached;
    ``top_n`` / ``prompt_n``: the logprobs / prompt logprobs the request asked for (vLLM hands the prompt's over
    whole with the first token, their first entry None: the first prompt token has none)."""
    c = out.outputs[0]
    prompt: tuple[TokenLogprobs, ...] = ()
    if prompt_n is not None and out.prompt_logprobs:
        prompt = logprobs(out.prompt_token_ids[1:], out.prompt_logprobs[1:], prompt_n, ranked=True)
    return EngineOutput(out.request_id, tuple(c.token_ids), c.text or "", bool(out.finished),
                        c.finish_reason if out.finished else None,
                        (out.num_cached_tokens or 0) if first else 0, None,
                        logprobs(c.token_ids, c.logprobs, top_n or 0) if top_n is not None else (), prompt)


def logprobs(token_ids: Any, per_token: Any, top_n: int, ranked: bool = False) -> tuple[TokenLogprobs, ...]:
    """vLLM's per-token ``{token id: Logprob}`` (the ``top_n`` most likely by rank, and the sampled or prompt
    token) as kvmesh's; ``ranked``: with the token's rank (a prompt's)."""
    out = []
    for tok, entries in zip(token_ids, per_token or ()):
        order = sorted((e.rank, tid, e.logprob) for tid, e in entries.items() if e.rank is not None)
        top = tuple((int(tid), float(lp)) for rank, tid, lp in order if rank <= top_n)
        own = entries[tok]
        out.append(TokenLogprobs(int(tok), float(own.logprob), top, int(own.rank or 0) if ranked else 0))
    return tuple(out)
