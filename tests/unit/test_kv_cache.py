"""The device pool's block copies: read_blocks / write_blocks are inverses for any order of block ids."""

import pytest
import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.kv_cache import DeviceKVPool, _runs, block_bytes, blocks_from_bytes


def test_runs_split_on_gaps_and_descending_ids():
    assert _runs([3, 4, 5, 9, 8, 10]) == [(0, 3, 3), (3, 9, 1), (4, 8, 1), (5, 10, 1)]
    assert _runs([]) == []


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_write_then_read_roundtrips_any_block_order(dtype):
    layout = KVLayout("t", 3, 2, 4, 4, dtype)
    pool = DeviceKVPool(layout, 16)
    src = torch.randn(5, *layout.block_shape).clamp(-4, 4)
    data = blocks_from_bytes(layout, bytearray(block_bytes(src.to(pool.dtype))))  # a view of received bytes
    ids = [7, 8, 2, 15, 14]
    pool.write_blocks(ids, data)
    back = pool.read_blocks(ids)
    assert back.view(torch.uint8).equal(data.view(torch.uint8))
    assert pool.read_blocks([2]).view(torch.uint8).equal(data[2:3].view(torch.uint8))
    # layer-major pool: block 8's layer-1 V is data[1, 1, 1]
    assert pool.v[1, 8].view(torch.uint8).equal(data[1, 1, 1].view(torch.uint8))
