"""Which engines may hand KV to each other: equal layouts, or layouts that differ in the dtype alone through the
cast converter the receiver names; an instance whose engine KV cannot be converted is never paired and gets no
pool credit. Pure functions and records, no process."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from kvmesh.contracts.engine import ImportedKV, KVPart
from kvmesh.contracts.layout import KVLayout, converter
from kvmesh.contracts.messages import Heartbeat, InstanceLoad
from kvmesh.engines.convert import cast, convert_import
from kvmesh.routing.plan import InstanceView, can_hand_off
from kvmesh.routing.policies import CacheAware, Candidate

FP32 = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="fp32")
BF16 = replace(FP32, dtype="bf16")


def instance(iid: str, layout: KVLayout | None, accepts: tuple[str, ...] = (), unconvertible: str = "") -> InstanceView:
    return InstanceView(iid, "decode", kv_layout=layout, kv_accepts=accepts, kv_unconvertible=unconvertible)


def beat(layout: KVLayout, accepts: tuple[str, ...] = (), unconvertible: str = "") -> Heartbeat:
    return Heartbeat(instance_id="d", role="decode", grpc_address="127.0.0.1:1", transfer_address="", ts=time.time(),
                     load=InstanceLoad(), model="m", block_size=4, kv_layout=layout, kv_accepts=accepts,
                     kv_unconvertible=unconvertible)


def test_converter_is_none_needed_a_cast_or_nothing():
    assert converter(FP32, FP32) == ""
    assert converter(BF16, FP32) == "cast bf16->fp32"
    assert converter(FP32, replace(FP32, block_size=8)) is None
    assert converter(FP32, replace(BF16, num_kv_heads=1)) is None


def test_equal_layouts_pair():
    assert can_hand_off(instance("p", FP32), instance("d", FP32))


def test_a_dtype_pairs_only_with_a_decode_that_names_its_converter():
    assert not can_hand_off(instance("p", BF16), instance("d", FP32))
    assert can_hand_off(instance("p", BF16), instance("d", FP32, accepts=("bf16",)))
    assert not can_hand_off(instance("p", replace(BF16, block_size=8)), instance("d", FP32, accepts=("bf16",)))


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_instance_whose_kv_cannot_be_converted_is_never_paired(side: str):
    why = "CPU attention's 'amx' kernel packs its pages its own way"
    p = instance("p", FP32, unconvertible=why if side == "prefill" else "")
    d = instance("d", FP32, unconvertible=why if side == "decode" else "")
    assert not can_hand_off(p, d)


def test_the_cost_model_counts_no_pool_hit_for_an_instance_that_cannot_load_one():
    policy = CacheAware()
    able, unable = Candidate("a"), Candidate("b", pool=False)
    assert policy.estimate(able, 1024, 16, pool_blocks=60) < policy.estimate(unable, 1024, 16, pool_blocks=60)
    assert policy.estimate(unable, 1024, 16, pool_blocks=60) == policy.estimate(unable, 1024, 16, pool_blocks=0)


def test_the_heartbeat_carries_the_converters_and_why_kv_cannot_be_converted():
    back = Heartbeat.decode(beat(FP32, accepts=("bf16", "fp8"), unconvertible="MLA").encode())
    assert (back.kv_accepts, back.kv_unconvertible) == (("bf16", "fp8"), "MLA")
    plain = Heartbeat.decode(beat(FP32).encode())
    assert (plain.kv_accepts, plain.kv_unconvertible) == ((), "")


def test_a_push_in_a_named_dtype_is_cast_part_by_part_into_the_engines_layout():
    values = torch.randn(3, *BF16.block_shape).to(torch.bfloat16)
    first = memoryview(bytearray(values[:2].contiguous().view(torch.uint8).numpy().tobytes()))
    rest = memoryview(bytearray(values[2:].contiguous().view(torch.uint8).numpy().tobytes()))
    kv = ImportedKV(BF16, 12, 7, 0, (KVPart(0, 2, None, first), KVPart(2, 1, None, rest)))
    got = convert_import(kv, FP32)
    assert got.layout == FP32 and (got.num_tokens, got.first_token) == (12, 7)
    flat = torch.cat([torch.frombuffer(bytearray(p.data), dtype=torch.float32) for p in got.parts])
    assert torch.equal(flat.view(3, *FP32.block_shape), values.float())


def test_a_push_no_converter_relates_is_refused():
    kv = ImportedKV(replace(FP32, block_size=8), 8, 1, 0, ())
    with pytest.raises(ValueError, match="no converter"):
        convert_import(kv, FP32)


def test_a_cast_into_fp8_saturates_instead_of_making_nan():
    big = torch.tensor([1e6, -1e6, 0.5], dtype=torch.float32)
    out = torch.frombuffer(bytearray(cast(big.numpy().data, "fp32", "fp8")), dtype=torch.uint8)
    back = out.view(torch.float8_e4m3fn).float()
    assert back.tolist() == [448.0, -448.0, 0.5]
