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


@pytest.mark.parametrize("dtype", ["fp32", "fp8"])
def test_layer_slices_read_out_and_written_back_rebuild_whole_blocks(dtype):
    """A block read out layer group by layer group (as prefill pushes it during the forward pass) and written
    back group by group into another pool is the block, bit for bit; each slice is that range of the block."""
    layout = KVLayout("t", 5, 2, 4, 4, dtype)
    src = DeviceKVPool(layout, 16)
    ids = [3, 4, 5, 11, 0]
    src.write_blocks(ids, torch.randn(len(ids), *layout.block_shape).clamp(-4, 4))
    whole = src.read_blocks(ids)
    dst = DeviceKVPool(layout, 16)
    for lo, hi in [(0, 2), (2, 3), (3, 5)]:
        part = src.read_blocks(ids, (lo, hi))
        assert part.shape == (len(ids), hi - lo, *layout.block_shape[1:])
        assert part.view(torch.uint8).equal(whole[:, lo:hi].view(torch.uint8))
        received = blocks_from_bytes(layout, bytearray(block_bytes(part)), (lo, hi))  # as decode views it
        assert len(block_bytes(part)) == len(ids) * layout.layers_nbytes((lo, hi))
        dst.write_blocks([9, 10, 1, 2, 14], received, (lo, hi))
    assert dst.read_blocks([9, 10, 1, 2, 14]).view(torch.uint8).equal(whole.view(torch.uint8))


def test_writing_a_layer_slice_leaves_the_other_layers_alone():
    layout = KVLayout("t", 3, 1, 2, 2)
    pool = DeviceKVPool(layout, 4)
    pool.write_blocks([1], torch.ones(1, 1, *layout.block_shape[1:]), (1, 2))
    assert pool.k[1, 1].eq(1).all() and pool.v[1, 1].eq(1).all()
    assert pool.k[0].eq(0).all() and pool.k[2].eq(0).all() and pool.k[1, [0, 2, 3]].eq(0).all()
