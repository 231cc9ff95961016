"""Per-token log-probabilities in OpenAI's two response shapes, each token named by its text in the router's
tokenizer (``Tokenizer.token_text``, as vLLM names them).

- ``/v1/completions`` (``"logprobs": N``, the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, one entry per generated token; each ``top_logprobs`` entry maps the N most likely tokens'
  texts to their logprobs, plus the sampled token when it is not among them (so up to N + 1 entries, as OpenAI
  documents); ``text_offset`` is where each token starts in the completion's text.
- An echoed prompt (``/v1/completions`` with ``echo``): its tokens' entries first in the legacy shape, the first
  token's logprob and alternatives null, offsets from the prompt's start; the completion's follow from where the
  prompt's text ends.
- vLLM's ``prompt_logprobs``: ``[null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]``.
- ``/v1/chat/completions`` (``"logprobs": true, "top_logprobs": N``): ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}], "refusal": null}``, the N most likely first.

A logprob below ``LOGPROB_FLOOR`` (-inf in the model) is written as it: JSON has no infinity (OpenAI's and
vLLM's convention)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvmesh.contracts.engine import TokenLogprobs

LOGPROB_FLOOR = -9999.0
TokenText = Callable[[int], str]  # a token id's text (``Tokenizer.token_text``)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(pieces: Iterable[tuple[Iterable[TokenLogprobs], str]], text: TokenText,
                        offset: int = 0) -> dict[str, Any]:
    """The legacy shape of a stream's pieces, each its tokens' logprobs and the text it added, from character
    ``offset`` of the completion on: a piece's first token starts where the text before the piece ends, each
    next one where the token before it ends (so streamed and whole answers agree)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entries, added in pieces:
        at = offset
        for lp in entries:
            token = text(lp.token_id)
            top = {text(t): _lp(v) for t, v in lp.top}
            top.setdefault(token, _lp(lp.logprob))
            out["tokens"].append(token)
            out["token_logprobs"].append(_lp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(at)
            at += len(token)
        offset += len(added)
    return out


def _chat_token(token_id: int, logprob: float, text: TokenText) -> dict[str, Any]:
    token = text(token_id)
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: Iterable[TokenLogprobs], text: TokenText) -> dict[str, Any]:
    """The chat shape, one ``content`` entry per token."""
    return {"content": [{**_chat_token(lp.token_id, lp.logprob, text),
                         "top_logprobs": [_chat_token(t, v, text) for t, v in lp.top]} for lp in entries],
            "refusal": None}


def echoed_logprobs(prompt: Sequence[int], scored: Sequence[TokenLogprobs], text: TokenText) -> dict[str, Any]:
    """The legacy shape of an echoed prompt's tokens (``echo`` with ``logprobs``), before the completion's: the
    first token has no logprob and no alternatives (null, as OpenAI and vLLM write it), each next one its
    ``scored`` entry; ``text_offset`` from 0, each token starting where the one before it ends."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    at = 0
    for i, token_id in enumerate(prompt):
        token = text(token_id)
        lp = scored[i - 1] if 0 < i <= len(scored) else None
        out["tokens"].append(token)
        out["token_logprobs"].append(None if lp is None else _lp(lp.logprob))
        if lp is None:
            out["top_logprobs"].append(None)
        else:
            top = {text(t): _lp(v) for t, v in lp.top}
            top.setdefault(token, _lp(lp.logprob))
            out["top_logprobs"].append(top)
        out["text_offset"].append(at)
        at += len(token)
    return out


def joined(first: dict[str, list[Any]], then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Two legacy-shape logprobs one after the other (an echoed prompt's, then the completion's)."""
    return {k: first[k] + then[k] for k in first}


def prompt_logprobs_json(scored: Sequence[TokenLogprobs], text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` field: null for the first prompt token, then per token ``{"<token id>":
    {"logprob", "rank", "decoded_token"}}`` for the token itself and the most likely ones there (each once)."""
    out: list[dict[str, Any] | None] = [None]
    for lp in scored:
        entry = {str(lp.token_id): {"logprob": _lp(lp.logprob), "rank": lp.rank or None,
                                    "decoded_token": text(lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top, 1):
            entry.setdefault(str(t), {"logprob": _lp(v), "rank": rank, "decoded_token": text(t)})
        out.append(entry)
    return out
