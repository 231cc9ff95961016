"""The layout descriptor (a contract) and its one codec; the engine's torch view of the same bytes."""

import json
from dataclasses import replace

import pytest
import torch
from kvmesh.contracts.layout import DTYPE_ITEMSIZE, KVLayout, layout_mismatch
from kvmesh.engine.kv_cache import STORAGE_DTYPES, block_bytes, blocks_from_bytes

LAYOUT = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bf16")


def test_dict_json_and_proto_forms_give_back_the_same_layout() -> None:
    assert KVLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
    assert KVLayout.from_json(LAYOUT.to_json()) == LAYOUT
    assert KVLayout.from_proto(LAYOUT.to_proto()) == LAYOUT


def test_json_form_is_canonical_so_it_can_name_a_layout() -> None:
    raw = LAYOUT.to_json()
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.pop("tp_size"), "layout fields"),
    (lambda d: d.update(rope="yarn"), "layout fields"),
    (lambda d: d.update(num_layers="2"), "num_layers"),
    (lambda d: d.update(num_layers=True), "integers and strings"),
    (lambda d: d.update(dtype="int3"), "unknown KV dtype 'int3'"),
    (lambda d: d.update(head_dim=0), "layout.head_dim must be >= 1"),
    (lambda d: d.update(tp_rank=1), "tp_rank"),
])
def test_a_bad_layout_document_is_refused_saying_why(change, message) -> None:
    doc = LAYOUT.to_dict()
    change(doc)
    with pytest.raises((TypeError, ValueError), match=message):
        KVLayout.from_dict(doc)


def test_equal_byte_counts_are_still_a_mismatch() -> None:
    other = replace(LAYOUT, dtype="fp16")
    assert other.block_nbytes == LAYOUT.block_nbytes
    assert layout_mismatch(LAYOUT, other) == "dtype 'fp16'!='bf16'"
    assert layout_mismatch(LAYOUT, LAYOUT) is None


def test_every_storage_dtype_name_has_the_item_size_of_its_torch_dtype() -> None:
    assert set(DTYPE_ITEMSIZE) == set(STORAGE_DTYPES)
    assert {name: t.itemsize for name, t in STORAGE_DTYPES.items()} == DTYPE_ITEMSIZE


def test_block_bytes_of_fp8_blocks_are_a_view_not_a_copy() -> None:
    t = torch.zeros(4, dtype=torch.float8_e4m3fn)
    view = block_bytes(t)
    view[0] = 0x38  # 1.0 in e4m3
    assert t[0].item() == 1.0


def test_received_bytes_become_blocks_of_the_layout_without_a_copy() -> None:
    sent = torch.randn((3, *LAYOUT.block_shape)).to(torch.bfloat16)
    data = bytearray(block_bytes(sent))
    got = blocks_from_bytes(LAYOUT, data)
    assert got.dtype == torch.bfloat16 and got.shape == sent.shape and torch.equal(got, sent)
    data[:2] = b"\0\0"
    assert got.view(-1)[0].item() == 0
