"""Shared builders for engine unit tests: a tiny random Llama as both a transformers model and our engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from kvmesh.contracts.engine import EngineRequest, ImportedKV, KVPart, TokenLogprobs
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine import native
from kvmesh.engine.kv_cache import KVPiece, Landed, block_bytes
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.model_source.hf_config import ModelConfig
from kvmesh.settings import EngineSettings


def needs_kernel(lib: object, source: Path) -> pytest.MarkDecorator:
    """Skip unless the C kernel built from ``source`` loaded (``lib``), saying why not: no compiler, a build
    error. The engine itself then runs the torch path, which the other tests cover."""
    why = native.UNAVAILABLE.get(source.name, "switched off")
    return pytest.mark.skipif(lib is None, reason=f"the native kernel {source.name} is unavailable here: {why}")


# the attention backends an engine test runs on: torch everywhere, the C decode kernel where it builds
BACKENDS = ["torch", pytest.param("native", marks=needs_kernel(native.load(), native.SOURCE))]


def hf_tiny(cfg: ModelConfig, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_cfg = AutoConfig.for_model(**cfg.to_hf())
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model


def engine_from_hf(hf_model, cfg: ModelConfig, **engine_kwargs) -> LLMEngine:
    settings = {"num_blocks": 64, "block_size": 4, "max_batched_tokens": 256}
    settings.update(engine_kwargs)
    engine = LLMEngine(EngineSettings(**settings), model_config=cfg)
    engine.model.load_hf_weights(hf_model.state_dict())
    return engine


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def req(request_id: str, prompt: Sequence[int], params: SamplingParams, cache_salt: str = "",
        **fields: Any) -> EngineRequest:
    """The request ``LLMEngine.add_request`` takes, from a prompt as a list (``fields``: the rest of
    ``EngineRequest``'s)."""
    return EngineRequest(request_id, tuple(prompt), params, cache_salt, **fields)


def pushed(layout: KVLayout, blocks: torch.Tensor | list[torch.Tensor] | list[KVPiece] | Landed, num_tokens: int,
           first_token: int, first_block: int = 0, first_logprobs: TokenLogprobs | None = None) -> ImportedKV:
    """KV read out of one engine as another receives it pushed: ``blocks`` (whole blocks from ``first_block``
    on, such tensors one after another, ``KVPiece`` s that place themselves, or ``Landed``: already in the blocks
    reserved under its lease) as the push's parts, over their bytes."""
    landed = blocks if isinstance(blocks, Landed) else None
    pieces = landed.pieces if landed is not None else blocks if isinstance(blocks, list) else [blocks]
    parts, at = [], first_block
    for piece in pieces:
        if not isinstance(piece, KVPiece):
            piece = KVPiece(at, piece)
            at += int(piece.data.shape[0])
        parts.append(KVPart(piece.first_block, int(piece.data.shape[0]), piece.layers, block_bytes(piece.data)))
    return ImportedKV(layout, num_tokens, first_token, first_block, tuple(parts),
                      landed.lease if landed is not None else None, first_logprobs)


class NanLogits:
    """A logits hook (``LLMEngine(logits_hook=...)``): the rows of the requests in ``ids`` go nan right after the
    forward pass, as a model going nan would. Through a router an engine knows a request by its dispatch id
    (``<tenant hash>.<client id>.<nonce>``): a client's id matches that too."""

    def __init__(self, *ids: str) -> None:
        self.ids = set(ids)

    def __call__(self, request_ids: list[str], logits: torch.Tensor) -> torch.Tensor:
        rows = [i for i, rid in enumerate(request_ids)
                if rid in self.ids or any(f".{client}." in rid for client in self.ids)]
        if not rows:
            return logits
        return logits.index_fill(0, torch.tensor(rows, device=logits.device), float("nan"))


def prompt_logits(engine: LLMEngine, prompt: list[int], cache_salt: str = "") -> tuple[torch.Tensor, int]:
    """Logits of the first sampled position of ``prompt`` and the number of prompt tokens served from cache."""
    rid = f"logits-{len(engine._requests)}-{id(prompt)}"
    seq = engine.add_request(req(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt))
    while True:
        failed = [o.error for o in engine.step().outputs if o.request_id == rid and o.error is not None]
        assert not failed, f"the request failed: {failed[0]}"
        ids, logits = engine.last_logits
        if rid in ids:
            row = logits[ids.index(rid)].clone()
            break
    engine.completion(rid)
    return row, seq.num_cached_tokens


def run(engine: LLMEngine, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Add ``reqs`` (request id, prompt, params) and step until nothing is left: each finished request's
    ``Completion`` by id."""
    for rid, prompt, params in reqs:
        engine.add_request(req(rid, prompt, params))
    done = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = engine.completion(out.request_id)
    return done
