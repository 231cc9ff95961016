"""Conversions between protocol messages and the engine's types, with the validation a bad request needs."""

from __future__ import annotations

from dataclasses import asdict

from kvmesh.engine.kv_cache import KVLayout
from kvmesh.engine.sequence import SamplingParams
from kvmesh.proto.v1 import common_pb2

DEFAULT_MAX_TOKENS = 64
# the smallest positive float32: a legal top_p below it must not round to 0, which the wire reads as "off" (1.0)
F32_TINY = 1.401298464324817e-45


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError with a message naming the bad field."""
    return SamplingParams(
        max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p or 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
    )


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k,
                                    top_p=max(s.top_p, F32_TINY), stop_token_ids=list(s.stop_token_ids), stop=list(s.stop),
                                    ignore_eos=s.ignore_eos)
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def layout_to_proto(layout: KVLayout) -> common_pb2.BlockLayout:
    return common_pb2.BlockLayout(**asdict(layout))


def layout_to_dict(layout: KVLayout) -> dict:
    return asdict(layout)


def layout_from_dict(d: dict) -> KVLayout:
    return KVLayout(**d)
