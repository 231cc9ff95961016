"""Structured output on xgrammar: compiled grammars (one per distinct spec), a matcher per constrained sequence,
and the token mask of one sampling step, built for all the constrained rows of the batch at once.

Where it sits in a step: ``LLMEngine.step`` asks ``Grammars.mask`` for the rows being sampled; ``sample`` applies
it (disallowed logits become -inf) after its finiteness check and before greedy/top-k/top-p; ``_append`` advances
the sequence's matcher with the token it got. A sequence whose first token was sampled elsewhere (the prefill
instance) gets a fresh matcher that accepts that token like any other: schema + tokens so far is the whole state.

xgrammar is imported lazily (it loads torch and takes a second or two): engines that never see a constrained
request never load it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvmesh.contracts.sampling import StructuredOutput

if TYPE_CHECKING:
    from kvmesh.model_source.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is tens to hundreds of KB)


class GrammarError(ValueError):
    """The spec does not compile: the client's fault (400 / INVALID_ARGUMENT), with xgrammar's reason."""


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]) -> Any:
    """xgrammar's view of ``tokenizer`` (a ``tokenizers`` tokenizer.json, no transformers): the vocabulary as
    its stored strings by id, padded to the model's ``vocab_size``, with the vocabulary type (byte-level,
    byte-fallback, raw) and prefix-space rule xgrammar reads from the tokenizer.json itself."""
    import xgrammar as xg

    raw = tokenizer._tok
    encoded = [""] * vocab_size
    for token, idx in raw.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xg.TokenizerInfo._detect_metadata_from_hf(raw.to_str())
    return xg.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stop_ids,
                            add_prefix_space=meta["add_prefix_space"])


def choice_grammar(options: list[str]) -> str:
    """EBNF for exactly one of ``options`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


JSON_KINDS = ("json_schema", "json_object")


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, json: bool = False) -> None:
        self.matcher = matcher
        self.json = json  # JSON text: never a raw control character (see Grammars.json_safe)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not fit the output's grammar")

    @property
    def terminated(self) -> bool:
        """The output is complete (the grammar reached its end and accepted a stop token)."""
        return self.matcher.is_terminated()


class Grammars:
    """An engine's compiler and compiled-grammar cache. Thread-safe: a service may compile off the engine
    thread (``compile``) so the engine thread only finds it cached."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int], cache_size: int = CACHE_SIZE,
                 threads: int = 2) -> None:
        import xgrammar as xg

        self._xg = xg
        self.vocab_size = vocab_size
        info = tokenizer_info(tokenizer, vocab_size, stop_ids)
        self.compiler = xg.GrammarCompiler(info, max_threads=threads,
                                           cache_enabled=False)  # our cache, keyed by the canonical spec
        # xgrammar 0.2.9 lets a string with minLength/maxLength hold raw control characters, which JSON forbids
        # (json.loads refuses them): JSON rows are also masked with this, which drops every token holding a
        # byte below 0x20 (with compact separators JSON text has no such byte anywhere)
        stop = set(stop_ids)
        self.json_safe = pack_bitmask([t in stop or not any(b < 0x20 for b in raw)
                                       for t, raw in enumerate(info.decoded_vocab[:vocab_size])], vocab_size)
        self.batch = xg.BatchGrammarMatcher(max_threads=threads)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0          # cache misses
        self.compile_s = 0.0       # time spent compiling

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec``, from the cache when the same spec (canonically) was seen.
        Raises GrammarError naming the problem."""
        try:
            key = spec.key
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        t0 = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own kinds
            raise GrammarError(f"{spec.kind} does not compile: {_reason(e)}") from None
        with self._lock:
            self.compiles += 1
            self.compile_s += time.perf_counter() - t0
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> Any:
        c = self.compiler
        if spec.kind == "json_schema":
            # compact separators, no free whitespace: a small model given free whitespace may spend its
            # whole budget on newlines
            return c.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            return c.compile_grammar(choice_grammar(spec.options))
        return c.compile_grammar(spec.spec)

    def start(self, spec: StructuredOutput) -> GrammarState:
        return GrammarState(self._xg.GrammarMatcher(self.compile(spec)), spec.kind in JSON_KINDS)

    def mask(self, states: list[GrammarState | None]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """For the rows of a sampling batch (None: unconstrained), the function that masks their logits
        ``[rows, vocab]``: one bitmask for the constrained rows, filled in one batched call, unpacked and applied
        on the logits' device. None when no row is constrained."""
        constrained = [(i, s) for i, s in enumerate(states) if s is not None]
        if not constrained:
            return None
        rows = [i for i, _ in constrained]
        bitmask = self._xg.allocate_token_bitmask(len(rows), self.vocab_size)
        self.batch.batch_fill_next_token_bitmask([s.matcher for _, s in constrained], bitmask)
        if json_rows := [j for j, (_, s) in enumerate(constrained) if s.json]:
            bitmask[json_rows] &= self.json_safe

        def apply(logits: torch.Tensor) -> torch.Tensor:
            allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
            index = torch.tensor(rows, device=logits.device)
            return logits.index_copy(0, index, logits[index].masked_fill(~allowed, float("-inf")))

        return apply


def pack_bitmask(allowed: list[bool], vocab: int) -> torch.Tensor:
    """``allowed`` per token id (missing ids: disallowed) as one row of xgrammar's int32 bitmask words."""
    words = -(-vocab // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:len(allowed)] = torch.tensor(allowed, dtype=torch.int64)
    packed = (bits.reshape(words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's int32 bitmask ``[n, ceil(vocab/32)]`` (bit j of word w: token 32w + j allowed) as bools
    ``[n, vocab]``; tokens past the bitmask (padded vocabulary) are disallowed."""
    if bitmask.device not in _SHIFTS:
        _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> _SHIFTS[bitmask.device]) & 1
    allowed = bits.bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(bitmask.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def _reason(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[09:57:41] /project/cpp/regex_converter.cc:94: ")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip()) or type(e).__name__
    return text.splitlines()[0] if len(text) > 500 else text
